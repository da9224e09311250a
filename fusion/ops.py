"""Ops users build fusions with: ``fd.ops.exp(x)``, ``fd.ops.sum(x, dims=[1])``, ...

Each op checks its operands when it is added (rank, shape, dtype, indices)
and raises ``DefinitionError`` naming the op, the tensors and the mismatch.
Elementwise ops need operands of equal rank; an axis of static extent 1
broadcasts against any extent. Two different symbolic extents (or a symbol and
an int) that must agree are recorded as a constraint and checked when the
fusion runs.

Dtype rules follow torch's promotion. Low-precision floats compute in float32
and round once to their output type (see ``fusion.reference``). fp8 and fp4
are storage types: only ``cast``, ``set`` and data movement (broadcast, expand,
reshape, permute, slice, select) accept them.
"""

from __future__ import annotations

import builtins
import itertools
import math
from collections import Counter
from collections.abc import Sequence

import torch

from fusion.dtypes import (
    DataType,
    as_dtype,
    bool_,
    float32,
    int64,
    promote_types,
    promote_with_scalar,
)
from fusion.errors import DefinitionError
from fusion.exprs import (
    BINARY_OPS,
    FLOAT_UNARY_OPS,
    BinaryOp,
    BroadcastOp,
    CastOp,
    CompareOp,
    ExpandOp,
    LinearOp,
    MatmulOp,
    PadOp,
    PermuteOp,
    ReductionOp,
    ReshapeOp,
    SelectOp,
    SetOp,
    SliceOp,
    UnaryOp,
    VarMeanOp,
    WhereOp,
)
from fusion.ir import Axis, Extent, ExtentConstraint, Fusion, IterType, Scalar, Symbol, TensorView

__all__ = [
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "relu",
    "gelu", "silu", "erf", "add", "sub", "mul", "div", "maximum", "minimum", "pow", "eq", "ne",
    "lt", "le", "gt", "ge", "where", "cast", "set", "broadcast", "expand", "broadcast_in_dim",
    "reshape", "permute", "slice", "select", "pad", "sum", "max", "min", "mean", "var_mean",
    "matmul", "linear", "iota", "detach", "dropout_mask", "cat", "embedding", "embedding_grad",
    "attention", "attention_grad",
]  # fmt: skip

# This module defines ops named like builtins (sum, max, min, abs, set, slice, pow);
# helpers reach the builtins through ``builtins``.


# ---------------------------------------------------------------------------
# Checks shared by the ops


def _fusion_of(op_name: str, operands: Sequence[object]) -> Fusion:
    """The fusion the tensor operands belong to; it must be open for definition."""
    tensors = [o for o in operands if isinstance(o, TensorView)]
    if not tensors:
        raise DefinitionError(f"{op_name}: needs at least one tensor operand")
    fusion = tensors[0].fusion
    for tensor in tensors[1:]:
        if tensor.fusion is not fusion:
            raise DefinitionError(
                f"{op_name}: {tensor} and {tensors[0]} come from different fusions; the "
                "operands of an op must come from the same FusionDefinition"
            )
    if fusion.finalized:
        raise DefinitionError(
            f"{op_name}: the fusion definition has ended; add ops inside "
            "`with FusionDefinition() as fd:`"
        )
    return fusion


def _tensor(op_name: str, role: str, value: object) -> TensorView:
    if not isinstance(value, TensorView):
        raise DefinitionError(f"{op_name}: {role} must be a TensorView, got {type(value).__name__}")
    return value


def _operand(op_name: str, role: str, value: object) -> TensorView | Scalar:
    if isinstance(value, (TensorView, bool, int, float)):
        return value
    raise DefinitionError(
        f"{op_name}: {role} must be a TensorView or a Python bool/int/float, "
        f"got {type(value).__name__}"
    )


def _require_compute_type(op_name: str, tensor: TensorView) -> None:
    if tensor.dtype.storage_only:
        raise DefinitionError(
            f"{op_name}: {tensor} is {tensor.dtype}, a storage type without arithmetic; "
            "cast it to a compute type (float32, bfloat16, ...) first"
        )


def _require_float(op_name: str, tensor: TensorView) -> None:
    _require_compute_type(op_name, tensor)
    if not tensor.dtype.is_floating:
        raise DefinitionError(
            f"{op_name}: {tensor} is {tensor.dtype}; {op_name} needs a floating-point tensor"
        )


