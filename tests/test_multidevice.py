"""Multi-device scenarios as real gloo processes, each against the single-device reference.

Every scenario runs on 2 and 4 ranks with fresh random inputs, checks every rank's output
piece against the reference evaluator's whole output (cut to that rank's piece), and
asserts which communications the framework inserted.
"""

from __future__ import annotations

import pytest
import torch

from fusion import FusionDefinition, to_fp4
from fusion.testing import assert_close
from overlap.executor import MultiDeviceExecutor
from sharding import DeviceMesh, Partial, Replicate, Shard, shard

WORLD_SIZES = [2, 4]


def _inputs(seed: int, shapes: list[list[int]], dtype=torch.float32, device="cpu"):
    """The same random whole inputs on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]


def _check(communicator, fd, full_inputs, reduction_extent: int) -> list[str]:
    """Run ``fd`` on this rank, compare with the reference, return the communications."""
    executor = MultiDeviceExecutor(fd, communicator)
    expected = executor.shard_outputs(fd.execute(full_inputs))
    outputs = executor.run(executor.shard_inputs(full_inputs))
    for position, (actual, wanted) in enumerate(zip(outputs, expected, strict=True)):
        if wanted is None:
            assert actual is None, f"output {position} should not be on rank {communicator.rank}"
        else:
            assert_close(actual, wanted, reduction_extent=reduction_extent,
                         message=f"rank {communicator.rank} output {position}")  # fmt: skip
    whole = executor.gather_outputs(outputs)
    for actual, wanted in zip(whole, fd.execute(full_inputs), strict=True):
        assert_close(actual, wanted, reduction_extent=reduction_extent)
    return [
        f"{c.op_name}({c.in_layout.mesh.axis_names[c.mesh_axis]})"
        if c.mesh_axis is not None
        else c.op_name
        for c in executor.communications
    ]


# ---------------------------------------------------------------------------
# 1. Tensor-parallel MLP: column-parallel linear, gelu, row-parallel linear


def tensor_parallel_mlp(communicator, seed: int, bias: bool) -> list[str]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    tokens, hidden, ffn = 6, 16, 8 * world
    with FusionDefinition("tp_mlp") as fd:
        x = fd.define_tensor([tokens, hidden])
        w1 = fd.define_tensor([ffn, hidden])
        w2 = fd.define_tensor([hidden, ffn])
        b2 = fd.define_tensor([hidden]) if bias else None
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2, b2))
    shard(x, mesh, [Replicate()])
    shard(w1, mesh, [Shard(0)])
    shard(w2, mesh, [Shard(1)])
    shapes = [[tokens, hidden], [ffn, hidden], [hidden, ffn]] + ([[hidden]] if bias else [])
    full = _inputs(seed, shapes, device=communicator.device)
    return _check(communicator, fd, full, reduction_extent=ffn)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tensor_parallel_mlp_needs_one_allreduce(rank_pools, world, bias):
    results = rank_pools(world).run(tensor_parallel_mlp, 11, bias)
    assert results == [["Allreduce(x)"]] * world


# ---------------------------------------------------------------------------
# 2. Sequence-parallel block, and 5. the same with an uneven sequence


def sequence_parallel_block(communicator, seed: int, tokens: int) -> tuple[list[str], str]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    hidden, ffn = 16, 8 * world
    with FusionDefinition("sp_block") as fd:
        x = fd.define_tensor([tokens, hidden])
        gamma = fd.define_tensor([hidden])
        w1 = fd.define_tensor([ffn, hidden])
        w2 = fd.define_tensor([hidden, ffn])
        var, mean = fd.ops.var_mean(x, dims=[1], correction=0, keepdim=True)
        normed = (x - mean) * fd.ops.rsqrt(var + 1e-5) * fd.ops.broadcast(gamma, [True, False])
        y = fd.ops.linear(fd.ops.gelu(fd.ops.linear(normed, w1)), w2)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])
    shard(w1, mesh, [Shard(0)])
    shard(w2, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    full = _inputs(
        seed, [[tokens, hidden], [hidden], [ffn, hidden], [hidden, ffn]], device=communicator.device
    )
    kinds = _check(communicator, fd, full, reduction_extent=ffn)
    return kinds, MultiDeviceExecutor(fd, communicator).explain()


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sequence_parallel_block_gathers_then_reduce_scatters(rank_pools, world):
    results = rank_pools(world).run(sequence_parallel_block, 12, 4 * world)
    assert [kinds for kinds, _ in results] == [["Allgather(x)", "ReduceScatter(x)"]] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_uneven_sequence_is_split_unevenly_and_stays_correct(rank_pools, world):
    # 7 rows over 2 ranks: 4 and 3; over 4 ranks: 2, 2, 2 and 1.
    results = rank_pools(world).run(sequence_parallel_block, 13, 7)
    assert [kinds for kinds, _ in results] == [["Allgather(x)", "ReduceScatter(x)"]] * world


# ---------------------------------------------------------------------------
# 3. Two pipeline stages on two meshes of one device each


def pipeline_stages(communicator, seed: int) -> list[str]:
    first, second = DeviceMesh([0]), DeviceMesh([communicator.world_size - 1])
    with FusionDefinition("pipeline") as fd:
        x = fd.define_tensor([5, 12])
        w1 = fd.define_tensor([20, 12])
        w2 = fd.define_tensor([6, 20])
        activation = fd.ops.gelu(fd.ops.linear(x, w1))
        moved = fd.ops.set(activation)
        fd.add_output(fd.ops.linear(moved, w2))
    for tensor in (x, w1):
        shard(tensor, first, [Replicate()])
    for tensor in (moved, w2):
        shard(tensor, second, [Replicate()])
    full = _inputs(seed, [[5, 12], [20, 12], [6, 20]], device=communicator.device)
    return _check(communicator, fd, full, reduction_extent=20)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_pipeline_stages_send_the_activation(rank_pools, world):
    results = rank_pools(world).run(pipeline_stages, 14)
    assert results == [["SendRecv"]] * world


# ---------------------------------------------------------------------------
# 4. A 2-D mesh: data-parallel x tensor-parallel linear, all-reduce over the data axis


def data_and_tensor_parallel(communicator, seed: int, mesh_shape: list[int]) -> list[str]:
    ranks = torch.arange(communicator.world_size).reshape(mesh_shape).tolist()
    mesh = DeviceMesh(ranks, ("dp", "tp"))
    batch, features, out_features = 8, 12, 16
    with FusionDefinition("dp_tp_linear") as fd:
        x = fd.define_tensor([batch, features])
        w = fd.define_tensor([out_features, features])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, dims=[0]))  # summed over the data-parallel batch
    shard(x, mesh, [Shard(0), Replicate()])
    shard(w, mesh, [Replicate(), Shard(0)])
    full = _inputs(seed, [[batch, features], [out_features, features]], device=communicator.device)
    return _check(communicator, fd, full, reduction_extent=batch * features)


@pytest.mark.parametrize(("world", "mesh_shape"), [(2, [2, 1]), (2, [1, 2]), (4, [2, 2])])
def test_data_times_tensor_parallel_all_reduces_over_the_data_axis(rank_pools, world, mesh_shape):
    results = rank_pools(world).run(data_and_tensor_parallel, 15, mesh_shape)
    assert results == [["Allreduce(dp)"]] * world


# ---------------------------------------------------------------------------
# 6. All-to-all: the split moves from the sequence axis to the heads axis


def sequence_to_heads(communicator, seed: int) -> list[str]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    sequence, heads, head_dim = 4 * world + 1, 2 * world, 3
    with FusionDefinition("sequence_to_heads") as fd:
        x = fd.define_tensor([sequence, heads * head_dim])
        per_head = fd.ops.reshape(x, [sequence, heads, head_dim])
        by_head = fd.ops.set(per_head)
        # Needs the whole sequence of each head: a split over heads lets every rank do it.
        fd.add_output(fd.ops.sum(by_head * by_head, dims=[0]))
    shard(x, mesh, [Shard(0)])
    shard(by_head, mesh, [Shard(1)])
    full = _inputs(seed, [[sequence, heads * head_dim]], device=communicator.device)
    return _check(communicator, fd, full, reduction_extent=sequence)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moving_the_split_from_sequence_to_heads_is_one_all_to_all(rank_pools, world):
    results = rank_pools(world).run(sequence_to_heads, 16)
    assert results == [["AllToAll(x)"]] * world


# ---------------------------------------------------------------------------
# Beyond the scenarios: dynamic shapes, storage types on the wire, low precision


def symbolic_sequence(communicator, seed: int, tokens: int) -> list[str]:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition("symbolic") as fd:
        x = fd.define_tensor(["tokens", 12])
        w = fd.define_tensor([8, 12])
        y = fd.ops.relu(fd.ops.linear(x, w))
        fd.add_output(y)
        fd.add_output(fd.ops.sum(y, dims=[0]))
    shard(x, mesh, [Shard(0)])
    shard(w, mesh, [Replicate()])
    return _check(
        communicator,
        fd,
        _inputs(seed, [[tokens, 12], [8, 12]], device=communicator.device),
        reduction_extent=12,
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_symbolic_split_extent_is_bound_from_the_local_pieces(rank_pools, world):
    pool = rank_pools(world)
    for tokens in (world, 7, 50):  # one executor definition, several sequence lengths
        assert pool.run(symbolic_sequence, 17, tokens) == [["Allreduce(x)"]] * world


def gather_storage_types(communicator, seed: int) -> list[str]:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition("storage_types") as fd:
        tensors = [
            fd.define_tensor([7, 6], dtype)
            for dtype in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1", "bool", "bfloat16")
        ]
        for tensor in tensors:
            gathered = fd.ops.set(tensor)
            fd.add_output(gathered)
            shard(tensor, mesh, [Shard(0)])
            shard(gathered, mesh, [Replicate()])
    generator = torch.Generator().manual_seed(seed)
    values = (4 * torch.randn(7, 6, generator=generator)).to(communicator.device)
    full = [
        values.to(torch.float8_e4m3fn),
        values.to(torch.float8_e5m2),
        to_fp4(values),
        values > 0,
        values.to(torch.bfloat16),
    ]
    executor = MultiDeviceExecutor(fd, communicator)
    outputs = executor.run(executor.shard_inputs(full))
    for whole, gathered in zip(full, outputs, strict=True):
        assert gathered.dtype == whole.dtype and gathered.shape == whole.shape
        assert torch.equal(gathered.view(torch.uint8), whole.view(torch.uint8))
    return [c.op_name for c in executor.communications]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fp8_fp4_bool_and_bf16_travel_bit_exactly(rank_pools, world):
    assert rank_pools(world).run(gather_storage_types, 18) == [["Allgather"] * 5] * world


def bf16_row_parallel(communicator, seed: int) -> None:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    with FusionDefinition("bf16_row_parallel") as fd:
        x = fd.define_tensor([16, 64], "bfloat16")
        w = fd.define_tensor([32, 64], "bfloat16")
        fd.add_output(fd.ops.linear(x, w))
    shard(x, mesh, [Shard(1)])
    shard(w, mesh, [Shard(1)])
    full = _inputs(seed, [[16, 64], [32, 64]], torch.bfloat16, communicator.device)
    executor = MultiDeviceExecutor(fd, communicator)
    (out,) = executor.run(executor.shard_inputs(full))
    (expected,) = fd.execute(full)
    # Each rank rounds its partial sum to bf16 before the all-reduce adds the world's
    # partials: up to `world` more bf16 roundings than the reference's single one.
    assert_close(out, expected, reduction_extent=64, partial_sums=world)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_bf16_row_parallel_linear_stays_within_bf16_partial_sum_rounding(rank_pools, world):
    rank_pools(world).run(bf16_row_parallel, 19)


# ---------------------------------------------------------------------------
# Between a single rank and a mesh: broadcast, scatter, gather, reduce


def one_rank_and_a_mesh(communicator, seed: int, kind: str) -> list[str]:
    world = communicator.world_size
    everyone, last = DeviceMesh(world), DeviceMesh([world - 1])
    with FusionDefinition(kind) as fd:
        x = fd.define_tensor([7, 6])
        if kind in ("Broadcast", "Scatter"):
            produced = fd.ops.exp(x)
            moved = fd.ops.set(produced)
            fd.add_output(fd.ops.relu(moved))
            shard(x, last, [Replicate()])
            shard(moved, everyone, [Replicate() if kind == "Broadcast" else Shard(0)])
        else:
            produced = fd.ops.exp(x) if kind == "Gather" else fd.ops.sum(x, dims=[0])
            moved = fd.ops.set(produced)
            fd.add_output(moved)
            shard(x, everyone, [Shard(0)])
            if kind == "Reduce":
                shard(produced, everyone, [Partial()])
            shard(moved, last, [Replicate()])
    return _check(
        communicator, fd, _inputs(seed, [[7, 6]], device=communicator.device), reduction_extent=7
    )


@pytest.mark.parametrize("kind", ["Broadcast", "Scatter", "Gather", "Reduce"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moving_between_one_rank_and_a_mesh(rank_pools, world, kind):
    assert rank_pools(world).run(one_rank_and_a_mesh, 20, kind) == [[kind]] * world
