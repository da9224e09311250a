"""Opaque torch ops: ATen ops the IR has no translation for, run by PyTorch.

``torch_op(target, args, kwargs, fusion)`` adds a ``TorchOp`` calling the ATen overload
``target`` on its tensor arguments (``TensorView``s anywhere in ``args`` and ``kwargs``,
lists included); its outputs' shapes and dtypes are those of the graph's ``val``
metadata (``like``) or of the op run on meta tensors. ``run_torch_op`` computes it (the
reference evaluator and the executor both call it), ``torch_vjp`` adds its backward: a
second ``TorchOp`` whose values PyTorch's autograd computes from the forward op.

Sharding splits a torch op as PyTorch's own DTensor strategy for it does, where torch
has one and the split checks out on sample values (``sharding.torch_strategy``), and
otherwise keeps every tensor of it whole on every rank (``sharding.rules``), so that the
op sees what it would see on one device. A random op never gets here: capture
refuses it (run by PyTorch it would draw other numbers on each rank and in the
backward's replay; ``fusion.capture``). An op whose schema writes its inputs (``add_``)
runs on copies of them: the fusion's values never change under it (a composite op that
writes without saying so, ``batch_norm`` in training mode updating its running
statistics, is refused by capture).

Example::

    y = torch_op(torch.ops.aten.cumsum.default, (x, 1), {}, fd.fusion)
    # T1_float[iS2{3}, iS3{4}] = torch_op[aten.cumsum.default](T0, dim=1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fusion.dtypes import DataType
from fusion.errors import DefinitionError
from fusion.exprs import TensorSlot, TorchOp
from fusion.ir import Fusion, Symbol, TensorView


def torch_op(
    target: object, args: Sequence, kwargs: dict, fusion: Fusion, like: object = None
) -> TensorView | tuple[TensorView, ...] | list[TensorView] | None:
    """``target(*args, **kwargs)`` run by PyTorch (see the module): its output tensor, or
    a tuple (list) of them as the op returns; None where it returns no tensor (a check).
    ``like``: the op's outputs as a graph traced them (tensors carrying shape and
    dtype); without it, the op runs on meta tensors to find them."""
    tensors: list[TensorView] = []

    def slot(value: object) -> object:
        tensors.append(value)
        return TensorSlot(len(tensors) - 1)

    arguments = _mapped(tuple(args), TensorView, slot)
    keywords = _mapped(dict(kwargs), TensorView, slot)
    if like is None:
        like = _on_meta(target, arguments, keywords, tensors)
    results = list(like) if isinstance(like, (tuple, list)) else [like]
    if all(result is None for result in results):
        return None
    if not all(isinstance(result, torch.Tensor) for result in results):
        raise DefinitionError(f"{target}: returns {like!r}, not tensors; the fallback runs "
                              "ops whose results are tensors")  # fmt: skip
    outs = [_like(fusion, result, target) for result in results]
    TorchOp(target, arguments, keywords, tensors, outs)
    if isinstance(like, torch.Tensor):
        return outs[0]
    return type(like)(outs) if isinstance(like, list) else tuple(outs)


def replay_torch_op(
    expr: TorchOp, operands: Sequence[TensorView], fusion: Fusion
) -> list[TensorView]:
    """``expr`` again on ``operands`` in ``fusion`` (theirs), its outputs shaped alike."""
    outs = [fusion.new_tensor(t.dtype, [fusion.new_axis(e) for e in t.shape])
            for t in expr.outputs]  # fmt: skip
    TorchOp(expr.target, expr.arguments, expr.keywords, operands, outs, expr.vjp)
    return outs


def torch_vjp(
    expr: TorchOp,
    inputs: Sequence[TensorView],
    grads: Sequence[TensorView],
    wanted: Sequence[int],
) -> list[TensorView]:
    """The gradients of forward ``expr``'s tensor inputs at positions ``wanted``
    (``inputs``: the values of all of them where the backward is built) from ``grads``,
    one per floating-point output of ``expr``, computed by PyTorch's autograd."""
    fusion = inputs[0].fusion
    outs = [fusion.new_tensor(inputs[i].dtype, [fusion.new_axis(e) for e in inputs[i].shape])
            for i in wanted]  # fmt: skip
    TorchOp(expr.target, expr.arguments, expr.keywords, [*inputs, *grads], outs, tuple(wanted))
    return outs


