"""The reference evaluator: runs a fusion with eager PyTorch on one device.

It is the ground truth every other path (generated kernels, multi-device
execution) is compared with, so it favours clarity over speed.

Numerics, defined once here:

- every op computes in its *compute type* (``dtypes.compute_dtype``: float32
  for bf16/f16 outputs, float64 for float64, the integer type for integers)
  and rounds once to its output dtype, so each tensor of the fusion holds
  values exactly representable in its dtype; Python scalars enter in the
  compute type too (``x_bf16 + 0.1`` adds float32 0.1, as a generated kernel
  does; eager torch on CPU would round 0.1 to bf16 first);
- matmul and linear on bf16/f16 multiply exactly and accumulate in float32,
  as cuBLAS does;
- fp4 values are held unpacked (one code per uint8) between ops and packed
  (``torch.float4_e2m1fn_x2``, low nibble first) at the fusion's boundary;
  fp4 conversions are those of ``fusion.fp4``, fp8 conversions those of
  ``fusion.fp8`` (torch's rounding, with a fixed overflow rule and one rounding);
- an ATen op captured without a translation (``TorchOp``) is the op itself, in its
  operands' dtypes, as eager PyTorch runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fusion.binding import bind_inputs, resolve
from fusion.dtypes import (
    DataType,
    compute_dtype,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float32,
)
from fusion.exprs import (
    AttentionGradOp,
    AttentionOp,
    BinaryOp,
    BroadcastOp,
    CastOp,
    CompareOp,
    ConcatOp,
    DetachOp,
    DropoutMaskOp,
    EmbeddingGradOp,
    EmbeddingOp,
    ExpandOp,
    Expr,
    IotaOp,
    LinearOp,
    MatmulOp,
    PadOp,
    PermuteOp,
    ReductionOp,
    ReshapeOp,
    SelectOp,
    SetOp,
    SliceOp,
    TorchOp,
    UnaryOp,
    VarMeanOp,
    WhereOp,
)
from fusion.fp4 import decode_fp4, encode_fp4
from fusion.fp8 import to_fp8
from fusion.ir import Fusion, Scalar, TensorView
from fusion.random import dropout_mask
from fusion.storage import to_logical, to_storage
from fusion.torch_ops import run_torch_op

Values = dict[TensorView, torch.Tensor]
# The concrete logical shape of a tensor where it is evaluated (per rank, it is the local shape).
ShapeOf = Callable[[TensorView], list[int]]


def evaluate(fusion: Fusion, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``fusion`` on ``inputs`` and return its outputs (fresh tensors, inputs untouched)."""
    bindings = bind_inputs(fusion, inputs)
    values: Values = {
        tv: to_logical(tv.dtype, value) for tv, value in zip(fusion.inputs, inputs, strict=True)
    }

    def shape_of(tensor: TensorView) -> list[int]:
        return [resolve(extent, bindings) for extent in tensor.shape]

    device = inputs[0].device if len(inputs) else torch.device("cpu")
    for expr in fusion.live_exprs():
        if expr.inputs:
            evaluate_expr(expr, values, shape_of)
        else:  # an op without operands (an iota) makes its value where the inputs are
            with device:
                evaluate_expr(expr, values, shape_of)
    input_storages = {value.untyped_storage().data_ptr() for value in inputs}
    outputs = []
    for tv in fusion.outputs:
        result = to_storage(tv.dtype, values[tv])
        if result.untyped_storage().data_ptr() in input_storages:
            result = result.clone()
        outputs.append(result)
    return outputs


def evaluate_expr(expr: Expr, values: Values, shape_of: ShapeOf) -> None:
    """Compute ``expr``'s outputs from ``values`` (which must hold its inputs) into ``values``.

    ``shape_of`` gives the concrete shape of a tensor where it is evaluated; an expr
    class without its own evaluator is evaluated as its nearest base class.
    """
    expr_evaluator(expr)(values, shape_of)


