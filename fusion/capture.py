"""Capturing a PyTorch module as a fusion: ``torch.export``'s ATen graph, op by op.

``capture(module, example_inputs)`` exports the module (its parameters and buffers
lifted to inputs) and translates every ATen op of the graph into the IR through
``ATEN``, a table from op to a function building it with ``fusion.ops``. An ATen op
without a translation falls back to PyTorch: an opaque ``TorchOp`` calls it on its
tensors (``fusion.torch_ops``; split as torch's DTensor strategy splits it, else its
tensors whole on every rank: ``sharding.torch_strategy``), and the fusion's
printout lists it under "fell back to torch". Before anything is built, every op of the
graph is looked up: ops that are neither translated nor ATen ops (higher-order ops) raise
one ``CaptureError`` listing each of them with the submodules it is used in. Broadcasting
follows torch's (operands of lower rank get leading axes), negative dims count from the
last, ``keepdim`` is kept.

The fusion's inputs are the module's parameters and buffers, in the order the export
lifted them, then the example inputs' positions; ``Captured.inputs(module, *args)``
lists the tensors to run it with, ``Captured.parameter_names`` names the first ones.
``Captured.boundaries`` gives, per submodule, the tensors that cross into it and out of
it (what a plan's per-module layouts place).

Dropout in training mode (``aten.dropout``) becomes ``x * dropout_mask(seed, ...)``, the
mask a pure function of a seed and each element's global index (``fusion.random``: the
same on every rank and in the backward). The seed is one more fusion input, after the
example inputs: a one-element int64 tensor, the same on every rank, a new one per call
(``Captured.seeded`` says whether there is one; ``Captured.inputs(..., seed=)`` gives it).

Example::

    captured = capture(block, [x])
    (y,) = captured.fd.execute(captured.inputs(block, x))  # == block(x)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.fx.node import map_arg

from fusion import ops
from fusion.definition import FusionDefinition
from fusion.dtypes import DataType
from fusion.errors import FusionError
from fusion.exprs import Expr
from fusion.ir import TensorView
from fusion.nn_ops import group_norm, layer_norm, rms_norm
from fusion.torch_ops import torch_op


class CaptureError(FusionError):
    """The module cannot be captured: ops that are neither translated nor ATen ops (all
    of them, each with where it is used), or a graph the export could not produce."""


@dataclass
class Boundary:
    """A submodule in the fusion: the tensors it reads from outside (parameters and
    buffers aside) and those it hands out, in the order the graph meets them, and the
    exprs its ops became."""

    reads: list[TensorView]
    hands: list[TensorView]
    exprs: list[Expr]


@dataclass
class Captured:
    """A captured module: ``fd`` its fusion; ``parameter_names`` the module's parameters
    and buffers that are the fusion's first inputs, in order (``buffers`` names the
    latter); the example inputs follow, then, where ``seeded``, dropout's seed."""

    fd: FusionDefinition
    parameter_names: list[str]
    buffers: frozenset[str] = frozenset()
    boundaries: dict[str, Boundary] = field(default_factory=dict)  # by submodule path
    seeded: bool = False  # dropout in training mode: the last input is its seed

    def inputs(
        self, module: torch.nn.Module, *args: torch.Tensor, seed: int | None = None
    ) -> list[torch.Tensor]:
        """The fusion's inputs: ``module``'s current parameters and buffers, then ``args``,
        then (given) ``seed`` as the seed input a ``seeded`` capture takes."""
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        found = [state[name].detach() for name in self.parameter_names] + list(args)
        if seed is not None:
            found.append(seed_tensor(seed))
        return found


