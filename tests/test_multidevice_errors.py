"""Bad input on a multi-device run fails on every rank with a clear error, and never hangs.

Each job runs on real gloo processes; a failing job must fail on every rank (no rank may
be left waiting in a collective: the pool's timeout would turn that into a failure), and
the pool must still run a good job afterwards.
"""

from __future__ import annotations

import pytest
import torch
from distributed import RankError

from fusion import FusionDefinition
from fusion.errors import InputError
from overlap import MultiDeviceExecutor
from overlap.runtime.autograd import without_grad
from sharding import DeviceMesh, Replicate, Shard, ShardingError, shard


def _row_split_fusion(world: int) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 6])
        w = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.linear(x, w))
    shard(x, DeviceMesh(world), [Shard(0)])
    shard(w, DeviceMesh(world), [Replicate()])
    return fd


def _failures_on_every_rank(pool, job) -> dict[int, tuple[str, str]]:
    """Run ``job``, which must fail on every rank (none left waiting): by rank, the
    error's type name and the last line of its traceback."""
    with pytest.raises(RankError) as failure:
        pool.run(job, timeout=60)
    assert sorted(failure.value.failures) == list(range(pool.world_size)), "every rank must fail"
    return {
        rank: (failure.value.failures[rank][0], message)
        for rank, message in failure.value.messages().items()
    }


def good_run(communicator) -> bool:
    fd = _row_split_fusion(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    full = [torch.ones(8, 6), torch.ones(4, 6)]
    (out,) = executor.run(executor.shard_inputs(full))
    return bool(torch.equal(out, executor.shard_outputs(fd.execute(full))[0]))


def wrong_shape_on_one_rank(communicator) -> None:
    fd = _row_split_fusion(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    local = executor.shard_inputs([torch.ones(8, 6), torch.ones(4, 6)])
    if communicator.rank == 1:
        local[0] = torch.ones(local[0].shape[0] + 1, 6)
    executor.run(local)


def wrong_dtype_on_one_rank(communicator) -> None:
    fd = _row_split_fusion(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    local = executor.shard_inputs([torch.ones(8, 6), torch.ones(4, 6)])
    if communicator.rank == communicator.world_size - 1:
        local[1] = local[1].double()
    executor.run(local)


def missing_input_on_one_rank(communicator) -> None:
    fd = _row_split_fusion(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    local = executor.shard_inputs([torch.ones(8, 6), torch.ones(4, 6)])
    if communicator.rank == 0:
        local = local[:1]
    executor.run(local)


def mesh_larger_than_the_world(communicator) -> None:
    MultiDeviceExecutor(_row_split_fusion(communicator.world_size + 1), communicator)


def tensor_used_off_its_mesh(communicator) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor([4])
        y = fd.ops.exp(x)
        fd.add_output(y)
    shard(x, DeviceMesh([0]), [Replicate()])
    shard(y, DeviceMesh([1]), [Replicate()])
    MultiDeviceExecutor(fd, communicator)


def _fp4_split_innermost(world: int, columns) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, columns])
        fd.add_output(fd.ops.cast(fd.ops.relu(x), "float4_e2m1"))  # packed two a byte
    shard(x, DeviceMesh(world), [Shard(1)])
    return fd


def fp4_pieces_of_odd_width(communicator) -> None:
    # 10 columns over 2 ranks are 5 and 5; 18 over 4 are 5, 5, 4, 4
    columns = 10 if communicator.world_size == 2 else 18
    MultiDeviceExecutor(_fp4_split_innermost(communicator.world_size, columns), communicator)


def fp4_symbolic_pieces_of_odd_width(communicator) -> None:
    world = communicator.world_size
    executor = MultiDeviceExecutor(_fp4_split_innermost(world, "columns"), communicator)
    columns = 10 if world == 2 else 18
    executor.run(
        executor.shard_inputs([torch.randn(6, columns, generator=torch.Generator().manual_seed(0))])
    )


@pytest.mark.parametrize(
    ("job", "error", "pieces"),
    [
        (
            fp4_pieces_of_odd_width,
            ShardingError,
            ["packed 2 values a byte", "must fill whole bytes"],
        ),
        (
            fp4_symbolic_pieces_of_odd_width,
            InputError,
            ["into pieces of [5, 5", "must fill whole bytes"],
        ),
        (wrong_shape_on_one_rank, InputError, ["rank 1:", "input 0", "expected the local shape"]),
        (wrong_dtype_on_one_rank, InputError, ["input 1", "expected dtype torch.float32"]),
        (missing_input_on_one_rank, InputError, ["rank 0:", "takes 2 inputs, got 1"]),
        (mesh_larger_than_the_world, ShardingError, ["the world has", "does not exist"]),
        (tensor_used_off_its_mesh, ShardingError, ["exp: a tensor is used on a mesh"]),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_fails_on_every_rank_then_the_ranks_carry_on(
    rank_pools, world, job, error, pieces
):
    pool = rank_pools(world)
    for rank, (kind, message) in _failures_on_every_rank(pool, job).items():
        assert kind == error.__name__, (rank, message)
        for piece in pieces:
            assert piece in message, (rank, message)
    assert pool.run(good_run, timeout=60) == [True] * world


# ---------------------------------------------------------------------------
# Failures on one rank only: its peers must fail with it, never wait for it


def different_fusions_on_the_ranks(communicator) -> None:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 6])
        if communicator.rank == 1:
            y = fd.ops.sum(x, dims=[0])  # a partial sum: an all-reduce
        else:
            y = fd.ops.set(x)  # gathered: an all-gather
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])
    shard(y, mesh, [Replicate()])
    MultiDeviceExecutor(fd, communicator)


