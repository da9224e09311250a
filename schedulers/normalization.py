"""The inner persistent (normalization) scheduler: softmax, LayerNorm and RMSNorm forward.

It takes a group of exprs with one or more reductions over the same innermost axes
whose results are used back along the rows: ``x - max(x)``, ``x * rsqrt(mean(x*x))``.
Every tensor of the group is one of four kinds, by the axes of the space S (the
reductions' input shape) it runs along:

- *full*: rows and reduced columns (``x``, the output ``y``);
- *row*: the kept axes only (``mean``, ``rstd``; row outputs such as a saved mean);
- *column*: the reduced axes only (a LayerNorm ``weight``);
- *scalar*: neither.

Each program takes ``block_rows`` rows. When the row fits in registers
(``persistent``) the kernel loads every input once and runs straight through: each
reduction, the row values that follow from it, then the outputs. When it does not, the
kernel walks the row in steps of ``block_columns`` once per level of reductions (a
reduction whose input needs another's result is one level deeper) and once more for
the outputs, re-reading its inputs (from L2, mostly): Triton has no explicit
shared-memory buffer to stage a row in.

The reduced extent is a ``tl.constexpr`` (``COLUMNS``): a kernel is specialised on it
(a symbolic reduced extent cost 32 % in a measured Triton RMSNorm), never on the
number of rows, so a new batch size reuses it. Reductions accumulate in float32
(float64 for float64) and round once to their dtype, as the reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fusion.dtypes import DataType, float4_e2m1, float32, float64
from fusion.exprs import Expr, ReductionOp, VarMeanOp
from fusion.ir import TensorView
from schedulers.analysis import POINTWISE, NotSchedulable, map_into_space
from schedulers.cache import KERNEL_CACHE
from schedulers.codegen import (
    COMBINE,
    COMPILE_OPTIONS,
    TRITON_TYPES,
    Emitter,
    Value,
    check_supported,
    kernel_source,
    reduce_call,
    reduction_identity,
)
from schedulers.hardware import HardwareProfile
from schedulers.runtime import as_bytes, cdiv, next_power_of_two, tma_descriptor

OCCUPANCY_TARGET = 0.25  # of the SM's warps: enough loads in flight for memory-bound rows
MAX_REGISTERS = 255  # a thread's registers; more spill to local memory
OTHER_REGISTERS = 40  # indices, masks, pointers, reduction temporaries (an estimate)
CHUNK_VALUES = 16  # values a thread per buffer when the row does not fit (chunked)
PIPELINE_REGISTERS = 128  # at most this many estimated: room for the pipelined loads
COMBINE_COLUMNS = 32  # column sums: columns a program of the combining kernel
COMBINE_PARTS = 256  # and partial rows it adds per step

MULTIWAVE, WARP_SPECIALIZED = "multiwave", "warp_specialized"
STRATEGIES = (MULTIWAVE, WARP_SPECIALIZED)
# Warp-specialized parameters, from sweeps on H200 (RMSNorm/LayerNorm backward, bf16,
# 1024-16384 columns; benchmarks/results/norms_ws_sweep.json): three stages as fast as
# four and much faster than two (0.50-0.65 of copy); a tile of about 32 KiB (8 rows of
# 1024, 2 of 4096, 1 of 8192: two tiles in flight); the fewest consumer warps that leave
# a thread at most two 128-bit vectors of a row (1024: 4 warps, two programs an SM,
# 0.57/0.49 of copy against 0.49/0.33 with 8 warps and one).
WS_MAX_STAGES = 3  # tiles in a warp-specialized kernel's circular buffer, at most
WS_MAX_BLOCKS = 2  # programs an SM, at most
WS_SCRATCH_BITS = 16 * 1024 * 8  # shared memory kept back: reductions' scratch, layouts
WS_INFLIGHT_BITS = 64 * 1024 * 8  # loads a program keeps in flight: the unroll stops there
WS_OVERSHOOT = 1.25  # degenerate when the register estimate passes this times the
# registers a thread may have. RMSNorm backward at 16384 columns (1.06 times over)
# spills a little and beats the multi-wave kernel in every run (0.71-0.72 against
# 0.67 of copy on H200); LayerNorm backward there (1.31 times over) spills more and its
# time was bimodal across runs, the same kernel 0.50 or 1.25 ms on H200 (0.60 or 1.69 on
# H100), against a steady 0.71 ms for the multi-wave one: it falls back.
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


@dataclass(frozen=True)
class NormalizationParams:
    """Launch configuration of a normalization kernel (override any field to tune it)."""

    block_rows: int  # rows a program
    block_columns: int  # columns a step (a power of two); >= the row when persistent
    num_warps: int
    persistent: bool  # the whole row in registers, inputs loaded once
    programs: int = 0  # >0: a grid of this many programs walking the rows
    stages: int = 1  # >1 (a persistent row, programs > 0): the next rows' loads go out
    # while this one is computed (Triton's async-copy pipeline over the walk); with the
    # warp-specialized strategy, the tiles of its circular buffer
    strategy: str = MULTIWAVE  # or WARP_SPECIALIZED: a persistent grid whose producer
    # warps load the full-shape inputs' tiles with TMA for the consumer warps
    column_registers: bool = False  # (programs > 0) column inputs (weights) loaded once,
    # before the walk, and kept in registers
    why: str = field(default="", compare=False)  # the heuristic's reasons

    def __str__(self) -> str:
        text = (
            f"NormalizationParams(block_rows={self.block_rows}, "
            f"block_columns={self.block_columns}, num_warps={self.num_warps}, "
            f"persistent={self.persistent}"
        )
        text += f", programs={self.programs}" if self.programs else ""
        text += f", stages={self.stages}" if self.stages != 1 else ""
        text += f", strategy={self.strategy!r}" if self.strategy != MULTIWAVE else ""
        text += ", column_registers=True)" if self.column_registers else ")"
        return f"{text} [{self.why}]" if self.why else text


@dataclass
class NormalizationPlan:
    """What the kernel computes; independent of extents."""

    column_sums: list[Expr]  # sums over the rows (a backward's dweight): partials per program
    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    rank: int  # of S
    reduced: int  # how many innermost axes of S are reduced
    kinds: dict[TensorView, str]  # "full", "row", "column" or "scalar"
    reductions: list[Expr]  # ReductionOp and VarMeanOp, in order
    levels: dict[TensorView, int]  # reduction outputs: passes over the row they need
    space: TensorView  # a tensor of shape S (the first reduction's input)

    @property
    def depth(self) -> int:
        """Passes over the row the reductions need (1: independent reductions only)."""
        return max(self.levels.values())

    @property
    def buffers(self) -> int:
        """Full-row inputs a persistent kernel keeps in registers."""
        return max(1, sum(1 for t in self.inputs if self.kinds[t] == "full"))


class NormalizationScheduler:
    name = "normalization"

    # -- analysis --------------------------------------------------------------------

    def plan(
        self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
    ) -> NormalizationPlan:
        all_reductions = [e for e in exprs if isinstance(e, (ReductionOp, VarMeanOp))]
        if not all_reductions:
            raise NotSchedulable("no reduction")
        last = all_reductions[0].inputs[0].ndim
        reductions = [e for e in all_reductions if last - 1 in e.dims]  # row reductions
        columns = [e for e in all_reductions if e not in reductions]  # sums over the rows
        if not reductions:
            raise NotSchedulable("no reduction along the rows")
        for expr in exprs:
            if not isinstance(expr, (*POINTWISE, ReductionOp, VarMeanOp)):
                raise NotSchedulable(f"{expr.op_name} is not pointwise or a reduction")
        check_supported([e for e in exprs if isinstance(e, POINTWISE)])
        space = reductions[0].inputs[0]
        rank = space.ndim
        reduced = len(reductions[0].dims)
        if reduced == 0 or rank == reduced:
            raise NotSchedulable("a normalization keeps some axes and reduces the innermost")
        trailing = tuple(range(rank - reduced, rank))
        for expr in reductions:
            (source,) = expr.inputs
            if source.ndim != rank or tuple(expr.dims) != trailing:
                raise NotSchedulable(f"{expr.op_name} does not reduce the innermost axes of S")
            if source.shape != space.shape:
                raise NotSchedulable(f"{source} and {space} have different shapes")
            if not all(o.dtype.is_floating and not o.dtype.storage_only for o in expr.outputs):
                raise NotSchedulable(f"{expr.op_name} of {source.dtype}: floats only")
        for expr in columns:
            (source,) = expr.inputs
            if expr.op_name != "sum" or tuple(expr.dims) != tuple(range(rank - reduced)):
                raise NotSchedulable(f"{expr.op_name} over {list(expr.dims)}: column sums only")
            if source.shape != space.shape or not expr.output.dtype.is_floating:
                raise NotSchedulable(f"{expr.op_name} of {source}: a float column sum of S")
            if expr.output not in outputs or any(u in exprs for u in expr.output.uses):
                raise NotSchedulable(f"{expr.output}: a column sum must be an output, unused")
        roots = {out: self._root(out, space, reduced) for out in outputs}
        mappings = map_into_space(exprs, roots, reduced_axes=trailing)
        for tensor in inputs:
            if tensor not in mappings:
                raise NotSchedulable(f"{tensor} is not read by the kernel")
        row_axes, column_axes = set(range(rank - reduced)), set(trailing)
        kinds = {}
        for tensor, mapping in mappings.items():
            present = [a for a in mapping if a is not None]
            if present != sorted(present):
                raise NotSchedulable(f"{tensor} runs along S's axes out of order")
            covered = set(present)
            if covered == row_axes | column_axes:
                kinds[tensor] = "full"
            elif covered == row_axes:
                kinds[tensor] = "row"
            elif covered == column_axes:
                kinds[tensor] = "column"
            elif not covered:
                kinds[tensor] = "scalar"
            else:
                raise NotSchedulable(f"{tensor} runs along only some of the kept or reduced axes")
        column_outputs = {e.output for e in columns}
        for out in outputs:
            if kinds[out] not in ("full", "row") and out not in column_outputs:
                raise NotSchedulable(f"{out} is an output along the reduced axes only")
            if out.dtype is float4_e2m1:
                raise NotSchedulable("fp4 outputs of a normalization")
        if not any(kinds[t] == "full" for t in [*inputs, *outputs]):
            raise NotSchedulable("no input or output of the full shape")
        levels = _levels(exprs)
        used_back = any(
            kinds.get(out) == "full" and any(levels.get(t, 0) > 0 for t in e.inputs)
            for e in exprs
            if isinstance(e, POINTWISE)
            for out in e.outputs
        )
        if not used_back:
            raise NotSchedulable("no reduction result is used back along the rows")
        reduction_outputs = [t for e in reductions for t in e.outputs]  # in order
        return NormalizationPlan(
            columns,
            exprs,
            inputs,
            outputs,
            rank,
            reduced,
            kinds,
            reductions,
            {t: levels[t] for t in reduction_outputs},
            space,
        )

    @staticmethod
    def _root(out: TensorView, space: TensorView, reduced: int) -> tuple[int | None, ...]:
        rank = space.ndim
        if out.ndim == rank - reduced and out.shape == space.shape[: rank - reduced]:
            return tuple(range(rank - reduced))
        if out.ndim == reduced and out.shape == space.shape[rank - reduced :]:
            return tuple(range(rank - reduced, rank))  # a column sum
        if out.ndim == rank and all(
            a == b or (a == 1 and d >= rank - reduced)
            for d, (a, b) in enumerate(zip(out.shape, space.shape, strict=True))
        ):
            return tuple(
                None if a == 1 and b != 1 else d
                for d, (a, b) in enumerate(zip(out.shape, space.shape, strict=True))
            )
        raise NotSchedulable(f"{out} has neither the shape of {space} nor of its rows")

    # -- heuristics ------------------------------------------------------------------

    strategies = STRATEGIES

    def configure(
        self, plan: NormalizationPlan, hardware: HardwareProfile, shape_of, strategy="auto"
    ):
        """The heuristics' params for the local shapes ``shape_of(tensor)`` gives."""
        return self.heuristics(plan, hardware, shape_of(plan.space), strategy)

    def launcher(self, plan: NormalizationPlan, params, hardware: HardwareProfile, shape_of):
        return self.build(plan, params)

    def heuristics(
        self,
        plan: NormalizationPlan,
        hardware: HardwareProfile,
        shape: list[int],
        strategy: str = "auto",
    ) -> NormalizationParams:
        """The launch configuration for S's ``shape``. ``strategy`` forces one strategy
        (``MULTIWAVE`` or ``WARP_SPECIALIZED``, no fallback: a warp-specialized kernel
        that cannot be built raises ``NotSchedulable`` saying why); ``"auto"`` takes the
        warp-specialized one where ``WS_GAINS`` records a gain for this architecture
        and number of column sums and each program walks enough rows, and falls
        back to the multi-wave one when the warp-specialized parameters are degenerate
        (one stage, or too few registers left)."""
        if strategy not in ("auto", *STRATEGIES):
            raise ValueError(f"strategy {strategy!r}: one of 'auto', {', '.join(STRATEGIES)}")
        rank = len(shape)
        columns = math.prod(shape[rank - plan.reduced :])
        rows = math.prod(shape[: rank - plan.reduced])
        if strategy == WARP_SPECIALIZED:
            chosen = self._warp_specialized(plan, hardware, columns, rows)
            if isinstance(chosen, str):
                raise NotSchedulable(f"the warp-specialized strategy (forced): {chosen}")
            return chosen
        multiwave = self._multiwave(plan, hardware, columns, rows)
        if strategy == MULTIWAVE:
            return multiwave
        gains = WS_GAINS.get(hardware.arch, {})
        if len(plan.column_sums) not in gains:
            why = (f"no warp-specialized gain recorded for sm_{hardware.arch} with "
                   f"{len(plan.column_sums)} column sums")  # fmt: skip
            return replace(multiwave, why=f"multi-wave ({why}): {multiwave.why}")
        chosen = self._warp_specialized(plan, hardware, columns, rows)
        if isinstance(chosen, str):
            return replace(multiwave, why=f"multi-wave (warp-specialized fell back: "
                                          f"{chosen}): {multiwave.why}")  # fmt: skip
        walked = cdiv(rows, chosen.programs)
        threshold = gains[len(plan.column_sums)]
        if walked < threshold:
            why = (f"{walked} rows a program, fewer than the {threshold} that amortize a "
                   "warp-specialized program's weights and partial sums")  # fmt: skip
            return replace(multiwave, why=f"multi-wave ({why}): {multiwave.why}")
        return replace(chosen, why=f"warp-specialized ({walked} rows a program, at least "
                                   f"{threshold}): {chosen.why}")  # fmt: skip

    def _warp_specialized(
        self, plan: NormalizationPlan, hardware: HardwareProfile, columns: int, rows: int
    ) -> NormalizationParams | str:
        """The warp-specialized parameters, or why there are none. A loop grows, while
        shared memory and registers allow: the circular buffer's stages (up to
        ``WS_MAX_STAGES``), then the consumer warp groups (4 to 16 warps, until a thread
        holds at most two 128-bit vectors of a row), then the rows a tile (until
        ``WS_INFLIGHT_BITS`` are in flight, without passing the registers a thread may
        have); the block width is the whole row (a persistent row). Short of registers
        it first reads the weights inside the walk, then takes fewer rows a tile. The
        number of rows plays no part: one compiled kernel serves every batch size."""
        if hardware.arch and hardware.arch < 90:
            return f"tensor-memory-accelerator loads need sm_90 or later (sm_{hardware.arch})"
        full = [t for t in plan.inputs if plan.kinds[t] == "full"]
        if not full:
            return "no input of the full shape to load through TMA"
        for tensor in full:
            if tensor.dtype.storage_only or tensor.dtype.bits < 8:
                return f"{tensor}: {tensor.dtype} codes are not loaded through descriptors"
            if columns * tensor.dtype.bits % 128:
                return (f"{tensor}: a row of {columns} {tensor.dtype} is not a multiple of "
                        "16 bytes (TMA strides)")  # fmt: skip
        width = next_power_of_two(columns)
        if width * min(t.dtype.bits for t in full) < 128:
            return f"a tile {width} wide is narrower than 16 bytes"
        row_bits = width * sum(t.dtype.bits for t in full)  # a tile row, every buffered input
        budget = hardware.smem_per_block_bits - WS_SCRATCH_BITS
        vector = max(1, 128 // max(t.dtype.bits for t in full))  # values of a 16-byte load
        weights = sum(1 for t in plan.inputs if plan.kinds[t] == "column")

        def registers(warps: int, block_rows: int, hoist: bool) -> int:
            threads = warps * hardware.warp_size
            values = max(1, block_rows * width // threads)
            per_row = max(1, width // threads)  # a column vector's values a thread
            sums = len(plan.column_sums) * per_row
            return plan.buffers * values + sums + hoist * weights * per_row + OTHER_REGISTERS

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
        used = registers(warps, block_rows, hoist)
        tile = block_rows * row_bits
        if stages < 2:
            return (f"degenerate: one stage (a tile of {tile // 8 // 1024} KiB, "
                    f"{budget // 8 // 1024} KiB of shared memory for the buffer)")  # fmt: skip
        if used > WS_OVERSHOOT * limit(warps):
            return (f"degenerate: about {used} registers a thread, over {WS_OVERSHOOT} times "
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
        return NormalizationParams(block_rows, width, warps, True, programs, stages,
                                   WARP_SPECIALIZED, hoist and bool(weights), why=why)  # fmt: skip

    def _multiwave(
        self, plan: NormalizationPlan, hardware: HardwareProfile, columns: int, rows: int
    ) -> NormalizationParams:
        """Enumerate persistent batch sizes (values a thread holds per buffered row) and
        rank them by, in order: reaching the occupancy target, at least four 128-bit
        vectors a thread (measured on H200, forward, 32 bf16 a thread against 16:
        LayerNorm 0.92 against 0.84 of copy at 4096 columns, 0.94 against 0.82 at 8192;
        RMSNorm 0.92-0.94 either way; earlier, 16 against 8: 0.95 against 0.84), the
        row dividing evenly into the threads'
        vectors, registers left for other values, fewer waves, higher occupancy.
        The number of rows only ranks waves. With column sums, a wave
        of programs walks the rows, loads pipelined three deep (0.90 against 0.78 of
        copy for RMSNorm backward at 4096) unless registers are short."""
        width = next_power_of_two(max(columns, 1))
        vector = max(1, 128 // max(t.dtype.bits for t in plan.inputs))
        candidates = []
        for warps in (1, 2, 4, 8, 16):
            threads = warps * hardware.warp_size
            for block_rows in (1, 2, 4, 8, 16, 32, 64):
                # per thread, per buffered row (a tile smaller than a warp: one value)
                values = max(1, block_rows * width // threads)
                if (block_rows * width < threads and warps > 1) or block_rows * width > 65536:
                    continue
                if block_rows > 1 and block_rows > next_power_of_two(rows):
                    continue
                # buffered rows, plus a program's partial column sums when it keeps any
                sums = len(plan.column_sums) * max(1, width // threads)
                registers = plan.buffers * values + sums + OTHER_REGISTERS
                if registers > MAX_REGISTERS:
                    continue
                candidate = _Candidate.of(hardware, warps, block_rows, width, columns, rows,
                                          vector, registers)  # fmt: skip
                if candidate.occupancy > 0:  # a block whose registers fit an SM at all
                    candidates.append(candidate)
        if not candidates:
            return self._chunked(plan, hardware, columns)
        # With column sums a wave of programs walks the rows, a reduction or two a row
        # each step: there a row within one warp (no shared memory in its reductions)
        # ranks second instead of the two-vector criterion (RMSNorm backward at 1024 on
        # H200: 0.55 of copy with 8 warps of a row each, 0.34 with 16 warps over 2 rows,
        # 0.14 with 2 warps over 1).
        walks = bool(plan.column_sums)
        best = min(candidates, key=lambda candidate: candidate.rank(walks))
        why = f"{best.describe()}; best of {len(candidates)} persistent candidates"
        programs, stages = 0, 1
        if plan.column_sums:  # one wave of programs, each summing its rows' columns
            programs = best.blocks * hardware.sm_count
            why += f"; {programs} programs keep column partial sums (one wave)"
            # the pipeline keeps its stages' tiles in shared memory: half the block's
            # budget at most (the rest for the reductions' scratch)
            tile_bits = sum(best.block_rows * width * t.dtype.bits
                            for t in plan.inputs if plan.kinds[t] == "full")  # fmt: skip
            fitting = [k for k in (3, 2) if k * tile_bits <= hardware.smem_per_block_bits // 2]
            if hardware.arch >= 80 and best.registers <= PIPELINE_REGISTERS and fitting:
                stages = fitting[0]
                why += f", the next rows' loads pipelined {stages} deep"
        return NormalizationParams(best.block_rows, width, best.warps, True, programs, stages,
                                   why=why)  # fmt: skip

    @staticmethod
    def _chunked(plan, hardware, columns: int) -> NormalizationParams:
        """Rows re-read once per pass: a grid small enough that the rows in flight stay
        in half the L2, so the passes after the first read from L2, not memory."""
        warps = 16
        step = min(next_power_of_two(columns), CHUNK_VALUES * warps * hardware.warp_size)
        row_bits = columns * sum(t.dtype.bits for t in plan.inputs if plan.kinds[t] == "full")
        fitting = hardware.l2_bits // 2 // max(row_bits, 1)
        programs = max(hardware.sm_count, min(4 * hardware.sm_count, fitting))
        why = (
            f"a row of {columns} does not fit in registers ({plan.buffers} buffered "
            f"inputs, at most {MAX_REGISTERS} registers a thread): {plan.depth + 1} passes "
            f"of {step} columns; {programs} programs walk the rows so those in flight "
            f"({programs * row_bits // 8 // 2**20} MiB) stay in half the L2"
        )
        return NormalizationParams(1, step, warps, False, programs, why=why)

    # -- code ------------------------------------------------------------------------

    def source(self, plan: NormalizationPlan, params: NormalizationParams) -> str:
        """The kernel's Triton source: no extent in it (``COLUMNS`` is a constexpr)."""
        pointers = {t: f"in{i}" for i, t in enumerate(plan.inputs)}
        targets = [f"out{i}" for i in range(len(plan.outputs))]
        persistent = params.persistent
        walking = persistent and params.programs > 0  # a fixed grid walks persistent rows
        specialized = params.strategy == WARP_SPECIALIZED
        if specialized and not walking:
            raise ValueError(f"{params}: warp specialization needs persistent rows and programs")
        if params.column_registers and not walking:
            raise ValueError(f"{params}: weights in registers need persistent rows and programs")
        # full-shape inputs arrive as TMA descriptors of (rows, COLUMNS) in the
        # warp-specialized kernel
        tiles = {t for t in plan.inputs if specialized and plan.kinds[t] == "full"}
        outer = Emitter()
        outer.line("pid = tl.cast(row_block, tl.int64)")
        outer.line("rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
        outer.line("row_mask = rows < row_count")
        row_cache: dict[TensorView, Value] = {}
        generator = _Generator(plan, pointers, outer, row_cache, tiles)
        early = outer.nested()  # before the walk: weights kept in registers
        if params.column_registers:
            generator.columns(early, "0", rows=False)
            for tensor in plan.inputs:
                if plan.kinds[tensor] == "column":
                    generator.value(_Step(early, row_cache), tensor)
        if persistent:
            generator.columns(outer, "0")
            step = _Step(outer, row_cache)  # one step: everything shares one cache
        for level in range(1, plan.depth + 1):
            group = [t for t, v in plan.levels.items() if v == level]
            if persistent:
                for tensor in group:
                    generator.reduce_persistent(step, tensor)
                continue
            accumulators = {t: generator.accumulator(t) for t in group}
            body = generator.loop()
            for tensor in group:
                generator.accumulate(body, tensor, accumulators[tensor])
            generator.close(body)
            for tensor in group:
                generator.finish(tensor, accumulators[tensor])
        full = [(i, t) for i, t in enumerate(plan.outputs) if plan.kinds[t] == "full"]
        sums = [(i, e) for i, e in enumerate(plan.column_sums)]
        partials = [f"part{i}" for i, _ in sums]
        before, after = [], []  # around the walk over the rows (column sums)
        if full or sums:
            body = step if persistent else generator.loop()
            for i, tensor in full:
                value = generator.value(body, tensor)
                shaped = f"tl.broadcast_to({value.name}, (BLOCK_ROWS, BLOCK_COLUMNS))"
                body.emit.line(
                    f"tl.store({targets[i]} + offs, "
                    f"{body.emit.stored(Value(shaped, value.dtype))}, mask=mask)"
                )
            for i, expr in sums:
                (source,) = expr.inputs
                term = body.emit.as_compute(generator.value(body, source), float32)
                column = body.emit.assign(f"tl.sum(tl.where(mask, {term}, 0.0), 0)")
                if persistent:  # this program's partial sums stay in registers
                    before.append(f"colsum{i} = tl.zeros((BLOCK_COLUMNS,), tl.float32)")
                    body.emit.line(f"colsum{i} = colsum{i} + {column}")
                    after.append(
                        f"tl.store(part{i} + tl.program_id(0).to(tl.int64) * COLUMNS "
                        "+ tl.arange(0, BLOCK_COLUMNS), "
                        f"colsum{i}, mask=tl.arange(0, BLOCK_COLUMNS) < COLUMNS)"
                    )
                else:  # its row of partial sums, in memory (zeroed before the launch)
                    row = body.emit.assign(
                        f"part{i} + tl.program_id(0).to(tl.int64) * COLUMNS + cols", "p"
                    )
                    body.emit.line(
                        f"tl.store({row}, tl.load({row}, mask=col_mask, other=0.0) + {column}, "
                        "mask=col_mask)"
                    )
            if not persistent:
                generator.close(body)
        for i, tensor in enumerate(plan.outputs):
            if plan.kinds[tensor] != "row":
                continue
            value = generator.value(_Step(outer, row_cache), tensor)
            outer.line(
                f"tl.store({targets[i]} + rows[:, None], {outer.stored(value)}, "
                "mask=row_mask[:, None])"
            )
        comment = (
            f"# normalization: {len(plan.reductions)} reductions in {plan.depth} levels, "
            f"{'persistent' if persistent else 'chunked'}"
            + (", warp-specialized (TMA tiles)" if specialized else "")
        )
        if params.programs:  # a fixed grid walks the row blocks
            blocks = "tl.program_id(0), tl.cdiv(row_count, BLOCK_ROWS), tl.num_programs(0)"
            if (params.stages > 1 or specialized) and persistent:
                options = f", num_stages={params.stages}"
                options += ", warp_specialize=True" if specialized else ""
                walk = f"for row_block in tl.range({blocks}{options}):"
            else:
                walk = f"for row_block in range({blocks}):"
            lines = [*before, *early.lines, walk, *(f"    {line}" for line in outer.lines),
                     *after]  # fmt: skip
        else:
            if sums:
                raise ValueError(f"{params}: column sums need a fixed grid (programs > 0)")
            lines = ["row_block = tl.program_id(0)", *outer.lines]
        arguments = [*pointers.values(), *targets, *partials]
        constants = ["COLUMNS", "BLOCK_ROWS", "BLOCK_COLUMNS"]
        return kernel_source("normalization_kernel", arguments, ["row_count"], constants, lines,
                             comment)  # fmt: skip

    def combine_source(self, plan: NormalizationPlan, index: int) -> str:
        """The column sums' second kernel: each program's partial row added in a fixed
        order (deterministic), rounded once to the output's dtype."""
        expr = plan.column_sums[index]
        emit = Emitter()
        emit.line("cols = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)")
        emit.line("col_mask = cols < COLUMNS")
        emit.line("acc = tl.zeros((PARTS, BLOCK_COLUMNS), tl.float32)")
        emit.line("for first in range(0, programs, PARTS):")
        emit.line("    parts = first + tl.arange(0, PARTS)")
        emit.line(
            "    acc += tl.load(partial + parts[:, None] * COLUMNS + cols[None, :], "
            "mask=(parts < programs)[:, None] & col_mask[None, :], other=0.0)"
        )
        value = emit.rounded("tl.sum(acc, 0)", float32, expr.output.dtype)
        emit.line(f"tl.store(out + cols, {emit.stored(value)}, mask=col_mask)")
        constants = ["COLUMNS", "BLOCK_COLUMNS", "PARTS"]
        return kernel_source("combine_kernel", ["partial", "out"], ["programs"], constants,
                             emit.lines)  # fmt: skip

    def constants(
        self, plan: NormalizationPlan, params: NormalizationParams, columns: int
    ) -> dict[str, int]:
        return {"COLUMNS": columns, "BLOCK_ROWS": params.block_rows,
                "BLOCK_COLUMNS": params.block_columns}  # fmt: skip

    def kernels(self, plan: NormalizationPlan, params: NormalizationParams, columns: int):
        """``(name, source, constants, num_warps)`` of each kernel a launch runs."""
        kernels = [("normalization_kernel", self.source(plan, params),
                    self.constants(plan, params, columns), params.num_warps)]  # fmt: skip
        for i in range(len(plan.column_sums)):
            constants = {"COLUMNS": columns, "BLOCK_COLUMNS": COMBINE_COLUMNS,
                         "PARTS": COMBINE_PARTS}  # fmt: skip
            kernels.append(("combine_kernel", self.combine_source(plan, i), constants, 8))
        return kernels

    def build(self, plan: NormalizationPlan, params: NormalizationParams):
        """A launcher ``(inputs, outputs, shapes)`` for this plan and params."""
        if params.block_columns & (params.block_columns - 1) or params.block_rows < 1:
            raise ValueError(f"{params}: block_columns must be a power of two")
        source = self.source(plan, params)
        kernel = KERNEL_CACHE.get(source, "normalization_kernel")
        combines = [
            KERNEL_CACHE.get(self.combine_source(plan, i), "combine_kernel")
            for i in range(len(plan.column_sums))
        ]
        sum_outputs = [plan.outputs.index(e.output) for e in plan.column_sums]
        tiles = [i for i, t in enumerate(plan.inputs)
                 if params.strategy == WARP_SPECIALIZED and plan.kinds[t] == "full"]  # fmt: skip

        def launch(inputs: list[torch.Tensor], outputs: list[torch.Tensor], shapes) -> None:
            shape = _space_shape(plan, shapes)
            columns = math.prod(shape[plan.rank - plan.reduced :])
            rows = math.prod(shape[: plan.rank - plan.reduced])
            if rows == 0:
                return
            if columns == 0:
                raise ValueError(
                    "a normalization over rows of 0 columns: generated kernels do not run "
                    "it; use kernels='reference'"
                )
            if params.persistent and columns > params.block_columns:
                raise ValueError(
                    f"{params} holds {params.block_columns} columns; the row has {columns}"
                )
            pointers = [as_bytes(t) for t in (*inputs, *outputs)]
            box = [params.block_rows, params.block_columns]
            for i in tiles:
                pointers[i] = tma_descriptor(pointers[i], rows, columns, box, params)
            grid = (cdiv(rows, params.block_rows),)
            if params.programs:
                grid = (min(grid[0], params.programs),)
            # one row of float32 partial column sums per program (zeroed when the row is
            # walked in chunks: each chunk adds into it)
            allocate = torch.empty if params.persistent else torch.zeros
            partials = [
                allocate((grid[0], columns), dtype=torch.float32, device=inputs[0].device)
                for _ in plan.column_sums
            ]
            kernel[grid](*pointers, *partials, rows, COLUMNS=columns,
                         BLOCK_ROWS=params.block_rows, BLOCK_COLUMNS=params.block_columns,
                         num_warps=params.num_warps, **COMPILE_OPTIONS)  # fmt: skip
            for combine, partial, index in zip(combines, partials, sum_outputs, strict=True):
                combine[(cdiv(columns, COMBINE_COLUMNS),)](partial, outputs[index],
                    grid[0], COLUMNS=columns, BLOCK_COLUMNS=COMBINE_COLUMNS, PARTS=COMBINE_PARTS,
                    num_warps=8, **COMPILE_OPTIONS)  # fmt: skip

        launch.forms = lambda: []
        return launch


# -- helpers -------------------------------------------------------------------------


def _levels(exprs: list[Expr]) -> dict[TensorView, int]:
    """How many reductions deep each tensor is (0: it needs no reduction's result)."""
    levels: dict[TensorView, int] = {}
    for expr in exprs:
        below = max((levels.get(t, 0) for t in expr.inputs), default=0)
        if isinstance(expr, VarMeanOp):
            var, mean = expr.outputs
            levels[mean] = below + 1
            levels[var] = below + 2  # the variance sums squares about the mean
        elif isinstance(expr, ReductionOp) and expr.inputs[0].ndim - 1 in expr.dims:
            levels[expr.outputs[0]] = below + 1
        elif isinstance(expr, ReductionOp):  # a column sum: no pass of its own
            levels[expr.outputs[0]] = below
        else:
            for out in expr.outputs:
                levels[out] = below
    return levels


def _space_shape(plan: NormalizationPlan, shapes) -> list[int]:
    for tensor, shape in shapes.items():
        if plan.kinds.get(tensor) == "full" and len(shape) == plan.rank:
            return list(shape)
    raise ValueError("no tensor of the normalization's full shape")


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
    busy: bool  # at least four 128-bit vectors a thread per buffered row
    in_warp: bool  # a row within one warp, at most 32 values a thread per buffered row

    @classmethod
    def of(cls, hardware, warps, block_rows, width, columns, rows, vector, registers):
        threads = warps * hardware.warp_size
        by_registers = hardware.registers_per_sm // (registers * threads)
        blocks = max(0, min(32, hardware.max_warps_per_sm // warps, by_registers))
        occupancy = blocks * warps / hardware.max_warps_per_sm
        lanes = threads // block_rows  # threads along one row
        even = lanes * vector <= width and columns % (lanes * vector) == 0
        programs = cdiv(max(rows, 1), block_rows)
        waves = cdiv(programs, max(1, blocks) * hardware.sm_count)
        values = max(1, block_rows * width // threads)
        return cls(warps, block_rows, values, registers, occupancy,
                   occupancy >= OCCUPANCY_TARGET, even, waves, blocks,
                   values >= 4 * vector, lanes <= 32 and values <= 32)  # fmt: skip

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


@dataclass
class _Step:
    """Where values of one walk over the columns are emitted, and those already there."""

    emit: Emitter
    cache: dict[TensorView, Value]


class _Generator:
    """Emits a normalization kernel's values: full and column values in a step, row
    values (reductions and what follows from them) once, outside any loop."""

    def __init__(self, plan, pointers, outer: Emitter, row_cache, tiles=frozenset()) -> None:
        self.plan, self.pointers, self.outer, self.row_cache = plan, pointers, outer, row_cache
        self.tiles = tiles  # inputs passed as TMA descriptors of (rows, COLUMNS)
        self.means: dict[Expr, str] = {}  # var_mean: its float32 mean, unrounded

    # Columns of a step: offsets, masks.
    @staticmethod
    def columns(emit: Emitter, start: str, rows: bool = True) -> None:
        emit.line(f"cols = {start} + tl.arange(0, BLOCK_COLUMNS)")
        emit.line("col_mask = cols < COLUMNS")
        if rows:
            emit.line("mask = row_mask[:, None] & col_mask[None, :]")
            emit.line("offs = rows[:, None] * COLUMNS + cols[None, :]")

    def loop(self) -> _Step:
        body = self.outer.nested()
        self.columns(body, "start")
        return _Step(body, {})

    def close(self, step: _Step) -> None:
        self.outer.block("for start in range(0, COLUMNS, BLOCK_COLUMNS):", step.emit)

    # Values.
    def value(self, step: _Step, tensor: TensorView) -> Value:
        kind = self.plan.kinds[tensor]
        if kind in ("row", "scalar") and step.cache is not self.row_cache:
            return self.value(_Step(self.outer, self.row_cache), tensor)
        if tensor in step.cache:
            return step.cache[tensor]
        emit = step.emit
        if tensor in self.pointers:
            pointer = self.pointers[tensor]
            if tensor in self.tiles:
                value = emit.load_tile(tensor, pointer, "row_block * BLOCK_ROWS, 0")
            elif kind == "full":
                value = emit.load(tensor, pointer, "offs", "mask")
            elif kind == "column":
                loaded = emit.load(tensor, pointer, "cols", "col_mask")
                value = Value(emit.assign(f"{loaded.name}[None, :]"), tensor.dtype)
            elif kind == "row":
                loaded = emit.load(tensor, pointer, "rows", "row_mask")
                value = Value(emit.assign(f"{loaded.name}[:, None]"), tensor.dtype)
            else:
                loaded = emit.load(tensor, pointer, "rows * 0", "row_mask")
                value = Value(emit.assign(f"{loaded.name}[:, None]"), tensor.dtype)
            step.cache[tensor] = value
            return value
        producer = tensor.definition
        if isinstance(producer, (ReductionOp, VarMeanOp)):
            raise AssertionError(f"{tensor} is used before its reduction finished")
        operands = [
            self.value(step, o) if isinstance(o, TensorView) else o for o in producer.operands
        ]
        for out, value in zip(producer.outputs, emit.expr(producer, operands), strict=True):
            step.cache[out] = value
        return step.cache[tensor]

    # Reductions.
    def _term(self, step: _Step, tensor: TensorView) -> tuple[Expr, str, str, DataType]:
        """The masked term a reduction output sums (or maxes) in a step."""
        producer = tensor.definition
        (source,) = producer.inputs
        accumulator = _accumulator(tensor.dtype)
        value = step.emit.as_compute(self.value(step, source), accumulator)
        if isinstance(producer, VarMeanOp) and tensor is producer.outputs[0]:
            mean = self.means[producer]
            centred = step.emit.assign(f"{value} - {mean}")
            value = step.emit.assign(f"{centred} * {centred}")
        op = "sum" if isinstance(producer, VarMeanOp) else producer.op_name
        identity = reduction_identity(op, accumulator)
        term = step.emit.assign(f"tl.where(mask, {value}, {identity})")
        return producer, op, term, accumulator

    def reduce_persistent(self, step: _Step, tensor: TensorView) -> None:
        producer, op, term, accumulator = self._term(step, tensor)
        reduced = step.emit.assign(reduce_call(term, 1, COMBINE[op], keep_dims=True))
        self._finish(producer, tensor, op, reduced, accumulator)

    def accumulator(self, tensor: TensorView) -> str:
        producer = tensor.definition
        op = "sum" if isinstance(producer, VarMeanOp) else producer.op_name
        accumulator = _accumulator(tensor.dtype)
        identity = reduction_identity(op, accumulator)
        return self.outer.assign(
            f"tl.full((BLOCK_ROWS, BLOCK_COLUMNS), {identity}, {TRITON_TYPES[accumulator.name]})",
            "acc",
        )

    def accumulate(self, step: _Step, tensor: TensorView, accumulator: str) -> None:
        _, op, term, _ = self._term(step, tensor)
        step.emit.line(f"{accumulator} = {COMBINE[op]}({accumulator}, {term})")

    def finish(self, tensor: TensorView, accumulator: str) -> None:
        producer = tensor.definition
        op = "sum" if isinstance(producer, VarMeanOp) else producer.op_name
        reduced = self.outer.assign(reduce_call(accumulator, 1, COMBINE[op], keep_dims=True))
        self._finish(producer, tensor, op, reduced, _accumulator(tensor.dtype))

    def _finish(self, producer, tensor, op, reduced: str, accumulator: DataType) -> None:
        emit = self.outer
        count = f"tl.full((), COLUMNS, {TRITON_TYPES[accumulator.name]})"
        if isinstance(producer, VarMeanOp):
            var, mean = producer.outputs
            if tensor is mean:
                result = emit.assign(f"div({reduced}, {count})")
                self.means[producer] = result
            else:
                kind = TRITON_TYPES[accumulator.name]
                divisor = f"tl.full((), COLUMNS - {producer.correction}, {kind})"
                result = emit.assign(f"div({reduced}, {divisor})")
        elif op == "mean":
            result = emit.assign(f"div({reduced}, {count})")
        else:
            result = reduced
        self.row_cache[tensor] = emit.rounded(result, accumulator, tensor.dtype)


def _accumulator(dtype: DataType) -> DataType:
    """Reductions of floats accumulate in float32 (float64 for float64)."""
    return float64 if dtype is float64 else float32
