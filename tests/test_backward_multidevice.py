"""Gradients of placed fusions on real gloo ranks, against torch autograd on one device.

The backward (``overlap.train.backward.placed_backward``) runs like any placed fusion; every
rank's gradient pieces, of activations and weights, must equal the single-device
gradients (torch autograd through the reference evaluator) cut to that rank's piece,
and the communications the gradients need are asserted.
"""

from __future__ import annotations

import pytest
import torch
from test_pipelined import SWIGLU_PIPELINES, _loops, swiglu_block

from fusion import FusionDefinition
from fusion.reference import evaluate
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor, OverlapOptions
from overlap.train.backward import placed_backward
from sharding import DeviceMesh, Replicate, Shard, shard, shard_fusion


def tensor_parallel_mlp(world: int) -> FusionDefinition:
    """Megatron's MLP: x whole on every rank, w1 column-parallel, w2 row-parallel."""
    mesh = DeviceMesh(world)
    with FusionDefinition("tp_mlp") as fd:
        x = fd.define_tensor([6, 16])
        w1 = fd.define_tensor([8 * world, 16])
        w2 = fd.define_tensor([16, 8 * world])
        y = fd.ops.linear(fd.ops.tanh(fd.ops.linear(x, w1)), w2)
        fd.add_output(y)
    shard(x, mesh, [Replicate()])
    shard(w1, mesh, [Shard(0)])
    shard(w2, mesh, [Shard(1)])
    shard(y, mesh, [Replicate()])
    return fd


def split_extremes(world: int) -> FusionDefinition:
    """An elementwise maximum and minimum on split pieces, summed over the split axis.
    Its backward spreads the sum's gradient (whole on every rank) over the pieces: with
    generated kernels, the spread and the pieces' own work once shared a kernel, which
    wrote the whole tensor over a piece's extent only (wrong gradients on every rank)."""
    with FusionDefinition("split_extremes") as fd:
        x = fd.define_tensor([6, 4 * world + 1])
        y = fd.define_tensor([6, 4 * world + 1])
        top = fd.ops.maximum(x, y)
        fd.add_output(fd.ops.sum(fd.ops.minimum(top, 0.25) * x, [1]))
    shard(x, DeviceMesh(world), [Shard(1)])
    shard(y, DeviceMesh(world), [Shard(1)])
    return fd


def heads_attention(world: int) -> FusionDefinition:
    """Batched matmuls with the heads split over the ranks: tanh(q k^T) v per head, the
    keys shared by pairs of heads (their batch axis at extent 1 against the heads')."""
    with FusionDefinition("heads") as fd:
        q = fd.define_tensor([2 * world, 2, 5, 3])
        k = fd.define_tensor([2 * world, 1, 5, 3])
        v = fd.define_tensor([2 * world, 2, 5, 4])
        scores = fd.ops.matmul(q, fd.ops.permute(k, [0, 1, 3, 2]))
        fd.add_output(fd.ops.matmul(fd.ops.tanh(scores), v))
    for tensor in (q, k, v):
        shard(tensor, DeviceMesh(world), [Shard(0)])
    return fd


def shared_gradient(world: int) -> FusionDefinition:
    """An add hands one gradient to both operands and to its result: a replicated x and
    a row-split b (the gradient is placed once, as b's rows; x's is gathered from it)."""
    with FusionDefinition("shared_gradient") as fd:
        x = fd.define_tensor([4 * world + 1, 3])
        b = fd.define_tensor([4 * world + 1, 3])
        fd.add_output(fd.ops.exp(fd.ops.add(x, b)))
    shard(x, DeviceMesh(world), [Replicate()])
    shard(b, DeviceMesh(world), [Shard(0)])
    return fd


def fused_projection(world: int) -> FusionDefinition:
    """A fused projection split in three by slices (q * sigmoid(k) + v), its weight's rows
    split over the ranks: the slices' gradients are padded back into one gradient."""
    with FusionDefinition("fused_projection") as fd:
        x = fd.define_tensor([5, 6])
        w = fd.define_tensor([3 * 4 * world, 6])
        fused = fd.ops.linear(x, w)
        width = 4 * world
        q, k, v = (fd.ops.slice(fused, [0, i * width], [5, (i + 1) * width]) for i in range(3))
        fd.add_output(q * fd.ops.sigmoid(k) + v)
    shard(x, DeviceMesh(world), [Replicate()])
    shard(w, DeviceMesh(world), [Shard(0)])
    return fd


