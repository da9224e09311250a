"""The reduction scheduler: a sum, max, min or mean with pointwise ops before and after.

The reduction's input space S is cut into iteration axes (kept) and reduced axes,
which must be the innermost axes (an *inner*, row reduction) or the outermost ones (an
*outer*, column reduction). Pointwise ops before the reduction (the prologue) run on
each tile as it is loaded; ops after it (the epilogue) run on the reduced values.

- Inner: each program takes ``block_rows`` rows and walks their reduced extent in
  tiles of ``block_reduce``, accumulating in float32 (int64 for integer sums).
- Outer: the reduced extent is split over the grid so there are a few waves of
  programs even when few columns remain; each program writes float32 partial results
  and a second kernel combines them in a fixed order: deterministic. With
  ``deterministic=False`` (sums only) partial sums are added atomically instead.

``block_reduce`` depends on the reduced extent; nothing depends on the iteration
extent, so a new batch size reuses the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusion.dtypes import DataType, compute_dtype, float64, int64
from fusion.exprs import Expr, ReductionOp
from fusion.ir import TensorView
from schedulers.analysis import POINTWISE, NotSchedulable, map_into_space
from schedulers.cache import ALIGN_ELEMENTS, AlignedVariants, forms_used
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

TILE_BITS = 16 * 1024 * 8  # a program's tile of the reduction input, per iteration
LINE_BITS = 128 * 8  # a cache line
COMBINE_COLUMNS = 32  # outer, deterministic: kept positions per program of the combine
COMBINE_PARTS = 256  # and partial rows it combines per step (few steps: each waits on memory)
COMBINE_WARPS = 8
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
TILE_CONSTANTS = ["BLOCK_KEPT", "BLOCK_REDUCED"]  # both kernels' constexpr arguments


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


@dataclass
class ReductionPlan:
    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    reduction: ReductionOp
    prologue: list[Expr]
    epilogue: list[Expr]
    mappings: dict[TensorView, tuple[int | None, ...]]  # into S (prologue) or kept space
    layout: str
    kept: list[int]  # axes of S that are kept, in order
    reduced: list[int]  # axes of S that are reduced

    @property
    def widest_bits(self) -> int:
        return max(t.dtype.bits for t in self.inputs + self.outputs)

    @property
    def accumulator(self) -> DataType:
        out = self.reduction.output.dtype
        if out.is_floating:
            return float64 if out is float64 else compute_dtype(out)
        return int64 if self.reduction.op_name == "sum" else out


def _split(exprs: list[Expr]) -> tuple[list[Expr], ReductionOp, list[Expr]]:
    reductions = [e for e in exprs if isinstance(e, ReductionOp)]
    if len(reductions) != 1:
        raise NotSchedulable(f"{len(reductions)} reductions (one is needed)")
    (reduction,) = reductions
    index = exprs.index(reduction)
    prologue, epilogue = exprs[:index], exprs[index + 1 :]
    for expr in prologue + epilogue:
        if not isinstance(expr, POINTWISE):
            raise NotSchedulable(f"{expr.op_name} beside a reduction")
    return prologue, reduction, epilogue


class ReductionScheduler:
    name = "reduction"

    def plan(
        self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
    ) -> ReductionPlan:
        prologue, reduction, epilogue = _split(exprs)
        check_supported(prologue + epilogue)
        if reduction.op_name in ("max", "min") and reduction.output.dtype.is_bool:
            raise NotSchedulable("max and min of bools")
        (source,) = reduction.inputs
        rank = source.ndim
        reduced = list(reduction.dims)
        kept = [d for d in range(rank) if d not in reduced]
        if reduced == list(range(rank - len(reduced), rank)):
            layout = "inner"
        elif reduced == list(range(len(reduced))):
            layout = "outer"
        else:
            raise NotSchedulable(f"reduced axes {reduced} are neither innermost nor outermost")
        result = reduction.output
        kept_identity = tuple(kept)  # the kept space is S restricted to the kept axes
        produced_after = {t for e in epilogue for t in e.outputs} | {result}
        for out in outputs:
            if out not in produced_after:
                raise NotSchedulable(f"{out} is computed before the reduction")
            if out.shape != result.shape:
                raise NotSchedulable(f"{out} has another shape than {result}")
        roots = {out: kept_identity for out in outputs if out is not result}
        mappings = map_into_space(epilogue, {**roots, result: kept_identity})
        prologue_map = map_into_space(prologue, {source: tuple(range(rank))})
        for tensor, mapping in prologue_map.items():
            if mappings.get(tensor, mapping) != mapping:
                raise NotSchedulable(f"{tensor} is used before and after the reduction")
            mappings[tensor] = mapping
        for tensor in inputs:
            if tensor not in mappings:
                raise NotSchedulable(f"{tensor} is not read along the reduction's axes")
        return ReductionPlan(
            exprs, inputs, outputs, reduction, prologue, epilogue, mappings, layout, kept, reduced
        )

    strategies = ("tiled", "tma")

    def configure(self, plan: ReductionPlan, hardware: HardwareProfile, shape_of, strategy="auto"):
        """The heuristics' params for the local shapes ``shape_of(tensor)`` gives;
        ``strategy="tma"`` forces an outer reduction through TMA tiles (no fallback),
        ``"tiled"`` the ordinary loads."""
        source = shape_of(plan.reduction.inputs[0])
        reduced = math.prod(self._reduced_extents(plan, shape_of))
        kept = math.prod(source[axis] for axis in plan.kept)
        if strategy not in ("auto", *self.strategies):
            raise ValueError(f"strategy {strategy!r}: one of 'auto', 'tiled', 'tma'")
        if strategy == "tma":
            return self.tma_params(plan, hardware, reduced, kept)
        return self.heuristics(plan, hardware, reduced)

    def tma_inputs(self, plan: ReductionPlan) -> list[int]:
        """Inputs an outer reduction reads as TMA tiles: those of S's full shape read
        before the reduction (the rest are loaded as before)."""
        source = plan.reduction.inputs[0]
        before = {t for e in plan.prologue for t in e.inputs} | {source}
        everything = tuple(range(source.ndim))
        return [i for i, t in enumerate(plan.inputs)
                if t in before and plan.mappings[t] == everything]  # fmt: skip

    def tma_params(
        self, plan: ReductionPlan, hardware: HardwareProfile, reduced: int, kept: int
    ) -> ReductionParams:
        """An outer reduction's params with TMA tiles (``tma_outer_tile``), or
        ``NotSchedulable`` saying why it cannot have them."""
        if plan.layout != "outer":
            raise NotSchedulable("TMA tiles are for outer (column) reductions")
        if hardware.arch and hardware.arch < 90:
            raise NotSchedulable(f"TMA needs sm_90 or later (sm_{hardware.arch})")
        tiled = [plan.inputs[i] for i in self.tma_inputs(plan)]
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

    def launcher(self, plan: ReductionPlan, params, hardware: HardwareProfile, shape_of):
        """``build`` for the local shapes ``shape_of(tensor)`` gives."""
        return self.build(plan, params, hardware, self._reduced_extents(plan, shape_of))

    @staticmethod
    def _reduced_extents(plan: ReductionPlan, shape_of) -> list[int]:
        source = shape_of(plan.reduction.inputs[0])
        return [source[axis] for axis in plan.reduced]

    def heuristics(
        self, plan: ReductionPlan, hardware: HardwareProfile, reduced_extent: int
    ) -> ReductionParams:
        """A tile of about 16 KiB of the widest dtype; the reduced extent sets its width."""
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

    # -- code ------------------------------------------------------------------------

    def _coordinates(self, emit: Emitter, index: str, axes: list[int], prefix: str) -> None:
        """Coordinates of a flat ``index`` over ``axes`` (runtime extents ``size_<axis>``).

        The outermost coordinate needs no remainder, so one axis costs no division (a
        64-bit division per element would dominate a memory-bound kernel).
        """
        emit.line(f"rest_{prefix} = {index}")
        for position, axis in enumerate(reversed(axes)):
            if position == len(axes) - 1:
                emit.line(f"{prefix}{axis} = rest_{prefix}")
                continue
            emit.line(f"{prefix}{axis} = rest_{prefix} % size{axis}")
            emit.line(f"rest_{prefix} = rest_{prefix} // size{axis}")

    def _offset(self, plan: ReductionPlan, i: int, axes: list[int], prefix: str) -> str:
        """Input ``i``'s offset along ``axes`` (coordinates ``<prefix><axis>``); a contiguous
        input steps by one along the axis of its innermost dimension."""
        mapping = plan.mappings[plan.inputs[i]]
        terms = [
            f"{prefix}{axis}" if axis == mapping[-1] else f"{prefix}{axis} * stride{i}_{axis}"
            for axis in axes
            if axis in mapping
        ]
        index = "kept_index" if prefix == "k" else "reduced_index"
        return " + ".join(terms) if terms else f"({index} * 0)"

    def aligned_arguments(self, plan: ReductionPlan) -> list[str]:
        """What an ``aligned`` kernel knows are multiples of ``ALIGN_ELEMENTS``: the count
        its mask compares the contiguous axis against, and the strides that appear in the
        source (the unit ones never do). See ``PointwiseScheduler.aligned_arguments``."""
        count = "reduced_count" if plan.layout == "inner" else "kept_count"
        return [count] + [
            f"stride{i}_{axis}"
            for i, tensor in enumerate(plan.inputs)
            for axis in plan.mappings[tensor]
            if axis is not None and axis != plan.mappings[tensor][-1]
        ]

    def constants(self, plan: ReductionPlan, params: ReductionParams) -> dict[str, int]:
        """The first kernel's ``tl.constexpr`` arguments: tile sizes, never an extent."""
        if plan.layout == "inner":
            return {"BLOCK_KEPT": params.block_rows, "BLOCK_REDUCED": params.block_reduce}
        return {"BLOCK_KEPT": params.block_reduce, "BLOCK_REDUCED": params.block_rows}

    def combine_constants(self, params: ReductionParams) -> dict[str, int]:
        """``combine_kernel``'s tile: ``COMBINE_COLUMNS`` kept positions (narrower than
        the first kernel's, so narrow outputs still spread over several programs) by
        ``COMBINE_PARTS`` partial rows per step, combined in a fixed tree order."""
        return {"BLOCK_KEPT": min(params.block_reduce, COMBINE_COLUMNS),
                "BLOCK_REDUCED": COMBINE_PARTS}  # fmt: skip

    def kernels(self, plan: ReductionPlan, params: ReductionParams, aligned: bool = False):
        """``(name, source, constants, num_warps)`` of each kernel a launch runs, in order."""
        kernels = [("reduction_kernel", self.source(plan, params, aligned),
                    self.constants(plan, params), params.num_warps)]  # fmt: skip
        if plan.layout == "outer":
            kernels.append(("combine_kernel", self.combine_source(plan, params, aligned),
                            self.combine_constants(params), COMBINE_WARPS))  # fmt: skip
        return kernels

    def _aligned_prologue(
        self, emit: Emitter, plan: ReductionPlan, runtime: list[str]
    ) -> list[str]:
        """Pitches arrive divided by ``ALIGN_ELEMENTS``; see ``AlignedVariants``."""
        known = self.aligned_arguments(plan)
        for name in known:
            emit.line(f"{name} = {name}_{ALIGN_ELEMENTS} * {ALIGN_ELEMENTS}")
        return [f"{name}_{ALIGN_ELEMENTS}" if name in known else name for name in runtime]

    def _start(self, plan: ReductionPlan, aligned: bool):
        """Both kernels' opening: parameters, the aligned prologue, this program's kept
        positions (``kept_index``, ``kept_mask``) and their coordinates."""
        emit = Emitter()
        ins, outs, runtime = _parameters(plan, plan.reduction.inputs[0].ndim)
        if aligned:
            runtime = self._aligned_prologue(emit, plan, runtime)
        emit.line("pid = tl.program_id(0).to(tl.int64)")
        emit.line("kept_index = pid * BLOCK_KEPT + tl.arange(0, BLOCK_KEPT)")
        emit.line("kept_mask = kept_index < kept_count")
        self._coordinates(emit, "kept_index", plan.kept, "k")
        return emit, ins, outs, runtime

    def source(self, plan: ReductionPlan, params: ReductionParams, aligned: bool = False) -> str:
        """The first (or only) kernel; ``aligned`` as in ``PointwiseScheduler.source``."""
        emit, ins, outs, runtime = self._start(plan, aligned)
        combine = COMBINE[plan.reduction.op_name]
        accumulator = plan.accumulator
        acc_type = TRITON_TYPES[accumulator.name]
        identity = reduction_identity(plan.reduction.op_name, accumulator)
        inner = plan.layout == "inner"
        if inner:
            emit.line("begin = 0")
            emit.line("end = reduced_count")
        else:
            emit.line("part = tl.program_id(1).to(tl.int64)")
            emit.line("rows_each = tl.cdiv(reduced_count, split)")
            emit.line("begin = part * rows_each")
            emit.line("end = tl.minimum(begin + rows_each, reduced_count)")
        shape = "(BLOCK_KEPT, BLOCK_REDUCED)" if inner else "(BLOCK_REDUCED, BLOCK_KEPT)"
        emit.line(f"acc = tl.full({shape}, {identity}, {acc_type})")
        body = emit.nested()  # the loop over the reduced extent; emit holds what precedes it
        body.line("reduced_index = start + tl.arange(0, BLOCK_REDUCED)")
        body.line("reduced_mask = reduced_index < end")
        self._coordinates(body, "reduced_index", plan.reduced, "r")
        if inner:
            body.line("mask = kept_mask[:, None] & reduced_mask[None, :]")
        else:
            body.line("mask = reduced_mask[:, None] & kept_mask[None, :]")
        values: dict[TensorView, Value] = {}
        source = plan.reduction.inputs[0]
        needed_before = {t for e in plan.prologue for t in e.inputs} | {source}
        tiles = self.tma_inputs(plan) if params.tma else []
        if params.tma and (inner or not tiles):
            raise ValueError(f"{params}: TMA tiles need an outer reduction of a full input")
        for i, tensor in enumerate(plan.inputs):
            if tensor not in needed_before:
                continue
            if i in tiles:  # a descriptor of (reduced_count, kept_count)
                at = "tl.cast(start, tl.int32), tl.cast(pid * BLOCK_KEPT, tl.int32)"
                values[tensor] = body.load_tile(tensor, ins[i], at)
                continue
            kept = self._offset(plan, i, plan.kept, "k")
            if not any(axis in plan.reduced for axis in plan.mappings[tensor]):
                # a weight along the kept axes: once, before the loop, not once a row
                loaded = emit.load(tensor, ins[i], emit.assign(kept, "idx"), "kept_mask")
                spread = f"{loaded.name}[:, None]" if inner else f"{loaded.name}[None, :]"
                values[tensor] = Value(emit.assign(spread), tensor.dtype)
                continue
            reduced = self._offset(plan, i, plan.reduced, "r")
            if inner:
                index = f"({kept})[:, None] + ({reduced})[None, :]"
            else:
                index = f"({reduced})[:, None] + ({kept})[None, :]"
            values[tensor] = body.load(tensor, ins[i], body.assign(index, "idx"), "mask")
        for expr in plan.prologue:
            operands = [values[o] if isinstance(o, TensorView) else o for o in expr.operands]
            for out, value in zip(expr.outputs, body.expr(expr, operands), strict=True):
                values[out] = value
        term = body.as_compute(values[source], accumulator)
        body.line(f"acc = {combine}(acc, tl.where(mask, {term}, {identity}))")
        if params.stages > 1:  # the next tiles' loads go out while this one is summed
            stages = f"num_stages={params.stages}"
            emit.block(f"for start in tl.range(begin, end, BLOCK_REDUCED, {stages}):", body)
        else:
            emit.block("for start in range(begin, end, BLOCK_REDUCED):", body)
        axis = 1 if inner else 0
        emit.line(f"reduced = {reduce_call('acc', axis, combine)}")
        if inner:
            self._finish(emit, plan, values={}, reduced="reduced", ins=ins, outs=outs)
        elif not params.deterministic:
            # Outer, atomics: add this part's partial sums into one row, in any order.
            emit.line("tl.atomic_add(partial + kept_index, reduced, mask=kept_mask)")
        else:
            # Outer: write this part's partial results; `combine_kernel` finishes them.
            emit.line("tl.store(partial + part * kept_count + kept_index, reduced, mask=kept_mask)")
        pointers = [*ins, *outs] if inner else ["partial", *ins]
        return kernel_source("reduction_kernel", pointers, runtime, TILE_CONSTANTS, emit.lines)

    def _finish(self, emit, plan, values, reduced, ins, outs) -> None:
        """Mean, rounding to the reduction's dtype, the epilogue and the stores."""
        accumulator = plan.accumulator
        result = plan.reduction.output
        if plan.reduction.op_name == "mean":
            emit.line(
                f"{reduced} = div({reduced}, tl.zeros((), tl.float32) + reduced_count)"
                if accumulator.name == "float32"
                else f"{reduced} = {reduced} / reduced_count"
            )
        values[result] = emit.rounded(reduced, accumulator, result.dtype)
        for i, tensor in enumerate(plan.inputs):
            if tensor in values or tensor in {t for e in plan.prologue for t in e.inputs}:
                continue
            if tensor is plan.reduction.inputs[0]:
                continue
            index = emit.assign(self._offset(plan, i, plan.kept, "k"), "idx")
            values[tensor] = emit.load(tensor, ins[i], index, "kept_mask")
        for expr in plan.epilogue:
            operands = [values[o] if isinstance(o, TensorView) else o for o in expr.operands]
            for out, value in zip(expr.outputs, emit.expr(expr, operands), strict=True):
                values[out] = value
        for i, tensor in enumerate(plan.outputs):
            emit.line(
                f"tl.store({outs[i]} + kept_index, {emit.stored(values[tensor])}, mask=kept_mask)"
            )

    def combine_source(
        self, plan: ReductionPlan, params: ReductionParams, aligned: bool = False
    ) -> str:
        """The outer reduction's second kernel: combine the parts in order, then finish."""
        emit, ins, outs, runtime = self._start(plan, aligned)
        combine = COMBINE[plan.reduction.op_name]
        identity = reduction_identity(plan.reduction.op_name, plan.accumulator)
        # A tile of parts per step, not one part: a loop of single loads would wait on
        # memory once per part (one program per 32 kept positions reads all of them).
        emit.line(
            f"acc = tl.full((BLOCK_REDUCED, BLOCK_KEPT), {identity}, partial.dtype.element_ty)"
        )
        emit.line("for first in range(0, split, BLOCK_REDUCED):")
        emit.line("    parts = first + tl.arange(0, BLOCK_REDUCED)")
        emit.line(
            f"    acc = {combine}(acc, tl.load(partial + parts[:, None] * kept_count "
            "+ kept_index[None, :], mask=(parts < split)[:, None] & kept_mask[None, :], "
            f"other={identity}))"
        )
        emit.line(f"reduced = {reduce_call('acc', 0, combine)}")
        self._finish(emit, plan, values={}, reduced="reduced", ins=ins, outs=outs)
        return kernel_source(
            "combine_kernel", ["partial", *ins, *outs], runtime, TILE_CONSTANTS, emit.lines
        )

    def build(
        self,
        plan: ReductionPlan,
        params: ReductionParams,
        hardware: HardwareProfile,
        reduced_extents: list[int],
    ):
        """A launcher ``(inputs, outputs, shapes)``; ``reduced_extents`` are the reduced
        axes' extents (the kept ones come from the outputs at each launch)."""
        if not params.deterministic and (
            plan.layout != "outer" or plan.accumulator.name != "float32"
            or plan.reduction.op_name not in ("sum", "mean")
        ):  # fmt: skip
            raise NotSchedulable("atomics are for float32 outer sums and means only")
        inner = plan.layout == "inner"
        described = self.tma_inputs(plan) if params.tma else []  # inputs as descriptors
        main = AlignedVariants(lambda aligned: self.source(plan, params, aligned),
                               "reduction_kernel")  # fmt: skip
        combine = AlignedVariants(lambda aligned: self.combine_source(plan, params, aligned),
                                  "combine_kernel")  # fmt: skip
        rank = plan.reduction.inputs[0].ndim
        known = self.aligned_arguments(plan)
        constants = self.constants(plan, params)
        combine_constants = self.combine_constants(params)
        names = ["kept_count", "reduced_count", "split"] + [f"size{axis}" for axis in range(rank)]
        names += [f"stride{i}_{axis}" for i in range(len(plan.inputs)) for axis in range(rank)]

        def launch(inputs: list[torch.Tensor], outputs: list[torch.Tensor], shapes) -> None:
            kept_shape = iter(shapes[plan.outputs[0]])
            reduced_shape = iter(reduced_extents)
            shape = [
                next(reduced_shape) if axis in plan.reduced else next(kept_shape)
                for axis in range(rank)
            ]
            kept_count = math.prod(shape[a] for a in plan.kept)
            reduced_count = math.prod(shape[a] for a in plan.reduced)
            if kept_count == 0:
                return
            strides = []
            for tensor in plan.inputs:
                mapping = plan.mappings[tensor]
                own = shapes[tensor]
                for axis in range(rank):
                    if axis in mapping:
                        dim = mapping.index(axis)
                        strides.append(math.prod(own[dim + 1 :]))
                    else:
                        strides.append(0)
            pointers = [as_bytes(t) for t in inputs]
            targets = [as_bytes(t) for t in outputs]
            box = [params.block_rows, params.block_reduce]
            for i in described:
                pointers[i] = tma_descriptor(pointers[i], reduced_count, kept_count, box, params)

            def bind(variants: AlignedVariants, split: int) -> tuple[object, list[int]]:
                values = [kept_count, reduced_count, split, *shape, *strides]
                return variants.bind(dict(zip(names, values, strict=True)), known)

            if inner:
                grid = (cdiv(kept_count, params.block_rows),)
                kernel, arguments = bind(main, 1)
                kernel[grid](*pointers, *targets, *arguments, **constants,
                             num_warps=params.num_warps, **COMPILE_OPTIONS)  # fmt: skip
                return
            tiles = cdiv(kept_count, params.block_reduce)
            most = max(1, cdiv(reduced_count, params.block_rows))
            split = min(most, max(1, params.waves * hardware.sm_count // tiles))
            # Deterministic: every part writes its row of partial results (no fill needed);
            # atomics add into one zeroed row, and the float32 sum is the result.
            allocate = torch.empty if params.deterministic else torch.zeros
            partial = allocate(
                (split if params.deterministic else 1, kept_count),
                dtype=plan.accumulator.torch_dtype, device=inputs[0].device,
            )  # fmt: skip
            kernel, arguments = bind(main, split)
            kernel[(tiles, split)](partial, *pointers, *arguments, **constants,
                                   num_warps=params.num_warps, **COMPILE_OPTIONS)  # fmt: skip
            kernel, arguments = bind(combine, split if params.deterministic else 1)
            columns = combine_constants["BLOCK_KEPT"]
            kernel[(cdiv(kept_count, columns),)](partial, *pointers, *targets, *arguments,
                **combine_constants, num_warps=COMBINE_WARPS, **COMPILE_OPTIONS)  # fmt: skip

        launch.forms = lambda: forms_used([main, combine])
        return launch


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


def _parameters(plan: ReductionPlan, rank: int) -> tuple[list[str], list[str], list[str]]:
    """A reduction kernel's input and output pointers and its runtime (unspecialised) scalars."""
    ins = [f"in{i}" for i in range(len(plan.inputs))]
    outs = [f"out{i}" for i in range(len(plan.outputs))]
    sizes = [f"size{axis}" for axis in range(rank)]
    strides = [f"stride{i}_{axis}" for i in range(len(plan.inputs)) for axis in range(rank)]
    return ins, outs, ["kept_count", "reduced_count", "split", *sizes, *strides]
