"""The scheduler registry: which scheduler takes which exprs, tried in priority order.

``split_into_kernels`` cuts a run of compute exprs into kernels: from each position it
takes the longest run that some scheduler accepts (normalization, reduction, then
pointwise); an expr no scheduler takes is evaluated by the reference evaluator, and the
reason is kept so the host program can say why.

A local shard (``shard_locally``: each rank keeps its own piece of a replicated tensor)
never goes into a kernel: its piece starts at a rank-dependent offset, which kernels,
specialized on local shapes alone, do not know. The executor takes it as a view.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.exprs import Expr
from fusion.ir import Fusion, TensorView
from schedulers.analysis import NotSchedulable
from schedulers.base import Scheduler
from schedulers.normalization import NormalizationScheduler
from schedulers.pointwise import PointwiseScheduler
from schedulers.reduction import ReductionScheduler
from sharding.communication import LocalShard

SCHEDULERS: tuple[Scheduler, ...] = (
    NormalizationScheduler(),
    ReductionScheduler(),
    PointwiseScheduler(),
)


@dataclass
class KernelGroup:
    """Exprs that become one kernel: a scheduler's, or the reference evaluator's."""

    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    scheduler: Scheduler | None
    plan: object | None
    reason: str = ""  # why no scheduler took it


def _first_taker(exprs: list[Expr], fusion: Fusion) -> tuple[Scheduler, object] | str:
    """The first scheduler that takes ``exprs`` and its plan, or why none does."""
    if any(isinstance(expr, LocalShard) for expr in exprs):
        return "shard_locally: its piece starts at a rank-dependent offset (taken as a view)"
    inputs, outputs = fusion.boundary(exprs)
    reasons = []
    for scheduler in SCHEDULERS:
        try:
            return scheduler, scheduler.plan(exprs, inputs, outputs)
        except NotSchedulable as reason:
            reasons.append(f"{scheduler.name}: {reason}")
    return "; ".join(reasons)


def _longest_taken(
    exprs: list[Expr], start: int, fusion: Fusion
) -> tuple[int, tuple[Scheduler, object] | str]:
    """The end of the longest run from ``start`` that a scheduler takes, and what
    ``_first_taker`` says of it; for none, ``start + 1`` and why its expr is not taken."""
    for end in range(len(exprs), start, -1):
        taken = _first_taker(exprs[start:end], fusion)
        if not isinstance(taken, str):
            return end, taken
    return start + 1, taken


def split_into_kernels(exprs: list[Expr], fusion: Fusion) -> list[KernelGroup]:
    """Kernels for ``exprs`` (no matmul among them), in order."""
    runs: list[tuple[list[Expr], tuple[Scheduler, object] | str]] = []
    start = 0
    while start < len(exprs):
        end, taken = _longest_taken(exprs, start, fusion)
        if isinstance(taken, str) and runs and isinstance(runs[-1][1], str):
            runs[-1][0].append(exprs[start])  # reference exprs in a row: one group
        else:
            runs.append((exprs[start:end], taken))
        start = end
    groups = []
    for run, taken in runs:
        inputs, outputs = fusion.boundary(run)
        if isinstance(taken, str):
            groups.append(KernelGroup(run, inputs, outputs, None, None, taken))
        else:
            scheduler, plan = taken
            groups.append(KernelGroup(run, inputs, outputs, scheduler, plan))
    return groups
