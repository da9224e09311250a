"""The Triton fp8/fp4 conversion helpers against fusion.fp8 and fusion.fp4, exhaustively.

Runs in the Triton interpreter on CPU; the helpers use only integer and exact float
arithmetic, so a GPU gives the same codes. Every fp8/fp4 code, every bfloat16 and float16
value, random float32 bit patterns and the float32 neighbours of every rounding midpoint
and overflow threshold are checked bit for bit.
"""

import pytest
import torch
import triton
import triton.language as tl

from fusion.fp4 import FP4_MAGNITUDES, decode_fp4, encode_fp4, pack_fp4, unpack_fp4
from fusion.fp8 import to_fp8
from schedulers.triton_lib import (
    fp4_decode,
    fp4_encode,
    fp4_pack,
    fp4_unpack,
    fp8e4m3_decode,
    fp8e4m3_encode,
    fp8e5m2_decode,
    fp8e5m2_encode,
)

# The interpreter runs one program at a time; big blocks keep launches few.
BLOCK = 65536
ULPS_AROUND_THRESHOLDS = 4


@triton.jit
def _map_kernel(src, dst, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst + offsets, FN(tl.load(src + offsets, mask=mask)), mask=mask)


@triton.jit
def _unpack_kernel(src, lo_dst, hi_dst, packed_dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    lo, hi = fp4_unpack(tl.load(src + offsets, mask=mask))
    tl.store(lo_dst + offsets, lo, mask=mask)
    tl.store(hi_dst + offsets, hi, mask=mask)
    tl.store(packed_dst + offsets, fp4_pack(lo, hi), mask=mask)


def _apply(helper, values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``helper`` elementwise over a 1-D tensor, in as few launches as BLOCK allows."""
    out = torch.empty(values.shape, dtype=out_dtype)
    _map_kernel[(triton.cdiv(values.numel(), BLOCK),)](
        values, out, values.numel(), helper, BLOCK=BLOCK
    )
    return out


ENCODERS = {
    "e4m3": (fp8e4m3_encode, lambda v: to_fp8(v, torch.float8_e4m3fn).view(torch.uint8)),
    "e5m2": (fp8e5m2_encode, lambda v: to_fp8(v, torch.float8_e5m2).view(torch.uint8)),
    "fp4": (fp4_encode, encode_fp4),
}


def _assert_same_codes(values: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    bad = (got != want).nonzero().flatten()[:8]
    assert bad.numel() == 0, (
        f"{(got != want).sum()} codes differ, e.g. input bits "
        f"{[hex(b) for b in values[bad].view(torch.int32).tolist()]}: "
        f"got {[hex(c) for c in got[bad].tolist()]}, want {[hex(c) for c in want[bad].tolist()]}"
    )


def _assert_same_floats(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (so -0.0 differs from 0.0), except that any NaN equals any NaN."""
    both_nan = got.isnan() & want.isnan()
    same = both_nan | (got.view(torch.int32) == want.view(torch.int32))
    assert same.all(), f"differ at codes {(~same).nonzero().flatten().tolist()[:8]}"


def _all_16_bit(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int16).view(dtype).to(torch.float32)


def _neighbours(points: torch.Tensor) -> torch.Tensor:
    """Each float32 point, both signs, and its neighbours within ULPS_AROUND_THRESHOLDS."""
    bits = points.to(torch.float32).abs().view(torch.int32)
    steps = torch.arange(-ULPS_AROUND_THRESHOLDS, ULPS_AROUND_THRESHOLDS + 1, dtype=torch.int32)
    near = (bits[:, None] + steps[None, :]).flatten().clamp(min=0).view(torch.float32)
    return torch.cat([near, -near])


def _midpoints(values: torch.Tensor) -> torch.Tensor:
    """Midpoints between consecutive sorted finite values (exact in float64)."""
    finite = values[values.isfinite()].to(torch.float64).unique()
    return (finite[:-1] + finite[1:]) / 2


def _threshold_inputs() -> torch.Tensor:
    """Values near every representable value, rounding midpoint and overflow threshold."""
    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).to(torch.float64)
    e5m2 = codes.view(torch.float8_e5m2).to(torch.float64)
    fp4 = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)
    points = [e4m3, e5m2, fp4, _midpoints(e4m3), _midpoints(e5m2), _midpoints(fp4)]
    # Beyond the largest value: the midpoint to the next binade's first value rounds up,
    # to 464 for e4m3 (saturating to 448) and to 61440 for e5m2 (inf).
    points.append(torch.tensor([464.0, 480.0, 512.0, 61440.0, 65536.0, 7.0, 8.0, 2.0**-10]))
    points.append(torch.tensor([2.0**-17, 2.0**-16, 2.0**-6, 2.0**-14]))
    # Every midpoint above is exact in float32 (they need at most 5 significant bits).
    points = torch.cat(points)
    return _neighbours(points[points.isfinite()])


