"""A reduction's Triton source: the first kernel (each program reduces its tile of kept
positions over its part of the reduced extent) and, for outer reductions, the kernel
that combines the parts in a fixed order and finishes (mean, epilogue, stores).

Both kernels take their extents and strides as runtime arguments; ``aligned`` forms
take the pitches divided by ``ALIGN_ELEMENTS`` (see ``schedulers.cache``).
"""

from __future__ import annotations

from fusion.ir import TensorView
from schedulers.cache import ALIGN_ELEMENTS
from schedulers.codegen import (
    COMBINE,
    TRITON_TYPES,
    Emitter,
    Value,
    kernel_source,
    reduce_call,
    reduction_identity,
)
from schedulers.reduction.analysis import ReductionPlan
from schedulers.reduction.heuristics import ReductionParams

COMBINE_COLUMNS = 32  # outer, deterministic: kept positions per program of the combine
COMBINE_PARTS = 256  # and partial rows it combines per step (few steps: each waits on memory)
COMBINE_WARPS = 8
TILE_CONSTANTS = ["BLOCK_KEPT", "BLOCK_REDUCED"]  # both kernels' constexpr arguments


def _coordinates(emit: Emitter, index: str, axes: list[int], prefix: str) -> None:
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


def _offset(plan: ReductionPlan, i: int, axes: list[int], prefix: str) -> str:
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


def aligned_arguments(plan: ReductionPlan) -> list[str]:
    """What an ``aligned`` kernel knows are multiples of ``ALIGN_ELEMENTS``: the count
    its mask compares the contiguous axis against, and the strides that appear in the
    source (the unit ones never do). See ``schedulers.pointwise.aligned_arguments``."""
    count = "reduced_count" if plan.layout == "inner" else "kept_count"
    return [count] + [
        f"stride{i}_{axis}"
        for i, tensor in enumerate(plan.inputs)
        for axis in plan.mappings[tensor]
        if axis is not None and axis != plan.mappings[tensor][-1]
    ]


def constants(plan: ReductionPlan, params: ReductionParams) -> dict[str, int]:
    """The first kernel's ``tl.constexpr`` arguments: tile sizes, never an extent."""
    if plan.layout == "inner":
        return {"BLOCK_KEPT": params.block_rows, "BLOCK_REDUCED": params.block_reduce}
    return {"BLOCK_KEPT": params.block_reduce, "BLOCK_REDUCED": params.block_rows}


def combine_constants(params: ReductionParams) -> dict[str, int]:
    """``combine_kernel``'s tile: ``COMBINE_COLUMNS`` kept positions (narrower than
    the first kernel's, so narrow outputs still spread over several programs) by
    ``COMBINE_PARTS`` partial rows per step, combined in a fixed tree order."""
    return {"BLOCK_KEPT": min(params.block_reduce, COMBINE_COLUMNS),
            "BLOCK_REDUCED": COMBINE_PARTS}  # fmt: skip


def _aligned_prologue(emit: Emitter, plan: ReductionPlan, runtime: list[str]) -> list[str]:
    """Pitches arrive divided by ``ALIGN_ELEMENTS``; see ``AlignedVariants``."""
    known = aligned_arguments(plan)
    for name in known:
        emit.line(f"{name} = {name}_{ALIGN_ELEMENTS} * {ALIGN_ELEMENTS}")
    return [f"{name}_{ALIGN_ELEMENTS}" if name in known else name for name in runtime]


def _start(plan: ReductionPlan, aligned: bool):
    """Both kernels' opening: parameters, the aligned prologue, this program's kept
    positions (``kept_index``, ``kept_mask``) and their coordinates."""
    emit = Emitter()
    ins, outs, runtime = _parameters(plan, plan.reduction.inputs[0].ndim)
    if aligned:
        runtime = _aligned_prologue(emit, plan, runtime)
    emit.line("pid = tl.program_id(0).to(tl.int64)")
    emit.line("kept_index = pid * BLOCK_KEPT + tl.arange(0, BLOCK_KEPT)")
    emit.line("kept_mask = kept_index < kept_count")
    _coordinates(emit, "kept_index", plan.kept, "k")
    return emit, ins, outs, runtime


