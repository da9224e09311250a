"""The column walk: a strategy of two kernels, then the combining kernel (``combine``),
for a normalization's rows with column sums too wide for a split row's registers.

The column walk: its first kernel is the chunked walk of the rows' reductions alone
(``codegen.source``), which stores each row's reduced values (float32, ``stashed``) in a
small buffer; its second (``column_source``) walks strips of ``strip_columns`` columns
down the rows: a program a strip and a group of rows, the row values loaded, the full
outputs stored and the strip's partial column sums kept in registers, stored once at the
end (a partial row a group, added by the combining kernel). A row's inputs are read
twice (10 bytes a column for LayerNorm backward against the 6 it must move), but neither
kernel's traffic depends on the rows fitting the L2 or the registers: the chunked walk
with column sums adds every row's terms into its program's partial row in memory (16
bytes more a column), LayerNorm backward's split slices of 16384 columns (past 131072)
spill, and a split whose programs hold few rows at once waits on its exchange.
"""

from __future__ import annotations

from fusion.dtypes import float32
from schedulers.codegen import (
    COMBINE,
    Emitter,
    Value,
    kernel_source,
    reduce_call,
    reduction_identity,
)
from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.codegen import Generator, Step, parts_combine, stashed
from schedulers.normalization.combine import COMBINE_PARTS
from schedulers.normalization.heuristics import (
    COLUMN_WALK,
    MAX_REGISTERS,
    SPLIT,
    NormalizationParams,
    full_bits,
    walk_registers,
)
from schedulers.runtime import cdiv, next_power_of_two

# The column walk: the rows' walk in steps of ROW_STEP columns over ROW_WARPS warps (32
# values a thread a buffer); strips of STRIP_COLUMNS over STRIP_WARPS warps (16 values),
# STRIP_PROGRAMS an SM; both walks' loads pipelined WALK_STAGES deep. H200, fraction of
# copy, LayerNorm backward 1024x135168 / 512x262144: 0.53 / 0.49 (torch.compile 0.41 /
# 0.36, the split row 0.09 / 0.09); RMSNorm backward 512x262144 0.54 (0.36, split 0.45-
# 0.47). Its neighbours (two rounds, results/norms_colwalk{,2}_{layernorm,rmsnorm}_bwd_
# h200_f1ee613.json), LayerNorm 1024x135168: strips of 1024 over 4 warps 0.50, of 512
# 0.44, of 4096 over 8 0.50; 2 or 8 strip warps 0.50-0.52; 2, 4, 8 programs an SM 0.43,
# 0.50-0.53, 0.50-0.51; stages 1, 2, 4, 5: 0.45, 0.38, 0.52-0.53, 0.51; 16 row warps 0.50-
# 0.52, steps of 4096 or 16384 0.50-0.52; the other shapes alike.
ROW_STEP, ROW_WARPS = 8192, 8
STRIP_COLUMNS, STRIP_WARPS = 2048, 4
STRIP_PROGRAMS = 4
WALK_STAGES = 3
# The first kernel's programs an SM at least, a row's reductions taken in parts where
# the rows are fewer. H200 (results/norms_colwalk_parts_*_bwd_h200_492d0ea.json), against
# a program a row: RMSNorm backward 8x262144 0.08 of copy against 0.05, 64x262144
# 0.29-0.30 against 0.28; LayerNorm 0.05 against 0.04, 0.20 against 0.19; from 132 rows
# level (0.31 / 0.40 at 132x262144: the strips, not the rows' kernel, hold it there).
ROW_PROGRAMS = 4
# A split row whose programs hold fewer rows than this at once (the device's programs,
# estimated from registers, over the programs a row) on a device whose memory moves
# SPLIT_ROWS_GBPS (the H200), in proportion on others (the bytes in flight that keep the
# memory busy), walks the columns instead. H200, RMSNorm backward 512x262144, 4 rows (32
# programs of 8192 columns, one an SM): 0.45-0.47 split against 0.54; at 1024x196608 (5
# rows, 24 programs) 0.59 split against 0.57, 2048x131072 (12 rows) 0.63 against 0.59;
# LayerNorm backward 2048x131072 (8 rows) 0.59 against 0.57, 4096x65536 (16) 0.70 against
# 0.59. H100 (3.5 rows): RMSNorm 512x262144 0.58 split against 0.55, 1024x196608 0.74
# against 0.57; LayerNorm 2048x131072 0.76 against 0.57 (results/norms_colwalk3_*_h100_
# 0da0dd4.json). Where the slices do not fit the registers at all (LayerNorm backward
# from 131073 columns: 16384 a slice, 16 warps) it holds none: 0.09-0.10 on both.
SPLIT_LEAST_ROWS, SPLIT_ROWS_GBPS = 5, 4300.0


