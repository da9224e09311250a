"""User annotations: place a tensor on a mesh with a layout.

Example::

    mesh = DeviceMesh([0, 1])
    shard(x, mesh, [Shard(0)])        # rows split over the mesh
    shard(w, mesh, [Replicate()])     # every rank holds all of w

Annotated tensors keep their layout; propagation fills in the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion.ir import TensorView
from sharding.errors import ShardingError
from sharding.layout import Layout, Placement, Replicate, apply_layout, layout_of
from sharding.mesh import DeviceMesh


def shard(tensor: TensorView, mesh: DeviceMesh, placements: Sequence[Placement]) -> TensorView:
    """Place ``tensor`` on ``mesh`` with one placement per mesh axis; returns the tensor.

    Raises ``ShardingError`` if the layout is invalid or conflicts with an earlier
    annotation of the same tensor.
    """
    if not isinstance(tensor, TensorView):
        raise ShardingError(f"shard: expected a TensorView, got {type(tensor).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"shard: expected a DeviceMesh, got {type(mesh).__name__}")
    try:
        layout = Layout(mesh, tuple(placements))
    except ValueError as error:
        raise ShardingError(f"shard: {tensor}: {error}") from None
    previous = layout_of(tensor)
    if previous is not None and previous != layout:
        raise ShardingError(
            f"shard: conflicting annotations of {tensor}: already {previous}, now {layout}"
        )
    try:
        apply_layout(tensor, layout)
    except ValueError as error:
        raise ShardingError(f"shard: {error}") from None
    return tensor


def replicate(tensor: TensorView, mesh: DeviceMesh) -> TensorView:
    """Place ``tensor`` whole on every rank of ``mesh``."""
    return shard(tensor, mesh, [Replicate()] * mesh.ndim)
