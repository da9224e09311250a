"""Communications as a rank program posts them (``overlap.comm.communications.prepare``):
right on every rank for every layout of the pieces, and copying nothing where the
pieces lie in memory as the collective moves them.

Each job runs a fusion whose one communication is an all-gather or a reduce-scatter
on real gloo ranks, over a mesh listing its ranks in order or reversed (coordinates not
in rank order), along the leading axis, after an axis of one element or after a wider
one, with even and uneven pieces, and compares every rank's output with the reference.
Its second run is watched by a dispatch mode that records every aten op that copies
data (``COPYING``), and so is the bare collective on tensors of the same shapes (gloo's
reduce-scatter copies its result once, inside its wait): where the pieces are even, in
rank order and along the leading axis (or after axes of one element), the input goes
to the collective as it is and the received buffer is the output, so the run copies
what the bare collective does and nothing more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fusion import FusionDefinition
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor
from sharding import DeviceMesh, Replicate, Shard, shard

# torch 2.13 renames the tensor collectives; 2.11 (the GPU machines) has the old names only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# aten ops that copy a tensor's data (a view, an allocation or a collective is none)
COPYING = {"aten::cat", "aten::copy_", "aten::clone", "aten::constant_pad_nd",
           "aten::_to_copy", "aten::stack", "aten::new_zeros"}  # fmt: skip


class Copies(TorchDispatchMode):
    """Records the name of every aten op in ``COPYING`` run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in COPYING:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _mesh(world: int, reversed_ranks: bool) -> DeviceMesh:
    return DeviceMesh(list(reversed(range(world)))) if reversed_ranks else DeviceMesh(world)


def _run_twice(communicator, fd, full: list[torch.Tensor], reduction_extent: int,
               bare) -> tuple[list[str], list[str]]:  # fmt: skip
    """Runs ``fd`` on this rank (the second run watched for copies) and checks its output
    against the reference; returns the copying ops of that run and those of ``bare()``
    (the collective alone)."""
    executor = MultiDeviceExecutor(fd, communicator)
    local = executor.shard_inputs(full)
    executor.run(local)  # the first run checks the inputs with the peers and builds
    with Copies() as copies:
        (actual,) = executor.run(local, check_inputs="never")
    (expected,) = executor.shard_outputs(fd.execute(full))
    assert_close(actual, expected, reduction_extent=reduction_extent,
                 message=f"rank {communicator.rank}")  # fmt: skip
    assert [c.op_name for c in executor.communications] == [
        {"set": "Allgather", "matmul": "ReduceScatter"}[fd.fusion.exprs[-1].op_name]
    ]
    with Copies() as alone:
        bare()
    return copies.seen, alone.seen


def gathered(communicator, shape: list[int], dim: int, reversed_ranks: bool) -> list[str]:
    """``x`` split along ``dim`` over the mesh, gathered whole on every rank."""
    mesh = _mesh(communicator.world_size, reversed_ranks)
    with FusionDefinition("gather") as fd:
        x = fd.define_tensor(shape)
        y = fd.ops.set(x)
        fd.add_output(y)
    shard(x, mesh, [Shard(dim)])
    shard(y, mesh, [Replicate()])
    full = [torch.randn(shape, generator=torch.Generator().manual_seed(3))]
    world = communicator.world_size
    piece = torch.empty(-(-shape[dim] // world) * math.prod(shape) // shape[dim])
    whole = torch.empty(world * piece.numel())  # the largest pieces, flat
    return _run_twice(communicator, fd, full, 1, lambda: _all_gather(whole, piece))


def scattered(communicator, rows: int, reversed_ranks: bool) -> list[str]:
    """A matmul over a split inner axis: its partial sums reduce-scattered by rows."""
    world = communicator.world_size
    mesh = _mesh(world, reversed_ranks)
    inner = 4 * world
    with FusionDefinition("scatter") as fd:
        a = fd.define_tensor([rows, inner])
        b = fd.define_tensor([inner, 6])
        y = fd.ops.matmul(a, b)
        fd.add_output(y)
    shard(a, mesh, [Shard(1)])
    shard(b, mesh, [Shard(0)])
    shard(y, mesh, [Shard(0)])
    generator = torch.Generator().manual_seed(5)
    full = [
        torch.randn(rows, inner, generator=generator),
        torch.randn(inner, 6, generator=generator),
    ]
    piece = torch.empty(-(-rows // world), 6)  # the largest
    partial = torch.empty(world * piece.shape[0], 6)
    return _run_twice(communicator, fd, full, inner, lambda: _reduce_scatter(piece, partial))


@pytest.mark.parametrize("reversed_ranks", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("layout", ["leading", "after-one", "uneven", "inner"])
@pytest.mark.parametrize("world", [2, 4])
def test_an_all_gather_copies_only_where_the_pieces_are_not_laid_out_as_it_moves_them(
    rank_pools, world, layout, reversed_ranks
):
    split = 4 * world
    shape, dim = {
        "leading": ([split, 5], 0),  # even, along the leading axis
        "after-one": ([1, split, 5], 1),  # after an axis of one element
        "uneven": ([split + 1, 5], 0),  # padded and trimmed
        "inner": ([3, split, 5], 1),  # after a wider axis: the pieces interleave in memory
    }[layout]
    for ours, bare in rank_pools(world).run(gathered, shape, dim, reversed_ranks):
        if layout in ("leading", "after-one") and not reversed_ranks:
            assert ours == bare, ours  # the received buffer is the output
        else:
            assert len(ours) > len(bare), ours  # the pieces moved into place


@pytest.mark.parametrize("reversed_ranks", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_reduce_scatter_sends_the_partial_sums_as_they_are_where_it_can(
    rank_pools, world, even, reversed_ranks
):
    rows = 4 * world if even else 4 * world + 1
    for ours, bare in rank_pools(world).run(scattered, rows, reversed_ranks):
        if even and not reversed_ranks:
            assert ours == bare, ours  # the matmul's output goes as it is
        else:
            assert len(ours) > len(bare), ours  # the pieces padded or put in rank order
