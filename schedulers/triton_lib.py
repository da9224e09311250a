"""Triton device helpers that convert float32 to and from fp8 (e4m3fn, e5m2) and fp4 (e2m1).

Generated kernels call these instead of ``x.to(tl.float8e4nv)``: Triton's own fp8
conversion differs between the interpreter (which neither rounds to nearest even nor
saturates) and the GPU, so the helpers use only integer bit operations and float
arithmetic that is exact, and give the same codes everywhere. The results match
``fusion.fp8.to_fp8`` and ``fusion.fp4.encode_fp4`` for every float32 input:

- round to nearest, ties to even, once;
- e4m3fn saturates: overflow and ±inf become ±448; NaN becomes 0x7F (0xFF when its
  sign bit is set, as torch does);
- e5m2 follows IEEE: overflow becomes ±inf; NaN becomes 0x7F (0xFF when negative);
- e2m1 saturates to ±6, NaN becomes code 0x7 (+6); negative values that round to zero
  keep their sign (code 0x8).

Encoders take float32 (widen bf16/f16 first, which is exact) and return uint8 codes;
decoders take uint8 codes and return float32. Example, inside a kernel::

    codes = fp8e4m3_encode(tl.load(src + offsets).to(tl.float32))
    tl.store(dst + offsets, codes)

Float32 subnormal inputs lie far below half the smallest subnormal of every target
format, so a GPU that flushes them to zero still gives the same (signed) zero code.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Adding then subtracting 2**23 rounds a float32 in [0, 2**22) to an integer, ties to even,
# because the sum's ulp is 1.
_ROUND_TO_INTEGER: tl.constexpr = tl.constexpr(8388608.0)
_FLOAT32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)
_FLOAT32_QUIET_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
_TWO_TO_126: tl.constexpr = tl.constexpr(2.0**126)


@triton.jit
def _sign_and_magnitude(x):
    """Split float32 ``x`` into its sign (0 or 1) and magnitude bits, both int32."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits >> 31) & 1, bits & 0x7FFFFFFF


@triton.jit
def _round_mantissa(magnitude_bits, DROPPED_BITS: tl.constexpr):
    """Drop the low ``DROPPED_BITS`` bits of a float32 magnitude, rounding to nearest even.

    Adding half an ulp less one, plus the kept lowest bit, carries exactly when the dropped
    bits exceed half or equal half with an odd kept part; a carry into the exponent is the
    right result. The caller passes magnitudes no larger than inf, so the sum fits int32.
    """
    half_ulp_less_one = (1 << (DROPPED_BITS - 1)) - 1
    kept_lowest_bit = (magnitude_bits >> DROPPED_BITS) & 1
    return (magnitude_bits + half_ulp_less_one + kept_lowest_bit) >> DROPPED_BITS


