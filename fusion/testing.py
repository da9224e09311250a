"""Comparing results with the reference: tolerances per dtype, defined in one place.

Why these tolerances:

- integers and bool are exact;
- fp8 and fp4 results are compared as bytes, exactly: a conversion either picks
  the right code or it is wrong;
- a float result may differ from another correct computation by one rounding
  to its own type (one ulp), plus for float32/float64 a couple of ulps from
  different implementations of transcendental functions: ``rtol`` is 2 ulps
  (``2 * eps``) for bf16/f16 and 4 ulps for f32/f64;
- a reduction accumulates in its compute type (float32 for bf16/f16) in some
  order; for inputs of magnitude about one the error of a different order
  stays below ``4 * eps_compute * reduction_extent``, which is ``atol``;
- a result combined from ``partial_sums`` partial results, each rounded to the
  output type first (a row-parallel linear's all-reduce), carries that many
  more roundings, each up to one ulp of a partial of magnitude about
  ``sqrt(reduction_extent)``: ``rtol`` grows by ``partial_sums`` ulps and
  ``atol`` by ``partial_sums * eps * sqrt(reduction_extent)``.
"""

from __future__ import annotations

import torch

from fusion.dtypes import DataType, compute_dtype, machine_epsilon


def tolerance(
    dtype: DataType, reduction_extent: int = 1, partial_sums: int = 1
) -> tuple[float, float]:
    """``(rtol, atol)`` for results of ``dtype``; ``reduction_extent`` counts accumulated
    terms, ``partial_sums`` the partial results rounded to ``dtype`` before combining."""
    if not dtype.is_floating or dtype.storage_only:
        return 0.0, 0.0
    eps = machine_epsilon(dtype)
    ulps = 2 if dtype.bits <= 16 else 4
    atol = 4 * machine_epsilon(compute_dtype(dtype)) * max(reduction_extent, 1)
    if partial_sums > 1:
        ulps += partial_sums
        atol += partial_sums * eps * max(reduction_extent, 1) ** 0.5
    return ulps * eps, atol


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: DataType | None = None,
    reduction_extent: int = 1,
    message: str = "",
    partial_sums: int = 1,
) -> None:
    """Assert ``actual`` matches ``expected`` within ``tolerance(dtype, reduction_extent)``.

    ``dtype`` defaults to ``actual``'s type. NaNs must match NaNs.
    """
    dtype = dtype or DataType.from_torch(actual.dtype)
    if actual.shape != expected.shape:
        raise AssertionError(f"{message} shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if dtype.storage_only:
        mismatched = (actual.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
        if mismatched:
            raise AssertionError(
                f"{message} {mismatched} of {actual.numel()} {dtype} elements differ bytewise"
            )
        return
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{message} dtype {actual.dtype} != {expected.dtype}")
    rtol, atol = tolerance(dtype, reduction_extent, partial_sums)
    wide = torch.float64 if dtype.is_floating else torch.int64
    torch.testing.assert_close(
        actual.to(wide),
        expected.to(wide),
        rtol=rtol,
        atol=atol,
        equal_nan=True,
        msg=lambda m: f"{message} ({dtype}, rtol={rtol:.3g}, atol={atol:.3g}): {m}",
    )
