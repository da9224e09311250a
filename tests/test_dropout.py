"""Dropout in training mode (``fusion.random``, ``fusion.capture``): a counter-based mask
from a seed and each element's global index, so every rank holding an element, the
reference evaluator, generated kernels and the backward all draw the same bit. The mask
is an IR op (``dropout_mask``) that generated kernels draw in registers: no mask in
memory, no kernel of its own."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import RankError
from torch.distributed.tensor import Shard

import sharding
from fusion import FusionDefinition
from fusion.autodiff import backward
from fusion.capture import capture
from fusion.exprs import DropoutMaskOp
from fusion.ir import ParallelType
from fusion.random import dropout_mask, element_hash, fmix32
from fusion.reference import evaluate
from fusion.testing import assert_close
from fusion.torch_ops import fell_back
from overlap import MultiDeviceExecutor, parallelize
from overlap.ir import ForLoop, LaunchKernel, walk
from overlap.train.backward import saved_by_policy
from schedulers.hardware import INTERPRETER
from schedulers.pointwise import PointwiseScheduler
from sharding import DeviceMesh, shard


class ScaledDropout(torch.nn.Module):
    """``dropout(x * weight)``: elementwise, so a rank's piece of the output is computed
    exactly as the whole one's (no sum split over ranks) and can be compared bitwise."""

    def __init__(self, hidden: int, p: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.weight)


