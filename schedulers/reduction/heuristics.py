"""A reduction's launch configuration (``ReductionParams``) and the heuristic of its
default, tiled strategy. The TMA strategy's is in ``schedulers.reduction.tma``."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.hardware import HardwareProfile
from schedulers.reduction.analysis import ReductionPlan
from schedulers.runtime import next_power_of_two

TILE_BITS = 16 * 1024 * 8  # a program's tile of the reduction input, per iteration
LINE_BITS = 128 * 8  # a cache line


@dataclass(frozen=True)
class ReductionParams:
    """Launch configuration of a reduction kernel (override any field to tune it)."""

    layout: str  # "inner" or "outer"
    block_rows: int  # inner: rows per program; outer: reduced rows per step
    block_reduce: int  # inner: reduced extent per step; outer: columns per program
    num_warps: int
    waves: int = 4  # outer: how many waves of programs the grid split aims for
    deterministic: bool = True
    stages: int = 1  # tiles in flight in the reduction loop (>1: Triton's async-copy pipeline)
    tma: bool = False  # outer: full-shape inputs loaded as TMA tiles (tensor descriptors)

    def __str__(self) -> str:
        fields = (
            f"layout={self.layout}, block_rows={self.block_rows}, "
            f"block_reduce={self.block_reduce}, num_warps={self.num_warps}"
        )
        if self.stages != 1:
            fields += f", stages={self.stages}"
        if self.tma:
            fields += ", tma=True"
        if self.layout == "outer":
            fields += f", waves={self.waves}, deterministic={self.deterministic}"
        return f"ReductionParams({fields})"


def tiled_params(
    plan: ReductionPlan, hardware: HardwareProfile, reduced_extent: int
) -> ReductionParams:
    """The tiled strategy (ordinary loads): a tile of about 16 KiB of the widest dtype;
    the reduced extent sets its width."""
    elements = TILE_BITS // plan.widest_bits
    if plan.layout == "inner":
        # At least two rows a tile: measured on H200 (row sums of 32768x4096 bf16),
        # 2x2048 tiles 0.89 of copy, 1x4096 0.84; 8 warps 0.88, 4 warps 0.81.
        block_reduce = min(next_power_of_two(reduced_extent), elements // 2)
        block_rows = max(1, elements // block_reduce)
        warps = 8 if hardware.arch >= 90 else 4
        return ReductionParams("inner", block_rows, block_reduce, num_warps=warps)
    # Each row of the tile one 128-byte line of the widest input: measured on H200
    # (bf16 column sums, N 256 to 65536), 64x64 tiles 0.85-0.94 of copy, 32x128
    # 0.83-0.91, 16x256 and 8x512 0.66-0.77.
    read_bits = max(t.dtype.bits for t in plan.inputs)
    block_columns = min(max(LINE_BITS // read_bits, 1), elements)
    block_rows = max(1, min(elements // block_columns, next_power_of_two(reduced_extent)))
    # Enough programs per SM to keep loads in flight, few enough that the partial
    # results stay small: measured on H200, 8 waves beat 4, 16 and 32 at every N; and
    # the next tile's loads issued before this one is summed (async copies, sm_80 on):
    # 2 stages 0.82-0.89 of copy, 1 stage 0.78-0.86, 4 stages 0.71-0.77.
    stages = 2 if hardware.arch >= 80 else 1
    return ReductionParams("outer", block_rows, block_columns, num_warps=4, waves=8,
                           stages=stages)  # fmt: skip