def run_torch_op(
    expr: TorchOp, tensors: Sequence[torch.Tensor], device: torch.device | None = None
) -> list[torch.Tensor]:
    """``expr``'s outputs from the values of its tensor inputs (``device``: where an op
    without tensor inputs makes its result; default torch's default device). Each result
    owns its memory, contiguous (a view of an input is copied)."""
    if device is None:
        device = tensors[0].device if tensors else torch.get_default_device()
    if expr.vjp is None:
        results = _called(expr, tensors, device)
    else:
        results = _vjp(expr, tensors, device)
    held = {t.untyped_storage().data_ptr() for t in tensors}
    return [r.clone() if r.untyped_storage().data_ptr() in held else r.contiguous()
            for r in results]  # fmt: skip


def fell_back(fusion: Fusion) -> list[str]:
    """The ATen ops ``fusion`` leaves to PyTorch (its ``TorchOp``s' targets), once each."""
    return list(dict.fromkeys(str(e.target) for e in fusion.exprs if isinstance(e, TorchOp)))


def filled_arguments(
    expr: TorchOp, tensors: Sequence[object], device: torch.device
) -> tuple[tuple, dict]:
    """``expr``'s forward arguments and keywords with its ``index``-th tensor input
    ``tensors[index]`` (tensors, or torch's DTensors to ask its sharding propagator) and
    every device they name ``device``."""

    def filled(value: object) -> object:
        return tensors[value.index]

    arguments = _on_device(_mapped(expr.arguments, TensorSlot, filled), device)
    return arguments, _on_device(_mapped(expr.keywords, TensorSlot, filled), device)


def _called(expr: TorchOp, tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    if expr.target._schema.is_mutable:  # writes its inputs: copies, the values stay as given
        tensors = [t.clone() for t in tensors]

    arguments, keywords = filled_arguments(expr, tensors, device)
    result = expr.target(*arguments, **keywords)
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _vjp(expr: TorchOp, tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """The forward run again under autograd, its gradients taken at ``expr.vjp``."""
    forward, grads = tensors[: expr.forward_count], tensors[expr.forward_count :]
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in expr.vjp) for i, t in enumerate(forward)]
        outputs = _called(expr, leaves, device)
        floating = [o for o in outputs if o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floating, grads, strict=True) if o.requires_grad]
        wrt = [leaves[i] for i in expr.vjp]
        found = [None] * len(wrt)
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                        allow_unused=True)  # fmt: skip
    return [torch.zeros_like(leaf) if g is None else g.detach()
            for leaf, g in zip(wrt, found, strict=True)]  # fmt: skip


def _on_meta(target, arguments, keywords, tensors: list[TensorView]) -> object:
    """The op's results on meta tensors shaped as ``tensors``."""
    for tensor in tensors:
        if any(isinstance(e, Symbol) for e in tensor.shape):
            raise DefinitionError(f"{target}: {tensor} has a symbolic extent; the fallback "
                                  "needs static shapes")  # fmt: skip
    metas = [torch.empty([int(e) for e in t.shape], dtype=t.dtype.torch_dtype, device="meta")
             for t in tensors]  # fmt: skip

    def filled(value: object) -> object:
        return metas[value.index]

    meta = torch.device("meta")
    return target(*_on_device(_mapped(arguments, TensorSlot, filled), meta),
                  **_on_device(_mapped(keywords, TensorSlot, filled), meta))  # fmt: skip


def _like(fusion: Fusion, result: torch.Tensor, target) -> TensorView:
    shape = []
    for extent in result.shape:
        try:
            shape.append(int(extent))
        except (TypeError, RuntimeError) as error:  # a dynamic extent
            raise DefinitionError(f"{target}: output extent {extent} is not static; the "
                                  "fallback needs static shapes") from error  # fmt: skip
    dtype = DataType.from_torch(result.dtype)
    return fusion.new_tensor(dtype, [fusion.new_axis(e) for e in shape])


def _mapped(value: object, kind: type, change: Callable[[object], object]) -> object:
    """``value`` with every ``kind`` inside it (lists, tuples, dicts) changed; containers
    become plain ones (fx's immutable lists do not deep-copy)."""
    if isinstance(value, kind):
        return change(value)
    if isinstance(value, tuple):
        return tuple(_mapped(v, kind, change) for v in value)
    if isinstance(value, list):
        return [_mapped(v, kind, change) for v in value]
    if isinstance(value, dict):
        return {k: _mapped(v, kind, change) for k, v in value.items()}
    return value


def _on_device(value: object, device: torch.device) -> object:
    """``value`` with every device it names made ``device`` (where this rank runs)."""
    return _mapped(value, torch.device, lambda _: device)
