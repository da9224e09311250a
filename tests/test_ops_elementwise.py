"""Elementwise ops of ``fusion.ops`` against the same computation written directly in torch.

Each test builds a small fusion with ``FusionDefinition``, runs it with ``fd.execute`` on
fresh random inputs (seeded per test, see ``conftest.py``) and compares the result with
torch called on the native dtype (``torch.exp(x_bf16)``, ``F.gelu(x, approximate="tanh")``,
``a + b``) through ``fusion.testing.assert_close``. It also checks the dtype the op promises
and the expr the fusion prints. Inputs stay inside each op's domain: positive for
log/sqrt/rsqrt, nonzero divisors, bounded exponents, integers that cannot overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

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
from fusion.exprs import BinaryOp, CompareOp, UnaryOp, WhereOp
from fusion.ir import Symbol
from fusion.testing import assert_close

SHAPES = [(1,), (7,), (1000,), (7, 1000), (1000, 7), (1, 1)]
# Scalar operands multiply the grid by sides and kinds; these three still hold 1, 7 and 1000.
SCALAR_SHAPES = [(1,), (7, 1000), (1000, 7)]
FLOATS = (float64, float32, bfloat16, float16)
INTS = (int64, int32, int8, uint8)
NUMERIC = FLOATS + INTS
COMPUTE = NUMERIC + (bool_,)
STORAGE_ONLY = (float8_e4m3fn, float8_e5m2, float4_e2m1)


def shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(str(e) for e in shape)


def build(inputs: list[tuple[tuple[int, ...], DataType]], body: Callable) -> FusionDefinition:
    """A fusion with inputs ``[(shape, dtype), ...]`` and the single output ``body(*inputs)``."""
    with FusionDefinition() as fd:
        tensors = [fd.define_tensor(list(shape), dtype) for shape, dtype in inputs]
        fd.add_output(body(*tensors))
    return fd


def run(fd: FusionDefinition, inputs: list[torch.Tensor]) -> torch.Tensor:
    (result,) = fd.execute(inputs)
    return result


def check_single_expr(fd: FusionDefinition, expr_class: type, printed: str) -> None:
    """The fusion holds exactly one expr, of ``expr_class``, printed ending in ``= printed``."""
    (expr,) = fd.fusion.exprs
    assert isinstance(expr, expr_class)
    assert str(expr).endswith(f" = {printed}"), str(expr)
    assert f" = {printed}" in str(fd)


def check_output_dtype(fd: FusionDefinition, result: torch.Tensor, expected: torch.dtype) -> None:
    """The IR output and the tensor ``execute`` returned both have the promised dtype."""
    (out,) = fd.fusion.outputs
    assert out.dtype.torch_dtype == expected, f"IR output is {out.dtype}, expected {expected}"
    assert result.dtype == expected, f"execute returned {result.dtype}, expected {expected}"


# ---------------------------------------------------------------------------
# Unary


def as_float32_if_not_floating(x: torch.Tensor) -> torch.Tensor:
    """torch has no integer gelu/silu; the op computes integer and bool inputs in float32."""
    return x if x.dtype.is_floating_point else x.to(torch.float32)


@dataclass(frozen=True)
class Unary:
    """One unary op: how the fusion calls it, the same op in torch and its input domain."""

    fusion_op: Callable
    torch_op: Callable[[torch.Tensor], torch.Tensor]
    printed: str
    float_range: tuple[float, float] | None  # None: N(0, 1)
    int_range: tuple[int, int]
    promotes_to_float: bool  # integer and bool inputs give float32


UNARY = {
    "neg": Unary(ops.neg, torch.neg, "neg(T0)", None, (-100, 100), False),
    "abs": Unary(ops.abs, torch.abs, "abs(T0)", None, (-100, 100), False),
    "relu": Unary(ops.relu, torch.relu, "relu(T0)", None, (-100, 100), False),
    "exp": Unary(ops.exp, torch.exp, "exp(T0)", (-10.0, 10.0), (-10, 10), True),
    "log": Unary(ops.log, torch.log, "log(T0)", (0.01, 100.0), (1, 100), True),
    "sqrt": Unary(ops.sqrt, torch.sqrt, "sqrt(T0)", (0.0, 100.0), (0, 100), True),
    "rsqrt": Unary(ops.rsqrt, torch.rsqrt, "rsqrt(T0)", (0.01, 100.0), (1, 100), True),
    "reciprocal": Unary(ops.reciprocal, torch.reciprocal, "reciprocal(T0)", None, (1, 100), True),
    "tanh": Unary(ops.tanh, torch.tanh, "tanh(T0)", (-5.0, 5.0), (-10, 10), True),
    "sigmoid": Unary(ops.sigmoid, torch.sigmoid, "sigmoid(T0)", (-10.0, 10.0), (-10, 10), True),
    "erf": Unary(
        ops.erf,
        lambda x: torch.erf(as_float32_if_not_floating(x)),
        "erf(T0)",
        (-4.0, 4.0),
        (-3, 3),
        True,
    ),
    "gelu": Unary(
        ops.gelu,
        lambda x: F.gelu(as_float32_if_not_floating(x)),
        "gelu(T0, approximate='none')",
        (-5.0, 5.0),
        (-10, 10),
        True,
    ),
    "gelu_tanh": Unary(
        lambda x: ops.gelu(x, approximate="tanh"),
        lambda x: F.gelu(as_float32_if_not_floating(x), approximate="tanh"),
        "gelu(T0, approximate='tanh')",
        (-5.0, 5.0),
        (-10, 10),
        True,
    ),
    "silu": Unary(
        ops.silu,
        lambda x: F.silu(as_float32_if_not_floating(x)),
        "silu(T0)",
        (-10.0, 10.0),
        (-10, 10),
        True,
    ),
}
SIGN_OPS = [name for name, spec in UNARY.items() if not spec.promotes_to_float]


def unary_input(make_input, spec: Unary, shape, dtype: DataType) -> torch.Tensor:
    if dtype.is_floating:
        low_high = spec.float_range or (None, None)
        return make_input(shape, dtype, *low_high)
    return make_input(shape, dtype, *spec.int_range)


# neg, abs and relu refuse bool (test_sign_ops_refuse_bool); the others compute it in float32.
UNARY_CASES = [
    pytest.param(name, dtype, id=f"{name}-{dtype}")
    for name, spec in UNARY.items()
    for dtype in COMPUTE
    if spec.promotes_to_float or dtype is not bool_
]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize(("name", "dtype"), UNARY_CASES)
def test_unary_matches_torch(make_input, name, dtype, shape):
    spec = UNARY[name]
    x = unary_input(make_input, spec, shape, dtype)
    fd = build([(shape, dtype)], spec.fusion_op)
    result = run(fd, [x])
    promoted = spec.promotes_to_float and not dtype.is_floating
    check_output_dtype(fd, result, torch.float32 if promoted else dtype.torch_dtype)
    check_single_expr(fd, UnaryOp, spec.printed)
    assert_close(result, spec.torch_op(x), message=f"{name}({dtype})")


@pytest.mark.parametrize("name", SIGN_OPS)
def test_sign_ops_refuse_bool(name):
    with pytest.raises(DefinitionError, match=f"^{name}: .*bool"):
        build([((7,), bool_)], UNARY[name].fusion_op)


# ---------------------------------------------------------------------------
# Binary


def torch_binary(op_name: str, lhs, rhs) -> torch.Tensor:
    """``op_name`` written in torch; either side may be a Python scalar.

    ``torch.maximum``/``minimum`` take no Python scalar: a 0-dim tensor promotes like one.
    torch refuses ``-`` on bool tensors, which the IR computes in the promoted type, so the
    hand-written version converts to that type first.
    """
    if op_name in ("maximum", "minimum"):
        lhs, rhs = (v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in (lhs, rhs))
    is_bool = [isinstance(v, torch.Tensor) and v.dtype == torch.bool for v in (lhs, rhs)]
    if op_name == "sub" and any(is_bool):
        promoted = torch.result_type(lhs, rhs)
        lhs, rhs = (v.to(promoted) if isinstance(v, torch.Tensor) else v for v in (lhs, rhs))
    return getattr(torch, op_name)(lhs, rhs)


@dataclass(frozen=True)
class Domain:
    """Where a binary op's operands come from, per side ``(lhs, rhs)``.

    Integer ranges keep every result inside int8 and uint8; each scalar lies inside the
    range of the side it stands on, so a scalar operand cannot overflow either. Bases of
    pow are positive, so a negative exponent never meets a zero. Float scalars are exact in
    bfloat16 and float16: eager torch on CPU rounds a Python scalar to a bf16/f16 tensor's
    type before adding or subtracting it, the IR keeps it in float32 (see
    test_low_precision_tensor_with_inexact_scalar_computes_in_float32).
    """

    float_ranges: tuple[tuple[float, float] | None, tuple[float, float] | None]
    int_ranges: tuple[tuple[int, int], tuple[int, int]]
    float_scalars: tuple[float, float]
    int_scalars: tuple[int, int]


BINARY = {
    "add": Domain((None, None), ((-50, 50), (-50, 50)), (0.75, -2.5), (30, 30)),
    "sub": Domain((None, None), ((50, 100), (0, 50)), (0.25, 1.5), (75, 25)),
    "mul": Domain((None, None), ((-11, 12), (-11, 12)), (-1.5, 0.75), (7, 7)),
    "div": Domain((None, None), ((-100, 100), (1, 10)), (2.5, 0.5), (7, 3)),
    "maximum": Domain((None, None), ((-100, 100), (-100, 100)), (0.5, 0.5), (5, 5)),
    "minimum": Domain((None, None), ((-100, 100), (-100, 100)), (0.5, 0.5), (5, 5)),
    "pow": Domain(((0.5, 2.0), (-3.0, 3.0)), ((1, 4), (0, 4)), (1.5, 2.5), (2, 3)),
}
SIDES = {"lhs": 0, "rhs": 1}


def operand(make_input, op_name: str, side: int, shape, dtype: DataType) -> torch.Tensor:
    domain = BINARY[op_name]
    if dtype.is_floating:
        return make_input(shape, dtype, *(domain.float_ranges[side] or (None, None)))
    return make_input(shape, dtype, *domain.int_ranges[side])


def binary_result_dtype(op_name: str, promoted: torch.dtype) -> torch.dtype:
    """What the op promises: torch's promotion, and true division of integers gives float32."""
    if op_name == "div" and not promoted.is_floating_point:
        return torch.float32
    return promoted


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_tensor_tensor(make_input, op_name, dtype, shape):
    lhs = operand(make_input, op_name, 0, shape, dtype)
    rhs = operand(make_input, op_name, 1, shape, dtype)
    fd = build([(shape, dtype), (shape, dtype)], getattr(ops, op_name))
    result = run(fd, [lhs, rhs])
    check_output_dtype(fd, result, binary_result_dtype(op_name, dtype.torch_dtype))
    check_single_expr(fd, BinaryOp, f"{op_name}(T0, T1)")
    assert_close(result, torch_binary(op_name, lhs, rhs), message=f"{op_name}({dtype})")


