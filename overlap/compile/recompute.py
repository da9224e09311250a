"""Two passes over the placed fusion that keep intermediates out of memory.

``recompute_widened_inputs``: a block that casts its bf16 input to float32 for a norm
and adds the same float32 copy back as the residual after its matmuls would keep that
copy in memory between the two kernels: written at 4 bytes an element, read back at 4,
where the residual's kernel could read the input again at 2 and widen it itself. Each
later use of such a widened input (one in another kernel: a matmul or a communication
lies between them, and the use is pointwise work a generated kernel takes) gets its own
copy of the chain that made it, placed just before it, so it runs inside the use's
kernel. The chain is a widening cast of a fusion input and the unary ops after it (a
backward's ``silu(float32(gate))``, with gate saved in bf16, is read by the forward's
recompute and again by silu's gradient after the matmuls). The widened result is then
no kernel's output. Layouts are the original exprs'.

``gather_pointwise``: a pointwise expr the program order puts after a matmul or a
communication, though what it reads was computed before them (a backward casts a
gradient to bf16 only after the matmuls that read its sibling), moves up to just after
the last expr computing its inputs, where it joins that kernel: the wide value it reads
is then not written out and read back by a kernel of its own. It ends by dropping the
exprs no output depends on (``drop_dead_exprs``): a dead reader would make a kernel
write out a value nothing reads.
"""

from __future__ import annotations

from fusion import ops
from fusion.exprs import (
    BinaryOp,
    CastOp,
    CompareOp,
    Expr,
    LinearOp,
    MatmulOp,
    ReductionOp,
    UnaryOp,
    VarMeanOp,
    WhereOp,
)
from fusion.ir import Fusion
from sharding.communication import Communication
from sharding.layout import apply_layout, layout_of

MAX_CHAIN = 4
_POINTWISE = (UnaryOp, BinaryOp, CastOp, CompareOp, WhereOp)


def recompute_widened_inputs(fusion: Fusion) -> list[Expr]:
    """Give later uses of a widened fusion input their own chain (see the module);
    returns the exprs added."""
    added = []
    exprs = fusion.live_exprs()
    for position, expr in enumerate(exprs):
        chain = _widening_chain(expr)
        if chain is None or expr.output in fusion.outputs:
            continue
        barrier = False
        for later in exprs[position + 1 :]:
            barrier |= _kernel_boundary(later)
            if barrier and expr.output in later.inputs and not _ends_a_kernel(later):
                added += _own_chain(fusion, chain, later)
    return added


def _widening_chain(expr: Expr) -> list[Expr] | None:
    """The exprs from a value held in memory anyway (a fusion input, or what a matmul or
    a communication wrote) to ``expr``'s output, when they are a widening cast and unary
    ops after it."""
    chain: list[Expr] = []
    while isinstance(expr, (CastOp, UnaryOp)) and len(chain) < MAX_CHAIN:
        chain.insert(0, expr)
        (source,) = expr.inputs
        if source.is_input or _ends_a_kernel(source.definition):
            first = chain[0]
            widening = isinstance(first, CastOp) and first.output.dtype.bits > source.dtype.bits
            return chain if widening else None
        expr = source.definition
    return None


def _ends_a_kernel(expr: Expr | None) -> bool:
    return isinstance(expr, (MatmulOp, LinearOp, Communication))


def _kernel_boundary(expr: Expr) -> bool:
    """An expr a generated pointwise kernel does not run: a matmul, a communication or a
    reduction (the reduction schedulers take those)."""
    return _ends_a_kernel(expr) or isinstance(expr, (ReductionOp, VarMeanOp))


def _own_chain(fusion: Fusion, chain: list[Expr], use: Expr) -> list[Expr]:
    """A copy of ``chain`` just before ``use``, which reads its result instead."""
    value = chain[0].inputs[0]
    copies = []
    with fusion.editing():
        for expr in chain:
            if isinstance(expr, CastOp):
                value = ops.cast(value, expr.output.dtype)
            else:
                value = getattr(ops, expr.op_name)(value, **expr.attrs)
            if expr.output.mesh is not None:
                apply_layout(value, layout_of(expr.output))
            copies.append(value.definition)
    fusion.move_before(copies, use)
    fusion.replace_input(use, chain[-1].output, value)
    return copies


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
            and any(_ends_a_kernel(e) for e in between)
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
