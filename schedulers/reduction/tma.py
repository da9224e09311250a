"""The TMA strategy of outer reductions: full-shape inputs read as tiles through tensor
descriptors (sm_90 on), several stages of them in shared memory. ``tma_outer_tile``
sizes the tile for the shared memory; ``tma_params`` turns it into ``ReductionParams``
or says why a reduction cannot have it."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.analysis import NotSchedulable
from schedulers.hardware import HardwareProfile
from schedulers.reduction.analysis import ReductionPlan
from schedulers.reduction.heuristics import ReductionParams
from schedulers.runtime import next_power_of_two

# Outer reductions through TMA tiles (tensor descriptors): the tile starts at the
# largest box a descriptor takes and shrinks, the reduced side first, until the stages
# of every input's tile fit in shared memory beside the room kept for the accumulators'
# cross-warp scratch and the outputs.
TMA_BOX = 256  # a descriptor's box: at most 256 elements along each axis
TMA_STAGES = 3  # tiles of each input in flight
TMA_EXTRA_TILES = 1  # Triton 3.6 asks for one tile more than its stages (measured on
# H200: 262160 bytes of shared memory for three stages of a 64 KiB bf16 tile)
TMA_MIN_REDUCED = 8  # the reduced side shrinks no further
TMA_SCRATCH_WARPS = 4  # warps along the reduced side whose partials meet in shared memory
TMA_BARRIER_BITS = 1024 * 8  # the stages' barriers and alignment


def tma_params(
    plan: ReductionPlan, hardware: HardwareProfile, reduced: int, kept: int
) -> ReductionParams:
    """An outer reduction's params with TMA tiles (``tma_outer_tile``), or
    ``NotSchedulable`` saying why it cannot have them."""
    if plan.layout != "outer":
        raise NotSchedulable("TMA tiles are for outer (column) reductions")
    if hardware.arch and hardware.arch < 90:
        raise NotSchedulable(f"TMA needs sm_90 or later (sm_{hardware.arch})")
    tiled = [plan.inputs[i] for i in plan.tma_inputs]
    if not tiled:
        raise NotSchedulable("no input of the reduction's full shape to read as TMA tiles")
    for tensor in tiled:
        if tensor.dtype.storage_only:
            raise NotSchedulable(f"{tensor}: {tensor.dtype} codes are not read through TMA")
        if kept * tensor.dtype.bits % 128:
            raise NotSchedulable(
                f"{tensor}: rows of {kept} {tensor.dtype} are not a multiple of 16 bytes"
            )
    tile = tma_outer_tile(
        [t.dtype.bits for t in tiled], plan.accumulator.bits,
        [t.dtype.bits for t in plan.outputs], hardware, reduced, kept,
        plan.reduction.op_name,
    )  # fmt: skip
    # about 64 values of a tile a thread (the loaded tile and the accumulator)
    warps = min(16, max(4, tile.block_reduced * tile.block_kept // (64 * hardware.warp_size)))
    return ReductionParams("outer", tile.block_reduced, tile.block_kept, warps, waves=8,
                           stages=tile.stages, tma=True)  # fmt: skip


@dataclass(frozen=True)
class TmaTile:
    """An outer reduction's tile through TMA: rows along the reduced axes, columns along
    the kept ones, and the shared memory its stages take."""

    block_reduced: int
    block_kept: int
    stages: int
    buffer_bits: int  # every input's tiles, all stages (and the one Triton adds)
    reserved_bits: int  # accumulator scratch, outputs, barriers
    why: str


def tma_outer_tile(
    input_bits: list[int],
    accumulator_bits: int,
    output_bits: list[int],
    hardware: HardwareProfile,
    reduced_extent: int,
    kept_extent: int,
    op: str = "sum",
    stages: int = TMA_STAGES,
) -> TmaTile:
    """The tile of an outer reduction over inputs of ``input_bits`` (each read as TMA
    tiles of one shape). The shared memory (``stages`` tiles of each input, and the one
    more Triton allocates) is split between the inputs in proportion to their widths,
    after keeping back the accumulators' cross-warp scratch, a tile row of
    each output and the barriers. The tile starts at the descriptor's largest box (or
    the extents, rounded up to powers of two) and halves, the reduced side first (down
    to ``TMA_MIN_REDUCED`` rows), then the kept side (down to one 16-byte vector of the
    narrowest input: never a vector width of 1). Raises ``NotSchedulable`` when even the
    smallest tile does not fit, and for Welford (var_mean), whose three running values
    a column this path does not carry."""
    if op in ("var_mean", "welford"):
        raise NotSchedulable("Welford (var_mean) is not reduced through TMA tiles")
    if not input_bits:
        raise NotSchedulable("no input to load through TMA")
    if min(input_bits) < 8:
        raise NotSchedulable("sub-byte inputs are not loaded through TMA descriptors")
    smallest_kept = max(2, 128 // min(input_bits))  # one 16-byte vector of the narrowest
    kept = max(smallest_kept, min(TMA_BOX, next_power_of_two(kept_extent)))
    reduced = max(TMA_MIN_REDUCED, min(TMA_BOX, next_power_of_two(reduced_extent)))
    per_element = sum(input_bits)  # a tile element of every input

    def reserved(kept: int) -> int:
        return TMA_BARRIER_BITS + kept * (TMA_SCRATCH_WARPS * accumulator_bits + sum(output_bits))

    copies = stages + TMA_EXTRA_TILES

    def fits(reduced: int, kept: int) -> bool:
        return (
            copies * reduced * kept * per_element + reserved(kept) <= hardware.smem_per_block_bits
        )

    start = (reduced, kept)
    while not fits(reduced, kept) and reduced > TMA_MIN_REDUCED:
        reduced //= 2
    while not fits(reduced, kept) and kept > smallest_kept:
        kept //= 2
    if not fits(reduced, kept):
        need = (copies * reduced * kept * per_element + reserved(kept)) // 8
        raise NotSchedulable(
            f"the smallest TMA tile ({reduced}x{kept}, {len(input_bits)} inputs, {stages} "
            f"stages) needs {need} bytes of shared memory; the block has "
            f"{hardware.smem_per_block_bits // 8}"
        )
    buffer = copies * reduced * kept * per_element
    why = (
        f"{reduced}x{kept} tiles of {len(input_bits)} inputs, {stages} stages: "
        f"{buffer // 8 // 1024} KiB of {hardware.smem_per_block_bits // 8 // 1024} KiB "
        f"(from {start[0]}x{start[1]}; {reserved(kept) // 8} bytes kept back)"
    )
    return TmaTile(reduced, kept, stages, buffer, reserved(kept), why)
