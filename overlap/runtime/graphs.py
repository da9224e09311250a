"""CUDA-graph replay of a rank program: captured once per key, replayed after.

A key is what every rank computes alike (the program's extents and every rank's input
buffers, learnt in the input check), so that every rank captures at the same run: NCCL
requires a captured collective to be captured on every rank of its group. A capture
runs the program once to warm up (communication handles, allocations), then once under
``torch.cuda.graph`` with garbage collection off (freeing an unreachable executor's
symmetric memory during a capture would be a CUDA call the capture forbids). At most
``MOST_GRAPHS`` graphs are kept: inputs that keep moving drop the oldest.

A replay's outputs are the graph's own buffers, overwritten by the next replay: their
autograd version is bumped at each replay, so a backward that saved them before refuses
to read the new values.

Example::

    graphs = GraphReplays()
    outputs = graphs.replay(key, rank_program, local_inputs)
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Sequence

import torch

from overlap.runtime.rank_program import RankProgram

MOST_GRAPHS = 8


class GraphReplays:
    """The graphs one executor captured, by key, oldest first."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple] = {}

    def replay(
        self, key: Hashable, program: RankProgram, local_inputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Run ``program`` by replaying its graph for ``key`` (captured now if new, which
        must then happen on every rank at this run)."""
        if key not in self._graphs:
            self._graphs[key] = _capture(program, local_inputs)
            if len(self._graphs) > MOST_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        graph, outputs, owned = self._graphs[key]
        graph.replay()
        torch.autograd.graph.increment_version(owned)
        return list(outputs)


def _capture(program: RankProgram, local_inputs: Sequence[torch.Tensor | None]) -> tuple:
    """``(graph, outputs, owned)``: ``owned`` the outputs in the graph's own buffers (an
    input passed through is the caller's)."""
    program.run(local_inputs, None)  # warm up: handles, allocations
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            outputs = program.run(local_inputs, None)
    finally:
        gc.enable()
    owned = [o for o in outputs if o is not None and all(o is not i for i in local_inputs)]
    return graph, outputs, owned
