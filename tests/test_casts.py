"""Casts between every pair of IR dtypes through a fusion.

Without fp4 the expectation is torch's own ``.to()``, compared bit for bit (fp8 as
bytes), except for the two fp8 rules ``fusion.fp8`` fixes whatever the torch version:
e4m3fn saturates to ±448 (torch 2.11 gives NaN) and a float64 source rounds once (torch
rounds through float32). fp8 special values are also checked against bytes written out by
hand, and all
256 fp8 bit patterns against a decoder written from the formats. Pairs with fp4 go
through the independent oracle in ``fp4_oracle``. Float-to-integer casts of NaN,
infinities and out-of-range values are unspecified, so those inputs are left out there.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp4_oracle import decoded, expected_codes, pack, unpack

from fusion import FusionDefinition
from fusion.dtypes import ALL_DTYPES, DataType, float4_e2m1

INF, NAN = float("inf"), float("nan")
FLOAT_CANDIDATES = [
    0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -2.75, 3.0, 5.0, 7.0, 100.3, -100.7, 127.0,
    -128.0, 200.0, 255.0, 255.9, 1e4, -3e4, 65504.0, 1e6, 2.0**31, 1e30, -1e30, 1e-3,
    -1e-8, 1e-40, 1e-300, INF, -INF, NAN,
]  # fmt: skip
INT_CANDIDATES = [
    0, 1, -1, 2, 3, 5, 7, 100, -100, 127, -128, 200, 255, 1000, -30000, 65504, 70000,
    2**31 - 1, -(2**31), 2**53 + 1, -(2**62),
]  # fmt: skip
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _ids(values):
    return [str(v).removeprefix("torch.") for v in values]


def _cast(values: torch.Tensor, source: DataType, target: DataType) -> torch.Tensor:
    with FusionDefinition() as fd:
        x = fd.define_tensor(
            list(values.shape[:-1]) + [values.shape[-1] * (1 + source.is_packed)], source
        )
        fd.add_output(fd.ops.cast(x, target))
    (out,) = fd.execute([values])
    assert out.dtype == target.to_torch(), f"cast to {target} returned {out.dtype}"
    return out


def _bits(values: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.itemsize]
    return values.view(width)


def _assert_identical(actual: torch.Tensor, expected: torch.Tensor, source: torch.Tensor):
    """Same dtype, shape and bits; a NaN may be any NaN, but only where NaN is expected."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype.is_floating_point:
        actual_nan = torch.isnan(actual.to(torch.float32))
        expected_nan = torch.isnan(expected.to(torch.float32))
        same = (_bits(actual) == _bits(expected)) | (actual_nan & expected_nan)
    else:
        same = actual == expected
    wrong = (~same).nonzero().flatten().tolist()
    assert not wrong, [
        f"{source[i].item()!r} -> {actual[i].item()!r}, expected {expected[i].item()!r}"
        for i in wrong[:5]
    ]


def _meaningful(value: float, target: DataType) -> bool:
    """Whether a cast of ``value`` to ``target`` has a specified result."""
    if not target.is_integer:
        return True
    info = torch.iinfo(target.to_torch())
    return math.isfinite(value) and info.min <= math.trunc(value) <= info.max


def _source_values(source: DataType, target: DataType) -> torch.Tensor:
    """A 1-D tensor of ``source`` values, with an even count so fp4 can hold it."""
    if source.is_bool:
        values = torch.tensor([True, False, True, True], dtype=torch.bool)
    elif source is float4_e2m1:
        values = torch.arange(16, dtype=torch.uint8)  # codes, packed below
    elif source.is_floating:
        values = torch.tensor(FLOAT_CANDIDATES, dtype=torch.float64).to(source.to_torch())
    else:
        info = torch.iinfo(source.to_torch())
        in_range = [v for v in INT_CANDIDATES if info.min <= v <= info.max]
        values = torch.tensor(in_range, dtype=torch.int64).to(source.to_torch())
    as_float = decoded(values) if source is float4_e2m1 else values.to(torch.float64)
    keep = torch.tensor([_meaningful(v, target) for v in as_float.tolist()])
    values = values[keep]
    if len(values) % 2:
        values = torch.cat([values, values[:1]])
    return values


