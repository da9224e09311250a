"""A pass over the placed fusion that keeps a widened copy of an input out of memory.

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
"""

from __future__ import annotations

from fusion import ops
from fusion.exprs import (
    CastOp,
    Expr,
    LinearOp,
    MatmulOp,
    ReductionOp,
    UnaryOp,
    VarMeanOp,
)
from fusion.ir import Fusion
from sharding.communication import Communication
from sharding.layout import apply_layout, layout_of

MAX_CHAIN = 4


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
            if barrier and expr.output in later.inputs and not ends_a_kernel(later):
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
        if source.is_input or ends_a_kernel(source.definition):
            first = chain[0]
            widening = isinstance(first, CastOp) and first.output.dtype.bits > source.dtype.bits
            return chain if widening else None
        expr = source.definition
    return None


def ends_a_kernel(expr: Expr | None) -> bool:
    """Whether ``expr`` ends a kernel: a matmul or a communication writes its result out."""
    return isinstance(expr, (MatmulOp, LinearOp, Communication))


def _kernel_boundary(expr: Expr) -> bool:
    """An expr a generated pointwise kernel does not run: a matmul, a communication or a
    reduction (the reduction schedulers take those)."""
    return ends_a_kernel(expr) or isinstance(expr, (ReductionOp, VarMeanOp))


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
