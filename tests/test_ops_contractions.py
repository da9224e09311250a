"""Contractions of ``fusion.ops`` (matmul, linear, the ``@`` operator) against torch.

Each test contracts fresh random inputs (seeded per test, see ``conftest.py``) with a one-op
fusion run by ``fd.execute`` and compares with torch on the native dtype (``a @ b``,
``F.linear(x, w, b)``) through ``fusion.testing.assert_close``, with ``reduction_extent`` the
number of accumulated terms (K, plus one for a bias). Extents 1, 7 and 1000 appear in M, K, N
and the batch axes. It also checks that the output keeps its dtype, its shape, the printed
expr and the contraction axis (a reduction axis of extent K).
"""

from __future__ import annotations

import itertools

import pytest
import torch.nn.functional as F

from fusion import FusionDefinition, ops
from fusion.dtypes import (
    DataType,
    bfloat16,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    float64,
)
from fusion.errors import DefinitionError
from fusion.exprs import LinearOp, MatmulOp
from fusion.ir import Symbol
from fusion.testing import assert_close

FLOATS = (float64, float32, bfloat16, float16)
STORAGE_ONLY = (float8_e4m3fn, float8_e5m2, float4_e2m1)
EXTENTS = (1, 7, 1000)


def shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(str(e) for e in shape)


def check_contraction(fd: FusionDefinition, expr_class: type, printed: str, k: int) -> None:
    """One expr of ``expr_class`` printed as ``printed``; its output ends in a reduction axis
    of extent K (the contraction), which its logical shape leaves out."""
    (expr,) = fd.fusion.exprs
    assert isinstance(expr, expr_class)
    assert str(expr).split(" = ", 1)[1] == printed
    reduction_axes = [axis for axis in expr.output.axes if axis.is_reduction]
    assert [axis.extent for axis in reduction_axes] == [k]
    assert expr.output.axes[-1].is_reduction


def run_matmul(make_input, a_shape, b_shape, dtype: DataType, use_operator: bool = False):
    a, b = make_input(a_shape, dtype), make_input(b_shape, dtype)
    with FusionDefinition() as fd:
        a_tv = fd.define_tensor(list(a_shape), dtype)
        b_tv = fd.define_tensor(list(b_shape), dtype)
        out = a_tv @ b_tv if use_operator else ops.matmul(a_tv, b_tv)
        fd.add_output(out)
    (result,) = fd.execute([a, b])
    expected = a @ b
    assert out.dtype is dtype
    assert result.dtype == dtype.torch_dtype
    assert out.shape == tuple(expected.shape)
    k = a_shape[-1]
    check_contraction(fd, MatmulOp, "matmul(T0, T1)", k)
    assert_close(result, expected, reduction_extent=k, message=f"{a_shape} @ {b_shape} ({dtype})")


# Every (M, K, N) over 1, 7, 1000 but 1000^3, which alone would take seconds on a CPU.
MKN = [mkn for mkn in itertools.product(EXTENTS, repeat=3) if mkn != (1000, 1000, 1000)]


@pytest.mark.parametrize("mkn", MKN, ids=shape_id)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_2d(make_input, dtype, mkn):
    m, k, n = mkn
    run_matmul(make_input, (m, k), (k, n), dtype)


BATCHED = [
    # 3-D x 2-D: the 2-D operand broadcasts over the batch
    ((7, 1, 1000), (1000, 7)),
    ((1, 7, 7), (7, 1000)),
    ((1000, 7, 1), (1, 7)),
    ((7, 1000, 7), (7, 1)),
    # 2-D x 3-D
    ((7, 1000), (7, 1000, 1)),
    # 3-D x 3-D, extent-1 batch axes broadcasting against 7 and 1000
    ((7, 1, 1000), (1, 1000, 7)),
    ((1, 7, 1000), (7, 1000, 1)),
    ((7, 7, 7), (7, 7, 7)),
    ((1000, 1, 7), (1, 7, 1)),
    ((1, 1000, 7), (1000, 7, 1)),
    # 4-D x 3-D: batch axes right-aligned
    ((7, 1, 1, 7), (1000, 7, 1)),
]


@pytest.mark.parametrize("shapes", BATCHED, ids=lambda p: f"{shape_id(p[0])}@{shape_id(p[1])}")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_batched(make_input, dtype, shapes):
    a_shape, b_shape = shapes
    run_matmul(make_input, a_shape, b_shape, dtype)


@pytest.mark.parametrize(
    "shapes",
    [((7, 1000), (1000, 7)), ((1, 1), (1, 1)), ((7, 1, 1000), (1, 1000, 7))],
    ids=lambda p: f"{shape_id(p[0])}@{shape_id(p[1])}",
)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_operator(make_input, dtype, shapes):
    a_shape, b_shape = shapes
    run_matmul(make_input, a_shape, b_shape, dtype, use_operator=True)


