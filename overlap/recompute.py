"""Recomputing a widened input instead of keeping it: one pass over memory less.

A block that casts its bf16 input to float32 for a norm and adds the same float32 copy
back as the residual after its matmuls would keep that copy in memory between the two
kernels: written at 4 bytes an element, read back at 4, where the residual's kernel
could read the input again at 2 and widen it itself. This pass gives each later use of
such a cast (one in another kernel: a matmul or a communication lies between them, and
the use is pointwise work a generated kernel takes) its own cast, placed just before
it, so the cast runs inside the use's kernel. The widened copy is then no kernel's
output. Layouts are the original cast's.
"""

from __future__ import annotations

from fusion import ops
from fusion.exprs import CastOp, Expr, LinearOp, MatmulOp
from fusion.ir import Fusion
from sharding.communication import Communication
from sharding.layout import apply_layout, layout_of


def recompute_widened_inputs(fusion: Fusion) -> list[Expr]:
    """Give later uses of a widening cast of a fusion input their own cast (see the
    module); returns the casts added."""
    added = []
    exprs = fusion.live_exprs()
    for position, expr in enumerate(exprs):
        (source,) = expr.inputs if isinstance(expr, CastOp) else (None,)
        if source is None or not source.is_input or expr.output in fusion.outputs:
            continue
        if expr.output.dtype.bits <= source.dtype.bits:
            continue
        barrier = False
        for later in exprs[position + 1 :]:
            barrier |= _ends_a_kernel(later)
            if barrier and expr.output in later.inputs and not _ends_a_kernel(later):
                added.append(_own_cast(fusion, expr, later))
    return added


def _ends_a_kernel(expr: Expr) -> bool:
    return isinstance(expr, (MatmulOp, LinearOp, Communication))


def _own_cast(fusion: Fusion, cast: CastOp, use: Expr) -> Expr:
    """A copy of ``cast`` just before ``use``, which reads it instead."""
    widened = cast.output
    with fusion.editing():
        copy = ops.cast(cast.inputs[0], widened.dtype)
    if widened.mesh is not None:
        apply_layout(copy, layout_of(widened))
    fusion.move_before([copy.definition], use)
    fusion.replace_input(use, widened, copy)
    return copy.definition
