"""Which exprs run together in one chunk loop: the runs lowering makes loops of.

Consecutive stream-parallel exprs over the same axis (same extent, same number of
chunks) and of the same planned pattern share one loop; any other expr between them
ends the loop. A stream-parallel expr that reads nothing computed since the last loop of
its kind is moved up into that loop first (the up projection next to the gate
projection, both fed by one gathered chunk; a backward's reduce-scatter next to its
matmul).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fusion.exprs import Expr
from overlap.compile.apply_plan import StreamAxes
from overlap.plan.planner import OverlapPlan


@dataclass
class Run:
    """Consecutive exprs lowered together: in one chunk loop (``looped``), or whole."""

    exprs: list[Expr]
    looped: bool


def loop_keys(plan: OverlapPlan, streams: StreamAxes) -> Callable[[Expr], tuple | None]:
    """Which loop an expr may share (None: it runs whole): its stream axis's extent and
    chunk count, and the planned pattern it belongs to (two patterns never share a loop:
    their chunks may go in different orders)."""
    owners: dict[Expr, int] = {}
    for position, decision in enumerate(plan):
        if decision.overlapped:
            members = [decision.communication, decision.contraction]
            for expr in (*members, *(expr for expr, _ in decision.chunked)):
                owners[expr] = position

    def key(expr: Expr) -> tuple | None:
        out = expr.outputs[0]
        dim = streams.dim(out)
        if dim is None:
            return None
        return (out.logical_axes[dim].extent, streams.chunks(out), owners.get(expr))

    return key


def _pulled_into_loops(exprs: list[Expr], loop_key: Callable[[Expr], tuple | None]) -> list[Expr]:
    """``exprs`` with each stream-parallel expr moved up to just after the last expr of
    its loop key, when none of the exprs it would pass computes its inputs (they cannot
    read its outputs: they came first). A reduce-scatter placed late (a backward's,
    after the weight gradients computed beside it) joins the loop of its matmul."""
    order: list[Expr] = []
    for expr in exprs:
        key = loop_key(expr)
        if key is not None:
            last = next(
                (i for i in range(len(order) - 1, -1, -1) if loop_key(order[i]) == key),
                None,
            )
            if last is not None and last < len(order) - 1:
                passed = {t for e in order[last + 1 :] for t in e.outputs}
                if not passed.intersection(expr.inputs):
                    order.insert(last + 1, expr)
                    continue
        order.append(expr)
    return order


def runs(exprs: list[Expr], loop_key: Callable[[Expr], tuple | None]) -> list[Run]:
    """``exprs`` (in program order, stream-parallel ones pulled into their loops) cut into
    runs: each loop's exprs, and the whole exprs between loops."""
    runs: list[Run] = []
    for expr in _pulled_into_loops(exprs, loop_key):
        key = loop_key(expr)
        looped = key is not None
        if (
            runs
            and runs[-1].looped == looped
            and (not looped or loop_key(runs[-1].exprs[-1]) == key)
        ):
            runs[-1].exprs.append(expr)
        else:
            runs.append(Run([expr], looped))
    return runs