def test_fmix32_is_murmur3s_finalizer():
    # murmur3's fmix32 written with Python's unbounded integers, wrapped to 32 bits
    def reference(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    values = [0, 1, 7, 1000, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    ours = fmix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert ours == [reference(v) for v in values]


def test_the_drop_fraction_is_p_within_a_few_sigma():
    count = 1 << 20
    for p in (0.1, 0.5, 0.9):
        mask = dropout_mask(torch.tensor([3]), [count], p)
        dropped = (mask == 0).sum().item()
        sigma = math.sqrt(count * p * (1 - p))
        assert abs(dropped - count * p) < 5 * sigma, (p, dropped)
        assert torch.all(mask[mask != 0] == torch.tensor(1 / (1 - p), dtype=torch.float32))


def test_the_hash_is_uniform_over_its_high_bits():
    # a bad mix leaves structure: each of the 16 top-nibble buckets gets 1/16 of the indices
    index = torch.arange(1 << 18, dtype=torch.int64)
    buckets = torch.bincount(element_hash(torch.tensor([5]), index) >> 28, minlength=16)
    expected, sigma = (1 << 18) / 16, math.sqrt((1 << 18) / 16)
    assert torch.all((buckets - expected).abs() < 5 * sigma), buckets


def test_the_mask_reads_each_elements_global_index_in_row_major_order():
    seed = torch.tensor([9])
    whole = dropout_mask(seed, [6, 7], 0.5)
    assert torch.equal(whole.flatten(), dropout_mask(seed, [42], 0.5))
    # a seed past 32 bits is mixed in whole: its high bits change the mask
    assert not torch.equal(whole, dropout_mask(seed + (1 << 32), [6, 7], 0.5))


def test_the_same_seed_gives_the_same_output_and_another_seed_another():
    torch.manual_seed(0)
    module, x = ScaledDropout(10, 0.5).train(), torch.randn(7, 10)
    captured = capture(module, [x])
    assert captured.seeded
    first, again, other = (captured.fd.execute(captured.inputs(module, x, seed=seed))[0]
                           for seed in (11, 11, 12))  # fmt: skip
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # the output is x * weight where kept, scaled by 1 / (1 - p), and 0 where dropped
    kept = first != 0
    assert 0 < kept.sum() < kept.numel()
    assert torch.equal(first[kept], ((x * module.weight) * 2.0)[kept].detach())


def test_eval_and_p_zero_take_no_seed():
    torch.manual_seed(0)
    x = torch.randn(7, 10)
    for module in (ScaledDropout(10, 0.5).eval(), ScaledDropout(10, 0.0).train()):
        captured = capture(module, [x])
        assert not captured.seeded
        (y,) = captured.fd.execute(captured.inputs(module, x))
        assert torch.equal(y, (x * module.weight).detach())


def test_the_gradient_is_the_output_gradient_through_the_same_mask():
    torch.manual_seed(0)
    module, x = ScaledDropout(10, 0.25).train(), torch.randn(7, 10)
    captured = capture(module, [x])
    inputs = [t.clone().requires_grad_(t.is_floating_point())
              for t in captured.inputs(module, x, seed=4)]  # fmt: skip
    (y,) = evaluate(captured.fd.fusion, inputs)
    grad = torch.randn(y.shape)
    weight_grad, x_grad = torch.autograd.grad(y, inputs[:2], grad)
    mask = dropout_mask(torch.tensor([4]), [7, 10], 0.25)
    assert torch.equal(x_grad, grad * mask * module.weight.detach())
    assert_close(weight_grad, (grad * mask * x).sum(0), reduction_extent=7)


def test_no_save_policy_stores_the_mask_the_backward_draws_it_again():
    torch.manual_seed(0)
    fusion = capture(ScaledDropout(10, 0.25).train(), [torch.randn(7, 10)]).fd.fusion
    (mask,) = [e.output for e in fusion.exprs if isinstance(e, DropoutMaskOp)]
    shard(fusion.inputs[1], DeviceMesh([0, 1]), [sharding.Shard(0)])  # x split by rows
    for policy in ("matmuls", "everything"):
        saved = saved_by_policy(fusion, policy)
        assert mask not in saved, policy
    grads = backward(fusion, saved=saved)
    assert mask in grads.read and mask not in grads.saved
    assert "dropout_mask" in [e.op_name for e in grads.fusion.exprs]


def test_a_bf16_dropout_scales_in_float32_and_rounds_once():
    torch.manual_seed(0)
    module, x = ScaledDropout(10, 0.3).train().bfloat16(), torch.randn(7, 10).bfloat16()
    captured = capture(module, [x])
    (y,) = captured.fd.execute(captured.inputs(module, x, seed=2))
    mask = dropout_mask(torch.tensor([2]), [7, 10], 0.3)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ((x * module.weight).float() * mask).bfloat16().detach())


def test_generated_kernels_equal_the_reference_evaluator_exactly():
    torch.manual_seed(0)
    module, x = ScaledDropout(33, 0.4).train(), torch.randn(5, 33)
    captured = capture(module, [x])
    inputs = captured.inputs(module, x, seed=21)
    (expected,) = evaluate(captured.fd.fusion, inputs)
    (ours,) = MultiDeviceExecutor(captured.fd, kernels="generated").run(inputs)
    assert torch.equal(ours, expected)


def generated_kernels(captured) -> list[LaunchKernel]:
    """The kernels of ``captured``'s program with generated kernels, loops included."""
    executor = MultiDeviceExecutor(captured.fd, kernels="generated")
    return [i for i in walk(executor.compiled.host.instructions) if isinstance(i, LaunchKernel)]


def test_the_mask_is_drawn_inside_the_kernel_of_the_product_not_held_in_memory():
    torch.manual_seed(0)
    module, x = ScaledDropout(33, 0.4), torch.randn(5, 33)
    captured = capture(module.train(), [x])
    text = str(captured.fd)
    assert "= dropout_mask(T4, p=0.4)" in text, text
    assert "torch_op" not in text and "fell back to torch" not in text, text
    # as many kernels as the module without dropout (it was two and a torch op): one,
    # generated, reading x, the weight and the seed, no mask
    (kernel,) = generated_kernels(captured)
    assert len(generated_kernels(capture(module.eval(), [x]))) == 1
    assert kernel.backend == "pointwise"
    assert any(isinstance(expr, DropoutMaskOp) for expr in kernel.exprs)
    assert [t.name for t in kernel.inputs] == [t.name for t in captured.fd.fusion.inputs]


@pytest.mark.parametrize(("split", "groups"), [((), ((0, 1, 2),)),
                                               ((1,), ((0,), (1, 2))),
                                               ((1, 2), ((0,), (1,), (2,)))])  # fmt: skip
def test_a_kernel_draws_a_pieces_bits_from_where_the_piece_starts(split, groups):
    # a device-split axis starts a group of its own, so an element's global index stays
    # linear in the kernel's coordinates (a tile's rows and columns, or a flat kernel's
    # three); the piece's start comes as runtime arguments, the kernel the same for all
    whole, p = [3, 4, 6], 0.5
    with FusionDefinition("dropped") as fd:
        x, seed = fd.define_tensor(whole, "f32"), fd.define_tensor([1], "i64")
        mask = fd.ops.dropout_mask(seed, whole, p)
        fd.add_output(x * mask)
    for dim in split:
        for tensor in (mask, fd.fusion.outputs[0]):
            tensor.axis(dim).parallel_type = ParallelType.DIDx
    scheduler = PointwiseScheduler()
    plan = scheduler.plan(fd.fusion.exprs, [x, seed], fd.fusion.outputs)
    assert plan.collapsed.groups == groups
    values, seed_value = torch.randn(whole), torch.tensor([-(2**40) - 3])
    sources = set()
    # two ranks' pieces along each split axis: the first halves, then the second ones
    extents = [e // 2 if d in split else e for d, e in enumerate(whole)]
    for origin in ([0, 0, 0], [e if d in split else 0 for d, e in enumerate(extents)]):
        piece = values[tuple(slice(o, o + e) for o, e in zip(origin, extents, strict=True))]
        shapes = {x: extents, seed: [1], fd.fusion.outputs[0]: extents}
        params = scheduler.heuristics(plan, INTERPRETER, extents)
        sources.add(scheduler.kernels(plan, params, extents)[0].source)
        launch = scheduler.launcher(plan, params, INTERPRETER, shapes.get).at(origin)
        out = torch.empty(extents)
        launch([piece.contiguous(), seed_value], [out], shapes)
        expected = piece * dropout_mask(seed_value, whole, p, origin, extents)
        assert torch.equal(out, expected), (split, origin)
    assert len(sources) == 1  # no rank's offset in the source


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_a_generated_mask_at_p_zero_keeps_everything_and_at_p_one_nothing(p):
    # the thresholds at the ends: 0 (every hash reaches it) and 2^32 (none does, and no
    # uint32 holds it)
    with FusionDefinition("ends") as fd:
        seed = fd.define_tensor([1], "i64")
        fd.add_output(fd.ops.dropout_mask(seed, [5, 7], p))
    inputs = [torch.tensor([3])]
    (expected,) = evaluate(fd.fusion, inputs)
    assert torch.equal(expected, torch.full([5, 7], 1.0 if p == 0 else 0.0))
    (ours,) = MultiDeviceExecutor(fd, kernels="generated").run(inputs)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("dim", [0, 1])
def test_a_mask_drawn_chunk_by_chunk_in_a_loop_is_the_whole_masks_chunks(dim):
    # chunks along the leading axis: the kernel at each chunk's start; along an axis the
    # kernel merged with the one before, the evaluator draws each chunk
    whole = [8, 6]
    with FusionDefinition("chunked") as fd:
        x, seed = fd.define_tensor(whole, "f32"), fd.define_tensor([1], "i64")
        y = x * fd.ops.dropout_mask(seed, whole, 0.5)
        fd.add_output(y)
    for tensor in (y, y.definition.inputs[1]):
        tensor.axis(dim).stream(2)
    inputs = [torch.randn(whole), torch.tensor([5])]
    (expected,) = evaluate(fd.fusion, inputs)
    executor = MultiDeviceExecutor(fd, kernels="generated")
    assert any(isinstance(i, ForLoop) for i in executor.compiled.host.instructions)
    (ours,) = executor.run(inputs)
    assert torch.equal(ours, expected)


def test_feature_and_alpha_dropout_in_training_stay_refused():
    from fusion.capture import CaptureError

    for dropout in (torch.nn.Dropout2d(0.5), torch.nn.AlphaDropout(0.5)):
        with pytest.raises(CaptureError, match="feature or alpha dropout"):
            capture(dropout.train(), [torch.randn(2, 3, 4, 4)])


def step_on_pieces(block, x, y_whole, grad, x_grad, what: str, exact_grad: bool = False):
    """A forward and backward of ``block`` on this rank's piece of ``x`` (on the rank's
    device): its output piece bitwise ``y_whole``'s (the CPU reference's), its input
    gradient piece ``x_grad``'s (bitwise with ``exact_grad``, else within a sum of ``x``'s
    rows' rounding). Returns the output piece."""
    device = block.model.communicator.device
    (x_piece,) = block.input_pieces(x)
    x_piece = x_piece.to(device).requires_grad_()
    y_piece = block(x_piece)
    (wanted,) = block.output_pieces(y_whole.detach())
    assert torch.equal(y_piece.cpu(), wanted.cpu()), what
    (grad_piece,) = block.output_pieces(grad)
    y_piece.backward(grad_piece.to(device))
    (x_grad_piece,) = block.input_pieces(x_grad)
    if exact_grad:
        assert torch.equal(x_piece.grad.cpu(), x_grad_piece.cpu()), f"{what}: x grad"
    else:
        assert_close(x_piece.grad.cpu(), x_grad_piece.cpu(), reduction_extent=x.shape[-1])
    return y_piece


def parallel_dropout(communicator, split_dim: int, kernels: str):
    """``ScaledDropout`` parallelized with its input and output split along ``split_dim``:
    three training steps (seeds 11, 12, 13; the forward, the backward recomputing the mask,
    an SGD step), each rank's output and input-gradient pieces bitwise the one-device
    reference's pieces (on the CPU) for the same seed and weights. On CUDA the third step
    replays the graphs captured at the second, which must read the new seed
    (``benchmarks/check_gpu.py``). Returns, per rank, whether the second step drew another
    mask."""
    torch.manual_seed(0)  # the same module and input on every rank
    module, x = ScaledDropout(10, 0.5).train(), torch.randn(7, 10)
    block = parallelize(module, [x], communicator, {}, inputs=[Shard(split_dim)],
                        outputs=[Shard(split_dim)], dtensors=False, seed=11,
                        kernels=kernels)  # fmt: skip
    captured = capture(module, [x])
    outputs = []
    for seed in (11, 12, 13):
        leaves = [t.clone().requires_grad_(t.is_floating_point())
                  for t in captured.inputs(module, x, seed=seed)]  # fmt: skip
        (y_whole,) = evaluate(captured.fd.fusion, leaves)
        grad = torch.randn(y_whole.shape, generator=torch.Generator().manual_seed(seed))
        weight_grad, x_grad = torch.autograd.grad(y_whole, leaves[:2], grad)
        what = f"rank {communicator.rank}, seed {seed}"
        y_piece = step_on_pieces(block, x, y_whole, grad, x_grad, what, exact_grad=True)
        ours = block.pieces["weight"].grad.cpu()
        # the weight is whole on every rank: its gradient sums the ranks' rows
        assert_close(ours, weight_grad, reduction_extent=7, partial_sums=2)
        # the same step on both: the module's weight stays bitwise the block's
        torch.optim.SGD(block.parameters(), lr=0.1).step()
        with torch.no_grad():
            module.weight.add_(ours, alpha=-0.1)  # as SGD steps
        assert torch.equal(block.pieces["weight"].detach().cpu(), module.weight.detach())
        block.pieces["weight"].grad = None
        outputs.append(y_piece.detach().cpu() != 0)
    return [(outputs[0] != outputs[1]).any().item()]


@pytest.mark.parametrize(("split_dim", "kernels"),
                         [(0, "reference"), (1, "reference"), (0, "generated"),
                          (1, "generated")])  # fmt: skip
def test_dropout_split_over_two_ranks_draws_the_one_device_mask(rank_pools, split_dim, kernels):
    results = rank_pools(2).run(parallel_dropout, split_dim, kernels, timeout=180)
    # the second call drew another mask (the seed advanced) on every rank
    assert results == [[True], [True]]


class DropoutBetweenFallbacks(torch.nn.Module):
    """Dropout between two ops PyTorch runs (``cumsum`` has no translation): the mask
    drawn beside torch ops, whose tensors every rank holds whole."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return torch.cumsum(self.drop(torch.cumsum(x, 0) * self.weight), 1)


def dropout_between_fallbacks(communicator):
    """``DropoutBetweenFallbacks`` split by rows over the ranks with generated kernels:
    each rank's output piece bitwise the one-device reference's, its input gradient's
    within rounding. Returns, per rank, the ops that fell back to torch."""
    torch.manual_seed(0)
    module, x = DropoutBetweenFallbacks(10).train(), torch.randn(7, 10)
    captured = capture(module, [x])
    leaves = [t.clone().requires_grad_(t.is_floating_point())
              for t in captured.inputs(module, x, seed=11)]  # fmt: skip
    (y_whole,) = evaluate(captured.fd.fusion, leaves)
    grad = torch.randn(y_whole.shape, generator=torch.Generator().manual_seed(1))
    (x_grad,) = torch.autograd.grad(y_whole, [leaves[1]], grad)
    block = parallelize(module, [x], communicator, {}, inputs=[Shard(0)], outputs=[Shard(0)],
                        dtensors=False, seed=11, kernels="generated")  # fmt: skip
    step_on_pieces(block, x, y_whole, grad, x_grad, f"rank {communicator.rank}")
    return fell_back(captured.fd.fusion)


def test_dropout_between_ops_that_fall_back_to_torch_draws_the_one_device_mask(rank_pools):
    results = rank_pools(2).run(dropout_between_fallbacks, timeout=180)
    assert results == [["aten.cumsum.default"]] * 2


def seeded_by_each_rank(communicator):
    """Dropout alone parallelized without ``seed=``: its base seed is
    ``torch.initial_seed()``, here another on each rank."""
    torch.manual_seed(communicator.rank)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    parallelize(torch.nn.Dropout(0.5).train(), [x], communicator, {}, dtensors=False)


def test_parallelize_refuses_a_dropout_seed_that_differs_between_ranks(rank_pools):
    with pytest.raises(RankError, match="dropout's seed"):
        rank_pools(2).run(seeded_by_each_rank, timeout=120)