def source(plan: ReductionPlan, params: ReductionParams, aligned: bool = False) -> str:
    """The first (or only) kernel; ``aligned`` as in ``schedulers.pointwise.source``."""
    emit, ins, outs, runtime = _start(plan, aligned)
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
    _coordinates(body, "reduced_index", plan.reduced, "r")
    if inner:
        body.line("mask = kept_mask[:, None] & reduced_mask[None, :]")
    else:
        body.line("mask = reduced_mask[:, None] & kept_mask[None, :]")
    values: dict[TensorView, Value] = {}
    source = plan.reduction.inputs[0]
    needed_before = {t for e in plan.prologue for t in e.inputs} | {source}
    tiles = plan.tma_inputs if params.tma else []
    if params.tma and (inner or not tiles):
        raise ValueError(f"{params}: TMA tiles need an outer reduction of a full input")
    for i, tensor in enumerate(plan.inputs):
        if tensor not in needed_before:
            continue
        if i in tiles:  # a descriptor of (reduced_count, kept_count)
            at = "tl.cast(start, tl.int32), tl.cast(pid * BLOCK_KEPT, tl.int32)"
            values[tensor] = body.load_tile(tensor, ins[i], at)
            continue
        kept = _offset(plan, i, plan.kept, "k")
        if not any(axis in plan.reduced for axis in plan.mappings[tensor]):
            # a weight along the kept axes: once, before the loop, not once a row
            loaded = emit.load(tensor, ins[i], emit.assign(kept, "idx"), "kept_mask")
            spread = f"{loaded.name}[:, None]" if inner else f"{loaded.name}[None, :]"
            values[tensor] = Value(emit.assign(spread), tensor.dtype)
            continue
        reduced = _offset(plan, i, plan.reduced, "r")
        if inner:
            index = f"({kept})[:, None] + ({reduced})[None, :]"
        else:
            index = f"({reduced})[:, None] + ({kept})[None, :]"
        values[tensor] = body.load(tensor, ins[i], body.assign(index, "idx"), "mask")
    body.exprs(plan.prologue, values)
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
        _finish(emit, plan, values={}, reduced="reduced", ins=ins, outs=outs)
    elif not params.deterministic:
        # Outer, atomics: add this part's partial sums into one row, in any order.
        emit.line("tl.atomic_add(partial + kept_index, reduced, mask=kept_mask)")
    else:
        # Outer: write this part's partial results; `combine_kernel` finishes them.
        emit.line("tl.store(partial + part * kept_count + kept_index, reduced, mask=kept_mask)")
    pointers = [*ins, *outs] if inner else ["partial", *ins]
    return kernel_source("reduction_kernel", pointers, runtime, TILE_CONSTANTS, emit.lines)


def _finish(emit, plan, values, reduced, ins, outs) -> None:
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
        index = emit.assign(_offset(plan, i, plan.kept, "k"), "idx")
        values[tensor] = emit.load(tensor, ins[i], index, "kept_mask")
    emit.exprs(plan.epilogue, values)
    for i, tensor in enumerate(plan.outputs):
        emit.line(
            f"tl.store({outs[i]} + kept_index, {emit.stored(values[tensor])}, mask=kept_mask)"
        )


def combine_source(plan: ReductionPlan, params: ReductionParams, aligned: bool = False) -> str:
    """The outer reduction's second kernel: combine the parts in order, then finish."""
    emit, ins, outs, runtime = _start(plan, aligned)
    combine = COMBINE[plan.reduction.op_name]
    identity = reduction_identity(plan.reduction.op_name, plan.accumulator)
    # A tile of parts per step, not one part: a loop of single loads would wait on
    # memory once per part (one program per 32 kept positions reads all of them).
    emit.line(f"acc = tl.full((BLOCK_REDUCED, BLOCK_KEPT), {identity}, partial.dtype.element_ty)")
    emit.line("for first in range(0, split, BLOCK_REDUCED):")
    emit.line("    parts = first + tl.arange(0, BLOCK_REDUCED)")
    emit.line(
        f"    acc = {combine}(acc, tl.load(partial + parts[:, None] * kept_count "
        "+ kept_index[None, :], mask=(parts < split)[:, None] & kept_mask[None, :], "
        f"other={identity}))"
    )
    emit.line(f"reduced = {reduce_call('acc', 0, combine)}")
    _finish(emit, plan, values={}, reduced="reduced", ins=ins, outs=outs)
    return kernel_source(
        "combine_kernel", ["partial", *ins, *outs], runtime, TILE_CONSTANTS, emit.lines
    )


def _parameters(plan: ReductionPlan, rank: int) -> tuple[list[str], list[str], list[str]]:
    """A reduction kernel's input and output pointers and its runtime (unspecialised) scalars."""
    ins = [f"in{i}" for i in range(len(plan.inputs))]
    outs = [f"out{i}" for i in range(len(plan.outputs))]
    sizes = [f"size{axis}" for axis in range(rank)]
    strides = [f"stride{i}_{axis}" for i in range(len(plan.inputs)) for axis in range(rank)]
    return ins, outs, ["kept_count", "reduced_count", "split", *sizes, *strides]