def expr_evaluator(expr: Expr) -> Callable[[Values, ShapeOf], None]:
    """``evaluate(values, shape_of)``: ``evaluate_expr(expr, values, shape_of)`` with
    ``expr``'s evaluator found once, for a caller that evaluates it again and again."""
    evaluator = next(_EVALUATORS[cls] for cls in type(expr).__mro__ if cls in _EVALUATORS)
    outputs = expr.outputs

    def evaluate(values: Values, shape_of: ShapeOf) -> None:
        results = evaluator(expr, values, shape_of)
        if isinstance(results, torch.Tensor):
            results = (results,)
        for tv, result in zip(outputs, results, strict=True):
            values[tv] = result

    return evaluate


# ---------------------------------------------------------------------------
# One evaluator per expr class


def _in_compute(value: torch.Tensor, dtype: DataType) -> torch.Tensor:
    return value.to(compute_dtype(dtype).torch_dtype)


def _operand_value(operand: TensorView | Scalar, values: Values, dtype: DataType) -> torch.Tensor:
    """A tensor or scalar operand converted to ``dtype``'s compute type."""
    ctype = compute_dtype(dtype).torch_dtype
    if isinstance(operand, TensorView):
        return values[operand].to(ctype)
    return torch.tensor(operand, dtype=ctype)


_UNARY: dict[str, Callable[..., torch.Tensor]] = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "erf": torch.erf,
}

_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "pow": torch.pow,
}