def seed_tensor(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``seed`` as a captured module's seed input: a one-element int64 tensor."""
    return torch.tensor([seed], dtype=torch.int64, device=device)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    empty = a.numel() == 0 or b.numel() == 0
    return not empty and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def capture(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor]) -> Captured:
    """``module`` as a fusion (see the module)."""
    # one tensor passed as two arguments would be exported as one input read twice: the
    # fusion's second input then unused, whatever a call passes there (a loss's targets
    # silently its tokens); each argument gets its own tensor
    examples = list(example_inputs)
    for position, example in enumerate(examples):
        if isinstance(example, torch.Tensor) and any(
            isinstance(other, torch.Tensor) and _shares_memory(example, other)
            for other in examples[:position]
        ):
            examples[position] = example.clone()
    try:
        exported = torch.export.export(module, tuple(examples))
    except Exception as error:  # torch's own reasons: data-dependent control flow, ...
        raise CaptureError(
            f"torch.export could not export {type(module).__name__}: {error}"
        ) from error
    graph = exported.graph_module.graph
    _check_translations(graph)
    signature = exported.graph_signature
    lifted = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    names: list[str] = []
    values: dict[str, object] = {}
    made: dict[str, list[Expr]] = {}  # per node, the exprs it became
    with FusionDefinition(type(module).__name__) as fd:
        seed = _SeedInput(fd)
        for node in graph.nodes:
            if node.op == "placeholder":
                value = node.meta["val"]
                shape = [int(e) if isinstance(e, int) else str(e) for e in value.shape]
                values[node.name] = fd.define_tensor(shape, DataType.from_torch(value.dtype))
                if node.name in lifted:
                    names.append(lifted[node.name])
            elif node.op == "call_function":
                if node.target in _IGNORED:
                    continue
                # the values of the nodes an argument holds, at any depth (fx's own walk)
                args = map_arg(node.args, lambda arg: values[arg.name])
                kwargs = dict(map_arg(node.kwargs, lambda arg: values[arg.name]))
                translate = _translation(node.target, strict=False)
                before = len(fd.fusion.exprs)
                if translate is None:  # an ATen op (checked above): PyTorch runs it
                    values[node.name] = torch_op(node.target, args, kwargs, fd.fusion,
                                                 node.meta.get("val"))  # fmt: skip
                else:
                    if translate in _MAKERS:  # makes a tensor from nothing: needs the fusion
                        kwargs["fusion"] = fd
                    if translate in _SEEDED:
                        kwargs["seed"] = seed
                    values[node.name] = translate(*args, **kwargs)
                made[node.name] = fd.fusion.exprs[before:]
            elif node.op == "output":
                for out in node.args[0]:
                    fd.add_output(values[out.name])
    buffers = frozenset(signature.inputs_to_buffers.values())
    boundaries = _boundaries(graph, values, made, set(lifted))
    return Captured(fd, names, buffers, boundaries, seeded=seed.tensor is not None)


class _SeedInput:
    """The fusion's seed input, defined where the first random op needs it (after the
    example inputs: the graph's placeholders come first)."""

    def __init__(self, fd: FusionDefinition) -> None:
        self.fd = fd
        self.tensor: TensorView | None = None

    def __call__(self) -> TensorView:
        if self.tensor is None:
            self.tensor = self.fd.define_tensor([1], DataType.from_torch(torch.int64))
        return self.tensor


def _boundaries(graph, values: dict, made: dict, lifted: set[str]) -> dict[str, Boundary]:
    """Per submodule path, the tensors crossing into it and out of it, and its exprs."""
    inside: dict[str, set[str]] = {}
    for node in graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path:
                inside.setdefault(path, set()).add(node.name)
    found = {}
    for path, names in inside.items():
        reads, hands = [], []
        for node in graph.nodes:
            if node.name in names:
                for arg in node.all_input_nodes:
                    if arg.name not in names and arg.name not in lifted:
                        reads.append(arg.name)
                if any(user.name not in names for user in node.users):
                    hands.append(node.name)
        tensors = [[values.get(n) for n in dict.fromkeys(group)] for group in (reads, hands)]
        reads, hands = ([t for t in group if isinstance(t, TensorView)] for group in tensors)
        exprs = [e for node in graph.nodes if node.name in names for e in made.get(node.name, [])]
        found[path] = Boundary(reads, hands, exprs)
    return found


