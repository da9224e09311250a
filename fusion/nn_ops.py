"""Ops of neural-network blocks that are not elementwise, reductions or contractions:
an index (``iota``), dropout's mask (``dropout_mask``), a stop-gradient (``detach``), a
concatenation (``cat``), an embedding lookup and scaled dot-product attention, each with
its gradient's op. ``fusion.ops`` exports them all (``fd.ops.embedding(table, indices)``,
...). Layer, RMS and group normalization are compositions of ``fusion.ops`` (a variance
and mean or a mean of squares, ``rsqrt``, pointwise ops), not ops of their own: the
normalization scheduler fuses what it knows, ``fusion.autodiff`` differentiates op by op;
this module's ``layer_norm``, ``rms_norm`` and ``group_norm`` build them.

Split over ranks, each keeps the single-device meaning: an ``iota``'s piece holds its own
global indices, a dropout mask's piece draws its own elements' bits, an embedding over a
piece of the table's rows gives the rows that piece holds and zeros elsewhere (the
pieces' lookups sum to the whole one: a vocabulary-parallel embedding), attention splits
along its leading (batch, heads) axes.

Example::

    rows = fd.ops.iota(logits, logits.shape[-1])  # [0, 1, ..., vocab - 1]
    picked = fd.ops.where(fd.ops.eq(rows_2d, targets_2d), logits, 0.0)
    y = fd.ops.attention(q, k, v, causal=True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusion.dtypes import DataType, as_dtype, float32, int64, machine_epsilon
from fusion.errors import DefinitionError
from fusion.exprs import (
    AttentionGradOp,
    AttentionOp,
    ConcatOp,
    DetachOp,
    DropoutMaskOp,
    EmbeddingGradOp,
    EmbeddingOp,
    IotaOp,
)
from fusion.ir import Extent, Fusion, IterType, Symbol, TensorView
from fusion.ops import (
    _as_extent,
    _copy_axes,
    _fusion_of,
    _normalize_dim,
    _output,
    _require_compute_type,
    _require_float,
    _tensor,
    _unify_extent,
    add,
    broadcast,
    cast,
    mean,
    mul,
    reshape,
    rsqrt,
    sub,
    var_mean,
)


def iota(source: object, extent: Extent | str, dtype: DataType | str = int64) -> TensorView:
    """``[0, 1, ..., extent - 1]`` in ``dtype`` (an integer type), in the fusion of
    ``source`` (a tensor of it, the fusion, or its ``FusionDefinition``)."""
    fusion = _open_fusion("iota", source)
    dtype = as_dtype(dtype)
    if not dtype.is_integer:
        raise DefinitionError(f"iota: dtype must be an integer type, got {dtype}")
    out = _output("iota", fusion, dtype, [fusion.new_axis(_as_extent("iota", fusion, extent))])
    IotaOp(out)
    return out


def dropout_mask(seed: TensorView, shape: Sequence[int], p: float) -> TensorView:
    """Dropout's float32 mask of the static ``shape`` at drop probability ``p``, drawn
    from ``seed`` (a one-element int64 tensor) as ``fusion.random`` says: ``x * mask`` is
    ``x`` dropped. Each element's bit depends on the seed and the element's global index
    alone, so the mask is the same wherever it is computed (a rank's piece, a kernel,
    the backward)."""
    seed = _tensor("dropout_mask", "seed", seed)
    fusion = _fusion_of("dropout_mask", [seed])
    if seed.dtype is not int64 or any(extent != 1 for extent in seed.shape):
        raise DefinitionError(f"dropout_mask: the seed must be one int64 element, got {seed}")
    if not all(isinstance(extent, int) and extent >= 0 for extent in shape):
        raise DefinitionError(f"dropout_mask: the shape must be static, got {list(shape)}")
    if not 0 <= p <= 1:
        raise DefinitionError(f"dropout_mask: p must lie in [0, 1], got {p}")
    out = _output("dropout_mask", fusion, float32, [fusion.new_axis(e) for e in shape])
    DropoutMaskOp(seed, out, float(p))
    return out


def detach(x: TensorView) -> TensorView:
    """``x``'s value, through which no gradient flows (torch's ``detach``)."""
    x = _tensor("detach", "input", x)
    fusion = _fusion_of("detach", [x])
    out = _output("detach", fusion, x.dtype, _copy_axes(fusion, x.logical_axes), [x])
    DetachOp(x, out)
    return out


def cat(tensors: Sequence[TensorView], dim: int) -> TensorView:
    """``tensors`` joined along axis ``dim`` (torch's ``cat``): one dtype, one rank, equal
    extents on the other axes; the joined axis static."""
    tensors = [_tensor("cat", f"tensor {i}", t) for i, t in enumerate(tensors)]
    if not tensors:
        raise DefinitionError("cat: needs at least one tensor")
    fusion = _fusion_of("cat", tensors)
    first = tensors[0]
    dim = _normalize_dim("cat", first, dim)
    for tensor in tensors[1:]:
        if tensor.ndim != first.ndim or tensor.dtype != first.dtype:
            raise DefinitionError(f"cat: {tensor} and {first} differ in rank or dtype")
        for axis in range(first.ndim):
            if axis != dim:
                _unify_extent("cat", fusion, first.shape[axis], tensor.shape[axis],
                              f"axis {axis} of {first} and {tensor}")  # fmt: skip
    extents = [t.shape[dim] for t in tensors]
    if not all(isinstance(e, int) for e in extents):
        raise DefinitionError(f"cat: the joined axis {dim} must be static, got {extents}")
    axes = _copy_axes(fusion, first.logical_axes)
    axes[dim] = fusion.new_axis(sum(extents))
    out = _output("cat", fusion, first.dtype, axes, tensors)
    ConcatOp(tensors, out, dim)
    return out


def embedding(
    table: TensorView,
    indices: TensorView,
    padding_idx: int | None = None,
    rows: TensorView | None = None,
) -> TensorView:
    """``table[indices]``: for each index, its row of ``table`` ([rows, features]); the
    output is ``indices``' shape plus the features axis. Indices outside the table are an
    error when the lookup runs; the row ``padding_idx`` (negative counts from the end)
    gets no gradient. ``rows`` numbers the table's rows: an iota over them, made here
    unless given (a replay passes its own)."""
    table, indices = _tensor("embedding", "table", table), _tensor("embedding", "indices", indices)
    fusion = _fusion_of("embedding", [table, indices])
    _require_compute_type("embedding", table)
    if table.ndim != 2:
        raise DefinitionError(f"embedding: the table must be 2-D [rows, features], got {table}")
    _require_index("embedding", indices)
    count = table.shape[0]
    if not isinstance(count, int):
        raise DefinitionError(f"embedding: the table's row count must be static, got {count}")
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or not -count <= padding_idx < count:
            raise DefinitionError(
                f"embedding: padding_idx {padding_idx!r} is not a row of {table} ({count} rows)"
            )
        padding_idx %= count
    if rows is None:
        rows = iota(fusion, count)
    elif not isinstance(rows.definition, IotaOp) or list(rows.shape) != [count]:
        raise DefinitionError(f"embedding: rows must be an iota over the {count} rows")
    axes = _copy_axes(fusion, [*indices.logical_axes, table.logical_axes[1]])
    # the table's rows, summed over (one row each): a table split by rows makes the
    # output partial, as a contraction's kept reduction axis does
    axes.append(fusion.new_axis(count, IterType.REDUCTION))
    out = _output("embedding", fusion, table.dtype, axes, [table])
    EmbeddingOp(table, indices, rows, out, padding_idx, count)
    return out


def embedding_grad(
    grad: TensorView, indices: TensorView, rows: TensorView, padding_idx: int | None = None
) -> TensorView:
    """The gradient of an embedding's table ([rows, features], ``grad``'s dtype): row
    ``rows[r]`` sums ``grad`` (the output's gradient) wherever ``indices`` equals it."""
    grad = _tensor("embedding_grad", "grad", grad)
    indices = _tensor("embedding_grad", "indices", indices)
    rows = _tensor("embedding_grad", "rows", rows)
    fusion = _fusion_of("embedding_grad", [grad, indices, rows])
    _require_float("embedding_grad", grad)
    _require_index("embedding_grad", indices)
    if grad.ndim != indices.ndim + 1 or rows.ndim != 1:
        raise DefinitionError(
            f"embedding_grad: grad {grad} must be indices' shape {indices} plus features, "
            f"rows {rows} 1-D"
        )
    for index in range(indices.ndim):
        _unify_extent("embedding_grad", fusion, grad.shape[index], indices.shape[index],
                      f"axis {index} of {grad} and {indices}")  # fmt: skip
    axes = _copy_axes(fusion, [rows.logical_axes[0], grad.logical_axes[-1]])
    # the index axes, summed over: split, they leave partial sums
    axes += [fusion.new_axis(e, IterType.REDUCTION) for e in indices.shape]
    out = _output("embedding_grad", fusion, grad.dtype, axes, [grad])
    EmbeddingGradOp(grad, indices, rows, out, padding_idx)
    return out


def attention(
    q: TensorView,
    k: TensorView,
    v: TensorView,
    mask: TensorView | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> TensorView:
    """Scaled dot-product attention over the last two axes (torch's
    ``scaled_dot_product_attention``, run by its kernels): ``q`` [..., queries, dim],
    ``k`` [..., keys, dim], ``v`` [..., keys, value dim], equal leading axes; ``mask``
    (bool, True where a query attends, or floats added to the scores) broadcasts to
    [..., queries, keys]; ``causal`` lets a query attend to keys up to its own position;
    ``scale`` defaults to ``1 / sqrt(dim)``."""
    fusion, scale = _check_attention("attention", q, k, v, mask, causal, scale)
    axes = _copy_axes(fusion, [*q.logical_axes[:-1], v.logical_axes[-1]])
    out = _output("attention", fusion, q.dtype, axes, [q])
    AttentionOp(q, k, v, mask, out, bool(causal), scale)
    return out


def attention_grad(
    grad: TensorView,
    q: TensorView,
    k: TensorView,
    v: TensorView,
    mask: TensorView | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[TensorView, TensorView, TensorView]:
    """The gradients of ``attention(q, k, v, mask, causal, scale)``'s ``q``, ``k`` and
    ``v`` from ``grad``, its output's gradient."""
    fusion, scale = _check_attention("attention_grad", q, k, v, mask, causal, scale)
    grad = _tensor("attention_grad", "grad", grad)
    if grad.ndim != q.ndim or grad.dtype != q.dtype:
        raise DefinitionError(f"attention_grad: grad {grad} must be shaped like the output")
    outs = [
        _output("attention_grad", fusion, t.dtype, _copy_axes(fusion, t.logical_axes), [t])
        for t in (q, k, v)
    ]
    AttentionGradOp(grad, q, k, v, mask, outs, bool(causal), scale)
    return outs[0], outs[1], outs[2]


def _check_attention(op_name, q, k, v, mask, causal, scale) -> tuple[Fusion, float]:
    q, k, v = (_tensor(op_name, role, t) for role, t in (("q", q), ("k", k), ("v", v)))
    tensors = [q, k, v] if mask is None else [q, k, v, _tensor(op_name, "mask", mask)]
    fusion = _fusion_of(op_name, tensors)
    for tensor in (q, k, v):
        _require_float(op_name, tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise DefinitionError(f"{op_name}: q, k and v must share a dtype: {q}, {k}, {v}")
    if not (q.ndim == k.ndim == v.ndim) or q.ndim < 2:
        raise DefinitionError(f"{op_name}: q, k and v need one rank (>= 2): {q}, {k}, {v}")
    for index in range(q.ndim - 2):
        for other in (k, v):
            _unify_extent(op_name, fusion, q.shape[index], other.shape[index],
                          f"leading axis {index} of {q} and {other}")  # fmt: skip
    _unify_extent(op_name, fusion, q.shape[-1], k.shape[-1], f"the last axes of {q} and {k}")
    _unify_extent(op_name, fusion, k.shape[-2], v.shape[-2], f"the key axes of {k} and {v}")
    if mask is not None:
        if causal:
            raise DefinitionError(f"{op_name}: give a mask or causal=True, not both")
        if mask.ndim != q.ndim:
            raise DefinitionError(f"{op_name}: mask {mask} needs q's rank ({q.ndim})")
        if not (mask.dtype.is_bool or mask.dtype == q.dtype):
            raise DefinitionError(f"{op_name}: mask {mask} must be bool or {q.dtype}")
        wanted = [*q.shape[:-1], k.shape[-2]]
        for index, (extent, target) in enumerate(zip(mask.shape, wanted, strict=True)):
            if extent != 1:
                _unify_extent(op_name, fusion, extent, target, f"axis {index} of mask {mask}")
    if scale is None:
        dim = q.shape[-1]
        if isinstance(dim, Symbol):
            raise DefinitionError(f"{op_name}: give scale: {q}'s last extent is symbolic")
        scale = 1.0 / math.sqrt(dim) if dim else 1.0
    return fusion, float(scale)


def _normalized_axes(op_name: str, x: TensorView, normalized_dims: int) -> list[int]:
    """The last ``normalized_dims`` axes of the floating-point ``x``, which a layer or RMS
    norm normalizes over (refused unless 1 to all of them)."""
    _require_float(op_name, x)
    if not isinstance(normalized_dims, int) or not 1 <= normalized_dims <= x.ndim:
        raise DefinitionError(
            f"{op_name}: normalized_dims must be 1 to {x.ndim} for {x}, got {normalized_dims!r}"
        )
    return list(range(x.ndim - normalized_dims, x.ndim))


def layer_norm(
    x: TensorView,
    normalized_dims: int,
    weight: TensorView | None = None,
    bias: TensorView | None = None,
    eps: float = 1e-5,
) -> tuple[TensorView, TensorView, TensorView]:
    """torch's ``layer_norm`` over the last ``normalized_dims`` axes of ``x``:
    ``(x - mean) * rstd * weight + bias`` with ``rstd = 1 / sqrt(var + eps)`` (the biased
    variance), ``weight`` and ``bias`` (optional) shaped like those axes. 16-bit inputs
    compute in float32 and round once, as torch's kernels. Returns ``(y, mean, rstd)``,
    the statistics float32 over the kept axes.

    Example::

        y, _, _ = layer_norm(x, 1, weight, bias)  # nn.LayerNorm(hidden) on [..., hidden]
    """
    x = _tensor("layer_norm", "input", x)
    dims = _normalized_axes("layer_norm", x, normalized_dims)
    y, mean, rstd = _normalized(x, dims, eps)
    y = _affine("layer_norm", y, [d < dims[0] for d in range(x.ndim)], weight, bias)
    return _in_dtype(y, x.dtype), mean, rstd


def rms_norm(
    x: TensorView,
    normalized_dims: int,
    weight: TensorView | None = None,
    eps: float | None = None,
) -> tuple[TensorView, TensorView]:
    """torch's ``rms_norm`` over the last ``normalized_dims`` axes of ``x``:
    ``x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``, ``weight`` (optional)
    shaped like those axes. As torch's, 16-bit inputs compute in float32 (the weight
    too) and round once, and ``eps=None`` is the machine epsilon of that compute type
    (float32's for 16- and 32-bit inputs, not bf16's). Returns ``(y, rstd)``, ``rstd``
    float32 (float64 inputs: float64) over the kept axes.

    Example::

        y, _ = rms_norm(x, 1, weight)  # nn.RMSNorm(hidden) on [..., hidden]
    """
    x = _tensor("rms_norm", "input", x)
    dims = _normalized_axes("rms_norm", x, normalized_dims)
    wide = cast(x, "float32") if x.dtype.bits < 32 else x
    if eps is None:
        eps = machine_epsilon(wide.dtype)
    rstd = rsqrt(add(mean(mul(wide, wide), dims), eps))
    y = mul(wide, broadcast(rstd, [d in dims for d in range(x.ndim)]))
    y = _affine("rms_norm", y, [d < dims[0] for d in range(x.ndim)], weight, None)
    return _in_dtype(y, x.dtype), rstd


def group_norm(
    x: TensorView,
    groups: int,
    weight: TensorView | None = None,
    bias: TensorView | None = None,
    eps: float = 1e-5,
) -> tuple[TensorView, TensorView, TensorView]:
    """torch's ``group_norm`` of ``x`` [N, C, *]: the channels in ``groups`` consecutive
    groups, each sample's group normalized over its channels and the trailing axes, then
    ``weight`` and ``bias`` ([C], optional) per channel. 16-bit inputs compute in float32
    and round once. Returns ``(y, mean, rstd)``, the statistics float32, [N, groups]."""
    x = _tensor("group_norm", "input", x)
    _require_float("group_norm", x)
    if x.ndim < 2:
        raise DefinitionError(f"group_norm: needs [N, C, *], got {x}")
    channels = x.shape[1]
    if not isinstance(groups, int) or groups < 1 or not isinstance(channels, int):
        raise DefinitionError(f"group_norm: needs static channels and groups >= 1: {x}, {groups!r}")
    if channels % groups:
        raise DefinitionError(f"group_norm: {channels} channels of {x} in {groups} groups")
    # [N, groups, the rest of a group]: one reduced axis, innermost, as the normalization
    # scheduler takes it (a group's axes kept apart where one is symbolic: no merging it).
    # The per-channel weight and bias vary along a kept axis (groups) and a reduced one,
    # none of that scheduler's kinds: applied after the reshape back, a pointwise kernel.
    rest = [channels // groups, *x.shape[2:]]
    if all(isinstance(extent, int) for extent in rest):
        rest = [math.prod(rest)]
    grouped = reshape(x, [x.shape[0], groups, *rest])
    y, mean, rstd = _normalized(grouped, list(range(2, grouped.ndim)), eps)
    y = reshape(y, list(x.shape))
    y = _affine("group_norm", y, [d != 1 for d in range(x.ndim)], weight, bias)
    return _in_dtype(y, x.dtype), mean, rstd


def _normalized(
    x: TensorView, dims: list[int], eps: float
) -> tuple[TensorView, TensorView, TensorView]:
    """``(x - mean) * rstd`` over ``dims`` in float32 (or float64), and the mean and rstd."""
    wide = cast(x, "float32") if x.dtype.bits < 32 else x
    var, mean = var_mean(wide, dims, correction=0)
    rstd = rsqrt(add(var, eps))
    kept = [d in dims for d in range(x.ndim)]
    return mul(sub(wide, broadcast(mean, kept)), broadcast(rstd, kept)), mean, rstd


def _affine(op_name, y, spread, weight, bias) -> TensorView:
    """``y * weight + bias``, each broadcast along the axes ``spread`` marks, in ``y``'s
    dtype (a 16-bit weight widened)."""
    for role, value in (("weight", weight), ("bias", bias)):
        if value is None:
            continue
        value = _tensor(op_name, role, value)
        if value.ndim != spread.count(False):
            raise DefinitionError(f"{op_name}: {role} {value} does not match {y}'s axes")
        value = broadcast(_in_dtype(value, y.dtype), spread)
        y = mul(y, value) if role == "weight" else add(y, value)
    return y


def _in_dtype(x: TensorView, dtype: DataType) -> TensorView:
    return x if x.dtype == dtype else cast(x, dtype)


def _require_index(op_name: str, indices: TensorView) -> None:
    if not indices.dtype.is_integer:
        raise DefinitionError(f"{op_name}: indices must be integers, got {indices}")


def _open_fusion(op_name: str, source: object) -> Fusion:
    fusion = getattr(source, "fusion", source)
    if not isinstance(fusion, Fusion):
        raise DefinitionError(
            f"{op_name}: needs a tensor, fusion or FusionDefinition, got {type(source).__name__}"
        )
    if fusion.finalized:
        raise DefinitionError(
            f"{op_name}: the fusion definition has ended; add ops inside "
            "`with FusionDefinition() as fd:`"
        )
    return fusion


__all__ = [
    "attention", "attention_grad", "cat", "detach", "dropout_mask", "embedding", "embedding_grad",
    "group_norm", "iota", "layer_norm", "rms_norm",
]  # fmt: skip
