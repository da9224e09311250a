"""A split row's variance: what each program reduces of its slice before the exchange
(``exchange.reduce_split`` combines the slices by Chan's rule): the slice's sum and its
sum of squares about its own mean, in two reductions or, with ``one_pass``, one."""

from __future__ import annotations

from schedulers.codegen import Emitter

# A variance in one pass keeps a slice's squares about its mean as the sum of its squares
# less its sum's square over its count where that difference is at least 1/ONE_PASS_LOSS
# of the sum of squares (the cancellation multiplies the sums' own rounding error by at
# most ONE_PASS_LOSS) and that sum is finite; otherwise (a NaN too) it reduces them about
# the mean
ONE_PASS_LOSS = 16.0
FLOAT32_MAX = 3.4028234663852886e38  # a sum of squares past it is inf: reduced again


def slice_moments(emit: Emitter, value: str, one_pass: bool) -> list[str]:
    """Names of the slice's sum of ``value`` (float32, masked by ``mask``) and sum of
    squares about its mean, each (BLOCK_ROWS,), emitted into ``emit``. Two reductions,
    the second about the first's mean; with ``one_pass`` one reduction of the values and
    their squares together (one exchange between warps instead of two), the squares about
    the mean as their difference, reduced again about the mean where that difference
    keeps too little of them (a mean far from zero against the spread), any row of the
    block."""
    if not one_pass:
        total = emit.assign(f"tl.sum(tl.where(mask, {value}, 0.0), 1)")
        count = emit.assign(slice_count("part"))
        return [total, emit.assign(_about_mean(emit, value, total, count))]
    masked = emit.assign(f"tl.where(mask, {value}, 0.0)")
    both = emit.assign(f"tl.sum(tl.join({masked}, {masked} * {masked}), 1)")
    total, raw = emit.fresh(), emit.fresh()
    emit.line(f"{total}, {raw} = tl.split({both})")
    count = emit.assign(slice_count("part"))
    squares = emit.assign(f"{raw} - {total} * {total} / tl.maximum({count}, 1.0)")
    again = emit.nested()
    again.line(f"{squares} = {_about_mean(again, value, total, count)}")
    # false where either is a NaN; an inf sum of squares less a finite square is inf
    kept = f"({raw} <= {ONE_PASS_LOSS} * {squares}) & ({raw} <= {FLOAT32_MAX})"
    emit.block(f"if tl.max(tl.where({kept}, 0, 1), 0) > 0:", again)
    return [total, squares]


def slice_count(part: str) -> str:
    """Triton source of the columns of slice ``part`` (a program's: ``"part"``; or a
    number), float32, counted without a reduction: clamped to the row (a slice past its
    end has none; a row past the last has no values and is not stored)."""
    clamped = f"tl.minimum(tl.maximum(COLUMNS - {part} * BLOCK_COLUMNS, 0), BLOCK_COLUMNS)"
    return f"{clamped}.to(tl.float32)"


def _about_mean(emit: Emitter, value: str, total: str, count: str) -> str:
    """The reduction of ``value``'s squares about the slice's mean (``total / count``),
    its operands emitted into ``emit``."""
    local = emit.assign(f"{total} / tl.maximum({count}, 1.0)")
    centred = emit.assign(f"tl.where(mask, {value} - {local}[:, None], 0.0)")
    return f"tl.sum({centred} * {centred}, 1)"