def _unary(expr: UnaryOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    out = expr.output
    x = _operand_value(expr.operands[0], values, out.dtype)
    return _UNARY[expr.op_name](x, **expr.attrs).to(out.dtype.torch_dtype)


def _binary(expr: BinaryOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    out = expr.output
    lhs, rhs = (_operand_value(o, values, out.dtype) for o in expr.operands)
    return _BINARY[expr.op_name](lhs, rhs).to(out.dtype.torch_dtype)


_COMPARE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
}


def _compare(expr: CompareOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    # both operands rounded to the type they are compared in (a bf16 tensor against 0.1
    # compares with bf16's 0.1, as torch does), then compared exactly
    dtype = expr.compared_in.torch_dtype
    lhs, rhs = (
        values[o].to(dtype) if isinstance(o, TensorView) else torch.tensor(o, dtype=dtype)
        for o in expr.operands
    )
    return _COMPARE[expr.op_name](lhs, rhs)


def _where(expr: WhereOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    cond, x, y = expr.operands
    out = expr.output
    return torch.where(
        values[cond], _operand_value(x, values, out.dtype), _operand_value(y, values, out.dtype)
    ).to(out.dtype.torch_dtype)


def _cast(expr: CastOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    source, target = expr.inputs[0].dtype, expr.output.dtype
    value = values[expr.inputs[0]]
    if source is target:
        return value.clone()
    if source is float4_e2m1:
        value = decode_fp4(value, float32.torch_dtype)
    if target is float4_e2m1:
        return encode_fp4(value)
    if target in (float8_e4m3fn, float8_e5m2):
        return to_fp8(value, target.torch_dtype)
    return value.to(target.torch_dtype)


def _set(expr: SetOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return values[expr.inputs[0]].clone()


def _broadcast(expr: BroadcastOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    value = values[expr.inputs[0]]
    for dim, flag in enumerate(expr.is_broadcast_dim):
        if flag:
            value = value.unsqueeze(dim)
    return value


def _expand(expr: ExpandOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return values[expr.inputs[0]].expand(shape_of(expr.output))


def _reshape(expr: ReshapeOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return values[expr.inputs[0]].reshape(shape_of(expr.output))


def _permute(expr: PermuteOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return values[expr.inputs[0]].permute(expr.dims)


def _slice(expr: SliceOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    source = expr.inputs[0]
    index = []
    for axis, start, stop, step in zip(
        source.logical_axes, expr.starts, expr.stops, expr.steps, strict=True
    ):
        whole = start == 0 and step == 1 and stop == axis.extent
        index.append(slice(None) if whole else slice(start, stop, step))
    return values[source][tuple(index)]


def _pad(expr: PadOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    # F.pad takes (before, after) pairs from the last axis to the first
    pads = [amount for d in reversed(range(len(expr.before)))
            for amount in (expr.before[d], expr.after[d])]  # fmt: skip
    return F.pad(values[expr.inputs[0]], pads)


def _select(expr: SelectOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return values[expr.inputs[0]].select(expr.dim, expr.index)


def _reduction(expr: ReductionOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    out = expr.output
    x = values[expr.inputs[0]].to(compute_dtype(out.dtype).torch_dtype)
    if not expr.dims:  # a reduction over no axes (a 0-dim input) is the identity
        return x.to(out.dtype.torch_dtype)
    if expr.op_name == "sum":
        result = torch.sum(x, dim=expr.dims)
    elif expr.op_name == "mean":
        result = torch.mean(x, dim=expr.dims)
    elif expr.op_name == "max":
        result = torch.amax(x, dim=expr.dims)
    else:
        result = torch.amin(x, dim=expr.dims)
    return result.to(out.dtype.torch_dtype)


def _var_mean(expr: VarMeanOp, values: Values, shape_of: ShapeOf) -> tuple[torch.Tensor, ...]:
    var, mean = expr.outputs
    x = values[expr.inputs[0]].to(compute_dtype(var.dtype).torch_dtype)
    result = torch.var_mean(x, dim=expr.dims, correction=expr.correction)
    return tuple(r.to(var.dtype.torch_dtype) for r in result)


def _matmul(expr: MatmulOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    out = expr.output
    a, b = (_operand_value(t, values, out.dtype) for t in expr.inputs)
    return torch.matmul(a, b).to(out.dtype.torch_dtype)


def _linear(expr: LinearOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    out = expr.output
    tensors = [_operand_value(t, values, out.dtype) for t in expr.inputs]
    return F.linear(*tensors).to(out.dtype.torch_dtype)


def _cat(expr: ConcatOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    return torch.cat([values[t] for t in expr.inputs], expr.dim)


def _iota(expr: IotaOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    (extent,) = shape_of(expr.output)
    return torch.arange(extent, dtype=expr.output.dtype.torch_dtype)


def _dropout_mask(expr: DropoutMaskOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    # the whole mask; a rank's piece is drawn from its own global indices by the executor
    return dropout_mask(values[expr.inputs[0]], shape_of(expr.output), expr.p)


def _embedding(expr: EmbeddingOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    table, indices, rows = (values[t] for t in expr.inputs)
    return embedding_rows(table, indices, rows, expr.count, expr.padding_idx)


def embedding_rows(
    table: torch.Tensor,
    indices: torch.Tensor,
    rows: torch.Tensor,
    count: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """The lookup of ``indices`` in the piece ``table`` of a ``count``-row table whose rows
    are numbered ``rows`` (consecutive, as an iota's piece): zeros for the rows it does
    not hold. An index outside the whole table fails (on CUDA, asynchronously). The whole
    table's lookup is torch's, ``padding_idx`` given (autograd through it skips that row)."""
    indices = indices.to(torch.int64)
    torch._assert_async(((indices >= 0) & (indices < count)).all(),
                        f"embedding: an index is outside the table's {count} rows")  # fmt: skip
    if table.shape[0] == count:  # the whole table
        return F.embedding(indices, table, padding_idx)
    held = table.shape[0]
    if not held:
        return table.new_zeros([*indices.shape, table.shape[1]])
    local = indices - rows[0]
    inside = (local >= 0) & (local < held)
    looked_up = F.embedding(torch.where(inside, local, 0), table)
    return looked_up * inside.unsqueeze(-1).to(table.dtype)


def _embedding_grad(expr: EmbeddingGradOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    grad, indices, rows = (values[t] for t in expr.inputs)
    return embedding_rows_grad(grad, indices, rows, expr.padding_idx)


def embedding_rows_grad(
    grad: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, padding_idx: int | None
) -> torch.Tensor:
    """Per row of ``rows``, the sum of ``grad`` where ``indices`` is that row (summed in
    float32 at least, rounded once); ``padding_idx``'s row gets none."""
    held, features = rows.shape[0], grad.shape[-1]
    accumulate = compute_dtype(DataType.from_torch(grad.dtype)).torch_dtype
    total = torch.zeros(held, features, dtype=accumulate, device=grad.device)
    if held:
        indices = indices.reshape(-1).to(torch.int64)
        local = indices - rows[0]
        keep = (local >= 0) & (local < held)
        if padding_idx is not None:
            keep &= indices != padding_idx
        flat = grad.reshape(-1, features).to(accumulate)
        flat = torch.where(keep.unsqueeze(-1), flat, 0.0)
        # every token added, the others as zeros at rows spread by remainder (one row
        # would take every atomic add): selecting the kept ones would size a tensor by
        # the data, a host sync that a CUDA graph's capture refuses
        total.index_add_(0, local.remainder(held), flat)
    return total.to(grad.dtype)


def attention_value(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """torch's scaled dot-product attention (its kernels, in the operands' dtype). Three
    axes get a leading one: torch's fused kernels (flash, memory-efficient) take four,
    and a [heads, tokens, dim] attention would fall back to its unfused math."""
    if q.dim() == 3:
        mask = mask.unsqueeze(0) if mask is not None else None
        out = attention_value(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, causal,
                              scale)  # fmt: skip
        return out.squeeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale)  # fmt: skip


def attention_grads(grad, q, k, v, mask, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """The gradients of ``attention_value``'s q, k and v from its output's ``grad``
    (torch's attention backward, after its forward again)."""
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attention_value(*leaves, mask, causal, scale)
        return torch.autograd.grad(out, leaves, grad)


def _attention_operands(expr: Expr, values: Values, first: int) -> list[torch.Tensor | None]:
    """q, k, v (and mask) in their compute type (float32 for 16-bit floats)."""
    tensors = [values[t] for t in expr.inputs[first:]]
    ctype = compute_dtype(expr.inputs[first].dtype).torch_dtype
    converted = [t.to(ctype) if t.is_floating_point() else t for t in tensors]
    return converted + [None] * (4 - len(converted))


def _attention(expr: AttentionOp, values: Values, shape_of: ShapeOf) -> torch.Tensor:
    q, k, v, mask = _attention_operands(expr, values, 0)
    out = attention_value(q, k, v, mask, expr.causal, expr.scale)
    return out.to(expr.output.dtype.torch_dtype)


def _attention_grad(expr: AttentionGradOp, values: Values, shape_of: ShapeOf):
    q, k, v, mask = _attention_operands(expr, values, 1)
    grad = values[expr.inputs[0]].to(q.dtype)
    grads = attention_grads(grad, q, k, v, mask, expr.causal, expr.scale)
    return tuple(g.to(out.dtype.torch_dtype) for g, out in zip(grads, expr.outputs, strict=True))


def _torch_op(expr: TorchOp, values: Values, shape_of: ShapeOf) -> tuple[torch.Tensor, ...]:
    # the op itself, in its operands' dtypes: what the module computes in eager PyTorch
    return tuple(run_torch_op(expr, [values[t] for t in expr.inputs]))


_EVALUATORS: dict[type[Expr], Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]] = {
    IotaOp: _iota,
    DropoutMaskOp: _dropout_mask,
    ConcatOp: _cat,
    EmbeddingOp: _embedding,
    EmbeddingGradOp: _embedding_grad,
    AttentionOp: _attention,
    AttentionGradOp: _attention_grad,
    TorchOp: _torch_op,
    UnaryOp: _unary,
    BinaryOp: _binary,
    CompareOp: _compare,
    WhereOp: _where,
    CastOp: _cast,
    SetOp: _set,
    DetachOp: _set,
    BroadcastOp: _broadcast,
    ExpandOp: _expand,
    ReshapeOp: _reshape,
    PermuteOp: _permute,
    SliceOp: _slice,
    PadOp: _pad,
    SelectOp: _select,
    ReductionOp: _reduction,
    VarMeanOp: _var_mean,
    MatmulOp: _matmul,
    LinearOp: _linear,
}