def _check_translations(graph) -> None:
    missing: dict[str, list[str]] = {}
    drawn: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target not in _IGNORED:
            if _translation(node.target, strict=False) is not None:
                continue
            where = node.meta.get("nn_module_stack") or {}
            path = list(where.values())[-1][0] if where else ""
            if not isinstance(node.target, torch._ops.OpOverload):
                missing.setdefault(str(node.target), []).append(path or "the module itself")
            elif torch.Tag.nondeterministic_seeded in node.target.tags:
                drawn.setdefault(str(node.target), []).append(path or "the module itself")
            elif _updates_running_statistics(node):
                raise CaptureError(
                    f"{node.target} in {path or 'the module itself'}: batch norm in training "
                    "mode updates its running statistics in place, which a replayed or "
                    "recomputed program would do more than once a step: capture the module "
                    "in eval() mode, or with track_running_stats=False"
                )
    if drawn:
        # run by PyTorch, a random op would draw other numbers on each rank (a tensor
        # every rank holds whole would differ between them) and again where the backward
        # replays it for its gradient: silently wrong, so refused before anything runs
        lines = [f"  {op}: in {', '.join(sorted(set(paths)))}" for op, paths in drawn.items()]
        raise CaptureError(
            f"{len(drawn)} random op(s) have no translation into the IR, and run by "
            "PyTorch they would draw different numbers on each rank and in the backward:\n"
            + "\n".join(lines)
            + "\nDropout (nn.Dropout) in training mode is translated, counter-based from a "
            "seed input"
        )
    if missing:
        lines = [f"  {op}: in {', '.join(sorted(set(paths)))}" for op, paths in missing.items()]
        raise CaptureError(
            f"{len(missing)} op(s) are neither ATen ops nor translated into the IR:\n"
            + "\n".join(lines)
        )


def _updates_running_statistics(node) -> bool:
    """Whether ``node`` is a batch norm in training mode with running statistics (which
    it writes without its schema saying so)."""
    if getattr(node.target, "overloadpacket", None) is not torch.ops.aten.batch_norm:
        return False
    running_mean, training = node.args[3], node.args[5]
    return bool(training) and running_mean is not None


def _translation(target, strict: bool = True) -> Callable | None:
    found = ATEN.get(target) or ATEN.get(getattr(target, "overloadpacket", None))
    if found is None and strict:
        raise CaptureError(f"{target}: no translation")
    return found


# -- translations --------------------------------------------------------------------


def _dims(x: TensorView, dims) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims or range(x.ndim))
    return [d % x.ndim for d in dims]


def _aligned(*operands):
    """Operands of lower rank broadcast with leading axes, as torch's elementwise ops."""
    rank = max((o.ndim for o in operands if isinstance(o, TensorView)), default=0)
    return [
        ops.broadcast(o, [True] * (rank - o.ndim) + [False] * o.ndim)
        if isinstance(o, TensorView) and o.ndim < rank
        else o
        for o in operands
    ]


def _binary(op: Callable) -> Callable:
    return lambda a, b, **_: op(*_aligned(a, b))


def _add(a, b, alpha=1):
    return ops.add(*_aligned(a, ops.mul(b, alpha) if alpha != 1 else b))


def _sub(a, b, alpha=1):
    return ops.sub(*_aligned(a, ops.mul(b, alpha) if alpha != 1 else b))


