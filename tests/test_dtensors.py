"""DTensors in and out of ``MultiDeviceExecutor.run`` on real gloo ranks: placed as the
fusion places them they run and come back as DTensors; placed otherwise they are
refused on every rank before any collective, never reinterpreted."""

from __future__ import annotations

import pytest
import torch
from distributed import RankError
from test_backward_multidevice import tensor_parallel_mlp

from fusion.testing import assert_close
from overlap import MultiDeviceExecutor


def dtensor_run(communicator, wrong: str | None = None) -> list[str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    world = communicator.world_size
    mesh = init_device_mesh("cpu", (world,))
    fd = tensor_parallel_mlp(world)  # x whole, w1 by rows, w2 by columns, y whole
    generator = torch.Generator().manual_seed(5)
    full = [torch.randn(list(t.shape), generator=generator) / 4 for t in fd.fusion.inputs]
    placements = [[Replicate()], [Shard(0)], [Shard(1)]]
    if wrong == "placement":
        placements[1] = [Shard(1)]  # w1 by columns: not the fusion's layout
    inputs = [distribute_tensor(t, mesh, p) for t, p in zip(full, placements, strict=True)]
    if wrong == "shape":
        inputs[0] = distribute_tensor(torch.randn(7, 16), mesh, [Replicate()])
    executor = MultiDeviceExecutor(fd, communicator)
    (y,) = executor.run(inputs)
    assert type(y).__name__ == "DTensor" and list(y.placements) == [Replicate()]
    assert_close(y.to_local(), fd.execute(full)[0], reduction_extent=16, partial_sums=world)
    assert_close(y.full_tensor(), fd.execute(full)[0], reduction_extent=16, partial_sums=world)
    # pieces as before, for comparison: the same values
    (piece,) = executor.run(executor.shard_inputs(full))
    assert torch.equal(piece, y.to_local())
    return [type(p).__name__ for p in y.placements]


@pytest.mark.parametrize("world", [2, 4])
def test_dtensors_placed_as_the_fusion_places_them_run_and_come_back(rank_pools, world):
    assert rank_pools(world).run(dtensor_run, timeout=120) == [["Replicate"]] * world


@pytest.mark.parametrize(
    ("wrong", "says"),
    [("placement", "a DTensor placed [S(1)]"), ("shape", "a DTensor of global shape [7, 16]")],
)
def test_a_dtensor_placed_otherwise_is_refused_on_every_rank(rank_pools, wrong, says):
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(dtensor_run, wrong, timeout=120)
    messages = failure.value.messages()
    assert sorted(messages) == [0, 1], messages
    for message in messages.values():
        assert "InputError: input " in message and says in message, message


def uneven_dtensor_run(communicator, split: str) -> None:
    """10 rows over 4 ranks, the input (``split="input"``) or only the output split."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    from fusion import DataType, FusionDefinition
    from sharding import DeviceMesh, Replicate, Shard, shard

    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition() as fd:
        x = fd.define_tensor([10, 4], DataType.float32)
        shard(x, mesh, [Shard(0) if split == "input" else Replicate()])
        y = fd.ops.mul(x, 2.0)
        shard(y, mesh, [Shard(0)])
        fd.add_output(y)
    torch_mesh = init_device_mesh("cpu", (communicator.world_size,))
    given = TorchShard(0) if split == "input" else TorchReplicate()
    MultiDeviceExecutor(fd, communicator).run([distribute_tensor(torch.randn(10, 4), torch_mesh,
                                                                 [given])])  # fmt: skip


@pytest.mark.parametrize("split", ["input", "output"])
def test_a_dtensor_whose_uneven_split_torch_cuts_otherwise_is_refused_on_every_rank(
    rank_pools, split
):
    with pytest.raises(RankError) as failure:
        rank_pools(4).run(uneven_dtensor_run, split, timeout=120)
    messages = failure.value.messages()
    assert sorted(messages) == [0, 1, 2, 3], messages
    for message in messages.values():
        assert "is cut [3, 3, 2, 2] here but [3, 3, 3, 1] by DTensor" in message, message
        assert f"InputError: {split}" in message or "would come back" in message, message