# (x shape, N): K is x's last extent
LINEAR = [
    ((7, 1000), 7),
    ((1000, 7), 1000),
    ((1, 1), 1),
    ((1000, 1000), 7),
    ((7, 7), 1000),
    ((1, 1000), 1000),
    ((1000, 1), 7),
    ((7, 1, 1000), 7),
    ((1, 7, 7), 1000),
    ((1000, 7, 1), 7),
    ((1000,), 7),
    ((7,), 1000),
]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("case", LINEAR, ids=lambda c: f"{shape_id(c[0])}-N{c[1]}")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_linear(make_input, dtype, case, bias):
    x_shape, n = case
    k = x_shape[-1]
    x, w = make_input(x_shape, dtype), make_input((n, k), dtype)
    b = make_input((n,), dtype) if bias else None
    with FusionDefinition() as fd:
        x_tv = fd.define_tensor(list(x_shape), dtype)
        w_tv = fd.define_tensor([n, k], dtype)
        b_tv = fd.define_tensor([n], dtype) if bias else None
        out = ops.linear(x_tv, w_tv, b_tv)
        fd.add_output(out)
    (result,) = fd.execute([x, w] + ([b] if bias else []))
    expected = F.linear(x, w, b)

    assert out.dtype is dtype
    assert result.dtype == dtype.torch_dtype
    assert out.shape == tuple(expected.shape)
    printed = "linear(T0, T1, T2)" if bias else "linear(T0, T1)"
    check_contraction(fd, LinearOp, printed, k)
    terms = k + 1 if bias else k
    assert_close(result, expected, reduction_extent=terms, message=f"linear {case} ({dtype})")


# ---------------------------------------------------------------------------
# fp8 and fp4 are storage types: matmul and linear refuse them, naming the op and the type


def check_storage_refusal(op_name: str, dtype: DataType, shapes_dtypes, body) -> None:
    with pytest.raises(DefinitionError) as info:
        with FusionDefinition() as fd:
            tensors = [fd.define_tensor(list(s), d) for s, d in shapes_dtypes]
            fd.add_output(body(*tensors))
    message = str(info.value)
    assert message.startswith(f"{op_name}: "), message
    assert dtype.name in message and "storage type" in message, message


@pytest.mark.parametrize("which", ["both", "a", "b"])
@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
def test_matmul_refuses_storage_only(dtype, which):
    a_dtype = dtype if which in ("both", "a") else float32
    b_dtype = dtype if which in ("both", "b") else float32
    check_storage_refusal("matmul", dtype, [((8, 1000), a_dtype), ((1000, 8), b_dtype)], ops.matmul)


@pytest.mark.parametrize("which", ["x_and_weight", "weight", "bias"])
@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
def test_linear_refuses_storage_only(dtype, which):
    x_dtype = dtype if which == "x_and_weight" else bfloat16
    w_dtype = dtype if which in ("x_and_weight", "weight") else bfloat16
    b_dtype = dtype if which == "bias" else bfloat16
    inputs = [((8, 1000), x_dtype), ((8, 1000), w_dtype), ((8,), b_dtype)]
    check_storage_refusal("linear", dtype, inputs, ops.linear)


# ---------------------------------------------------------------------------
# Symbolic extents: one definition, run at several batch sizes


@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=str)
def test_contractions_with_symbolic_batch(make_input, dtype):
    batch = Symbol("batch")
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 1000], dtype)
        w = fd.define_tensor([7, 1000], dtype)
        bias = fd.define_tensor([7], dtype)
        b = fd.define_tensor([1000, 7], dtype)
        stacked = fd.define_tensor(["batch", 7, 1000], dtype)
        shared = fd.define_tensor([1, 1000, 7], dtype)
        projected = ops.linear(x, w, bias)
        product = x @ b
        batched = ops.matmul(stacked, shared)
        for tensor in (projected, product, batched):
            fd.add_output(tensor)
    assert projected.shape == (batch, 7)
    assert batched.shape == (batch, 7, 7)
    for batch_size in (1, 7, 1000):
        xs, ws, biases = (
            make_input((batch_size, 1000), dtype),
            make_input((7, 1000), dtype),
            make_input((7,), dtype),
        )
        bs = make_input((1000, 7), dtype)
        stacks, shareds = make_input((batch_size, 7, 1000), dtype), make_input((1, 1000, 7), dtype)
        results = fd.execute([xs, ws, biases, bs, stacks, shareds])
        expected = [(F.linear(xs, ws, biases), 1001), (xs @ bs, 1000), (stacks @ shareds, 1000)]
        for index, (result, (want, terms)) in enumerate(zip(results, expected, strict=True)):
            assert_close(
                result, want, reduction_extent=terms, message=f"output {index}, batch {batch_size}"
            )
