"""Applying an overlap plan: which tensors run chunk by chunk, on which axis, in how many
chunks (``StreamAxes``), decided once and read by lowering.

Three sources, in this order, none written onto the IR:

1. the user's ``Stream`` marks on the fusion (``axis.stream(chunks)``, or
   ``parallelize(ParallelType.Stream)`` with no count: ``DEFAULT_CHUNKS``);
2. the plan's pipelines (``overlap.plan.planner``): the contraction's output rows, the
   rows of the other matmuls of the loop, and the communication's output along the axis
   it gathers or scatters, in the chosen chunk count;
3. communications next to a stream-parallel expr join its loop: one whose input comes
   chunk by chunk, or whose output a stream-parallel expr reads along its stream axis,
   gets that axis too.

Example::

    streams = stream_axes(fusion, plan)
    print(streams)  # T5: axis 0 in 4 chunks (allgather+matmul), ...
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from fusion.ir import Fusion, TensorView
from overlap.ir import stream_dim
from overlap.plan.cost_model import Pattern
from overlap.plan.planner import OverlapPlan
from sharding.communication import Communication
from sharding.layout import Shard
from sharding.rules import dim_map

# chunks of an axis the user marked Stream without a count
DEFAULT_CHUNKS = 2


@dataclass(frozen=True)
class StreamAxis:
    """A tensor's axis that runs chunk by chunk: which, in how many chunks, and why."""

    dim: int
    chunks: int
    source: str  # "marked", a pattern of the plan, or "joins T5's loop"

    def __str__(self) -> str:
        return f"axis {self.dim} in {self.chunks} chunks ({self.source})"


class StreamAxes:
    """Every tensor of a fusion that runs chunk by chunk, with its ``StreamAxis``; a
    frozen value (built by ``stream_axes``)."""

    def __init__(self, axes: dict[TensorView, StreamAxis]) -> None:
        self._axes = MappingProxyType(dict(axes))

    def dim(self, tensor: TensorView) -> int | None:
        """The axis of ``tensor`` cut into chunks, None if it runs whole."""
        axis = self._axes.get(tensor)
        return None if axis is None else axis.dim

    def chunks(self, tensor: TensorView) -> int:
        """How many chunks ``tensor``'s stream axis is cut into."""
        return self._axes[tensor].chunks

    def __str__(self) -> str:
        if not self._axes:
            return "no stream axes: every expr runs whole"
        return "\n".join(f"{tensor.name}: {axis}" for tensor, axis in self._axes.items())


def stream_axes(fusion: Fusion, plan: OverlapPlan | None = None) -> StreamAxes:
    """The stream axes of ``fusion`` (placed, or on one device): its own marks, the
    pipelines ``plan`` chose, and the communications that join their loops."""
    axes: dict[TensorView, StreamAxis] = {}

    def mark(tensor: TensorView, dim: int, chunks: int, source: str) -> None:
        held = axes.get(tensor)
        if held is not None and held.dim != dim:
            raise ValueError(
                f"{tensor} would run chunk by chunk along axis {held.dim} ({held.source}) "
                f"and axis {dim} ({source}); at most one stream axis is supported"
            )
        axes[tensor] = StreamAxis(dim, chunks, source)

    for tensor in fusion.tensors:
        dim = stream_dim(tensor)
        if dim is not None:
            chunks = tensor.logical_axes[dim].stream_chunks or DEFAULT_CHUNKS
            mark(tensor, dim, chunks, "marked")
    for decision in plan or ():
        if not decision.overlapped:
            continue
        chunks, pattern = decision.chosen.num_chunks, str(decision.pattern)
        mark(decision.contraction.outputs[0], decision.row, chunks, pattern)
        for expr, row in decision.chunked:
            mark(expr.outputs[0], row, chunks, pattern)
        comm = decision.communication
        gathered = decision.pattern is Pattern.ALLGATHER_MATMUL
        mark(comm.output, comm.in_dim if gathered else comm.out_dim, chunks, pattern)
    for expr in fusion.live_exprs():
        if isinstance(expr, Communication) and expr.output not in axes:
            joined = _joined_loop(expr, axes)
            if joined is not None:
                mark(expr.output, *joined)
    return StreamAxes(axes)


def _joined_loop(
    comm: Communication, axes: dict[TensorView, StreamAxis]
) -> tuple[int, int, str] | None:
    """``(dim, chunks, source)`` of the loop ``comm`` joins: its input's (the
    reduce-scatter of a pipelined linear), or a stream-parallel reader's along the axis
    it reads chunk by chunk (an all-gather feeding a pipelined linear); None if none."""
    (source,) = comm.inputs
    held = axes.get(source)
    if source.definition is not None and held is not None and held.dim < comm.output.ndim:
        return held.dim, held.chunks, f"joins {source.name}'s loop"
    for consumer in comm.output.uses:
        out = consumer.outputs[0]
        reader = axes.get(out)
        if reader is None:
            continue
        needs = dim_map(consumer, 1).backward(Shard(reader.dim))
        wanted = needs[consumer.inputs.index(comm.output)] if needs else None
        if isinstance(wanted, Shard):
            return wanted.dim, reader.chunks, f"joins {out.name}'s loop"
    return None