def scalar_result_dtype(op_name: str, dtype: DataType, scalar: bool | int | float) -> torch.dtype:
    """A Python scalar never widens a tensor within its category; it lifts to the next one.

    bool tensors become int64 with an int scalar, integer and bool tensors become float32
    with a float scalar.
    """
    if dtype.is_floating:
        promoted = dtype.torch_dtype
    elif isinstance(scalar, float):
        promoted = torch.float32
    elif dtype is bool_:
        promoted = torch.int64
    else:
        promoted = dtype.torch_dtype
    return binary_result_dtype(op_name, promoted)


@pytest.mark.parametrize("shape", SCALAR_SHAPES, ids=shape_id)
@pytest.mark.parametrize("scalar_kind", ["int", "float"])
@pytest.mark.parametrize("scalar_side", list(SIDES))
@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_with_scalar(make_input, op_name, dtype, scalar_side, scalar_kind, shape):
    side = SIDES[scalar_side]
    domain = BINARY[op_name]
    scalar = (domain.int_scalars if scalar_kind == "int" else domain.float_scalars)[side]
    x = operand(make_input, op_name, 1 - side, shape, dtype)

    def body(tensor):
        return getattr(ops, op_name)(*((scalar, tensor) if side == 0 else (tensor, scalar)))

    fd = build([(shape, dtype)], body)
    result = run(fd, [x])
    expected = torch_binary(op_name, *((scalar, x) if side == 0 else (x, scalar)))
    check_output_dtype(fd, result, scalar_result_dtype(op_name, dtype, scalar))
    printed = f"{scalar!r}, T0" if side == 0 else f"T0, {scalar!r}"
    check_single_expr(fd, BinaryOp, f"{op_name}({printed})")
    assert_close(result, expected, message=f"{op_name}({dtype}, {scalar_side}={scalar!r})")


