"""A normalization's column sums (a backward's weight gradients) from its programs'
partial rows: the kernel that adds them in a fixed order (deterministic), launched after
the normalization kernel (every strategy's; a column walk's after its strips' kernel).
"""

from __future__ import annotations

from fusion.dtypes import float32
from schedulers.codegen import Emitter, kernel_source
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.runtime import next_power_of_two

# column sums: columns a program of the combining kernel. 16, not 32: at 1024 columns 64
# programs, not 32 (ncu, H200, LayerNorm backward 32768x1024: 9.5 us of the 61 in all at
# 32); 0.84 of copy against 0.80 on the H200, 0.89 against 0.87 on the H100, the other
# backward shapes within 0.01 (results/probe_combine_{h200,h100}_54047f8.json)
COMBINE_COLUMNS = 16
COMBINE_PARTS = 256  # and partial rows it adds per step (fewer rows: as many, and as many
# more columns a program; H200, ncu, the column walk's 4 partial rows of 262144 columns
# took 72 us in tiles of 256 rows, against 49 for its strips' kernel)
COMBINE_WARPS = 8
# Launched as a programmatic dependent of the kernel writing the partial rows (sm_90 and
# later: its programs start as that kernel ends and wait in ``griddepcontrol.wait`` until
# its writes are visible). H200, two runs (results/norms_pdl_h200_ce0f105_{1,2}.json),
# against a plain launch: RMSNorm backward 32768x1024 0.87-0.88 of copy against 0.86-0.87,
# 16384x1024 0.79 against 0.78, 4096x1024 0.40-0.44 against 0.37-0.43, LayerNorm 4096x65536
# 0.73 against 0.71-0.72, RMSNorm 1024x135168 0.65-0.67 against 0.64-0.66; the others level
# (two runs at a271b5d had read it within their spread: LayerNorm 32768x1024 0.834-0.835
# against 0.829-0.830). The kernel before it also starting it from its own start
# (``griddepcontrol.launch_dependents``): 0.54-0.57 against 0.57-0.60 at 2048x4096, not kept.
DEPENDENT_LAUNCH = 90


def combine_source(plan: NormalizationPlan) -> str:
    """The column sums' second kernel, one launch for all of them: each program's
    partial row added in a fixed order (deterministic), rounded once to the output's
    dtype (when each column sum had a launch of its own, LayerNorm backward's two cost
    2.3 us each at 1024x4096, H200, of 16 us in all). ``DEPENDENT``: it waits for the
    kernel before it first (``DEPENDENT_LAUNCH``)."""
    emit = Emitter()
    emit.line("if DEPENDENT:  # launched before the kernel writing the partial rows ends")
    emit.line("    tl.extra.cuda.gdc_wait()")
    emit.line("cols = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)")
    emit.line("col_mask = cols < COLUMNS")
    sums = range(len(plan.column_sums))
    for i in sums:
        emit.line(f"acc{i} = tl.zeros((PARTS, BLOCK_COLUMNS), tl.float32)")
    emit.line("for first in range(0, programs, PARTS):")
    emit.line("    parts = first + tl.arange(0, PARTS)")
    emit.line("    offsets = parts[:, None] * COLUMNS + cols[None, :]")
    emit.line("    kept = (parts < programs)[:, None] & col_mask[None, :]")
    for i in sums:
        emit.line(f"    acc{i} += tl.load(partial{i} + offsets, mask=kept, other=0.0)")
    for i, written in enumerate(plan.column_outputs):
        value = emit.rounded(f"tl.sum(acc{i}, 0)", float32, written.dtype)
        emit.line(f"tl.store(out{i} + cols, {emit.stored(value)}, mask=col_mask)")
    arguments = [*(f"partial{i}" for i in sums), *(f"out{i}" for i in sums)]
    constants = ["COLUMNS", "BLOCK_COLUMNS", "PARTS", "DEPENDENT"]
    return kernel_source("combine_kernel", arguments, ["programs"], constants, emit.lines)


def combine_constants(columns: int, most: int, *, dependent: bool) -> dict[str, int | bool]:
    """A combining kernel's ``tl.constexpr`` arguments for at most ``most`` partial rows of
    ``columns``: ``COMBINE_PARTS`` partial rows a step and ``COMBINE_COLUMNS`` columns a
    program, or, where there are fewer rows, as many a step (a power of two) and as many
    more columns (the same tile). A constant of the launch's params, not of its rows, so
    a new batch size keeps the kernel. ``dependent``: launched as a programmatic
    dependent of the kernel before it (``DEPENDENT_LAUNCH``: sm_90 and later only)."""
    parts = min(COMBINE_PARTS, next_power_of_two(max(most, 1)))
    width = min(next_power_of_two(columns), COMBINE_COLUMNS * COMBINE_PARTS // parts)
    return {"COLUMNS": columns, "BLOCK_COLUMNS": max(COMBINE_COLUMNS, width), "PARTS": parts,
            "DEPENDENT": dependent}  # fmt: skip
