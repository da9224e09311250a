"""Running a ``Communication`` on one rank with torch.distributed.

Collectives need equal-sized pieces; uneven splits (7 rows over 2 ranks) are
padded to the largest piece for the transfer and trimmed after it. Pieces are
matched to ranks by mesh coordinate, not by rank number, so a mesh may list its
ranks in any order. fp8 and bool travel as bytes (no backend reduces them, and
gloo cannot move them); fp4 is already held as one byte per value.

``prepare`` works out once how this rank posts a communication (its team, group,
split sizes, buffers' shapes); the ``post`` it returns posts the transfer
(asynchronously) and returns a ``Pending`` whose ``wait`` finishes it and returns this
rank's output (None on ranks that take part but do not keep a result, like the root
of a scatter outside the mesh). Where the pieces lie in memory as a collective moves
them (even, in rank order, along the leading axis), the input is sent as it is and the
received buffer is the output: no copies.

A max or min of floats travels as ordered integer keys so that NaN propagates as it
does on one device (the backends' own float MAX/MIN drop NaN).

Size: the nine kinds of communication, each prepared once and posted at every run,
share their padding, wire types, keys and buffers here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fusion.ir import TensorView
from overlap.comm.communicator import Communicator
from schedulers.runtime import allocator, contiguous_strides
from sharding.communication import Communication, CommunicationKind
from sharding.layout import split_range, split_sizes
from sharding.mesh import DeviceMesh

# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU machines) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_BYTE_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bool)


@dataclass
class RankContext:
    """What a communication needs to know about this rank and the tensors' shapes."""

    rank: int
    communicator: Communicator | None  # None: one device, nothing to communicate
    global_shape: Callable[[TensorView], list[int]]
    local_shape: Callable[[TensorView], list[int]]
    storage_dtype: Callable[[TensorView], torch.dtype]
    device: torch.device


@dataclass
class Pending:
    """A posted communication: ``wait()`` completes it and returns this rank's output."""

    works: list[object] = field(default_factory=list)
    finish: Callable[[], torch.Tensor | None] = lambda: None

    def wait(self) -> torch.Tensor | None:
        for work in self.works:
            if work is not None:
                work.wait()
        return self.finish()


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype in _BYTE_TYPES else dtype


def _wire(value: torch.Tensor) -> torch.Tensor:
    return value.view(torch.uint8) if value.dtype in _BYTE_TYPES else value