@pytest.mark.parametrize("dtype", [bfloat16, float16], ids=str)
@pytest.mark.parametrize("op_name", ["add", "sub", "mul", "div"])
def test_low_precision_tensor_with_inexact_scalar_computes_in_float32(make_input, op_name, dtype):
    # 0.1 is not a bf16/f16 value. The IR computes low-precision floats in float32 and rounds
    # once, scalar included (as torch does on CUDA); eager torch on CPU would round 0.1 to
    # the tensor's type first, so the hand-written version spells the float32 computation.
    x = make_input((7, 1000), dtype)
    fd = build([((7, 1000), dtype)], lambda t: getattr(ops, op_name)(t, 0.1))
    result = run(fd, [x])
    expected = getattr(torch, op_name)(x.to(torch.float32), 0.1).to(dtype.torch_dtype)
    check_output_dtype(fd, result, dtype.torch_dtype)
    assert_close(result, expected, message=f"{op_name}({dtype}, 0.1)")


BROADCAST_PAIRS = [
    ((7, 1000), (1, 1000)),
    ((7, 1000), (7, 1)),
    ((1, 1000), (7, 1)),
    ((1, 1), (1000, 7)),
    ((1,), (1000,)),
    ((7,), (1,)),
    ((1, 1), (1, 1)),
]