def data_and_tensor_parallel_mlp(world: int) -> FusionDefinition:
    """A 2 x 2 mesh: the batch split over "dp", Megatron's MLP over "tp"; the weights'
    gradients, partial over the batch pieces, are all-reduced over "dp" (cheaper than
    gathering the batch once it outweighs the weights)."""
    ranks = torch.arange(world).reshape([2, world // 2]).tolist()
    mesh = DeviceMesh(ranks, ("dp", "tp"))
    tp = world // 2
    with FusionDefinition("dp_tp_mlp") as fd:
        x = fd.define_tensor([64, 16])  # a batch larger than the weights, as data parallelism
        w1 = fd.define_tensor([8 * tp, 16])
        w2 = fd.define_tensor([16, 8 * tp])
        y = fd.ops.linear(fd.ops.tanh(fd.ops.linear(x, w1)), w2)
        fd.add_output(y)
    shard(x, mesh, [Shard(0), Replicate()])
    shard(w1, mesh, [Replicate(), Shard(0)])
    shard(w2, mesh, [Replicate(), Shard(1)])
    shard(y, mesh, [Shard(0), Replicate()])
    return fd


# The SwiGLU block's backward, as placed today: the normed rows gathered again (the
# forward recomputed), the output's gradient gathered once (for the down projection's
# input gradient, and transposed locally for its weight gradient), the normed rows'
# gradient reduce-scattered once per projection (gate and up: adding the partial sums
# first would need one), and gamma's gradient all-reduced.
SWIGLU_COMMUNICATIONS = ["Allgather(x)", "Allgather(x)", "ReduceScatter(x)", "ReduceScatter(x)",
                         "Allreduce(x)"]  # fmt: skip


BLOCKS = {"tp_mlp": lambda world: tensor_parallel_mlp(world),
          "swiglu_even": lambda world: swiglu_block(world, 4 * world),
          "swiglu_uneven": lambda world: swiglu_block(world, 4 * world - 1),
          "split_extremes": split_extremes,
          "heads": heads_attention,
          "shared_gradient": shared_gradient,
          "fused_projection": fused_projection,
          "dp_tp_mlp": data_and_tensor_parallel_mlp}  # fmt: skip


def gradients_on_every_rank(communicator, block: str, kernels: str, options=None, fd=None):
    world = communicator.world_size
    fd = fd or BLOCKS[block](world)
    generator = torch.Generator().manual_seed(31)
    full = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    full[1:] = [w / w.shape[-1] ** 0.5 if w.ndim == 2 else w for w in full[1:]]
    seeds = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.outputs]
    full, seeds = ([t.to(communicator.device) for t in ts] for ts in (full, seeds))
    # single device: torch autograd through the reference evaluator
    leaves = [t.clone().requires_grad_() for t in full]
    expected = torch.autograd.grad(evaluate(fd.fusion, leaves), leaves, seeds)
    grads = placed_backward(fd.fusion)
    executor = MultiDeviceExecutor(grads.fusion, communicator, options, kernels=kernels)
    local = executor.run(executor.shard_inputs(full + seeds))
    wanted = executor.shard_outputs(list(expected))
    for position, (ours, theirs) in enumerate(zip(local, wanted, strict=True)):
        assert_close(ours, theirs, reduction_extent=64, partial_sums=world,
                     message=f"rank {communicator.rank}, gradient of input {position}")  # fmt: skip
    if options is not None:
        return _loops(executor.program)
    return [f"{c.op_name}({c.in_layout.mesh.axis_names[c.mesh_axis]})"
            for c in executor.communications]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "block", "kernels"),
    [
        (world, block, kernels)
        for kernels in ("reference", "generated")
        for world, block in [(w, b) for w in (2, 4) for b in BLOCKS if b != "dp_tp_mlp"]
        + [(4, "dp_tp_mlp")]
    ],  # fmt: skip
)
def test_every_rank_gets_its_piece_of_every_gradient(rank_pools, world, block, kernels):
    results = rank_pools(world).run(gradients_on_every_rank, block, kernels, timeout=120)
    for communications in results:
        assert communications == results[0]  # one program on every rank
        if block in ("split_extremes", "heads"):
            # on the pieces alone: the gradients need nothing from other ranks
            assert communications == [], communications
        elif block == "shared_gradient":
            assert communications == ["Allgather(x)"], communications
        elif block == "fused_projection":
            # the slices need whole columns: the projection's column pieces trade for row
            # pieces (all-to-all), its gradient trades back, x's partial gradient is
            # all-reduced
            assert communications == ["AllToAll(x)"] * 2 + ["Allreduce(x)"], communications
        elif block == "dp_tp_mlp":
            # the weights' gradients all-reduced over "dp" (partial over the batch's
            # pieces); x's gradient from the hidden gradient and w1 gathered over "tp"
            # (at these sizes fewer bits than all-reducing x's partial gradient)
            assert sorted(communications) == ["Allgather(tp)"] * 2 + ["Allreduce(dp)"] * 2, (
                communications
            )
        elif block == "tp_mlp":
            # x's gradient, partial over the column-parallel weights' pieces, is
            # all-reduced; nothing else moves (the forward's own all-reduce of y is not
            # needed by any gradient, so the recomputed forward drops it)
            assert communications == ["Allreduce(x)"], communications
        else:
            # the sequence-split activations are gathered (forward again, and the
            # gradient's way back) and the gradients reduce-scattered to their rows
            assert communications == SWIGLU_COMMUNICATIONS, communications


