"""The warp-specialized strategy of normalizations with column sums (LayerNorm and
RMSNorm backward): a persistent grid whose producer warps load the full-shape inputs'
tiles with TMA into a circular buffer in shared memory for the consumer warps.

On Triton 3.6 for sm_90 the walk asks for warp specialization (``warp_specialize=True``)
but is not split into partitions: its TTGIR keeps the loop's attribute and no partition,
its SASS has one code stream, no ``setmaxnreg``, and whole-block barriers around each
TMA load and each cross-warp sum (LayerNorm backward at 1024 columns and RMSNorm
backward at 4096, compiled for sm_90 on a CPU). What runs is TMA tiles pipelined
``stages`` deep by the same warps; the figures below are of that kernel, and the 4
producer warps counted per program are not there."""

from __future__ import annotations

from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.heuristics import (
    FAST_MEMORY_GBPS,
    MAX_REGISTERS,
    MULTIWAVE,
    SPILL_ALLOWANCE,
    WARP_SPECIALIZED,
    NormalizationParams,
    full_bits,
    tile_sums_fit,
    tma_refusal,
    walk_registers,
    weight_inputs,
)
from schedulers.runtime import next_power_of_two

# Warp-specialized parameters, from sweeps on H200 (RMSNorm/LayerNorm backward, bf16,
# 1024-16384 columns; benchmarks/results/norms_ws_sweep.json): three stages as fast as
# four and much faster than two (0.50-0.65 of copy); a tile of about 32 KiB (8 rows of
# 1024, 2 of 4096, 1 of 8192: two tiles in flight); the fewest consumer warps that leave
# a thread at most two 128-bit vectors of a row (1024: 4 warps, two programs an SM,
# 0.57/0.49 of copy against 0.49/0.33 with 8 warps and one, the column sums added every
# step); with the column sums kept by row of the tile, enough consumer warps for that
# tile to be at most TILE_SUM_VALUES a thread (1024: 8 warps, one program an SM; H100,
# 32768x1024, 0.88/0.84 of copy against 0.72/0.66 before, commit 2105a11).
WS_MAX_STAGES = 3  # tiles in a warp-specialized kernel's circular buffer, at most
WS_MAX_BLOCKS = 2  # programs an SM, at most
WS_SCRATCH_BITS = 16 * 1024 * 8  # shared memory kept back: reductions' scratch, layouts
WS_INFLIGHT_BITS = 64 * 1024 * 8  # loads a program keeps in flight: the unroll stops there
# Degenerate when the register estimate passes SPILL_ALLOWANCE (shared with the
# multi-wave heuristic) times the registers a thread may have. RMSNorm backward at 16384
# columns (1.06 times over) spills a little and beats the 8-warp multi-wave kernel in
# every run (0.71-0.72 against 0.67 of copy on H200; on H100 0.84 against 0.82, and
# 0.90 for a 16-warp one: ``rows_in_flight``); LayerNorm backward there (1.31 times
# over) spills more and its time was bimodal across runs, the same kernel 0.50 or
# 1.25 ms on H200 (0.60 or 1.69 on H100), against a steady 0.71 ms for the multi-wave
# one: it falls back.
#
# Where the warp-specialized strategy gains: by compute capability, then by the number of
# column sums (1: RMSNorm backward, 2: LayerNorm backward), the fewest rows each program
# must walk to amortize loading its weights and writing its partial sums. Measured on
# H200 with these parameters (benchmarks/results/norms_threshold.json, fraction of copy,
# warp-specialized against multi-wave): RMSNorm at 31 rows a program loses with 4096
# columns (0.62 against 0.66) but wins with 1024 (0.34 against 0.27), loses at 15 rows
# of 8192 (0.61, 0.66), wins from 62 rows (0.51 against 0.32 at 16384x1024): 48 gives
# up the small win to avoid the loss; LayerNorm, whose multi-wave kernel is slower,
# wins from 31 rows a program (0.58 against 0.48 at 4096x4096, 0.32 against 0.17 at
# 8192x1024) and ties at 8-15. No entry (the forward, other architectures): the multi-wave strategy.
WS_GAINS: dict[int, dict[int, int]] = {90: {1: 48, 2: 16}}
# Rows of at most this many columns gain sooner, from this many rows a program, on a
# device whose memory moves at least this many GB/s (a device-to-device copy). RMSNorm
# backward at 8192x1024 (32 rows a program), warp-specialized against multi-wave: on
# H200 0.38 and 0.39 of copy against 0.28 in two runs, 0.25 against 0.27 in a third
# (benchmarks/results/norms_programs_sweep.json, norms_threshold*.json); on H100 0.25
# and 0.28 against 0.27 and 0.29 (norms_threshold_h100_1024.json): the H200 only.
WS_SHORT_ROW_GAINS: dict[int, dict[int, tuple[int, int, float]]] = {
    90: {1: (1024, 32, FAST_MEMORY_GBPS)}
}


