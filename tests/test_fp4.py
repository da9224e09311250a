"""fp4 (e2m1): every code, every rounding midpoint and its neighbours, saturation, NaN, signed
zero, packing, and the cast through the IR, all against the independent oracle in
``fp4_oracle`` (brute-force nearest code, written from the format, not from ``fusion.fp4``).
"""

from __future__ import annotations

import pytest
import torch
from fp4_oracle import CODE_VALUES, decoded, e2m1_value, expected_codes, pack, unpack

from fusion import FusionDefinition, as_dtype
from fusion.dtypes import float4_e2m1
from fusion.fp4 import decode_fp4, encode_fp4, from_fp4, pack_fp4, to_fp4, unpack_fp4

FLOAT_SOURCES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# Midpoint i lies between magnitude codes i and i + 1; written out by hand.
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
# The code a midpoint rounds to: of codes i and i + 1, the one with mantissa bit 0.
MIDPOINT_CODES = [0, 2, 2, 4, 4, 6, 6]
ALL_CODES = torch.arange(16, dtype=torch.uint8)


def _ids(values):
    return [str(v).removeprefix("torch.") for v in values]


def _assert_codes_equal(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor):
    """Exact code equality; on failure, names the first inputs that encoded wrongly."""
    assert actual.dtype == torch.uint8 and actual.shape == expected.shape
    wrong = (actual != expected).nonzero()
    if len(wrong):
        samples = [
            f"{inputs[tuple(i)].item()!r}: got {actual[tuple(i)].item():#x}, "
            f"expected {expected[tuple(i)].item():#x}"
            for i in wrong[:5].tolist()
        ]
        raise AssertionError(f"{len(wrong)} of {actual.numel()} codes wrong, e.g. {samples}")


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so -0.0 and 0.0 differ."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.itemsize]
    return values.view(width)


