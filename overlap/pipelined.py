"""Pipelined communications: one chunk per loop iteration, by three transports.

Inside a stream loop, an all-gather along the stream axis delivers chunk ``c``
(sub-chunk ``c % k`` of its owner's rows) and a reduce-scatter sums chunk ``c``
into its owner. How a chunk moves:

- ``collective``: one collective per chunk (a broadcast from the owner, a
  reduce to it). Every rank issues them in the same (global) order.
- ``ring``: send/receive to the ring neighbours; an all-gather chunk is
  forwarded rank to rank starting at its owner, a reduce-scatter chunk is
  accumulated rank to rank and lands on its owner.
- ``copy_engine`` (CUDA only): ``copy_`` from (all-gather) or to
  (reduce-scatter) peers' symmetric-memory buffers. The copies run on the
  copy engines, so they take no SMs from the matmul; a rank may visit chunks
  in any order, its own first (all-gather) or last (reduce-scatter).

A communication that acts along another axis than the stream axis (an
all-reduce of a chunk, say) runs the whole-tensor collective on the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from overlap.communications import _REDUCE_OPS, Pending, RankContext, start
from overlap.host_ir import ChunkScheme, Communicate, stream_dim
from sharding.communication import Communication, CommunicationKind
from sharding.layout import split_range

TRANSPORTS = ("collective", "ring", "copy_engine")
_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def split_dim(comm: Communication) -> int | None:
    """The axis a pipelined all-gather gathers or a reduce-scatter scatters."""
    if comm.kind is CommunicationKind.Allgather:
        return comm.in_dim
    if comm.kind is CommunicationKind.ReduceScatter:
        return comm.out_dim
    return None


@dataclass
class ChunkPlace:
    """Where chunk ``chunk`` lives: its owner's coordinate and sub-chunk, and ours."""

    chunk: int
    owner: int
    sub: int
    mine: int
    team: tuple[int, ...]  # ranks by coordinate along the split axis

    @property
    def parts(self) -> int:
        return len(self.team)

    def rank_at(self, coordinate: int) -> int:
        return self.team[coordinate % self.parts]


def place(scheme: ChunkScheme, rank: int, iteration: int) -> ChunkPlace:
    mesh, axis = scheme.mesh, scheme.mesh_axis
    mine = mesh.coords(rank)[axis]
    chunk = scheme.chunk(iteration, mine)
    team = mesh.team(rank, axis)
    return ChunkPlace(chunk, chunk // scheme.per_owner, chunk % scheme.per_owner, mine, team)


def chunk_rows(extent: int, scheme: ChunkScheme, chunk: int, split: bool) -> tuple[int, int]:
    """``(offset, size)`` of ``chunk`` along an axis of ``extent`` values.

    ``split``: the axis holds only this rank's piece (the owner's rows); else it is whole.
    """
    if scheme.owners == 1:
        return split_range(extent, scheme.num_chunks, chunk)
    owner, sub = divmod(chunk, scheme.per_owner)
    if split:
        return split_range(extent, scheme.per_owner, sub)
    block_offset, block_size = split_range(extent, scheme.owners, owner)
    offset, size = split_range(block_size, scheme.per_owner, sub)
    return block_offset + offset, size


def _contiguous(view: torch.Tensor) -> torch.Tensor:
    return view if view.is_contiguous() else view.contiguous()


class PipelinedComms:
    """Runs the chunk communications of a program's loops on one rank."""

    def __init__(self, ctx: RankContext, symmetric) -> None:
        self.ctx = ctx
        self.symmetric = symmetric  # SymmetricBuffers or None (CPU)
        self.outstanding: list[object] = []  # sends whose completion nobody waits for yet

    def drain(self) -> None:
        """Wait for every outstanding send (end of a loop)."""
        for work in self.outstanding:
            work.wait()
        self.outstanding.clear()

    def start(
        self,
        communicate: Communicate,
        source: torch.Tensor | None,
        target: torch.Tensor | None,
        scheme: ChunkScheme,
        iteration: int,
    ) -> Pending:
        comm = communicate.communication
        ctx = self.ctx
        split = split_dim(comm)
        if scheme.owners == 1 or split != stream_dim(comm.output):
            chunk_ctx = replace(ctx, local_shape=lambda t: list(target.shape))
            pending = start(comm, source, chunk_ctx)
            finish = pending.finish
            pending.finish = lambda: target.copy_(finish()) if target is not None else None
            return pending
        where = place(scheme, ctx.rank, iteration)
        group = ctx.communicator.group(where.team) if where.parts > 1 else None
        transport = communicate.transport or "collective"
        if comm.kind is CommunicationKind.Allgather:
            return self._gather_chunk(communicate, source, target, where, group, transport)
        return self._reduce_chunk(communicate, source, target, where, group, transport)

    # -- all-gather: chunk c comes from its owner ------------------------------

    def _gather_chunk(self, communicate, source, target, where, group, transport) -> Pending:
        mine = where.owner == where.mine
        if mine:
            target.copy_(source)
        if where.parts == 1:
            return Pending()
        if transport == "copy_engine":
            if not mine:
                self.symmetric.pull(communicate, where, target)
            return Pending()
        if transport == "collective":
            buffer = _contiguous(target)
            work = dist.broadcast(
                buffer, src=where.rank_at(where.owner), group=group, async_op=True
            )
            return Pending([work], lambda: target.copy_(buffer) if buffer is not target else None)
        steps = (where.mine - where.owner) % where.parts
        after = where.rank_at(where.mine + 1)
        if mine:
            self.outstanding.append(dist.isend(_contiguous(target), dst=after))
            return Pending()
        buffer = _contiguous(target)
        work = dist.irecv(buffer, src=where.rank_at(where.mine - 1))

        def finish() -> None:
            if buffer is not target:
                target.copy_(buffer)
            if steps < where.parts - 1:
                self.outstanding.append(dist.isend(buffer, dst=after))

        return Pending([work], finish)

    # -- reduce-scatter: chunk c is summed into its owner -------------------------

    def _reduce_chunk(self, communicate, source, target, where, group, transport) -> Pending:
        comm = communicate.communication
        mine = where.owner == where.mine
        if where.parts == 1:
            target.copy_(source)
            return Pending()
        if transport == "copy_engine":
            self.symmetric.push(communicate, where, source)
            return Pending()
        if transport == "collective":
            buffer = source.contiguous().clone() if not source.is_contiguous() else source
            work = dist.reduce(
                buffer,
                dst=where.rank_at(where.owner),
                op=_REDUCE_OPS[comm.reduce_op],
                group=group,
                async_op=True,
            )
            return Pending([work], lambda: target.copy_(buffer) if mine else None)
        step = (where.mine - where.owner - 1) % where.parts
        after = where.rank_at(where.mine + 1)
        if step == 0:
            self.outstanding.append(dist.isend(_contiguous(source), dst=after))
            return Pending()
        received = torch.empty_like(source, memory_format=torch.contiguous_format)
        work = dist.irecv(received, src=where.rank_at(where.mine - 1))
        combine = _COMBINE[comm.reduce_op]

        def finish() -> None:
            total = combine(received.float(), source.float()).to(source.dtype)
            if mine:
                target.copy_(total)
            else:
                self.outstanding.append(dist.isend(total, dst=after))

        return Pending([work], finish)
