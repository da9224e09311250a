"""UCX point-to-point transfers (``overlap.comm.ucx``) between two CPU processes: exact bytes
for every dtype, one-way and as a ring step, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from launch.local import run_function

pytest.importorskip("ucxx")


def _payloads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(1000, 33, generator=generator).bfloat16(),
        torch.randn(17, generator=generator),
        torch.randint(-(2**62), 2**62, (123,), generator=generator, dtype=torch.int64),
        torch.randint(0, 256, (4096,), generator=generator, dtype=torch.uint8),  # fp4 pairs
        torch.randn(1024, 1024, generator=generator, dtype=torch.float64),  # 8 MiB
        torch.randn(3, 5, 7, generator=generator).transpose(
            0, 2
        ),  # not contiguous: sent as its values
    ]


def _one_way(communicator) -> list[torch.Tensor]:
    from overlap import UcxTransport

    transport = UcxTransport(communicator)
    received = []
    try:
        for tensor in _payloads():
            if communicator.rank == 0:
                transport.send(tensor, peer=1)
            else:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype)  # contiguous
                received.append(transport.recv(buffer, peer=0))
    finally:
        transport.close()
    return received


def _ring(communicator) -> torch.Tensor:
    from overlap import UcxTransport

    transport = UcxTransport(communicator)
    try:
        mine = torch.full((1 << 20,), communicator.rank + 1, dtype=torch.float32)
        into = torch.empty_like(mine)
        world = communicator.world_size
        nxt, previous = (communicator.rank + 1) % world, (communicator.rank - 1) % world
        got = transport.sendrecv(mine, nxt, into, previous)
        return bool(torch.equal(got, torch.full_like(got, previous + 1)))
    finally:
        transport.close()


def _refusals(communicator) -> list[str]:
    from overlap import UcxTransport

    transport = UcxTransport(communicator)
    said = []
    try:
        try:
            transport.send(torch.zeros(3), peer=communicator.rank)
        except ValueError as error:
            said.append(str(error))
        try:
            transport.recv(torch.zeros(4, 4).t(), peer=1 - communicator.rank)
        except ValueError as error:
            said.append(str(error))
    finally:
        transport.close()
    return said


def test_host_tensors_arrive_with_their_exact_bytes():
    _, received = run_function(_one_way, nproc=2, timeout_s=120)
    for sent, got in zip(_payloads(), received, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           sent.contiguous().reshape(-1).view(torch.uint8))  # fmt: skip


def test_a_ring_step_sends_and_receives_at_once():
    # each rank got its previous rank's 4 MiB (rank + 1 everywhere)
    assert run_function(_ring, nproc=2, timeout_s=120) == [True, True]


def test_bad_peers_and_buffers_are_refused_before_any_transfer():
    for said in run_function(_refusals, nproc=2, timeout_s=120):
        assert said[0].startswith("peer ") and "another rank" in said[0]
        assert said[1] == "recv needs a contiguous tensor to fill"
