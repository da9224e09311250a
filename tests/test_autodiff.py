"""Gradients of fusions (``fusion.autodiff``) against torch autograd, in float64.

The reference: the forward fusion evaluated by the reference evaluator on tensors that
require gradients (it runs torch ops, so torch's autograd differentiates it), and
``torch.autograd.grad`` with random output gradients. Ours: the backward fusion,
evaluated on the same inputs and output gradients. Odd shapes throughout.
"""

from __future__ import annotations

import pytest
import torch

from fusion import FusionDefinition
from fusion.autodiff import DifferentiationError, backward, forward_with_saved
from fusion.exprs import ReductionOp
from fusion.reference import evaluate
from fusion.testing import assert_close


def _check(fd: FusionDefinition, shapes: list[list[int]], seed: int = 0, positive=()):
    """Every input's gradient from our backward equals torch autograd's."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for position, shape in enumerate(shapes):
        value = torch.randn(shape, generator=generator, dtype=torch.float64)
        if position in positive:
            value = value.abs() + 0.5
        inputs.append(value.requires_grad_())
    outputs = evaluate(fd.fusion, inputs)
    seeds = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    expected = torch.autograd.grad(outputs, inputs, seeds, allow_unused=True)
    grads = backward(fd.fusion)
    assert grads.wrt == list(range(len(shapes)))
    actual = evaluate(grads.fusion, [i.detach() for i in inputs] + seeds)
    for position, (ours, theirs) in enumerate(zip(actual, expected, strict=True)):
        theirs = torch.zeros_like(inputs[position]) if theirs is None else theirs
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9,
                                   msg=lambda m, p=position: f"input {p}: {m}")  # fmt: skip


UNARY = ["neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "relu", "silu",
         "abs", "erf", "gelu"]  # fmt: skip


@pytest.mark.parametrize("op", UNARY)
def test_each_unary_op(op):
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 7], "float64")
        fd.add_output(getattr(fd.ops, op)(x))
    _check(fd, [[3, 7]], positive=(0,) if op in ("log", "sqrt", "rsqrt") else ())


def test_gelu_with_the_tanh_approximation():
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 1], "float64")
        fd.add_output(fd.ops.gelu(x, approximate="tanh"))
    _check(fd, [[5, 1]])


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
@pytest.mark.parametrize("shapes", [([3, 7], [3, 7]), ([3, 7], [1, 7]), ([1, 1], [4, 1])],
                         ids=["same", "row broadcast", "both broadcast"])  # fmt: skip
def test_each_binary_op_with_broadcasting(op, shapes):
    with FusionDefinition() as fd:
        a = fd.define_tensor(shapes[0], "float64")
        b = fd.define_tensor(shapes[1], "float64")
        fd.add_output(getattr(fd.ops, op)(a, b))
    _check(fd, list(shapes), positive=(0, 1) if op in ("div", "pow") else ())


def test_a_scalar_operand_and_a_tensor_used_twice():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 9], "float64")
        fd.add_output(fd.ops.mul(fd.ops.sub(2.5, x), x) / 3.0)
        fd.add_output(fd.ops.pow(x, 3))
    _check(fd, [[2, 9]])


@pytest.mark.parametrize("keepdim", [False, True])
def test_sums_means_and_a_variance(keepdim):
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 7, 3], "float64")
        fd.add_output(fd.ops.sum(x, [0, 2], keepdim=keepdim))
        fd.add_output(fd.ops.mean(x, [1], keepdim=keepdim))
        for output in fd.ops.var_mean(x, [2], correction=1, keepdim=keepdim):
            fd.add_output(output)
    _check(fd, [[5, 7, 3]])


def test_an_rmsnorm_and_a_layernorm():
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 11], "float64")
        gamma = fd.define_tensor([11], "float64")
        scale = fd.ops.broadcast(gamma, [True, False])
        rms = fd.ops.rsqrt(fd.ops.mean(x * x, [1], keepdim=True) + 1e-6)
        fd.add_output(x * rms * scale)
        var, mean = fd.ops.var_mean(x, [1], correction=0, keepdim=True)
        fd.add_output((x - mean) * fd.ops.rsqrt(var + 1e-5) * scale)
    _check(fd, [[6, 11], [11]])


def _sums_of_one_element(fusion) -> list[str]:
    """The live reductions of ``fusion`` over axes of extent 1 only (each a copy)."""
    return [str(expr.output) for expr in fusion.live_exprs()
            if isinstance(expr, ReductionOp)
            and all(expr.inputs[0].shape[d] == 1 for d in expr.dims)]  # fmt: skip


def test_keepdim_statistics_get_their_gradients_without_sums_of_one_element():
    """A LayerNorm's and an RMSNorm's statistics kept as [rows, 1] (``keepdim``): their
    gradients are rebuilt over [rows] through the elementwise ops, not summed over the
    axis of extent 1 (which would break the normalization kernel). Values as torch's."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 11], "float64")
        var, mean = fd.ops.var_mean(x, [1], correction=0, keepdim=True)
        fd.add_output((x - mean) * fd.ops.rsqrt(var + 1e-5))
        fd.add_output(x * fd.ops.rsqrt(fd.ops.mean(x * x, [1], keepdim=True) + 1e-6))
    _check(fd, [[6, 11]])
    assert _sums_of_one_element(backward(fd.fusion).fusion) == []


