"""Multi-device scenarios as real gloo processes, each against the single-device reference.

Every scenario runs on 2 and 4 ranks with fresh random inputs, checks every rank's output
piece against the reference evaluator's whole output (cut to that rank's piece), and
asserts which communications the framework inserted. Its backward
(``overlap.train.backward.placed_backward``) runs too: every rank's piece of every input's
gradient against torch autograd through the reference evaluator on one device. Each
runs twice: with the compute evaluated by the reference evaluator, and with generated
Triton kernels (under Triton's interpreter here, compiled on GPUs by
``benchmarks/check_gpu.py``), so that a kernel that is right only on rank 0's piece
fails here.
"""

from __future__ import annotations

import pytest
import torch

from fusion import FusionDefinition, to_fp4
from fusion.reference import evaluate
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor
from overlap.ir import LaunchKernel, walk
from overlap.train.backward import placed_backward
from sharding import DeviceMesh, Partial, Replicate, Shard, shard

WORLD_SIZES = [2, 4]
KERNELS = ["reference", "generated"]


def _inputs(seed: int, shapes: list[list[int]], dtype=torch.float32, device="cpu"):
    """The same random whole inputs on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]


def _check(communicator, fd, full_inputs, reduction_extent: int, kernels: str,
           partial_sums: int = 1, kernel_params: dict | None = None) -> list[str]:  # fmt: skip
    """Run ``fd`` on this rank, compare with the reference, return the communications."""
    executor = MultiDeviceExecutor(fd, communicator, kernels=kernels, kernel_params=kernel_params)
    expected = executor.shard_outputs(fd.execute(full_inputs))
    outputs = executor.run(executor.shard_inputs(full_inputs))
    for position, (actual, wanted) in enumerate(zip(outputs, expected, strict=True)):
        if wanted is None:
            assert actual is None, f"output {position} should not be on rank {communicator.rank}"
        else:
            assert_close(actual, wanted, reduction_extent=reduction_extent,
                         partial_sums=partial_sums,
                         message=f"rank {communicator.rank} output {position}")  # fmt: skip
    whole = executor.gather_outputs(outputs)
    for actual, wanted in zip(whole, fd.execute(full_inputs), strict=True):
        assert_close(actual, wanted, reduction_extent=reduction_extent, partial_sums=partial_sums)
    _check_gradients(communicator, fd, full_inputs, kernels)
    return [
        f"{c.op_name}({c.in_layout.mesh.axis_names[c.mesh_axis]})"
        if c.mesh_axis is not None
        else c.op_name
        for c in executor.communications
    ]


def _check_gradients(communicator, fd, full_inputs, kernels: str) -> None:
    """Every rank's piece of the gradient of every floating-point input, from the placed
    backward, against torch autograd on one device (float64 seeds cast to each output's
    dtype; a gradient sums over at most every element of the largest tensor, and every
    rank's partial sums are rounded once)."""
    leaves = [
        t.detach().clone().requires_grad_(t.is_floating_point() and t.element_size() > 1)
        for t in full_inputs
    ]
    outputs = evaluate(fd.fusion, leaves)
    generator = torch.Generator().manual_seed(7)
    seeds = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype)
             if o.is_floating_point() else torch.zeros_like(o) for o in outputs]  # fmt: skip
    differentiated = [(o, s) for o, s in zip(outputs, seeds, strict=True) if o.requires_grad]
    wrt = [leaf for leaf in leaves if leaf.requires_grad]
    if not differentiated or not wrt:
        return
    expected = torch.autograd.grad(
        [o for o, _ in differentiated], wrt, [s for _, s in differentiated], allow_unused=True
    )
    expected = [torch.zeros_like(w) if e is None else e for e, w in zip(expected, wrt, strict=True)]
    grads = placed_backward(fd.fusion)
    executor = MultiDeviceExecutor(grads.fusion, communicator, kernels=kernels)
    local = executor.run(executor.shard_inputs([*full_inputs, *seeds]))
    extent = max(t.numel() for t in full_inputs)
    for position, actual, wanted in zip(
        grads.wrt, local, executor.shard_outputs(expected), strict=True
    ):
        message = f"rank {communicator.rank}, gradient of input {position}"
        if wanted is None:
            assert actual is None, message
        else:
            assert_close(actual, wanted, reduction_extent=extent,
                         partial_sums=communicator.world_size, message=message)  # fmt: skip


