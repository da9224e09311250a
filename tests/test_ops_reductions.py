"""Reductions of ``fusion.ops`` (sum, max, min, mean, var_mean) against hand-written torch.

Each test reduces fresh random inputs (seeded per test, see ``conftest.py``) with a one-op
fusion run by ``fd.execute`` and compares with torch on the native dtype (``x.sum(dim=1)``,
``x.amax(...)``, ``torch.var_mean(x, dim=1, correction=1)``) through
``fusion.testing.assert_close``, whose tolerance grows with ``reduction_extent``, the number
of accumulated terms. It also checks the dtype the op promises (integer and bool sums give
int64, bf16 stays bf16), the printed expr with its normalized dims, and the reduction axes
the output keeps.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusion import FusionDefinition, ops
from fusion.dtypes import (
    DataType,
    bfloat16,
    bool_,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    float64,
    int8,
    int32,
    int64,
    uint8,
)
from fusion.errors import DefinitionError
from fusion.exprs import ReductionOp, VarMeanOp
from fusion.ir import Symbol
from fusion.testing import assert_close

FLOATS = (float64, float32, bfloat16, float16)
COMPUTE = FLOATS + (int64, int32, int8, uint8, bool_)
STORAGE_ONLY = (float8_e4m3fn, float8_e5m2, float4_e2m1)

# (shape, dims as passed, keepdim, the dims the IR should record: normalized and sorted)
CASES = [
    ((1,), [0], False, [0]),
    ((7,), 0, False, [0]),
    ((1000,), [-1], True, [0]),
    ((7, 1000), [1], False, [1]),
    ((7, 1000), [0], True, [0]),
    ((1000, 7), [-2], False, [0]),
    ((1000, 7), [-1], True, [1]),
    ((7, 1000), [1, 0], False, [0, 1]),
    ((7, 1000), None, False, [0, 1]),
    ((7, 1000), None, True, [0, 1]),
    ((1, 1), [1], False, [1]),
    ((1, 1), None, True, [0, 1]),
    ((7, 1, 1000), [0, 2], False, [0, 2]),
    ((7, 1, 1000), [-1, 0], True, [0, 2]),
    ((1000, 7, 1), [1], False, [1]),
]
# A 0-dim tensor reduces over no axes: the reduction is the identity.
ZERO_DIM_CASE = ((), None, False, [])


def case_id(case) -> str:
    shape, dims, keepdim, _ = case
    shape_text = "x".join(str(e) for e in shape) or "0dim"
    return f"{shape_text}-dims{dims}{'-keepdim' if keepdim else ''}".replace(" ", "")


def torch_dims(x: torch.Tensor, dims) -> tuple[int, ...]:
    """``dims`` as torch takes them; None means every axis."""
    if dims is None:
        return tuple(range(x.dim()))
    return (dims,) if isinstance(dims, int) else tuple(dims)


# op -> (the same reduction written in torch, accepted dtypes)
REDUCTIONS = {
    "sum": (lambda x, dim, keepdim: x.sum(dim=dim, keepdim=keepdim), COMPUTE),
    "max": (lambda x, dim, keepdim: x.amax(dim=dim, keepdim=keepdim), COMPUTE),
    "min": (lambda x, dim, keepdim: x.amin(dim=dim, keepdim=keepdim), COMPUTE),
    "mean": (lambda x, dim, keepdim: x.mean(dim=dim, keepdim=keepdim), FLOATS),
}
REDUCTION_CASES = [
    pytest.param(op_name, dtype, case, id=f"{op_name}-{dtype}-{case_id(case)}")
    for op_name, (_, dtypes) in REDUCTIONS.items()
    for dtype in dtypes
    for case in [*CASES, ZERO_DIM_CASE]
]


def reduction_result_dtype(op_name: str, dtype: DataType) -> torch.dtype:
    """Integer and bool sums accumulate in int64, as torch does; everything else keeps its type."""
    if op_name == "sum" and not dtype.is_floating:
        return torch.int64
    return dtype.torch_dtype


def check_printed(fd: FusionDefinition, expected: list[str]) -> None:
    printed = [str(expr).split(" = ", 1)[1] for expr in fd.fusion.exprs]
    assert printed == expected
    for text in expected:
        assert f" = {text}" in str(fd)


def check_reduction_axes(expr, shape, normalized_dims) -> None:
    """Each output keeps the reduced axes as reduction axes with the input's extents."""
    for output in expr.outputs:
        reduced = [axis.extent for axis in output.axes if axis.is_reduction]
        assert reduced == [shape[d] for d in normalized_dims], str(output)