def ws_threshold(hardware: HardwareProfile, sums: int, columns: int) -> int | None:
    """The fewest rows a program must walk for the warp-specialized kernel to gain, for
    ``sums`` column sums over rows of ``columns`` on ``hardware``; None: no gain."""
    gain = WS_GAINS.get(hardware.arch, {}).get(sums)
    short = WS_SHORT_ROW_GAINS.get(hardware.arch, {}).get(sums)
    if gain is not None and short and columns <= short[0] and hardware.memory_gbps >= short[2]:
        return short[1]
    return gain


def rows_in_flight(
    plan: NormalizationPlan,
    multiwave: NormalizationParams,
    specialized: NormalizationParams,
    columns: int,
) -> str | None:
    """Why the warp-specialized kernel ``specialized`` would add nothing to the
    multi-wave ``multiwave``, or None: it is short of registers (its weights read inside
    the walk), and each multi-wave program already loads one row of the full inputs at
    once, of at least the ``WS_INFLIGHT_BITS`` a warp-specialized program keeps in
    flight, without producer warps or a circular buffer (H100, RMSNorm backward at
    4096-16384x16384: 0.87-0.92 of copy, one row of 16 warps a program, against
    0.81-0.86 warp-specialized, ``results/norms_bwd16384_h100_3ba5bc6.json``; H200
    0.76-0.83 against 0.69-0.74, ``results/norms_bwd16384_h200_cf2d605.json``). One
    row: with rows of fewer columns (a block of several) the walk's next block waits for
    this one's (H100, LayerNorm backward at 4096 columns, four rows a block: 0.83
    against 0.91). Where the warp-specialized kernel keeps its weights in registers
    (bf16 at 12288 columns, float32 at 8192) nothing was measured: it stays."""
    if not multiwave.persistent or multiwave.strategy != MULTIWAVE or multiwave.block_rows != 1:
        return None
    if weight_inputs(plan) and specialized.column_registers:
        return None
    row_bits = columns * full_bits(plan)
    if row_bits < WS_INFLIGHT_BITS:
        return None
    return (f"a row of {row_bits // 8 // 1024} KiB loaded at once a program, at least the "
            f"{WS_INFLIGHT_BITS // 8 // 1024} KiB a warp-specialized program keeps in "
            "flight, where that one is short of registers")  # fmt: skip