def _special_inputs() -> torch.Tensor:
    bits = torch.tensor(
        [
            0x00000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,  # zero, subnormals, max
            0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000,  # inf and NaNs
        ],
        dtype=torch.int64,
    )  # fmt: skip
    bits = torch.cat([bits, bits | 0x80000000]).to(torch.int32)  # wraps to the negative twins
    return bits.view(torch.float32)


def _random_inputs(count: int) -> torch.Tensor:
    """Uniform random float32 bit patterns, and as many with exponents near the fp8 range."""
    generator = torch.Generator().manual_seed(20240613)
    anything = torch.randint(-(2**31), 2**31, (count,), generator=generator, dtype=torch.int64)
    mantissa_and_sign = torch.randint(0, 2**32, (count,), generator=generator, dtype=torch.int64)
    mantissa_and_sign &= 0x807FFFFF
    # Biased exponents 96..144 cover 2**-31 to 2**17: every subnormal, normal and overflow
    # of both fp8 formats and of fp4.
    exponent = torch.randint(96, 145, (count,), generator=generator, dtype=torch.int64)
    near_range = mantissa_and_sign | (exponent << 23)
    both = torch.cat([anything, near_range])
    return torch.where(both >= 2**31, both - 2**32, both).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_decode_every_code(fmt: str) -> None:
    torch_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    helper = {"e4m3": fp8e4m3_decode, "e5m2": fp8e5m2_decode}[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    _assert_same_floats(_apply(helper, codes, torch.float32), codes.view(torch_dtype).float())


def test_fp4_decode_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    _assert_same_floats(_apply(fp4_decode, codes, torch.float32), decode_fp4(codes))


@pytest.mark.parametrize("fmt", sorted(ENCODERS))
def test_encode_matches_reference(fmt: str) -> None:
    """One launch over every bf16 and f16 value, specials, thresholds and random bits."""
    helper, reference = ENCODERS[fmt]
    values = torch.cat(
        [
            _all_16_bit(torch.bfloat16),
            _all_16_bit(torch.float16),
            _special_inputs(),
            _threshold_inputs(),
            _random_inputs(2**18),
        ]
    )
    _assert_same_codes(values, _apply(helper, values, torch.uint8), reference(values))


@pytest.mark.parametrize(
    ("fmt", "value", "code"),
    [
        ("e4m3", float("nan"), 0x7F),
        ("e4m3", -float("nan"), 0xFF),
        ("e4m3", float("inf"), 0x7E),
        ("e4m3", -464.0, 0xFE),
        ("e4m3", -0.0, 0x80),
        ("e4m3", 2.0**-10, 0x00),  # a tie between 0 and 2**-9: even is 0
        ("e5m2", float("nan"), 0x7F),
        ("e5m2", -float("nan"), 0xFF),
        ("e5m2", 61440.0, 0x7C),  # a tie between 57344 and the next binade: overflows
        ("e5m2", -float("inf"), 0xFC),
        ("fp4", float("nan"), 0x7),
        ("fp4", -float("nan"), 0x7),
        ("fp4", -0.25, 0x8),  # a tie between 0 and 0.5: even is 0, sign kept
        ("fp4", 0.2500001, 0x1),  # a bit above the midpoint rounds up
        ("fp4", 2.5, 0x4),
        ("fp4", float("inf"), 0x7),
    ],
)
def test_encode_named_cases(fmt: str, value: float, code: int) -> None:
    """The rules the module docstring states, spelled out for readers."""
    helper, _ = ENCODERS[fmt]
    assert _apply(helper, torch.tensor([value]), torch.uint8).item() == code


def test_fp4_pack_unpack_every_byte() -> None:
    packed = torch.arange(256, dtype=torch.uint8)
    lo, hi, repacked = (torch.empty_like(packed) for _ in range(3))
    _unpack_kernel[(1,)](packed, lo, hi, repacked, packed.numel(), BLOCK=256)
    assert torch.equal(torch.stack([lo, hi], dim=-1).flatten(), unpack_fp4(packed))
    assert torch.equal(repacked, packed)
    assert torch.equal(pack_fp4(torch.stack([lo, hi], dim=-1)).view(torch.uint8).flatten(), packed)
