"""Running a ``Communication`` on one rank with torch.distributed.

Collectives need equal-sized pieces; uneven splits (7 rows over 2 ranks) are
padded to the largest piece for the transfer and trimmed after it. Pieces are
matched to ranks by mesh coordinate, not by rank number, so a mesh may list its
ranks in any order. fp8 and bool travel as bytes (no backend reduces them, and
gloo cannot move them); fp4 is already held as one byte per value.

``start`` posts the transfer (asynchronously) and returns a ``Pending`` whose
``wait`` finishes it and returns this rank's output (None on ranks that take
part but do not keep a result, like the root of a scatter outside the mesh).

A max or min of floats travels as ordered integer keys so that NaN propagates as it
does on one device (the backends' own float MAX/MIN drop NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fusion.ir import TensorView
from overlap.comm.communicator import Communicator
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

    def empty(self, tensor: TensorView, shape: list[int] | None = None) -> torch.Tensor:
        shape = self.local_shape(tensor) if shape is None else shape
        return torch.empty(shape, dtype=_wire_dtype(self.storage_dtype(tensor)), device=self.device)


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


def start(comm: Communication, value: torch.Tensor | None, ctx: RankContext) -> Pending:
    """Post ``comm`` on this rank; ``value`` is this rank's input (None if it has none)."""
    kind = comm.kind
    if comm.same_mesh:
        mesh, axis = comm.in_layout.mesh, comm.mesh_axis
        team = mesh.team(ctx.rank, axis)
        if len(team) == 1:
            return Pending(finish=lambda: value.clone())
        group = ctx.communicator.group(team)
        members = _members(mesh, team, axis)
        handler = {
            CommunicationKind.Allgather: _allgather,
            CommunicationKind.Allreduce: _allreduce,
            CommunicationKind.ReduceScatter: _reduce_scatter,
            CommunicationKind.AllToAll: _all_to_all,
        }[kind]
        return handler(comm, value, ctx, group, members)
    if kind is CommunicationKind.SendRecv:
        return _send_recv(comm, value, ctx)
    (team,) = comm.teams()
    group = ctx.communicator.group(team)
    handler = {
        CommunicationKind.Broadcast: _broadcast,
        CommunicationKind.Scatter: _scatter,
        CommunicationKind.Gather: _gather,
        CommunicationKind.Reduce: _reduce,
    }[kind]
    return handler(comm, value, ctx, group, team)


def _allgather(comm, value, ctx, group, members) -> Pending:
    dim = comm.in_dim
    parts = len(members)
    extent = ctx.local_shape(comm.output)[dim]  # the gathered axis, whole
    largest = max(split_sizes(extent, parts))
    send = _pad(_wire(value), dim, largest).movedim(dim, 0).contiguous()
    receive = send.new_empty((parts * largest, *send.shape[1:]))
    work = _all_gather_single(receive, send, group=group, async_op=True)

    def finish() -> torch.Tensor:
        chunks = receive.view(parts, largest, *send.shape[1:])
        by_coordinate = {coord: chunks[i] for i, (_, coord) in enumerate(members)}
        sizes = split_sizes(extent, parts)
        whole = torch.cat([by_coordinate[c][: sizes[c]] for c in range(parts)], 0)
        return _unwire(whole.movedim(0, dim).contiguous(), value.dtype)

    return Pending([work], finish)


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


def _allreduce(comm, value, ctx, group, members) -> Pending:
    wire, read = reducible(value, comm.reduce_op)
    work = dist.all_reduce(wire, op=_REDUCE_OPS[comm.reduce_op], group=group, async_op=True)
    return Pending([work], lambda: read(wire))


def _reduce_scatter(comm, value, ctx, group, members) -> Pending:
    dim = comm.out_dim
    parts = len(members)
    extent = value.shape[dim]
    sizes = split_sizes(extent, parts)
    largest = max(sizes)
    wire, read = reducible(value, comm.reduce_op, in_place=True)  # the pieces are copied
    chunks = [
        _pad(_piece(wire, dim, extent, parts, coord), dim, largest).movedim(dim, 0)
        for _, coord in members
    ]
    send = torch.cat(chunks, 0).contiguous()
    receive = send.new_empty((largest, *send.shape[1:]))
    work = _reduce_scatter_single(
        receive, send, op=_REDUCE_OPS[comm.reduce_op], group=group, async_op=True
    )
    mine = comm.in_layout.mesh.coords(ctx.rank)[comm.mesh_axis]

    def finish() -> torch.Tensor:
        return read(receive[: sizes[mine]].movedim(0, dim).contiguous())

    return Pending([work], finish)


