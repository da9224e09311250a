"""The backward of a placed fusion, placed like its forward.

``placed_backward(fusion)`` differentiates ``fusion`` (``fusion.autodiff.backward``) and
places the backward fusion from the forward's layouts as sharding placed them: the
forward's inputs where they are, each output's gradient as that output is placed (a
partial output is replicated), and each input's gradient as its input. Sharding the
backward then inserts what the gradients need: a replicated weight's gradient, partial
on every rank, is all-reduced (or reduce-scattered, where its input is split); a
sequence-split activation's gradient comes back split. Run it like any placed fusion:

    grads = placed_backward(fd.fusion)
    executor = MultiDeviceExecutor(grads.fusion, communicator)
    local_grads = executor.run(local_inputs + local_output_grads)
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion.autodiff import Backward, backward
from fusion.ir import Fusion, TensorView
from sharding import shard
from sharding.layout import layout_of
from sharding.resharding import shard_fusion


def placed_backward(fusion: Fusion, wrt: Sequence[int] | None = None) -> Backward:
    """The backward of ``fusion`` (see the module); ``wrt`` as ``backward``'s."""
    grads = backward(fusion, wrt)
    placed, _ = shard_fusion(fusion)
    count = len(fusion.inputs)
    inputs, seeds = grads.fusion.inputs[:count], grads.fusion.inputs[count:]
    for forward, tensor in zip(placed.inputs, inputs, strict=True):
        _place_like(tensor, forward)
    for output, seed in zip(placed.outputs, seeds, strict=True):
        _place_like(seed, output)
    for position, grad in zip(grads.wrt, grads.fusion.outputs, strict=True):
        _place_like(grad, placed.inputs[position])
    return grads


def _place_like(tensor: TensorView, like: TensorView) -> None:
    layout = layout_of(like).resolved()
    shard(tensor, layout.mesh, list(layout.placements))
