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
from schedulers.normalization import NormalizationScheduler
from schedulers.pointwise import PointwiseScheduler
from schedulers.reduction import ReductionScheduler
from sharding.communication import LocalShard

SCHEDULERS = (NormalizationScheduler(), ReductionScheduler(), PointwiseScheduler())


@dataclass
class KernelGroup:
    """Exprs that become one kernel: a scheduler's, or the reference evaluator's."""

    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    scheduler: object | None
    plan: object | None
    reason: str = ""  # why no scheduler took it


def _first_taker(exprs: list[Expr], fusion: Fusion) -> tuple[object, object] | str:
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


def split_into_kernels(exprs: list[Expr], fusion: Fusion) -> list[KernelGroup]:
    """Kernels for ``exprs`` (no matmul among them), in order."""
    groups: list[KernelGroup] = []
    start = 0
    while start < len(exprs):
        for end in range(len(exprs), start, -1):
            taken = _first_taker(exprs[start:end], fusion)
            if not isinstance(taken, str):
                break
        if isinstance(taken, str):
            end = start + 1
            reason = _first_taker(exprs[start:end], fusion)
            if groups and groups[-1].scheduler is None:
                groups[-1].exprs.append(exprs[start])
            else:
                groups.append(KernelGroup([exprs[start]], [], [], None, None, reason))
        else:
            scheduler, plan = taken
            inputs, outputs = fusion.boundary(exprs[start:end])
            groups.append(KernelGroup(exprs[start:end], inputs, outputs, scheduler, plan))
        start = end
    for group in groups:
        if group.scheduler is None:
            group.inputs, group.outputs = fusion.boundary(group.exprs)
    return groups