def different_dtypes_on_the_ranks(communicator) -> None:
    """The same communications, of tensors of different dtypes: on gloo a rank aborts
    on the size mismatch, on NCCL the ranks read each other's bytes wrong."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 6])
        y = fd.ops.cast(x, "bfloat16") if communicator.rank == 1 else x
        total = fd.ops.sum(y, dims=[0])
        fd.add_output(total)
    shard(x, DeviceMesh(communicator.world_size), [Shard(0)])
    shard(total, DeviceMesh(communicator.world_size), [Replicate()])
    MultiDeviceExecutor(fd, communicator)


def max_over_an_axis_empty_everywhere(communicator) -> None:
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 6])
        fd.add_output(fd.ops.max(x, dims=[0]))
    shard(x, DeviceMesh(communicator.world_size), [Shard(0)])
    executor = MultiDeviceExecutor(fd, communicator)
    executor.run(executor.shard_inputs([torch.ones(0, 6)]))  # the reference raises too


def different_executors_run(communicator) -> None:
    fd = _row_split_fusion(communicator.world_size)
    with FusionDefinition() as other:
        x = other.define_tensor([8, 6])
        other.add_output(other.ops.sum(x, dims=[0]))
    shard(x, DeviceMesh(communicator.world_size), [Shard(0)])
    first, second = MultiDeviceExecutor(fd, communicator), MultiDeviceExecutor(other, communicator)
    executor = second if communicator.rank == 1 else first
    executor.run(
        executor.shard_inputs([torch.ones(8, 6), torch.ones(4, 6)][: len(executor.fusion.inputs)],
                              check=False)  # the ranks' fusions differ: the run says so
    )  # fmt: skip


def kernel_params_refused_on_one_rank(communicator) -> None:
    params = {"k9": "multiwave"} if communicator.rank == 1 else {}
    MultiDeviceExecutor(_row_split_fusion(communicator.world_size), communicator,
                        kernel_params=params)  # fmt: skip


def forced_strategy_refused_on_one_rank(communicator) -> None:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 7], "bfloat16")
        x32 = fd.ops.cast(x, "float32")
        mean_square = fd.ops.mean(x32 * x32, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(x32 * fd.ops.rsqrt(mean_square + 1e-6), "bfloat16"))
    shard(x, mesh, [Shard(0)])
    # the user's params differ by rank; the forced kernel can only be refused at the first
    # run, on the rank that forced it
    params = {"k0": "warp_specialized"} if communicator.rank == 1 else {}
    executor = MultiDeviceExecutor(fd, communicator, kernels="generated", kernel_params=params)
    executor.run(
        executor.shard_inputs(
            [torch.randn(8, 7, generator=torch.Generator().manual_seed(0)).bfloat16()]
        )
    )


def meta_inputs_on_one_rank(communicator) -> None:
    fd = _row_split_fusion(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    local = executor.shard_inputs([torch.ones(8, 6), torch.ones(4, 6)])
    if communicator.rank == 1:
        local = [value.to("meta") for value in local]
    executor.run(local)


@pytest.mark.parametrize(
    ("job", "errors", "pieces"),
    [
        (
            different_fusions_on_the_ranks,
            {"all": "ProgramMismatch"},
            ["building the program: the ranks built different host programs",
             "rank 0 posts \"c0 = Allgather", "rank 1 posts \"c0 = Allreduce"],
        ),
        (
            different_dtypes_on_the_ranks,
            {"all": "ProgramMismatch"},
            ['rank 0 posts "c0 = Allreduce(axis=\'x\', op=\'sum\')  @M0: f32[',
             'rank 1 posts "c0 = Allreduce(axis=\'x\', op=\'sum\')  @M0: bf16['],
        ),
        (
            max_over_an_axis_empty_everywhere,
            {"all": "InputError"},
            ["max over axis 0 of T0", "is empty (extent 0 with these inputs)"],
        ),
        (
            different_executors_run,
            {"all": "ProgramMismatch"},
            ["run: the ranks built different host programs"],
        ),
        (
            kernel_params_refused_on_one_rank,
            {1: "ValueError", "others": "PeerError"},
            ["no generated kernel 'k9'"],
        ),
        (
            forced_strategy_refused_on_one_rank,
            {1: "NotSchedulable", "others": "PeerError"},
            ["not a multiple of 16 bytes"],
        ),
        (
            meta_inputs_on_one_rank,
            {"all": "InputError"},
            ["rank 1: input 0: on meta, but this rank runs on cpu", "meta tensors hold no values"],
        ),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)  # fmt: skip
@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_on_one_rank_fails_every_rank_before_any_collective(
    rank_pools, world, job, errors, pieces
):
    pool = rank_pools(world)
    for rank, (kind, message) in _failures_on_every_rank(pool, job).items():
        expected = errors.get("all") or errors.get(rank) or errors["others"]
        assert kind == expected, (rank, message)
        if expected == "PeerError":
            assert "failed on rank 1:" in message, (rank, message)
        for piece in pieces:
            assert piece in message, (rank, message)
    assert pool.run(good_run, timeout=60) == [True] * world


# ---------------------------------------------------------------------------
# Gradients: not computed yet, so a backward through a run raises on every rank


def backward_through_a_run(communicator) -> tuple[bool, str]:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 6])
        w = fd.define_tensor([3, 6])
        fd.add_output(fd.ops.sum(fd.ops.linear(x, w), dims=[0]))  # a partial sum, all-reduced
    shard(x, mesh, [Shard(0)])
    shard(w, mesh, [Replicate()])
    executor = MultiDeviceExecutor(fd, communicator)
    generator = torch.Generator().manual_seed(3)
    x_value, w_value = (
        torch.randn(8, 6, generator=generator),
        torch.randn(3, 6, generator=generator),
    )
    w_value.requires_grad_()
    (y,) = executor.run(executor.shard_inputs([x_value, w_value]))
    right = torch.allclose(y, fd.execute([x_value, w_value.detach()])[0], atol=1e-5)
    with pytest.raises(RuntimeError) as refused:
        y.sum().backward()  # each rank would get only its partial gradient of w
    assert w_value.grad is None
    return right, str(refused.value)


def test_a_backward_through_a_run_raises_on_every_rank(rank_pools):
    for right, message in rank_pools(2).run(backward_through_a_run, timeout=60):
        assert right
        assert message.startswith("MultiDeviceExecutor.run has no backward yet"), message


def test_a_backward_through_a_single_device_run_raises_too():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.exp(x))
    x_value = torch.randn(4, 6, requires_grad=True)
    (y,) = MultiDeviceExecutor(fd).run([x_value])
    with pytest.raises(RuntimeError, match="has no backward yet"):
        y.sum().backward()
    with torch.no_grad():  # the forward alone is what a run is for
        (y,) = MultiDeviceExecutor(fd).run([x_value])
    assert not y.requires_grad and torch.allclose(y, x_value.detach().exp())


def test_without_grad_records_no_autograd_graph_and_restores_the_grad_mode():
    """``without_grad`` (what a run runs under): autograd off inside, the caller's mode
    back after, a raise included."""
    assert without_grad(torch.is_grad_enabled) is False and torch.is_grad_enabled()
    leaf = torch.ones(3, requires_grad=True)
    assert not without_grad(torch.mul, leaf, 2).requires_grad
    with pytest.raises(ZeroDivisionError):
        without_grad(lambda: 1 / 0)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        assert without_grad(torch.is_grad_enabled) is False
        assert not torch.is_grad_enabled()


def test_a_single_device_run_refuses_what_is_not_a_list_of_tensors():
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4]), fd.define_tensor([4])
        fd.add_output(a + b)
    executor = MultiDeviceExecutor(fd)
    # two rows of one tensor are not two inputs
    with pytest.raises(InputError, match="inputs must be a list of tensors, got Tensor"):
        executor.run(torch.ones(2, 4))
    assert executor.explain().startswith("no tensor is placed on a mesh")


def test_a_compiled_program_runs_as_it_was_compiled_or_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # generated kernels may run on CPU
    from overlap import OverlapOptions, compile_program

    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        fd.add_output(fd.ops.exp(x))
    compiled = compile_program(fd)  # the evaluator, not generated kernels
    value = torch.randn(4, 8)
    (out,) = MultiDeviceExecutor(compiled, kernels="reference").run([value])
    assert torch.allclose(out, value.exp())
    with pytest.raises(ValueError, match="compiled with schedule=False"):
        MultiDeviceExecutor(compiled, kernels="generated")
    with pytest.raises(ValueError, match="already planned"):
        MultiDeviceExecutor(compiled, options=OverlapOptions(overlap=False), kernels="reference")