def _normalize_dim(op_name: str, tensor: TensorView, dim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise DefinitionError(f"{op_name}: dim must be an int, got {dim!r}")
    if not -tensor.ndim <= dim < tensor.ndim:
        raise DefinitionError(
            f"{op_name}: dim {dim} is out of range for {tensor} of rank {tensor.ndim}"
        )
    return dim % tensor.ndim


def _normalize_dims(
    op_name: str, tensor: TensorView, dims: int | Sequence[int] | None
) -> list[int]:
    if dims is None:
        return list(range(tensor.ndim))
    if isinstance(dims, int):
        dims = [dims]
    normalized = [_normalize_dim(op_name, tensor, d) for d in dims]
    if len(builtins.set(normalized)) != len(normalized):
        raise DefinitionError(f"{op_name}: dims {list(dims)} of {tensor} repeat an axis")
    return sorted(normalized)


def _as_extent(op_name: str, fusion: Fusion, value: object) -> Extent:
    if isinstance(value, str):
        return fusion.symbol(value)
    if isinstance(value, Symbol):
        return fusion.symbol(value.name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise DefinitionError(
        f"{op_name}: an extent must be a non-negative int or a symbol name, got {value!r}"
    )


def check_packing(
    op_name: str, dtype: DataType, axes: Sequence[Axis], sources: Sequence[TensorView] = ()
) -> None:
    """A packed dtype (fp4) needs an even innermost extent: two values share a byte."""
    if not dtype.is_packed:
        return
    logical = [axis for axis in axes if not axis.is_reduction]
    origin = f" (from {', '.join(str(t) for t in sources)})" if sources else ""
    per_byte = f"{dtype} packs {dtype.values_per_storage_element} values per byte"
    if not logical:
        raise DefinitionError(
            f"{op_name}: the {dtype} tensor{origin} would be 0-dim; {per_byte} along the "
            "innermost axis"
        )
    extent = logical[-1].extent
    if isinstance(extent, int) and extent % dtype.values_per_storage_element:
        shape = [axis.extent for axis in logical]
        raise DefinitionError(
            f"{op_name}: the {dtype} tensor of shape {shape}{origin} has an odd innermost "
            f"extent {extent}; {per_byte}"
        )


def _output(
    op_name: str,
    fusion: Fusion,
    dtype: DataType,
    axes: list[Axis],
    sources: Sequence[TensorView | Scalar] = (),
) -> TensorView:
    check_packing(op_name, dtype, axes, [t for t in sources if isinstance(t, TensorView)])
    return fusion.new_tensor(dtype, axes)


def _copy_axes(fusion: Fusion, axes: Sequence[Axis]) -> list[Axis]:
    """Fresh axes with the same extents and iteration types (reduction axes become iteration)."""
    return [
        fusion.new_axis(a.extent, IterType.BROADCAST if a.is_broadcast else IterType.ITERATION)
        for a in axes
    ]


def _unify_extent(op_name: str, fusion: Fusion, lhs: Extent, rhs: Extent, where: str) -> Extent:
    """The common extent of two axes that must agree; records a constraint if symbolic."""
    if lhs == rhs:
        return lhs
    if isinstance(lhs, int) and isinstance(rhs, int):
        raise DefinitionError(f"{op_name}: extent mismatch at {where}")
    fusion.constraints.append(ExtentConstraint(lhs, rhs, f"{op_name}: {where}"))
    return rhs if isinstance(rhs, int) else lhs


def _broadcast_extents(
    op_name: str, fusion: Fusion, columns: Sequence[Sequence[tuple[TensorView, Axis]]]
) -> list[Axis]:
    """Output axes of an elementwise op; ``columns[i]`` pairs each operand with its axis i."""
    axes = []
    for index, column in enumerate(columns):
        sized = [(t, a) for t, a in column if a.extent != 1]
        if not sized:
            axes.append(fusion.new_axis(1))
            continue
        first_tensor, first_axis = sized[0]
        extent = first_axis.extent
        for tensor, axis in sized[1:]:
            where = (
                f"axis {index}: {first_tensor} has {first_axis.extent}, {tensor} has {axis.extent}"
            )
            extent = _unify_extent(op_name, fusion, extent, axis.extent, where)
        axes.append(fusion.new_axis(extent))
    return axes


def _elementwise_axes(op_name: str, fusion: Fusion, tensors: Sequence[TensorView]) -> list[Axis]:
    ranks = {t.ndim for t in tensors}
    if len(ranks) > 1:
        described = ", ".join(f"{t} has rank {t.ndim}" for t in tensors)
        raise DefinitionError(
            f"{op_name}: operands must have the same rank ({described}); "
            "add axes with ops.broadcast first"
        )
    columns = [[(t, t.axis(i)) for t in tensors] for i in range(tensors[0].ndim)]
    return _broadcast_extents(op_name, fusion, columns)


def _result_dtype(op_name: str, operands: Sequence[TensorView | Scalar]) -> DataType:
    """torch's promotion over tensors, then scalars (which never widen a tensor's category).

    Refuses a promotion to a type the IR lacks (int8 with uint8 gives int16 in torch) and an
    integer scalar that does not fit the integer result type.
    """
    tensors = [o for o in operands if isinstance(o, TensorView)]
    scalars = [o for o in operands if not isinstance(o, TensorView)]
    for tensor in tensors:
        _require_compute_type(op_name, tensor)
    dtype = tensors[0].dtype
    try:
        for tensor in tensors[1:]:
            dtype = promote_types(dtype, tensor.dtype)
        for scalar in scalars:
            dtype = promote_with_scalar(dtype, scalar)
    except ValueError:
        described = ", ".join(_describe(o) for o in operands)
        raise DefinitionError(
            f"{op_name}: operands ({described}) promote to a type the IR does not have; "
            "cast them to a common type first"
        ) from None
    if dtype.is_integer:
        info = torch.iinfo(dtype.torch_dtype)
        for scalar in scalars:
            if not isinstance(scalar, bool) and not info.min <= scalar <= info.max:
                raise DefinitionError(
                    f"{op_name}: scalar {scalar!r} does not fit the result type {dtype} "
                    f"[{info.min}, {info.max}]"
                )
    return dtype


# ---------------------------------------------------------------------------
# Elementwise


def _unary(op_name: str, x: TensorView, **attrs: object) -> TensorView:
    x = _tensor(op_name, "input", x)
    fusion = _fusion_of(op_name, [x])
    _require_compute_type(op_name, x)
    if op_name in FLOAT_UNARY_OPS:
        dtype = x.dtype if x.dtype.is_floating else float32
    elif x.dtype is bool_:
        raise DefinitionError(f"{op_name}: {x} is bool; cast it to a numeric type first")
    else:
        dtype = x.dtype
    out = _output(op_name, fusion, dtype, _copy_axes(fusion, x.logical_axes))
    UnaryOp(op_name, x, out, **attrs)
    return out


def neg(x: TensorView) -> TensorView:
    """``-x``."""
    return _unary("neg", x)


def abs(x: TensorView) -> TensorView:  # noqa: A001 - mirrors torch.abs
    """``|x|``."""
    return _unary("abs", x)


def exp(x: TensorView) -> TensorView:
    """``e**x``; integer inputs compute in float32."""
    return _unary("exp", x)


def log(x: TensorView) -> TensorView:
    """Natural logarithm; integer inputs compute in float32."""
    return _unary("log", x)


def sqrt(x: TensorView) -> TensorView:
    """Square root; integer inputs compute in float32."""
    return _unary("sqrt", x)


def rsqrt(x: TensorView) -> TensorView:
    """``1 / sqrt(x)``; integer inputs compute in float32."""
    return _unary("rsqrt", x)


def reciprocal(x: TensorView) -> TensorView:
    """``1 / x``; integer inputs compute in float32."""
    return _unary("reciprocal", x)


def tanh(x: TensorView) -> TensorView:
    """Hyperbolic tangent; integer inputs compute in float32."""
    return _unary("tanh", x)


def sigmoid(x: TensorView) -> TensorView:
    """``1 / (1 + e**-x)``; integer inputs compute in float32."""
    return _unary("sigmoid", x)


def relu(x: TensorView) -> TensorView:
    """``max(x, 0)``."""
    return _unary("relu", x)


def erf(x: TensorView) -> TensorView:
    """The error function; integer inputs compute in float32."""
    return _unary("erf", x)


def gelu(x: TensorView, approximate: str = "none") -> TensorView:
    """GELU, exact (``approximate="none"``, with erf) or the ``"tanh"`` approximation."""
    if approximate not in ("none", "tanh"):
        raise DefinitionError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _unary("gelu", x, approximate=approximate)


def silu(x: TensorView) -> TensorView:
    """``x * sigmoid(x)``."""
    return _unary("silu", x)


def _binary(op_name: str, lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    assert op_name in BINARY_OPS
    lhs, rhs = _operand(op_name, "lhs", lhs), _operand(op_name, "rhs", rhs)
    fusion = _fusion_of(op_name, [lhs, rhs])
    dtype = _result_dtype(op_name, [lhs, rhs])
    if dtype is bool_:
        raise DefinitionError(
            f"{op_name}: arithmetic on bool operands ({_describe(lhs)}, {_describe(rhs)}); "
            "cast them to a numeric type first"
        )
    if op_name == "div" and not dtype.is_floating:
        dtype = float32  # true division, as torch does
    if op_name == "pow" and not dtype.is_floating and isinstance(rhs, int) and rhs < 0:
        raise DefinitionError(
            f"pow: {_describe(lhs)} ** {rhs}: an integer to a negative power is not an integer; "
            "cast the base to a floating-point type first"
        )
    tensors = [o for o in (lhs, rhs) if isinstance(o, TensorView)]
    out = _output(op_name, fusion, dtype, _elementwise_axes(op_name, fusion, tensors))
    BinaryOp(op_name, lhs, rhs, out)
    return out


def _describe(operand: TensorView | Scalar) -> str:
    return str(operand) if isinstance(operand, TensorView) else repr(operand)


def add(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs + rhs``."""
    return _binary("add", lhs, rhs)


def sub(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs - rhs``."""
    return _binary("sub", lhs, rhs)


def mul(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs * rhs``."""
    return _binary("mul", lhs, rhs)


def div(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs / rhs``, true division (integers give float32)."""
    return _binary("div", lhs, rhs)


def maximum(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """Elementwise maximum (NaN propagates)."""
    return _binary("maximum", lhs, rhs)


def minimum(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """Elementwise minimum (NaN propagates)."""
    return _binary("minimum", lhs, rhs)


def pow(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:  # noqa: A001
    """``lhs ** rhs``."""
    return _binary("pow", lhs, rhs)


def _compare(op_name: str, lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    lhs, rhs = _operand(op_name, "lhs", lhs), _operand(op_name, "rhs", rhs)
    fusion = _fusion_of(op_name, [lhs, rhs])
    # an integer scalar outside the tensor's type is refused: torch wraps it around (an
    # int8 against 300 compares with 44), which no one means
    compared_in = _result_dtype(op_name, [lhs, rhs])
    tensors = [o for o in (lhs, rhs) if isinstance(o, TensorView)]
    out = _output(op_name, fusion, bool_, _elementwise_axes(op_name, fusion, tensors))
    CompareOp(op_name, lhs, rhs, out, compared_in)
    return out


def eq(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs == rhs`` (bool), compared in the operands' promoted type; NaN equals nothing."""
    return _compare("eq", lhs, rhs)


def ne(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs != rhs`` (bool); NaN differs from everything, itself included."""
    return _compare("ne", lhs, rhs)


def lt(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs < rhs`` (bool); false where either is NaN."""
    return _compare("lt", lhs, rhs)


def le(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs <= rhs`` (bool); false where either is NaN."""
    return _compare("le", lhs, rhs)


def gt(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs > rhs`` (bool); false where either is NaN."""
    return _compare("gt", lhs, rhs)


def ge(lhs: TensorView | Scalar, rhs: TensorView | Scalar) -> TensorView:
    """``lhs >= rhs`` (bool); false where either is NaN."""
    return _compare("ge", lhs, rhs)


def where(cond: TensorView, x: TensorView | Scalar, y: TensorView | Scalar) -> TensorView:
    """``x`` where ``cond`` is true, else ``y``; ``cond`` must be bool."""
    cond = _tensor("where", "cond", cond)
    x, y = _operand("where", "x", x), _operand("where", "y", y)
    fusion = _fusion_of("where", [cond, x, y])
    if cond.dtype is not bool_:
        raise DefinitionError(f"where: cond {cond} is {cond.dtype}; it must be bool")
    values = [o for o in (x, y) if isinstance(o, TensorView)]
    if values:
        dtype = _result_dtype("where", [x, y])
    else:
        dtype = DataType.from_torch(torch.result_type(torch.tensor(x), y))
    out = _output("where", fusion, dtype, _elementwise_axes("where", fusion, [cond, *values]))
    WhereOp(cond, x, y, out)
    return out


def cast(x: TensorView, dtype: DataType | torch.dtype | str) -> TensorView:
    """``x`` converted to ``dtype``; every pair of types, fp8 and fp4 included.

    To fp4: round to nearest even, saturate to ±6, NaN to +6 (see ``fusion.fp4``).
    To fp8: round to nearest even once; e4m3fn saturates to ±448, e5m2 overflows to ±inf
    (see ``fusion.fp8``). Floats to integers truncate toward zero;
    NaN, infinities and out-of-range values give an unspecified integer, as in torch.
    """
    x = _tensor("cast", "input", x)
    fusion = _fusion_of("cast", [x])
    try:
        target = as_dtype(dtype)
    except ValueError as error:
        raise DefinitionError(f"cast: {error}") from None
    out = _output("cast", fusion, target, _copy_axes(fusion, x.logical_axes), [x])
    CastOp(x, out)
    return out


def set(x: TensorView) -> TensorView:  # noqa: A001 - the IR's name for a copy
    """A copy of ``x``."""
    x = _tensor("set", "input", x)
    fusion = _fusion_of("set", [x])
    out = _output("set", fusion, x.dtype, _copy_axes(fusion, x.logical_axes), [x])
    SetOp(x, out)
    return out


# ---------------------------------------------------------------------------
# Data movement


def broadcast(x: TensorView, is_broadcast_dim: Sequence[bool]) -> TensorView:
    """Insert an extent-1 axis wherever ``is_broadcast_dim`` is True.

    ``broadcast(x, [True, False])`` turns ``[N]`` into ``[1, N]``.
    """
    x = _tensor("broadcast", "input", x)
    fusion = _fusion_of("broadcast", [x])
    flags = [bool(f) for f in is_broadcast_dim]
    kept = flags.count(False)
    if kept != x.ndim:
        raise DefinitionError(
            f"broadcast: is_broadcast_dim {flags} keeps {kept} axes but {x} has rank {x.ndim}"
        )
    source = iter(x.logical_axes)
    axes = [fusion.new_axis(1) if flag else _copy_axes(fusion, [next(source)])[0] for flag in flags]
    out = _output("broadcast", fusion, x.dtype, axes, [x])
    BroadcastOp(x, out, flags)
    return out


def expand(x: TensorView, shape: Sequence[int | str | Symbol]) -> TensorView:
    """Expand extent-1 axes to ``shape`` without copying; -1 keeps an axis as it is."""
    x = _tensor("expand", "input", x)
    fusion = _fusion_of("expand", [x])
    if len(shape) != x.ndim:
        raise DefinitionError(
            f"expand: shape {list(shape)} has {len(shape)} entries but {x} has rank {x.ndim}"
        )
    extents: list[Extent] = []
    axes: list[Axis] = []
    for index, (axis, requested) in enumerate(zip(x.logical_axes, shape, strict=True)):
        if requested == -1:
            extents.append(axis.extent)
            axes.extend(_copy_axes(fusion, [axis]))
            continue
        extent = _as_extent("expand", fusion, requested)
        if axis.extent == 1 and extent != 1:
            axes.append(fusion.new_axis(extent, IterType.BROADCAST))
        elif axis.extent == extent:
            axes.extend(_copy_axes(fusion, [axis]))
        else:
            raise DefinitionError(
                f"expand: axis {index} of {x} has extent {axis.extent} and cannot expand to "
                f"{extent}; only extent-1 axes expand"
            )
        extents.append(extent)
    out = _output("expand", fusion, x.dtype, axes, [x])
    ExpandOp(x, out, extents)
    return out


def broadcast_in_dim(
    x: TensorView, shape: Sequence[int | str | Symbol], broadcast_dims: Sequence[int]
) -> TensorView:
    """Broadcast ``x`` to ``shape``; input axis i becomes output axis ``broadcast_dims[i]``."""
    x = _tensor("broadcast_in_dim", "input", x)
    if len(broadcast_dims) != x.ndim:
        raise DefinitionError(
            f"broadcast_in_dim: broadcast_dims {list(broadcast_dims)} must name one output "
            f"axis per axis of {x} (rank {x.ndim})"
        )
    increasing = all(a < b for a, b in itertools.pairwise(broadcast_dims))
    in_range = all(0 <= d < len(shape) for d in broadcast_dims)
    if not (increasing and in_range):
        raise DefinitionError(
            f"broadcast_in_dim: broadcast_dims {list(broadcast_dims)} must be strictly "
            f"increasing output axes in [0, {len(shape)})"
        )
    flags = [d not in broadcast_dims for d in range(len(shape))]
    expanded = broadcast(x, flags) if any(flags) else x
    return expand(expanded, list(shape))


def reshape(x: TensorView, shape: Sequence[int | str | Symbol]) -> TensorView:
    """``x`` viewed as ``shape`` (row-major); one entry may be -1.

    Symbolic extents must pass through unchanged: ``[batch, 8, 64] -> [batch, 512]`` works,
    splitting or merging a symbolic axis is refused.
    """
    x = _tensor("reshape", "input", x)
    fusion = _fusion_of("reshape", [x])
    requested = list(shape)
    if requested.count(-1) > 1:
        raise DefinitionError(f"reshape: at most one -1 in shape {requested}")
    out_extents: list[Extent | None] = [
        None if r == -1 else _as_extent("reshape", fusion, r) for r in requested
    ]
    in_ints = math.prod(e for e in x.shape if isinstance(e, int))
    in_syms = Counter(e for e in x.shape if isinstance(e, Symbol))
    out_ints = math.prod(e for e in out_extents if isinstance(e, int))
    out_syms = Counter(e for e in out_extents if isinstance(e, Symbol))
    mismatch = DefinitionError(
        f"reshape: {x} with shape {list(x.shape)} cannot become {requested}: "
        "the element counts differ (symbolic extents must pass through unchanged)"
    )
    if None in out_extents:
        remaining = in_syms - out_syms
        if out_syms - in_syms or out_ints == 0 or in_ints % out_ints:
            raise mismatch
        quotient = in_ints // out_ints
        if not remaining:
            inferred: Extent = quotient
        elif quotient == 1 and builtins.sum(remaining.values()) == 1:
            (inferred,) = remaining
        else:
            raise DefinitionError(
                f"reshape: cannot infer -1 in {requested} for {x}: it would merge symbolic "
                "extents with others"
            )
        out_extents[out_extents.index(None)] = inferred
    elif in_ints != out_ints or in_syms != out_syms:
        raise mismatch
    axes = [fusion.new_axis(e) for e in out_extents]
    out = _output("reshape", fusion, x.dtype, axes, [x])
    ReshapeOp(x, out, out_extents)
    return out


def permute(x: TensorView, dims: Sequence[int]) -> TensorView:
    """Reorder axes: output axis i is input axis ``dims[i]``."""
    x = _tensor("permute", "input", x)
    fusion = _fusion_of("permute", [x])
    if len(dims) != x.ndim:
        raise DefinitionError(f"permute: dims {list(dims)} must have {x.ndim} entries for {x}")
    normalized = [_normalize_dim("permute", x, d) for d in dims]
    if sorted(normalized) != list(range(x.ndim)):
        raise DefinitionError(f"permute: dims {list(dims)} is not a permutation of {x}'s axes")
    out = _output(
        "permute", fusion, x.dtype, _copy_axes(fusion, [x.axis(d) for d in normalized]), [x]
    )
    PermuteOp(x, out, normalized)
    return out


def slice(  # noqa: A001 - the IR's name
    x: TensorView,
    starts: Sequence[int],
    stops: Sequence[int | None],
    steps: Sequence[int] | None = None,
) -> TensorView:
    """``x[starts[0]:stops[0]:steps[0], ...]``; one entry per axis, None stop means the end.

    Bounds are not clamped: an index outside ``[-extent, extent]`` is an error. A symbolic
    axis can only be taken whole.
    """
    x = _tensor("slice", "input", x)
    fusion = _fusion_of("slice", [x])
    steps = [1] * x.ndim if steps is None else list(steps)
    if not len(starts) == len(stops) == len(steps) == x.ndim:
        raise DefinitionError(
            f"slice: starts, stops and steps need {x.ndim} entries each for {x}, got "
            f"{len(starts)}, {len(stops)}, {len(steps)}"
        )
    norm_starts: list[int] = []
    norm_stops: list[Extent] = []
    axes: list[Axis] = []
    for index, (axis, start, stop, step) in enumerate(
        zip(x.logical_axes, starts, stops, steps, strict=True)
    ):
        if not isinstance(step, int) or step < 1:
            raise DefinitionError(f"slice: step {step!r} of axis {index} must be a positive int")
        extent = axis.extent
        if isinstance(extent, Symbol):
            if start != 0 or stop not in (None, extent) or step != 1:
                raise DefinitionError(
                    f"slice: axis {index} of {x} has symbolic extent {extent}; only the whole "
                    "axis can be taken (start 0, stop None, step 1)"
                )
            norm_starts.append(0)
            norm_stops.append(extent)
            axes.extend(_copy_axes(fusion, [axis]))
            continue
        bounds = []
        for bound_name, bound in (("start", start), ("stop", extent if stop is None else stop)):
            if not isinstance(bound, int) or not -extent <= bound <= extent:
                raise DefinitionError(
                    f"slice: {bound_name} {bound!r} is out of range for axis {index} of {x} "
                    f"(extent {extent})"
                )
            bounds.append(bound % extent if bound < 0 else bound)
        begin, end = bounds
        if end < begin:
            raise DefinitionError(
                f"slice: stop {stop} comes before start {start} on axis {index} of {x}"
            )
        norm_starts.append(begin)
        norm_stops.append(end)
        axes.append(fusion.new_axis(-(-(end - begin) // step)))
    out = _output("slice", fusion, x.dtype, axes, [x])
    SliceOp(x, out, norm_starts, norm_stops, steps)
    return out


def pad(x: TensorView, before: Sequence[int], after: Sequence[int]) -> TensorView:
    """``x`` with ``before[d]`` zeros ahead of it and ``after[d]`` zeros behind it along
    each axis ``d`` (non-negative ints; a padded axis must have a static extent)."""
    x = _tensor("pad", "input", x)
    fusion = _fusion_of("pad", [x])
    _require_compute_type("pad", x)
    if not len(before) == len(after) == x.ndim:
        raise DefinitionError(
            f"pad: before and after need {x.ndim} entries each for {x}, got "
            f"{len(before)}, {len(after)}"
        )
    axes: list[Axis] = []
    for index, (axis, ahead, behind) in enumerate(zip(x.logical_axes, before, after, strict=True)):
        for amount in (ahead, behind):
            if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
                raise DefinitionError(f"pad: {amount!r} on axis {index} must be an int >= 0")
        if ahead == behind == 0:
            axes.extend(_copy_axes(fusion, [axis]))
        elif isinstance(axis.extent, Symbol):
            raise DefinitionError(
                f"pad: axis {index} of {x} has symbolic extent {axis.extent}; only axes of "
                "static extent can be padded"
            )
        else:
            axes.append(fusion.new_axis(ahead + axis.extent + behind))
    out = _output("pad", fusion, x.dtype, axes, [x])
    PadOp(x, out, before, after)
    return out


def select(x: TensorView, dim: int, index: int) -> TensorView:
    """``x`` at ``index`` along axis ``dim``; that axis is removed."""
    x = _tensor("select", "input", x)
    fusion = _fusion_of("select", [x])
    dim = _normalize_dim("select", x, dim)
    extent = x.axis(dim).extent
    if not isinstance(index, int) or isinstance(index, bool):
        raise DefinitionError(f"select: index must be an int, got {index!r}")
    if isinstance(extent, int):
        if not -extent <= index < extent:
            raise DefinitionError(
                f"select: index {index} is out of range for axis {dim} of {x} (extent {extent})"
            )
        index %= extent
    elif index < 0:
        raise DefinitionError(
            f"select: axis {dim} of {x} has symbolic extent {extent}; use a non-negative index"
        )
    else:
        fusion.constraints.append(
            ExtentConstraint(extent, index, f"select: index {index} of axis {dim} of {x}", ">")
        )
    kept = [a for i, a in enumerate(x.logical_axes) if i != dim]
    out = _output("select", fusion, x.dtype, _copy_axes(fusion, kept), [x])
    SelectOp(x, out, dim, index)
    return out


# ---------------------------------------------------------------------------
# Reductions


def _reduction_axes(fusion: Fusion, x: TensorView, dims: Sequence[int]) -> list[Axis]:
    return [
        fusion.new_axis(a.extent, IterType.REDUCTION) if i in dims else _copy_axes(fusion, [a])[0]
        for i, a in enumerate(x.logical_axes)
    ]


def _keepdim(out: TensorView, dims: Sequence[int], keepdim: bool) -> TensorView:
    if not keepdim:
        return out
    rank = out.ndim + len(dims)
    return broadcast(out, [i in dims for i in range(rank)])


def _reduce(
    op_name: str, x: TensorView, dims: int | Sequence[int] | None, keepdim: bool
) -> TensorView:
    x = _tensor(op_name, "input", x)
    fusion = _fusion_of(op_name, [x])
    _require_compute_type(op_name, x)
    dims = _normalize_dims(op_name, x, dims)
    if op_name == "mean":
        _require_float(op_name, x)
    if op_name in ("max", "min"):
        empty = [d for d in dims if x.axis(d).extent == 0]
        if empty:
            raise DefinitionError(
                f"{op_name}: axis {empty[0]} of {x} has extent 0 and {op_name} has no identity"
            )
    dtype = x.dtype
    if op_name == "sum" and not dtype.is_floating:
        dtype = int64  # as torch: integer and bool sums accumulate in int64
    out = _output(op_name, fusion, dtype, _reduction_axes(fusion, x, dims))
    ReductionOp(op_name, x, out, dims)
    return _keepdim(out, dims, keepdim)


def sum(  # noqa: A001 - mirrors torch.sum
    x: TensorView, dims: int | Sequence[int] | None = None, keepdim: bool = False
) -> TensorView:
    """Sum over ``dims`` (all axes when None). Integer and bool inputs sum to int64."""
    return _reduce("sum", x, dims, keepdim)


def max(  # noqa: A001 - mirrors torch.amax
    x: TensorView, dims: int | Sequence[int] | None = None, keepdim: bool = False
) -> TensorView:
    """Maximum over ``dims`` (NaN propagates)."""
    return _reduce("max", x, dims, keepdim)


def min(  # noqa: A001 - mirrors torch.amin
    x: TensorView, dims: int | Sequence[int] | None = None, keepdim: bool = False
) -> TensorView:
    """Minimum over ``dims`` (NaN propagates)."""
    return _reduce("min", x, dims, keepdim)


def mean(
    x: TensorView, dims: int | Sequence[int] | None = None, keepdim: bool = False
) -> TensorView:
    """Mean over ``dims``; floating-point inputs only."""
    return _reduce("mean", x, dims, keepdim)


def var_mean(
    x: TensorView,
    dims: int | Sequence[int] | None = None,
    correction: int = 1,
    keepdim: bool = False,
) -> tuple[TensorView, TensorView]:
    """``(variance, mean)`` over ``dims``; variance divides by ``count - correction``."""
    x = _tensor("var_mean", "input", x)
    fusion = _fusion_of("var_mean", [x])
    _require_float("var_mean", x)
    if not isinstance(correction, int) or correction < 0:
        raise DefinitionError(
            f"var_mean: correction must be a non-negative int, got {correction!r}"
        )
    dims = _normalize_dims("var_mean", x, dims)
    if not dims:
        raise DefinitionError(f"var_mean: needs at least one axis to reduce; {x} has none")
    var = _output("var_mean", fusion, x.dtype, _reduction_axes(fusion, x, dims))
    avg = _output("var_mean", fusion, x.dtype, _reduction_axes(fusion, x, dims))
    VarMeanOp(x, var, avg, dims, correction)
    return _keepdim(var, dims, keepdim), _keepdim(avg, dims, keepdim)


# ---------------------------------------------------------------------------
# Contractions


def _matmul_dtype(op_name: str, tensors: Sequence[TensorView]) -> DataType:
    for tensor in tensors:
        _require_float(op_name, tensor)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        described = ", ".join(f"{t.name} is {t.dtype}" for t in tensors)
        raise DefinitionError(
            f"{op_name}: operand dtypes differ ({described}); cast them to one type"
        )
    return tensors[0].dtype


def matmul(a: TensorView, b: TensorView) -> TensorView:
    """``a @ b`` for ``a: [..., M, K]``, ``b: [..., K, N]``; batch axes broadcast right-aligned."""
    a, b = _tensor("matmul", "a", a), _tensor("matmul", "b", b)
    fusion = _fusion_of("matmul", [a, b])
    for tensor in (a, b):
        if tensor.ndim < 2:
            raise DefinitionError(
                f"matmul: {tensor} has rank {tensor.ndim}; matmul needs rank >= 2 "
                "(add an axis with ops.broadcast)"
            )
    dtype = _matmul_dtype("matmul", [a, b])
    k = _unify_extent(
        "matmul",
        fusion,
        a.axis(-1).extent,
        b.axis(-2).extent,
        f"contraction: {a} has K={a.axis(-1).extent}, {b} has K={b.axis(-2).extent}",
    )
    batch_rank = builtins.max(a.ndim, b.ndim) - 2
    columns = []
    for index in range(batch_rank):
        column = []
        for tensor in (a, b):
            offset = index - (batch_rank - (tensor.ndim - 2))
            if offset >= 0:
                column.append((tensor, tensor.axis(offset)))
        columns.append(column)
    axes = _broadcast_extents("matmul", fusion, columns)
    axes += _copy_axes(fusion, [a.axis(-2), b.axis(-1)])
    axes.append(fusion.new_axis(k, IterType.REDUCTION))
    out = _output("matmul", fusion, dtype, axes)
    MatmulOp(a, b, out)
    return out


def linear(x: TensorView, weight: TensorView, bias: TensorView | None = None) -> TensorView:
    """``x @ weight.T + bias`` for ``x: [..., K]``, ``weight: [N, K]``, ``bias: [N]``."""
    x, weight = _tensor("linear", "x", x), _tensor("linear", "weight", weight)
    operands = [x, weight]
    if bias is not None:
        operands.append(_tensor("linear", "bias", bias))
    fusion = _fusion_of("linear", operands)
    if x.ndim < 1:
        raise DefinitionError(f"linear: x {x} must have rank >= 1")
    if weight.ndim != 2:
        raise DefinitionError(
            f"linear: weight {weight} must have rank 2 ([N, K]), not {weight.ndim}"
        )
    dtype = _matmul_dtype("linear", operands)
    k = _unify_extent(
        "linear",
        fusion,
        x.axis(-1).extent,
        weight.axis(1).extent,
        f"contraction: {x} has K={x.axis(-1).extent}, {weight} has K={weight.axis(1).extent}",
    )
    n = weight.axis(0).extent
    if bias is not None:
        if bias.ndim != 1:
            raise DefinitionError(f"linear: bias {bias} must have rank 1 ([N]), not {bias.ndim}")
        n = _unify_extent(
            "linear",
            fusion,
            n,
            bias.axis(0).extent,
            f"output features: {weight} has N={n}, {bias} has N={bias.axis(0).extent}",
        )
    axes = _copy_axes(fusion, x.logical_axes[:-1]) + [fusion.new_axis(n)]
    axes.append(fusion.new_axis(k, IterType.REDUCTION))
    out = _output("linear", fusion, dtype, axes)
    LinearOp(x, weight, bias, out)
    return out


# Ops of network blocks (an index, a stop-gradient, embeddings, attention): their own
# module, which builds on the helpers above.
from fusion.nn_ops import (  # noqa: E402
    attention,
    attention_grad,
    cat,
    detach,
    dropout_mask,
    embedding,
    embedding_grad,
    iota,
)
