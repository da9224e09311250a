"""ATen ops without a translation into the IR: captured as opaque torch ops (``TorchOp``),
run by PyTorch on one device (the reference evaluator, generated kernels around them)
and over gloo ranks (split as torch's DTensor strategy splits them, else whole on every
rank), differentiated by PyTorch's autograd; the fusion's
printout and ``explain()`` name each op that fell back."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from test_capture import _check

import sharding.torch_strategy
from fusion import FusionDefinition
from fusion.capture import CaptureError, capture
from fusion.exprs import TorchOp, UnaryOp
from fusion.reference import evaluate
from fusion.testing import assert_close
from fusion.torch_ops import fell_back, torch_op, torch_vjp
from overlap import MultiDeviceExecutor, parallelize
from overlap.ir import LaunchKernel, walk
from sharding import DeviceMesh, Replicate, Shard, shard
from sharding.layout import layout_of
from sharding.propagation import explain
from sharding.resharding import shard_fusion
from sharding.torch_strategy import (
    NO_SPLIT,
    NO_STRATEGY,
    TorchStrategy,
    fallback_placement,
    torch_strategy,
)


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
                 "aten.sort.default, aten.zeros.default (placed by torch's DTensor strategy where "
                 "it has one, else replicated)")  # fmt: skip
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
    """The cumsum scans the split features axis: torch's own strategy for it (asked with
    ``dim=-1`` made positive) wants that axis whole, so the column-parallel output is
    gathered before it, and explain() names the placement and where it came from."""
    results = rank_pools(2).run(parallel_cumsum, 5, timeout=120)
    kinds, explained = results[0]
    assert all(result == results[0] for result in results)
    assert kinds == ["Allgather"], kinds
    lines = explained.splitlines()
    assert re.search(r"\[R\] @M0  Allgather of T\d+ for torch_op\[aten\.cumsum\.default\]$",
                     explained, re.M), explained  # fmt: skip
    # torch splits the cumsum on rows only: 5 rows do not split evenly over 2 ranks
    fell_back = "aten.cumsum.default (replicated: torch's strategy splits none of it here)"
    assert lines[-1] == f"fell back to torch: {fell_back}", lines


def placed_cumsum(split: int):
    """``exp(cumsum(x[4, 6], dim=1))`` with ``x`` and the result split on axis ``split``
    over 2 ranks: the placed fusion, explained."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], "float32")
        running = torch_op(torch.ops.aten.cumsum.default, (x, 1), {}, fd.fusion)
        y = fd.ops.exp(running)
        fd.add_output(y)
    mesh = DeviceMesh([0, 1])
    shard(x, mesh, [Shard(split)])
    shard(y, mesh, [Shard(split)])
    placed, decisions = shard_fusion(fd.fusion)
    return placed, explain(placed, decisions), x.name


def test_a_torch_op_between_split_tensors_is_placed_replicated_and_explained():
    """A cumsum along the split axis: torch's strategy gives the op's output whole,
    resharding gathers its split input and cuts its output where the consumer wants it
    split; explain() names the rule, the printout where the op runs."""
    placed, text, x = placed_cumsum(split=1)
    assert f"[R] @M0  torch's strategy rule, forward through " \
           f"torch_op[aten.cumsum.default] from input {x}" in text, text  # fmt: skip
    kinds = [e.op_name for e in placed.exprs if not isinstance(e, (TorchOp, UnaryOp))]
    assert kinds == ["Allgather", "shard_locally"], kinds
    last = str(placed).splitlines()[-1]
    assert last == "fell back to torch: aten.cumsum.default (whole on every rank)", last


def test_a_torch_op_along_a_whole_axis_of_split_tensors_runs_on_each_ranks_piece():
    """A cumsum along the axis left whole: torch's strategy keeps the rows split, nothing
    is inserted around it; explain() and the printout say so."""
    placed, text, x = placed_cumsum(split=0)
    assert not [e for e in placed.exprs if not isinstance(e, (TorchOp, UnaryOp))], placed
    assert f"[S(0)] @M0  torch's strategy rule, forward through " \
           f"torch_op[aten.cumsum.default] from input {x}" in text, text  # fmt: skip
    last = "fell back to torch: aten.cumsum.default (torch's strategy: S(0))"
    assert text.splitlines()[-1] == last, text
    last = str(placed).splitlines()[-1]
    assert last == "fell back to torch: aten.cumsum.default (split on axis 0)", last