def _all_to_all(comm, value, ctx, group, members) -> Pending:
    split_in, split_out = comm.in_dim, comm.out_dim
    parts = len(members)
    extent_in = ctx.local_shape(comm.output)[split_in]  # whole after the exchange
    extent_out = value.shape[split_out]  # whole before it
    largest_in = max(split_sizes(extent_in, parts))
    largest_out = max(split_sizes(extent_out, parts))
    wire = _wire(value)
    chunks = [
        _pad(_pad(_piece(wire, split_out, extent_out, parts, coord), split_out, largest_out),
             split_in, largest_in)
        for _, coord in members
    ]  # fmt: skip
    send = torch.stack(chunks).contiguous()
    receive = torch.empty_like(send)
    work = dist.all_to_all_single(receive, send, group=group, async_op=True)
    mine = comm.in_layout.mesh.coords(ctx.rank)[comm.mesh_axis]

    def finish() -> torch.Tensor:
        sizes_in = split_sizes(extent_in, parts)
        own_out = split_sizes(extent_out, parts)[mine]
        by_coordinate = {coord: receive[i] for i, (_, coord) in enumerate(members)}
        pieces = [
            by_coordinate[c].narrow(split_in, 0, sizes_in[c]).narrow(split_out, 0, own_out)
            for c in range(parts)
        ]
        return _unwire(torch.cat(pieces, split_in).contiguous(), value.dtype)

    return Pending([work], finish)


def _broadcast(comm, value, ctx, group, team) -> Pending:
    if ctx.rank == comm.root:
        buffer = _wire(value).contiguous()
    else:
        buffer = ctx.empty(comm.output)
    work = dist.broadcast(buffer, src=comm.root, group=group, async_op=True)
    keeps = ctx.rank in comm.out_layout.mesh
    dtype = ctx.storage_dtype(comm.output)
    return Pending([work], lambda: _unwire(buffer, dtype).clone() if keeps else None)


def _scatter(comm, value, ctx, group, team) -> Pending:
    dim = comm.out_dim
    out_mesh = comm.out_layout.mesh
    parts = out_mesh.size
    extent = ctx.global_shape(comm.output)[dim]
    sizes = split_sizes(extent, parts)
    largest = max(sizes)
    padded_shape = ctx.global_shape(comm.output)
    padded_shape[dim] = largest
    chunks = None
    if ctx.rank == comm.root:
        wire = _wire(value)
        chunks = []
        for rank in sorted(team):
            if rank in out_mesh:
                piece = _piece(wire, dim, extent, parts, out_mesh.coords(rank)[0])
                chunks.append(_pad(piece, dim, largest).contiguous())
            else:
                chunks.append(wire.new_zeros(padded_shape))
    receive = ctx.empty(comm.output, padded_shape)
    work = dist.scatter(receive, chunks, src=comm.root, group=group, async_op=True)
    dtype = ctx.storage_dtype(comm.output)

    def finish() -> torch.Tensor | None:
        if ctx.rank not in out_mesh:
            return None
        own = sizes[out_mesh.coords(ctx.rank)[0]]
        return _unwire(receive.narrow(dim, 0, own).contiguous(), dtype)

    return Pending([work], finish)


def _gather(comm, value, ctx, group, team) -> Pending:
    dim = comm.in_dim
    in_mesh = comm.in_layout.mesh
    parts = in_mesh.size
    whole = ctx.global_shape(comm.output)
    extent = whole[dim]
    sizes = split_sizes(extent, parts)
    padded_shape = list(whole)
    padded_shape[dim] = max(sizes)
    if ctx.rank in in_mesh:
        send = _pad(_wire(value), dim, max(sizes)).contiguous()
    else:
        send = ctx.empty(comm.output, padded_shape).zero_()
    receive = [torch.empty_like(send) for _ in team] if ctx.rank == comm.root else None
    work = dist.gather(send, receive, dst=comm.root, group=group, async_op=True)
    dtype = ctx.storage_dtype(comm.output)

    def finish() -> torch.Tensor | None:
        if ctx.rank != comm.root:
            return None
        by_coordinate = {
            in_mesh.coords(rank)[0]: chunk
            for rank, chunk in zip(sorted(team), receive, strict=True)
            if rank in in_mesh
        }
        pieces = [by_coordinate[c].narrow(dim, 0, sizes[c]) for c in range(parts)]
        return _unwire(torch.cat(pieces, dim).contiguous(), dtype)

    return Pending([work], finish)


def _reduce(comm, value, ctx, group, team) -> Pending:
    outside = ctx.rank not in comm.in_layout.mesh
    if outside:  # the root outside the mesh contributes the identity of the reduction
        value = identity(ctx.empty(comm.output), comm.reduce_op)
    wire, read = reducible(value, comm.reduce_op, in_place=outside)
    work = dist.reduce(
        wire, dst=comm.root, op=_REDUCE_OPS[comm.reduce_op], group=group, async_op=True
    )
    return Pending([work], lambda: read(wire) if ctx.rank == comm.root else None)


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


def _send_recv(comm, value, ctx) -> Pending:
    works = []
    result = None
    dtype = ctx.storage_dtype(comm.output)
    for source, destination in comm.pairs:
        if source == destination == ctx.rank:
            result = value.clone()
        elif ctx.rank == source:
            works.append(dist.isend(_wire(value).contiguous(), dst=destination))
        elif ctx.rank == destination:
            result = ctx.empty(comm.output)
            works.append(dist.irecv(result, src=source))
    return Pending(works, lambda: None if result is None else _unwire(result, dtype))