def _div(a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise CaptureError(f"div with rounding_mode={rounding_mode!r}: no translation yet")
    return ops.div(*_aligned(a, b))


def _reduction(op: str) -> Callable:
    def build(x, dims=None, keepdim=False, dtype=None):
        if dtype is not None:
            x = ops.cast(x, DataType.from_torch(dtype))
        return getattr(ops, op)(x, _dims(x, dims), keepdim=keepdim)

    return build


def _var(x, dims=None, correction=None, keepdim=False, unbiased=None):
    correction = 1 if correction is None else correction
    var, _ = ops.var_mean(x, _dims(x, dims), correction=correction, keepdim=keepdim)
    return var


def _var_mean(x, dims=None, unbiased=None, keepdim=False, correction=None):
    """``torch.var_mean``: ``unbiased`` (the ``dim`` overload) or ``correction``."""
    if correction is None:
        correction = 0 if unbiased is False else 1
    return ops.var_mean(x, _dims(x, dims), correction=correction, keepdim=keepdim)


def _softmax(x, dim, half_to_float=False):
    dim = dim % x.ndim  # the max a stop-gradient: its gradient cancels exactly
    shifted = ops.sub(x, ops.detach(ops.max(x, [dim], keepdim=True)))
    exp = ops.exp(shifted)
    return ops.div(exp, ops.sum(exp, [dim], keepdim=True))


def _log_softmax(x, dim, half_to_float=False, dtype=None):
    """``x - max - log(sum(exp(x - max)))`` along ``dim`` (16-bit floats in float32,
    rounded once), the max a stop-gradient (its gradient cancels exactly)."""
    if dtype is not None:
        x = ops.cast(x, DataType.from_torch(dtype))
    wide = ops.cast(x, DataType.float32) if x.dtype.bits < 32 else x
    dim = dim % x.ndim
    shifted = ops.sub(wide, ops.detach(ops.max(wide, [dim], keepdim=True)))
    result = ops.sub(shifted, ops.log(ops.sum(ops.exp(shifted), [dim], keepdim=True)))
    return result if result.dtype == x.dtype else ops.cast(result, x.dtype)


def _class_loss(logp, target, weight, reduction, ignore_index, label_smoothing, name):
    """The negative log-likelihood of integer ``target`` classes (axis 1 of ``logp``, or
    its only axis), reduced as torch's (0 none, 1 mean over the counted, 2 sum)."""
    classes = 1 if logp.ndim >= 2 else 0
    count = logp.shape[classes]
    if not target.dtype.is_integer:  # class probabilities
        if weight is not None or label_smoothing:
            raise CaptureError(f"{name} with probabilities and a weight or label smoothing: "
                               "no translation yet")  # fmt: skip
        per = ops.neg(ops.sum(ops.mul(logp, target), [classes]))
        if reduction == 1:
            return ops.div(ops.sum(per), math.prod(per.shape) if per.ndim else 1)
        return ops.sum(per) if reduction == 2 else per
    if weight is not None and label_smoothing:
        raise CaptureError(f"{name} with a weight and label smoothing: no translation yet")
    # each class's index along the class axis, each target along it: equal where picked
    indices = ops.broadcast(ops.iota(logp, count), [d != classes for d in range(logp.ndim)])
    targets = ops.broadcast(target, [d == classes for d in range(logp.ndim)])
    chosen = ops.eq(indices, targets)
    per = ops.neg(ops.sum(ops.where(chosen, logp, 0.0), [classes]))
    counted = ops.ne(target, ignore_index)
    if weight is not None:
        weight = ops.broadcast(weight, [d != classes for d in range(logp.ndim)])
        weights = ops.sum(ops.where(chosen, weight, 0.0), [classes])
        per = ops.mul(per, weights)
    if label_smoothing:
        smooth = ops.div(ops.neg(ops.sum(logp, [classes])), count)
        per = ops.add(ops.mul(per, 1.0 - label_smoothing), ops.mul(smooth, label_smoothing))
    per = ops.where(counted, per, 0.0)
    if reduction == 0:
        return per
    total = ops.sum(per)
    if reduction == 2:
        return total
    counts = ops.cast(counted, per.dtype) if weight is None else ops.where(counted, weights, 0.0)
    return ops.div(total, ops.sum(counts))


def _cross_entropy(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """torch's cross-entropy: ``log_softmax`` over the classes, then the loss of the
    targets; a class axis split over ranks (a vocabulary-parallel head) needs no gather:
    its max and sums are combined across ranks, the rest stays split."""
    logp = _log_softmax(x, 1 if x.ndim >= 2 else 0)
    wide = ops.cast(logp, DataType.float32) if logp.dtype.bits < 32 else logp
    loss = _class_loss(wide, target, weight, reduction, ignore_index, label_smoothing,
                       "cross_entropy")  # fmt: skip
    return loss if loss.dtype == x.dtype else ops.cast(loss, x.dtype)


def _nll_loss(logp, target, weight=None, reduction=1, ignore_index=-100):
    wide = ops.cast(logp, DataType.float32) if logp.dtype.bits < 32 else logp
    loss = _class_loss(wide, target, weight, reduction, ignore_index, 0.0, "nll_loss")
    return loss if loss.dtype == logp.dtype else ops.cast(loss, logp.dtype)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise CaptureError("embedding with scale_grad_by_freq or sparse: no translation yet")
    return ops.embedding(weight, indices, None if padding_idx == -1 else padding_idx)


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):  # fmt: skip
    if dropout_p:
        raise CaptureError("scaled_dot_product_attention with dropout: no translation yet "
                           "(capture the module in eval mode)")  # fmt: skip
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k, v = _repeat_heads(k, q.shape[-3]), _repeat_heads(v, q.shape[-3])
    if attn_mask is not None and attn_mask.ndim < q.ndim:
        attn_mask = ops.broadcast(attn_mask, [True] * (q.ndim - attn_mask.ndim)
                                  + [False] * attn_mask.ndim)  # fmt: skip
    return ops.attention(q, k, v, attn_mask, causal=is_causal, scale=scale)


def _repeat_heads(x, heads: int):
    """Grouped-query attention's keys or values [..., kv_heads, seq, dim] for ``heads``
    query heads: each head repeated for its group, as ``enable_gqa`` (and HF's
    ``repeat_kv``) do: an expand and a reshape, which a split of the heads passes."""
    *batch, kv_heads, seq, dim = x.shape
    if heads % kv_heads:
        raise CaptureError(f"scaled_dot_product_attention(enable_gqa=True): {heads} query "
                           f"heads, not a multiple of {kv_heads} key and value heads")  # fmt: skip
    groups = heads // kv_heads
    wide = ops.broadcast(x, [False] * (len(batch) + 1) + [True, False, False])
    wide = ops.expand(wide, [*batch, kv_heads, groups, seq, dim])
    return ops.reshape(wide, [*batch, heads, seq, dim])


def _arange(start, end=None, step=1, dtype=None, fusion=None, **_):
    """``iota`` scaled and shifted (int64 unless a float bound or ``dtype``)."""
    if end is None:
        start, end = 0, start
    count = max(0, math.ceil((end - start) / step))
    floating = any(isinstance(b, float) for b in (start, end, step))
    result = ops.iota(fusion, count)
    if floating:
        result = ops.cast(result, DataType.float32)
    if step != 1:
        result = ops.mul(result, step)
    if start != 0:
        result = ops.add(result, start)
    wanted = DataType.from_torch(dtype) if dtype is not None else result.dtype
    return result if result.dtype == wanted else ops.cast(result, wanted)


def _transpose(x, a, b):
    dims = list(range(x.ndim))
    dims[a % x.ndim], dims[b % x.ndim] = dims[b % x.ndim], dims[a % x.ndim]
    return ops.permute(x, dims)


def _unsqueeze(x, dim):
    dim = dim % (x.ndim + 1)
    return ops.broadcast(x, [d == dim for d in range(x.ndim + 1)])


def _squeeze(x, dims=None):
    dims = _dims(x, dims) if dims is not None else [d for d in range(x.ndim) if x.shape[d] == 1]
    kept = [e for d, e in enumerate(x.shape) if not (d in dims and e == 1)]
    return ops.reshape(x, [e if isinstance(e, int) else str(e) for e in kept])


def _reshape(x, shape):
    return ops.reshape(x, [e if isinstance(e, int) else str(e) for e in shape])


def _flatten(x, start_dim=0, end_dim=-1):
    """``torch.flatten``: axes ``start_dim`` to ``end_dim`` merged by a reshape, which keeps
    a split of the other axes (a vocabulary-split head's logits flattened over [batch,
    seq] stay split; the torch op's DTensor rule would gather them)."""
    if x.ndim == 0:
        return ops.reshape(x, [1])
    start, end = start_dim % x.ndim, end_dim % x.ndim
    if start == end:
        return x
    return _reshape(x, [*x.shape[:start], -1, *x.shape[end + 1 :]])


def _slice(x, dim=0, start=None, end=None, step=1):
    dim = dim % x.ndim
    starts, stops, steps = [0] * x.ndim, [None] * x.ndim, [1] * x.ndim
    starts[dim], steps[dim] = start or 0, step
    stops[dim] = None if end is None or end >= 2**62 else end
    return ops.slice(x, starts, stops, steps)


def _split(x, sizes, dim=0):
    """torch's split (a size per piece, or one size for all but a shorter last piece)."""
    dim = dim % x.ndim
    extent = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, extent - start) for start in range(0, extent, sizes)]
    pieces, start = [], 0
    for size in sizes:
        pieces.append(_slice(x, dim, start, start + size))
        start += size
    return pieces