def warp_specialized_params(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int, rows: int
) -> NormalizationParams | str:
    """The warp-specialized parameters, or why there are none. A loop grows, while
    shared memory and registers allow: the circular buffer's stages (up to
    ``WS_MAX_STAGES``), then the consumer warp groups (4 to 16 warps, until a thread
    holds at most two 128-bit vectors of a row), then the rows a tile (until
    ``WS_INFLIGHT_BITS`` are in flight, without passing the registers a thread may
    have); the block width is the whole row (a persistent row). Short of registers
    it first reads the weights inside the walk, then takes fewer rows a tile. The
    number of rows plays no part: one compiled kernel serves every batch size."""
    width = next_power_of_two(columns)
    refusal = tma_refusal(plan, hardware, columns, width)
    if refusal:
        return refusal
    full = plan.full_inputs
    row_bits = width * full_bits(plan)  # a tile row, every buffered input
    budget = hardware.smem_per_block_bits - WS_SCRATCH_BITS
    vector = max(1, 128 // max(t.dtype.bits for t in full))  # values of a 16-byte load
    weights = weight_inputs(plan)

    def registers(warps: int, block_rows: int, hoist: bool, tiled: bool = False) -> int:
        return walk_registers(plan, hardware, width, warps, block_rows, hoist, tiled)

    def limit(warps: int) -> int:  # registers a thread may have
        return min(MAX_REGISTERS, hardware.registers_per_sm // (warps * hardware.warp_size))

    stages, warps, block_rows, hoist = 1, 4, 1, True
    while stages < WS_MAX_STAGES and (stages + 1) * row_bits <= budget:
        stages += 1
    while warps < 16 and width > 2 * vector * warps * hardware.warp_size:
        warps *= 2
    while (
        block_rows * 2 <= 64
        and stages * 2 * block_rows * row_bits <= budget
        and (stages - 1) * block_rows * row_bits < WS_INFLIGHT_BITS
        and registers(warps, 2 * block_rows, hoist) <= limit(warps)
    ):
        block_rows *= 2
    fallbacks = []
    if registers(warps, block_rows, hoist) > limit(warps) and weights:
        hoist = False
        fallbacks.append("weights read inside the walk")
    while registers(warps, block_rows, hoist) > limit(warps) and block_rows > 1:
        block_rows //= 2
        fallbacks.append(f"{block_rows} rows a tile")
    # column sums kept by row of the tile: consumer warps grown until that fits (1024
    # columns: 8 warps, not 4; TILE_SUM_VALUES says what was measured)
    while not tile_sums_fit(plan, block_rows, width, warps, hardware) and warps < 16:
        warps *= 2
    tiled = tile_sums_fit(plan, block_rows, width, warps, hardware)
    used = registers(warps, block_rows, hoist, tiled)
    tile = block_rows * row_bits
    if stages < 2:
        return (f"degenerate: one stage (a tile of {tile // 8 // 1024} KiB, "
                f"{budget // 8 // 1024} KiB of shared memory for the buffer)")  # fmt: skip
    if used > SPILL_ALLOWANCE * limit(warps):
        return (f"degenerate: about {used} registers a thread, over {SPILL_ALLOWANCE} times "
                f"the {limit(warps)} a thread of {warps} warps may have")  # fmt: skip
    # programs an SM holds: each its buffer and its consumer warps' registers (the
    # producer warps give theirs back), and a producer warp group: 4 warps
    by_smem = hardware.smem_per_block_bits // (stages * tile + WS_SCRATCH_BITS)
    by_warps = hardware.max_warps_per_sm // (warps + 4)
    by_registers = hardware.registers_per_sm // (used * warps * hardware.warp_size)
    blocks = max(1, min(WS_MAX_BLOCKS, by_smem, by_warps, by_registers))
    programs = blocks * hardware.sm_count
    why = (f"{stages} stages of {block_rows}x{width} tiles ({stages * tile // 8 // 1024} "
           f"KiB), {warps} consumer warps, about {used} registers a thread, "
           f"{programs} programs ({blocks} an SM)"
           + (", weights in registers" if hoist and weights else ""))  # fmt: skip
    if fallbacks:
        why += f"; short of registers: {', '.join(fallbacks)}"
    if plan.column_sums and block_rows > 1:
        why += "; column sums kept by row of the tile" if tiled else "; column sums added a step"
    return NormalizationParams(block_rows, width, warps, True, programs, stages,
                               WARP_SPECIALIZED, hoist and bool(weights), tile_sums=tiled,
                               why=why)  # fmt: skip