@pytest.mark.parametrize("shapes", BROADCAST_PAIRS, ids=lambda p: "_".join(shape_id(s) for s in p))
@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_broadcasts_extent_one_axes(make_input, op_name, dtype, shapes):
    lhs_shape, rhs_shape = shapes
    lhs = operand(make_input, op_name, 0, lhs_shape, dtype)
    rhs = operand(make_input, op_name, 1, rhs_shape, dtype)
    fd = build([(lhs_shape, dtype), (rhs_shape, dtype)], getattr(ops, op_name))
    result = run(fd, [lhs, rhs])
    expected = torch_binary(op_name, lhs, rhs)
    (out,) = fd.fusion.outputs
    assert out.shape == expected.shape
    assert_close(result, expected, message=f"{op_name}({dtype}) {lhs_shape} with {rhs_shape}")


# torch promotes int8 with uint8 to int16, which the IR has no type for: see
# test_int8_with_uint8_is_refused.
MIXED_PAIRS = [(a, b) for a in COMPUTE for b in COMPUTE if a is not b and {a, b} != {int8, uint8}]


# bool - uint8 is uint8, where every nonzero rhs would wrap around: left out.
MIXED_BINARY_CASES = [
    pytest.param(op_name, a, b, id=f"{op_name}-{a}-{b}")
    for op_name in BINARY
    for a, b in MIXED_PAIRS
    if (op_name, a, b) != ("sub", bool_, uint8)
]