def _unbind(x, dim=0):
    """torch's unbind: one piece per index of ``dim``, ``dim`` removed."""
    dim = dim % x.ndim
    return [ops.select(x, dim, index) for index in range(x.shape[dim])]


def _dropout(x, p, train, seed):
    """Dropout as exported (``aten.dropout(x, p, train)``): out of training, or with
    ``p == 0``, the identity; in training ``x * dropout_mask(seed, x's shape, p)``, the
    mask an IR op drawn from the seed (``fusion.random``), the product in float32."""
    if not train or p == 0:
        return x
    shape = list(x.shape)
    if not all(isinstance(e, int) for e in shape):
        raise CaptureError(f"dropout in training mode on {x} of symbolic shape {shape}: "
                           "its mask needs a static shape")  # fmt: skip
    mask = ops.dropout_mask(seed(), shape, float(p))
    if x.dtype == DataType.float32:
        return ops.mul(x, mask)
    return ops.cast(ops.mul(ops.cast(x, DataType.float32), mask), x.dtype)


def _other_dropout(x, p, train):
    """``feature_dropout`` and ``alpha_dropout``: out of training, or with ``p == 0``, the
    identity; in training refused (their masks, per channel or with alpha's affine, are
    not translated; run by PyTorch they would draw other masks on each rank)."""
    if not train or p == 0:
        return x
    raise CaptureError(
        f"feature or alpha dropout with p={p} in training mode is not translated into the "
        "IR yet, and run by PyTorch it would draw different masks on each rank and in the "
        "backward: capture the module in eval() mode (or with p=0), or use nn.Dropout"
    )


