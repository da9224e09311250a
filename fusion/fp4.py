"""FP4 (e2m1) encoding, decoding and packing in plain PyTorch.

An e2m1 code is 4 bits: sign (bit 3), a 2-bit exponent and a 1-bit mantissa.
The eight magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6. Two codes share a
byte, the even-indexed element in the low nibble, as ``torch.float4_e2m1fn_x2``
stores them.

Conversion to fp4 rounds to nearest, ties to even (to the code whose mantissa
bit is 0), and saturates: every magnitude above 6, infinities included, becomes
±6 with the input's sign. The format has no NaN: NaN becomes +6 (code 0x7), so
it stays visible as the largest value rather than hiding as a zero. Negative
zero and negative values that round to zero keep their sign (code 0x8).

Inside the IR's reference evaluator an fp4 tensor is held unpacked, one code
per ``uint8``, in its logical shape; it is packed only at the fusion's
boundary.
"""

from __future__ import annotations

import torch

FP4_MAX = 6.0
# Magnitude of each code 0..7; codes 8..15 are the same magnitudes, negative.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoint i lies between codes i and i+1; a magnitude above it rounds up.
FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP4_NAN_CODE = 0x7
_SIGN_BIT = 0x8


def fp4_code_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values of codes 0..15, as a tensor of ``dtype`` (code 8 is -0.0)."""
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=dtype)
    return torch.cat([magnitudes, -magnitudes])


def encode_fp4(values: torch.Tensor) -> torch.Tensor:
    """Round ``values`` to e2m1 codes (uint8, one code per element, same shape).

    Rounds in the input's own precision (float64 stays float64; other types are
    widened exactly to float32 or, for integers, float64), so no double rounding.
    """
    if values.dtype == torch.float64 or not values.dtype.is_floating_point:
        x = values.to(torch.float64)
    else:
        x = values.to(torch.float32)
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for index, midpoint in enumerate(FP4_MIDPOINTS):
        upper_code_is_even = (index + 1) % 2 == 0
        rounds_up = magnitude > midpoint
        if upper_code_is_even:
            rounds_up |= magnitude == midpoint
        code += rounds_up.to(torch.uint8)
    negative = torch.signbit(x) & ~torch.isnan(x)
    code |= negative.to(torch.uint8) * _SIGN_BIT
    return torch.where(torch.isnan(x), torch.full_like(code, FP4_NAN_CODE), code)


def decode_fp4(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of e2m1 ``codes`` (uint8 holding 0..15) as ``dtype``; exact for every float type."""
    table = fp4_code_values(torch.float32).to(codes.device)
    return table[codes.long()].to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., 2k]`` into ``torch.float4_e2m1fn_x2`` ``[..., k]``, low nibble first."""
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"fp4 values are packed two per byte: the innermost extent must be even, "
            f"got shape {tuple(codes.shape)}"
        )
    codes = codes.to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2k]`` (uint8) of a packed ``[..., k]`` tensor (float4_e2m1fn_x2 or uint8)."""
    raw = packed.contiguous().view(torch.uint8)
    low = raw & 0xF
    high = raw >> 4
    return torch.stack([low, high], dim=-1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)


def to_fp4(values: torch.Tensor) -> torch.Tensor:
    """Round a tensor to fp4 and pack it: ``[..., 2k]`` to ``float4_e2m1fn_x2`` ``[..., k]``."""
    return pack_fp4(encode_fp4(values))


def from_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and decode a ``float4_e2m1fn_x2`` ``[..., k]`` tensor to ``dtype`` ``[..., 2k]``."""
    return decode_fp4(unpack_fp4(packed), dtype)
