"""An fp4 (e2m1) oracle for the tests, derived from the format, independent of ``fusion.fp4``.

``fusion.fp4`` encodes by counting the midpoints a magnitude passes. This oracle
decodes each code from its bit fields, and encodes by brute force: the distance
from the value to each of the eight magnitudes, the nearest wins, a tie goes to
the code whose mantissa bit is 0. Rules from the format's documentation: |x| > 6
saturates to ±6, NaN becomes +6 (code 0x7), a negative value keeps its sign even
when it rounds to zero.

Why float64 distances are exact enough: after saturation the magnitude ``m`` lies in
[0, 6]. Around a midpoint, ``m`` lies between adjacent magnitudes ``a < b`` with
``b <= 2a`` (or ``a = 0``), so ``m - a`` and ``b - m`` are exact (Sterbenz); every
other magnitude is at least half a spacing farther, far beyond any rounding.
"""

from __future__ import annotations

import torch

NAN_CODE = 0x7


def e2m1_value(code: int) -> float:
    """The value of a 4-bit code from its fields: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:  # subnormal: 2**(1 - bias) * 0.m with bias 1
        magnitude = 0.5 * mantissa
    else:
        magnitude = 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
    return sign * magnitude


CODE_VALUES = tuple(e2m1_value(code) for code in range(16))
MAGNITUDES = CODE_VALUES[:8]


def expected_codes(values: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (uint8) of each element of ``values`` (any float, int or bool dtype)."""
    x = values.to(torch.float64)
    magnitude = x.abs().clamp(max=MAGNITUDES[-1])
    table = torch.tensor(MAGNITUDES, dtype=torch.float64)
    distance = (magnitude.unsqueeze(-1) - table).abs()
    nearest = distance.argmin(dim=-1)  # the first (lower) of two equally near codes
    upper = (nearest + 1).clamp(max=7)
    ties = (upper != nearest) & (
        distance.gather(-1, upper.unsqueeze(-1)) == distance.gather(-1, nearest.unsqueeze(-1))
    ).squeeze(-1)
    code = torch.where(ties & (nearest % 2 == 1), upper, nearest)
    code = torch.where(torch.signbit(x), code + 8, code)
    code = torch.where(torch.isnan(x), torch.full_like(code, NAN_CODE), code)
    return code.to(torch.uint8)


def decoded(codes: torch.Tensor) -> torch.Tensor:
    """The float64 values of ``codes`` (code 8 is -0.0)."""
    return torch.tensor(CODE_VALUES, dtype=torch.float64)[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2k]`` as ``float4_e2m1fn_x2`` ``[..., k]``: element 2i in the low nibble."""
    pairs = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8).view(torch.float4_e2m1fn_x2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2k]`` (uint8) of a packed ``[..., k]`` tensor."""
    raw = packed.view(torch.uint8).to(torch.int32)
    pairs = torch.stack([raw % 16, raw // 16], dim=-1)
    return pairs.reshape(*raw.shape[:-1], -1).to(torch.uint8)
