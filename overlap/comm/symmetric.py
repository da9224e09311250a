"""Symmetric-memory buffers for copy-engine transfers between GPUs (CUDA only).

Every rank allocates the same buffer (``torch.distributed._symmetric_memory``)
and maps its peers' copies, so a plain ``copy_`` between a local tensor and a
peer's buffer is a device-to-device copy done by the copy engines: no SMs.

- all-gather: each rank stages its piece in its buffer, a barrier makes sure
  every piece is there, then every rank pulls the chunks it needs;
- reduce-scatter: each rank pushes partial chunk ``c`` into slot ``me`` of
  the owner's buffer, a barrier makes sure every push has landed, then the
  owner combines the slots in coordinate order (``overlap.comm.partials``).

Buffers alternate between two halves from one run to the next, so a rank never
overwrites what a slower peer may still be reading: the barrier of run n+1
comes after every rank's copies of run n, and run n+2 is the next to write
the same half.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlap.comm.pipelined import ChunkPlace, chunk_rows
from overlap.ir import ChunkScheme, Communicate
from sharding.layout import split_sizes


@dataclass
class _Buffer:
    tensor: torch.Tensor  # [2, slots, rows, *rest]
    handle: object
    members: tuple[int, ...]  # the team's ranks in group order
    extent: int  # the whole extent of the split axis
    scheme: ChunkScheme
    dim: int  # the split axis in the tensors that move
    peers: dict[int, torch.Tensor] = field(default_factory=dict)
    staged: torch.cuda.Event | None = None  # recorded once this rank's piece is staged
    pulled: torch.cuda.Event | None = None  # recorded once the run's latest pull is done


class SymmetricBuffers:
    """The symmetric buffers of one executor, one per copy-engine communication."""

    def __init__(self, communicator) -> None:
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        self.symm_mem = symm_mem
        self.communicator = communicator
        self.buffers: dict[Communicate, _Buffer] = {}
        self.parity = 0
        self.stage_stream = torch.cuda.Stream(communicator.device)

    def next_run(self) -> None:
        self.parity ^= 1

    def allocate(
        self,
        communicate: Communicate,
        scheme: ChunkScheme,
        extent: int,
        dim: int,
        rest: list[int],
        dtype: torch.dtype,
    ) -> None:
        """Allocate and map the buffer of ``communicate`` (collective: every rank, same order).

        ``rest`` is the shape of a piece without its split axis.
        """
        if communicate in self.buffers:
            return
        comm = communicate.communication
        team = comm.in_layout.mesh.team(self.communicator.rank, comm.mesh_axis)
        group = self.communicator.group(team) or dist.group.WORLD
        slots = 1 if comm.kind.value == "Allgather" else scheme.owners
        rows = max(split_sizes(extent, scheme.owners))
        tensor = self.symm_mem.empty(
            (2, slots, rows, *rest), dtype=dtype, device=self.communicator.device
        )
        handle = self.symm_mem.rendezvous(tensor, group.group_name)
        buffer = _Buffer(tensor, handle, tuple(sorted(team)), extent, scheme, dim)
        for rank in buffer.members:
            buffer.peers[rank] = handle.get_buffer(
                buffer.members.index(rank), tuple(tensor.shape), tensor.dtype
            )
        self.buffers[communicate] = buffer

    def _chunk(self, buffer: _Buffer, where: ChunkPlace) -> tuple[int, int]:
        block = split_sizes(buffer.extent, buffer.scheme.owners)[where.owner]
        return chunk_rows(block, buffer.scheme, where.chunk, split=True)

    # -- all-gather --------------------------------------------------------------

    def stage(self, communicate: Communicate, local: torch.Tensor) -> None:
        """Copy this rank's piece into its buffer, then wait until every peer's is there.

        Done on a stream of its own: the streams that pull wait for it, the ones that
        compute with this rank's own chunks do not.
        """
        buffer = self.buffers[communicate]
        moved = local.movedim(buffer.dim, 0)
        self.stage_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stage_stream):
            buffer.tensor[self.parity, 0, : moved.shape[0]].copy_(moved)
            buffer.handle.barrier(channel=0)
            buffer.staged = torch.cuda.Event()
            buffer.staged.record(self.stage_stream)
        buffer.pulled = None
        local.record_stream(self.stage_stream)

    def puller(self, communicate: Communicate, where: ChunkPlace) -> Callable:
        """A function copying the owner's rows of ``where``'s chunk into a target.

        A run's pulls go one after another, each after the one posted before it (they
        are posted in the order the chunks are used, each on its chunk's stream): posted
        all at once on their streams, they would share the links, and at 4 ranks the
        first chunk would land with the last instead of one pull after the start.
        """
        buffer = self.buffers[communicate]
        offset, size = self._chunk(buffer, where)
        halves = [
            buffer.peers[where.rank_at(where.owner)][parity, 0, offset : offset + size]
            for parity in (0, 1)
        ]
        dim = buffer.dim
        done = torch.cuda.Event()

        def pull(target: torch.Tensor) -> None:
            stream = torch.cuda.current_stream()
            stream.wait_event(buffer.staged)
            if buffer.pulled is not None:
                stream.wait_event(buffer.pulled)
            target.movedim(dim, 0).copy_(halves[self.parity])
            done.record(stream)
            buffer.pulled = done

        return pull

    # -- reduce-scatter ----------------------------------------------------------

    def pusher(self, communicate: Communicate, where: ChunkPlace) -> Callable:
        """A function copying a partial chunk into this rank's slot of the owner's buffer."""
        buffer = self.buffers[communicate]
        offset, size = self._chunk(buffer, where)
        halves = [
            buffer.peers[where.rank_at(where.owner)][parity, where.mine, offset : offset + size]
            for parity in (0, 1)
        ]
        dim = buffer.dim

        def push(partial: torch.Tensor) -> None:
            halves[self.parity].copy_(partial.movedim(dim, 0))

        return push

    def combine(self, communicate: Communicate, output: torch.Tensor, combiner) -> None:
        """Wait until every push has landed, then combine the slots into this rank's
        piece with ``combiner`` (``overlap.comm.partials``: in coordinate order, one pass)."""
        buffer = self.buffers[communicate]
        buffer.handle.barrier(channel=0)
        moved = output.movedim(buffer.dim, 0)
        slots = buffer.tensor[self.parity, :, : moved.shape[0]]
        combiner(list(slots), moved)
