"""User annotations: place a tensor on a mesh with a layout.

Example::

    mesh = DeviceMesh([0, 1])
    shard(x, mesh, [Shard(0)])        # rows split over the mesh
    shard(w, mesh, [Replicate()])     # every rank holds all of w

Annotated tensors keep their layout; propagation fills in the rest. torch's own
``torch.distributed.tensor`` placements (``Shard``, ``Replicate``, ``Partial``) and
``DeviceMesh`` are read as ours; anything else is refused, never reinterpreted.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion.ir import TensorView
from sharding.errors import ShardingError
from sharding.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    apply_layout,
    layout_of,
    partial_op,
)
from sharding.mesh import DeviceMesh


def shard(tensor: TensorView, mesh: DeviceMesh, placements: Sequence[Placement]) -> TensorView:
    """Place ``tensor`` on ``mesh`` with one placement per mesh axis; returns the tensor.

    Raises ``ShardingError`` if the layout is invalid or conflicts with an earlier
    annotation of the same tensor.
    """
    if not isinstance(tensor, TensorView):
        raise ShardingError(f"shard: expected a TensorView, got {type(tensor).__name__}")
    mesh = as_mesh(mesh)
    try:
        layout = Layout(mesh, tuple(as_placement(p, tensor.ndim) for p in placements))
    except ValueError as error:
        raise ShardingError(f"shard: {tensor}: {error}") from None
    for placement in layout.placements:
        if (
            isinstance(placement, Partial)
            and tensor.definition is not None
            and placement.op != partial_op(tensor)
        ):  # annotations win, but cannot change what the producer computes
            raise ShardingError(
                f"shard: {tensor} is computed by {tensor.definition.op_name}, whose partial "
                f"results combine by {partial_op(tensor)!r}, not {placement.op!r}: annotate "
                f"Partial({partial_op(tensor)!r})"
            )
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


def pin(tensor: TensorView, mesh: DeviceMesh, placements: Sequence[Placement]) -> TensorView:
    """Place a fusion input as ``shard`` does, to be computed with where it lies (a
    plan's weight): the layout chooser and the resharding pass move it only where no
    way to lay the tensors out avoids it, whatever bits moving it would save
    (``sharding.layout_cost.Cost``). A data input is placed with ``shard``: moving an
    activation (gathering the tokens a split weight's rows need) is the traffic a
    plan expects."""
    if tensor.definition is not None:
        raise ShardingError(f"pin: {tensor} is computed by {tensor.definition.op_name}; "
                            "only a fusion's inputs are pinned")  # fmt: skip
    shard(tensor, mesh, placements)
    tensor.pinned = True
    return tensor


def replicate(tensor: TensorView, mesh: DeviceMesh) -> TensorView:
    """Place ``tensor`` whole on every rank of ``mesh``."""
    return shard(tensor, mesh, [Replicate()] * mesh.ndim)


def torch_class(value: object) -> str | None:
    """The class name of a torch.distributed object, or None for anything else."""
    module = type(value).__module__ or ""
    return type(value).__name__ if module.startswith("torch.distributed") else None


def as_mesh(mesh: object) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    if torch_class(mesh) == "DeviceMesh":
        # torch's mesh of ranks, with its axis names when it has them
        return DeviceMesh(mesh.mesh.tolist(), getattr(mesh, "mesh_dim_names", None))
    raise ShardingError(
        f"shard: expected a sharding.DeviceMesh (or torch's DeviceMesh), got "
        f"{type(mesh).__module__}.{type(mesh).__name__}"
    )


def as_placement(placement: object, ndim: int) -> Placement:
    """Ours as is; torch's Shard/Replicate/Partial as ours; anything else refused
    (``ValueError``, which ``shard`` reports with the tensor). A negative shard axis
    counts from the last, as in DTensor."""
    name = torch_class(placement)
    if name == "Shard":  # not _StridedShard: its name differs and it is refused below
        placement = Shard(placement.dim)
    if isinstance(placement, Shard) and -ndim <= placement.dim < 0:
        return Shard(placement.dim + ndim)
    if isinstance(placement, (Shard, Replicate, Partial)):
        return placement
    if name == "Replicate":
        return Replicate()
    if name == "Partial":
        try:
            return Partial(placement.reduce_op)
        except ValueError as error:
            raise ValueError(f"torch's {placement}: {error}") from None
    raise ValueError(
        f"placements are Shard(dim), Replicate() or Partial(op); got "
        f"{type(placement).__module__}.{type(placement).__name__} {placement!r}"
    )