# ---------------------------------------------------------------------------
# 1. Tensor-parallel MLP: column-parallel linear, gelu, row-parallel linear


def tensor_parallel_mlp(
    communicator, seed: int, bias: bool, kernels: str = "reference"
) -> list[str]:
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
    return _check(communicator, fd, full, reduction_extent=ffn, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tensor_parallel_mlp_needs_one_allreduce(rank_pools, world, kernels, bias):
    results = rank_pools(world).run(tensor_parallel_mlp, 11, bias, kernels)
    assert results == [["Allreduce(x)"]] * world


# ---------------------------------------------------------------------------
# 2. Sequence-parallel block, and 5. the same with an uneven sequence


def sequence_parallel_block(
    communicator, seed: int, tokens: int, kernels: str = "reference"
) -> tuple[list[str], str]:
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
    kinds = _check(communicator, fd, full, reduction_extent=ffn, kernels=kernels)
    return kinds, MultiDeviceExecutor(fd, communicator, kernels=kernels).explain()


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sequence_parallel_block_gathers_then_reduce_scatters(rank_pools, world, kernels):
    results = rank_pools(world).run(sequence_parallel_block, 12, 4 * world, kernels)
    assert [kinds for kinds, _ in results] == [["Allgather(x)", "ReduceScatter(x)"]] * world


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_uneven_sequence_is_split_unevenly_and_stays_correct(rank_pools, world, kernels):
    # 7 rows over 2 ranks: 4 and 3; over 4 ranks: 2, 2, 2 and 1.
    results = rank_pools(world).run(sequence_parallel_block, 13, 7, kernels)
    assert [kinds for kinds, _ in results] == [["Allgather(x)", "ReduceScatter(x)"]] * world


# ---------------------------------------------------------------------------
# 3. Two pipeline stages on two meshes of one device each


def pipeline_stages(communicator, seed: int, kernels: str = "reference") -> list[str]:
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
    return _check(communicator, fd, full, reduction_extent=20, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_pipeline_stages_send_the_activation(rank_pools, world, kernels):
    results = rank_pools(world).run(pipeline_stages, 14, kernels)
    assert results == [["SendRecv"]] * world


# ---------------------------------------------------------------------------
# 4. A 2-D mesh: data-parallel x tensor-parallel linear, all-reduce over the data axis


def data_and_tensor_parallel(
    communicator, seed: int, mesh_shape: list[int], kernels: str = "reference"
) -> list[str]:
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
    return _check(communicator, fd, full, reduction_extent=batch * features, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("world", "mesh_shape"), [(2, [2, 1]), (2, [1, 2]), (4, [2, 2])])
def test_data_times_tensor_parallel_all_reduces_over_the_data_axis(
    rank_pools, world, kernels, mesh_shape
):
    results = rank_pools(world).run(data_and_tensor_parallel, 15, mesh_shape, kernels)
    assert results == [["Allreduce(dp)"]] * world


# ---------------------------------------------------------------------------
# 6. All-to-all: the split moves from the sequence axis to the heads axis


def sequence_to_heads(communicator, seed: int, kernels: str = "reference") -> list[str]:
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
    return _check(communicator, fd, full, reduction_extent=sequence, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moving_the_split_from_sequence_to_heads_is_one_all_to_all(rank_pools, world, kernels):
    results = rank_pools(world).run(sequence_to_heads, 16, kernels)
    assert results == [["AllToAll(x)"]] * world


# ---------------------------------------------------------------------------
# Beyond the scenarios: dynamic shapes, storage types on the wire, low precision


def symbolic_sequence(
    communicator, seed: int, tokens: int, kernels: str = "reference"
) -> list[str]:
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
        kernels=kernels,
    )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_symbolic_split_extent_is_bound_from_the_local_pieces(rank_pools, world, kernels):
    pool = rank_pools(world)
    for tokens in (world, 7, 50):  # one executor definition, several sequence lengths
        assert pool.run(symbolic_sequence, 17, tokens, kernels) == [["Allreduce(x)"]] * world


def gather_storage_types(communicator, seed: int, kernels: str = "reference") -> list[str]:
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
    executor = MultiDeviceExecutor(fd, communicator, kernels=kernels)
    outputs = executor.run(executor.shard_inputs(full))
    for whole, gathered in zip(full, outputs, strict=True):
        assert gathered.dtype == whole.dtype and gathered.shape == whole.shape
        assert torch.equal(gathered.view(torch.uint8), whole.view(torch.uint8))
    # assembled through the host too (torch cannot unpickle fp8 and fp4 as they are)
    for whole, assembled in zip(full, executor.gather_outputs(outputs), strict=True):
        assert assembled.dtype == whole.dtype and assembled.shape == whole.shape
        assert torch.equal(assembled.view(torch.uint8), whole.view(torch.uint8))
    return [c.op_name for c in executor.communications]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fp8_fp4_bool_and_bf16_travel_bit_exactly(rank_pools, world, kernels):
    assert rank_pools(world).run(gather_storage_types, 18, kernels) == [["Allgather"] * 5] * world


def bf16_row_parallel(communicator, seed: int, kernels: str = "reference") -> None:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    with FusionDefinition("bf16_row_parallel") as fd:
        x = fd.define_tensor([16, 64], "bfloat16")
        w = fd.define_tensor([32, 64], "bfloat16")
        fd.add_output(fd.ops.linear(x, w))
    shard(x, mesh, [Shard(1)])
    shard(w, mesh, [Shard(1)])
    full = _inputs(seed, [[16, 64], [32, 64]], torch.bfloat16, communicator.device)
    executor = MultiDeviceExecutor(fd, communicator, kernels=kernels)
    (out,) = executor.run(executor.shard_inputs(full))
    (expected,) = fd.execute(full)
    # Each rank rounds its partial sum to bf16 before the all-reduce adds the world's
    # partials: up to `world` more bf16 roundings than the reference's single one.
    assert_close(out, expected, reduction_extent=64, partial_sums=world)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_bf16_row_parallel_linear_stays_within_bf16_partial_sum_rounding(
    rank_pools, world, kernels
):
    rank_pools(world).run(bf16_row_parallel, 19, kernels)


# ---------------------------------------------------------------------------
# Between a single rank and a mesh: broadcast, scatter, gather, reduce


def one_rank_and_a_mesh(
    communicator, seed: int, kind: str, kernels: str = "reference"
) -> list[str]:
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
        communicator,
        fd,
        _inputs(seed, [[7, 6]], device=communicator.device),
        reduction_extent=7,
        kernels=kernels,
    )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["Broadcast", "Scatter", "Gather", "Reduce"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moving_between_one_rank_and_a_mesh(rank_pools, world, kernels, kind):
    assert rank_pools(world).run(one_rank_and_a_mesh, 20, kind, kernels) == [[kind]] * world


# ---------------------------------------------------------------------------
# A Megatron-style sequence-parallel SwiGLU block with its residual: the residual's rows
# are this rank's piece of a replicated sum (a local shard), added in a generated kernel


def swiglu_residual_block(
    communicator, seed: int, tokens: int, kernels: str = "reference", replicated: bool = False
) -> tuple[list[str], list[str]]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    hidden, ffn = 16, 8 * world
    with FusionDefinition("swiglu_block") as fd:
        x = fd.define_tensor([tokens, hidden], "bfloat16")
        gamma = fd.define_tensor([hidden], "bfloat16")
        w_gate = fd.define_tensor([ffn, hidden], "bfloat16")
        w_up = fd.define_tensor([ffn, hidden], "bfloat16")
        w_down = fd.define_tensor([hidden, ffn], "bfloat16")
        x32 = fd.ops.cast(x, "float32")
        mean_square = fd.ops.mean(x32 * x32, dims=[1], keepdim=True)
        scale = fd.ops.broadcast(fd.ops.cast(gamma, "float32"), [True, False])
        normed = fd.ops.cast(x32 * fd.ops.rsqrt(mean_square + 1e-6) * scale, "bfloat16")
        gate = fd.ops.cast(fd.ops.linear(normed, w_gate), "float32")
        up = fd.ops.cast(fd.ops.linear(normed, w_up), "float32")
        down = fd.ops.linear(fd.ops.cast(fd.ops.silu(gate) * up, "bfloat16"), w_down)
        out = fd.ops.cast(fd.ops.cast(down, "float32") + x32, "bfloat16")
        fd.add_output(out)
    shard(x, mesh, [Shard(0)])
    shard(w_gate, mesh, [Shard(0)])
    shard(w_up, mesh, [Shard(0)])
    shard(w_down, mesh, [Shard(1)])
    shard(out, mesh, [Shard(0)])
    if replicated:  # the down projection asked whole: all-reduced, then split locally
        shard(down, mesh, [Replicate()])
    shapes = [[tokens, hidden], [hidden], [ffn, hidden], [ffn, hidden], [hidden, ffn]]
    full = _inputs(seed, shapes, torch.float32, communicator.device)
    # weights scaled as a model initializes them, so partial sums stay near the result's
    # magnitude; the row-parallel down projection rounds each rank's partial sum to bf16
    full = [full[0], full[1], full[2] / hidden**0.5, full[3] / hidden**0.5, full[4] / ffn**0.5]
    full = [value.to(torch.bfloat16) for value in full]
    kinds = _check(communicator, fd, full, ffn, kernels, partial_sums=world)
    executor = MultiDeviceExecutor(fd, communicator, kernels=kernels)
    local_shards = [
        f"{k.name} [{k.backend}]"
        for k in walk(executor.program.instructions)
        if isinstance(k, LaunchKernel) and any(e.op_name == "shard_locally" for e in k.exprs)
    ]
    return kinds, local_shards


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("replicated", [False, True], ids=["default", "replicated"])
@pytest.mark.parametrize("tokens", [8, 7], ids=["even", "uneven"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_swiglu_block_with_its_residual_is_right_on_every_rank(
    rank_pools, world, tokens, replicated, kernels
):
    tokens = tokens * world // 2
    results = rank_pools(world).run(swiglu_residual_block, 22, tokens, kernels, replicated)
    for kinds, local_shards in results:
        if not replicated:
            # the partial sums reduce-scattered to the residual's rows (fewer bits than an
            # all-reduce and a local split)
            assert kinds == ["Allgather(x)", "ReduceScatter(x)"]
            assert local_shards == []
            continue
        assert kinds == ["Allgather(x)", "Allreduce(x)"]
        # the piece is taken as a view outside any generated kernel
        assert len(local_shards) == 1 and local_shards[0].endswith("[reference]"), local_shards


# ---------------------------------------------------------------------------
# Fewer rows than ranks: some ranks hold empty pieces


def empty_pieces(communicator, seed: int, symbolic: bool, kernels: str = "reference") -> list[str]:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition("empty_pieces") as fd:
        x = fd.define_tensor(["rows" if symbolic else 1, 8])
        w = fd.define_tensor([6, 8])
        flags = fd.define_tensor(["rows" if symbolic else 1, 8], "bool")
        y = fd.ops.relu(x) * 2.0
        reduced = [
            fd.ops.max(x, dims=[0]),  # partial max over an empty piece
            fd.ops.min(fd.ops.exp(x), dims=[0]),
            fd.ops.sum(y, dims=[0]),
            fd.ops.max(flags, dims=[0]),  # a bool's identity is False
        ]
        fd.add_output(y)  # rows split: empty on every rank but rank 0
        for out in [*reduced[:3], fd.ops.linear(x, w), reduced[3]]:  # a matmul of no rows
            fd.add_output(out)
    # Partial results, combined once: gathering one row would move fewer bits (the layout
    # chooser would), but the point here is each rank reducing its (empty) piece.
    for result, op in zip(reduced, ["max", "min", "sum", "max"], strict=True):
        shard(result, mesh, [Partial(op)])
    shard(x, mesh, [Shard(0)])
    shard(w, mesh, [Replicate()])
    shard(flags, mesh, [Shard(0)])
    full = _inputs(seed, [[1, 8], [6, 8]], device=communicator.device)
    full.append(full[0] > 0)
    return _check(communicator, fd, full, reduction_extent=8, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_with_empty_pieces_compute_the_identity_and_stay_right(
    rank_pools, world, symbolic, kernels
):
    results = rank_pools(world).run(empty_pieces, 23, symbolic, kernels)
    assert results == [["Allreduce(x)"] * 4] * world


# ---------------------------------------------------------------------------
# Reductions over an axis split across ranks: each rank reduces its piece and the
# ranks combine the results (a mean as a sum, a variance in two passes)


def split_axis_reduction(
    communicator, seed: int, op: str, columns: int, dtype: str, kernels: str = "reference"
) -> list[str]:
    with FusionDefinition("split_reduction") as fd:
        x = fd.define_tensor([5, columns], dtype)
        if op == "var_mean":
            for output in fd.ops.var_mean(x, dims=[1], correction=1):
                fd.add_output(output)
        else:
            fd.add_output(getattr(fd.ops, op)(x, dims=[1]))
    shard(x, DeviceMesh(communicator.world_size), [Shard(1)])
    # off-centre values: a one-pass variance (sum of squares minus squared sum) would
    # lose digits here; the two-pass one does not
    (value,) = _inputs(seed, [[5, columns]], device=communicator.device)
    value = (value + 100.0).to(getattr(torch, dtype))
    return _check(communicator, fd, [value], reduction_extent=columns, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("columns", [16, 19, 32, 35])
@pytest.mark.parametrize("op", ["sum", "max", "mean", "var_mean"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_reduction_over_a_split_axis_combines_each_rank_result(
    rank_pools, world, op, columns, dtype, kernels
):
    results = rank_pools(world).run(split_axis_reduction, 25, op, columns, dtype, kernels)
    # never the input itself moved: one small all-reduce (two for the variance's passes)
    assert results == [["Allreduce(x)"] * (2 if op == "var_mean" else 1)] * world


# ---------------------------------------------------------------------------
# NaN and infinities in some rank's piece of an axis reduced across ranks


def special_values(
    communicator, seed: int, op: str, dtype: str, target: str, kernels: str = "reference"
) -> list[str]:
    world = communicator.world_size
    everyone, last = DeviceMesh(world), DeviceMesh([world - 1])
    rows, columns = 6, 4 * world + 1  # uneven pieces
    with FusionDefinition("special_values") as fd:
        x = fd.define_tensor([rows, columns], dtype)
        reduced = getattr(fd.ops, op)(x, dims=[1])
        if target == "one rank":
            moved = fd.ops.set(reduced)
            fd.add_output(moved)
            shard(reduced, everyone, [Partial(op)])
            shard(moved, last, [Replicate()])
        else:
            fd.add_output(reduced)
            shard(reduced, everyone, [Shard(0) if target == "split" else Replicate()])
    shard(x, everyone, [Shard(1)])
    (value,) = _inputs(seed, [[rows, columns]], getattr(torch, dtype), communicator.device)
    first, final = 0, columns - 1  # rank 0's piece and the last rank's
    value[0, final] = float("nan")  # NaN in the last rank's piece only
    value[1, first] = float("inf")
    value[2, final] = -float("inf")
    value[3, first], value[3, final] = float("inf"), -float("inf")  # on two ranks
    value[4, first], value[4, final] = float("nan"), float("inf")
    return _check(communicator, fd, [value], reduction_extent=columns, kernels=kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("target", ["replicated", "split", "one rank"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["max", "min", "sum"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_nan_and_infinities_in_one_rank_piece_come_out_as_on_one_device(
    rank_pools, world, op, dtype, target, kernels
):
    results = rank_pools(world).run(special_values, 24, op, dtype, target, kernels)
    kind = {"replicated": "Allreduce(x)", "split": "ReduceScatter(x)", "one rank": "Reduce"}
    assert results == [[kind[target]]] * world


# ---------------------------------------------------------------------------
# The examples' normalizations with their rows split over the ranks, and the demo's
# tensor-parallel MLP


def row_split_normalization(communicator, name: str, seed: int, kernels: str = "reference",
                            strategy: str | None = None):  # fmt: skip
    """``strategy`` (generated kernels): the normalization kernel's, forced (a split row's
    programs exchanging partial reductions, a forward's input through TMA; a backward's
    column walk; ``"clusters"``: a backward's split row as the H200 runs it, a cluster
    of ``CLUSTER_SUMS_PARTS`` programs a row, as many clusters as the device holds)."""
    from examples.norms import BUILDERS, make_inputs

    n, rows = 48, 4 * communicator.world_size + 3  # uneven pieces
    fd = BUILDERS[name](n, "bfloat16")
    mesh = DeviceMesh(communicator.world_size)
    for tensor in fd.fusion.inputs:
        # activations and saved statistics split by rows; weights whole on every rank
        rows_first = tensor.ndim == 2 or str(tensor.shape[0]) == "rows"
        shard(tensor, mesh, [Shard(0) if rows_first else Replicate()])
    generator = torch.Generator().manual_seed(seed)
    full = make_inputs(name, rows, n, torch.bfloat16, communicator.device, generator)
    # a backward's weight gradients sum every rank's rows: one more rounding of a partial
    partial_sums = 2 if name.endswith("_bwd") else 1
    forced = {"k0": strategy} if strategy else None
    if strategy == "clusters":
        from schedulers.hardware import H200
        from schedulers.normalization.split import CLUSTER_SUMS_PARTS, split_params
        from schedulers.registry import split_into_kernels

        plan = split_into_kernels(fd.fusion.exprs, fd.fusion)[0].plan
        params = split_params(plan, H200, n, CLUSTER_SUMS_PARTS)
        assert params.cluster and not params.programs, params
        forced = {"k0": params}
    return _check(communicator, fd, full, max(n, rows), kernels, partial_sums=partial_sums,
                  kernel_params=forced)  # fmt: skip


def repeated_runs_over_buffers(communicator, name: str, seed: int, kernels: str = "reference"):
    """One executor run again and again on rows split over the ranks, its inputs in new
    buffers: aligned, then starting 2 bytes past a 16-byte boundary, then new inputs
    aligned, then in the first misaligned buffers (a launch after the first goes
    straight to the kernel compiled for its arguments' alignment: ``BoundKernel``);
    every run's pieces checked on every rank."""
    from examples.norms import BUILDERS, make_inputs

    n, rows = 48, 4 * communicator.world_size + 3
    fd = BUILDERS[name](n, "bfloat16")
    mesh = DeviceMesh(communicator.world_size)
    for tensor in fd.fusion.inputs:
        rows_first = tensor.ndim == 2 or str(tensor.shape[0]) == "rows"
        shard(tensor, mesh, [Shard(0) if rows_first else Replicate()])
    executor = MultiDeviceExecutor(fd, communicator, kernels=kernels)
    generator = torch.Generator().manual_seed(seed)
    partial_sums = 2 if name.endswith("_bwd") else 1

    def misaligned(piece: torch.Tensor) -> torch.Tensor:
        held = torch.empty(piece.numel() + 1, dtype=piece.dtype, device=piece.device)
        return held[1:].view(piece.shape).copy_(piece)

    full = make_inputs(name, rows, n, torch.bfloat16, communicator.device, generator)
    shifted = None
    for run in range(4):
        if run == 2:
            full = make_inputs(name, rows, n, torch.bfloat16, communicator.device, generator)
        pieces = executor.shard_inputs(full)
        if run == 1:
            shifted = [misaligned(piece) for piece in pieces]
            assert all(piece.data_ptr() % 16 for piece in shifted)
        elif run == 3:  # the new inputs in run 1's misaligned buffers
            shifted = [held.copy_(piece) for held, piece in zip(shifted, pieces, strict=True)]
        if run % 2:
            pieces = shifted
        expected = executor.shard_outputs(fd.execute(full))
        outputs = executor.run(pieces)
        for position, (actual, wanted) in enumerate(zip(outputs, expected, strict=True)):
            message = f"rank {communicator.rank} run {run} output {position}"
            assert_close(actual, wanted, reduction_extent=max(n, rows),
                         partial_sums=partial_sums, message=message)  # fmt: skip


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_bwd"])
def test_runs_over_new_and_misaligned_buffers(rank_pools, name):
    """As ``check_gpu.py`` runs it. Here (Triton's interpreter) every launch goes
    through the JIT; on GPUs the launches after the first go straight to the compiled
    kernels, and this is what checks their alignment key there."""
    rank_pools(2).run(repeated_runs_over_buffers, name, 27, "generated")


NORMALIZATIONS = ["softmax_fwd", "softmax_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd",
                  "layernorm_bwd"]  # fmt: skip


def _normalization_cases() -> list[tuple[str, str, str | None]]:
    """Every normalization with each kernel kind, split rows forced, and the backward
    ones' column walk and clusters forced (they write column sums)."""
    cases = [(name, k, None) for name in NORMALIZATIONS for k in KERNELS]
    cases += [(name, "generated", "split") for name in NORMALIZATIONS]
    return cases + [(name, "generated", strategy) for name in NORMALIZATIONS
                    for strategy in ("column_walk", "clusters")
                    if name.endswith("_bwd") and not name.startswith("softmax")]  # fmt: skip


@pytest.mark.parametrize(("name", "kernels", "strategy"), _normalization_cases())
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_examples_normalizations_with_rows_split(rank_pools, world, name, kernels, strategy):
    """``strategy="split"``: each rank's rows split over programs too (the exchange of
    partial reductions, a forward's input through TMA); ``"column_walk"``: the rows'
    values first, then strips of columns walked down each rank's rows; ``"clusters"``: a
    backward's split row in clusters of programs; as ``check_gpu.py`` runs them."""
    results = rank_pools(world).run(row_split_normalization, name, 25, kernels, strategy)
    # forwards need nothing from other ranks; backwards all-reduce their weight gradients
    column_sums = {"rmsnorm_bwd": 1, "layernorm_bwd": 2}.get(name, 0)
    assert results == [["Allreduce(x)"] * column_sums] * world


def demo_mlp(communicator, seed: int, kernels: str = "reference") -> list[str]:
    from launch.demo import build_tp_mlp

    tokens, hidden, ffn = 8 * communicator.world_size + 2, 32, 16 * communicator.world_size
    fd = build_tp_mlp(tokens, hidden, ffn, communicator.world_size)
    generator = torch.Generator().manual_seed(seed)
    shapes = [[tokens, hidden], [hidden, ffn], [ffn, hidden]]
    scales = [1.0, hidden**-0.5, ffn**-0.5]
    full = [
        (scale * torch.randn(shape, generator=generator)).to(communicator.device, torch.bfloat16)
        for shape, scale in zip(shapes, scales, strict=True)
    ]
    return _check(communicator, fd, full, ffn, kernels, partial_sums=communicator.world_size)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_the_demo_mlp_gathers_then_reduce_scatters(rank_pools, world, kernels):
    results = rank_pools(world).run(demo_mlp, 26, kernels)
    assert results == [["Allgather(x)", "ReduceScatter(x)"]] * world


# ---------------------------------------------------------------------------
# Blocks whose layouts are chosen by cost: attention projections (QKV column-parallel,
# the output projection row-parallel, a residual) and a row-parallel linear with a bias
# and a LayerNorm after it. The partial sums are reduce-scattered to the tokens' pieces.


def attention_projections(
    communicator, seed: int, tokens: int, kernels: str = "reference"
) -> list[str]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    hidden, heads_dim = 16, 8 * world
    with FusionDefinition("attention_projections") as fd:
        x = fd.define_tensor([tokens, hidden])
        w_q = fd.define_tensor([heads_dim, hidden])
        w_k = fd.define_tensor([heads_dim, hidden])
        w_v = fd.define_tensor([heads_dim, hidden])
        w_o = fd.define_tensor([hidden, heads_dim])
        q, k, v = (fd.ops.linear(x, w) for w in (w_q, w_k, w_v))
        mixed = fd.ops.tanh(q) * fd.ops.sigmoid(k) + v  # stands in for attention, per head
        out = fd.ops.linear(mixed, w_o) + x
        fd.add_output(out)
    shard(x, mesh, [Shard(0)])
    for weight in (w_q, w_k, w_v):
        shard(weight, mesh, [Shard(0)])
    shard(w_o, mesh, [Shard(1)])
    shard(out, mesh, [Shard(0)])
    shapes = [[tokens, hidden]] + [[heads_dim, hidden]] * 3 + [[hidden, heads_dim]]
    full = _inputs(seed, shapes, device=communicator.device)
    return _check(communicator, fd, full, heads_dim, kernels)


def bias_and_layernorm_after(
    communicator, seed: int, tokens: int, kernels: str = "reference"
) -> list[str]:
    world = communicator.world_size
    mesh = DeviceMesh(world)
    hidden, ffn = 16, 8 * world
    with FusionDefinition("bias_layernorm") as fd:
        h = fd.define_tensor([tokens, ffn])
        w = fd.define_tensor([hidden, ffn])
        b = fd.define_tensor([hidden])
        y = fd.ops.linear(h, w, b)
        var, mean = fd.ops.var_mean(y, dims=[1], correction=0, keepdim=True)
        normed = (y - mean) * fd.ops.rsqrt(var + 1e-5)
        fd.add_output(normed)
    shard(h, mesh, [Shard(1)])
    shard(w, mesh, [Shard(1)])
    shard(normed, mesh, [Shard(0)])
    full = _inputs(seed, [[tokens, ffn], [hidden, ffn], [hidden]], device=communicator.device)
    return _check(communicator, fd, full, ffn, kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("tokens", [8, 7], ids=["even", "uneven"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_attention_projections_gather_once_and_reduce_scatter(rank_pools, world, tokens, kernels):
    results = rank_pools(world).run(attention_projections, 24, tokens * world // 2, kernels)
    # one all-gather feeds Q, K and V; the output projection's partial sums go straight
    # to the residual's rows
    assert results == [["Allgather(x)", "ReduceScatter(x)"]] * world


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_bias_and_a_layernorm_after_a_row_parallel_linear_reduce_scatter(
    rank_pools, world, kernels
):
    results = rank_pools(world).run(bias_and_layernorm_after, 25, 3 * world + 1, kernels)
    assert results == [["ReduceScatter(x)"]] * world