def column_walk_params(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int
) -> NormalizationParams | str:
    """The column walk's params for rows of ``columns``, or why it cannot be. Where the
    strips may combine parts of a row's reductions (``codegen.parts_combine``), a row may
    be reduced in as many parts as it has steps: the launch takes as many as its rows
    leave room for (``row_parts``), so the kernels do not depend on the rows."""
    if not plan.column_sums:
        return "no column sums: the column walk writes them"
    for tensor in stashed(plan):
        dtype = tensor.dtype
        if not dtype.is_floating or dtype.storage_only or dtype.bits > 32:
            return f"{tensor} ({dtype}): the column walk keeps row values as float32"
    step = min(next_power_of_two(columns), ROW_STEP)
    strip = min(next_power_of_two(columns), STRIP_COLUMNS)
    programs = STRIP_PROGRAMS * hardware.sm_count
    parts = cdiv(columns, step) if parts_combine(plan) else 1  # at most one a step
    reduced = f" (in up to {parts} parts a row where rows are few)" if parts > 1 else ""
    why = (f"the rows' {len(stashed(plan))} reductions{reduced} in steps of {step} columns, "
           f"then strips of {strip} columns ({cdiv(columns, strip)} of them) walked down "
           f"the rows by {programs} programs, their column sums in registers")  # fmt: skip
    return NormalizationParams(1, step, ROW_WARPS, False, programs, WALK_STAGES,
                               strategy=COLUMN_WALK, parts=parts, strip_columns=strip,
                               strip_warps=STRIP_WARPS, why=why)  # fmt: skip


def split_short_of_rows(
    plan: NormalizationPlan, hardware: HardwareProfile, split: NormalizationParams
) -> str | None:
    """Why a ``split`` holds too few rows at once (``SPLIT_LEAST_ROWS``), or None: the
    programs the device holds, estimated from their registers (``walk_registers``: a row
    of the slice, weights and column sums) and the shared memory of their pipelined
    loads, over the programs a row."""
    registers = walk_registers(plan, hardware, split.block_columns, split.num_warps, 1,
                               split.column_registers, False)  # fmt: skip
    staged = split.stages * split.block_rows * split.block_columns * full_bits(plan)
    blocks = hardware.blocks_per_sm(split.num_warps, registers, staged if split.stages > 1 else 0)
    rows = blocks * hardware.sm_count // split.parts if registers <= MAX_REGISTERS else 0
    least = SPLIT_LEAST_ROWS * hardware.memory_gbps / SPLIT_ROWS_GBPS
    if rows and rows >= least:
        return None
    return (f"{split.parts} programs a row hold {rows} rows at once, fewer than {least:.1f} "
            f"on a device of {hardware.memory_gbps:.0f} GB/s")  # fmt: skip


def row_parts(
    params: NormalizationParams, hardware: HardwareProfile, rows: int, columns: int
) -> tuple[int, int]:
    """The parts a launch of the column walk over ``rows`` rows of ``columns`` reduces a
    row in, and the columns of each (whole steps): as many as fill ``ROW_PROGRAMS``
    programs an SM, at most ``params.parts``, none empty."""
    steps = cdiv(columns, params.block_columns)
    wanted = cdiv(ROW_PROGRAMS * hardware.sm_count, max(cdiv(rows, params.block_rows), 1))
    parts = max(1, min(params.parts, steps, wanted))
    span = cdiv(steps, parts) * params.block_columns
    return cdiv(columns, span), span


