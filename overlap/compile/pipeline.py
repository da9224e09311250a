"""``compile_program``: a fusion becomes the host program every rank runs.

The passes run from one visible list, ``PASSES``, each a function of its own module:

1. ``shard`` (``sharding.resharding.shard_fusion``): a placed copy of the fusion, every
   tensor laid out and the communications inserted (a fusion placed on no mesh is
   copied as it is);
2. ``plan overlap`` (``overlap.plan.planner.plan_overlap``): which communications to
   pipeline with their matmuls, how many chunks, by which transport, in which order:
   a typed ``OverlapPlan``, decided from the device's figures, changing nothing;
3. ``apply the plan`` (``overlap.compile.apply_plan.apply_overlap_plan``): the chosen rows
   become ``Stream`` axes;
4. ``lower`` (``overlap.compile.lowering.lower_to_host_program``): segments, kernels (generated
   by the schedulers, or the evaluator) and stream loops, the plan's transports and
   orders on the pipelined communications;
5. ``deallocate`` (``overlap.compile.deallocate.insert_deallocations``).

``compile.py`` lists the passes, wraps each to the state it reads and writes, and holds
the checks only the world size allows (a mesh larger than the world). Nothing here talks
to another rank, and nothing depends on which rank asks: the result,
a ``CompiledProgram``, is the same on every rank (``MultiDeviceExecutor`` specializes it
per rank). ``overlap dump`` prints it for a device the user names, without any process
group. Example::

    compiled = compile_program(fd, world_size=8, figures=NAMED_FIGURES["h200"],
                               dump=sys.stdout)  # the fusion or program after each pass
    print(compiled.host)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from fusion.definition import FusionDefinition
from fusion.ir import Fusion
from overlap.compile.apply_plan import apply_overlap_plan
from overlap.compile.deallocate import insert_deallocations
from overlap.compile.lowering import lower_to_host_program
from overlap.compile.recompute import drop_dead_exprs, gather_pointwise, recompute_widened_inputs
from overlap.ir import HostProgram
from overlap.plan.figures import CPU_FIGURES, HardwareFigures
from overlap.plan.planner import OverlapOptions, OverlapPlan, plan_overlap
from sharding.errors import ShardingError
from sharding.layout import is_placed
from sharding.pieces import check_packed_pieces
from sharding.propagation import explain
from sharding.resharding import shard_fusion


@dataclass
class CompiledProgram:
    """What compiling a fusion gives: the placed fusion, why each tensor is placed so
    (``decisions``), the overlap plan and the host program, for ``world_size`` ranks."""

    fusion: Fusion
    decisions: dict
    plan: OverlapPlan
    host: HostProgram
    world_size: int
    figures: HardwareFigures
    sharded: bool
    schedule: bool  # compute lowered to generated kernels where a scheduler takes it

    def explain(self) -> str:
        """Which rule placed each tensor (see ``sharding.explain``)."""
        if not self.sharded:
            return "no tensor is placed on a mesh: the fusion runs whole on one device"
        return explain(self.fusion, self.decisions)

    def explain_overlap(self) -> str:
        """The planner's choices, with reasons and predicted times."""
        return str(self.plan)

    def rank_programs(self) -> list[tuple[list[int], str]]:
        """The program as each rank sees it (the instructions on its meshes), with the
        ranks that see the same, each distinct program once."""
        seen: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.host.text_for_rank(rank), []).append(rank)
        return [(ranks, text) for text, ranks in seen.items()]


@dataclass
class _Compilation:
    """The state the passes read and write, in order."""

    fusion: Fusion
    world_size: int
    figures: HardwareFigures
    options: OverlapOptions
    schedule: bool
    replayed: bool
    sharded: bool = False
    decisions: dict = field(default_factory=dict)
    plan: OverlapPlan = field(default_factory=OverlapPlan)
    host: HostProgram | None = None


def _shard(state: _Compilation) -> None:
    state.sharded = is_placed(state.fusion)
    if not state.sharded:
        state.fusion = state.fusion.clone()
        return
    state.fusion, state.decisions = shard_fusion(state.fusion)
    for tensor in state.fusion.tensors:
        too_large = [r for r in tensor.mesh.ranks if r >= state.world_size]
        if too_large:
            raise ShardingError(
                f"{tensor} is placed on {tensor.mesh}, but the world has {state.world_size} "
                f"ranks (0..{state.world_size - 1}); rank {too_large[0]} does not exist"
            )
    check_packed_pieces(state.fusion, {}, ShardingError)


def _recompute(state: _Compilation) -> None:
    recompute_widened_inputs(state.fusion)


def _gather(state: _Compilation) -> None:
    gather_pointwise(state.fusion)
    drop_dead_exprs(state.fusion)


def _plan(state: _Compilation) -> None:
    state.plan = plan_overlap(state.fusion, state.figures, state.options, state.replayed)


def _apply(state: _Compilation) -> None:
    apply_overlap_plan(state.plan)


def _lower(state: _Compilation) -> None:
    state.host = lower_to_host_program(state.fusion, state.plan, state.schedule)


def _deallocate(state: _Compilation) -> None:
    insert_deallocations(state.host)


# The pipeline, in order: (name, pass). A pass reads and writes the compilation's state.
PASSES: tuple[tuple[str, Callable[[_Compilation], None]], ...] = (
    ("shard", _shard),
    ("recompute widened inputs", _recompute),
    ("gather pointwise work", _gather),
    ("plan overlap", _plan),
    ("apply the plan", _apply),
    ("lower", _lower),
    ("deallocate", _deallocate),
)


def compile_program(
    fusion: Fusion | FusionDefinition,
    world_size: int = 1,
    options: OverlapOptions | None = None,
    figures: HardwareFigures | None = None,
    *,
    schedule: bool = False,
    replayed: bool = False,
    dump: TextIO | None = None,
) -> CompiledProgram:
    """Run ``PASSES`` on ``fusion`` for a world of ``world_size`` ranks.

    ``figures`` describe the device the planner plans for (default: CPU processes);
    ``schedule``: compute becomes generated kernels where a scheduler takes it;
    ``replayed``: runs will replay a CUDA graph (the host's cost does not count);
    ``dump``: a stream that gets the fusion (or the program) after each pass.
    """
    fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
    if not fusion.finalized:
        raise ShardingError("finish the fusion definition (leave its `with` block) first")
    state = _Compilation(
        fusion, world_size, figures or CPU_FIGURES, options or OverlapOptions(), schedule, replayed
    )
    for name, run_pass in PASSES:
        run_pass(state)
        if dump is not None:
            shown = state.plan if name == "plan overlap" else state.host or state.fusion
            dump.write(f"=== after {name} ===\n{shown}\n\n")
    return CompiledProgram(
        state.fusion, state.decisions, state.plan, state.host, world_size, state.figures,
        state.sharded, schedule,
    )  # fmt: skip