def test_torchs_strategy_cuts_a_whole_operand_to_the_split_it_asks_for():
    """logaddexp of a column-split tensor and a whole one: torch's pointwise strategy
    wants both split alike, so the whole one is cut on each rank (no communication) and
    the result stays split."""
    with FusionDefinition() as fd:
        split, whole = fd.define_tensor([4, 6], "float32"), fd.define_tensor([4, 6], "float32")
        fd.add_output(torch_op(torch.ops.aten.logaddexp.default, (split, whole), {}, fd.fusion))
    mesh = DeviceMesh([0, 1])
    shard(split, mesh, [Shard(1)])
    shard(whole, mesh, [Replicate()])
    placed, decisions = shard_fusion(fd.fusion)
    cuts = [e for e in placed.exprs if not isinstance(e, TorchOp)]
    assert [(e.op_name, e.inputs[0].name) for e in cuts] == [("shard_locally", whole.name)]
    (output,) = placed.outputs
    assert layout_of(output).placements == (Shard(1),), explain(placed, decisions)


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


def scan(rows: int, dim: int) -> TorchOp:
    """``cumsum(x[rows, 6], dim)`` as an opaque torch op."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([rows, 6], "float32")
        fd.add_output(torch_op(torch.ops.aten.cumsum.default, (x, dim), {}, fd.fusion))
    return fd.fusion.exprs[0]


def test_torchs_strategy_splits_what_a_scan_leaves_whole_and_its_backward_alike():
    """A cumsum splits on the axis it does not scan (a negative dim read as torch's
    strategies read a positive one), only where it splits evenly; its backward keeps the
    split; an op torch has no strategy for splits nothing."""
    assert torch_strategy(scan(4, 1), 2).splits == {0: (0,)}
    assert torch_strategy(scan(4, -1), 2).splits == {0: (0,)}
    assert torch_strategy(scan(4, 0), 2).splits == {1: (1,)}
    uneven = scan(5, 1)
    assert torch_strategy(uneven, 2).splits == {}
    assert fallback_placement(uneven, ["R"], (2,)) == f"replicated: {NO_SPLIT}"
    forward = scan(4, 1)
    (grad,) = torch_vjp(forward, forward.inputs, forward.outputs, [0])
    assert torch_strategy(grad.definition, 2).splits == {0: (0, 0)}  # input and its grad
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], "float32")
        fd.add_output(torch_op(torch.ops.aten.renorm.default, (x, 2, 0, 1.0), {}, fd.fusion))
    assert torch_strategy(fd.fusion.exprs[0], 2) == TorchStrategy(note=NO_STRATEGY)


def test_a_split_torchs_strategy_would_get_wrong_is_checked_on_values_and_not_taken(
    monkeypatch,
):
    """Were torch's strategy to keep a split of the axis a cumsum scans (torch 2.13's
    does, asked with ``dim=-1``), the op on each rank's pieces would differ from the
    whole's pieces: that split is not taken, the rows' still is."""

    def keeps_every_split(expr, mesh, shapes, dtypes, split):
        return next(d for d in split if d is not None), tuple(split)

    monkeypatch.setattr(sharding.torch_strategy, "_ask", keeps_every_split)
    monkeypatch.setattr(sharding.torch_strategy, "_answers", {})
    assert torch_strategy(scan(4, 1), 2).splits == {0: (0,)}


class SplitFallback(torch.nn.Module):
    """A linear (two for the binary op), then an op the capture table has no translation
    for: ``cumsum`` along the features, ``logaddexp`` of the two linears (pointwise in
    torch's strategies) or ``renorm`` of the rows (torch has no strategy for it)."""

    def __init__(self, op: str, hidden: int) -> None:
        super().__init__()
        self.op = op
        self.up = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        y = self.up(x)
        if self.op == "cumsum":
            return torch.cumsum(y, dim=1)
        if self.op == "logaddexp":
            return torch.logaddexp(y, self.gate(x))
        return torch.renorm(y, p=2, dim=0, maxnorm=1.0)


def parallel_fallback(communicator, op: str, plan: dict, placement: str):
    """``SplitFallback(op)`` parallelized by ``plan``, its input and output placed
    ``placement``: this rank's output, input gradient and every parameter gradient
    against the module's under torch autograd on one device; returns the forward's
    communications, and the forward and the backward explained."""
    tokens, hidden = 6, 8
    torch.manual_seed(0)  # the same module on every rank
    module = SplitFallback(op, hidden)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    seed = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    model = parallelize(module, [x], communicator, plan, inputs=[placement],
                        outputs=[placement], dtensors=False)  # fmt: skip
    x_whole = x.clone().requires_grad_()
    y_whole = module(x_whole)
    names = [name for name, _ in module.named_parameters()]
    expected = torch.autograd.grad(y_whole, [*module.parameters(), x_whole], seed,
                                   allow_unused=True)  # fmt: skip
    (x_piece,) = model.input_pieces(x)
    x_piece.requires_grad_()
    y = model(x_piece)
    rank, extent = communicator.rank, hidden * hidden
    (wanted,) = model.output_pieces(y_whole.detach())
    assert_close(y, wanted, reduction_extent=extent, message=f"rank {rank} output")
    (seed_piece,) = model.output_pieces(seed)
    y.backward(seed_piece)
    used = {n: g for n, g in zip(names, expected, strict=False) if g is not None}
    for name, grad in model.full_state(used).items():
        ours = model.pieces[name.replace(".", "__")].grad
        assert_close(ours, grad, reduction_extent=tokens * extent, message=f"rank {rank} {name}")
    (x_grad,) = model.input_pieces(expected[-1])
    assert_close(x_piece.grad, x_grad, reduction_extent=extent, message=f"rank {rank} x")
    forward, backward = model.model.executors
    return [c.op_name for c in forward.communications], forward.explain(), backward.explain()


def test_a_cumsum_of_row_split_tokens_stays_split_by_torchs_strategy(rank_pools):
    """torch's strategy scans each rank's rows where its axis is whole: nothing moves in
    the forward, nor for its backward (the vjp runs on each rank's rows too)."""
    results = rank_pools(2).run(parallel_fallback, "cumsum", {}, "sequence", timeout=120)
    kinds, forward, backward = results[0]
    assert all(result == results[0] for result in results)
    assert kinds == [], forward
    fell_back = "aten.cumsum.default (torch's strategy: S(0))"
    assert forward.splitlines()[-1] == f"fell back to torch: {fell_back}", forward
    assert not re.search(r"for torch_vjp", backward), backward
    fell_back = "aten.cumsum.default backward (torch's strategy: S(0))"
    assert backward.splitlines()[-1] == f"fell back to torch: {fell_back}", backward


def test_a_pointwise_op_of_column_parallel_outputs_stays_split_by_torchs_strategy(rank_pools):
    """logaddexp of two column-parallel linears runs on each rank's columns: the one
    all-gather is of its result (for the whole output), not of its two inputs; its
    backward takes the columns as they are."""
    plan = {"up": "colwise", "gate": "colwise"}
    results = rank_pools(2).run(parallel_fallback, "logaddexp", plan, "replicate", timeout=120)
    kinds, forward, backward = results[0]
    assert all(result == results[0] for result in results)
    assert kinds == ["Allgather"], forward
    assert re.search(r"\[S\(1\)\] @M0  torch_op\[aten\.logaddexp\.default\] of T\d+, T\d+ "
                     r"for Allgather$", forward, re.M), forward  # fmt: skip
    fell_back = "aten.logaddexp.default (torch's strategy: S(1))"
    assert forward.splitlines()[-1] == f"fell back to torch: {fell_back}", forward
    assert not re.search(r"(Allgather|Allreduce) of T\d+ for torch_vjp", backward), backward


def test_an_op_torch_has_no_strategy_for_runs_replicated_and_says_so(rank_pools):
    """renorm of row-split tokens: torch has no strategy, so its input is gathered and
    each rank keeps its rows of the whole result."""
    results = rank_pools(2).run(parallel_fallback, "renorm", {}, "sequence", timeout=120)
    kinds, forward, _ = results[0]
    assert all(result == results[0] for result in results)
    assert kinds == ["Allgather"], forward
    assert re.search(r"\[R\] @M0  Allgather of T\d+ for torch_op\[aten\.renorm\.default\]$",
                     forward, re.M), forward  # fmt: skip
    fell_back = "aten.renorm.default (replicated: torch has no strategy)"
    assert forward.splitlines()[-1] == f"fell back to torch: {fell_back}", forward
