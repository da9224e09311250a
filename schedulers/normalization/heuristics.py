"""A normalization's launch configuration (``NormalizationParams``) and the heuristics
of its multi-wave strategy (the row in registers, persistent, when it fits, walked in
chunks when it does not). The split strategy's (a row too long for one program's
registers split over several programs that exchange their partial reductions) are in
``schedulers.normalization.split``, the warp-specialized strategy's in
``schedulers.normalization.warp_specialized``."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusion.ir import TensorView
from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.runtime import cdiv, next_power_of_two

OCCUPANCY_TARGET = 0.25  # of the SM's warps: enough loads in flight for memory-bound rows
MAX_REGISTERS = 255  # a thread's registers; more spill to local memory
OTHER_REGISTERS = 40  # indices, masks, pointers, reduction temporaries (an estimate)
CHUNK_VALUES = 16  # values a thread per buffer when the row does not fit (chunked)
# A thread's 128-bit vectors a buffered row that keep its loads busy, ranking the
# multi-wave candidates without column sums (``multiwave_params``): two (16 bf16), four
# (32) for a variance on fast memory. Twice the warps over the row (16 values a thread
# against 32; .devtmp A/B at 5e80526, results/norms_busy_vectors_ab_{h100,h200}_
# 5e80526.json, every output checked first), fraction of copy: H100, RMSNorm and
# LayerNorm forward level or ahead at 256-8192 columns (LayerNorm 32768x4096 0.983
# against 0.972, 16384x8192 0.981 against 0.977, 32768x1024 0.898 against 0.872; RMSNorm
# 16384x8192 0.990 against 0.984, 32768x1024 0.911 against 0.900), but RMSNorm 4096x2048
# 0.679 against 0.693 (a 16 us kernel); H200 RMSNorm the same (32768x4096 0.967 against
# 0.947, 32768x1024 0.873 against 0.852, 65536x512 0.876 against 0.838; 4096x2048 0.576
# against 0.587), H200 LayerNorm far behind where its rows are long (32768x4096 0.878
# against 0.941, 16384x8192 0.851 against 0.960; earlier, 0.84 against 0.92 and 0.82
# against 0.94); softmax forward and backward level or ahead on both (H100 65536x512
# forward 0.928 against 0.918; H200 4096x4096 0.756 against 0.741), but the H100's
# forward at 16384x2048 0.919 against 0.924.
BUSY_VECTORS = 2
BUSY_VECTORS_VARIANCE_FAST = 4
PIPELINE_REGISTERS = 128  # at most this many estimated: room for the pipelined loads
SPILL_ALLOWANCE = 1.25  # a block whose register estimate passes its share of the register
# file (what a thread may have for one block an SM) by at most this factor is compiled at
# that share, spilling a little; the estimate never passes MAX_REGISTERS. H100, RMSNorm
# backward 8192x16384 (1.06 times over at 16 warps, 128 registers and 18 spilled): 0.91
# of copy with one row of 16 warps a program, against 0.82 with 8 warps (232 estimated)
# and 0.84 warp-specialized (norms_bwd_sweep_h100_9e850ea.json); LayerNorm backward
# there (1.31 times over) 0.18, forced with norms.py --params on the H200
# (norms_bwd16384_h200_f7d4d24.json; the same in a probe on the H100, not kept).

TILE_SUM_VALUES = 32  # column sums: each row of a block keeps its own partial sums
# (``tile_sums``) when that tile is at most this many values a thread. H100, backward at
# 32768x1024 (norms_sweep_h100_ae335a5.json), RMSNorm / LayerNorm, fraction of copy:
# warp-specialized 8x1024 tiles over 8 consumer warps (32 values) 0.84 / 0.76; over 4
# warps (64 values) 0.63 / 0.38, against 0.74 / 0.67 with the sums added every step;
# multi-wave 16 warps x 16 rows (32 values) 0.57 against 0.49 added every step.
MULTIWAVE, WARP_SPECIALIZED, SPLIT = "multiwave", "warp_specialized", "split"
COLUMN_WALK = "column_walk"  # ``schedulers.normalization.column_sums``
STRATEGIES = (MULTIWAVE, WARP_SPECIALIZED, SPLIT, COLUMN_WALK)


@dataclass(frozen=True)
class NormalizationParams:
    """Launch configuration of a normalization kernel (override any field to tune it)."""

    block_rows: int  # rows a program
    block_columns: int  # columns a step (a power of two); >= the row when persistent
    num_warps: int
    persistent: bool  # the whole row in registers, inputs loaded once
    programs: int = 0  # >0: a grid of this many programs walking the rows
    stages: int = 1  # >1 (a persistent row, programs > 0, or a split row): the next
    # rows' loads go out while this one is computed (Triton's pipeline over the walk);
    # with the warp-specialized strategy, the tiles of its circular buffer
    strategy: str = MULTIWAVE  # or WARP_SPECIALIZED: a persistent grid whose producer
    # warps load the full-shape inputs' tiles with TMA for the consumer warps (on Triton
    # 3.6, sm_90: TMA tiles pipelined by the same warps, ``warp_specialized``); or SPLIT
    column_registers: bool = False  # (programs > 0) column inputs (weights) loaded once,
    # before the walk, and kept in registers
    parts: int = 1  # (SPLIT) programs sharing a row, block_columns each; programs=0: as
    # many as the device holds at once, read from the compiled kernel (they wait for each
    # other). (COLUMN_WALK) the first kernel's programs a row, each reducing a part
    prefetch: bool = False  # (SPLIT) the next rows' full inputs loaded before this one's
    # partial reductions are exchanged
    tile_sums: bool = True  # (persistent, column sums) each row of the block keeps its
    # own float32 partial column sums, added across the block once after the walk (a
    # thread holds block_rows * block_columns / threads values a sum: as many as one
    # row replicated over the block's warps only where each thread holds one of the
    # block's rows); off: added every step (a reduction across the block's warps)
    tma: bool = False  # (SPLIT, stages > 1) the full inputs' slices loaded through TMA
    # descriptors into shared memory, the walk pipelined ``stages`` rows deep
    cluster: bool = False  # (SPLIT, compiled) a row's programs a thread-block cluster, their
    # partial reductions exchanged through its distributed shared memory
    rewiden: bool = False  # (SPLIT) the full inputs' bfloat16 bits kept across the
    # exchange and widened to float32 again after it, not their float32s and the values
    # made of them (fewer registers a thread: more programs an SM)
    column_bits: bool = False  # (column_registers) bfloat16 column inputs kept as their
    # bits across the walk, widened where used each row (half their registers)
    contract: bool = False  # the rows kernel's (``normalization_kernel``'s) multiplies and
    # adds contracted into fmas (off by default: an fma skips the product's rounding the
    # reference does; the combining and strips kernels never)
    one_pass: bool = False  # (SPLIT) a slice's variance from one reduction of its values
    # and their squares (its squares about its mean as their difference), reduced again
    # about its mean where that difference cancels more than ``ONE_PASS_LOSS`` allows
    max_registers: int = 0  # >0: the registers a thread of the kernel is held to (ptxas's
    # maxnreg; what does not fit spills), so more of its programs fit an SM
    strip_columns: int = 0  # (COLUMN_WALK) the second kernel's strips: columns a program
    strip_warps: int = 0  # walks down the rows (``programs`` of them), and its warps
    why: str = field(default="", compare=False)  # the heuristic's reasons

    @property
    def compile_options(self) -> dict:
        """The rows kernel's compile options beyond ``COMPILE_OPTIONS`` (Triton's names):
        ``max_registers`` as ``maxnreg``, ``contract`` as ``enable_fp_fusion``."""
        options: dict = {"maxnreg": self.max_registers} if self.max_registers else {}
        return options | ({"enable_fp_fusion": True} if self.contract else {})

    def __str__(self) -> str:
        text = (
            f"NormalizationParams(block_rows={self.block_rows}, "
            f"block_columns={self.block_columns}, num_warps={self.num_warps}, "
            f"persistent={self.persistent}"
        )
        text += f", programs={self.programs}" if self.programs else ""
        text += f", stages={self.stages}" if self.stages != 1 else ""
        text += f", strategy={self.strategy!r}" if self.strategy != MULTIWAVE else ""
        text += f", parts={self.parts}" if self.parts != 1 else ""
        text += ", prefetch=True" if self.prefetch else ""
        text += ", tile_sums=False" if not self.tile_sums else ""
        text += ", tma=True" if self.tma else ""
        text += ", cluster=True" if self.cluster else ""
        text += ", rewiden=True" if self.rewiden else ""
        text += ", column_bits=True" if self.column_bits else ""
        text += ", contract=True" if self.contract else ""
        text += ", one_pass=True" if self.one_pass else ""
        text += f", max_registers={self.max_registers}" if self.max_registers else ""
        if self.strip_columns:
            text += f", strip_columns={self.strip_columns}, strip_warps={self.strip_warps}"
        text += ", column_registers=True)" if self.column_registers else ")"
        return f"{text} [{self.why}]" if self.why else text


def multiwave_params(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int, rows: int
) -> NormalizationParams:
    """Enumerate persistent batch sizes (values a thread holds per buffered row) and
    rank them by, in order: reaching the occupancy target, enough 128-bit vectors a
    thread to keep its loads busy (``BUSY_VECTORS``; a variance on fast memory
    ``BUSY_VECTORS_VARIANCE_FAST``: measured on H200, forward, 32 bf16 a thread against
    16: LayerNorm 0.92 against 0.84 of copy at 4096 columns, 0.94 against 0.82 at 8192;
    earlier, 16 against 8: 0.95 against 0.84), the row dividing evenly into the threads'
    vectors, registers left for other values, fewer waves, higher occupancy.
    The number of rows only ranks waves. With column sums, a wave
    of programs walks the rows, loads pipelined three deep (0.90 against 0.78 of
    copy for RMSNorm backward at 4096) unless registers are short."""
    width = next_power_of_two(max(columns, 1))
    vector = max(1, 128 // max(t.dtype.bits for t in plan.inputs))
    fast = fast_memory(hardware)
    busy = BUSY_VECTORS_VARIANCE_FAST if plan.variance and fast else BUSY_VECTORS
    candidates = []
    for warps in (1, 2, 4, 8, 16):
        threads = warps * hardware.warp_size
        for block_rows in (1, 2, 4, 8, 16, 32, 64):
            if (block_rows * width < threads and warps > 1) or block_rows * width > 65536:
                continue
            if block_rows > 1 and block_rows > next_power_of_two(rows):
                continue
            if block_rows > threads:  # every row needs a thread (a row of one column)
                continue
            # buffered rows, plus a program's partial column sums when it keeps any
            registers = walk_registers(plan, hardware, width, warps, block_rows, False, False)
            if registers > MAX_REGISTERS:
                continue
            candidate = _Candidate.of(hardware, warps, block_rows, width, columns, rows,
                                      vector, registers, busy * vector)  # fmt: skip
            if candidate.occupancy > 0:  # a block whose registers fit an SM at all
                candidates.append(candidate)
    if not candidates:
        return chunked_params(plan, hardware, columns)
    # With column sums a wave of programs walks the rows, a reduction or two a row
    # each step: there at most a warp's threads a row (``in_warp``) ranks second instead
    # of the two-vector criterion (RMSNorm backward at 1024 on H200: 0.55 of copy with 8
    # warps over 8 rows, 0.34 with 16 warps over 2 rows, 0.14 with 2 warps over 1). It
    # does not keep a row in one warp: Triton lays a tile's warps along its rows first
    # (8x1024 bf16 over 8 warps: warpsPerCTA [2, 4], a row over 4 warps; compiled for
    # sm_90), so the row's reductions still cross warps; the criterion stays for what it
    # measured.
    walks = bool(plan.column_sums)
    best = min(candidates, key=lambda candidate: candidate.rank(walks))
    why = f"{best.describe()}; best of {len(candidates)} persistent candidates"
    programs, stages = 0, 1
    if plan.column_sums:  # one wave of programs, each summing its rows' columns
        programs = best.blocks * hardware.sm_count
        why += f"; {programs} programs keep column partial sums (one wave)"
        # the pipeline keeps its stages' tiles in shared memory: half the block's
        # budget at most (the rest for the reductions' scratch)
        tile_bits = best.block_rows * width * full_bits(plan)
        fitting = [k for k in (3, 2) if k * tile_bits <= hardware.smem_per_block_bits // 2]
        if hardware.arch >= 80 and best.registers <= PIPELINE_REGISTERS and fitting:
            stages = fitting[0]
            why += f", the next rows' loads pipelined {stages} deep"
    # (the candidates were ranked without the tile's registers: at 1024 columns 16 warps
    # x 16 rows, 32 values a thread a sum, measured 0.57 of copy against 0.49 added a step)
    tiled = tile_sums_fit(plan, best.block_rows, width, best.warps, hardware)
    if plan.column_sums and best.block_rows > 1:
        why += ", column sums kept by row of the block" if tiled else ", column sums added a step"
    return NormalizationParams(best.block_rows, width, best.warps, True, programs, stages,
                               tile_sums=tiled, why=why)  # fmt: skip


# Column sums over rows of this many columns (the kernel's block width: 513-1024 columns;
# measured at 1000 and 1024) on this architecture, with 16-bit full inputs (measured with
# bf16): where the warp-specialized kernel would be taken (RMSNorm and LayerNorm backward
# measured; any fusion with one or two column sums, WS_GAINS's, takes it), a wave of programs
# walks the rows instead: SHORT_ROWS rows a tile, SHORT_VALUES values a thread a buffered
# row (two 128-bit vectors; 4 warps at 1024 columns), SHORT_BLOCKS programs an SM, loads
# pipelined SHORT_STAGES deep, weights in registers, partial sums by row of the tile, where
# each program walks at least SHORT_WALK rows. Rows the warp-specialized kernel refuses
# (a row not a multiple of 16 bytes, for TMA) keep the multi-wave kernel: not measured.
#
# Fraction of copy, 32768x1024 / 8192x1024, against the warp-specialized kernel (8x1024
# tiles, 8 warps, one program an SM; results/sweep1024b_{h200,h100}_f80a9d6.json, every
# output checked first): H200 LayerNorm backward 0.80 / 0.52 against 0.74 / 0.47, RMSNorm
# 0.87 / 0.64 against 0.82 / 0.59; H100 LayerNorm 0.84 / 0.65 against 0.83 / 0.60,
# RMSNorm 0.90 / 0.74 against 0.88 / 0.70. Four programs an SM: level or below on the
# H200, below on the H100 (LayerNorm 0.78 against 0.84); five or six (they do not fit the
# registers together): below three everywhere (0.63-0.84 at 32768 rows); 8 warps over 2
# or 4 rows, 4 warps over 1 or 4, 2 warps over 1 or 2: below. ncu on the H200
# (LayerNorm): the warp-specialized kernel's 241 registers a thread leave 8 warps an SM,
# issue slots 60 % busy, DRAM 66 %; the walk's kernels take 112-127 (three programs: 12
# warps). Rows a warp each, (rows, chunks, 256) tiles with no exchange between warps:
# 0.64-0.71 on the H200 (results/probe3d_h200_f80a9d6.json).
SHORT_ROW_COLUMNS: dict[int, int] = {90: 1024}
SHORT_ROWS, SHORT_VALUES, SHORT_BLOCKS, SHORT_STAGES = 2, 16, 3, 3
SHORT_WALK = 16  # rows a program: 8192 rows walk 21 on 396 programs (132 SMs, measured);
# 4096 walk 11 (not taken); 12-20 not measured


def short_row_params(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int, rows: int
) -> NormalizationParams | None:
    """The walk ``SHORT_ROW_COLUMNS`` gives column sums over ``rows`` rows of
    ``columns`` on ``hardware``, or None where it does not apply or fit."""
    width = next_power_of_two(max(columns, 1))
    full = plan.full_inputs
    if (SHORT_ROW_COLUMNS.get(hardware.arch) != width or not plan.column_sums or not full
            or any(t.dtype.bits != 16 or t.dtype.storage_only for t in full)):  # fmt: skip
        return None
    threads = SHORT_ROWS * width // SHORT_VALUES
    warps = threads // hardware.warp_size
    programs = SHORT_BLOCKS * hardware.sm_count
    if warps < 1 or cdiv(rows, programs) < SHORT_WALK:
        return None
    weights = weight_inputs(plan)
    registers = walk_registers(plan, hardware, width, warps, SHORT_ROWS, bool(weights), True)
    tile_bits = SHORT_ROWS * width * full_bits(plan)
    # the SM's programs together: its registers, and its shared memory (on Hopper about
    # what one block may ask for: 228 KiB against 227)
    if (SHORT_BLOCKS * registers * threads > hardware.registers_per_sm
            or SHORT_BLOCKS * SHORT_STAGES * tile_bits > hardware.smem_per_block_bits):  # fmt: skip
        return None
    why = (f"{SHORT_ROWS}x{width} tiles over {warps} warps ({SHORT_VALUES} values a thread a "
           f"buffer, about {registers} registers), {programs} programs ({SHORT_BLOCKS} an SM, "
           f"{cdiv(rows, programs)} rows each) keep column partial sums by row of the tile, "
           f"the next rows' loads pipelined {SHORT_STAGES} deep, weights in registers")  # fmt: skip
    return NormalizationParams(SHORT_ROWS, width, warps, True, programs, SHORT_STAGES,
                               column_registers=bool(weights), why=why)  # fmt: skip


def weight_inputs(plan: NormalizationPlan) -> int:
    """How many inputs are column vectors (weights, biases): loaded once a program where
    they are kept in registers."""
    return sum(1 for t in plan.inputs if plan.kinds[t] == "column")


def walk_registers(
    plan: NormalizationPlan,
    hardware: HardwareProfile,
    width: int,
    warps: int,
    block_rows: int,
    weights_held: bool,
    tiled: bool,
) -> int:
    """Estimated registers a thread of a persistent walk over ``block_rows`` x ``width``
    tiles on ``warps`` warps: each buffered input's values, the column sums' (a value a
    thread of the tile where ``tiled``, of one row otherwise), the weights' where
    ``weights_held``, and ``OTHER_REGISTERS``."""
    threads = warps * hardware.warp_size
    values = max(1, block_rows * width // threads)
    per_row = max(1, width // threads)  # a column vector's values a thread
    sums = len(plan.column_sums) * (values if tiled else per_row)
    weights = weight_inputs(plan) * per_row if weights_held else 0
    return plan.buffers * values + sums + weights + OTHER_REGISTERS


def full_bits(plan: NormalizationPlan) -> int:
    """Bits of one column of every full-shape input (a row of them: times its columns)."""
    return sum(t.dtype.bits for t in plan.full_inputs)


def tile_sums_fit(
    plan: NormalizationPlan, block_rows: int, width: int, warps: int, hardware: HardwareProfile
) -> bool:
    """Whether each row of a block may keep its own partial column sums: the block's
    tile is at most ``TILE_SUM_VALUES`` values a thread (without column sums, or with
    one row a block, the kernel is the same either way)."""
    if not plan.column_sums or block_rows == 1:
        return True
    return block_rows * width <= TILE_SUM_VALUES * warps * hardware.warp_size


def chunked_params(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int
) -> NormalizationParams:
    """Rows re-read once per pass: a grid small enough that the rows in flight stay
    in half the L2, so the passes after the first read from L2, not memory."""
    warps = 16
    step = min(next_power_of_two(columns), CHUNK_VALUES * warps * hardware.warp_size)
    row_bits = columns * full_bits(plan)
    fitting = hardware.l2_bits // 2 // max(row_bits, 1)
    programs = max(hardware.sm_count, min(4 * hardware.sm_count, fitting))
    why = (
        f"a row of {columns} does not fit in registers ({plan.buffers} buffered "
        f"inputs, at most {MAX_REGISTERS} registers a thread): {plan.depth + 1} passes "
        f"of {step} columns; {programs} programs walk the rows so those in flight "
        f"({programs * row_bits // 8 // 2**20} MiB) stay in half the L2"
    )
    return NormalizationParams(1, step, warps, False, programs, why=why)


# A forward whose variance needs its mean first (LayerNorm's), over rows of at least this
# many columns, walks them in steps of this many, 16 warps and a program a row, on a
# device whose memory moves at least this many GB/s, where the rows its programs hold at
# once stay in half the L2 (the later walks read them there, "evict_last"). H200,
# LayerNorm forward 8192x16384: 0.95 of copy against 0.87 in registers, 0.74-0.80 with a
# grid of 528 programs walking the rows; at 4096x32768 (33 MiB held, over half the L2)
# 0.78 against 0.75, not taken. H100: 0.96 against 0.98: the H200 only (results/
# norms_lnfwdchunk_h200_*_75d68b1.json, norms_chunked_{h200,h100}_75d68b1.json). Rows
# too long for registers are split, as on the H100: 4096x65536, 0.82 of copy against
# 0.75 in chunks, twice, since the exchange is in the rows' layout (0.70-0.71 against
# 0.75-0.76 before; norms_lnfwd_long_h200_*_6b9ab9f.json). Measured with one 16-bit
# full input (bf16): the rule is for those.
VARIANCE_CHUNKS = 16384
FORWARD_STEP = 4096
FAST_MEMORY_GBPS = 4000.0  # the H200 (4300), not the H100 (3000); also WS_SHORT_ROW_GAINS
# A forward of one level of reductions (RMSNorm's) walks rows of at least this many
# columns the same way there: H200 16384x8192 0.97-0.98 of copy against 0.95 in
# registers, 8192x16384 0.96 (three runs) against 0.94-0.95, where torch.compile read
# 0.93-0.98 (norms_fwdprobe_h200_{0d4e56a,e630232}.json, norms_chunked_h200_75d68b1.json);
# H100 level (0.97-0.99 against 0.98-0.99). At 65536 the split stays (0.80-0.81 either
# way); softmax (two levels, no variance) is not measured and keeps its kernels.
PLAIN_CHUNKS = 8192


def fast_memory(hardware: HardwareProfile) -> bool:
    """Whether ``hardware``'s memory is fast (``FAST_MEMORY_GBPS``: the H200, not the
    H100)."""
    return hardware.memory_gbps >= FAST_MEMORY_GBPS


def _walked_from(plan: NormalizationPlan, hardware: HardwareProfile) -> int | None:
    """The fewest columns from which a forward (no column sums, one 16-bit full input)
    walks its rows in chunks on ``hardware``: ``VARIANCE_CHUNKS`` with a variance,
    ``PLAIN_CHUNKS`` with one level of reductions; None otherwise."""
    if plan.column_sums or full_bits(plan) > 16 or not fast_memory(hardware):
        return None
    if plan.variance:
        return VARIANCE_CHUNKS
    return PLAIN_CHUNKS if plan.depth == 1 else None


# A forward with a variance over rows of at least this many columns that fit the
# registers but are not walked (the rows held at once would pass half the L2) is split
# on such a device: H200 LayerNorm forward 8192x32768 0.83 of copy split against 0.77 in
# registers, 4096x32768 0.82 against 0.74-0.75 (three runs, results/norms_lnfwd_long_
# h200_*_6b9ab9f.json, norms_fwd32k_{h200,h100_*}_6f71824.json); the H100 keeps the
# registers (0.97 / 0.94 against 0.86-0.88 / 0.80-0.82 split), and so does RMSNorm (one
# level) on the H200 (0.88-0.90 against 0.82-0.83).
VARIANCE_SPLIT = 32768


def splits_variance(plan: NormalizationPlan, hardware: HardwareProfile, columns: int) -> bool:
    """Whether a forward's rows of ``columns`` that fit the registers are split
    (``VARIANCE_SPLIT``)."""
    return _walked_from(plan, hardware) == VARIANCE_CHUNKS and columns >= VARIANCE_SPLIT


def forward_chunks(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int
) -> NormalizationParams | None:
    """The chunked params ``VARIANCE_CHUNKS`` and ``PLAIN_CHUNKS`` say a row of
    ``columns`` takes, or None."""
    least = _walked_from(plan, hardware)
    if least is None or columns < least:
        return None
    step, warps = FORWARD_STEP, 16
    held = hardware.max_warps_per_sm // warps * hardware.sm_count * columns * full_bits(plan)
    if held > hardware.l2_bits // 2:
        return None
    why = (f"a forward over rows of {columns} on a device of {hardware.memory_gbps:.0f} "
           f"GB/s: {plan.depth + 1} walks of {step} columns, a program a row, the rows "
           f"held at once ({held // 8 // 2**20} MiB) in half the L2")  # fmt: skip
    return NormalizationParams(1, step, warps, False, 0, why=why)


def tma_inputs(plan: NormalizationPlan, params: NormalizationParams) -> list[TensorView]:
    """The inputs a kernel of ``params`` takes as TMA descriptors of (rows, COLUMNS), read
    in (block_rows, block_columns) tiles: the full-shape ones of a warp-specialized
    kernel, or of a split row with ``tma``."""
    if params.strategy != WARP_SPECIALIZED and not params.tma:
        return []
    return plan.full_inputs


def tma_refusal(
    plan: NormalizationPlan, hardware: HardwareProfile, columns: int, width: int
) -> str | None:
    """Why the full-shape inputs cannot be loaded through TMA descriptors in rows of
    ``columns``, tiles ``width`` wide, on ``hardware``, or None."""
    if hardware.arch and hardware.arch < 90:
        return f"tensor-memory-accelerator loads need sm_90 or later (sm_{hardware.arch})"
    if not plan.full_inputs:
        return "no input of the full shape to load through TMA"
    for tensor in plan.full_inputs:
        if tensor.dtype.storage_only or tensor.dtype.bits < 8:
            return f"{tensor}: {tensor.dtype} codes are not loaded through descriptors"
        if columns * tensor.dtype.bits % 128:
            return (f"{tensor}: a row of {columns} {tensor.dtype} is not a multiple of "
                    "16 bytes (TMA strides)")  # fmt: skip
        if width * tensor.dtype.bits < 128:
            return f"a tile {width} wide is narrower than 16 bytes"
    return None


@dataclass
class _Candidate:
    warps: int
    block_rows: int
    values: int  # per thread, per buffered row
    registers: int
    occupancy: float
    reaches: bool
    even: bool
    waves: int
    blocks: int  # programs an SM holds at once
    busy: bool  # enough values a thread per buffered row to keep its loads busy
    in_warp: bool  # at most a warp's threads a row (not a row a warp: see
    # ``multiwave_params``), at most 32 values a thread per buffered row

    @classmethod
    def of(cls, hardware, warps, block_rows, width, columns, rows, vector, registers,
           busy_values):  # fmt: skip
        threads = warps * hardware.warp_size
        share = min(MAX_REGISTERS, hardware.registers_per_sm // threads)  # one block an SM
        compiled = share if share < registers <= SPILL_ALLOWANCE * share else registers
        blocks = hardware.blocks_per_sm(warps, compiled)
        occupancy = blocks * warps / hardware.max_warps_per_sm
        lanes = threads // block_rows  # threads along one row
        even = lanes * vector <= width and columns % (lanes * vector) == 0
        programs = cdiv(max(rows, 1), block_rows)
        waves = cdiv(programs, max(1, blocks) * hardware.sm_count)
        values = max(1, block_rows * width // threads)
        return cls(warps, block_rows, values, registers, occupancy,
                   occupancy >= OCCUPANCY_TARGET, even, waves, blocks,
                   values >= busy_values, lanes <= 32 and values <= 32)  # fmt: skip

    def rank(self, walks: bool) -> tuple:
        """Sort key, best first; ``walks``: a fixed grid walks the rows (column sums)."""
        left = MAX_REGISTERS - self.registers
        second = self.in_warp if walks else self.busy
        return (not self.reaches, not second, not self.even, -left, self.waves,
                -self.occupancy)  # fmt: skip

    def describe(self) -> str:
        return (
            f"{self.warps} warps x {self.block_rows} rows: {self.values} values a thread "
            f"a buffer, about {self.registers} registers, occupancy {self.occupancy:.2f} "
            f"({'reaches' if self.reaches else 'below'} {OCCUPANCY_TARGET}), the row "
            f"{'divides' if self.even else 'does not divide'} evenly, {self.waves} waves"
        )