def _cat(tensors, dim=0):
    """torch's cat (empty pieces left out; one piece is itself)."""
    tensors = [t for t in tensors if t.shape[dim % t.ndim] != 0]
    return tensors[0] if len(tensors) == 1 else ops.cat(tensors, dim % tensors[0].ndim)


def _masked_fill(x, mask, value):
    return ops.where(*_aligned(mask, value, x))


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return layer_norm(x, len(normalized_shape), weight, bias, eps)[0]


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    """``(y, mean, rstd)``, the statistics in ``x``'s dtype with the normalized axes kept
    (extent 1), as torch's CPU kernels (the exported graph's)."""
    y, mean, rstd = layer_norm(x, len(normalized_shape), weight, bias, eps)
    kept = [d >= mean.ndim for d in range(x.ndim)]
    return (y, *(ops.broadcast(_statistic(s, x), kept) for s in (mean, rstd)))


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    return rms_norm(x, len(normalized_shape), weight, eps)[0]


def _fused_rms_norm(x, normalized_shape, weight, eps):
    """``(y, rstd)``, ``rstd`` in the compute dtype with the normalized axes kept, as
    torch's kernels hand it out."""
    y, rstd = rms_norm(x, len(normalized_shape), weight, eps)
    return y, ops.broadcast(rstd, [d >= rstd.ndim for d in range(x.ndim)])


def _group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return group_norm(x, num_groups, weight, bias, eps)[0]


def _native_group_norm(x, weight, bias, batch, channels, spatial, groups, eps):
    """``(y, mean, rstd)``, the statistics [N, groups] in ``x``'s dtype (torch's CPU)."""
    y, mean, rstd = group_norm(x, groups, weight, bias, eps)
    return y, _statistic(mean, x), _statistic(rstd, x)


def _statistic(value: TensorView, x: TensorView) -> TensorView:
    """A norm's float32 statistic in ``x``'s dtype, as torch's CPU kernels hand it out."""
    return value if value.dtype == x.dtype else ops.cast(value, x.dtype)


def _to(x, dtype=None, *_, **kwargs):
    dtype = dtype if isinstance(dtype, torch.dtype) else kwargs.get("dtype")
    return x if dtype is None else ops.cast(x, DataType.from_torch(dtype))


