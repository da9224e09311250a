"""Point-to-point transfers over UCX (``ucxx``), beside the torch.distributed groups.

    transport = UcxTransport(communicator)      # collective: every rank, same order
    transport.send(tensor, peer=1)              # rank 0
    transport.recv(buffer, peer=0)              # rank 1: a contiguous tensor to fill
    transport.sendrecv(out, next_rank, into, previous_rank)   # a ring step
    transport.close()                           # collective too

Every rank listens on a port; the addresses are exchanged through the communicator's
host group; each rank connects to the ranks below it and introduces itself, so every
pair of ranks shares one endpoint. Messages between a pair arrive in the order they
were sent (one tag per endpoint). Host tensors travel as their bytes; CUDA tensors
too where the UCX build has its CUDA transports (the wheels of
``../shared/tools/device-wheels.sh ucx``). Calls block until the transfer is done.

ucxx endpoints use TCP unless told otherwise, even on one host; shared memory needs
``UCX_POSIX_ERROR_HANDLING=y`` and ``UCX_SYSV_ERROR_HANDLING=y`` on both sides. The
PyPI UCX has no InfiniBand/RoCE: RDMA needs a system UCX.
"""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import torch

from overlap.comm.communicator import Communicator

_RANK_BYTES = 8  # the first message on a new endpoint: the connecting rank


def _ucxx():
    try:
        import ucxx
    except ImportError:
        raise RuntimeError(
            "UCX transfers need ucxx: pip install ucxx-cu12 (or ucxx-cu13 for CUDA 13)"
        ) from None
    return ucxx


def _bytes_of(tensor: torch.Tensor, writable: bool):
    """The buffer ucxx sends from or receives into: the tensor's own bytes."""
    if not tensor.is_contiguous():
        if writable:
            raise ValueError("recv needs a contiguous tensor to fill")
        tensor = tensor.contiguous()
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if tensor.is_cuda else flat.numpy()


class UcxTransport:
    """Point-to-point transfers between the ranks of ``communicator`` over UCX."""

    def __init__(self, communicator: Communicator, host: str | None = None,
                 timeout_s: float = 60.0) -> None:  # fmt: skip
        ucxx = _ucxx()
        self.rank, self.world_size = communicator.rank, communicator.world_size
        self._communicator = communicator
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)  # ucxx progresses on the current loop
        self._endpoints: dict[int, object] = {}
        self._accepted = asyncio.Event()
        waiting_for = self.world_size - 1 - self.rank  # the ranks above connect to us

        async def accept(endpoint) -> None:
            peer = np.empty(1, dtype=np.int64)
            await endpoint.recv(peer)
            self._endpoints[int(peer[0])] = endpoint
            if sum(1 for p in self._endpoints if p > self.rank) == waiting_for:
                self._accepted.set()

        async def listen():
            return ucxx.create_listener(accept)

        self._listener = self._loop.run_until_complete(listen())
        host = host or _this_host()
        addresses = communicator.all_gather_object((host, self._listener.port))

        async def connect() -> None:
            for peer in range(self.rank):
                endpoint = await ucxx.create_endpoint(*addresses[peer])
                await endpoint.send(np.array([self.rank], dtype=np.int64))
                self._endpoints[peer] = endpoint
            if waiting_for == 0:
                self._accepted.set()
            await asyncio.wait_for(self._accepted.wait(), timeout_s)

        self._run(connect())

    def _run(self, coroutine):
        return self._loop.run_until_complete(asyncio.wait_for(coroutine, self.timeout_s))

    def _endpoint(self, peer: int):
        if peer == self.rank or not 0 <= peer < self.world_size:
            raise ValueError(f"peer {peer}: another rank of the world of {self.world_size}")
        return self._endpoints[peer]

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send ``tensor``'s bytes to ``peer`` (which receives into a tensor of as many)."""
        self._run(self._endpoint(peer).send(_bytes_of(tensor, writable=False)))

    def recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        """Fill contiguous ``tensor`` with the bytes ``peer`` sent; returns it."""
        self._run(self._endpoint(peer).recv(_bytes_of(tensor, writable=True)))
        return tensor

    def sendrecv(self, tensor: torch.Tensor, to: int, into: torch.Tensor, source: int):
        """Send to ``to`` and receive from ``source`` at once (a ring step never waits on
        itself); returns ``into``."""

        async def both() -> None:
            await asyncio.gather(
                self._endpoint(to).send(_bytes_of(tensor, writable=False)),
                self._endpoint(source).recv(_bytes_of(into, writable=True)),
            )

        self._run(both())
        return into

    def close(self) -> None:
        """Collective: every rank's transfers end before any endpoint closes (a peer
        still receiving would see its connection reset)."""
        if self._loop.is_closed():
            return
        self._communicator.all_gather_object(None)  # a barrier on the host group

        async def shut() -> None:
            for endpoint in self._endpoints.values():
                await endpoint.close()
            self._listener.close()

        self._loop.run_until_complete(shut())
        self._loop.close()
        self._endpoints.clear()


def _this_host() -> str:
    """An address the other ranks can reach: this host's, or loopback when alone."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