@pytest.mark.parametrize(("op_name", "lhs_dtype", "rhs_dtype"), MIXED_BINARY_CASES)
def test_binary_mixed_dtypes_promote_like_torch(make_input, op_name, lhs_dtype, rhs_dtype):
    dtypes = (lhs_dtype, rhs_dtype)
    lhs_shape, rhs_shape = (7, 1), (1, 1000)
    lhs = operand(make_input, op_name, 0, lhs_shape, lhs_dtype)
    rhs = operand(make_input, op_name, 1, rhs_shape, rhs_dtype)
    fd = build([(lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype)], getattr(ops, op_name))
    result = run(fd, [lhs, rhs])
    promoted = torch.promote_types(lhs_dtype.torch_dtype, rhs_dtype.torch_dtype)
    check_output_dtype(fd, result, binary_result_dtype(op_name, promoted))
    check_single_expr(fd, BinaryOp, f"{op_name}(T0, T1)")
    assert_close(result, torch_binary(op_name, lhs, rhs), message=f"{op_name}{dtypes}")


@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_refuses_bool_with_bool(op_name):
    with pytest.raises(DefinitionError, match=f"^{op_name}: arithmetic on bool operands"):
        build([((7,), bool_), ((7,), bool_)], getattr(ops, op_name))


INT8_WITH_UINT8 = {
    "add": ([((7,), int8), ((7,), uint8)], ops.add),
    "mul": ([((7,), uint8), ((7,), int8)], ops.mul),
    "where": ([((7,), bool_), ((7,), int8), ((7,), uint8)], ops.where),
}


@pytest.mark.parametrize("op_name", list(INT8_WITH_UINT8))
def test_int8_with_uint8_is_refused(op_name):
    # torch promotes int8 with uint8 to int16, a type the IR does not have: the op refuses
    # like every other op check, naming itself and both operands (their names carry the types).
    inputs, body = INT8_WITH_UINT8[op_name]
    with pytest.raises(DefinitionError) as info:
        build(inputs, body)
    message = str(info.value)
    first = len(inputs) - 2  # where's cond comes first
    assert message.startswith(f"{op_name}: "), message
    for index, (_, dtype) in enumerate(inputs[first:], start=first):
        assert f"T{index}_{dtype.short}[" in message, message


# ---------------------------------------------------------------------------
# TensorView operators


OPERATORS = [
    pytest.param(lambda x, y: x + y, "add(T0, T1)", id="x+y"),
    pytest.param(lambda x, y: 2 + x, "add(2, T0)", id="2+x"),
    pytest.param(lambda x, y: x - y, "sub(T0, T1)", id="x-y"),
    pytest.param(lambda x, y: 4 - y, "sub(4, T1)", id="4-y"),
    pytest.param(lambda x, y: x * y, "mul(T0, T1)", id="x*y"),
    pytest.param(lambda x, y: x * 0.5, "mul(T0, 0.5)", id="x*0.5"),
    pytest.param(lambda x, y: x / y, "div(T0, T1)", id="x/y"),
    pytest.param(lambda x, y: 1 / x, "div(1, T0)", id="1/x"),
    pytest.param(lambda x, y: x**y, "pow(T0, T1)", id="x**y"),
    pytest.param(lambda x, y: x**2, "pow(T0, 2)", id="x**2"),
    pytest.param(lambda x, y: 2**y, "pow(2, T1)", id="2**y"),
    pytest.param(lambda x, y: -x, "neg(T0)", id="-x"),
]


@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
@pytest.mark.parametrize(("expression", "printed"), OPERATORS)
def test_tensorview_operators(make_input, expression, printed, dtype):
    # x in [4, 8) and y in [1, 4): 4 - y, x - y and x**y (<= 7**3) stay inside uint8 and int8,
    # and every divisor is nonzero.
    shape = (7, 1000)
    x = make_input(shape, dtype, 4, 8)
    y = make_input(shape, dtype, 1, 4)
    fd = build([(shape, dtype), (shape, dtype)], expression)
    result = run(fd, [x, y])
    (expr,) = fd.fusion.exprs
    assert str(expr).endswith(f" = {printed}"), str(expr)
    assert_close(result, expression(x, y), message=f"{printed} ({dtype})")


