"""A pass over the placed fusion that moves pointwise work to the kernel computing its
inputs.

``gather_pointwise``: a pointwise expr the program order puts after a matmul or a
communication, though what it reads was computed before them (a backward casts a
gradient to bf16 only after the matmuls that read its sibling), moves up to just after
the last expr computing its inputs, where it joins that kernel: the wide value it reads
is then not written out and read back by a kernel of its own. It ends by dropping the
exprs no output depends on (``drop_dead_exprs``): a dead reader would make a kernel
write out a value nothing reads.
"""

from __future__ import annotations

from fusion.exprs import BinaryOp, CastOp, CompareOp, Expr, UnaryOp, WhereOp
from fusion.ir import Fusion
from overlap.compile.recompute import ends_a_kernel

_POINTWISE = (UnaryOp, BinaryOp, CastOp, CompareOp, WhereOp)


def gather_pointwise(fusion: Fusion) -> list[Expr]:
    """Move each pointwise expr that a matmul or communication separates from what it
    reads up to the kernel computing its inputs (see the module); returns those moved."""
    moved = []
    for expr in list(fusion.live_exprs()):
        if not isinstance(expr, _POINTWISE):
            continue
        order = fusion.exprs
        here = order.index(expr)
        producers = [order.index(t.definition) for t in expr.inputs if t.definition in order]
        if not producers:
            continue
        last = max(producers)
        anchor = order[last]
        between = order[last + 1 : here]
        if (
            isinstance(anchor, _POINTWISE)
            and anchor.outputs[0].mesh == expr.outputs[0].mesh
            and any(ends_a_kernel(e) for e in between)
        ):
            fusion.move_after([expr], anchor)
            moved.append(expr)
    return moved


def drop_dead_exprs(fusion: Fusion) -> int:
    """Remove the exprs no output depends on (a backward's replay of the forward's own
    outputs, a chain every use of which now has its copy): a kernel writes out what
    exprs outside it read, and a dead reader would keep a wide value in memory that
    nothing reads. Returns how many were removed."""
    live = set(fusion.live_exprs())
    dead = [expr for expr in fusion.exprs if expr not in live]
    for expr in reversed(dead):
        fusion.remove_expr(expr)
    return len(dead)
