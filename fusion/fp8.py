"""FP8 conversion with one rounding and a fixed overflow rule, whatever the torch version.

- Round to nearest, ties to even, once: a float64 source is first narrowed to
  float32 with round-to-odd, which keeps a sticky bit so the second rounding
  (float32 to fp8) gives the correctly rounded result. torch rounds float64 to
  float32 to nearest first, which can land on an fp8 midpoint and round twice.
- ``float8_e4m3fn`` has no infinity: overflow, infinities included, saturates
  to ±448 (what torch 2.13 does; torch 2.11 gives NaN). NaN stays NaN.
- ``float8_e5m2`` follows IEEE: overflow becomes ±inf, NaN stays NaN.

Decoding fp8 to wider types is exact and is torch's own.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def _float64_to_float32_round_to_odd(values: torch.Tensor) -> torch.Tensor:
    """Narrow float64 to float32 rounding toward zero, then set the last bit if inexact."""
    nearest = values.to(torch.float32)
    widened = nearest.to(torch.float64)
    finite = torch.isfinite(nearest)
    # Step back toward zero where rounding to nearest went away from zero.
    away = finite & (widened.abs() > values.abs())
    toward_zero = torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    inexact = finite & (toward_zero.to(torch.float64) != values)
    bits = toward_zero.view(torch.int32)
    odd = torch.where(inexact, bits | 1, bits).view(torch.float32)
    return torch.where(finite, odd, nearest)


def to_fp8(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Convert ``values`` (any float, integer or bool tensor) to ``dtype`` (an fp8 torch dtype)."""
    if values.dtype == torch.float64:
        narrow = _float64_to_float32_round_to_odd(values)
    else:
        narrow = values.to(torch.float32)
    if dtype == torch.float8_e4m3fn:
        narrow = narrow.clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    elif dtype != torch.float8_e5m2:
        raise ValueError(f"to_fp8: {dtype} is not an fp8 type")
    return narrow.to(dtype)