# ---------------------------------------------------------------------------
# where


WHERE_SHAPES = [
    ((7, 1000), (7, 1000), (7, 1000)),
    ((7, 1), (1, 1000), (7, 1000)),
    ((1, 1000), (7, 1), (1, 1)),
    ((1,), (1000,), (1,)),
    ((7,), (7,), (7,)),
    ((1, 1), (1, 1), (1, 1)),
]


@pytest.mark.parametrize("shapes", WHERE_SHAPES, ids=lambda p: "_".join(shape_id(s) for s in p))
@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
def test_where_tensor_branches(make_input, dtype, shapes):
    cond_shape, x_shape, y_shape = shapes
    cond = make_input(cond_shape, bool_)
    x, y = make_input(x_shape, dtype), make_input(y_shape, dtype)
    fd = build([(cond_shape, bool_), (x_shape, dtype), (y_shape, dtype)], ops.where)
    result = run(fd, [cond, x, y])
    check_output_dtype(fd, result, dtype.torch_dtype)
    check_single_expr(fd, WhereOp, "where(T0, T1, T2)")
    assert_close(result, torch.where(cond, x, y), message=f"where({dtype}) {shapes}")


@pytest.mark.parametrize("scalar", [True, 3, -0.5], ids=repr)
@pytest.mark.parametrize("scalar_side", list(SIDES))
@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
def test_where_scalar_branch(make_input, dtype, scalar_side, scalar):
    shape = (7, 1000)
    cond, values = make_input((7, 1), bool_), make_input(shape, dtype)
    side = SIDES[scalar_side]

    def body(c, t):
        return ops.where(c, *((scalar, t) if side == 0 else (t, scalar)))

    fd = build([((7, 1), bool_), (shape, dtype)], body)
    result = run(fd, [cond, values])
    expected = torch.where(cond, *((scalar, values) if side == 0 else (values, scalar)))
    check_output_dtype(fd, result, expected.dtype)
    printed = f"{scalar!r}, T1" if side == 0 else f"T1, {scalar!r}"
    check_single_expr(fd, WhereOp, f"where(T0, {printed})")
    assert_close(result, expected, message=f"where({dtype}, {scalar_side}={scalar!r})")


@pytest.mark.parametrize(
    "branches", [(1.0, 0), (True, 2), (3, -1), (0.5, 1.5), (True, False)], ids=repr
)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_where_both_branches_scalar(make_input, shape, branches):
    cond = make_input(shape, bool_)
    fd = build([(shape, bool_)], lambda c: ops.where(c, *branches))
    result = run(fd, [cond])
    expected = torch.where(cond, *branches)
    check_output_dtype(fd, result, expected.dtype)
    check_single_expr(fd, WhereOp, f"where(T0, {branches[0]!r}, {branches[1]!r})")
    assert_close(result, expected)


