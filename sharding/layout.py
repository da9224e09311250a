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

from dataclasses import dataclass

from fusion.ir import Extent, TensorView
from sharding.mesh import DeviceMesh


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


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial result; the value is their reduction by ``op``."""

    op: str = "sum"

    def __str__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


Placement = Shard | Replicate | Partial


@dataclass(frozen=True)
class Layout:
    """A mesh and one placement per mesh axis."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
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

    @property
    def is_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def __str__(self) -> str:
        return f"[{', '.join(str(p) for p in self.placements)}] on {self.mesh}"

    __repr__ = __str__


def split_sizes(extent: int, parts: int) -> list[int]:
    """Balanced split of ``extent`` into ``parts``: sizes differ by at most one."""
    base, extra = divmod(extent, parts)
    return [base + 1 if index < extra else base for index in range(parts)]


def split_range(extent: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of part ``index`` of a balanced split."""
    sizes = split_sizes(extent, parts)
    return sum(sizes[:index]), sizes[index]


def local_shape(tensor: TensorView, layout: Layout, rank: int, extents: list[int]) -> list[int]:
    """The shape of ``rank``'s piece of a tensor of global logical shape ``extents``."""
    coords = layout.mesh.coords(rank)
    shape = list(extents)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            _, size = split_range(
                shape[placement.dim], layout.mesh.shape[mesh_axis], coords[mesh_axis]
            )
            shape[placement.dim] = size
    return shape


def extents_are_static(extents: tuple[Extent, ...]) -> bool:
    return all(isinstance(e, int) for e in extents)
