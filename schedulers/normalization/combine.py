"""A normalization's column sums (a backward's weight gradients) from its programs'
partial rows, added in a fixed order (deterministic) and rounded once to the output's
dtype: by a kernel of their own launched after the normalization's (``combine_source``),
or at the end of the normalization kernel itself (``fused_lines``): its last programs to
finish add them once every program's partial rows are stored.

The fused form (``NormalizationParams.fused_sums``): each program, its partial rows
stored, counts itself in an int32 word (``sums_count``, an atomic add at GPU scope, a
release of the block's stores after a barrier); the last ``combiners`` to arrive wait
until every program has (an acquire), then each adds a slice of ``SUM_COLUMNS`` columns
of every column sum (every ``combiners``-th slice); the last of them to finish sets the
words back to zero for the next launch (``sums_count`` is zero before a launch: the
launcher keeps one pair of words a stream, ``NormalizationLauncher``). The programs that
wait are the last to arrive: those still to come need only the room the others left, so
a grid larger than the device holds at once still finishes. The interpreter runs
programs one after another: one combiner, the last program, adds every slice.
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


def add_rows(emit: Emitter, plan: NormalizationPlan, partials: list[str], outputs: list[str],
             rows: str, names: tuple[str, str, str]) -> None:  # fmt: skip
    """Lines adding ``rows`` partial rows (of ``COLUMNS`` columns, at ``partials``) over
    the columns ``cols`` (a slice, ``names``' tile: its columns and rows a step, and
    the prefix of the values' names) and storing each column sum to ``outputs``."""
    columns, steps, prefix = names
    sums = range(len(plan.column_sums))
    emit.line(f"{prefix}col_mask = {prefix}cols < COLUMNS")
    for i in sums:
        emit.line(f"{prefix}acc{i} = tl.zeros(({steps}, {columns}), tl.float32)")
    emit.line(f"for {prefix}first in range(0, {rows}, {steps}):")
    emit.line(f"    {prefix}parts = {prefix}first + tl.arange(0, {steps})")
    emit.line(f"    {prefix}offsets = {prefix}parts[:, None] * COLUMNS + {prefix}cols[None, :]")
    emit.line(f"    {prefix}kept = ({prefix}parts < {rows})[:, None] & {prefix}col_mask[None, :]")
    for i in sums:
        emit.line(f"    {prefix}acc{i} += tl.load({partials[i]} + {prefix}offsets, "
                  f"mask={prefix}kept, other=0.0)")  # fmt: skip
    for i, expr in enumerate(plan.column_sums):
        value = emit.rounded(f"tl.sum({prefix}acc{i}, 0)", float32, expr.output.dtype)
        emit.line(f"tl.store({outputs[i]} + {prefix}cols, {emit.stored(value)}, "
                  f"mask={prefix}col_mask)")  # fmt: skip


def combine_source(plan: NormalizationPlan) -> str:
    """The column sums' second kernel, one launch for all of them: each program's
    partial row added in a fixed order (deterministic), rounded once to the output's
    dtype (LayerNorm backward's two combining launches cost 2.3 us each at 1024x4096,
    H200, of 16 us in all)."""
    emit = Emitter()
    emit.line("cols = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)")
    sums = range(len(plan.column_sums))
    add_rows(emit, plan, [f"partial{i}" for i in sums], [f"out{i}" for i in sums],
             "programs", ("BLOCK_COLUMNS", "PARTS", ""))  # fmt: skip
    arguments = [*(f"partial{i}" for i in sums), *(f"out{i}" for i in sums)]
    constants = ["COLUMNS", "BLOCK_COLUMNS", "PARTS"]
    return kernel_source("combine_kernel", arguments, ["programs"], constants, emit.lines)


def fused_lines(kernel: Emitter, plan: NormalizationPlan, partials: list[str],
                outputs: list[str], rows: str) -> list[str]:  # fmt: skip
    """The end of a normalization kernel (``kernel``: its names) whose programs add its
    column sums themselves: ``rows`` partial rows at ``partials`` (every program's stored
    before these lines), the sums stored to ``outputs``. Runtime argument ``combiners``
    (1 to the slices), constants ``SUM_COLUMNS`` and ``SUM_PARTS`` (``combine_constants``)."""
    emit = kernel.nested()
    emit.line("# every program's partial rows stored: the last to arrive add them")
    emit.line("tl.debug_barrier()")  # every thread's stores before the arrival
    emit.line('arrived = tl.atomic_add(sums_count, 1, sem="acq_rel", scope="gpu")')
    emit.line("first_combiner = tl.num_programs(0) - combiners")
    emit.line("if arrived >= first_combiner:")
    combining = emit.nested()
    combining.line('seen = tl.atomic_add(sums_count, 0, sem="acquire", scope="gpu")')
    combining.line("while seen < tl.num_programs(0):")
    combining.line('    seen = tl.atomic_add(sums_count, 0, sem="acquire", scope="gpu")')
    piece = combining.nested()
    piece.line("sum_cols = piece * SUM_COLUMNS + tl.arange(0, SUM_COLUMNS)")
    add_rows(piece, plan, partials, outputs, rows, ("SUM_COLUMNS", "SUM_PARTS", "sum_"))
    combining.block("for piece in range(arrived - first_combiner, "
                    "tl.cdiv(COLUMNS, SUM_COLUMNS), combiners):", piece)  # fmt: skip
    # the last combiner: the words zero again (every combiner is past its wait)
    combining.line('done = tl.atomic_add(sums_count + 1, 1, sem="acq_rel", scope="gpu")')
    combining.line("if done == combiners - 1:")
    combining.line('    tl.atomic_xchg(sums_count, 0, sem="relaxed", scope="gpu")')
    combining.line('    tl.atomic_xchg(sums_count + 1, 0, sem="relaxed", scope="gpu")')
    emit.lines.extend(f"    {line}" for line in combining.lines)
    return emit.lines


def fused_constants(columns: int, most: int) -> dict[str, int]:
    """A fused combination's ``tl.constexpr`` arguments: the combining kernel's tile
    (``combine_constants``) for at most ``most`` partial rows of ``columns``."""
    fixed = combine_constants(columns, most)
    return {"SUM_COLUMNS": fixed["BLOCK_COLUMNS"], "SUM_PARTS": fixed["PARTS"]}


def combine_constants(columns: int, most: int = COMBINE_PARTS) -> dict[str, int]:
    """A combining kernel's ``tl.constexpr`` arguments for at most ``most`` partial rows of
    ``columns``: ``COMBINE_PARTS`` partial rows a step and ``COMBINE_COLUMNS`` columns a
    program, or, where there are fewer rows, as many a step (a power of two) and as many
    more columns (the same tile). A constant of the launch's params, not of its rows, so
    a new batch size keeps the kernel."""
    parts = min(COMBINE_PARTS, next_power_of_two(max(most, 1)))
    width = min(next_power_of_two(columns), COMBINE_COLUMNS * COMBINE_PARTS // parts)
    return {"COLUMNS": columns, "BLOCK_COLUMNS": max(COMBINE_COLUMNS, width), "PARTS": parts}
