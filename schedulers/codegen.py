"""Writing Triton source for generated kernels: loads, ops, casts, stores.

A kernel is Python source text built line by line, then compiled once (see
``schedulers.cache``). Values travel in registers in a *value form* that keeps the
reference's numerics exactly:

- floats as float32 (float64 for float64) holding a value exactly representable in
  the tensor's dtype: every op computes in its compute type (float32 for bf16/f16) and
  rounds once to its output dtype, as ``fusion.reference`` does;
- integers and bools natively;
- fp8 and fp4 as their codes (uint8); casts decode and encode them with the bit
  operations of ``schedulers.triton_lib``.

A dropout mask (``DropoutMaskOp``) is drawn in registers (``schedulers.triton_random``)
from the seed and each element's global index, which the kernel that writes it names
(``Emitter.element_index``): no mask is read from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion.dtypes import (
    DataType,
    bfloat16,
    bool_,
    compute_dtype,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    float64,
)
from fusion.exprs import (
    BinaryOp,
    BroadcastOp,
    CastOp,
    CompareOp,
    DetachOp,
    DropoutMaskOp,
    ExpandOp,
    Expr,
    SetOp,
    UnaryOp,
    WhereOp,
)
from fusion.ir import Scalar, TensorView
from fusion.random import keep_scale, keep_threshold
from schedulers.analysis import NotSchedulable

TRITON_TYPES = {
    "float64": "tl.float64",
    "float32": "tl.float32",
    "bfloat16": "tl.bfloat16",
    "float16": "tl.float16",
    "int64": "tl.int64",
    "int32": "tl.int32",
    "int8": "tl.int8",
    "uint8": "tl.uint8",
    "bool": "tl.int1",
}
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ENCODE = {
    float8_e4m3fn: "fp8e4m3_encode",
    float8_e5m2: "fp8e5m2_encode",
    float4_e2m1: "fp4_encode",
}
_DECODE = {
    float8_e4m3fn: "fp8e4m3_decode",
    float8_e5m2: "fp8e5m2_decode",
    float4_e2m1: "fp4_decode",
}
# Options of every generated kernel's compilation. No multiply-add contraction: the
# reference rounds a product before adding to it, and so must the kernel (an fma
# rounds once; in bf16 that can differ by an ulp from torch).
COMPILE_OPTIONS = {"enable_fp_fusion": False}
# A reduction's combine function (``schedulers.triton_math``), by op.
COMBINE = {"sum": "add", "mean": "add", "max": "maximum", "min": "minimum"}

PRELUDE = """\
import triton
import triton.language as tl
from schedulers.triton_lib import (
    fp4_decode, fp4_encode, fp8e4m3_decode, fp8e4m3_encode, fp8e5m2_decode, fp8e5m2_encode,
)
from schedulers.triton_math import (
    INTERPRETED, add, div, gelu, gelu_tanh, maximum, minimum, reciprocal, round_to_bf16,
    round_to_f16, sigmoid, sigmoid_narrow, sqrt, sum_pair, tanh, widen_bf16,
    widen_bf16_here,
)
from schedulers.triton_random import dropout_key, element_hash
"""


def memory_type(dtype: DataType) -> str:
    """The Triton element type a kernel loads and stores for ``dtype`` (codes as bytes)."""
    if dtype.storage_only:
        return "tl.uint8"
    return TRITON_TYPES[dtype.name]


def pointer_types(inputs: list[TensorView], outputs: list[TensorView]) -> dict[str, str]:
    """The memory type of each input (``in<i>``) and output (``out<i>``) pointer of a
    generated kernel, as ``schedulers.ptx`` compiles it."""
    types = {f"in{i}": memory_type(t.dtype) for i, t in enumerate(inputs)}
    return types | {f"out{i}": memory_type(t.dtype) for i, t in enumerate(outputs)}


def check_supported(exprs: list[Expr]) -> None:
    """Raise ``NotSchedulable`` for an op or cast the code generator does not write."""
    for expr in exprs:
        if isinstance(expr, BinaryOp) and expr.op_name == "pow":
            _, exponent = expr.operands
            if not (isinstance(exponent, (int, float)) and exponent in _POWERS):
                raise NotSchedulable("pow with a tensor or unusual exponent")
        if isinstance(expr, CastOp):
            source, target = expr.inputs[0].dtype, expr.output.dtype
            if source is float64 and target.storage_only:
                raise NotSchedulable(f"a cast from float64 to {target} (rounds in float64)")


# pow with these scalar exponents is written with multiplications and roots.
_POWERS = {0, 1, 2, 3, 0.5, -0.5, -1, -2}


@dataclass
class Value:
    """A value in registers: the variable holding it and the dtype it stands for;
    ``raw``, for a bfloat16 loaded and carried as float32, the variable of its bits as
    loaded (a kernel may widen them again instead of keeping the float32s live:
    ``normalization.codegen.Generator.rematerialize``)."""

    name: str
    dtype: DataType
    raw: str = ""


class NameSupply:
    """The variable names of one kernel: a prefix and a number no other name of the
    kernel has. Every emitter of a kernel (its body, its loops, what goes before them)
    draws from the same supply, so their names never clash."""

    def __init__(self) -> None:
        self._count = 0

    def fresh(self, prefix: str = "v") -> str:
        self._count += 1
        return f"{prefix}{self._count}"


class Emitter:
    """Accumulates lines of one kernel's source (a body, or a block inside it), naming
    its values from ``names`` (a new supply when none is given)."""

    def __init__(self, names: NameSupply | None = None) -> None:
        self.lines: list[str] = []
        self.names = names if names is not None else NameSupply()
        # the variable holding each element's global row-major index (int64), where the
        # kernel knows it: what a dropout mask is drawn from
        self.element_index: str | None = None

    def nested(self) -> Emitter:
        """Another list of lines of the same kernel: a loop's body, or what goes
        before a loop; its names come from the same supply."""
        return Emitter(self.names)

    def fresh(self, prefix: str = "v") -> str:
        return self.names.fresh(prefix)

    def line(self, text: str) -> None:
        self.lines.append(text)

    def exprs(self, exprs: list[Expr], values: dict[TensorView, Value]) -> None:
        """Emit ``exprs`` in order, their operands read from ``values`` (tensors; Python
        scalars are taken as they are) and their results added to it."""
        for expr in exprs:
            operands = [values[o] if isinstance(o, TensorView) else o for o in expr.operands]
            for out, value in zip(expr.outputs, self.expr(expr, operands), strict=True):
                values[out] = value

    def block(self, header: str, body: Emitter) -> None:
        """``header`` (a ``for ...:`` line) and the lines of ``body`` indented under it."""
        self.lines.append(header)
        self.lines.extend(f"    {line}" for line in body.lines)

    def assign(self, expression: str, prefix: str = "v") -> str:
        name = self.fresh(prefix)
        self.line(f"{name} = {expression}")
        return name

    # -- loads and stores ----------------------------------------------------------

    def load(self, tensor: TensorView, pointer: str, index: str, mask: str,
             eviction: str = "") -> Value:  # fmt: skip
        dtype = tensor.dtype
        hint = f", eviction_policy='{eviction}'" if eviction else ""
        if dtype is float4_e2m1:
            byte = self.assign(f"tl.load({pointer} + ({index} >> 1), mask={mask}, other=0{hint})")
            shift = f"(({index} & 1) * 4).to(tl.uint8)"
            return Value(self.assign(f"({byte} >> {shift}) & 15"), dtype)
        return self.loaded(self.load_stored(pointer, index, mask, eviction), dtype)

    def load_stored(self, pointer: str, index: str, mask: str, eviction: str = "") -> str:
        """The name of the values at ``pointer + index`` as they are stored (not widened:
        ``load``'s first step)."""
        hint = f", eviction_policy='{eviction}'" if eviction else ""
        return self.assign(f"tl.load({pointer} + {index}, mask={mask}, other=0{hint})")

    def loaded(self, raw: str, dtype: DataType) -> Value:
        """``raw`` (a tensor loaded as ``dtype`` is stored) in value form: floats carried
        as float32 (float64 and storage-only codes as they are)."""
        if dtype.is_floating and not dtype.storage_only and dtype is not float64:
            return Value(self.assign(f"{raw}.to(tl.float32)"), dtype,
                         raw if dtype is bfloat16 else "")  # fmt: skip
        return Value(raw, dtype)

    def load_tile(self, tensor: TensorView, descriptor: str, offsets: str) -> Value:
        """A tile through a TMA tensor descriptor (rows past the end read as zeros)."""
        dtype = tensor.dtype
        if dtype.storage_only:
            raise ValueError(f"{tensor}: {dtype} codes are not loaded through descriptors")
        return self.loaded(self.assign(f"{descriptor}.load([{offsets}])"), dtype)

    def stored(self, value: Value) -> str:
        """The expression to store for ``value`` (exact: it already has the dtype's value)."""
        if value.dtype.storage_only or value.dtype is bool_:
            return value.name
        return f"{value.name}.to({TRITON_TYPES[value.dtype.name]})"

    # -- conversions ---------------------------------------------------------------

    def as_compute(self, value: Value, target: DataType) -> str:
        """``value`` as an operand of an op computing in ``target`` (a compute type)."""
        source = value.dtype
        if source.storage_only:
            decoded = self.assign(f"{_DECODE[source]}({value.name})")
            return decoded if target is float32 else f"{decoded}.to({TRITON_TYPES[target.name]})"
        carried = float32 if source.is_floating and source is not float64 else source
        if carried is target:
            return value.name
        return f"{value.name}.to({TRITON_TYPES[target.name]})"

    def rounded(self, expression: str, computed: DataType, dtype: DataType) -> Value:
        """``expression`` (in ``computed``) rounded once to ``dtype``, in value form."""
        if dtype is bfloat16:
            source = expression if computed is float32 else f"({expression}).to(tl.float32)"
            return Value(self.assign(f"round_to_bf16({source})"), dtype)
        if dtype is float16:
            source = expression if computed is float32 else f"({expression}).to(tl.float32)"
            return Value(self.assign(f"round_to_f16({source})"), dtype)
        if dtype.storage_only:
            source = expression if computed is float32 else f"({expression}).to(tl.float32)"
            return Value(self.assign(f"{_ENCODE[dtype]}({source})"), dtype)
        if dtype is bool_:
            return Value(self.assign(f"({expression}) != 0"), dtype)
        if computed is dtype:
            return Value(self.assign(expression), dtype)
        return Value(self.assign(f"({expression}).to({TRITON_TYPES[dtype.name]})"), dtype)

    # -- ops -------------------------------------------------------------------------

    def expr(self, expr: Expr, operands: list[Value | Scalar]) -> list[Value]:
        """Emit ``expr`` on ``operands`` (values for tensors, Python scalars as they are)."""
        out = expr.outputs[0]
        if isinstance(expr, (SetOp, DetachOp, BroadcastOp, ExpandOp)):
            return [operands[0]]  # the same values, seen through another shape
        if isinstance(expr, CastOp):
            return [self._cast(operands[0], out.dtype)]
        if isinstance(expr, CompareOp):
            return [self._compare(expr, operands)]
        if isinstance(expr, DropoutMaskOp):
            return [self._dropout_mask(expr, operands[0])]
        ctype = compute_dtype(out.dtype)
        args = [
            self.as_compute(o, ctype) if isinstance(o, Value) else _literal(o, ctype)
            for o in operands
        ]
        if isinstance(expr, UnaryOp):
            # Rounded to 16 bits or fewer, a float32 result needs no IEEE-exact division.
            narrow = ctype is float32 and out.dtype.bits <= 16
            text = self._unary(expr, args[0], ctype, narrow)
        elif isinstance(expr, BinaryOp):
            if expr.op_name == "div" and ctype is float32:  # div takes tensors only
                args = [a if isinstance(o, Value) else f"tl.full((), {a}, tl.float32)"
                        for a, o in zip(args, operands, strict=True)]  # fmt: skip
            text = self._binary(expr.op_name, args[0], args[1], ctype, expr.operands[1])
        elif isinstance(expr, WhereOp):
            condition = operands[0]
            text = f"tl.where({condition.name}, {args[1]}, {args[2]})"
        else:
            raise NotSchedulable(f"{expr.op_name} is not generated")
        return [self.rounded(text, ctype, out.dtype)]

    def _dropout_mask(self, expr: DropoutMaskOp, seed: Value) -> Value:
        """The mask's float32 values: ``1 / (1 - p)`` (rounded to float32, as the
        reference's float32 product rounds it) where the element's hash reaches the
        threshold, else 0; ``seed`` a scalar."""
        if self.element_index is None:
            raise NotSchedulable("dropout_mask: this kernel does not know global indices")
        scale = repr(torch.tensor(keep_scale(expr.p), dtype=torch.float32).item())
        threshold = keep_threshold(expr.p)
        if threshold > 0xFFFFFFFF:  # p = 1: no hash reaches 2^32, nothing is kept
            return Value(self.assign(f"tl.zeros_like({self.element_index}).to(tl.float32)"),
                         float32)  # fmt: skip
        key = self.assign(f"dropout_key({seed.name})", "key")
        hashed = self.assign(f"element_hash({key}, {self.element_index})", "hash")
        kept = f"{hashed} >= tl.full((), {threshold}, tl.uint32)"
        return Value(self.assign(f"tl.where({kept}, {scale}, 0.0)"), float32)

    def _compare(self, expr: CompareOp, operands: list[Value | Scalar]) -> Value:
        """Both operands rounded to the type they are compared in first (as torch: a
        bf16 tensor against 0.1 compares with bf16's 0.1), then compared exactly."""
        dtype = expr.compared_in
        ctype = compute_dtype(dtype)
        sides = []
        for operand in operands:
            if isinstance(operand, Value):
                sides.append(self.as_compute(self._cast(operand, dtype), ctype))
                continue
            rounded = torch.tensor(operand, dtype=dtype.torch_dtype).item()
            # a typed constant: Triton would make a bare float literal a float32 one
            sides.append(f"tl.full([], {_literal(rounded, ctype)}, {TRITON_TYPES[ctype.name]})")
        lhs, rhs = sides
        return Value(self.assign(f"{lhs} {_COMPARISONS[expr.op_name]} {rhs}"), bool_)

    def _cast(self, value: Value, target: DataType) -> Value:
        source = value.dtype
        if source is target:
            return value
        if target.is_floating and not target.storage_only:
            compute = float64 if target is float64 else float32
            if source.storage_only:  # every fp8 and fp4 value is exact in bf16, f16, f32
                return Value(self.as_compute(value, compute), target)
            return self.rounded(self.as_compute(value, compute), compute, target)
        if target.storage_only:
            return self.rounded(self.as_compute(value, float32), float32, target)
        if target is bool_:
            return Value(self.assign(f"{self.as_compute(value, _carrier(source))} != 0"), target)
        # To an integer: floats truncate toward zero, as torch does.
        carrier = self.as_compute(value, _carrier(source))
        return Value(self.assign(f"{carrier}.to({TRITON_TYPES[target.name]})"), target)

    def _unary(self, expr: UnaryOp, a: str, ctype: DataType, narrow: bool = False) -> str:
        name = expr.op_name
        if name == "neg":
            return f"-{a}"
        if name == "abs":
            return f"tl.abs({a})"
        if name == "relu":
            if ctype.is_floating:
                return f"tl.maximum({a}, 0.0, propagate_nan=tl.PropagateNan.ALL)"
            return f"tl.maximum({a}, 0)"
        if name == "exp":
            return f"tl.exp({a})"
        if name == "log":
            return f"tl.log({a})"
        if name == "sqrt":
            return _sqrt(a, ctype)
        if name == "rsqrt":
            return _reciprocal(_sqrt(a, ctype), ctype)
        if name == "reciprocal":
            return _reciprocal(a, ctype)
        if name == "tanh":
            return f"tanh({a})"
        sigmoid = "sigmoid_narrow" if narrow else "sigmoid"
        if name == "sigmoid":
            return f"{sigmoid}({a})"
        if name == "silu":
            return f"{a} * {sigmoid}({a})"
        if name == "erf":
            return f"tl.math.erf({a})"
        if name == "gelu":
            return f"gelu_tanh({a})" if expr.attrs.get("approximate") == "tanh" else f"gelu({a})"
        raise NotSchedulable(f"{name} is not generated")

    def _binary(self, name: str, a: str, b: str, ctype: DataType, exponent: object) -> str:
        if name == "add":
            return f"{a} + {b}"
        if name == "sub":
            return f"{a} - {b}"
        if name == "mul":
            return f"{a} * {b}"
        if name == "div":
            return f"div({a}, {b})" if ctype is float32 else f"{a} / {b}"
        if name in ("maximum", "minimum"):
            nan = ", propagate_nan=tl.PropagateNan.ALL" if ctype.is_floating else ""
            return f"tl.{name}({a}, {b}{nan})"
        if name == "pow":
            return _power(a, exponent, ctype)
        raise NotSchedulable(f"{name} is not generated")


def _carrier(dtype: DataType) -> DataType:
    """The type a value of ``dtype`` travels in (see the module's docstring)."""
    if dtype.storage_only or (dtype.is_floating and dtype is not float64):
        return float32
    return dtype


def _literal(value: Scalar, ctype: DataType) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if ctype.is_floating:
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")):
            return f'float("{number}")'
        return repr(number)
    return str(int(value))


def _power(a: str, exponent: object, ctype: DataType) -> str:
    one = "1.0" if ctype.is_floating else "1"
    if exponent == 0:
        return f"(tl.zeros_like({a}) + {one})"
    if exponent == 1:
        return a
    if exponent == 2:
        return f"{a} * {a}"
    if exponent == 3:
        return f"{a} * {a} * {a}"
    if exponent == 0.5:
        return _sqrt(a, ctype)
    if exponent == -0.5:
        return _reciprocal(_sqrt(a, ctype), ctype)
    if exponent == -1:
        return _reciprocal(a, ctype)
    if exponent == -2:
        return _reciprocal(f"{a} * {a}", ctype)
    raise NotSchedulable(f"pow with exponent {exponent!r}")


def _sqrt(a: str, ctype: DataType) -> str:
    """IEEE square root for float32 (Triton's may be approximate); float64's is exact."""
    return f"sqrt({a})" if ctype is float32 else f"tl.sqrt({a})"


def _reciprocal(a: str, ctype: DataType) -> str:
    """IEEE reciprocal for float32 (see ``triton_math.div``)."""
    return f"reciprocal({a})" if ctype is float32 else f"1.0 / ({a})"


def reduce_call(value: str, axis: int, combine: str, keep_dims: bool = False) -> str:
    """Triton source reducing ``value`` along ``axis`` with ``combine`` ("add",
    "maximum", "minimum"). Sums use ``tl.sum``: the same tree on a GPU as ``tl.reduce``
    with an add, and vectorised in the interpreter, which runs a ``tl.reduce`` with a
    combine function one element at a time. Max and min keep the NaN-propagating
    combine functions."""
    keep = ", keep_dims=True" if keep_dims else ""
    if combine == "add":
        return f"tl.sum({value}, {axis}{keep})"
    return f"tl.reduce({value}, {axis}, {combine}{keep})"


def reduce_terms(
    emit: Emitter, terms: list[tuple[str, str]], axis: int, keep_dims: bool = False
) -> list[str]:
    """Names of the reductions of each ``(value, combine)`` of ``terms`` along ``axis``
    (``reduce_call``'s), emitted into ``emit``: sums two at a time (``sum_pair``: one
    exchange between warps for both)."""
    names: list[str | None] = [None] * len(terms)
    sums = [i for i, (_, combine) in enumerate(terms) if combine == "add"]
    for first, second in zip(sums[::2], sums[1::2], strict=False):
        names[first], names[second] = emit.fresh("v"), emit.fresh("v")
        emit.line(f"{names[first]}, {names[second]} = sum_pair({terms[first][0]}, "
                  f"{terms[second][0]}, {axis}, {keep_dims})")  # fmt: skip
    return [name or emit.assign(reduce_call(value, axis, combine, keep_dims))
            for name, (value, combine) in zip(names, terms, strict=True)]  # fmt: skip


def reduction_identity(op: str, accumulator: DataType) -> str:
    """Triton source for the value a reduction ``op`` starts from (and masks with) when
    it accumulates in ``accumulator``: 0 for sums and means, -inf or the smallest
    integer for max, +inf or the largest for min."""
    if op in ("sum", "mean"):
        return "0" if not accumulator.is_floating else "0.0"
    if accumulator.is_floating:
        return 'float("-inf")' if op == "max" else 'float("inf")'
    info = torch.iinfo(accumulator.torch_dtype)
    return str(info.min if op == "max" else info.max)


def kernel_source(
    name: str,
    pointers: list[str],
    runtime: list[str],
    constants: list[str],
    lines: list[str],
    comment: str = "",
    helpers: list[str] = (),
) -> str:
    """A generated kernel's whole source: the prelude, the ``helpers`` (device functions'
    sources), a ``comment`` line (when given),
    then ``def name(*pointers, *runtime, *constants)`` jitted without specializing on
    the ``runtime`` arguments (extents, strides) and with ``constants`` as
    ``tl.constexpr`` arguments, its body the ``lines``."""
    arguments = [*pointers, *runtime, *(f"{constant}: tl.constexpr" for constant in constants)]
    header = f"@triton.jit(do_not_specialize={runtime!r})\ndef {name}({', '.join(arguments)}):\n"
    body = "".join(f"    {line}\n" for line in lines)
    defined = "".join(f"\n{helper}\n" for helper in helpers)
    return f"{PRELUDE}{defined}\n" + (f"{comment}\n" if comment else "") + header + body