@pytest.mark.parametrize("dtypes", MIXED_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_where_mixed_dtypes_promote_like_torch(make_input, dtypes):
    x_dtype, y_dtype = dtypes
    cond = make_input((7, 1000), bool_)
    x, y = make_input((7, 1), x_dtype), make_input((1, 1000), y_dtype)
    fd = build([((7, 1000), bool_), ((7, 1), x_dtype), ((1, 1000), y_dtype)], ops.where)
    result = run(fd, [cond, x, y])
    check_output_dtype(fd, result, torch.promote_types(x_dtype.torch_dtype, y_dtype.torch_dtype))
    check_single_expr(fd, WhereOp, "where(T0, T1, T2)")
    assert_close(result, torch.where(cond, x, y), message=f"where{dtypes}")


# ---------------------------------------------------------------------------
# fp8 and fp4 are storage types: every arithmetic op refuses them, naming itself and the type


def check_storage_refusal(op_name: str, dtype: DataType, inputs, body) -> None:
    with pytest.raises(DefinitionError) as info:
        build(inputs, body)
    message = str(info.value)
    assert message.startswith(f"{op_name}: "), message
    assert dtype.name in message, message
    assert "storage type" in message, message


@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_refuses_storage_only(name, dtype):
    spec = UNARY[name]
    op_name = name.removesuffix("_tanh")
    check_storage_refusal(op_name, dtype, [((7, 1000), dtype)], spec.fusion_op)


BINARY_STORAGE_CASES = {
    "both": lambda op, dtype: ([((7, 1000), dtype), ((7, 1000), dtype)], op),
    "lhs_with_float32": lambda op, dtype: ([((7, 1000), dtype), ((7, 1000), float32)], op),
    "rhs_with_bfloat16": lambda op, dtype: ([((7, 1000), bfloat16), ((7, 1000), dtype)], op),
    "with_float_scalar": lambda op, dtype: ([((7, 1000), dtype)], lambda x: op(x, 2.0)),
    "after_int_scalar": lambda op, dtype: ([((7, 1000), dtype)], lambda x: op(2, x)),
}


@pytest.mark.parametrize("case", list(BINARY_STORAGE_CASES))
@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
@pytest.mark.parametrize("op_name", list(BINARY))
def test_binary_refuses_storage_only(op_name, dtype, case):
    inputs, body = BINARY_STORAGE_CASES[case](getattr(ops, op_name), dtype)
    check_storage_refusal(op_name, dtype, inputs, body)


@pytest.mark.parametrize("other", ["tensor", "scalar"])
@pytest.mark.parametrize("branch", ["x", "y"])
@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
def test_where_refuses_storage_only_values(dtype, branch, other):
    inputs = [((7, 1000), bool_), ((7, 1000), dtype)]
    if other == "tensor":
        inputs.append(((7, 1000), float32))

    def body(cond, storage, *rest):
        other_value = rest[0] if rest else 1.0
        return ops.where(
            cond, *((storage, other_value) if branch == "x" else (other_value, storage))
        )

    check_storage_refusal("where", dtype, inputs, body)


# ---------------------------------------------------------------------------
# Symbolic extents: one definition, run at several batch sizes


@pytest.mark.parametrize("dtype", [float32, bfloat16], ids=str)
def test_elementwise_with_symbolic_batch(make_input, dtype):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 1000], dtype)
        w = fd.define_tensor([1, 1000], dtype)
        y = fd.define_tensor(["batch", 1000], dtype)
        cond = fd.define_tensor(["batch", 1], bool_)
        hidden = ops.gelu(x * w, approximate="tanh")
        out = ops.where(cond, ops.sub(hidden, y), 0.5)
        fd.add_output(out)
    batch = Symbol("batch")
    assert out.shape == (batch, 1000)
    assert "iS0{batch}" in str(fd)
    for batch_size in (1, 7, 1000):
        xs = make_input((batch_size, 1000), dtype)
        ws = make_input((1, 1000), dtype)
        ys = make_input((batch_size, 1000), dtype)
        conds = make_input((batch_size, 1), bool_)
        result = run(fd, [xs, ws, ys, conds])
        hidden_torch = F.gelu(xs * ws, approximate="tanh")
        expected = torch.where(conds, hidden_torch - ys, 0.5)
        assert_close(result, expected, message=f"batch {batch_size}")


# ---------------------------------------------------------------------------
# Comparisons: bool results, operands compared in their promoted type, NaN unequal


COMPARISONS = ["eq", "ne", "lt", "le", "gt", "ge"]


