"""Symmetric-memory buffers for copy-engine transfers between GPUs (CUDA only).

Every rank allocates the same buffer (``torch.distributed._symmetric_memory``)
and maps its peers' copies, so a plain ``copy_`` between a local tensor and a
peer's buffer is a device-to-device copy done by the copy engines: no SMs.

- all-gather: each rank stages its piece in its buffer, a barrier makes sure
  every piece is there, then every rank pulls the chunks it needs;
- reduce-scatter: each rank pushes partial chunk ``c`` into slot ``me`` of
  the owner's buffer, a barrier makes sure every push has landed, then the
  owner sums its slots.

Buffers alternate between two halves from one run to the next, so a rank never
overwrites what a slower peer may still be reading: the barrier of run n+1
comes after every rank's copies of run n, and run n+2 is the next to write
the same half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.host_ir import ChunkScheme, Communicate
from overlap.pipelined import ChunkPlace, chunk_rows
from sharding.layout import split_sizes


@dataclass
class _Buffer:
    tensor: torch.Tensor  # [2, slots, rows, *rest]
    handle: object
    members: tuple[int, ...]  # the team's ranks in group order
    extent: int  # the whole extent of the split axis
    scheme: ChunkScheme
    dim: int  # the split axis in the tensors that move


class SymmetricBuffers:
    """The symmetric buffers of one executor, one per copy-engine communication."""

    def __init__(self, communicator) -> None:
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        self.symm_mem = symm_mem
        self.communicator = communicator
        self.buffers: dict[Communicate, _Buffer] = {}
        self.parity = 0

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
        group = self.communicator.group(team)
        slots = 1 if comm.kind.value == "Allgather" else scheme.owners
        rows = max(split_sizes(extent, scheme.owners))
        tensor = self.symm_mem.empty(
            (2, slots, rows, *rest), dtype=dtype, device=self.communicator.device
        )
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        handle = self.symm_mem.rendezvous(tensor, group.group_name)
        self.buffers[communicate] = _Buffer(
            tensor, handle, tuple(sorted(team)), extent, scheme, dim
        )

    def _peer(self, buffer: _Buffer, rank: int) -> torch.Tensor:
        return buffer.handle.get_buffer(
            buffer.members.index(rank), tuple(buffer.tensor.shape), buffer.tensor.dtype
        )

    def _chunk(self, buffer: _Buffer, where: ChunkPlace) -> tuple[int, int]:
        block = split_sizes(buffer.extent, buffer.scheme.owners)[where.owner]
        return chunk_rows(block, buffer.scheme, where.chunk, split=True)

    # -- all-gather --------------------------------------------------------------

    def stage(self, communicate: Communicate, local: torch.Tensor) -> None:
        """Copy this rank's piece into its buffer, then wait until every peer's is there."""
        buffer = self.buffers[communicate]
        moved = local.movedim(buffer.dim, 0)
        buffer.tensor[self.parity, 0, : moved.shape[0]].copy_(moved)
        buffer.handle.barrier(channel=0)

    def pull(self, communicate: Communicate, where: ChunkPlace, target: torch.Tensor) -> None:
        """Copy the owner's rows of chunk ``where.chunk`` into ``target``."""
        buffer = self.buffers[communicate]
        offset, size = self._chunk(buffer, where)
        peer = self._peer(buffer, where.rank_at(where.owner))
        target.movedim(buffer.dim, 0).copy_(peer[self.parity, 0, offset : offset + size])

    # -- reduce-scatter ----------------------------------------------------------

    def push(self, communicate: Communicate, where: ChunkPlace, partial: torch.Tensor) -> None:
        """Copy this rank's partial chunk into its slot of the owner's buffer."""
        buffer = self.buffers[communicate]
        offset, size = self._chunk(buffer, where)
        destination = self._peer(buffer, where.rank_at(where.owner))
        destination[self.parity, where.mine, offset : offset + size].copy_(
            partial.movedim(buffer.dim, 0)
        )

    def combine(self, communicate: Communicate, output: torch.Tensor) -> None:
        """Wait until every push has landed, then sum the slots into this rank's piece."""
        buffer = self.buffers[communicate]
        buffer.handle.barrier(channel=0)
        moved = output.movedim(buffer.dim, 0)
        slots = buffer.tensor[self.parity, :, : moved.shape[0]]
        total = slots[0].float()
        for slot in range(1, slots.shape[0]):
            total += slots[slot].float()
        moved.copy_(total.to(output.dtype))