def strip_grid(params: NormalizationParams, rows: int, columns: int) -> tuple[int, int]:
    """The second kernel's strips and groups of rows: a program each pair, at most
    ``params.programs`` (at least a group), no group without a row."""
    strips = cdiv(columns, params.strip_columns)
    return strips, max(1, min(cdiv(rows, params.block_rows), params.programs // strips))


def column_source(plan: NormalizationPlan, params: NormalizationParams) -> str:
    """The column walk's second kernel: program ``p`` takes strip ``p % strips`` and
    every ``groups``-th row block from ``p // strips``; its partial column sums go to
    row ``p // strips`` of each ``part`` buffer."""
    pointers = {t: f"in{i}" for i, t in enumerate(plan.inputs)}
    targets = [f"out{i}" for i in range(len(plan.outputs))]
    strip = Emitter()
    strip.line("strips = tl.cdiv(COLUMNS, BLOCK_COLUMNS)")
    strip.line("group = tl.program_id(0) // strips")
    strip.line("groups = tl.num_programs(0) // strips")
    strip.line("cols = tl.program_id(0) % strips * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)")
    strip.line("col_mask = cols < COLUMNS")
    walk = strip.nested()
    cache: dict = {}  # one step: row values and the strip's weights included
    generator = Generator(plan, params, pointers, walk, cache)
    for tensor in plan.inputs:  # weights: loaded once a strip
        if plan.kinds[tensor] == "column":
            generator.value(Step(strip, cache), tensor)
    walk.line("rows = tl.cast(row_block, tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
    walk.line("row_mask = rows < row_count")
    walk.line("mask = row_mask[:, None] & col_mask[None, :]")
    walk.line("offs = rows[:, None] * COLUMNS + cols[None, :]")
    kept = stashed(plan)
    if params.parts > 1:  # the parts' reductions, combined in a fixed order and finished
        walk.line("parts = tl.arange(0, PARTS_BLOCK)")
    for j, tensor in enumerate(kept):  # float32: the first kernel's value, or its parts
        if params.parts == 1:
            loaded = walk.assign(f"tl.load(stash + rows[:, None] * {len(kept)} + {j}, "
                                 "mask=row_mask[:, None], other=0.0)", "row")  # fmt: skip
            cache[tensor] = Value(loaded, tensor.dtype)
            continue
        op = tensor.definition.op_name
        loaded = walk.assign(
            f"tl.load(stash + (rows[:, None] * row_parts + parts[None, :]) * {len(kept)} + {j}, "
            f"mask=row_mask[:, None] & (parts < row_parts)[None, :], "
            f"other={reduction_identity(op, float32)})", "row")  # fmt: skip
        reduced = walk.assign(reduce_call(loaded, 1, COMBINE[op], keep_dims=True))
        generator.finish_reduced(tensor.definition, tensor, op, reduced, float32)
    step = Step(walk, cache, "evict_first")
    generator.full_outputs(step, targets)
    sums = generator.column_terms(step, list(range(len(plan.column_sums))))
    for i, term in sums:  # a partial row a row of the tile, added at the end
        strip.line(f"colsum{i} = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)")
        walk.line(f"colsum{i} = colsum{i} + {term}")
    blocks = "group, tl.cdiv(row_count, BLOCK_ROWS), groups"
    if params.stages > 1:
        blocks = f"tl.range({blocks}, num_stages={params.stages})"
    else:
        blocks = f"range({blocks})"
    strip.block(f"for row_block in {blocks}:", walk)
    for i in range(len(sums)):
        strip.line(f"tl.store(part{i} + tl.cast(group, tl.int64) * COLUMNS + cols, "
                   f"tl.sum(colsum{i}, 0), mask=col_mask)")  # fmt: skip
    arguments = [*pointers.values(), *targets, *(f"part{i}" for i in range(len(sums))), "stash"]
    comment = (f"# normalization: a column walk's strips, {len(kept)} row values, "
               f"{len(sums)} column sums")  # fmt: skip
    constants = ["COLUMNS", "BLOCK_ROWS", "BLOCK_COLUMNS",
                 *(["PARTS_BLOCK"] if params.parts > 1 else [])]  # fmt: skip
    runtime = ["row_count", *(["row_parts"] if params.parts > 1 else [])]
    return kernel_source("column_kernel", arguments, runtime, constants, strip.lines,
                         comment, [text for _, text in generator.helpers.values()])  # fmt: skip


def column_constants(params: NormalizationParams, columns: int) -> dict[str, int]:
    """The column walk's second kernel's ``tl.constexpr`` arguments."""
    values = {"COLUMNS": columns, "BLOCK_ROWS": params.block_rows,
              "BLOCK_COLUMNS": params.strip_columns}  # fmt: skip
    if params.parts > 1:  # room for the most parts a launch takes
        values["PARTS_BLOCK"] = next_power_of_two(params.parts)
    return values


def combine_rows(params: NormalizationParams, columns: int) -> int:
    """The most partial rows of a column sum a launch of ``params`` over rows of
    ``columns`` writes: a program's each, a column walk's a group of rows' each; a
    split's a group's each, as many as the device holds (known at its launch, not from
    ``params``): ``COMBINE_PARTS``, the combining kernel's widest step."""
    if params.strategy == COLUMN_WALK:  # as many groups as any number of rows gives
        return strip_grid(params, params.programs * params.block_rows, columns)[1]
    if params.strategy == SPLIT:
        return COMBINE_PARTS
    return max(1, params.programs)