def pipelined_backward(communicator, tokens: int, chunks: int, transport: str, kernels: str):
    fd = swiglu_block(communicator.world_size, tokens)
    options = OverlapOptions(overlap=True, num_chunks=chunks, transport=transport)
    return gradients_on_every_rank(communicator, "", kernels, options, fd)


@pytest.mark.parametrize("kernels", ["reference", "generated"])
@pytest.mark.parametrize(("tokens", "per_rank", "transport"), SWIGLU_PIPELINES)
@pytest.mark.parametrize("world", [2, 4])
def test_the_swiglu_backward_pipelines_as_its_forward(
    rank_pools, world, tokens, per_rank, transport, kernels
):
    """The backward's patterns go through the planner as the forward's: the normed rows
    gathered again for gate and up (placed as the forward placed them), the output's
    gradient gathered for the down projection's input gradient, and each projection's
    input gradient reduce-scattered in its matmul's loop (a reduce-scatter the program
    placed after the weight gradients is pulled into it). Every rank's gradients are
    single-device autograd's."""
    chunks = per_rank * world
    results = rank_pools(world).run(pipelined_backward, tokens, chunks, transport, kernels,
                                    timeout=120)  # fmt: skip
    gathered = ["Allgather"] if transport == "ring" else []
    for loops in results:
        assert loops == [
            [*gathered, "torch", "torch"],
            [*gathered, "torch"],
            ["torch", "ReduceScatter"],
            ["torch", "ReduceScatter"],
        ], loops


def test_a_bf16_block_backward_places_an_expr_reading_one_tensor_twice():
    """The bf16 SwiGLU block's backward squares a per-row statistic (``y * y``) that
    must move for the product: resharding copied it one operand at a time and the
    second found the first's copy already in place (it crashed). Placed now, with the
    copy shared by both operands."""
    mesh = DeviceMesh(2)
    with FusionDefinition("swiglu_bf16") as fd:
        x = fd.define_tensor([64, 32], "bfloat16")
        gamma = fd.define_tensor([32], "bfloat16")
        w_gate, w_up = (
            fd.define_tensor([64, 32], "bfloat16"),
            fd.define_tensor([64, 32], "bfloat16"),
        )
        w_down = fd.define_tensor([32, 64], "bfloat16")
        x32 = fd.ops.cast(x, "float32")
        rms = fd.ops.rsqrt(fd.ops.mean(x32 * x32, dims=[1], keepdim=True) + 1e-6)
        scale = fd.ops.broadcast(fd.ops.cast(gamma, "float32"), [True, False])
        normed = fd.ops.cast(x32 * rms * scale, "bfloat16")
        gate = fd.ops.cast(fd.ops.linear(normed, w_gate), "float32")
        up = fd.ops.cast(fd.ops.linear(normed, w_up), "float32")
        down = fd.ops.linear(fd.ops.cast(fd.ops.silu(gate) * up, "bfloat16"), w_down)
        out = fd.ops.cast(fd.ops.cast(down, "float32") + x32, "bfloat16")
        fd.add_output(out)
    for tensor, placement in ((x, Shard(0)), (w_gate, Shard(0)), (w_up, Shard(0)),
                              (w_down, Shard(1)), (out, Shard(0))):  # fmt: skip
        shard(tensor, mesh, [placement])
    placed, _ = shard_fusion(placed_backward(fd.fusion).fusion)
    twice = [e for e in placed.exprs if len(e.inputs) == 2 and e.inputs[0] is e.inputs[1]]
    assert twice and all(e.inputs[0] in placed.tensors for e in twice)
