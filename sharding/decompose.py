"""Rewrites that let ranks combine partial results instead of moving whole tensors.

Run after a first propagation (they read the layouts), each returns whether it changed
the fusion, whose layouts must then be propagated again (``shard_fusion``):

- ``decompose_partial_linear_bias``: a row-parallel ``linear(x, w, b)`` (its contraction
  axis split, whatever its output is placed) becomes ``linear(x, w) + b``: the product
  stays a partial sum, and the bias, whole on every rank, meets it as any replicated
  addend meets a partial sum: after the all-reduce or on the reduce-scattered piece,
  never before (it would count once per rank), and never by gathering the weight or
  the activation (which a linear with the bias inside must do to make its output whole);
- ``decompose_split_means``: a ``mean`` or ``var_mean`` over an axis split across ranks
  becomes sums, which each rank computes on its piece and the ranks combine (a small
  all-reduce of the result's size) instead of gathering the whole input: the mean as
  ``sum / count``, the variance in two passes (``sum((x - mean)^2) / (count -
  correction)``, numerically as stable as one device's). Low-precision inputs are summed
  in float32 and rounded once at the end, as torch does. Axes of symbolic extent are
  left as they are (their count is not known when the fusion is placed).
"""

from __future__ import annotations

import math

from fusion import ops
from fusion.exprs import Expr, LinearOp, ReductionOp, VarMeanOp
from fusion.ir import Fusion, TensorView
from sharding.layout import layout_of
from sharding.rules import mesh_rule


def decompose_partial_linear_bias(fusion: Fusion) -> bool:
    """Rewrite ``linear(x, w, b)`` as ``linear(x, w) + b`` where its output is partial or
    its inputs, as placed, make it partial (an output placed whole or split by the user,
    a row-parallel linear's ``Replicate()`` or ``Shard(0)``, is then the add's)."""
    changed = False
    for expr in list(fusion.exprs):
        if not (isinstance(expr, LinearOp) and expr.has_bias):
            continue
        out = expr.output
        layout = layout_of(out)
        if layout is None:
            continue
        natural = mesh_rule(expr, layout.mesh).forward([layout_of(t) for t in expr.inputs])
        if not (layout.is_partial or natural.is_partial):
            continue
        x, weight, bias = expr.inputs
        with fusion.editing():
            product = ops.linear(x, weight)
            row = ops.broadcast(bias, [True] * (out.ndim - 1) + [False])
            total = ops.add(product, row)
        _replace(fusion, expr, 3, [(total, out)])
        changed = True
    return changed


def decompose_split_means(fusion: Fusion) -> bool:
    """Rewrite each ``mean``/``var_mean`` over a split axis of static extent as sums."""
    changed = False
    for expr in list(fusion.exprs):
        is_mean = isinstance(expr, ReductionOp) and expr.op_name == "mean"
        if not (is_mean or isinstance(expr, VarMeanOp)):
            continue
        (x,) = expr.inputs
        layout = layout_of(x)
        if layout is None or all(layout.mesh_axis_of(d) is None for d in expr.dims):
            continue
        extents = [x.shape[d] for d in expr.dims]
        if not all(isinstance(e, int) for e in extents):
            continue
        count = math.prod(extents)
        before = len(fusion.exprs)
        with fusion.editing():
            wide = x if x.dtype.bits >= 32 else ops.cast(x, "float32")
            mean = ops.div(ops.sum(wide, expr.dims), float(count))
            if is_mean:
                results = [mean]
            else:
                flags = [d in expr.dims for d in range(x.ndim)]
                centered = ops.sub(wide, ops.broadcast(mean, flags))
                squares = ops.sum(ops.mul(centered, centered), expr.dims)
                results = [ops.div(squares, float(max(count - expr.correction, 0))), mean]
            results = [
                r if r.dtype == out.dtype else ops.cast(r, out.dtype.name)
                for r, out in zip(results, expr.outputs, strict=True)
            ]
        _replace(
            fusion, expr, len(fusion.exprs) - before, list(zip(results, expr.outputs, strict=True))
        )
        changed = True
    return changed


def _replace(fusion: Fusion, expr: Expr, added: int, results: list[tuple[TensorView, TensorView]]):
    """Put the ``added`` exprs just made where ``expr`` was, and make them define
    ``expr``'s outputs (``results``: each new tensor with the output it stands for; the
    new exprs that read it read the output instead)."""
    fusion.move_before(fusion.exprs[len(fusion.exprs) - added :], expr)
    fusion.remove_expr(expr)
    for new, old in results:
        for use in list(new.uses):
            fusion.replace_input(use, new, old)
        fusion.redirect_output(new.definition, new, old)
        fusion.tensors.remove(new)