@triton.jit
def _round_subnormal(magnitude_bits, MIN_NORMAL_BITS: tl.constexpr, STEPS_PER_UNIT: tl.constexpr):
    """Round a magnitude below the format's smallest normal to a count of subnormal steps.

    Clamping the bits first keeps the scaled value below 2**22 for every input (inf and NaN
    included) so the magic-number rounding is valid; the clamped lanes are not used.
    Scaling by a power of two is exact, so there is one rounding only.
    """
    clamped = tl.minimum(magnitude_bits, MIN_NORMAL_BITS).to(tl.float32, bitcast=True)
    scaled = clamped * STEPS_PER_UNIT
    return ((scaled + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER).to(tl.int32)


@triton.jit
def _fp8_encode(
    x,
    MANTISSA_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    STEPS_PER_UNIT: tl.constexpr,
):
    """Float32 ``x`` to codes of an fp8 format with ``MANTISSA_BITS`` and exponent ``BIAS``:
    nearest even; magnitudes past ``MAX_CODE`` clamp to it; NaN to 0x7F (with the sign).

    Normals keep ``MANTISSA_BITS`` of float32's 23, and the exponent bias 127 becomes
    ``BIAS``. Below the smallest normal, 2**(1 - BIAS), the code counts subnormal steps of
    1 / ``STEPS_PER_UNIT``; a count of 2**MANTISSA_BITS is the smallest normal's code.
    """
    sign, magnitude_bits = _sign_and_magnitude(x)
    normal = _round_mantissa(tl.minimum(magnitude_bits, _FLOAT32_INF_BITS), 23 - MANTISSA_BITS)
    normal = tl.minimum(normal - ((127 - BIAS) << MANTISSA_BITS), MAX_CODE)
    min_normal_bits: tl.constexpr = (128 - BIAS) << 23
    subnormal = _round_subnormal(magnitude_bits, min_normal_bits, STEPS_PER_UNIT)
    code = tl.where(magnitude_bits < min_normal_bits, subnormal, normal)
    code = tl.where(magnitude_bits > _FLOAT32_INF_BITS, 0x7F, code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def fp8e4m3_encode(x):
    """Float32 ``x`` to float8_e4m3fn codes (uint8): nearest even, saturating to ±448."""
    return _fp8_encode(x, 3, 7, 0x7E, 512.0)


@triton.jit
def _fp8_decode(
    code,
    MANTISSA_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    STEPS_PER_UNIT: tl.constexpr,
    HAS_INF: tl.constexpr,
):
    """Codes (uint8) of an fp8 format with ``MANTISSA_BITS`` and exponent ``BIAS`` to
    float32, exact. Subnormals count steps of 1 / ``STEPS_PER_UNIT``. With ``HAS_INF``
    the all-ones exponent is inf (mantissa 0) or NaN; without, only magnitude 0x7F is
    NaN (e4m3fn has no inf)."""
    code = code.to(tl.int32)
    exponent = (code >> MANTISSA_BITS) & (0x7F >> MANTISSA_BITS)
    mantissa = code & ((1 << MANTISSA_BITS) - 1)
    normal_bits = ((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANTISSA_BITS))
    subnormal = mantissa.to(tl.float32) * (1.0 / STEPS_PER_UNIT)
    magnitude_bits = tl.where(exponent == 0, subnormal.to(tl.int32, bitcast=True), normal_bits)
    if HAS_INF:
        special_bits = tl.where(mantissa == 0, _FLOAT32_INF_BITS, _FLOAT32_QUIET_NAN_BITS)
        magnitude_bits = tl.where(exponent == (0x7F >> MANTISSA_BITS), special_bits,
                                  magnitude_bits)  # fmt: skip
    else:
        magnitude_bits = tl.where((code & 0x7F) == 0x7F, _FLOAT32_QUIET_NAN_BITS,
                                  magnitude_bits)  # fmt: skip
    return (magnitude_bits | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3_decode(code):
    """Float8_e4m3fn codes (uint8) to float32, exact; 0x7F and 0xFF are NaN."""
    return _fp8_decode(code, 3, 7, 512.0, False)


@triton.jit
def fp8e5m2_encode(x):
    """Float32 ``x`` to float8_e5m2 codes (uint8): nearest even, overflow to ±inf (0x7C)."""
    return _fp8_encode(x, 2, 15, 0x7C, 65536.0)


@triton.jit
def fp8e5m2_decode(code):
    """Float8_e5m2 codes (uint8) to float32, exact; exponent 31 is inf or NaN."""
    return _fp8_decode(code, 2, 15, 65536.0, True)


@triton.jit
def fp4_encode(x):
    """Float32 ``x`` to e2m1 codes 0..15 (uint8): nearest even, saturating to ±6, NaN to 0x7.

    Same codes as ``fusion.fp4.encode_fp4``. The rounding add carries every dropped bit,
    so a magnitude just above a midpoint (0.25 + ulp, say) rounds up.
    """
    sign, magnitude_bits = _sign_and_magnitude(x)
    # Magnitudes of 1 and above: keep 1 mantissa bit; exponent bias 127 becomes 1.
    normal = _round_mantissa(tl.minimum(magnitude_bits, _FLOAT32_INF_BITS), 22) - (126 << 1)
    normal = tl.minimum(normal, 0x7)
    # Below 1: steps of 0.5; a count of 2 is the code of 1.0.
    subnormal = _round_subnormal(magnitude_bits, 127 << 23, 2.0)
    code = tl.where(magnitude_bits < (127 << 23), subnormal, normal) | (sign << 3)
    code = tl.where(magnitude_bits > _FLOAT32_INF_BITS, 0x7, code)
    return code.to(tl.uint8)


@triton.jit
def fp4_decode(code):
    """E2m1 codes 0..15 (uint8) to float32, exact (code 8 is -0.0).

    The three magnitude bits, placed at the top of a float32's exponent and mantissa,
    read as 2**(e - 127) * (1 + m/2), or 2**-126 * m/2 when e == 0 (a subnormal);
    times 2**126 that is e2m1's value in both cases, exactly. Six integer and float
    operations an element: decoding is on the critical path of fp4 -> bf16 at memory
    speed. (Needs subnormals kept, which Triton's float32 multiply does: no ``.ftz``.)
    """
    code = code.to(tl.int32)
    magnitude = ((code & 0x7) << 22).to(tl.float32, bitcast=True) * _TWO_TO_126
    return (magnitude.to(tl.int32, bitcast=True) | ((code & 0x8) << 28)).to(
        tl.float32, bitcast=True
    )


@triton.jit
def fp4_pack(lo, hi):
    """Two e2m1 codes into one byte (uint8), ``lo`` in the low nibble as float4_e2m1fn_x2."""
    return ((lo.to(tl.int32) & 0xF) | ((hi.to(tl.int32) & 0xF) << 4)).to(tl.uint8)


@triton.jit
def fp4_unpack(byte):
    """One byte to its two e2m1 codes (uint8): ``(lo, hi)``, the low nibble first."""
    byte = byte.to(tl.int32)
    return (byte & 0xF).to(tl.uint8), ((byte >> 4) & 0xF).to(tl.uint8)
