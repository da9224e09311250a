"""Device helpers for generated kernels that behave the same in Triton's CPU interpreter
and on a GPU.

The interpreter truncates float32 to bfloat16 instead of rounding, and it has no
libdevice; so in the interpreter rounding to bf16 is done with integer operations
(on a GPU the conversion instruction rounds to nearest even itself, in one
instruction instead of eight), and tanh, division and square roots use only what
both support (``div_rn`` and ``sqrt_rn`` are the IEEE-exact forms, as torch computes
them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from schedulers.runtime import interpreted

# Read when this module is imported: set TRITON_INTERPRET before importing it.
INTERPRETED: tl.constexpr = tl.constexpr(interpreted())


@triton.jit
def round_to_bf16(x):
    """A float32 rounded to the nearest bfloat16 (ties to even), kept as float32."""
    if INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        rounded = tl.where(x != x, bits | 0x00400000, rounded)  # keep NaN a (quiet) NaN
        return rounded.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def widen_bf16(x):
    """A bfloat16 as float32 from its bits (exact, as ``x.to(tl.float32)``): a kernel
    that widens a loaded value again where it is used late, instead of keeping the
    first float32s live, writes this so the compiler does not merge the two."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def widen_bf16_here(x):
    """``widen_bf16`` where it is written: the compiler does not move it out of a loop
    (on a GPU, an instruction it must keep in place), so a loop-invariant bfloat16
    kept as its bits across the loop is widened at each use, not once into float32s
    live across the whole loop."""
    if INTERPRETED:
        return widen_bf16(x)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 z; mov.b16 z, 0; mov.b32 $0, {z, $1}; }", "=r,h",
            [x.to(tl.uint16, bitcast=True)], dtype=tl.float32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def round_to_f16(x):
    """A float32 rounded to the nearest float16 (ties to even), kept as float32."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def div(x, y):
    """IEEE division (Triton's ``/`` on float32 may be approximate on GPU; on float64 it
    is exact) of two tensors, either of them a scalar (0-d) one."""
    x, y = tl.broadcast(x, y)
    if x.dtype == tl.float32:
        return tl.math.div_rn(x, y)
    return x / y


@triton.jit
def reciprocal(x):
    return div(tl.full(x.shape, 1.0, x.dtype), x)


@triton.jit
def sqrt(x):
    return tl.sqrt_rn(x)


@triton.jit
def sigmoid(x):
    return reciprocal(1.0 + tl.exp(-x))


@triton.jit
def sigmoid_narrow(x):
    """sigmoid of a float32 whose result is rounded to 16 bits or fewer: hardware
    approximations of 2**x and 1/x (within 2 float32 ulps each, 2**-22, far below a
    bf16 or f16 ulp) instead of IEEE division; subnormal results flush to zero."""
    if INTERPRETED:
        return sigmoid(x)
    else:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def tanh(x):
    """tanh within about a float32 ulp: its Taylor series below 0.55 (through x**17, the
    next term is under 1e-8 relative there), exp beyond (where 1 - e no longer cancels)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    far = div(1.0 - e, 1.0 + e)
    if x.dtype == tl.float64:  # near zero, exp's error is far below float64 tolerances
        return tl.where(x < 0, -far, far)
    s = a * a
    series = 6404582.0 / 10854718875.0
    series = series * s - 929569.0 / 638512875.0
    series = series * s + 21844.0 / 6081075.0
    series = series * s - 1382.0 / 155925.0
    series = series * s + 62.0 / 2835.0
    series = series * s - 17.0 / 315.0
    series = series * s + 2.0 / 15.0
    series = series * s - 1.0 / 3.0
    near = a + a * s * series
    magnitude = tl.where(a < 0.55, near, far)
    return tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner))


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def maximum(a, b):
    """max that propagates NaN, as torch.amax does."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def minimum(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def sum_pair(a, b, axis: tl.constexpr, keep_dims: tl.constexpr):
    """Two sums along ``axis`` in one reduction: on a GPU one exchange between warps
    (a round through shared memory and its barriers) instead of two, each sum the same
    tree as ``tl.sum``'s; the interpreter sums each (it runs a ``tl.reduce`` with a
    combine function one element at a time)."""
    if INTERPRETED:
        return tl.sum(a, axis, keep_dims=keep_dims), tl.sum(b, axis, keep_dims=keep_dims)
    else:
        return tl.reduce((a, b), axis, _add_pairs, keep_dims=keep_dims)