def _gelu(x, approximate="none"):
    return ops.gelu(x, approximate=approximate)


def _linear(x, weight, bias=None):
    return ops.linear(x, weight, bias)


aten = torch.ops.aten
ATEN: dict[object, Callable] = {
    aten.add: _add,
    aten.sub: _sub,
    aten.rsub: lambda a, b, alpha=1: _sub(b, a, alpha),
    aten.mul: _binary(ops.mul),
    aten.div: _div,
    aten.pow: _binary(ops.pow),
    aten.maximum: _binary(ops.maximum),
    aten.minimum: _binary(ops.minimum),
    aten.eq: _binary(ops.eq),
    aten.ne: _binary(ops.ne),
    aten.lt: _binary(ops.lt),
    aten.le: _binary(ops.le),
    aten.gt: _binary(ops.gt),
    aten.ge: _binary(ops.ge),
    aten.where: lambda c, x, y: ops.where(*_aligned(c, x, y)),
    aten.neg: ops.neg,
    aten.abs: ops.abs,
    aten.exp: ops.exp,
    aten.log: ops.log,
    aten.sqrt: ops.sqrt,
    aten.rsqrt: ops.rsqrt,
    aten.reciprocal: ops.reciprocal,
    aten.tanh: ops.tanh,
    aten.sigmoid: ops.sigmoid,
    aten.relu: ops.relu,
    aten.silu: ops.silu,
    aten.erf: ops.erf,
    aten.gelu: _gelu,
    aten.sum: _reduction("sum"),
    aten.mean: _reduction("mean"),
    aten.amax: _reduction("max"),
    aten.amin: _reduction("min"),
    aten.var: _var,
    aten.var_mean: _var_mean,
    aten.softmax: _softmax,
    aten._softmax: _softmax,
    aten.log_softmax: _log_softmax,
    aten._log_softmax: _log_softmax,
    aten.cross_entropy_loss: _cross_entropy,
    aten.nll_loss: _nll_loss,
    aten.nll_loss_nd: _nll_loss,
    aten.embedding: _embedding,
    aten.layer_norm: _layer_norm,
    aten.native_layer_norm: _native_layer_norm,
    aten.rms_norm: _rms_norm,
    aten._fused_rms_norm: _fused_rms_norm,
    aten.group_norm: _group_norm,
    aten.native_group_norm: _native_group_norm,
    aten.scaled_dot_product_attention: _attention,
    aten.arange: _arange,
    aten.linear: _linear,
    aten.mm: ops.matmul,
    aten.bmm: ops.matmul,
    aten.matmul: ops.matmul,
    aten.t: lambda x: ops.permute(x, [1, 0]),
    aten.permute: lambda x, dims: ops.permute(x, [d % x.ndim for d in dims]),
    aten.transpose: _transpose,
    aten.view: _reshape,
    aten.reshape: _reshape,
    aten._unsafe_view: _reshape,
    aten.flatten: _flatten,
    aten.expand: lambda x, shape, implicit=False: ops.expand(
        *_aligned(x), [e if e != -1 else x.shape[d] for d, e in enumerate(shape)]
    ),
    aten.unsqueeze: _unsqueeze,
    aten.squeeze: _squeeze,
    aten.slice: _slice,
    aten.split: _split,
    aten.split_with_sizes: _split,
    aten.unbind: _unbind,
    aten.dropout: _dropout,
    aten.feature_dropout: _other_dropout,
    aten.alpha_dropout: _other_dropout,
    aten.cat: _cat,
    aten.masked_fill: _masked_fill,
    aten.select: lambda x, dim, index: ops.select(x, dim % x.ndim, index),
    aten.to: _to,
    aten._to_copy: _to,
    aten.clone: lambda x, **_: ops.set(x),
    aten.contiguous: lambda x, **_: x,
    aten.alias: lambda x: x,
    aten.detach: lambda x: x,
    operator.getitem: lambda values, index: values[index],
}
# translations that make a tensor from nothing (they are handed the fusion)
_MAKERS = {_arange}
_SEEDED = {_dropout}  # random ops: take the capture's seed input
# ops of the graph that compute nothing (metadata checks)
_IGNORED = {aten._assert_tensor_metadata.default}
