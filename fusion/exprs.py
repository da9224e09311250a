"""Expressions: one class per op family.

Every expr has ``operands`` (tensors and Python scalars, in call order),
``inputs`` (the tensor operands), ``outputs`` and printable ``attrs``. The
reference evaluator and, later, sharding rules and schedulers dispatch on the
class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusion.dtypes import DataType
from fusion.ir import Extent, Scalar, TensorView

UNARY_OPS = (
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "erf",
)
# Unary ops that only make sense on floats; integer and bool inputs are promoted to float32.
FLOAT_UNARY_OPS = frozenset(
    {"exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "gelu", "silu", "erf"}
)
BINARY_OPS = ("add", "sub", "mul", "div", "maximum", "minimum", "pow")
COMPARE_OPS = ("eq", "ne", "lt", "le", "gt", "ge")
REDUCTION_OPS = ("sum", "max", "min", "mean")


def format_operand(operand: TensorView | Scalar) -> str:
    if isinstance(operand, TensorView):
        return operand.name
    return repr(operand)


def _format_attr(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_format_attr(v) for v in value) + "]"
    if isinstance(value, DataType):
        return value.name
    if isinstance(value, str):
        return repr(value)
    return str(value)


class Expr:
    """An operation consuming ``operands`` and producing ``outputs``."""

    op_name: str

    def __init__(
        self,
        op_name: str,
        operands: Sequence[TensorView | Scalar],
        outputs: Sequence[TensorView],
        **attrs: object,
    ) -> None:
        self.op_name = op_name
        self.operands = tuple(operands)
        self.inputs = [o for o in self.operands if isinstance(o, TensorView)]
        self.outputs = list(outputs)
        self.attrs = attrs
        for output in self.outputs:
            output.definition = self
        for tensor in dict.fromkeys(self.inputs):
            tensor.uses.append(self)
        self.outputs[0].fusion.exprs.append(self)

    @property
    def output(self) -> TensorView:
        """The single output (every expr but var_mean has exactly one)."""
        (only,) = self.outputs
        return only

    def __str__(self) -> str:
        lhs = ", ".join(str(t) for t in self.outputs)
        args = [format_operand(o) for o in self.operands]
        args += [f"{key}={_format_attr(value)}" for key, value in self.attrs.items()]
        return f"{lhs} = {self.op_name}({', '.join(args)})"

    __repr__ = __str__


class UnaryOp(Expr):
    """``out = op(x)`` elementwise. ``gelu`` carries ``approximate`` ("none" or "tanh")."""

    def __init__(self, op: str, x: TensorView, out: TensorView, **attrs: object) -> None:
        super().__init__(op, [x], [out], **attrs)


class BinaryOp(Expr):
    """``out = op(lhs, rhs)`` elementwise with broadcasting; either side may be a scalar."""

    def __init__(
        self, op: str, lhs: TensorView | Scalar, rhs: TensorView | Scalar, out: TensorView
    ) -> None:
        super().__init__(op, [lhs, rhs], [out])


class CompareOp(Expr):
    """``out = lhs op rhs`` elementwise, a bool; ``op`` one of ``COMPARE_OPS``. The
    operands are compared in ``compared_in``, their promoted type (NaN compares unequal
    to everything, itself included, as in IEEE arithmetic and torch)."""

    def __init__(
        self,
        op: str,
        lhs: TensorView | Scalar,
        rhs: TensorView | Scalar,
        out: TensorView,
        compared_in: DataType,
    ) -> None:
        self.compared_in = compared_in
        super().__init__(op, [lhs, rhs], [out])


class WhereOp(Expr):
    """``out = cond ? x : y`` elementwise; ``x`` and ``y`` may be scalars."""

    def __init__(
        self, cond: TensorView, x: TensorView | Scalar, y: TensorView | Scalar, out: TensorView
    ) -> None:
        super().__init__("where", [cond, x, y], [out])


class CastOp(Expr):
    """``out = x`` converted to ``out.dtype`` (fp8 and fp4 included)."""

    def __init__(self, x: TensorView, out: TensorView) -> None:
        super().__init__("cast", [x], [out], dtype=out.dtype)


class SetOp(Expr):
    """``out = x``: a copy."""

    def __init__(self, x: TensorView, out: TensorView) -> None:
        super().__init__("set", [x], [out])


class BroadcastOp(Expr):
    """Insert broadcast axes (extent 1) where ``is_broadcast_dim`` is True."""

    def __init__(self, x: TensorView, out: TensorView, is_broadcast_dim: Sequence[bool]) -> None:
        self.is_broadcast_dim = tuple(is_broadcast_dim)
        dims = [i for i, flag in enumerate(self.is_broadcast_dim) if flag]
        super().__init__("broadcast", [x], [out], dims=dims)


class ExpandOp(Expr):
    """Expand extent-1 axes to ``shape`` without copying (stride 0)."""

    def __init__(self, x: TensorView, out: TensorView, shape: Sequence[Extent]) -> None:
        self.shape = tuple(shape)
        super().__init__("expand", [x], [out], shape=list(self.shape))


class ReshapeOp(Expr):
    """View the data in a new shape with the same number of elements (row-major order)."""

    def __init__(self, x: TensorView, out: TensorView, shape: Sequence[Extent]) -> None:
        self.shape = tuple(shape)
        super().__init__("reshape", [x], [out], shape=list(self.shape))


class PermuteOp(Expr):
    """Reorder axes: output axis ``i`` is input axis ``dims[i]``."""

    def __init__(self, x: TensorView, out: TensorView, dims: Sequence[int]) -> None:
        self.dims = tuple(dims)
        super().__init__("permute", [x], [out], dims=list(self.dims))


class SliceOp(Expr):
    """Per axis ``[start:stop:step]``, all bounds normalized to non-negative ints."""

    def __init__(
        self,
        x: TensorView,
        out: TensorView,
        starts: Sequence[int],
        stops: Sequence[Extent],
        steps: Sequence[int],
    ) -> None:
        self.starts, self.stops, self.steps = tuple(starts), tuple(stops), tuple(steps)
        super().__init__(
            "slice",
            [x],
            [out],
            starts=list(self.starts),
            stops=list(self.stops),
            steps=list(self.steps),
        )


class PadOp(Expr):
    """Per axis, ``before`` zeros, ``x``, ``after`` zeros (a slice's gradient)."""

    def __init__(
        self, x: TensorView, out: TensorView, before: Sequence[int], after: Sequence[int]
    ) -> None:
        self.before, self.after = tuple(before), tuple(after)
        super().__init__("pad", [x], [out], before=list(self.before), after=list(self.after))


class ConcatOp(Expr):
    """The inputs joined along axis ``dim`` (equal extents elsewhere)."""

    def __init__(self, xs: Sequence[TensorView], out: TensorView, dim: int) -> None:
        self.dim = dim
        super().__init__("cat", list(xs), [out], dim=dim)


class SelectOp(Expr):
    """Take index ``index`` of axis ``dim``, removing that axis."""

    def __init__(self, x: TensorView, out: TensorView, dim: int, index: int) -> None:
        self.dim, self.index = dim, index
        super().__init__("select", [x], [out], dim=dim, index=index)


class ReductionOp(Expr):
    """``sum``, ``max``, ``min`` or ``mean`` over ``dims`` (kept in ``out`` as reduction axes)."""

    def __init__(self, op: str, x: TensorView, out: TensorView, dims: Sequence[int]) -> None:
        self.dims = tuple(dims)
        super().__init__(op, [x], [out], dims=list(self.dims))


class VarMeanOp(Expr):
    """Variance (with Bessel-style ``correction``) and mean over ``dims``: two outputs."""

    def __init__(
        self, x: TensorView, var: TensorView, mean: TensorView, dims: Sequence[int], correction: int
    ) -> None:
        self.dims, self.correction = tuple(dims), correction
        super().__init__("var_mean", [x], [var, mean], dims=list(self.dims), correction=correction)


class MatmulOp(Expr):
    """``out = a @ b``, batch axes broadcast; ``out`` keeps the contraction as a reduction axis."""

    def __init__(self, a: TensorView, b: TensorView, out: TensorView) -> None:
        super().__init__("matmul", [a, b], [out])


class LinearOp(Expr):
    """``out = x @ weight.T (+ bias)``; the contraction axis stays in ``out`` as reduction."""

    def __init__(
        self, x: TensorView, weight: TensorView, bias: TensorView | None, out: TensorView
    ) -> None:
        self.has_bias = bias is not None
        operands = [x, weight] if bias is None else [x, weight, bias]
        super().__init__("linear", operands, [out])


class IotaOp(Expr):
    """``out = [0, 1, ..., n - 1]`` (an index along an axis, ``out.dtype``): no operands.
    Split over ranks, each piece holds its own global indices."""

    def __init__(self, out: TensorView) -> None:
        super().__init__("iota", [], [out])


class DropoutMaskOp(Expr):
    """``out``: dropout's float32 mask, ``1 / (1 - p)`` where an element is kept and 0
    where it is dropped, each element's bit a hash of ``seed`` (a one-element int64
    tensor) and of the element's global row-major index in the whole ``out``
    (``fusion.random``). Split over ranks, each piece draws its own elements' bits:
    every rank, generated kernels and the backward's recomputation draw the same mask."""

    def __init__(self, seed: TensorView, out: TensorView, p: float) -> None:
        self.p = p
        super().__init__("dropout_mask", [seed], [out], p=p)


class DetachOp(Expr):
    """``out = x``, through which no gradient flows (a stop-gradient). Not a ``SetOp``:
    sharding places it as an elementwise op, where a copy between layouts would become
    a communication."""

    def __init__(self, x: TensorView, out: TensorView) -> None:
        super().__init__("detach", [x], [out])


class EmbeddingOp(Expr):
    """``out[..., :] = table[indices[...], :]``, where ``rows`` (an iota over the table's
    rows) numbers the table's rows: a piece of the table holding rows ``rows[0]`` onward
    gives the rows it holds and zeros for the others (so that pieces split by rows sum to
    the whole lookup). ``padding_idx`` (or None) gets no gradient; ``count`` is the
    table's whole row count (indices outside it are an error)."""

    def __init__(
        self,
        table: TensorView,
        indices: TensorView,
        rows: TensorView,
        out: TensorView,
        padding_idx: int | None,
        count: int,
    ) -> None:
        self.padding_idx, self.count = padding_idx, count
        super().__init__("embedding", [table, indices, rows], [out], padding_idx=padding_idx)


class EmbeddingGradOp(Expr):
    """The gradient of a table from ``grad`` (shaped like an embedding's output): row
    ``rows[r]`` sums ``grad`` where ``indices`` equals it (never at ``padding_idx``)."""

    def __init__(
        self,
        grad: TensorView,
        indices: TensorView,
        rows: TensorView,
        out: TensorView,
        padding_idx: int | None,
    ) -> None:
        self.padding_idx = padding_idx
        super().__init__("embedding_grad", [grad, indices, rows], [out], padding_idx=padding_idx)


class AttentionOp(Expr):
    """Scaled dot-product attention ``softmax(q @ k^T * scale + mask) @ v`` over the last
    two axes (``causal``: a query sees keys up to its own position), run by PyTorch's
    attention kernels; leading axes (batch, heads) are independent. ``mask`` (optional):
    bool (True: attend) or added to the scores."""

    def __init__(
        self,
        q: TensorView,
        k: TensorView,
        v: TensorView,
        mask: TensorView | None,
        out: TensorView,
        causal: bool,
        scale: float,
    ) -> None:
        self.causal, self.scale, self.has_mask = causal, scale, mask is not None
        operands = [q, k, v] if mask is None else [q, k, v, mask]
        super().__init__("attention", operands, [out], causal=causal, scale=scale)


class AttentionGradOp(Expr):
    """The gradients of an ``AttentionOp``'s ``q``, ``k`` and ``v`` from the gradient of
    its output: three outputs."""

    def __init__(
        self,
        grad: TensorView,
        q: TensorView,
        k: TensorView,
        v: TensorView,
        mask: TensorView | None,
        outs: Sequence[TensorView],
        causal: bool,
        scale: float,
    ) -> None:
        self.causal, self.scale, self.has_mask = causal, scale, mask is not None
        operands = [grad, q, k, v] if mask is None else [grad, q, k, v, mask]
        super().__init__("attention_grad", operands, outs, causal=causal, scale=scale)


@dataclass(frozen=True)
class TensorSlot:
    """Where a ``TorchOp``'s argument list holds its ``index``-th tensor input."""

    index: int


class TorchOp(Expr):
    """``outs = target(*arguments, **keywords)``: an ATen op the IR has no translation
    for (``fusion.torch_ops``), run by PyTorch on the local pieces of its tensor inputs
    (sharding splits them as torch's DTensor strategy does, ``sharding.torch_strategy``,
    else keeps them whole on every rank: the ``torch op fallback`` rule).
    ``arguments`` and ``keywords`` hold the op's arguments with each tensor replaced by a
    ``TensorSlot``, its position among ``inputs`` (the operands are the tensors alone).

    With ``vjp`` (the positions of the differentiable tensor inputs) it is the op's
    vector-Jacobian product instead, computed by PyTorch's autograd: its operands are the
    forward's tensor inputs, then one gradient per floating-point forward output, and its
    outputs the gradients of the inputs at ``vjp``.

    Prints as ``T5 = torch_op[aten.cumsum.default](T3, dim=1)``.
    """

    def __init__(
        self,
        target: object,
        arguments: tuple,
        keywords: dict[str, object],
        tensors: Sequence[TensorView],
        outs: Sequence[TensorView],
        vjp: tuple[int, ...] | None = None,
    ) -> None:
        self.target, self.arguments, self.keywords, self.vjp = target, arguments, keywords, vjp
        self.forward_count = len(_slots((arguments, keywords)))  # the forward's tensors
        kind = "torch_op" if vjp is None else "torch_vjp"
        super().__init__(f"{kind}[{target}]", tensors, outs)

    def __str__(self) -> str:
        def shown(value: object) -> str:
            if isinstance(value, TensorSlot):
                return self.inputs[value.index].name
            if isinstance(value, (list, tuple)):
                return "[" + ", ".join(shown(v) for v in value) + "]"
            return _format_attr(value)

        names = [argument.name for argument in self.target._schema.arguments]
        shown_args = []
        for position, value in enumerate(self.arguments):
            # leading tensors by position, the rest by the schema's names
            if isinstance(value, TensorSlot) and len(shown_args) == position:
                shown_args.append(shown(value))
            else:
                shown_args.append(f"{names[position]}={shown(value)}")
        shown_args += [f"{key}={shown(value)}" for key, value in self.keywords.items()]
        if self.vjp is not None:
            grads = self.inputs[self.forward_count :]
            shown_args.append(f"grads=[{', '.join(t.name for t in grads)}]")
        lhs = ", ".join(str(t) for t in self.outputs)
        return f"{lhs} = {self.op_name}({', '.join(shown_args)})"

    __repr__ = __str__

    def __getstate__(self) -> dict[str, object]:
        # an ATen overload does not pickle: it travels (to Ray actors, launched ranks)
        # as its name, ``aten.cumsum.default``
        return {**self.__dict__, "target": str(self.target)}

    def __setstate__(self, state: dict[str, object]) -> None:
        namespace, name, overload = str(state["target"]).split(".")
        target = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        self.__dict__.update({**state, "target": target})


def _slots(value: object) -> list[int]:
    """The tensor positions ``value`` (arguments, at any depth) holds."""
    if isinstance(value, TensorSlot):
        return [value.index]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _slots(v)]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _slots(v)]
    return []