@pytest.mark.parametrize(("op_name", "dtype", "case"), REDUCTION_CASES)
def test_reduction_matches_torch(make_input, op_name, dtype, case):
    shape, dims, keepdim, normalized = case
    torch_op, _ = REDUCTIONS[op_name]
    x = make_input(shape, dtype)
    with FusionDefinition() as fd:
        out = getattr(ops, op_name)(fd.define_tensor(list(shape), dtype), dims, keepdim=keepdim)
        fd.add_output(out)
    (result,) = fd.execute([x])
    expected = torch_op(x, torch_dims(x, dims), keepdim)

    assert out.dtype.torch_dtype == reduction_result_dtype(op_name, dtype)
    assert result.dtype == reduction_result_dtype(op_name, dtype)
    assert out.shape == tuple(expected.shape)
    reduction = fd.fusion.exprs[0]
    assert isinstance(reduction, ReductionOp)
    check_reduction_axes(reduction, shape, normalized)
    keep = [f"broadcast(T1, dims={normalized})"] if keepdim else []
    check_printed(fd, [f"{op_name}(T0, dims={normalized})", *keep])
    terms = math.prod(shape[d] for d in normalized)
    assert_close(result, expected, reduction_extent=terms, message=f"{op_name}({dtype})")


VAR_MEAN_CASES = [
    pytest.param(dtype, correction, case, id=f"{dtype}-correction{correction}-{case_id(case)}")
    for dtype in FLOATS
    for correction in (0, 1)
    for case in CASES
]


# Reducing one element with correction 1 divides by zero: NaN, as in torch, which warns.
@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")
@pytest.mark.parametrize(("dtype", "correction", "case"), VAR_MEAN_CASES)
def test_var_mean_matches_torch(make_input, dtype, correction, case):
    shape, dims, keepdim, normalized = case
    x = make_input(shape, dtype)
    with FusionDefinition() as fd:
        var, mean = ops.var_mean(
            fd.define_tensor(list(shape), dtype), dims, correction=correction, keepdim=keepdim
        )
        fd.add_output(var)
        fd.add_output(mean)
    var_result, mean_result = fd.execute([x])
    var_expected, mean_expected = torch.var_mean(
        x, dim=torch_dims(x, dims), correction=correction, keepdim=keepdim
    )

    for tensor in (var, mean):
        assert tensor.dtype is dtype
        assert tensor.shape == tuple(var_expected.shape)
    expr = fd.fusion.exprs[0]
    assert isinstance(expr, VarMeanOp)
    check_reduction_axes(expr, shape, normalized)
    keep = [f"broadcast(T{i}, dims={normalized})" for i in (1, 2)] if keepdim else []
    check_printed(fd, [f"var_mean(T0, dims={normalized}, correction={correction})", *keep])
    terms = math.prod(shape[d] for d in normalized)
    assert_close(var_result, var_expected, reduction_extent=terms, message=f"var ({dtype})")
    assert_close(mean_result, mean_expected, reduction_extent=terms, message=f"mean ({dtype})")


# ---------------------------------------------------------------------------
# Accepted dtypes


@pytest.mark.parametrize("dtype", (int64, int32, int8, uint8, bool_), ids=str)
@pytest.mark.parametrize("op_name", ["mean", "var_mean"])
def test_mean_and_var_mean_refuse_integers_and_bool(op_name, dtype):
    with pytest.raises(
        DefinitionError, match=f"^{op_name}: .* is {dtype}; {op_name} needs a float"
    ):
        with FusionDefinition() as fd:
            fd.add_output(getattr(ops, op_name)(fd.define_tensor([7, 1000], dtype), [1]))


def first_output(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
@pytest.mark.parametrize("op_name", ["sum", "max", "min", "mean", "var_mean"])
def test_reductions_refuse_storage_only(op_name, dtype):
    with pytest.raises(DefinitionError) as info:
        with FusionDefinition() as fd:
            x = fd.define_tensor([7, 1000], dtype)
            fd.add_output(first_output(getattr(ops, op_name)(x, [1])))
    message = str(info.value)
    assert message.startswith(f"{op_name}: "), message
    assert dtype.name in message and "storage type" in message, message


# ---------------------------------------------------------------------------
# Symbolic extents: one definition, run at several batch sizes


@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=str)
def test_reductions_with_symbolic_batch(make_input, dtype):
    batch = Symbol("batch")
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 1000], dtype)
        row_sums = ops.sum(x, [1])
        column_means = ops.mean(x, [0], keepdim=True)
        overall_max = ops.max(x)
        var, mean = ops.var_mean(x, [-1], correction=1)
        column_var, _ = ops.var_mean(x, [0], correction=0)
        for tensor in (row_sums, column_means, overall_max, var, mean, column_var):
            fd.add_output(tensor)
    assert row_sums.shape == (batch,)
    assert column_means.shape == (1, 1000)
    reduced_over_batch = [a.extent for a in column_var.axes if a.is_reduction]
    assert reduced_over_batch == [batch]
    for batch_size in (1, 7, 1000):
        xs = make_input((batch_size, 1000), dtype)
        results = fd.execute([xs])
        var_expected, mean_expected = torch.var_mean(xs, dim=1, correction=1)
        expected = [
            (xs.sum(dim=1), 1000),
            (xs.mean(dim=0, keepdim=True), batch_size),
            (xs.amax(), batch_size * 1000),
            (var_expected, 1000),
            (mean_expected, 1000),
            (torch.var_mean(xs, dim=0, correction=0)[0], batch_size),
        ]
        for index, (result, (want, terms)) in enumerate(zip(results, expected, strict=True)):
            assert_close(
                result, want, reduction_extent=terms, message=f"output {index}, batch {batch_size}"
            )
