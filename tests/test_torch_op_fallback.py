"""ATen ops without a translation into the IR: captured as opaque torch ops (``TorchOp``),
run by PyTorch on one device (the reference evaluator, generated kernels around them)
and over gloo ranks (whole on every rank), differentiated by PyTorch's autograd; the
fusion's printout and ``explain()`` name each op that fell back."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from test_capture import _check

from fusion import FusionDefinition
from fusion.capture import CaptureError, capture
from fusion.exprs import TorchOp, UnaryOp
from fusion.reference import evaluate
from fusion.testing import assert_close
from fusion.torch_ops import fell_back, torch_op
from overlap import MultiDeviceExecutor, parallelize
from overlap.ir import LaunchKernel, walk
from sharding import DeviceMesh, Shard, shard
from sharding.propagation import explain
from sharding.resharding import shard_fusion


class Untranslated(torch.nn.Module):
    """A linear, then ops the capture table has no translation for: a cumulative sum, a
    flip, a sort (two outputs, one of them integer) and zeros made from nothing."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        running = torch.cumsum(self.proj(x), dim=1).flip(0)
        ranked = torch.sort(x, dim=-1).values
        return torch.tanh(running) * ranked + torch.zeros(x.shape)


def test_untranslated_ops_run_as_torch_ops_with_torchs_gradients():
    """Outputs and every gradient (ours through the fallback's vjp ops) equal the module's
    under torch autograd, on odd shapes."""
    torch.manual_seed(0)
    _check(Untranslated(7), torch.randn(5, 7), extent=7)


def test_the_printout_names_each_fallback_with_its_arguments():
    captured = capture(Untranslated(4), [torch.randn(3, 4)])
    text = str(captured.fd)
    assert re.search(r"= torch_op\[aten\.cumsum\.default\]\(T\d+, dim=1\)$", text, re.M), text
    assert re.search(r"= torch_op\[aten\.flip\.default\]\(T\d+, dims=\[0\]\)$", text, re.M), text
    # sort's two outputs: the values and the int64 indices
    assert re.search(r"T\d+_f32\[.*\], T\d+_i64\[.*\] = torch_op\[aten\.sort\.default\]", text)
    fell_back = ("fell back to torch: aten.cumsum.default, aten.flip.default, "
                 "aten.sort.default, aten.zeros.default (replicated)")  # fmt: skip
    assert text.splitlines()[-1] == fell_back, text
    translated = {e.op_name for e in captured.fd.fusion.exprs if not isinstance(e, TorchOp)}
    assert translated == {"linear", "tanh", "mul", "add"}  # no fallback where a translation is


def test_a_fusion_with_torch_ops_pickles_as_ray_actors_and_launched_ranks_receive_it():
    torch.manual_seed(2)
    module, x = Untranslated(4), torch.randn(3, 4)
    captured = capture(module, [x])
    received = pickle.loads(pickle.dumps(captured.fd.fusion))
    assert str(received) == str(captured.fd.fusion)
    (ours,) = evaluate(received, captured.inputs(module, x))
    assert_close(ours, module(x).detach(), reduction_extent=4)


def test_generated_kernels_leave_torch_ops_to_pytorch():
    """With kernels generated (Triton's interpreter on CPU), each torch op is a kernel of
    its own run by PyTorch, the elementwise ops around it generated."""
    torch.manual_seed(1)
    module, x = Untranslated(6), torch.randn(5, 6)
    captured = capture(module, [x])
    executor = MultiDeviceExecutor(captured.fd, kernels="generated")
    (ours,) = executor.run(captured.inputs(module, x))
    assert_close(ours, module(x).detach(), reduction_extent=6)
    kernels = [k for k in walk(executor.program.instructions) if isinstance(k, LaunchKernel)]
    by_torch = [k for k in kernels if any(isinstance(e, TorchOp) for e in k.exprs)]
    assert [(len(k.exprs), k.backend) for k in by_torch] == [(1, "torch")] * 4
    assert any(k.backend == "pointwise" for k in kernels), [k.backend for k in kernels]


class ProjectedCumsum(torch.nn.Module):
    """A column-parallel linear, then a cumulative sum along the split features."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return torch.cumsum(self.up(x), dim=-1)


def parallel_cumsum(communicator, tokens: int):
    """The module parallelized (``up`` column-wise): this rank's output and gradients
    against the module's under torch autograd; returns the forward's communications and
    its placements explained."""
    world, hidden = communicator.world_size, 8
    torch.manual_seed(0)  # the same module on every rank
    module = ProjectedCumsum(hidden, 4 * world + 2)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    seed = torch.randn(tokens, 4 * world + 2, generator=torch.Generator().manual_seed(2))
    model = parallelize(module, [x], communicator, {"up": "colwise"}, dtensors=False)
    x_whole = x.clone().requires_grad_()
    y_whole = module(x_whole)
    expected = torch.autograd.grad(y_whole, [module.up.weight, x_whole], seed)
    (x_piece,) = model.input_pieces(x)
    x_piece.requires_grad_()
    y = model(x_piece)
    rank, extent = communicator.rank, hidden * (4 * world + 2)
    assert_close(y, y_whole.detach(), reduction_extent=extent, message=f"rank {rank} output")
    y.backward(seed)
    (weight,) = model.full_state({"up.weight": expected[0]}).values()
    assert_close(model.pieces["up__weight"].grad, weight, reduction_extent=tokens * extent,
                 message=f"rank {rank} weight")  # fmt: skip
    assert_close(x_piece.grad, expected[1], reduction_extent=extent, message=f"rank {rank} x")
    executor = model.model.forward_executor
    return [c.op_name for c in executor.communications], executor.explain()


def test_a_cumsum_after_a_column_parallel_linear_runs_replicated_on_every_rank(rank_pools):
    """The cumsum needs the whole features axis: the column-parallel output is gathered
    before it, and explain() names the fallback's rule."""
    results = rank_pools(2).run(parallel_cumsum, 5, timeout=120)
    kinds, explained = results[0]
    assert all(result == results[0] for result in results)
    assert kinds == ["Allgather"], kinds
    lines = explained.splitlines()
    assert re.search(r"\[R\] @M0  Allgather of T\d+ for torch_op\[aten\.cumsum\.default\]$",
                     explained, re.M), explained  # fmt: skip
    assert lines[-1] == "fell back to torch (torch op fallback: replicated): aten.cumsum.default"