def _with_ties_and_specials(make_input, shape, dtype: DataType) -> torch.Tensor:
    value = make_input(shape, dtype, -3, 3)
    if dtype.is_floating:
        value = (value * 2).round() / 2  # ties with the other operand
        flat = value.view(-1)
        flat[:: max(len(flat) // 3, 1)] = float("nan")
        flat[1 :: max(len(flat) // 4, 1)] = float("inf")
    return value


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
@pytest.mark.parametrize("op_name", COMPARISONS)
def test_comparisons_give_bool_as_torch(make_input, op_name, dtype, shape):
    lhs = _with_ties_and_specials(make_input, shape, dtype)
    rhs = _with_ties_and_specials(make_input, shape, dtype)
    fd = build([(shape, dtype), (shape, dtype)], getattr(ops, op_name))
    result = run(fd, [lhs, rhs])
    check_single_expr(fd, CompareOp, f"{op_name}(T0, T1)")
    expected = getattr(torch, op_name)(lhs, rhs)
    assert result.dtype is torch.bool and torch.equal(result, expected), (op_name, dtype)


@pytest.mark.parametrize("dtypes", [(int32, float32), (bfloat16, float64), (bool_, int8),
                                    (uint8, int64)], ids=str)  # fmt: skip
@pytest.mark.parametrize("op_name", COMPARISONS)
def test_comparisons_of_mixed_types_and_scalars_promote_like_torch(make_input, op_name, dtypes):
    lhs = make_input((7, 1000), dtypes[0], -5, 5)
    rhs = make_input((1, 1000), dtypes[1], -5, 5)
    fd = build([((7, 1000), dtypes[0]), ((1, 1000), dtypes[1])], getattr(ops, op_name))
    assert torch.equal(run(fd, [lhs, rhs]), getattr(torch, op_name)(lhs, rhs))
    for scalar in (2, -0.5):  # an int tensor against a float scalar compares as floats
        fd = build([((7, 1000), dtypes[0])], lambda t, s=scalar: getattr(ops, op_name)(t, s))
        assert torch.equal(run(fd, [lhs]), getattr(torch, op_name)(lhs, scalar))
        fd = build([((7, 1000), dtypes[0])], lambda t, s=scalar: getattr(ops, op_name)(s, t))
        assert torch.equal(run(fd, [lhs]), getattr(torch, op_name)(torch.tensor(scalar), lhs))


@pytest.mark.parametrize("dtype", STORAGE_ONLY, ids=str)
def test_comparisons_refuse_storage_types(dtype):
    with pytest.raises(DefinitionError, match="storage type"):
        build([((7, 8), dtype), ((7, 8), dtype)], ops.eq)


@pytest.mark.parametrize("scalar", [0.1, 1 / 3, -2.7], ids=repr)
@pytest.mark.parametrize("dtype", [bfloat16, float16, float32, float64], ids=str)
@pytest.mark.parametrize("op_name", COMPARISONS)
def test_a_float_scalar_is_rounded_to_the_tensors_type_first(op_name, dtype, scalar):
    """As torch: a bf16 tensor against 0.1 compares with bf16's 0.1 (values at the
    rounded scalar and at its neighbours, the scalar on either side)."""
    rounded = torch.tensor(scalar, dtype=dtype.torch_dtype)
    up = rounded.double().nextafter(torch.tensor(9.0, dtype=torch.float64))
    down = rounded.double().nextafter(torch.tensor(-9.0, dtype=torch.float64))
    values = torch.stack([rounded, up.to(rounded.dtype), down.to(rounded.dtype),
                          torch.tensor(scalar, dtype=torch.float64).to(rounded.dtype)])  # fmt: skip
    for side in (0, 1):
        operands = (lambda t: (t, scalar)) if side == 0 else (lambda t: (scalar, t))
        fd = build([((4,), dtype)], lambda t, pick=operands: getattr(ops, op_name)(*pick(t)))
        scalar_tensor = torch.full_like(values, scalar)
        pair = (values, scalar_tensor) if side == 0 else (scalar_tensor, values)
        expected = getattr(torch, op_name)(*pair)
        assert torch.equal(run(fd, [values]), expected), (op_name, dtype, scalar, side)


@pytest.mark.parametrize(("dtype", "scalar"), [(int8, 300), (uint8, -1), (int32, 2**40)], ids=str)
def test_an_integer_scalar_out_of_the_tensors_range_is_refused(dtype, scalar):
    """torch wraps it around (an int8 against 300 compares with 44): refused instead."""
    with pytest.raises(DefinitionError, match=f"scalar {scalar} does not fit"):
        build([((7, 9), dtype)], lambda t: ops.lt(t, scalar))
