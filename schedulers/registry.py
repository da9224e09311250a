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
    """Kernels for ``exprs`` (no matmul among them), in order; where moving the exprs the
    reference evaluator runs up to the ones before them gives fewer kernels, in that
    order."""
    groups = _split(exprs, fusion)
    untaken = {id(expr) for group in groups if group.scheduler is None for expr in group.exprs}
    moved = _untaken_joined(exprs, untaken)
    if moved != exprs:
        fewer = _split(moved, fusion)
        if len(fewer) < len(groups):
            return fewer
    return groups


def _untaken_joined(exprs: list[Expr], untaken: set[int]) -> list[Expr]:
    """``exprs`` with each of ``untaken`` (ids of the exprs no scheduler took) moved up
    past the taken exprs before it that it does not read, where that brings it next to
    another untaken expr (or to the start): the reference evaluator's exprs gather into
    one launch and the taken ones around them into one kernel. A GroupNorm's backward:
    its bias gradient (a sum over the batch and spatial axes) sat between the weight's
    broadcast and the products that read it, a pointwise kernel on each side."""
    order: list[Expr] = []
    for expr in exprs:
        position = len(order)
        if id(expr) in untaken:
            reads = set(expr.inputs)
            while (position and id(order[position - 1]) not in untaken
                   and not reads & set(order[position - 1].outputs)):  # fmt: skip
                position -= 1
            if position and id(order[position - 1]) not in untaken:
                position = len(order)  # it reads the taken expr it reached: it stays
        order.insert(position, expr)
    return order


def _split(exprs: list[Expr], fusion: Fusion) -> list[KernelGroup]:
    """Kernels for ``exprs`` in their order: from each, the longest run taken."""
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
