"""Pieces of tensors: a rank's piece of a whole value, and the whole from every piece.

``local_piece`` cuts what a rank holds of a tensor placed on a mesh; ``assemble`` is its
inverse. Packed fp4 is cut on values, not bytes: ``check_packed_pieces`` refuses a
layout whose pieces would not fill whole bytes.

Example::

    pieces = {rank: local_piece(whole, tensor, rank) for rank in tensor.mesh.ranks}
    assert torch.equal(assemble(pieces, tensor), whole)
"""

from __future__ import annotations

import torch

from fusion.binding import Bindings, resolve
from fusion.ir import Fusion, Symbol, TensorView
from fusion.storage import to_logical, to_storage
from sharding.layout import Shard, layout_of, split_range, split_sizes


def local_piece(value: torch.Tensor, tensor: TensorView, rank: int) -> torch.Tensor | None:
    """``rank``'s piece of the whole ``value`` of ``tensor`` (None if not on ``rank``).

    fp4 values (``float4_e2m1fn_x2``) are split on values, not bytes.
    """
    layout = layout_of(tensor)
    if rank not in layout.mesh:
        return None
    piece = to_logical(tensor.dtype, value)
    coords = layout.mesh.coords(rank)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            extent = piece.shape[placement.dim]
            offset, size = split_range(extent, layout.mesh.shape[mesh_axis], coords[mesh_axis])
            piece = piece.narrow(placement.dim, offset, size)
    return to_storage(tensor.dtype, piece)


def piece_origin(tensor: TensorView, rank: int, shape: list[int]) -> list[int]:
    """Where ``rank``'s piece of ``tensor`` (of whole logical ``shape``) starts in the
    whole, per axis: the offsets ``local_piece`` cuts it at (zeros where it is whole)."""
    origin, extents = [0] * len(shape), list(shape)
    layout = layout_of(tensor)
    if layout is None or rank not in layout.mesh:
        return origin
    coords = layout.mesh.coords(rank)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            dim, parts = placement.dim, layout.mesh.shape[mesh_axis]
            offset, size = split_range(extents[dim], parts, coords[mesh_axis])
            origin[dim] += offset
            extents[dim] = size
    return origin


def assemble(pieces: dict[int, torch.Tensor | None], tensor: TensorView) -> torch.Tensor:
    """The whole value of ``tensor`` from its pieces by rank (the inverse of ``local_piece``).

    Replicated copies must agree; the first rank's copy is kept.
    """
    layout = layout_of(tensor)
    mesh = layout.mesh

    def along(mesh_axis: int, fixed: dict[int, int]) -> torch.Tensor:
        """Concatenate over mesh axes from ``mesh_axis`` on, the others fixed at ``fixed``."""
        if mesh_axis == mesh.ndim:
            rank = mesh.rank_at([fixed[a] for a in range(mesh.ndim)])
            piece = pieces[rank]
            if piece is None:
                raise ValueError(f"rank {rank} holds a piece of {tensor} but gave None")
            return to_logical(tensor.dtype, piece)
        placement = layout.placements[mesh_axis]
        if not isinstance(placement, Shard):
            return along(mesh_axis + 1, {**fixed, mesh_axis: 0})
        parts = [
            along(mesh_axis + 1, {**fixed, mesh_axis: coordinate})
            for coordinate in range(mesh.shape[mesh_axis])
        ]
        return torch.cat(parts, placement.dim)

    return to_storage(tensor.dtype, along(0, {}))


def check_packed_pieces(fusion: Fusion, bindings: Bindings, error: type[Exception]) -> None:
    """Every rank's piece of a packed tensor (fp4, two values a byte) split along its
    innermost axis must fill whole bytes; else ``error``, the same verdict on every rank.
    Extents still unbound (symbols before the inputs come) are checked when they are."""
    for tensor in fusion.tensors:
        layout = layout_of(tensor)
        if not tensor.dtype.is_packed or layout is None:
            continue
        innermost = tensor.ndim - 1
        mesh_axis = layout.mesh_axis_of(innermost)
        extent = tensor.shape[innermost]
        if mesh_axis is None or (isinstance(extent, Symbol) and extent not in bindings):
            continue
        extent = resolve(extent, bindings)
        pieces = split_sizes(extent, layout.mesh.shape[mesh_axis])
        per_byte = tensor.dtype.values_per_storage_element
        if any(piece % per_byte for piece in pieces):
            raise error(
                f"{tensor} holds {tensor.dtype} packed {per_byte} values a byte, and its "
                f"innermost axis ({extent} values) is split over mesh axis "
                f"{layout.mesh.axis_names[mesh_axis]!r} into pieces of {pieces} values: a piece "
                f"must fill whole bytes. Make the extent split into multiples of {per_byte} "
                "or split another axis"
            )
