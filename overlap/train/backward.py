"""The backward of a placed fusion, placed like its forward.

``placed_backward(fusion)`` differentiates ``fusion`` (``fusion.autodiff.backward``) and
places the backward fusion from the forward's layouts as sharding placed them: the
forward's inputs where they are, each saved intermediate as the forward holds it (a
partial sum cannot be saved: the forward would have to combine it), each output's
gradient as that output is placed (a partial output is replicated), and each input's
gradient as its input; each recomputed intermediate as the forward holds it, and each
intermediate's gradient as its tensor (where the forward copies a tensor to another
mesh or layout, ``fd.ops.set``, the gradient's copy moves it back). Sharding the
backward then inserts what the gradients need: a replicated weight's gradient, partial
on every rank, is all-reduced (or reduce-scattered, where its input is split); a
sequence-split activation's gradient comes back split. Run it like any placed fusion:

    grads = placed_backward(fd.fusion)
    executor = MultiDeviceExecutor(grads.fusion, communicator)
    local_grads = executor.run(local_inputs + local_output_grads)
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion.autodiff import Backward, backward, forward_with_saved
from fusion.exprs import (
    AttentionOp,
    BroadcastOp,
    DetachOp,
    DropoutMaskOp,
    ExpandOp,
    LinearOp,
    MatmulOp,
    PermuteOp,
    ReshapeOp,
    SelectOp,
    SetOp,
    SliceOp,
)
from fusion.ir import Fusion, TensorView
from sharding import ShardingError, shard
from sharding.layout import layout_of
from sharding.resharding import shard_fusion


def placed_backward(
    fusion: Fusion, wrt: Sequence[int] | None = None, saved: Sequence[TensorView] = ()
) -> Backward:
    """The backward of ``fusion`` (see the module); ``wrt`` and ``saved`` as
    ``backward``'s."""
    grads = backward(fusion, wrt, saved)
    placed, _ = shard_fusion(fusion)
    by_id = {tensor.id: tensor for tensor in placed.tensors}
    count, kept = len(fusion.inputs), len(grads.saved)
    inputs = grads.fusion.inputs
    for forward, tensor in zip(placed.inputs, inputs[:count], strict=True):
        _place_like(tensor, forward)
        tensor.pinned = forward.pinned  # a weight the forward keeps in place, here too
    for intermediate, tensor in zip(grads.saved, inputs[count : count + kept], strict=True):
        _place_like(tensor, _held(intermediate, by_id))
    for output, seed in zip(placed.outputs, inputs[count + kept :], strict=True):
        _place_like(seed, output)
    for position, grad in zip(grads.wrt, grads.fusion.outputs, strict=True):
        _place_like(grad, placed.inputs[position])
    _place_replayed(grads, by_id)
    return grads


def _place_replayed(grads: Backward, by_id: dict[int, TensorView]) -> None:
    """Each intermediate the backward recomputes placed as the forward placed it (the
    forward's own program again, its pipelined all-gathers included), and each
    intermediate's gradient as its tensor (resolved: a partial tensor's gradient is
    replicated). A gradient shared by several tensors takes the first one's place; the
    backward's inputs keep theirs (the caller's pieces)."""
    placed_here: set[TensorView] = set()
    for tensor, value in grads.values.items():
        if not value.is_input:
            layout = layout_of(by_id[tensor.id])
            shard(value, layout.mesh, list(layout.placements))
    for tensor, gradient in grads.gradients.items():
        # placed already: an input's gradient (an add hands one to its input and to its
        # result), or the first tensor's of several
        if not gradient.is_input and gradient not in placed_here and gradient.mesh is None:
            _place_like(gradient, by_id[tensor.id])
            placed_here.add(gradient)


def _held(intermediate: TensorView, by_id: dict[int, TensorView]) -> TensorView:
    """How the placed forward holds ``intermediate`` (never as partial sums)."""
    held = by_id[intermediate.id]
    if layout_of(held).is_partial:
        raise ShardingError(
            f"save {intermediate}: the forward holds it as partial sums ({layout_of(held)}); "
            "saving it would combine them there. Save what is computed from it, or let the "
            "backward recompute it"
        )
    return held