@pytest.mark.parametrize("target", ALL_DTYPES, ids=_ids(ALL_DTYPES))
@pytest.mark.parametrize("source", ALL_DTYPES, ids=_ids(ALL_DTYPES))
def test_cast_between_every_pair_of_dtypes(source, target):
    values = _source_values(source, target)
    assert len(values) >= 4
    if source is float4_e2m1:
        out = _cast(pack(values), source, target)
        if target is float4_e2m1:
            assert torch.equal(unpack(out), values)
        else:  # every fp4 value is exact in every float type; integers truncate
            _assert_identical(out, decoded(values).to(target.to_torch()), values)
    elif target is float4_e2m1:
        out = _cast(values, source, target)
        assert list(out.shape) == [len(values) // 2]
        expected = expected_codes(values.to(torch.float64))
        assert unpack(out).tolist() == expected.tolist(), values.tolist()
    else:
        out = _cast(values, source, target)
        _assert_identical(out, _torch_cast(values, target.to_torch()), values)


def _torch_cast(values: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """torch's conversion, with e4m3fn overflow saturating (``fusion.fp8``'s rule)."""
    if target == torch.float8_e4m3fn and values.dtype.is_floating_point and values.itemsize > 1:
        values = values.clamp(-448.0, 448.0)
    return values.to(target)


# ---------------------------------------------------------------------------
# fp8 special values

FP8_SPECIALS = [
    448.0, -448.0, 57344.0, -57344.0,  # the largest finite values
    449.0, 464.0, 480.0, 500.0, 1e4, 6e4, 61440.0, 1e6,  # above one max or the other
    INF, -INF, NAN, 0.0, -0.0,
    2.0**-6, 2.0**-9, 2.0**-10, 3 * 2.0**-10,  # e4m3fn: min normal, subnormals, halfway
    2.0**-14, 2.0**-16, 2.0**-17, 3 * 2.0**-17,  # e5m2: min normal, subnormals, halfway
    1 + 1 / 16, 1 + 3 / 16, 1 + 1 / 8, 1 + 3 / 8,  # halfway between codes near 1
    1 + 1 / 16 + 2.0**-20, 1 + 1 / 16 - 2.0**-20, -(1 + 3 / 8 + 2.0**-12),
]  # fmt: skip
FLOAT_SOURCES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("target", FP8, ids=_ids(FP8))
@pytest.mark.parametrize("source", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_fp8_special_values_agree_with_torch_bitwise(source, target):
    values = torch.tensor(FP8_SPECIALS, dtype=torch.float64).to(source)
    out = _cast(values, DataType.from_torch(source), DataType.from_torch(target))
    expected = _torch_cast(values, target)
    assert out.view(torch.uint8).tolist() == expected.view(torch.uint8).tolist()


# Round to nearest even, written out by hand from the formats (float32 sources).
E4M3FN_BYTES = {
    448.0: 0x7E, -448.0: 0xFE, 464.0: 0x7E, 1.0: 0x38, 1 + 1 / 16: 0x38, 1 + 3 / 16: 0x3A,
    1 + 1 / 16 + 2.0**-20: 0x39, 2.0**-6: 0x08, 2.0**-9: 0x01, 2.0**-10: 0x00,
    3 * 2.0**-10: 0x02, -0.0: 0x80,
    480.0: 0x7E, 1e6: 0x7E, INF: 0x7E, -INF: 0xFE, -1e30: 0xFE,  # overflow saturates
}  # fmt: skip
E5M2_BYTES = {
    57344.0: 0x7B, -57344.0: 0xFB, 61440.0: 0x7C, INF: 0x7C, -INF: 0xFC, 1.0: 0x3C,
    1 + 1 / 8: 0x3C, 1 + 3 / 8: 0x3E, 2.0**-14: 0x04, 2.0**-16: 0x01, 2.0**-17: 0x00,
    3 * 2.0**-17: 0x02, -0.0: 0x80,
    1e6: 0x7C, -1e30: 0xFC,  # overflow is infinite
}  # fmt: skip


@pytest.mark.parametrize(
    ("target", "table"),
    [(torch.float8_e4m3fn, E4M3FN_BYTES), (torch.float8_e5m2, E5M2_BYTES)],
    ids=_ids(FP8),
)
def test_fp8_rounding_gives_the_hand_computed_bytes(target, table):
    values = torch.tensor(list(table), dtype=torch.float32)
    out = _cast(values, DataType.from_torch(torch.float32), DataType.from_torch(target))
    assert [hex(b) for b in out.view(torch.uint8).tolist()] == [hex(b) for b in table.values()]


# float64 values a hair off an fp8 midpoint, closer than float32 can tell: rounding through
# float32 would land on the midpoint and round to even; one correct rounding does not.
FLOAT64_NEAR_MIDPOINTS = {
    torch.float8_e4m3fn: {
        1 + 1 / 16 + 2.0**-40: 0x39, 1 + 1 / 16 - 2.0**-40: 0x38,
        -(1 + 3 / 16 - 2.0**-40): 0xB9, 2.0**-10 + 2.0**-60: 0x01,
    },
    torch.float8_e5m2: {
        1 + 1 / 8 + 2.0**-40: 0x3D, 1 + 1 / 8 - 2.0**-40: 0x3C,
        -(1 + 3 / 8 + 2.0**-45): 0xBE, 2.0**-17 + 2.0**-60: 0x01,
    },
}  # fmt: skip


@pytest.mark.parametrize("target", FP8, ids=_ids(FP8))
def test_fp8_from_float64_rounds_once(target):
    table = FLOAT64_NEAR_MIDPOINTS[target]
    values = torch.tensor(list(table), dtype=torch.float64)
    out = _cast(values, DataType.from_torch(torch.float64), DataType.from_torch(target))
    assert [hex(b) for b in out.view(torch.uint8).tolist()] == [hex(b) for b in table.values()]


@pytest.mark.parametrize("target", FP8, ids=_ids(FP8))
def test_nan_to_fp8_is_nan(target):
    values = torch.tensor([NAN, 1.0], dtype=torch.float32)
    out = _cast(values, DataType.from_torch(torch.float32), DataType.from_torch(target))
    assert torch.isnan(out.to(torch.float32)).tolist() == [True, False]


# ---------------------------------------------------------------------------
# Every fp8 bit pattern decoded


def _fp8_value(byte: int, exponent_bits: int, finite_only: bool) -> float:
    """The value of an fp8 byte from its fields (e4m3fn: finite_only, e5m2: IEEE-like)."""
    mantissa_bits = 7 - exponent_bits
    bias = 2 ** (exponent_bits - 1) - 1
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> mantissa_bits) & (2**exponent_bits - 1)
    mantissa = byte & (2**mantissa_bits - 1)
    top_exponent = exponent == 2**exponent_bits - 1
    if finite_only and top_exponent and mantissa == 2**mantissa_bits - 1:
        return NAN
    if not finite_only and top_exponent:
        return sign * INF if mantissa == 0 else NAN
    if exponent == 0:
        return sign * 2.0 ** (1 - bias) * mantissa / 2**mantissa_bits
    return sign * 2.0 ** (exponent - bias) * (1 + mantissa / 2**mantissa_bits)


FP8_FORMATS = {torch.float8_e4m3fn: (4, True), torch.float8_e5m2: (5, False)}
DECODE_TARGETS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("target", DECODE_TARGETS, ids=_ids(DECODE_TARGETS))
@pytest.mark.parametrize("source", FP8, ids=_ids(FP8))
def test_every_fp8_bit_pattern_decodes_like_torch_and_the_format(source, target):
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(source)
    out = _cast(every_byte, DataType.from_torch(source), DataType.from_torch(target))
    _assert_identical(out, every_byte.to(target), every_byte.view(torch.uint8))
    exponent_bits, finite_only = FP8_FORMATS[source]
    formula = torch.tensor(
        [_fp8_value(byte, exponent_bits, finite_only) for byte in range(256)], dtype=torch.float64
    )
    _assert_identical(out, formula.to(target), every_byte.view(torch.uint8))


def test_the_fp8_decoder_agrees_with_the_formats_landmarks():
    assert _fp8_value(0x7E, 4, True) == 448.0
    assert math.isnan(_fp8_value(0x7F, 4, True))
    assert _fp8_value(0x01, 4, True) == 2.0**-9
    assert _fp8_value(0x7B, 5, False) == 57344.0
    assert _fp8_value(0xFC, 5, False) == -INF
    assert _fp8_value(0x01, 5, False) == 2.0**-16


# ---------------------------------------------------------------------------
# Casts keep the shape (fp4 packs the innermost axis)


@pytest.mark.parametrize("shape", [[7, 1000], [1, 1, 2], [3, 7, 8]], ids=str)
def test_cast_keeps_the_logical_shape_and_fp4_halves_the_innermost_storage(shape):
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    bf16 = _cast(values, DataType.from_torch(torch.float32), DataType.bfloat16)
    assert list(bf16.shape) == shape
    fp4 = _cast(bf16, DataType.bfloat16, float4_e2m1)
    assert list(fp4.shape) == shape[:-1] + [shape[-1] // 2]
    assert torch.equal(unpack(fp4), expected_codes(bf16))
    back = _cast(fp4, float4_e2m1, DataType.float16)
    assert list(back.shape) == shape
    assert torch.equal(back, decoded(expected_codes(bf16)).to(torch.float16))
