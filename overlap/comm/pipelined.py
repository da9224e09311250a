"""Pipelined communications: one chunk per loop iteration, by three transports.

Inside a stream loop, an all-gather along the stream axis delivers chunk ``c``
(sub-chunk ``c % k`` of its owner's rows) and a reduce-scatter sums chunk ``c``
into its owner. How a chunk moves:

- ``collective``: an all-gather chunk is broadcast from its owner, every rank
  issuing the broadcasts in the same (global) order. A reduce-scatter chunk's
  partials go whole to its owner (each iteration's sends and receives posted as one
  batch: in the ``local_last`` order the planner picks, every rank sends one
  partial to one owner and receives one, all links busy at once); the owner combines
  them, in coordinate order, at its own iteration of the chunk (``overlap.comm.partials``).
- ``ring``: send/receive to the ring neighbours; an all-gather chunk is
  forwarded rank to rank starting at its owner, a reduce-scatter chunk is
  accumulated rank to rank and lands on its owner. Each step of the ring is one batch
  of a send to the successor and a receive from the predecessor (``overlap.comm.ring``).
- ``copy_engine`` (CUDA only): ``copy_`` from (all-gather) or to
  (reduce-scatter) peers' symmetric-memory buffers. The copies run on the
  copy engines, so they take no SMs from the matmul; a rank may visit chunks
  in any order, its own first (all-gather) or last (reduce-scatter).

A reduce-scatter's partials are summed in one documented order: by the collective
and copy-engine transports as ``overlap.comm.partials`` says (given the same partials, the
same bits at every chunk count and by either transport), by the ring hop by hop along
the ring, from the owner's successor to the owner, each hop's sum rounded to the
output's type (the same bits at every chunk count, given the same partials).

A communication that acts along another axis than the stream axis (an
all-reduce of a chunk, say) runs the whole-tensor collective on the chunk.

Everything that depends only on the rank and the iteration (which chunk, its
owner, the group, the peers) is worked out once, by ``prepare``; a run then
calls the returned function with the chunk's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from overlap.comm.communications import Pending, Post, RankContext, prepare
from overlap.comm.partials import COMBINE, PartialCombiner
from overlap.comm.ring import RingSteps
from overlap.ir import ChunkScheme, Communicate, Transport
from schedulers.runtime import allocator, contiguous_strides
from sharding.communication import Communication, CommunicationKind
from sharding.errors import ShardingError
from sharding.layout import split_range

ChunkTransfer = Callable[[torch.Tensor | None, torch.Tensor | None], Pending]


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


def _landing(view: torch.Tensor) -> torch.Tensor:
    """Where a transfer into ``view`` lands: the view itself, or a new contiguous
    buffer (copied into the view after)."""
    return (
        view
        if view.is_contiguous()
        else torch.empty_like(view, memory_format=torch.contiguous_format)
    )


class _Batch:
    """One iteration's sends and receives, waited for by that iteration and again by the
    owner combining what they brought. Waiting orders the current CUDA stream after
    them, every time; on the host the works are waited for once (a gloo send or
    receive waited for a second time blocks for ever)."""

    def __init__(self, works: list, device: torch.device) -> None:
        self.works, self.again = works, device.type == "cuda"
        self.waited = False

    def wait(self) -> None:
        if self.again or not self.waited:
            for work in self.works:
                work.wait()
            self.waited = True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class PipelinedComms:
    """Prepares the chunk communications of a program's loops on one rank."""

    def __init__(self, ctx: RankContext, symmetric, hardware=None) -> None:
        self.ctx = ctx
        self.symmetric = symmetric  # SymmetricBuffers, or None off CUDA
        self.hardware = hardware  # sums of partials as generated kernels for it; None: torch
        self.allocate = allocator(ctx.device)
        self.ring = RingSteps(ctx.device)
        self.combiners: dict[Communicate, PartialCombiner] = {}
        # where the peers' partials land, by communication, chunk and sender: a loop's,
        # allocated as its run needs them and dropped after it (``drain``)
        self.inboxes: dict[tuple[Communicate, int, int], torch.Tensor] = {}
        # a run's receives of partials, by communication and chunk, until the owner
        # combines them
        self.arrivals: dict[tuple[Communicate, int], list[_Batch]] = {}

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
        """After a loop: drop its inboxes and what its rings sent (the user's stream has
        waited for every stream that used them, and every transfer was waited for)."""
        self.ring.clear()
        self.inboxes.clear()

    def new_run(self) -> None:
        """Forget what a run that raised left behind."""
        self.ring.clear()
        self.arrivals.clear()
        self.inboxes.clear()

    def combiner(self, communicate: Communicate, elements: int) -> PartialCombiner:
        """How this rank combines the partials of ``communicate`` (a reduce-scatter),
        ``elements`` at a time: on CUDA its kernel for that size is compiled now."""
        if communicate not in self.combiners:
            comm = communicate.communication
            parts = comm.in_layout.mesh.shape[comm.mesh_axis]
            dtype = self.ctx.storage_dtype(comm.inputs[0])
            self.combiners[communicate] = PartialCombiner(
                parts, comm.reduce_op, dtype, self.hardware
            )
        combine = self.combiners[communicate]
        if self.ctx.device.type == "cuda":
            combine.warm_up(self.ctx.device, elements)
        return combine

    def prepare(
        self, communicate: Communicate, scheme: ChunkScheme, iteration: int
    ) -> ChunkTransfer:
        """The transfer of ``communicate``'s chunk at ``iteration``, for this rank."""
        comm = communicate.communication
        if not communicate.pipelined:
            return self._whole_collective(comm)
        where = place(scheme, self.ctx.rank, iteration)
        group = self.ctx.communicator.group(where.team) if where.parts > 1 else None
        transport = communicate.transport or Transport.COLLECTIVE
        if comm.kind is CommunicationKind.Allgather:
            return self._gather_chunk(communicate, scheme, iteration, where, group, transport)
        if transport is Transport.COLLECTIVE and where.parts > 1:
            return self._deliver_chunk(communicate, scheme, iteration, where, group)
        return self._reduce_chunk(communicate, scheme, iteration, where, group, transport)

    def _whole_collective(self, comm: Communication) -> ChunkTransfer:
        """The whole collective on a chunk, prepared (``communications.prepare``) at its
        first run for the chunk's shapes, which every run of the program repeats."""
        prepared: dict[tuple, Post] = {}

        def transfer(source, target) -> Pending:
            shapes = (target.shape if source is None else source.shape, target.shape)
            post = prepared.get(shapes)
            if post is None:
                moving = comm.inputs[0]

                def chunk_shape(tensor) -> list[int]:
                    return list(shapes[0] if tensor is moving else shapes[1])

                post = prepared[shapes] = prepare(comm, replace(self.ctx, local_shape=chunk_shape))
            pending = post(source)
            finish = pending.finish
            pending.finish = lambda: target.copy_(finish())
            return pending

        return transfer

    # -- all-gather: chunk c comes from its owner ------------------------------

    def _gather_chunk(self, communicate, scheme, iteration, where, group,
                      transport) -> ChunkTransfer:  # fmt: skip
        owner = where.rank_at(where.owner)
        to_global = self.ctx.communicator.global_rank  # what torch.distributed names
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
                work = dist.broadcast(buffer, src=to_global(owner), group=group, async_op=True)
                return Pending(
                    [work], lambda: target.copy_(buffer) if buffer is not target else None
                )

            return broadcast
        steps = (where.mine - where.owner) % where.parts  # hops from the owner
        before = to_global(where.rank_at(where.mine - 1))
        after = to_global(where.rank_at(where.mine + 1))
        # this iteration's step, and the one the successor takes this chunk at
        now, later = (communicate, iteration), (communicate, iteration + scheme.per_owner)

        def ring(source, target) -> Pending:
            if where.owned:
                target.copy_(source)
                self.ring.hand_on(later, _contiguous(target))
                return Pending()
            buffer = _landing(target)
            works = self.ring.step(now, after, buffer, before, group)

            def finish() -> None:
                if buffer is not target:
                    target.copy_(buffer)
                if steps < where.parts - 1:
                    self.ring.hand_on(later, buffer)

            return Pending(works, finish)

        return ring

    # -- reduce-scatter: chunk c is summed into its owner -------------------------

    def _deliver_chunk(self, communicate, scheme, iteration, where, group) -> ChunkTransfer:
        """A reduce-scatter chunk by the collective transport: this rank's partial of
        the chunk it computes now goes whole to its owner, and the partials of this
        rank's own chunks that its peers compute now come in (one batch of sends and
        receives, which every rank of the team posts, empty chunks too). At this rank's
        own iteration of a chunk, which must be the last at which any of its partials
        is sent, it combines them in coordinate order."""
        comm = communicate.communication
        dim = comm.split_dim
        to_global = self.ctx.communicator.global_rank  # what torch.distributed names
        senders = {
            coordinate: scheme.chunk(iteration, coordinate)
            for coordinate in range(where.parts)
            if coordinate != where.mine
            and scheme.chunk(iteration, coordinate) // scheme.per_owner == where.mine
        }
        # each peer's partial: where it lands (its inbox's key and shape), who sends it
        incoming = [
            ((communicate, chunk, coordinate), self._inbox_shape(communicate, scheme, chunk),
             to_global(where.rank_at(coordinate)))
            for coordinate, chunk in senders.items()
        ]  # fmt: skip
        chunks = set(senders.values())
        owner = to_global(where.rank_at(where.owner))
        combine = (
            self._owner_combine(communicate, scheme, iteration, where) if where.owned else None
        )

        def deliver(source, target) -> Pending:
            ops = [dist.P2POp(dist.irecv, self._inbox(key, shape), peer, group)
                   for key, shape, peer in incoming]  # fmt: skip
            outgoing = None
            if not where.owned:
                outgoing = _contiguous(source if dim == 0 else source.movedim(dim, 0))
                ops.append(dist.P2POp(dist.isend, outgoing, owner, group))
            batch = _Batch(dist.batch_isend_irecv(ops) if ops else [], self.ctx.device)
            for chunk in chunks:
                self.arrivals.setdefault((communicate, chunk), []).append(batch)
            if combine is not None:
                return combine(source, target)
            return Pending([batch], lambda kept=outgoing: None)  # kept until it is sent

        return deliver

    def _inbox_shape(self, communicate, scheme, chunk: int) -> tuple:
        """How a peer's partial of ``chunk`` lands (the split axis first): its shape,
        strides and dtype, as ``_inbox`` allocates it."""
        comm = communicate.communication
        dim = comm.split_dim
        whole = self.ctx.local_shape(comm.inputs[0])
        _, size = chunk_rows(whole[dim], scheme, chunk, split=False)
        shape = (size, *whole[:dim], *whole[dim + 1 :])
        return shape, contiguous_strides(shape), self.ctx.storage_dtype(comm.inputs[0])

    def _inbox(self, key: tuple[Communicate, int, int], shape: tuple) -> torch.Tensor:
        """Where the partial of a chunk from a peer lands in this run (``key``:
        communication, chunk, the peer's coordinate; ``shape``: ``_inbox_shape``'s),
        allocated at its first use."""
        inbox = self.inboxes.get(key)
        if inbox is None:
            inbox = self.inboxes[key] = self.allocate(*shape)
        return inbox

    def _owner_combine(self, communicate, scheme, iteration, where):
        """At the owner's own iteration of a chunk: wait for every peer's partial of it,
        then combine them with its own, in coordinate order, into the chunk's rows."""
        comm = communicate.communication
        dim, chunk = comm.split_dim, where.chunk
        visits = range(scheme.num_chunks)
        sent_at = {
            coordinate: next(i for i in visits if scheme.chunk(i, coordinate) == chunk)
            for coordinate in range(where.parts)
        }
        late = [coordinate for coordinate, i in sent_at.items() if i > iteration]
        if late:
            raise ShardingError(
                f"{comm.op_name} of {comm.inputs[0]}: in order {scheme.order}, rank "
                f"{where.rank_at(late[0])} computes its partial of chunk {chunk} after the "
                "chunk's owner, which combines them at its own iteration"
            )
        shape = self._inbox_shape(communicate, scheme, chunk)
        peers = [(communicate, chunk, c) if c != where.mine else None for c in range(where.parts)]
        combiner = self.combiner(communicate, math.prod(shape[0]))

        def combine(source, target) -> Pending:
            own = source if dim == 0 else source.movedim(dim, 0)
            partials = [own if key is None else self._inbox(key, shape) for key in peers]
            rows = target if dim == 0 else target.movedim(dim, 0)
            return Pending(
                self.arrivals.pop((communicate, chunk), []), lambda: combiner(partials, rows)
            )

        return combine

    def _reduce_chunk(self, communicate, scheme, iteration, where, group,
                      transport) -> ChunkTransfer:  # fmt: skip
        comm = communicate.communication
        if where.parts == 1:
            return lambda source, target: (target.copy_(source), Pending())[1]
        if transport is Transport.COPY_ENGINE:
            push = self._later(lambda: self.symmetric.pusher(communicate, where))
            return lambda source, target: (push()(source), Pending())[1]
        step = (where.mine - where.owner - 1) % where.parts
        to_global = self.ctx.communicator.global_rank  # what torch.distributed names
        before = to_global(where.rank_at(where.mine - 1))
        after = to_global(where.rank_at(where.mine + 1))
        combine = COMBINE[comm.reduce_op]
        # this iteration's step, and the one the successor takes this chunk at
        now, later = (communicate, iteration), (communicate, iteration + scheme.per_owner)

        def ring(source, target) -> Pending:
            if step == 0:
                self.ring.hand_on(later, _contiguous(source))
                return Pending()
            received = torch.empty_like(source, memory_format=torch.contiguous_format)
            works = self.ring.step(now, after, received, before, group)

            def finish() -> None:
                total = combine(received.float(), source.float()).to(source.dtype)
                if where.owned:
                    target.copy_(total)
                else:
                    self.ring.hand_on(later, _contiguous(total))

            return Pending(works, finish)

        return ring
