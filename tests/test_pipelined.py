"""Pipelined all-gather + linear and linear + reduce-scatter on real gloo processes.

Every chunk count and transport must give the reference's result on fresh random
inputs, uneven rows included; a chunk count that cannot work fails on every rank before
any communication.
"""

from __future__ import annotations

import pytest
import torch
from distributed import RankError

from fusion import FusionDefinition
from fusion.testing import assert_close
from overlap.executor import MultiDeviceExecutor
from overlap.planner import OverlapOptions
from sharding import DeviceMesh, Shard, ShardingError, shard


def _ag_linear(world: int, rows: int, bias: bool) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("ag_linear") as fd:
        x = fd.define_tensor([rows, 12])
        w = fd.define_tensor([4 * world, 12])
        b = fd.define_tensor([4 * world]) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])  # sequence split, gathered for a column-parallel linear
    shard(w, mesh, [Shard(0)])
    return fd


def _linear_rs(world: int, rows: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("linear_rs") as fd:
        # a contraction longer than the rows: reduce-scattering the result is the cheaper
        # plan (with 4 a rank, moving the rows and gathering the weight would be)
        x = fd.define_tensor([rows, 16 * world])
        w = fd.define_tensor([10, 16 * world])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, mesh, [Shard(1)])  # row-parallel linear, reduce-scattered back to rows
    shard(w, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    return fd


def pipelined(communicator, pattern: str, rows: int, chunks: int, transport: str, seed: int):
    world = communicator.world_size
    fd = _ag_linear(world, rows, bias=True) if pattern == "ag" else _linear_rs(world, rows)
    options = OverlapOptions(overlap=True, num_chunks=chunks, transport=transport)
    executor = MultiDeviceExecutor(fd, communicator, options)
    generator = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(list(t.shape), generator=generator).to(communicator.device)
        for t in fd.fusion.inputs
    ]
    expected = executor.shard_outputs(fd.execute(full))
    for _ in range(2):  # a second run reuses buffers and streams
        (out,) = executor.run(executor.shard_inputs(full))
        assert_close(out, expected[0], reduction_extent=(4 if pattern == "ag" else 16) * world)
    (decision,) = executor.overlap
    return decision.overlapped, decision.chosen.num_chunks, decision.chosen.transport


CASES = [
    # (pattern, rows, chunks as a multiple of the world, transport)
    ("ag", 16, 1, "collective"),
    ("ag", 16, 2, "collective"),
    ("ag", 13, 3, "collective"),  # rows split 7/6 (or 4/3/3/3), chunks uneven too
    ("ag", 13, 1, "ring"),
    ("ag", 16, 4, "ring"),  # OverlapOptions(num_chunks=8, transport="ring"), as in the guide
    ("rs", 16, 1, "collective"),
    ("rs", 16, 2, "collective"),
    ("rs", 13, 3, "collective"),
    ("rs", 13, 1, "ring"),
    ("ag", 13, 3, "ring"),  # several chunks a rank travel the ring one after another
    ("rs", 16, 4, "ring"),
]


@pytest.mark.parametrize(("pattern", "rows", "per_rank", "transport"), CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_pattern_matches_the_reference(rank_pools, world, pattern, rows, per_rank,
                                                 transport):  # fmt: skip
    chunks = per_rank * world
    results = rank_pools(world).run(pipelined, pattern, rows, chunks, transport, 21)
    assert results == [(True, chunks, transport)] * world


def chunks_not_a_multiple(communicator) -> None:
    fd = _ag_linear(communicator.world_size, 16, bias=False)
    options = OverlapOptions(overlap=True, num_chunks=communicator.world_size + 1)
    MultiDeviceExecutor(fd, communicator, options)


@pytest.mark.parametrize("world", [2, 4])
def test_a_chunk_count_that_is_not_a_multiple_of_the_team_fails_on_every_rank(rank_pools, world):
    pool = rank_pools(world)
    with pytest.raises(RankError) as failure:
        pool.run(chunks_not_a_multiple, timeout=60)
    assert sorted(failure.value.failures) == list(range(world))
    for rank, message in failure.value.messages().items():
        assert failure.value.failures[rank][0] == ShardingError.__name__
        assert "must be a multiple of" in message, message


def copy_engine_on_cpu(communicator) -> None:
    fd = _ag_linear(communicator.world_size, 16, bias=False)
    MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=True, transport="copy_engine"))


def test_the_copy_engine_transport_is_refused_on_cpu_before_any_communication(rank_pools):
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(copy_engine_on_cpu, timeout=60)
    assert all("needs CUDA" in m for m in failure.value.messages().values())