def _place_like(tensor: TensorView, like: TensorView) -> None:
    layout = layout_of(like).resolved()
    shard(tensor, layout.mesh, list(layout.placements))


def placed_forward_with_saved(fusion: Fusion, saved: Sequence[TensorView]) -> Fusion:
    """``fusion`` also outputting ``saved``, each placed as the forward holds it (so the
    pieces it hands over are those ``placed_backward`` takes)."""
    placed, _ = shard_fusion(fusion)
    by_id = {tensor.id: tensor for tensor in placed.tensors}
    copy = forward_with_saved(fusion, saved)
    for tensor, output in zip(saved, copy.outputs[len(fusion.outputs) :], strict=True):
        _place_like(output, _held(tensor, by_id))
    return copy


SAVE_POLICIES = {
    "matmuls": "what a matmul, linear or attention computes, and what an attention reads, "
    "is saved (recomputing it would cost the matmul again, and in a tensor-parallel block "
    "the all-gather before it; an attention's backward reads its operands anyway), unless "
    "the forward holds it as partial sums or returns it; everything else is recomputed "
    "(pointwise work and statistics: memory-bound, cheap to redo)",
    "nothing": "everything the gradients read is recomputed (least memory)",
    "everything": "everything the gradients read is saved, as eager autograd keeps it "
    "(most memory, least recomputation), but data movement (views, copies: replayed from "
    "what they move), dropout masks (drawn again from the seed, in the kernel that reads "
    "them) and what the forward holds as partial sums or returns",
}


# data movement: replayed from what it moves, never worth a buffer of its own
_VIEWS = (BroadcastOp, ExpandOp, ReshapeOp, PermuteOp, SliceOp, SelectOp, SetOp, DetachOp)


def _through_views(tensor: TensorView) -> TensorView:
    """The tensor ``tensor`` is a view (or copy) of, through every view."""
    while tensor.definition is not None and isinstance(tensor.definition, _VIEWS):
        tensor = tensor.definition.inputs[0]
    return tensor


def saved_by_policy(
    fusion: Fusion, policy: str, wrt: Sequence[int] | None = None
) -> list[TensorView]:
    """The intermediates of ``fusion`` that ``policy`` (a key of ``SAVE_POLICIES``) has
    the forward hand to the backward, for the gradients of the inputs at ``wrt`` (default
    every floating-point one; a backward for others recomputes what it misses)."""
    if policy not in SAVE_POLICIES:
        raise ValueError(f"save policy {policy!r}: one of {sorted(SAVE_POLICIES)}, or a list "
                         "of the fusion's intermediates")  # fmt: skip
    if policy == "nothing":
        return []
    everything = policy == "everything"
    live = fusion.live_exprs()
    # what an attention reads (through views), kept: its backward reads it anyway, and
    # recomputing it would redo the work before it (a rotary embedding's copies)
    fed = set() if everything else {
        _through_views(t) for e in live if isinstance(e, AttentionOp) for t in e.inputs[:3]
    }  # fmt: skip
    fed = {t for t in fed if t.definition is not None}
    read = set(backward(fusion, wrt, [t for t in fusion.tensors if t in fed]).read)
    placed, _ = shard_fusion(fusion)
    by_id = {tensor.id: tensor for tensor in placed.tensors}
    return [
        expr.output
        for expr in live
        if (
            isinstance(expr, (MatmulOp, LinearOp, AttentionOp))
            or (everything and not isinstance(expr, (*_VIEWS, DropoutMaskOp)))
            or expr.outputs[0] in fed
        )
        and len(expr.outputs) == 1
        and expr.output in read
        and expr.output not in fusion.outputs
        and not layout_of(by_id[expr.output.id]).is_partial
    ]
