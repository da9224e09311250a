"""``DeviceMesh``: an n-D array of ranks with named axes.

Mesh axis 0 is the one ``ParallelType.DIDx`` splits over, axis 1 ``DIDy``,
axis 2 ``DIDz``.

Example::

    >>> mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    >>> mesh.team(3, "tp")
    (2, 3)
    >>> mesh.coords(2)
    (1, 0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from fusion.ir import ParallelType

DEVICE_PARALLEL_TYPES = (ParallelType.DIDx, ParallelType.DIDy, ParallelType.DIDz)
DEFAULT_AXIS_NAMES = ("x", "y", "z")


def _flatten(ranks: object) -> tuple[tuple[int, ...], list[int]]:
    """Shape and row-major flat list of a nested list of ints."""
    if isinstance(ranks, int):
        return (), [ranks]
    if not isinstance(ranks, Sequence) or isinstance(ranks, str) or not ranks:
        raise ValueError(
            f"DeviceMesh: ranks must be a non-empty nested list of ints, got {ranks!r}"
        )
    parts = [_flatten(r) for r in ranks]
    shapes = {shape for shape, _ in parts}
    if len(shapes) != 1:
        raise ValueError(f"DeviceMesh: ranks {ranks!r} is ragged")
    (inner,) = shapes
    return (len(ranks), *inner), [rank for _, flat in parts for rank in flat]


class DeviceMesh:
    """An n-D array (n <= 3) of distinct non-negative ranks with named axes."""

    def __init__(self, ranks: Sequence | int, axis_names: Sequence[str] | None = None) -> None:
        if isinstance(ranks, int):
            ranks = list(range(ranks))
        elif hasattr(ranks, "tolist"):  # a torch tensor or numpy array of ranks
            ranks = ranks.tolist()
        shape, flat = _flatten(ranks)
        if not shape:
            raise ValueError("DeviceMesh: give at least one axis, e.g. DeviceMesh([0, 1])")
        if len(shape) > len(DEVICE_PARALLEL_TYPES):
            raise ValueError(f"DeviceMesh: at most 3 axes (DIDx, DIDy, DIDz), got shape {shape}")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in flat):
            raise ValueError(f"DeviceMesh: ranks must be non-negative ints, got {flat}")
        if len(set(flat)) != len(flat):
            raise ValueError(f"DeviceMesh: ranks {flat} repeat a rank")
        names = tuple(axis_names) if axis_names is not None else DEFAULT_AXIS_NAMES[: len(shape)]
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ValueError(
                f"DeviceMesh: need {len(shape)} distinct axis names for shape {shape}, got {names}"
            )
        self.shape: tuple[int, ...] = shape
        self.axis_names: tuple[str, ...] = names
        self.ranks: tuple[int, ...] = tuple(flat)
        self._coords = {
            rank: coords
            for rank, coords in zip(
                flat, itertools.product(*(range(n) for n in shape)), strict=True
            )
        }

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def axis_index(self, axis: int | str | ParallelType) -> int:
        """The index of a mesh axis given by index, name or device parallel type."""
        if isinstance(axis, ParallelType):
            if axis not in DEVICE_PARALLEL_TYPES[: self.ndim]:
                raise ValueError(f"{self} has no axis for {axis.name}")
            return DEVICE_PARALLEL_TYPES.index(axis)
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"{self} has no axis named {axis!r} (axes: {self.axis_names})")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise ValueError(f"{self} has no axis {axis}")
        return axis

    def parallel_type(self, axis: int | str) -> ParallelType:
        """The parallel type (DIDx, DIDy, DIDz) that splits over ``axis``."""
        return DEVICE_PARALLEL_TYPES[self.axis_index(axis)]

    def coords(self, rank: int) -> tuple[int, ...]:
        """The position of ``rank`` in the mesh."""
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is not in {self}")
        return self._coords[rank]

    def rank_at(self, coords: Sequence[int]) -> int:
        index = 0
        for coord, extent in zip(coords, self.shape, strict=True):
            index = index * extent + coord
        return self.ranks[index]

    def team(self, rank: int, axis: int | str | ParallelType) -> tuple[int, ...]:
        """The ranks along ``axis`` that share every other coordinate with ``rank``."""
        axis = self.axis_index(axis)
        coords = list(self.coords(rank))
        team = []
        for position in range(self.shape[axis]):
            coords[axis] = position
            team.append(self.rank_at(coords))
        return tuple(team)

    def teams(self, axis: int | str | ParallelType) -> list[tuple[int, ...]]:
        """Every team along ``axis``, in rank order of their first member."""
        axis = self.axis_index(axis)
        return sorted({self.team(rank, axis) for rank in self.ranks})

    def _key(self) -> tuple:
        return self.shape, self.axis_names, self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"mesh({axes}: {list(self.ranks)})"

    __repr__ = __str__
