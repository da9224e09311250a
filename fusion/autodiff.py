"""Reverse-mode differentiation of a fusion: its backward, as another fusion.

``backward(fusion)`` builds a fusion whose inputs are the forward's inputs, then the
intermediates it was told to ``save`` (forward tensors the forward hands over instead of
the backward recomputing them: memory against time; ``forward_with_saved`` makes them
outputs of the forward), then one gradient per forward output (same shape and dtype as
the output), and whose outputs are the gradients of the forward's floating-point inputs
(or of those named in ``wrt``), in input order. What it does not save, it recomputes
inside the backward (by default, everything: ``Backward.explain()`` says which
intermediates the gradients read and where each comes from). It then walks the forward's
exprs backwards applying one rule per op family, registered in
``GRADIENT_RULES`` by expr type (unary and binary pointwise ops by name in
``UNARY_RULES`` and ``BINARY_RULES``). Gradients meeting at a tensor are summed; an
operand broadcast along an axis (extent 1 against a larger output) gets its gradient
summed over that axis. The axes a ``broadcast`` inserted are dropped from its gradient
without a sum of one element where the gradient allows (``_squeezed``), so a
normalization's backward stays the normalization scheduler's one kernel: a captured
``nn.LayerNorm``'s, statistics and dx's row reductions with dweight's and dbias's column
sums, as ``examples/norms.py``'s hand-written one.

A max or min shares its gradient evenly among the elements that reach it, maximum and
minimum half to each operand where they are equal, as torch's. An ATen op captured
without a translation (``TorchOp``) gets PyTorch's own gradient: a second torch op runs
its vector-Jacobian product by autograd. An op without a rule
raises ``DifferentiationError`` naming it and the tensor it makes, when the backward is
built (never a wrong gradient), where a gradient would flow through it (an expr reading
nothing computed from the differentiated inputs is only replayed: a slice of a frozen
table is fine): a slice with a step, a select on a symbolic axis and every
cast from or to an fp8/fp4 type among them (a straight-through cast would be a silent
choice; ask for it explicitly, later).

Example::

    grads = backward(fd.fusion)
    dx, dw = evaluate(grads.fusion, [x, w, dy])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusion import ops
from fusion.definition import FusionDefinition
from fusion.errors import FusionError
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
from fusion.ir import Fusion, Symbol, TensorView
from fusion.torch_ops import replay_torch_op, torch_vjp


class DifferentiationError(FusionError):
    """The fusion holds an op whose gradient has no rule (raised when the backward is
    built, before anything runs)."""


@dataclass
class Backward:
    """The backward fusion; ``wrt`` the forward inputs (positions) whose gradients are
    its outputs, in that order; ``saved`` the forward intermediates it takes as inputs
    (after the forward's inputs); ``read`` every forward intermediate the gradients
    read, saved or recomputed; ``values`` and ``gradients``: per forward tensor, its
    value in the backward fusion (an input, or the replayed expr's output) and its
    gradient there (where one flows)."""

    fusion: Fusion
    wrt: list[int]
    saved: list[TensorView]
    read: list[TensorView]
    values: dict[TensorView, TensorView]
    gradients: dict[TensorView, TensorView]

    def explain(self) -> str:
        """Per intermediate the gradients read: saved by the forward or recomputed."""
        lines = []
        for tensor in self.read:
            size = tensor.dtype.size_bits(math.prod(_extent(e) for e in tensor.shape)) // 8
            how = "saved" if tensor in self.saved else "recomputed"
            made = tensor.definition.op_name if tensor.definition is not None else "input"
            lines.append(f"{tensor} ({made}, {size} B): {how}")
        return "\n".join(lines) or "the gradients read no intermediate"


def _extent(extent) -> int:
    return extent if isinstance(extent, int) else 1


def forward_with_saved(fusion: Fusion, saved: Sequence[TensorView]) -> Fusion:
    """A copy of ``fusion`` that also outputs ``saved`` (after its own outputs)."""
    copy = fusion.clone()
    by_id = {tensor.id: tensor for tensor in copy.tensors}
    with copy.editing():
        for tensor in saved:
            kept = by_id[tensor.id]
            copy.outputs.append(ops.set(kept) if kept in copy.outputs else kept)
    return copy


def backward(
    fusion: Fusion, wrt: Sequence[int] | None = None, saved: Sequence[TensorView] = ()
) -> Backward:
    """The backward of ``fusion`` (see the module). ``wrt``: the input positions to
    differentiate with respect to (default: every floating-point input); ``saved``:
    intermediates of ``fusion`` the backward takes as inputs instead of recomputing."""
    if wrt is None:
        wrt = [i for i, t in enumerate(fusion.inputs) if differentiable(t)]
    for position in wrt:
        tensor = fusion.inputs[position]
        if not differentiable(tensor):
            raise DifferentiationError(
                f"input {position} ({tensor}) is {tensor.dtype}: only floating-point inputs "
                "of a compute type have gradients"
            )
    live = fusion.live_exprs()
    # a gradient flows only through exprs that read something computed from the inputs
    # at ``wrt``: the others (a frozen input's slice, say) are replayed, never differentiated
    reached = {fusion.inputs[p] for p in wrt}
    for expr in live:
        if any(t in reached for t in expr.inputs):
            reached.update(expr.outputs)
    flowing = [e for e in live if any(t in reached for t in e.inputs)]
    for expr in flowing:
        if isinstance(expr, AttentionOp) and expr.has_mask and expr.inputs[3] in reached:
            raise DifferentiationError(
                f"attention ({expr.output}): its mask {expr.inputs[3]} is computed from "
                "differentiated inputs, and a mask has no gradient rule"
            )
    for expr in flowing:  # every rule exists before anything is built
        _rule(expr)
    computed = {t for expr in live for t in expr.outputs}
    for tensor in saved:
        if tensor not in computed:
            raise DifferentiationError(
                f"save {tensor}: only an intermediate the outputs depend on can be saved"
            )
    with FusionDefinition(f"{fusion.name or 'fusion'}_backward") as fd:
        mapped: dict[TensorView, TensorView] = {}
        for tensor in [*fusion.inputs, *saved]:
            mapped[tensor] = fd.define_tensor(_shape(tensor), tensor.dtype)
        for expr in live:
            if any(out not in mapped for out in expr.outputs):
                _replay(expr, mapped, fd.fusion)
        grads: dict[TensorView, TensorView] = {}
        for output in fusion.outputs:
            seed = fd.define_tensor(_shape(output), output.dtype)
            if differentiable(output):
                _accumulate(grads, output, seed)
        for expr in reversed(flowing):
            given = [grads.get(out) for out in expr.outputs]
            if all(g is None for g in given):
                continue
            operand_grads = _rule(expr)(expr, mapped, given)
            for tensor, grad in zip(expr.inputs, operand_grads, strict=True):
                if grad is not None and differentiable(tensor):
                    _accumulate(grads, tensor, _fit(grad, mapped[tensor]))
        for position in wrt:
            tensor = fusion.inputs[position]
            grad = grads.get(tensor)
            if grad is None:  # the outputs do not depend on it: zeros (even where it is NaN)
                grad = _zeros_like(mapped[tensor])
            if grad in fd.fusion.outputs or grad in fd.fusion.inputs:
                grad = ops.set(grad)  # one gradient for two inputs, or an output's own
            fd.add_output(grad)
    read = _read(fd.fusion, mapped, computed)
    return Backward(fd.fusion, list(wrt), list(saved), read, mapped, grads)


def _read(backward_fusion: Fusion, mapped: dict, computed: set) -> list[TensorView]:
    """The forward intermediates whose values the backward's live exprs read."""
    reads = {t for expr in backward_fusion.live_exprs() for t in expr.inputs}
    return [tensor for tensor, value in mapped.items() if tensor in computed and value in reads]


def differentiable(tensor: TensorView) -> bool:
    """Whether ``tensor`` can have a gradient: a floating-point dtype with arithmetic."""
    return tensor.dtype.is_floating and not tensor.dtype.storage_only


def _shape(tensor: TensorView) -> list:
    return [str(e) if isinstance(e, Symbol) else e for e in tensor.shape]


def _accumulate(grads: dict, tensor: TensorView, grad: TensorView) -> None:
    grads[tensor] = grad if tensor not in grads else ops.add(grads[tensor], grad)


def _fit(grad: TensorView, like: TensorView) -> TensorView:
    """``grad`` summed over the axes ``like`` broadcasts along, in ``like``'s dtype (a
    gradient widened exactly and narrowed back is the gradient itself: a bf16 residual
    summed in float32 hands its bf16 gradient on, not a float32 copy of it)."""
    dims = [d for d in range(like.ndim) if like.shape[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = ops.sum(grad, dims, keepdim=True)
    if grad.dtype == like.dtype:
        return grad
    widened = grad.definition
    if isinstance(widened, CastOp) and widened.inputs[0].dtype == like.dtype:
        if like.dtype.is_floating and grad.dtype.bits > like.dtype.bits:
            return widened.inputs[0]
    return ops.cast(grad, like.dtype)


# -- replaying the forward ----------------------------------------------------------------


def _replay(expr: Expr, mapped: dict[TensorView, TensorView], fusion: Fusion) -> None:
    """``expr`` again in the backward ``fusion``, on its mapped operands (an output saved
    keeps its saved value)."""
    operands = [mapped[o] if isinstance(o, TensorView) else o for o in expr.operands]
    if isinstance(expr, VarMeanOp):
        results = ops.var_mean(operands[0], list(expr.dims), expr.correction)
    elif isinstance(expr, IotaOp):
        results = (ops.iota(fusion, _shape(expr.output)[0], expr.output.dtype),)
    elif isinstance(expr, AttentionGradOp):
        mask = operands[4] if expr.has_mask else None
        results = ops.attention_grad(*operands[:4], mask, expr.causal, expr.scale)
    elif isinstance(expr, TorchOp):
        results = replay_torch_op(expr, operands, fusion)
    else:
        results = (_REPLAY[type(expr)](expr, operands),)
    for out, result in zip(expr.outputs, results, strict=True):
        mapped.setdefault(out, result)


_REPLAY: dict[type, Callable] = {
    UnaryOp: lambda e, o: getattr(ops, e.op_name)(o[0], **e.attrs),
    BinaryOp: lambda e, o: getattr(ops, e.op_name)(o[0], o[1]),
    CastOp: lambda e, o: ops.cast(o[0], e.output.dtype),
    SetOp: lambda e, o: ops.set(o[0]),
    BroadcastOp: lambda e, o: ops.broadcast(o[0], list(e.is_broadcast_dim)),
    ExpandOp: lambda e, o: ops.expand(o[0], _shape(e.output)),
    ReshapeOp: lambda e, o: ops.reshape(o[0], _shape(e.output)),
    PermuteOp: lambda e, o: ops.permute(o[0], list(e.dims)),
    ReductionOp: lambda e, o: getattr(ops, e.op_name)(o[0], list(e.dims)),
    MatmulOp: lambda e, o: ops.matmul(o[0], o[1]),
    LinearOp: lambda e, o: ops.linear(*o),
    WhereOp: lambda e, o: ops.where(*o),
    CompareOp: lambda e, o: getattr(ops, e.op_name)(o[0], o[1]),
    SliceOp: lambda e, o: ops.slice(o[0], list(e.starts), _stops(e), list(e.steps)),
    SelectOp: lambda e, o: ops.select(o[0], e.dim, e.index),
    PadOp: lambda e, o: ops.pad(o[0], list(e.before), list(e.after)),
    DetachOp: lambda e, o: ops.detach(o[0]),
    # drawn again from the seed, not saved: the same bits (``fusion.random``)
    DropoutMaskOp: lambda e, o: ops.dropout_mask(o[0], _shape(e.output), e.p),
    ConcatOp: lambda e, o: ops.cat(o, e.dim),
    EmbeddingOp: lambda e, o: ops.embedding(o[0], o[1], e.padding_idx, rows=o[2]),
    EmbeddingGradOp: lambda e, o: ops.embedding_grad(*o, e.padding_idx),
    AttentionOp: lambda e, o: ops.attention(
        *o[:3], o[3] if e.has_mask else None, e.causal, e.scale
    ),
}


def _stops(expr: SliceOp) -> list[int | None]:
    """A slice's stops as ``ops.slice`` takes them (None: to the axis's end)."""
    stops: list[int | None] = []
    for axis, stop in zip(expr.inputs[0].logical_axes, expr.stops, strict=True):
        if stop == axis.extent:
            stops.append(None)
        elif isinstance(stop, int):
            stops.append(stop)
        else:
            raise DifferentiationError(f"slice {expr.output}: a symbolic stop is not replayed")
    return stops


# -- the rules ----------------------------------------------------------------------------
# A rule takes the expr, the forward tensors mapped into the backward fusion and the
# gradients of the expr's outputs (None: none arrives); it returns one gradient (or None)
# per tensor input, shaped like the output (broadcast operands are summed by ``_fit``).


# Rules that move a gradient as it is (or negated) keep its dtype; the others compute a
# 16-bit float gradient in float32 and round once at the end (``_fit``), as torch's
# kernels do: rounding after every op of a gelu's derivative loses several bf16 bits.
_EXACT = frozenset({"neg", "add", "sub"})


def _widened(operand, exact: bool):
    if exact or not isinstance(operand, TensorView) or operand.dtype.bits >= 32:
        return operand
    return ops.cast(operand, "float32") if operand.dtype.is_floating else operand


def _unary(expr, mapped, given):
    (g,) = given
    exact = expr.op_name in _EXACT
    x, y, g = (_widened(t, exact) for t in (mapped[expr.inputs[0]], mapped[expr.output], g))
    return [UNARY_RULES[expr.op_name](x, y, g, expr.attrs)]


def _positive(x: TensorView) -> TensorView:
    """1 where ``x > 0`` (NaN included, as torch's relu backward passes it), else 0: the
    IR has no comparison, but relu(x) is nonzero exactly there."""
    return ops.cast(ops.cast(ops.relu(x), "bool"), x.dtype)


def _gelu_tanh(x, g):
    c = math.sqrt(2.0 / math.pi)
    t = ops.tanh(ops.mul(c, ops.add(x, ops.mul(0.044715, ops.mul(x, ops.mul(x, x))))))
    d_inner = ops.mul(c, ops.add(1.0, ops.mul(3 * 0.044715, ops.mul(x, x))))
    dt = ops.mul(ops.sub(1.0, ops.mul(t, t)), d_inner)
    return ops.mul(g, ops.add(ops.mul(0.5, ops.add(1.0, t)), ops.mul(ops.mul(0.5, x), dt)))


def _gelu_exact(x, g):
    # d/dx x * Phi(x) = Phi(x) + x * phi(x)
    cdf = ops.mul(0.5, ops.add(1.0, ops.erf(ops.mul(x, 1.0 / math.sqrt(2.0)))))
    density = ops.mul(1.0 / math.sqrt(2.0 * math.pi), ops.exp(ops.mul(-0.5, ops.mul(x, x))))
    return ops.mul(g, ops.add(cdf, ops.mul(x, density)))


def _gelu(x, g, attrs):
    return _gelu_tanh(x, g) if attrs.get("approximate") == "tanh" else _gelu_exact(x, g)


UNARY_RULES: dict[str, Callable] = {
    "neg": lambda x, y, g, a: ops.neg(g),
    "exp": lambda x, y, g, a: ops.mul(g, y),
    "log": lambda x, y, g, a: ops.div(g, x),
    "sqrt": lambda x, y, g, a: ops.div(ops.mul(g, 0.5), y),
    "rsqrt": lambda x, y, g, a: ops.mul(ops.mul(g, -0.5), ops.mul(y, ops.mul(y, y))),
    "reciprocal": lambda x, y, g, a: ops.neg(ops.mul(g, ops.mul(y, y))),
    "tanh": lambda x, y, g, a: ops.mul(g, ops.sub(1.0, ops.mul(y, y))),
    "sigmoid": lambda x, y, g, a: ops.mul(g, ops.mul(y, ops.sub(1.0, y))),
    "relu": lambda x, y, g, a: ops.mul(g, _positive(x)),
    "silu": lambda x, y, g, a: ops.mul(
        g, ops.mul(ops.sigmoid(x), ops.add(1.0, ops.mul(x, ops.sub(1.0, ops.sigmoid(x)))))
    ),
    "gelu": lambda x, y, g, a: _gelu(x, g, a),
    "erf": lambda x, y, g, a: ops.mul(
        g, ops.mul(2.0 / math.sqrt(math.pi), ops.exp(ops.neg(ops.mul(x, x))))
    ),
    "abs": lambda x, y, g, a: ops.mul(g, ops.sub(_positive(x), _positive(ops.neg(x)))),
}


def _binary(expr, mapped, given):
    (g,) = given
    exact = expr.op_name in _EXACT
    lhs, rhs = (_widened(mapped[o], exact) if isinstance(o, TensorView) else o
                for o in expr.operands)  # fmt: skip
    y, g = _widened(mapped[expr.output], exact), _widened(g, exact)
    grads = BINARY_RULES[expr.op_name](lhs, rhs, y, g)
    return [grad for operand, grad in zip(expr.operands, grads, strict=True)
            if isinstance(operand, TensorView)]  # fmt: skip


def _pow(a, b, y, g):
    """d(a^b)/da = b a^(b-1); d(a^b)/db = a^b log(a), for whichever side is a tensor."""
    grad_a = grad_b = None
    if isinstance(a, TensorView):
        lower = ops.sub(b, 1.0) if isinstance(b, TensorView) else b - 1
        grad_a = ops.mul(g, ops.mul(b, ops.pow(a, lower)))
    if isinstance(b, TensorView):
        log_a = ops.log(a) if isinstance(a, TensorView) else math.log(a)
        grad_b = ops.mul(g, ops.mul(y, log_a))
    return grad_a, grad_b


def _extreme_pair(sign: float):
    """maximum (``sign`` 1) or minimum (-1), as torch's: the gradient goes to the larger
    (smaller) operand, half to each where they are equal (infinities included), and to
    both where either is NaN (neither loses a comparison with NaN)."""

    def rule(a, b, y, g):
        shared = ops.where(ops.eq(a, b), ops.mul(g, 0.5), g)
        a_loses, b_loses = (ops.lt(a, b), ops.gt(a, b))[:: int(sign)]
        return ops.where(a_loses, 0.0, shared), ops.where(b_loses, 0.0, shared)

    return rule


BINARY_RULES: dict[str, Callable] = {
    "add": lambda a, b, y, g: (g, g),
    "sub": lambda a, b, y, g: (g, ops.neg(g)),
    "mul": lambda a, b, y, g: (ops.mul(g, b), ops.mul(g, a)),
    "div": lambda a, b, y, g: (ops.div(g, b), ops.neg(ops.div(ops.mul(g, y), b))),
    "pow": _pow,
    "maximum": _extreme_pair(1.0),
    "minimum": _extreme_pair(-1.0),
}


def _cast(expr, mapped, given):
    source, target = expr.inputs[0].dtype, expr.output.dtype
    for dtype in (source, target):
        if dtype.storage_only:
            raise DifferentiationError(
                f"cast {source} -> {target} ({expr.output}): a gradient through an "
                f"{dtype} cast would be a choice (straight through, or not at all) the "
                "fusion does not state"
            )
    return [given[0]]


def _reduction(expr, mapped, given):
    (g,) = given
    x = mapped[expr.inputs[0]]
    flags = [d in expr.dims for d in range(x.ndim)]
    spread = ops.expand(ops.broadcast(g, flags), _shape(x))
    if expr.op_name == "mean":
        spread = ops.div(spread, float(_count(x, expr.dims)))
    elif expr.op_name in ("max", "min"):  # shared evenly by the elements that reach it
        reached = ops.broadcast(mapped[expr.output], flags)
        at = ops.cast(ops.eq(x, reached), x.dtype)  # none where it is NaN: NaN gradients
        ties = ops.broadcast(ops.sum(at, list(expr.dims)), flags)
        spread = ops.div(ops.mul(spread, at), ties)
    return [spread]


def _var_mean(expr, mapped, given):
    g_var, g_mean = given
    x = mapped[expr.inputs[0]]
    flags = [d in expr.dims for d in range(x.ndim)]
    count = _count(x, expr.dims)
    grad = None
    if g_var is not None:
        mean = ops.broadcast(mapped[expr.outputs[1]], flags)
        scale = 2.0 / max(count - expr.correction, 0) if count > expr.correction else math.inf
        grad = ops.mul(ops.mul(ops.sub(x, mean), scale), ops.broadcast(g_var, flags))
    if g_mean is not None:
        spread = ops.div(ops.expand(ops.broadcast(g_mean, flags), _shape(x)), float(count))
        grad = spread if grad is None else ops.add(grad, spread)
    return [grad]


def _count(x: TensorView, dims) -> int:
    extents = [x.shape[d] for d in dims]
    if not all(isinstance(e, int) for e in extents):
        raise DifferentiationError(
            f"a mean or variance over an axis of symbolic extent of {x}: its gradient "
            "divides by the count, which must be static for now"
        )
    return math.prod(extents)


def _broadcast(expr, mapped, given):
    (g,) = given
    flags = list(expr.is_broadcast_dim)
    if not any(flags):
        return [g]
    if _squeezable(g, flags, {}):
        return [_squeezed(g, flags, {})]
    return [ops.sum(g, [d for d, dropped in enumerate(flags) if dropped])]


# what a gradient of extent 1 along an axis may be rebuilt through without that axis
_SQUEEZABLE = (UnaryOp, BinaryOp, CastOp, CompareOp, WhereOp)


def _covers(made: BroadcastOp, flags: list[bool]) -> bool:
    """Whether broadcast ``made`` inserted every axis ``flags`` marks."""
    return all(inserted for inserted, dropped in zip(made.is_broadcast_dim, flags, strict=True)
               if dropped)  # fmt: skip


def _squeezable(t: TensorView, flags: list[bool], seen: dict[TensorView, bool]) -> bool:
    """Whether ``_squeezed`` drops ``flags``' axes of ``t`` without a sum: ``t`` is a
    broadcast of them, or an elementwise op of tensors that are (``seen``: decided so far)."""
    if t not in seen:
        made = t.definition
        if isinstance(made, BroadcastOp):
            seen[t] = _covers(made, flags)
        else:
            operands = [o for o in made.operands if isinstance(o, TensorView)] if made else []
            seen[t] = isinstance(made, _SQUEEZABLE) and all(
                o.ndim == t.ndim and _squeezable(o, flags, seen) for o in operands
            )
    return seen[t]


def _squeezed(t: TensorView, flags: list[bool], built: dict[TensorView, TensorView]) -> TensorView:
    """``t`` (``_squeezable``) without the axes ``flags`` marks, each of extent 1: a
    broadcast of them gives what it read, an elementwise op is rebuilt on its operands
    squeezed alike (``built``: those rebuilt so far). A LayerNorm or RMSNorm written
    with ``keepdim`` statistics ([rows, 1]: rstd, the variance plus eps) so gets the
    gradients of its statistics over [rows], row values to the normalization scheduler,
    not sums of one element that it cannot fuse."""
    if t not in built:
        made = t.definition
        if isinstance(made, BroadcastOp):
            kept = [inserted for inserted, dropped in zip(made.is_broadcast_dim, flags,
                                                          strict=True) if not dropped]  # fmt: skip
            built[t] = ops.broadcast(made.inputs[0], kept) if any(kept) else made.inputs[0]
        else:
            operands = [_squeezed(o, flags, built) if isinstance(o, TensorView) else o
                        for o in made.operands]  # fmt: skip
            built[t] = _REPLAY[type(made)](made, operands)
    return built[t]


def _expand(expr, mapped, given):
    return [given[0]]  # summed over the expanded axes by ``_fit``


def _reshape(expr, mapped, given):
    return [ops.reshape(given[0], _shape(expr.inputs[0]))]


def _permute(expr, mapped, given):
    inverse = [expr.dims.index(i) for i in range(len(expr.dims))]
    return [ops.permute(given[0], inverse)]


def _transpose_last(t: TensorView) -> TensorView:
    dims = list(range(t.ndim))
    dims[-2], dims[-1] = dims[-1], dims[-2]
    return ops.permute(t, dims)


def _matmul(expr, mapped, given):
    (g,) = given
    a, b = (mapped[t] for t in expr.inputs)
    # batch axes broadcast: each operand's gradient summed over the batch axes it lacks
    # (``_fit`` then sums those it has at extent 1)
    da = _summed_to_rank(ops.matmul(g, _transpose_last(b)), a.ndim)
    db = _summed_to_rank(ops.matmul(_transpose_last(a), g), b.ndim)
    return [da, db]


def _summed_to_rank(grad: TensorView, ndim: int) -> TensorView:
    extra = grad.ndim - ndim
    return ops.sum(grad, list(range(extra))) if extra > 0 else grad


def _weight_gradient(g: TensorView, x: TensorView) -> TensorView:
    """``g``ᵀ ``x`` summed over every leading axis: a linear's weight gradient. Where the
    leading extents are static, one matmul over the rows of both viewed as 2-D: a batched
    matmul then a sum over the batch writes a [batch, out, in] product and reads it back
    (1.3 ms a weight of the HF Llama layer at [1, 4096, 4096] on H200, 9 a step)."""
    leading = g.shape[:-1]
    if g.ndim > 2 and all(isinstance(extent, int) for extent in leading):
        rows = math.prod(leading)
        g, x = ops.reshape(g, [rows, g.shape[-1]]), ops.reshape(x, [rows, x.shape[-1]])
    return _summed_to_rank(ops.matmul(_transpose_last(g), x), 2)


def _linear(expr, mapped, given):
    (g,) = given
    x, weight = mapped[expr.inputs[0]], mapped[expr.inputs[1]]
    if x.ndim < 2:
        raise DifferentiationError(
            f"linear of the vector {expr.inputs[0]}: its gradient is not written yet "
            "(broadcast it to [1, K] first)"
        )
    # x: [..., in], weight: [out, in]; the weight's gradient sums over every leading axis
    grads = [ops.matmul(g, weight), _weight_gradient(g, x)]
    if len(expr.inputs) == 3:
        grads.append(ops.sum(g, list(range(g.ndim - 1))))
    return grads


def _where(expr, mapped, given):
    (g,) = given
    cond = mapped[expr.inputs[0]]
    grads = [None]  # the condition has none
    for position, operand in enumerate(expr.operands[1:]):
        if isinstance(operand, TensorView):
            taken = ops.where(cond, g, 0.0) if position == 0 else ops.where(cond, 0.0, g)
            grads.append(taken)
    return grads


def _slice_grad(expr, mapped, given):
    """Zeros where the slice took nothing: the gradient padded back to the input."""
    (g,) = given
    x = expr.inputs[0]
    if any(step != 1 for step in expr.steps):
        raise DifferentiationError(
            f"slice {expr.output}: the gradient of a slice with a step is not written yet"
        )
    after = [
        _extent(axis.extent) - stop for axis, stop in zip(x.logical_axes, expr.stops, strict=True)
    ]
    return [ops.pad(g, list(expr.starts), [a if isinstance(a, int) else 0 for a in after])]


def _select_grad(expr, mapped, given):
    """The gradient put back at ``index`` of the removed axis, zeros elsewhere on it."""
    (g,) = given
    x = expr.inputs[0]
    extent = x.axis(expr.dim).extent
    if not isinstance(extent, int):
        raise DifferentiationError(
            f"select {expr.output}: the gradient of a select on a symbolic axis is not written yet"
        )
    restored = ops.broadcast(g, [d == expr.dim for d in range(x.ndim)])
    before = [expr.index if d == expr.dim else 0 for d in range(x.ndim)]
    after = [extent - expr.index - 1 if d == expr.dim else 0 for d in range(x.ndim)]
    return [ops.pad(restored, before, after)]


def _pad_grad(expr, mapped, given):
    (g,) = given
    x = expr.inputs[0]
    padded = zip(x.logical_axes, expr.before, expr.after, strict=True)
    stops = [b + _extent(axis.extent) if (b or a) else None for axis, b, a in padded]
    return [ops.slice(g, list(expr.before), stops)]


def _cat_grad(expr, mapped, given):
    """Each piece's gradient: its slice of the joined axis."""
    (g,) = given
    grads, start = [], 0
    for tensor in expr.inputs:
        extent = tensor.shape[expr.dim]
        starts = [start if d == expr.dim else 0 for d in range(g.ndim)]
        stops = [start + extent if d == expr.dim else None for d in range(g.ndim)]
        grads.append(ops.slice(g, starts, stops))
        start += extent
    return grads


def _embedding_grad(expr, mapped, given):
    (g,) = given
    table, indices, rows = (mapped[t] for t in expr.inputs)
    return [ops.embedding_grad(g, indices, rows, expr.padding_idx), None, None]


def _attention_grad(expr, mapped, given):
    (g,) = given
    q, k, v, *mask = (mapped[t] for t in expr.inputs)
    grads = ops.attention_grad(g, q, k, v, mask[0] if mask else None, expr.causal, expr.scale)
    return [*grads, *[None] * len(mask)]


def _torch_op_grad(expr, mapped, given):
    """PyTorch's own gradient of the op (a vjp ``TorchOp``), from one gradient per
    floating-point output (zeros where none arrives)."""
    grads = [
        _zeros_like(mapped[out]) if grad is None else grad
        for out, grad in zip(expr.outputs, given, strict=True)
        if out.dtype.is_floating  # torch's autograd takes a gradient of these
    ]
    inputs = [mapped[t] for t in expr.inputs]
    wanted = [i for i, t in enumerate(expr.inputs) if differentiable(t)]
    found = dict(zip(wanted, torch_vjp(expr, inputs, grads, wanted) if wanted else [],
                     strict=True))  # fmt: skip
    return [found.get(i) for i in range(len(inputs))]


def _zeros_like(value: TensorView) -> TensorView:
    """Zeros shaped as ``value`` (even where it is NaN)."""
    return ops.mul(ops.cast(ops.cast(value, "bool"), value.dtype), 0.0)


GRADIENT_RULES: dict[type, Callable] = {
    UnaryOp: _unary,
    BinaryOp: _binary,
    CastOp: _cast,
    # a copy of the gradient: where the forward's copy moves a tensor (to another mesh or
    # layout), the gradient's copy moves it back
    SetOp: lambda expr, mapped, given: [ops.set(given[0])],
    BroadcastOp: _broadcast,
    ExpandOp: _expand,
    ReshapeOp: _reshape,
    PermuteOp: _permute,
    ReductionOp: _reduction,
    VarMeanOp: _var_mean,
    MatmulOp: _matmul,
    LinearOp: _linear,
    WhereOp: _where,
    CompareOp: lambda expr, mapped, given: [None] * len(expr.inputs),  # a bool has none
    SliceOp: _slice_grad,
    SelectOp: _select_grad,
    PadOp: _pad_grad,
    DetachOp: lambda expr, mapped, given: [None],  # a stop-gradient
    ConcatOp: _cat_grad,
    EmbeddingOp: _embedding_grad,
    AttentionOp: _attention_grad,
    TorchOp: _torch_op_grad,
}


def _rule(expr: Expr) -> Callable:
    """The gradient rule of ``expr``; raises ``DifferentiationError`` if it has none."""
    rule = GRADIENT_RULES.get(type(expr))
    name = expr.op_name
    missing = (
        rule is None
        or (isinstance(expr, UnaryOp) and name not in UNARY_RULES)
        or (isinstance(expr, BinaryOp) and name not in BINARY_RULES)
        or (isinstance(expr, ReductionOp) and name not in ("sum", "mean", "max", "min"))
        or (isinstance(expr, TorchOp) and expr.vjp is not None)  # no second derivative
    )
    if missing:
        raise DifferentiationError(
            f"{name} ({expr.output if len(expr.outputs) == 1 else expr.outputs[0]}) has no "
            f"gradient rule; differentiable ops: {_known()}"
        )
    return rule


def _known() -> str:
    names = [*UNARY_RULES, *BINARY_RULES, "eq", "ne", "lt", "le", "gt", "ge", "cast", "set",
             "broadcast", "expand", "reshape", "permute", "slice", "select", "pad", "where",
             "sum", "mean", "max", "min", "var_mean", "matmul", "linear", "detach", "cat",
             "embedding", "attention", "torch_op"]  # fmt: skip
    return ", ".join(names)