def test_a_torch_op_between_split_tensors_is_placed_replicated_and_explained():
    """Propagation gives the op's output the fallback's placement (whole), resharding
    gathers its split input and cuts its output where the consumer wants it split;
    explain() names the rule."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], "float32")
        running = torch_op(torch.ops.aten.cumsum.default, (x, 1), {}, fd.fusion)
        y = fd.ops.exp(running)
        fd.add_output(y)
    mesh = DeviceMesh([0, 1])
    shard(x, mesh, [Shard(1)])
    shard(y, mesh, [Shard(1)])
    placed, decisions = shard_fusion(fd.fusion)
    text = explain(placed, decisions)
    assert f"[R] @M0  torch op fallback: replicated rule, forward through " \
           f"torch_op[aten.cumsum.default] from input {x.name}" in text, text  # fmt: skip
    kinds = [e.op_name for e in placed.exprs if not isinstance(e, (TorchOp, UnaryOp))]
    assert kinds == ["Allgather", "shard_locally"], kinds


def test_an_op_writing_its_input_in_place_leaves_the_fusions_values_as_they_were():
    class Counting(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x, 0) * x.add_(1.0)

    x = torch.randn(5)
    captured = capture(Counting(), [x.clone()])
    assert "torch_op[aten.add_.Tensor]" in str(captured.fd)
    given = x.clone()
    (ours,) = captured.fd.execute([given])
    assert torch.equal(given, x)  # the input itself untouched
    assert_close(ours, torch.cumsum(x, 0) * (x + 1.0), reduction_extent=5)


class Noisy(torch.nn.Module):
    """A linear and dropout, and noise drawn by ``torch.rand_like`` where ``noise``."""

    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.dropout = torch.nn.Dropout(0.25)
        self.noise = noise

    def forward(self, x):
        y = self.dropout(self.linear(x))
        return y + torch.rand_like(y) if self.noise else y


def test_a_random_op_is_refused_naming_it_not_run_by_torch_on_each_rank_on_its_own():
    """Run by PyTorch, a random op would draw other numbers on each rank (a tensor every
    rank holds whole would differ between them) and again when the backward replays it:
    capture refuses it before anything runs, naming the op and where it is."""
    with pytest.raises(CaptureError, match=r"(?s)random op.*aten\.rand_like.*module itself"):
        capture(Noisy(noise=True).eval(), [torch.randn(3, 4)])
    # dropout in training mode is translated instead: not torch's random op, but a mask
    # (an IR op) drawn from the capture's seed input, the same on every rank
    # (tests/test_dropout.py)
    captured = capture(Noisy().train(), [torch.randn(3, 4)])
    assert captured.seeded
    assert fell_back(captured.fd.fusion) == []
    assert "dropout_mask" in [e.op_name for e in captured.fd.fusion.exprs]


def test_dropout_out_of_training_is_the_identity():
    module, x = Noisy().eval(), torch.randn(3, 4)
    captured = capture(module, [x])
    assert not any(isinstance(e, TorchOp) for e in captured.fd.fusion.exprs)
    params = [p.detach() for p in module.parameters()]
    (ours,) = evaluate(captured.fd.fusion, [*params, x])
    torch.testing.assert_close(ours, module(x))


def test_batch_norm_updating_its_running_statistics_is_refused_and_otherwise_falls_back():
    """A batch norm in training mode writes its running statistics in place, which a
    replayed or recomputed program would do more than once a step: refused, naming it;
    out of training, or without running statistics, it falls back to torch."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CaptureError, match=r"aten\.batch_norm.* in 1: .*running statistics"):
        capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train(), [x])
    for module in (torch.nn.BatchNorm1d(4).eval(),
                   torch.nn.BatchNorm1d(4, track_running_stats=False).train()):  # fmt: skip
        captured = capture(module, [x])
        assert any(isinstance(e, TorchOp) for e in captured.fd.fusion.exprs)
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        values = [state[name].detach() for name in captured.parameter_names]
        (ours,) = evaluate(captured.fd.fusion, [*values, x])
        torch.testing.assert_close(ours, module(x))
