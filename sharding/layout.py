"""Layouts: how a tensor is placed on a device mesh.

A layout has one placement per mesh axis, as in DTensor: ``Shard(d)`` (tensor
axis ``d`` is split over that mesh axis), ``Replicate()`` or ``Partial(op)``
(each rank holds a partial result; the true value is their sum, max or min).
Equivalently, per tensor axis: which mesh axis, if any, splits it. A tensor
axis is split over at most one mesh axis.

Uneven extents are split in balance: with extent E over P ranks, the first
``E % P`` ranks hold ``ceil(E / P)`` rows and the others ``floor(E / P)``
(7 over 2: 4 and 3).

In the fusion IR a layout is written as parallel types: a sharded axis is
``DIDx``/``DIDy``/``DIDz`` (mesh axis 0/1/2), a partial result has its reduction
axis parallelized the same way, and ``TensorView.mesh`` is the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusion.exprs import ReductionOp
from fusion.ir import Fusion, ParallelType, TensorView
from sharding.mesh import DEVICE_PARALLEL_TYPES, DeviceMesh


@dataclass(frozen=True)
class Shard:
    """Tensor axis ``dim`` (a logical axis index) is split over the mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


PARTIAL_OPS = ("sum", "max", "min")


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial result; the value is their reduction by ``op``
    (``sum``, ``max`` or ``min``)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(
                f"Partial: partial results combine by one of {PARTIAL_OPS}, got {self.op!r}"
            )

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Placement = Shard | Replicate | Partial


@dataclass(frozen=True)
class Layout:
    """A mesh and one placement per mesh axis."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        for placement in self.placements:
            if not isinstance(placement, (Shard, Replicate, Partial)):
                raise ValueError(
                    f"layout: expected sharding.Shard, Replicate or Partial placements, got "
                    f"{type(placement).__module__}.{type(placement).__name__} {placement}"
                )
        if len(self.placements) != self.mesh.ndim:
            raise ValueError(
                f"layout: {self.mesh} has {self.mesh.ndim} axes but got "
                f"{len(self.placements)} placements {[str(p) for p in self.placements]}"
            )
        dims = [p.dim for p in self.placements if isinstance(p, Shard)]
        if len(set(dims)) != len(dims):
            raise ValueError(
                f"layout: a tensor axis is split over at most one mesh axis; placements "
                f"{[str(p) for p in self.placements]} split axis {dims[0]} twice"
            )

    @staticmethod
    def replicated(mesh: DeviceMesh) -> Layout:
        return Layout(mesh, (Replicate(),) * mesh.ndim)

    def with_placement(self, mesh_axis: int, placement: Placement) -> Layout:
        placements = list(self.placements)
        placements[mesh_axis] = placement
        return Layout(self.mesh, tuple(placements))

    def mesh_axis_of(self, dim: int) -> int | None:
        """The mesh axis that splits tensor axis ``dim``, or None."""
        for mesh_axis, placement in enumerate(self.placements):
            if placement == Shard(dim):
                return mesh_axis
        return None

    def resolved(self) -> Layout:
        """This layout with its partial results combined (``Partial`` made replicated)."""
        return Layout(
            self.mesh,
            tuple(Replicate() if isinstance(p, Partial) else p for p in self.placements),
        )

    @property
    def is_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def __str__(self) -> str:
        return f"[{', '.join(str(p) for p in self.placements)}] on {self.mesh}"

    __repr__ = __str__


def valid_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with any second split of an already split tensor axis replicated."""
    seen: set[int] = set()
    result: list[Placement] = []
    for placement in placements:
        if isinstance(placement, Shard):
            if placement.dim in seen:
                placement = Replicate()
            else:
                seen.add(placement.dim)
        result.append(placement)
    return tuple(result)


def split_sizes(extent: int, parts: int) -> list[int]:
    """Balanced split of ``extent`` into ``parts``: sizes differ by at most one."""
    base, extra = divmod(extent, parts)
    return [base + 1 if index < extra else base for index in range(parts)]


def split_range(extent: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of part ``index`` of a balanced split."""
    sizes = split_sizes(extent, parts)
    return sum(sizes[:index]), sizes[index]


def local_shape(layout: Layout, rank: int, shape: Sequence[int]) -> list[int]:
    """The shape of ``rank``'s piece of a tensor of global logical ``shape``."""
    coords = layout.mesh.coords(rank)
    local = list(shape)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            parts = layout.mesh.shape[mesh_axis]
            local[placement.dim] = split_range(shape[placement.dim], parts, coords[mesh_axis])[1]
    return local


def partial_op(tensor: TensorView) -> str:
    """How partial results of ``tensor`` combine: its reduction's op (sum for contractions)."""
    definition = tensor.definition
    if isinstance(definition, ReductionOp) and definition.op_name in ("max", "min"):
        return definition.op_name
    return "sum"


def is_placed(fusion: Fusion) -> bool:
    """Whether any tensor of ``fusion`` is placed on a mesh (else it runs on one device)."""
    return any(tensor.mesh is not None for tensor in fusion.tensors)


def layout_of(tensor: TensorView) -> Layout | None:
    """The layout written in the IR (mesh and parallel types), or None when not placed."""
    mesh = tensor.mesh
    if mesh is None:
        return None
    placements: list[Placement] = []
    for mesh_axis in range(mesh.ndim):
        parallel_type = DEVICE_PARALLEL_TYPES[mesh_axis]
        dims = [i for i, a in enumerate(tensor.logical_axes) if a.parallel_type is parallel_type]
        reduced = [a for a in tensor.axes if a.is_reduction and a.parallel_type is parallel_type]
        if dims:
            placements.append(Shard(dims[0]))
        elif reduced:
            placements.append(Partial(partial_op(tensor)))
        else:
            placements.append(Replicate())
    return Layout(mesh, tuple(placements))


def apply_layout(tensor: TensorView, layout: Layout) -> None:
    """Write ``layout`` into the IR: the mesh, and parallel types on the split axes."""
    for axis in tensor.axes:
        if axis.parallel_type.is_device:
            axis.parallel_type = ParallelType.Serial
    free_reductions = [axis for axis in tensor.axes if axis.is_reduction]
    for mesh_axis, placement in enumerate(layout.placements):
        parallel_type = DEVICE_PARALLEL_TYPES[mesh_axis]
        if isinstance(placement, Shard):
            if not 0 <= placement.dim < tensor.ndim:
                raise ValueError(
                    f"{tensor} has rank {tensor.ndim}; it has no axis {placement.dim} to shard"
                )
            tensor.axis(placement.dim).parallel_type = parallel_type
        elif isinstance(placement, Partial):
            if not free_reductions:
                raise ValueError(
                    f"{tensor} cannot be partial: only the result of a reduction or "
                    "contraction holds partial values"
                )
            free_reductions.pop(0).parallel_type = parallel_type
    tensor.mesh = layout.mesh


def placed_like(
    fusion: Fusion, tensor: TensorView, layout: Layout, *, reductions: bool
) -> TensorView:
    """A new tensor of ``fusion`` shaped like ``tensor`` (with its reduction axes if asked),
    placed ``layout``: a copy to reshard into."""
    axes = tensor.axes if reductions else tensor.logical_axes
    copy = fusion.new_tensor(tensor.dtype, [fusion.new_axis(a.extent, a.iter_type) for a in axes])
    apply_layout(copy, layout)
    return copy