def _next_up(values: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(values, torch.full_like(values, float("inf")))


def _next_down(values: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(values, torch.full_like(values, float("-inf")))


# ---------------------------------------------------------------------------
# The oracle agrees with the format's table


def test_oracle_decodes_the_e2m1_table():
    assert CODE_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert CODE_VALUES[8:] == (-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    assert str(e2m1_value(8)) == "-0.0"


# ---------------------------------------------------------------------------
# Decoding and encoding the 16 codes


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_every_code_decodes_to_its_value(dtype):
    values = decode_fp4(ALL_CODES, dtype)
    assert values.dtype == dtype
    expected = torch.tensor(CODE_VALUES, dtype=torch.float64).to(dtype)
    assert torch.equal(_bits(values), _bits(expected))  # code 8 is -0.0, not 0.0


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_every_code_value_encodes_back_to_its_code(dtype):
    values = torch.tensor(CODE_VALUES, dtype=dtype)
    assert encode_fp4(values).tolist() == list(range(16))


# ---------------------------------------------------------------------------
# Rounding at and around every midpoint


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_every_midpoint_rounds_to_the_even_code(dtype):
    midpoints = torch.tensor(MIDPOINTS, dtype=dtype)
    assert encode_fp4(midpoints).tolist() == MIDPOINT_CODES
    assert encode_fp4(-midpoints).tolist() == [code | 0x8 for code in MIDPOINT_CODES]


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_the_value_just_above_a_midpoint_rounds_up(dtype):
    above = _next_up(torch.tensor(MIDPOINTS, dtype=dtype))  # one ulp of dtype above
    assert (above > torch.tensor(MIDPOINTS, dtype=dtype)).all()
    upper_codes = [index + 1 for index in range(len(MIDPOINTS))]
    assert encode_fp4(above).tolist() == upper_codes
    assert encode_fp4(-above).tolist() == [code | 0x8 for code in upper_codes]


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_the_value_just_below_a_midpoint_rounds_down(dtype):
    below = _next_down(torch.tensor(MIDPOINTS, dtype=dtype))
    assert (below < torch.tensor(MIDPOINTS, dtype=dtype)).all()
    lower_codes = list(range(len(MIDPOINTS)))
    assert encode_fp4(below).tolist() == lower_codes
    assert encode_fp4(-below).tolist() == [code | 0x8 for code in lower_codes]


def test_float64_rounds_once_not_through_float32():
    # Above or below each midpoint by less than float32 resolution: rounding through
    # float32 first would land exactly on the midpoint and then on the even code.
    midpoints = torch.tensor(MIDPOINTS, dtype=torch.float64)
    above = midpoints * (1 + 2.0**-40)
    below = midpoints * (1 - 2.0**-40)
    assert torch.equal(above.to(torch.float32).to(torch.float64), midpoints)
    assert torch.equal(below.to(torch.float32).to(torch.float64), midpoints)
    assert encode_fp4(above).tolist() == [index + 1 for index in range(len(MIDPOINTS))]
    assert encode_fp4(below).tolist() == list(range(len(MIDPOINTS)))
    assert encode_fp4(torch.tensor([0.25 + 2.0**-40], dtype=torch.float64)).tolist() == [1]


# ---------------------------------------------------------------------------
# Saturation, NaN and signed zero


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_magnitudes_from_six_up_saturate_to_six(dtype):
    six = torch.tensor([6.0], dtype=dtype)
    large = torch.cat(
        [
            six,
            _next_up(six),
            torch.tensor([7.0, 6.5, 100.0, 1e4, 1e30], dtype=dtype),  # 1e30 is inf in f16
            torch.tensor([torch.finfo(dtype).max, float("inf")], dtype=dtype),
        ]
    )
    assert encode_fp4(large).tolist() == [0x7] * len(large)
    assert encode_fp4(-large).tolist() == [0xF] * len(large)


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_nan_becomes_plus_six_whatever_its_sign_bit(dtype):
    nan = torch.tensor([float("nan")], dtype=dtype)
    sign_bit = _bits(torch.tensor([-0.0], dtype=dtype))
    negative_nan = (_bits(nan) | sign_bit).view(dtype)  # -nan may drop the sign (bf16 does)
    assert torch.isnan(negative_nan).item()
    assert torch.signbit(negative_nan).item()
    assert encode_fp4(nan).tolist() == [0x7]
    assert encode_fp4(negative_nan).tolist() == [0x7]


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_zero_keeps_its_sign_and_tiny_negatives_become_minus_zero(dtype):
    smallest_subnormal = _next_up(torch.zeros(1, dtype=dtype))
    tiny = torch.cat(
        [
            torch.zeros(1, dtype=dtype),
            smallest_subnormal,
            torch.tensor([torch.finfo(dtype).tiny, 1e-3, 0.2, 0.25], dtype=dtype),
        ]
    )
    assert encode_fp4(tiny).tolist() == [0x0] * len(tiny)
    assert encode_fp4(-tiny).tolist() == [0x8] * len(tiny)


# ---------------------------------------------------------------------------
# Dense and exhaustive comparisons with the oracle


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_random_values_in_minus_eight_to_eight_match_the_oracle(dtype):
    generator = torch.Generator().manual_seed(1)
    values = (torch.rand(200_000, generator=generator, dtype=torch.float64) * 16 - 8).to(dtype)
    _assert_codes_equal(encode_fp4(values), expected_codes(values), values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_every_16_bit_pattern_matches_the_oracle(dtype):
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    _assert_codes_equal(encode_fp4(values), expected_codes(values), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_random_bit_patterns_match_the_oracle(dtype):
    # Random bytes reach every exponent: subnormals, huge values, infinities and NaNs.
    generator = torch.Generator().manual_seed(2)
    count = 200_000
    raw = torch.randint(0, 256, (count * dtype.itemsize,), generator=generator, dtype=torch.uint8)
    values = raw.view(dtype)
    _assert_codes_equal(encode_fp4(values), expected_codes(values), values)


def test_values_clustered_around_the_midpoints_match_the_oracle():
    # A few float32 ulps either side of every midpoint and code value, in float32 and float64.
    generator = torch.Generator().manual_seed(3)
    centers = torch.tensor(MIDPOINTS + list(CODE_VALUES), dtype=torch.float64).repeat(2000)
    for dtype in (torch.float32, torch.float64):
        ulps = torch.randint(-8, 9, centers.shape, generator=generator).to(torch.float64)
        step = 2.0**-24 if dtype == torch.float32 else 2.0**-53
        values = (centers * (1 + ulps * step)).to(dtype)
        _assert_codes_equal(encode_fp4(values), expected_codes(values), values)


# ---------------------------------------------------------------------------
# Packing: two codes per byte, low nibble first


def test_a_hand_built_byte_packs_the_first_code_in_the_low_nibble():
    packed = pack_fp4(torch.tensor([1, 2], dtype=torch.uint8))
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8).tolist() == [0x21]
    assert unpack_fp4(packed).tolist() == [1, 2]
    assert to_fp4(torch.tensor([0.5, 1.0])).view(torch.uint8).tolist() == [0x21]
    assert to_fp4(torch.tensor([-6.0, 0.0])).view(torch.uint8).tolist() == [0x0F]
    two_bytes = torch.tensor([0x21, 0xF0], dtype=torch.uint8)
    assert from_fp4(two_bytes).tolist() == [0.5, 1.0, 0.0, -6.0]


def test_every_byte_unpacks_to_its_two_nibbles_and_packs_back():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = unpack_fp4(every_byte.view(torch.float4_e2m1fn_x2))
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [nibble for b in range(256) for nibble in (b & 0xF, b >> 4)]
    assert torch.equal(pack_fp4(codes).view(torch.uint8), every_byte)


@pytest.mark.parametrize("shape", [[2], [7, 1000], [3, 5, 2], [1, 8]])
def test_pack_matches_the_oracle_layout_and_halves_the_innermost_extent(shape):
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, shape, generator=generator, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert list(packed.shape) == shape[:-1] + [shape[-1] // 2]
    assert torch.equal(packed.view(torch.uint8), pack(codes).view(torch.uint8))
    assert torch.equal(unpack_fp4(packed), codes)


@pytest.mark.parametrize("dtype", FLOAT_SOURCES, ids=_ids(FLOAT_SOURCES))
def test_to_fp4_then_from_fp4_rounds_each_value_to_its_nearest_code(dtype):
    generator = torch.Generator().manual_seed(5)
    values = (torch.randn(6, 64, generator=generator, dtype=torch.float64) * 3).to(dtype)
    packed = to_fp4(values)
    assert packed.dtype == torch.float4_e2m1fn_x2 and list(packed.shape) == [6, 32]
    assert torch.equal(unpack(packed), expected_codes(values))
    round_trip = from_fp4(packed, dtype)
    assert round_trip.dtype == dtype and list(round_trip.shape) == [6, 64]
    assert torch.equal(_bits(round_trip), _bits(decoded(expected_codes(values)).to(dtype)))


def test_from_fp4_of_to_fp4_is_the_identity_on_code_values():
    values = torch.tensor(CODE_VALUES, dtype=torch.float32)
    assert torch.equal(_bits(from_fp4(to_fp4(values))), _bits(values))


@pytest.mark.parametrize("shape", [[1], [7], [4, 3]])
def test_packing_an_odd_innermost_extent_is_refused(shape):
    with pytest.raises(ValueError, match=rf"innermost extent must be even, got shape \({shape[0]}"):
        pack_fp4(torch.zeros(shape, dtype=torch.uint8))


def test_packing_a_0_dim_tensor_is_refused():
    with pytest.raises(ValueError, match="innermost extent must be even"):
        pack_fp4(torch.zeros((), dtype=torch.uint8))


# ---------------------------------------------------------------------------
# Through the IR: cast to fp4 and from fp4


def _cast_fusion(shape, source, target):
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, source)
        fd.add_output(fd.ops.cast(x, target))
    return fd


def _source_values(dtype: torch.dtype, shape, generator) -> torch.Tensor:
    if dtype.is_floating_point:
        values = torch.rand(shape, generator=generator, dtype=torch.float64) * 16 - 8
        flat = values.view(-1)
        specials = MIDPOINTS + [-m for m in MIDPOINTS] + [-0.0, 6.5, -1e4, float("inf")]
        specials += [float("-inf"), float("nan")]
        count = min(len(specials), flat.numel())
        flat[:count] = torch.tensor(specials[:count], dtype=torch.float64)
        return values.to(dtype)
    info = torch.iinfo(dtype)
    values = torch.randint(-10, 11, shape, generator=generator, dtype=torch.int64)
    flat = values.view(-1)
    specials = [info.min, info.max, -5, 5]  # 5 is a midpoint: it rounds to 4
    count = min(len(specials), flat.numel())
    flat[:count] = torch.tensor(specials[:count])
    return values.to(dtype)


INT_SOURCES = [torch.int32, torch.int8]


@pytest.mark.parametrize("shape", [[7, 1000], [3, 5, 2], [2]], ids=str)
@pytest.mark.parametrize(
    "source", FLOAT_SOURCES + INT_SOURCES, ids=_ids(FLOAT_SOURCES + INT_SOURCES)
)
def test_cast_to_fp4_through_the_ir_matches_the_oracle(source, shape):
    generator = torch.Generator().manual_seed(6)
    values = _source_values(source, shape, generator)
    (out,) = _cast_fusion(shape, source, float4_e2m1).execute([values])
    assert out.dtype == torch.float4_e2m1fn_x2
    assert list(out.shape) == shape[:-1] + [shape[-1] // 2]
    _assert_codes_equal(unpack(out), expected_codes(values), values)


def test_cast_from_float64_to_fp4_through_the_ir_rounds_once():
    values = torch.tensor(
        [0.25 + 2.0**-40, 5.0 - 2.0**-40, 1.75 + 2.0**-40, -2.5 - 2.0**-40], dtype=torch.float64
    )
    (out,) = _cast_fusion([4], "float64", float4_e2m1).execute([values])
    assert unpack(out).tolist() == [0x1, 0x6, 0x4, 0xD]


FROM_FP4_TARGETS = [
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int32,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("shape", [[7, 1000], [3, 5, 2], [16]], ids=str)
@pytest.mark.parametrize("target", FROM_FP4_TARGETS, ids=_ids(FROM_FP4_TARGETS))
def test_cast_from_fp4_through_the_ir_gives_the_code_values(target, shape):
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, shape, generator=generator, dtype=torch.uint8)
    codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)[: codes.numel()]
    (out,) = _cast_fusion(shape, float4_e2m1, as_dtype(target)).execute([pack(codes)])
    assert out.dtype == target and list(out.shape) == shape
    values = decoded(codes)
    if target.is_floating_point:  # every fp4 value is exact in every float type, -0.0 included
        assert torch.equal(_bits(out.to(torch.float64)), _bits(values))
    else:  # integers truncate toward zero
        assert torch.equal(out.to(torch.float64), values.trunc())