def _unwire(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.view(dtype) if dtype in _BYTE_TYPES else value


def _pad(value: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``value`` grown to ``size`` along ``dim`` with zeros."""
    missing = size - value.shape[dim]
    if missing <= 0:
        return value
    shape = list(value.shape)
    shape[dim] = missing
    return torch.cat([value, value.new_zeros(shape)], dim)


def _piece(value: torch.Tensor, dim: int, extent: int, parts: int, index: int) -> torch.Tensor:
    offset, size = split_range(extent, parts, index)
    return value.narrow(dim, offset, size)


def _members(mesh: DeviceMesh, team: tuple[int, ...], axis: int) -> list[tuple[int, int]]:
    """``(rank, coordinate along axis)`` in group order (torch orders a group by rank)."""
    return [(rank, mesh.coords(rank)[axis]) for rank in sorted(team)]


def _as_laid_out(whole: list[int], dim: int, sizes: list[int], members) -> bool:
    """Whether the pieces of ``whole`` along ``dim`` lie in its memory as a collective
    moves them: equal, in group order (coordinates in rank order), and along the leading
    axis (or after axes of one element). Then a collective's whole buffer is the
    tensor itself: nothing to pad, reorder or copy."""
    return (
        len(set(sizes)) == 1
        and all(coordinate == index for index, (_, coordinate) in enumerate(members))
        and all(extent == 1 for extent in whole[:dim])
    )


def _allocation(ctx: RankContext, shape) -> Callable[[torch.dtype], torch.Tensor]:
    """``allocate(dtype)``: a new contiguous buffer of ``shape`` at each call (the caching
    allocator's, without torch.empty's parsing of its arguments:
    ``schedulers.runtime.allocator``)."""
    shape = tuple(shape)
    strides, allocate = contiguous_strides(shape), allocator(ctx.device)
    return lambda dtype: allocate(shape, strides, dtype)


Post = Callable[[torch.Tensor | None], Pending]


def prepare(comm: Communication, ctx: RankContext) -> Post:
    """How this rank posts ``comm``: ``post(value)`` posts it (asynchronously) for this
    rank's input ``value`` (None if it has none) and returns its ``Pending``. Its team,
    process group, members, split sizes and buffers' shapes are worked out here, once;
    a post moves the data and copies only what the layout needs (uneven pieces, a split
    axis after others, a mesh whose coordinates are not in rank order)."""
    kind = comm.kind
    if comm.same_mesh:
        mesh, axis = comm.in_layout.mesh, comm.mesh_axis
        team = mesh.team(ctx.rank, axis)
        if len(team) == 1:
            return lambda value: Pending(finish=lambda: value.clone())
        group = ctx.communicator.group(team)
        members = _members(mesh, team, axis)
        handler = {
            CommunicationKind.Allgather: _allgather,
            CommunicationKind.Allreduce: _allreduce,
            CommunicationKind.ReduceScatter: _reduce_scatter,
            CommunicationKind.AllToAll: _all_to_all,
        }[kind]
        return handler(comm, ctx, group, members)
    if kind is CommunicationKind.SendRecv:
        return _send_recv(comm, ctx)
    (team,) = comm.teams()
    group = ctx.communicator.group(team)
    handler = {
        CommunicationKind.Broadcast: _broadcast,
        CommunicationKind.Scatter: _scatter,
        CommunicationKind.Gather: _gather,
        CommunicationKind.Reduce: _reduce,
    }[kind]
    return handler(comm, ctx, group, team)


def _allgather(comm, ctx, group, members) -> Post:
    dim, parts = comm.in_dim, len(members)
    whole = ctx.local_shape(comm.output)  # the gathered axis, whole
    sizes = split_sizes(whole[dim], parts)
    largest = max(sizes)
    rest = [*whole[:dim], *whole[dim + 1 :]]
    allocate = _allocation(ctx, (parts * largest, *rest))
    if _as_laid_out(whole, dim, sizes, members):
        # the pieces go as they are, and the received buffer is the result (after axes of
        # one element, as its view)
        piece, shape = (None, None) if dim == 0 else ((largest, *rest), tuple(whole))

        def gather_in_place(value) -> Pending:
            send = _wire(value).contiguous()
            receive = allocate(send.dtype)
            work = _all_gather_single(receive, send if piece is None else send.view(piece),
                                      group=group, async_op=True)  # fmt: skip
            result = receive if shape is None else receive.view(shape)
            return Pending([work], lambda: _unwire(result, value.dtype))

        return gather_in_place
    # the group's pieces (by position) in coordinate order
    order = [position for _, position in sorted((c, i) for i, (_, c) in enumerate(members))]

    def gather(value) -> Pending:
        send = _pad(_wire(value), dim, largest).movedim(dim, 0).contiguous()
        receive = allocate(send.dtype)
        work = _all_gather_single(receive, send, group=group, async_op=True)

        def finish() -> torch.Tensor:
            chunks = receive.view(parts, largest, *rest)
            pieces = [chunks[position][:size] for position, size in zip(order, sizes, strict=True)]
            whole = torch.cat(pieces, 0)
            return _unwire(whole.movedim(0, dim).contiguous(), value.dtype)

        return Pending([work], finish)

    return gather


# Floats compared as integers: the bits of a float, with all but the sign flipped when
# it is negative, order as the floats do (-inf < -0.0 < +0.0 < +inf); a NaN takes the
# integer type's extreme, above +inf for a max, below -inf for a min. A MAX/MIN
# collective over these keys then propagates NaN as torch.amax/amin do on one device;
# over the floats, NCCL and gloo drop it (their max of NaN and 1.0 is 1.0). 16-bit
# floats travel as float32 keys: twice their bytes, for the (small) results of a max.
_KEY_TYPES = {torch.float32: torch.int32, torch.float64: torch.int64}


def _to_keys(value: torch.Tensor, op: str) -> torch.Tensor:
    """Order-preserving integer keys of floats, NaN winning a ``op`` (max or min).

    A NaN's key is the largest (max) or smallest (min) integer, which reads back as a
    NaN; scalars only, so that nothing waits on a host copy (or breaks a graph capture).
    """
    wide = value if value.dtype in _KEY_TYPES else value.float()  # 16-bit floats: exact
    bits = wide.view(_KEY_TYPES[wide.dtype])
    info = torch.iinfo(bits.dtype)
    keys = torch.where(bits < 0, bits ^ info.max, bits)
    return torch.where(torch.isnan(wide), info.max if op == "max" else info.min, keys)


def _from_keys(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``_to_keys`` (the flip is its own inverse), in ``dtype``."""
    bits = torch.where(keys < 0, keys ^ torch.iinfo(keys.dtype).max, keys)
    wide = {torch.int32: torch.float32, torch.int64: torch.float64}[keys.dtype]
    return bits.view(wide).to(dtype)


def reducible(
    value: torch.Tensor, op: str, in_place: bool = False
) -> tuple[torch.Tensor, Callable]:
    """What a reducing collective moves for ``value``, and how to read its result back.

    Sums move the values (``value`` itself when ``in_place`` and contiguous, else a
    copy); a max or min of floats moves ordered keys, so that NaN wins.
    """
    if op == "sum" or not value.dtype.is_floating_point:
        if in_place and value.is_contiguous():
            return value, lambda result: result
        return value.clone(memory_format=torch.contiguous_format), lambda result: result
    dtype = value.dtype
    return _to_keys(value, op).contiguous(), lambda result: _from_keys(result, dtype)


def _allreduce(comm, ctx, group, members) -> Post:
    op, reduce_op = comm.reduce_op, _REDUCE_OPS[comm.reduce_op]

    def reduce(value) -> Pending:
        wire, read = reducible(value, op)
        work = dist.all_reduce(wire, op=reduce_op, group=group, async_op=True)
        return Pending([work], lambda: read(wire))

    return reduce


def _reduce_scatter(comm, ctx, group, members) -> Post:
    dim, parts = comm.out_dim, len(members)
    whole = ctx.local_shape(comm.inputs[0])  # the scattered axis, whole
    extent = whole[dim]
    sizes = split_sizes(extent, parts)
    largest = max(sizes)
    rest = [*whole[:dim], *whole[dim + 1 :]]
    op, reduce_op = comm.reduce_op, _REDUCE_OPS[comm.reduce_op]
    mine = comm.in_layout.mesh.coords(ctx.rank)[comm.mesh_axis]
    allocate = _allocation(ctx, (largest, *rest))
    if _as_laid_out(whole, dim, sizes, members):
        # the partials go as they are (a sum's; a max or min moves their keys), and the
        # received buffer is the result (after axes of one element, as its view)
        flat, shape = None, None
        if dim > 0:
            flat, shape = (extent, *rest), (*whole[:dim], largest, *whole[dim + 1 :])

        def scatter_in_place(value) -> Pending:
            wire, read = reducible(value, op, in_place=True)
            receive = allocate(wire.dtype)
            work = _reduce_scatter_single(receive, wire if flat is None else wire.view(flat),
                                          op=reduce_op, group=group, async_op=True)  # fmt: skip
            result = receive if shape is None else receive.view(shape)
            return Pending([work], lambda: read(result))

        return scatter_in_place
    coordinates = [coordinate for _, coordinate in members]

    def scatter(value) -> Pending:
        wire, read = reducible(value, op, in_place=True)  # the pieces are copied
        chunks = [
            _pad(_piece(wire, dim, extent, parts, coordinate), dim, largest).movedim(dim, 0)
            for coordinate in coordinates
        ]
        send = torch.cat(chunks, 0)
        receive = allocate(send.dtype)
        work = _reduce_scatter_single(receive, send, op=reduce_op, group=group, async_op=True)
        return Pending([work], lambda: read(receive[: sizes[mine]].movedim(0, dim).contiguous()))

    return scatter


def _all_to_all(comm, ctx, group, members) -> Post:
    split_in, split_out = comm.in_dim, comm.out_dim
    parts = len(members)
    extent_in = ctx.local_shape(comm.output)[split_in]  # whole after the exchange
    extent_out = ctx.local_shape(comm.inputs[0])[split_out]  # whole before it
    sizes_in = split_sizes(extent_in, parts)
    largest_in, largest_out = max(sizes_in), max(split_sizes(extent_out, parts))
    mine = comm.in_layout.mesh.coords(ctx.rank)[comm.mesh_axis]
    own_out = split_sizes(extent_out, parts)[mine]
    coordinates = [coordinate for _, coordinate in members]
    order = [position for _, position in sorted((c, i) for i, c in enumerate(coordinates))]

    def exchange(value) -> Pending:
        wire = _wire(value)
        chunks = [
            _pad(_pad(_piece(wire, split_out, extent_out, parts, coordinate), split_out,
                      largest_out), split_in, largest_in)
            for coordinate in coordinates
        ]  # fmt: skip
        send = torch.stack(chunks)
        receive = torch.empty_like(send)
        work = dist.all_to_all_single(receive, send, group=group, async_op=True)

        def finish() -> torch.Tensor:
            pieces = [
                receive[position].narrow(split_in, 0, size).narrow(split_out, 0, own_out)
                for position, size in zip(order, sizes_in, strict=True)
            ]
            return _unwire(torch.cat(pieces, split_in).contiguous(), value.dtype)

        return Pending([work], finish)

    return exchange


def _broadcast(comm, ctx, group, team) -> Post:
    root, source = comm.root, ctx.communicator.global_rank(comm.root)
    dtype = ctx.storage_dtype(comm.output)
    if ctx.rank == root:
        keeps = ctx.rank in comm.out_layout.mesh

        def send(value) -> Pending:
            buffer = _wire(value).contiguous()
            work = dist.broadcast(buffer, src=source, group=group, async_op=True)
            return Pending([work], lambda: _unwire(buffer, dtype).clone() if keeps else None)

        return send
    allocate, wire_dtype = _allocation(ctx, ctx.local_shape(comm.output)), _wire_dtype(dtype)

    def receive(value) -> Pending:
        buffer = allocate(wire_dtype)
        work = dist.broadcast(buffer, src=source, group=group, async_op=True)
        return Pending([work], lambda: _unwire(buffer, dtype))

    return receive


def _scatter(comm, ctx, group, team) -> Post:
    dim = comm.out_dim
    out_mesh = comm.out_layout.mesh
    parts = out_mesh.size
    extent = ctx.global_shape(comm.output)[dim]
    sizes = split_sizes(extent, parts)
    largest = max(sizes)
    padded_shape = ctx.global_shape(comm.output)
    padded_shape[dim] = largest
    dtype = ctx.storage_dtype(comm.output)
    allocate, wire_dtype = _allocation(ctx, padded_shape), _wire_dtype(dtype)
    # the root's pieces, by rank: the coordinate of a rank on the mesh (None: off it)
    coordinates = [out_mesh.coords(rank)[0] if rank in out_mesh else None
                   for rank in sorted(team)]  # fmt: skip
    own = sizes[out_mesh.coords(ctx.rank)[0]] if ctx.rank in out_mesh else None
    source = ctx.communicator.global_rank(comm.root)

    def scatter(value) -> Pending:
        chunks = None
        if ctx.rank == comm.root:
            wire = _wire(value)
            chunks = [
                wire.new_zeros(padded_shape) if coordinate is None
                else _pad(_piece(wire, dim, extent, parts, coordinate), dim, largest).contiguous()
                for coordinate in coordinates
            ]  # fmt: skip
        receive = allocate(wire_dtype)
        work = dist.scatter(receive, chunks, src=source, group=group, async_op=True)

        def finish() -> torch.Tensor | None:
            if own is None:
                return None
            piece = receive if own == largest else receive.narrow(dim, 0, own).contiguous()
            return _unwire(piece, dtype)

        return Pending([work], finish)

    return scatter


def _gather(comm, ctx, group, team) -> Post:
    dim = comm.in_dim
    in_mesh = comm.in_layout.mesh
    parts = in_mesh.size
    whole = ctx.global_shape(comm.output)
    sizes = split_sizes(whole[dim], parts)
    padded_shape = list(whole)
    padded_shape[dim] = max(sizes)
    dtype = ctx.storage_dtype(comm.output)
    inside = ctx.rank in in_mesh
    allocate, wire_dtype = _allocation(ctx, padded_shape), _wire_dtype(dtype)
    count = len(team) if ctx.rank == comm.root else 0
    # the root's received pieces (by position in rank order) in coordinate order
    positions = {in_mesh.coords(rank)[0]: position
                 for position, rank in enumerate(sorted(team)) if rank in in_mesh}  # fmt: skip
    order = [positions[coordinate] for coordinate in range(parts)]
    destination = ctx.communicator.global_rank(comm.root)

    def gather(value) -> Pending:
        if inside:
            send = _pad(_wire(value), dim, padded_shape[dim]).contiguous()
        else:
            send = allocate(wire_dtype).zero_()
        receive = [allocate(wire_dtype) for _ in range(count)] or None
        work = dist.gather(send, receive, dst=destination, group=group, async_op=True)

        def finish() -> torch.Tensor | None:
            if receive is None:
                return None
            pieces = [receive[position].narrow(dim, 0, size)
                      for position, size in zip(order, sizes, strict=True)]  # fmt: skip
            return _unwire(torch.cat(pieces, dim).contiguous(), dtype)

        return Pending([work], finish)

    return gather


def _reduce(comm, ctx, group, team) -> Post:
    outside = ctx.rank not in comm.in_layout.mesh
    op, reduce_op, root = comm.reduce_op, _REDUCE_OPS[comm.reduce_op], comm.root
    keeps, destination = ctx.rank == root, ctx.communicator.global_rank(root)
    # the root outside the mesh contributes the identity of the reduction
    allocate = _allocation(ctx, ctx.local_shape(comm.output)) if outside else None
    wire_dtype = _wire_dtype(ctx.storage_dtype(comm.output))

    def reduce(value) -> Pending:
        if outside:
            value = identity(allocate(wire_dtype), op)
        wire, read = reducible(value, op, in_place=outside)
        work = dist.reduce(wire, dst=destination, op=reduce_op, group=group, async_op=True)
        return Pending([work], lambda: read(wire) if keeps else None)

    return reduce


def identity(buffer: torch.Tensor, op: str) -> torch.Tensor:
    """``buffer`` filled with the identity of ``op``: 0, or -inf/+inf (an integer
    type's extremes, False/True) for max/min."""
    if op == "sum":
        return buffer.zero_()
    if buffer.dtype.is_floating_point:
        return buffer.fill_(-float("inf") if op == "max" else float("inf"))
    if buffer.dtype == torch.bool:
        return buffer.fill_(op == "min")
    info = torch.iinfo(buffer.dtype)
    return buffer.fill_(info.min if op == "max" else info.max)


def _send_recv(comm, ctx) -> Post:
    dtype = ctx.storage_dtype(comm.output)
    # this rank's part of each pair: keep its own value, send it, or receive another's
    # (the peer by its global rank)
    parts, to_global = [], ctx.communicator.global_rank
    for source, destination in comm.pairs:
        if source == destination == ctx.rank:
            parts.append(("keep", None))
        elif ctx.rank == source:
            parts.append(("send", to_global(destination)))
        elif ctx.rank == destination:
            parts.append(("receive", to_global(source)))
    receiving = any(part == "receive" for part, _ in parts)
    allocate = _allocation(ctx, ctx.local_shape(comm.output)) if receiving else None
    wire_dtype = _wire_dtype(dtype)

    def exchange(value) -> Pending:
        works, result = [], None
        for part, peer in parts:
            if part == "keep":
                result = value.clone()
            elif part == "send":
                works.append(dist.isend(_wire(value).contiguous(), dst=peer))
            else:
                result = allocate(wire_dtype)
                works.append(dist.irecv(result, src=peer))
        return Pending(works, lambda: None if result is None else _unwire(result, dtype))

    return exchange
