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

Everything that depends only on the rank and the iteration (which chunk, its
owner, the group, the peers) is worked out once, by ``prepare``; a run then
calls the returned function with the chunk's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from overlap.communications import _REDUCE_OPS, Pending, RankContext, reducible, start
from overlap.host_ir import ChunkScheme, Communicate, Transport, stream_dim
from sharding.communication import Communication, CommunicationKind
from sharding.layout import split_range

_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}

ChunkTransfer = Callable[[torch.Tensor | None, torch.Tensor | None], Pending]


def is_pipelined(comm: Communication, scheme: ChunkScheme) -> bool:
    """Whether the loop cuts the axis this communication gathers or scatters."""
    return scheme.owners > 1 and comm.split_dim == stream_dim(comm.output)


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

    @property
    def owned(self) -> bool:
        return self.owner == self.mine

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
    """Prepares the chunk communications of a program's loops on one rank."""

    def __init__(self, ctx: RankContext, symmetric) -> None:
        self.ctx = ctx
        self.symmetric = symmetric  # SymmetricBuffers, or None off CUDA
        self.outstanding: list[object] = []  # sends nobody waits for yet

    @staticmethod
    def _later(make: Callable[[], Callable]) -> Callable[[], Callable]:
        """``make()`` on first use, kept: a copy-engine transfer is prepared before the
        ranks allocate their symmetric buffers (after they agree the run may start)."""
        made: list[Callable] = []

        def get() -> Callable:
            if not made:
                made.append(make())
            return made[0]

        return get

    def drain(self) -> None:
        """Wait for every outstanding send (after a loop)."""
        for work in self.outstanding:
            work.wait()
        self.outstanding.clear()

    def prepare(
        self, communicate: Communicate, scheme: ChunkScheme, iteration: int
    ) -> ChunkTransfer:
        """The transfer of ``communicate``'s chunk at ``iteration``, for this rank."""
        comm = communicate.communication
        if not is_pipelined(comm, scheme):
            return self._whole_collective(comm)
        where = place(scheme, self.ctx.rank, iteration)
        group = self.ctx.communicator.group(where.team) if where.parts > 1 else None
        transport = communicate.transport or Transport.COLLECTIVE
        if comm.kind is CommunicationKind.Allgather:
            return self._gather_chunk(communicate, where, group, transport)
        return self._reduce_chunk(communicate, where, group, transport)

    def _whole_collective(self, comm: Communication) -> ChunkTransfer:
        def transfer(source, target) -> Pending:
            chunk_ctx = replace(self.ctx, local_shape=lambda tensor: list(target.shape))
            pending = start(comm, source, chunk_ctx)
            finish = pending.finish
            pending.finish = lambda: target.copy_(finish())
            return pending

        return transfer

    # -- all-gather: chunk c comes from its owner ------------------------------

    def _gather_chunk(self, communicate, where, group, transport) -> ChunkTransfer:
        owner = where.rank_at(where.owner)
        if where.parts == 1:
            return lambda source, target: (target.copy_(source), Pending())[1]
        if transport is Transport.COPY_ENGINE:
            if where.owned and communicate.alias_owned:
                # The chunk is used where it is: no copy (its value becomes the source).
                return lambda source, target: Pending(finish=lambda: source)
            if where.owned:
                return lambda source, target: (target.copy_(source), Pending())[1]
            pull = self._later(lambda: self.symmetric.puller(communicate, where))
            return lambda source, target: (pull()(target), Pending())[1]
        if transport is Transport.COLLECTIVE:

            def broadcast(source, target) -> Pending:
                if where.owned:
                    target.copy_(source)
                buffer = _contiguous(target)
                work = dist.broadcast(buffer, src=owner, group=group, async_op=True)
                return Pending(
                    [work], lambda: target.copy_(buffer) if buffer is not target else None
                )

            return broadcast
        steps = (where.mine - where.owner) % where.parts
        before, after = where.rank_at(where.mine - 1), where.rank_at(where.mine + 1)

        def ring(source, target) -> Pending:
            if where.owned:
                target.copy_(source)
                self.outstanding.append(dist.isend(_contiguous(target), dst=after))
                return Pending()
            buffer = _contiguous(target)
            work = dist.irecv(buffer, src=before)

            def finish() -> None:
                if buffer is not target:
                    target.copy_(buffer)
                if steps < where.parts - 1:
                    self.outstanding.append(dist.isend(buffer, dst=after))

            return Pending([work], finish)

        return ring

    # -- reduce-scatter: chunk c is summed into its owner -------------------------

    def _reduce_chunk(self, communicate, where, group, transport) -> ChunkTransfer:
        comm = communicate.communication
        if where.parts == 1:
            return lambda source, target: (target.copy_(source), Pending())[1]
        if transport is Transport.COPY_ENGINE:
            push = self._later(lambda: self.symmetric.pusher(communicate, where))
            return lambda source, target: (push()(source), Pending())[1]
        if transport is Transport.COLLECTIVE:
            owner = where.rank_at(where.owner)
            op = _REDUCE_OPS[comm.reduce_op]

            def reduce(source, target) -> Pending:
                wire, read = reducible(source, comm.reduce_op, in_place=True)
                work = dist.reduce(wire, dst=owner, op=op, group=group, async_op=True)
                return Pending([work], lambda: target.copy_(read(wire)) if where.owned else None)

            return reduce
        step = (where.mine - where.owner - 1) % where.parts
        before, after = where.rank_at(where.mine - 1), where.rank_at(where.mine + 1)
        combine = _COMBINE[comm.reduce_op]

        def ring(source, target) -> Pending:
            if step == 0:
                self.outstanding.append(dist.isend(_contiguous(source), dst=after))
                return Pending()
            received = torch.empty_like(source, memory_format=torch.contiguous_format)
            work = dist.irecv(received, src=before)

            def finish() -> None:
                total = combine(received.float(), source.float()).to(source.dtype)
                if where.owned:
                    target.copy_(total)
                else:
                    self.outstanding.append(dist.isend(total, dst=after))

            return Pending([work], finish)

        return ring