def test_a_keepdim_statistic_scaled_by_an_input_of_one_column_is_summed_back_to_it():
    """An input [rows, 1] among the statistic's ops has nothing to rebuild over [rows]
    from: the statistic's gradient is summed over its axis of extent 1 (one sum, not one
    per input), still torch's."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 11], "float64")
        shift = fd.define_tensor([6, 1], "float64")
        rms = fd.ops.rsqrt(fd.ops.mean(x * x, [1], keepdim=True) * shift + 1e-6)
        fd.add_output(x * rms)
    _check(fd, [[6, 11], [6, 1]], positive=(1,))
    assert len(_sums_of_one_element(backward(fd.fusion, wrt=[0]).fusion)) == 1


def test_matmul_linear_with_bias_and_a_swiglu_mlp():
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 5], "float64")
        w_gate = fd.define_tensor([9, 5], "float64")
        w_up = fd.define_tensor([9, 5], "float64")
        w_down = fd.define_tensor([5, 9], "float64")
        bias = fd.define_tensor([5], "float64")
        h = fd.ops.silu(fd.ops.linear(x, w_gate)) * fd.ops.linear(x, w_up)
        fd.add_output(fd.ops.linear(h, w_down, bias) + x)
        fd.add_output(fd.ops.matmul(x, fd.ops.permute(w_gate, [1, 0])))
    _check(fd, [[7, 5], [9, 5], [9, 5], [5, 9], [5]])


def test_casts_reshapes_expands_and_copies():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 6], "float64")
        y = fd.define_tensor([1, 6], "float64")
        narrow = fd.ops.cast(fd.ops.cast(x, "float32"), "float64")  # a gradient passes casts
        folded = fd.ops.reshape(fd.ops.set(narrow), [2, 12])
        fd.add_output(fd.ops.exp(folded))
        fd.add_output(fd.ops.expand(y, [4, 6]) * x)
    _check(fd, [[4, 6], [1, 6]])


def test_an_input_the_outputs_do_not_depend_on_gets_zeros():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], "float64")
        fd.define_tensor([2], "float64")
        fd.add_output(fd.ops.exp(x))
    _check(fd, [[3], [2]])


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda fd, x: fd.ops.slice(x, [0, 0], [4, 5], [2, 1]), "slice"),
        (lambda fd, x: fd.ops.cast(fd.ops.cast(x, "float8_e4m3fn"), "float32"), "cast"),
    ],
    ids=["slice with a step", "fp8 cast"],
)
def test_an_op_without_a_rule_is_named_when_the_backward_is_built(build, named):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 5])
        fd.add_output(fd.ops.exp(build(fd, x)))
    with pytest.raises(DifferentiationError, match=rf"^{named} "):
        backward(fd.fusion)


def test_integer_inputs_have_no_gradient_and_asking_for_one_is_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], "float64")
        n = fd.define_tensor([3], "int64")
        fd.add_output(x * fd.ops.cast(n, "float64"))
    assert backward(fd.fusion).wrt == [0]
    with pytest.raises(DifferentiationError, match="input 1 .* only floating-point"):
        backward(fd.fusion, wrt=[1])


def _swiglu(fd):
    x = fd.define_tensor([7, 5], "float64")
    w_gate = fd.define_tensor([9, 5], "float64")
    w_up = fd.define_tensor([9, 5], "float64")
    w_down = fd.define_tensor([5, 9], "float64")
    gate, up = fd.ops.linear(x, w_gate), fd.ops.linear(x, w_up)
    h = fd.ops.silu(gate) * up
    fd.add_output(fd.ops.linear(h, w_down) + x)
    return gate, up, h


def test_saved_intermediates_are_taken_not_recomputed_and_give_the_same_gradients():
    with FusionDefinition() as fd:
        gate, up, h = _swiglu(fd)
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(s, generator=generator, dtype=torch.float64)
              for s in ([7, 5], [9, 5], [9, 5], [5, 9])]  # fmt: skip
    seed = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    recomputed = backward(fd.fusion)
    kept = backward(fd.fusion, saved=[gate, up, h])
    forward = forward_with_saved(fd.fusion, [gate, up, h])
    out, *saved_values = evaluate(forward, inputs)
    assert torch.equal(out, evaluate(fd.fusion, inputs)[0])
    expected = evaluate(recomputed.fusion, inputs + [seed])
    actual = evaluate(kept.fusion, inputs + saved_values + [seed])
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    # the saved projections are not run again: only the gradients' six matmuls remain
    # (x's two, the three weights', h's); recomputing adds gate and up
    matmuls = [e for e in kept.fusion.live_exprs() if e.op_name in ("matmul", "linear")]
    assert len(matmuls) == 6
    assert len([e for e in recomputed.fusion.live_exprs()
                if e.op_name in ("matmul", "linear")]) == 8  # fmt: skip
    assert kept.explain().count(": saved") == 3 and ": recomputed" in kept.explain()
    assert ": saved" not in recomputed.explain()


def test_only_a_computed_intermediate_can_be_saved():
    with FusionDefinition() as fd:
        _swiglu(fd)
    with pytest.raises(DifferentiationError, match="only an intermediate"):
        backward(fd.fusion, saved=[fd.fusion.inputs[0]])


def _with_ties(shape, generator):
    """Values rounded to halves: many ties, for max, min, maximum and minimum."""
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 2).round() / 2


@pytest.mark.parametrize("op", ["max", "min"])
def test_a_max_or_min_shares_its_gradient_among_ties(op):
    with FusionDefinition() as fd:
        x = fd.define_tensor([6, 5], "float64")
        fd.add_output(getattr(fd.ops, op)(x, [1]))
        fd.add_output(getattr(fd.ops, op)(x, [0, 1]))
    generator = torch.Generator().manual_seed(3)
    value = _with_ties([6, 5], generator)
    value[2] = 1.5  # a whole row tied
    leaf = value.clone().requires_grad_()
    outputs = evaluate(fd.fusion, [leaf])
    seeds = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    (expected,) = torch.autograd.grad(outputs, [leaf], seeds)
    (actual,) = evaluate(backward(fd.fusion).fusion, [value] + seeds)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_maximum_and_minimum_split_a_tie(op):
    with FusionDefinition() as fd:
        a = fd.define_tensor([4, 7], "float64")
        b = fd.define_tensor([4, 7], "float64")
        fd.add_output(getattr(fd.ops, op)(a, b))
        fd.add_output(getattr(fd.ops, op)(a, 0.5))
    generator = torch.Generator().manual_seed(4)
    values = [_with_ties([4, 7], generator) for _ in range(2)]
    leaves = [v.clone().requires_grad_() for v in values]
    outputs = evaluate(fd.fusion, leaves)
    seeds = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    expected = torch.autograd.grad(outputs, leaves, seeds)
    actual = evaluate(backward(fd.fusion).fusion, values + seeds)
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_where_sends_the_gradient_to_the_side_it_took():
    with FusionDefinition() as fd:
        cond = fd.define_tensor([3, 4], "bool")
        x = fd.define_tensor([3, 4], "float64")
        y = fd.define_tensor([1, 4], "float64")
        fd.add_output(fd.ops.where(cond, x, y) * x)
        fd.add_output(fd.ops.where(cond, 2.0, y))
    generator = torch.Generator().manual_seed(6)
    mask = torch.rand(3, 4, generator=generator) > 0.5
    values = [torch.randn(s, generator=generator, dtype=torch.float64) for s in ([3, 4], [1, 4])]
    leaves = [v.clone().requires_grad_() for v in values]
    outputs = evaluate(fd.fusion, [mask, *leaves])
    seeds = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    expected = torch.autograd.grad(outputs, leaves, seeds)
    grads = backward(fd.fusion)
    assert grads.wrt == [1, 2]  # the condition has no gradient
    actual = evaluate(grads.fusion, [mask, *values, *seeds])
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_a_power_of_a_scalar_base():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], "float64")
        fd.add_output(fd.ops.pow(2.0, x) + fd.ops.pow(x, 3))
    _check(fd, [[3, 4]])


def test_extremes_with_nan_and_infinities_give_torch_gradients():
    """Ties at an infinity split the gradient, a NaN maximum makes its row's gradient NaN
    (torch's amax), and maximum/minimum give the whole gradient to both operands where
    either is NaN (neither loses a comparison)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 3], "float64")
        y = fd.define_tensor([5, 3], "float64")
        fd.add_output(fd.ops.max(x, [1]))
        fd.add_output(fd.ops.min(x, [1]))
        fd.add_output(fd.ops.maximum(x, y))
        fd.add_output(fd.ops.minimum(x, y))
    inf, nan = float("inf"), float("nan")
    x_value = torch.tensor([[1.0, nan, 2.0], [inf, 1.0, inf], [-inf, -inf, -inf],
                            [2.0, 2.0, 0.5], [inf, nan, -inf]], dtype=torch.float64)  # fmt: skip
    y_value = torch.tensor([[1.0, 2.0, nan], [inf, 3.0, -inf], [-inf, 0.0, nan],
                            [2.0, nan, 0.5], [1.0, nan, -inf]], dtype=torch.float64)  # fmt: skip
    leaves = [v.clone().requires_grad_() for v in (x_value, y_value)]
    outputs = evaluate(fd.fusion, leaves)
    generator = torch.Generator().manual_seed(5)
    seeds = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    expected = torch.autograd.grad(outputs, leaves, seeds)
    actual = evaluate(backward(fd.fusion).fusion, [x_value, y_value, *seeds])
    assert expected[0].isnan().any()  # the cases above reach a NaN gradient
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_a_bf16_gradient_rounds_once_as_torch_kernels_do(approximate):
    """A bf16 gelu's derivative is a dozen ops: computed in bf16, rounding after each,
    the input gradient of a bf16 MLP was 50 % off torch's in places; in float32 with one
    rounding at the end it is within bf16 tolerance of torch autograd."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([10, 32], "bfloat16")
        w1 = fd.define_tensor([16, 32], "bfloat16")
        w2 = fd.define_tensor([32, 16], "bfloat16")
        hidden = fd.ops.gelu(fd.ops.linear(x, w1), approximate=approximate)
        fd.add_output(fd.ops.linear(hidden, w2))
    generator = torch.Generator().manual_seed(26)
    values = [torch.randn(s, generator=generator).to(torch.bfloat16) / s[1] ** 0.5
              for s in ([10, 32], [16, 32], [32, 16])]  # fmt: skip
    values[0] = values[0] * 32**0.5
    leaves = [v.clone().requires_grad_() for v in values]
    (out,) = evaluate(fd.fusion, leaves)
    seed = torch.randn(out.shape, generator=generator).to(torch.bfloat16)
    expected = torch.autograd.grad(out, leaves, seed)
    actual = evaluate(backward(fd.fusion).fusion, [*values, seed])
    for position, (ours, theirs) in enumerate(zip(actual, expected, strict=True)):
        assert_close(ours, theirs, reduction_extent=32, message=f"input {position}")


def test_batched_matmuls_with_broadcast_batch_axes_and_a_3d_linear():
    with FusionDefinition() as fd:
        a = fd.define_tensor([2, 3, 4, 5], "float64")
        b = fd.define_tensor([5, 6], "float64")  # broadcast over both batch axes
        c = fd.define_tensor([2, 1, 6, 3], "float64")  # extent 1 against 3
        x = fd.define_tensor([2, 4, 5], "float64")
        w = fd.define_tensor([7, 5], "float64")
        bias = fd.define_tensor([7], "float64")
        fd.add_output(fd.ops.matmul(fd.ops.matmul(a, b), c))
        fd.add_output(fd.ops.linear(x, w, bias))
    _check(fd, [[2, 3, 4, 5], [5, 6], [2, 1, 6, 3], [2, 4, 5], [7, 5], [7]])


def test_a_slice_or_select_of_what_needs_no_gradient_is_replayed_not_refused():
    """A rotary table sliced to the sequence (a frozen input): the gradient of x flows
    around the slice and the select, which are only replayed; asked for the table's and
    the rows' gradients too, they are padded back (zeros where nothing was taken)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([5, 4], "float64")
        table = fd.define_tensor([9, 4], "float64")
        rows = fd.define_tensor([3, 5, 4], "float64")
        cos = fd.ops.slice(table, [2, 0], [7, 4])
        fd.add_output(x * cos + fd.ops.select(rows, 0, 1))
    generator = torch.Generator().manual_seed(8)
    values = [torch.randn(s, generator=generator, dtype=torch.float64)
              for s in ([5, 4], [9, 4], [3, 5, 4])]  # fmt: skip
    leaf = values[0].clone().requires_grad_()
    (out,) = evaluate(fd.fusion, [leaf, values[1], values[2]])
    seed = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    (expected,) = torch.autograd.grad(out, [leaf], seed)
    grads = backward(fd.fusion, wrt=[0])
    (actual,) = evaluate(grads.fusion, [*values, seed])
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    _check(fd, [[5, 4], [9, 4], [3, 5, 4]])  # every input's gradient


def test_pads_and_their_gradients():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], "float64")
        fd.add_output(fd.ops.exp(fd.ops.pad(x, [1, 0], [2, 3])))
    _check(fd, [[3, 4]])
