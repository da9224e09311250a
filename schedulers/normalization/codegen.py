"""A normalization's Triton source: ``source`` writes the kernel (reductions, the row
values that follow from them, the outputs and a program's partial column sums; a column
walk's first kernel: the reductions and their row values). ``combine`` writes the
kernel that adds a column sum's partial rows, ``column_sums`` the column walk's second.

Full and column values are emitted in a step over the columns (the whole row when it
is persistent, a loop over chunks otherwise); row values (reductions and what follows
from them) once per row block, outside any loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.dtypes import DataType, bfloat16, float32, float64
from fusion.exprs import Expr, ReductionOp, VarMeanOp
from fusion.ir import TensorView
from schedulers.codegen import (
    COMBINE,
    TRITON_TYPES,
    Emitter,
    Value,
    kernel_source,
    reduce_call,
    reduce_terms,
    reduction_identity,
)
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.exchange import (
    CLUSTER_SIZES,
    barrier_source,
    cluster_exchange,
    cluster_start_source,
    exchange_step,
    reduce_split,
)
from schedulers.normalization.heuristics import (
    COLUMN_WALK,
    SPLIT,
    WARP_SPECIALIZED,
    NormalizationParams,
    tma_inputs,
)


def source(plan: NormalizationPlan, params: NormalizationParams) -> str:
    """The kernel's Triton source: no extent in it (``COLUMNS`` is a constexpr)."""
    pointers = {t: f"in{i}" for i, t in enumerate(plan.inputs)}
    targets = [f"out{i}" for i in range(len(plan.outputs))]
    persistent = params.persistent
    split = params.strategy == SPLIT  # programs of a row exchange partial reductions
    # the rows' reductions only, their values kept for the column walk's kernel; with
    # parts (as many a row as the launch takes, ``row_parts``, each ``part_steps`` steps:
    # the part's first column a known multiple of the step, so its loads stay vectorized),
    # each program's part of a row reduced, finished by the strips
    stashing = params.strategy == COLUMN_WALK
    if (split or stashing) and persistent != split:
        raise ValueError(f"{params}: a split row is persistent, a column walk's is not")
    if params.parts < 1:
        raise ValueError(f"{params}: parts is at least 1")
    partial = stashing and params.parts > 1
    if partial and not parts_combine(plan):
        raise ValueError(f"{params}: only one level of float32 sums, means, maxima or minima "
                         "and no row output are reduced in parts")  # fmt: skip
    # a fixed grid walks persistent rows (a split row's: as many as the device holds)
    walking = persistent and (params.programs > 0 or split)
    specialized = params.strategy == WARP_SPECIALIZED
    if specialized and not walking:
        raise ValueError(f"{params}: warp specialization needs persistent rows and programs")
    if params.column_registers and not walking:
        raise ValueError(f"{params}: weights in registers need persistent rows and programs")
    if params.column_bits and not params.column_registers:
        raise ValueError(f"{params}: weights kept as bits are kept in registers")
    if params.cluster and not (split and params.parts in CLUSTER_SIZES):
        raise ValueError(f"{params}: a cluster of a split row's programs holds "
                         f"{', '.join(map(str, CLUSTER_SIZES))} of them")  # fmt: skip
    if params.one_pass and not (split and plan.variance):
        raise ValueError(f"{params}: a variance in one pass is a split row's with a variance")
    if params.rewiden and not split:
        raise ValueError(f"{params}: inputs widened again after the exchange need a split row")
    if params.tma and not (split and params.stages > 1 and not params.prefetch):
        raise ValueError(f"{params}: TMA tiles need a split row, stages > 1, no prefetch")
    tiles = set(tma_inputs(plan, params))  # TMA descriptors of (rows, COLUMNS)
    outer = Emitter()
    outer.line("pid = tl.cast(row_block, tl.int64)")
    outer.line("rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
    outer.line("row_mask = rows < row_count")
    row_cache: dict[TensorView, Value] = {}
    start = "part * BLOCK_COLUMNS" if split else "0"  # a split row: this program's slice
    generator = Generator(plan, params, pointers, outer, row_cache, tiles, start)
    early = outer.nested()  # before the walk: weights kept in registers
    if split:
        if params.cluster:  # its exchange words zeroed, the cluster's programs started
            begin = generator.helper("xstart", cluster_start_source, cluster_exchange(plan, params))
            early.line(f"xstart = {begin}(tl.program_id(0) * 0)")
        early.line("group = tl.program_id(0) // PARTS")  # the programs sharing rows
        early.line("part = tl.program_id(0) % PARTS")  # this one's slice of them
        early.line("groups = tl.num_programs(0) // PARTS")
    # a split row's slice: its columns before the walk, for its prefetch and the store of
    # its column sums after it
    if params.column_registers or (split and (params.prefetch or plan.column_sums)):
        generator.columns(early, start, rows=False)
    if params.column_registers:
        for tensor in plan.inputs:
            if plan.kinds[tensor] != "column":
                continue
            if params.column_bits and tensor.dtype is bfloat16:  # widened where used
                generator.keep_bits(early, tensor)
            else:
                generator.value(Step(early, row_cache), tensor)
    if persistent:
        generator.columns(outer, start)
        step = Step(outer, row_cache)  # one step: everything shares one cache
        if split:
            exchange_step(generator, early, step, params.prefetch)
    before, after = [], []  # around the walk over the rows (column sums)
    sums = [] if stashing else plan.column_sums
    # a split row whose inputs are widened again after the exchange adds the column sums
    # that need no reduction before it, their float32 terms not kept across it
    sooner = ([i for i, plain in enumerate(plan.unreduced_column_sums) if plain]
              if split and params.rewiden else [])  # fmt: skip
    later = [i for i in range(len(sums)) if i not in sooner]
    for i, kept in generator.column_terms(step, sooner) if sooner else ():
        keep_column_sum(params, step.emit, i, kept, before, after)
    for level in range(1, plan.depth + 1):
        group = [t for t, v in plan.levels.items() if v == level]
        if persistent and split:  # the level's reductions exchanged together
            reduce_split(generator, step, group, level)
            continue
        if persistent:
            generator.reduce_persistent(step, group)
            continue
        accumulators = {t: generator.accumulator(t) for t in group}
        # rows kept in L2 for the walk after (a column walk's rows are read again by its
        # second kernel, after every row's first walk: not from L2)
        span = "part_steps * BLOCK_COLUMNS" if partial else ""  # a part's columns
        body = generator.loop("" if stashing else "evict_last", f"part * {span}" if span else "")
        for tensor in group:
            generator.accumulate(body, tensor, accumulators[tensor])
        generator.close(body, params.stages if stashing else 1, span)
        for tensor in group:
            if partial:  # this part's reduction, unfinished
                generator.stash_part(tensor, accumulators[tensor], stashed(plan))
            else:
                generator.finish(tensor, accumulators[tensor])
    if split and params.rewiden:  # what follows the exchange, from the inputs' bits
        generator.rematerialize(step)
    if stashing and not partial:  # the column walk's row values, float32 (``column_sums``)
        kept = stashed(plan)
        for j, tensor in enumerate(kept):
            outer.line(f"tl.store(stash + rows[:, None] * {len(kept)} + {j}, "
                       f"{row_cache[tensor].name}, mask=row_mask[:, None])")  # fmt: skip
    elif not stashing and (any(plan.kinds[t] == "full" for t in plan.outputs) or sums):
        body = step if persistent else generator.loop("evict_first")
        generator.full_outputs(body, targets)
        for i, kept in generator.column_terms(body, later):
            if not persistent:  # its row of partial sums, in memory (zeroed before the launch)
                column = body.emit.assign(f"tl.sum({kept}, 0)")
                row = body.emit.assign(
                    f"part{i} + tl.program_id(0).to(tl.int64) * COLUMNS + cols", "p"
                )
                body.emit.line(
                    f"tl.store({row}, tl.load({row}, mask=col_mask, other=0.0) + {column}, "
                    "mask=col_mask)"
                )
                continue
            keep_column_sum(params, body.emit, i, kept, before, after)
        if not persistent:
            generator.close(body)
    for i, tensor in enumerate(plan.outputs):
        if plan.kinds[tensor] != "row":
            continue
        value = generator.value(Step(outer, row_cache), tensor)
        mask = "row_mask[:, None] & (part == 0)" if split else "row_mask[:, None]"
        outer.line(f"tl.store({targets[i]} + rows[:, None], {outer.stored(value)}, mask={mask})")
    comment = (
        f"# normalization: {len(plan.reductions)} reductions in {plan.depth} levels, "
        f"{'persistent' if persistent else 'chunked'}"
        + (", warp-specialized (TMA tiles)" if specialized else "")
        + (", split over programs exchanging partial reductions" if split else "")
        + (", the rows' reductions of a column walk" if stashing else "")
    )
    if (params.programs and not stashing) or split:  # a fixed grid walks the row blocks
        blocks = "tl.program_id(0), tl.cdiv(row_count, BLOCK_ROWS), tl.num_programs(0)"
        if split:  # the programs of a group walk the same rows
            blocks = "group, tl.cdiv(row_count, BLOCK_ROWS), groups"
        if (params.stages > 1 or specialized) and persistent:
            options = f", num_stages={params.stages}"
            options += ", warp_specialize=True" if specialized else ""
            walk = f"for row_block in tl.range({blocks}{options}):"
        else:
            walk = f"for row_block in range({blocks}):"
        if split and params.cluster:  # no program leaves while others may read its words
            after.append(f"{generator.helper('xbarrier', barrier_source)}(tl.program_id(0) * 0)")
        lines = [*before, *early.lines, walk, *(f"    {line}" for line in outer.lines),
                 *after]  # fmt: skip
    else:
        if sums:
            raise ValueError(f"{params}: column sums need a fixed grid (programs > 0)")
        first = (["row_block = tl.program_id(0) // row_parts",
                  "part = tl.program_id(0) % row_parts"]
                 if partial else ["row_block = tl.program_id(0)"])  # fmt: skip
        lines = [*first, *outer.lines]
    partials = [f"part{i}" for i, _ in enumerate(sums)]
    extra = ["slots"] if split else ["stash"] if stashing else []
    arguments = [*pointers.values(), *targets, *partials, *extra]
    constants = ["COLUMNS", "BLOCK_ROWS", "BLOCK_COLUMNS", *(["PARTS"] if split else [])]
    runtime = ["row_count", *(["row_parts", "part_steps"] if partial else [])]
    return kernel_source("normalization_kernel", arguments, runtime, constants, lines,
                         comment, [text for _, text in generator.helpers.values()])  # fmt: skip


def keep_column_sum(params: NormalizationParams, emit: Emitter, i: int, kept: str,
                    before: list[str], after: list[str]) -> None:  # fmt: skip
    """Column sum ``i``'s step term ``kept`` added to the program's partial sums, kept
    in registers (``before`` the walk: zeroed; ``after`` it: stored as the program's row
    of partials, a split row's group's)."""
    if params.tile_sums:  # a partial row per row of the block, added across the
        # block after the walk: no reduction across warps a step
        # (block_rows * block_columns / threads values a thread: TILE_SUM_VALUES)
        before.append(f"colsum{i} = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)")
        emit.line(f"colsum{i} = colsum{i} + {kept}")
        after.append(f"colsum{i} = tl.sum(colsum{i}, 0)")
    else:  # added across the block every step
        before.append(f"colsum{i} = tl.zeros((BLOCK_COLUMNS,), tl.float32)")
        emit.line(f"colsum{i} = colsum{i} + tl.sum({kept}, 0)")
    after.append(
        f"tl.store(part{i} + tl.cast(group, tl.int64) * COLUMNS + cols, "
        f"colsum{i}, mask=col_mask)"
        if params.strategy == SPLIT else
        f"tl.store(part{i} + tl.program_id(0).to(tl.int64) * COLUMNS "
        "+ tl.arange(0, BLOCK_COLUMNS), "
        f"colsum{i}, mask=tl.arange(0, BLOCK_COLUMNS) < COLUMNS)"
    )  # fmt: skip


def constants(plan: NormalizationPlan, params: NormalizationParams, columns: int) -> dict[str, int]:
    """The normalization kernel's ``tl.constexpr`` arguments: the reduced extent
    ``columns`` (the kernel is specialized on it) and the tile."""
    values = {"COLUMNS": columns, "BLOCK_ROWS": params.block_rows,
              "BLOCK_COLUMNS": params.block_columns}  # fmt: skip
    if params.strategy == SPLIT:
        values["PARTS"] = params.parts
    return values


@dataclass
class Step:
    """Where values of one walk over the columns are emitted, and those already there."""

    emit: Emitter
    cache: dict[TensorView, Value]
    # a chunked walk's full-row loads: kept in L2 for a later walk ("evict_last") or read
    # a last time ("evict_first"); H200, RMSNorm forward 4096x65536 chunked: 0.81 of copy
    # against 0.72 without (benchmarks/RESULTS.md; a persistent row's lose: not used)
    eviction: str = ""


class Generator:
    """Emits a normalization kernel's values: full and column values in a step, row
    values (reductions and what follows from them) once, outside any loop."""

    def __init__(self, plan, params, pointers, outer: Emitter, row_cache, tiles=frozenset(),
                 start: str = "0") -> None:  # fmt: skip
        self.plan, self.params, self.pointers = plan, params, pointers
        self.outer, self.row_cache = outer, row_cache
        self.helpers: dict[tuple, tuple[str, str]] = {}  # device functions: name, source
        self.tiles = tiles  # inputs passed as TMA descriptors of (rows, COLUMNS)
        self.means: dict[Expr, str] = {}  # var_mean: its float32 mean, unrounded
        self.start = start  # a persistent row's first column (a split row's slice's)
        self.bits: dict[TensorView, str] = {}  # column inputs kept as bfloat16 bits

    def keep_bits(self, emit: Emitter, tensor: TensorView) -> None:
        """Column input ``tensor`` (bfloat16) loaded into ``emit`` (before the walk) as
        its bits, not widened: ``value`` widens them where used, each row
        (``column_bits``)."""
        raw = emit.load_stored(self.pointers[tensor], "cols", "col_mask")
        self.bits[tensor] = emit.assign(f"{raw}[None, :]")

    def helper(self, prefix: str, write, *shape: int) -> str:
        """The name of a device function ``write(name, *shape)`` writes, defined once in
        the kernel's source."""
        key = (prefix, shape)
        if key not in self.helpers:
            name = f"{prefix}{len(self.helpers)}"
            self.helpers[key] = (name, write(name, *shape))
        return self.helpers[key][0]

    # Columns of a step: offsets, masks.
    @staticmethod
    def columns(emit: Emitter, start: str, rows: bool = True) -> None:
        emit.line(f"cols = {start} + tl.arange(0, BLOCK_COLUMNS)")
        emit.line("col_mask = cols < COLUMNS")
        if rows:
            emit.line("mask = row_mask[:, None] & col_mask[None, :]")
            emit.line("offs = rows[:, None] * COLUMNS + cols[None, :]")

    def loop(self, eviction: str, first: str = "") -> Step:
        """A walk's step over the row's columns (from ``first``: a part of them)."""
        body = self.outer.nested()
        if first:
            body.line(f"start = {first} + offset")
        self.columns(body, "start")
        return Step(body, {}, eviction)

    def close(self, step: Step, stages: int = 1, span: str = "") -> None:
        """The walk's loop (over ``span`` columns from the step's first: a part)."""
        name, end = ("offset", span) if span else ("start", "COLUMNS")
        walk = f"range(0, {end}, BLOCK_COLUMNS" + (f", num_stages={stages}" if stages > 1 else "")
        self.outer.block(f"for {name} in {'tl.' if stages > 1 else ''}{walk}):", step.emit)

    def rematerialize(self, step: Step) -> None:
        """The step's full values worked out again where next used: its bfloat16 inputs
        widened from their bits as loaded (``widen_bf16``, which the compiler does not
        merge with the first widening), the values made of them dropped. A split row
        keeps 16 bits an input value across its exchange instead of the float32 values
        (RMSNorm backward, 4096 columns a program, its column sums added before the exchange:
        200 registers a thread, 128 so)."""
        for tensor in list(step.cache):
            value = step.cache[tensor]
            if self.plan.kinds[tensor] != "full":
                continue
            if tensor not in self.pointers:
                del step.cache[tensor]
            elif value.raw:
                widened = step.emit.assign(f"widen_bf16({value.raw})")
                step.cache[tensor] = Value(widened, value.dtype, value.raw)

    # Outputs of a step.
    def full_outputs(self, step: Step, targets: list[str]) -> None:
        """Stores the step's values of the full-shape outputs."""
        for i, tensor in enumerate(self.plan.outputs):
            if self.plan.kinds[tensor] != "full":
                continue
            value = self.value(step, tensor)
            shaped = f"tl.broadcast_to({value.name}, (BLOCK_ROWS, BLOCK_COLUMNS))"
            stored = step.emit.stored(Value(shaped, value.dtype))
            step.emit.line(f"tl.store({targets[i]} + offs, {stored}, mask=mask)")

    def column_terms(self, step: Step, indices: list[int]) -> list[tuple[int, str]]:
        """The step's float32 terms of the column sums at ``indices``, zero outside the
        mask: (index, term) each."""
        terms = []
        for i in indices:
            (summed,) = self.plan.column_sums[i].inputs
            term = step.emit.as_compute(self.value(step, summed), float32)
            terms.append((i, f"tl.where(mask, {term}, 0.0)"))
        return terms

    # Values.
    def value(self, step: Step, tensor: TensorView) -> Value:
        kind = self.plan.kinds[tensor]
        if kind in ("row", "scalar") and step.cache is not self.row_cache:
            return self.value(Step(self.outer, self.row_cache), tensor)
        if tensor in step.cache:
            return step.cache[tensor]
        emit = step.emit
        if tensor in self.bits:  # widened here, not hoisted out of the walk
            bits = self.bits[tensor]
            value = Value(emit.assign(f"widen_bf16_here({bits})"), tensor.dtype, bits)
            step.cache[tensor] = value
            return value
        if tensor in self.pointers:
            pointer = self.pointers[tensor]
            if tensor in self.tiles:
                value = emit.load_tile(tensor, pointer, f"row_block * BLOCK_ROWS, {self.start}")
            elif kind == "full":
                value = emit.load(tensor, pointer, "offs", "mask", step.eviction)
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
    def term(self, step: Step, tensor: TensorView) -> tuple[Expr, str, str, DataType]:
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

    def reduce_persistent(self, step: Step, group: list[TensorView]) -> None:
        """A level's reductions of a persistent row: every term first, then their
        reductions, sums two at a time (``reduce_terms``: LayerNorm backward's two,
        warp-specialized at 32768x1024, 0.74 of copy against 0.69-0.70 on H200, level on
        H100, ``results/norms_lnbwd_{before,pair}*_{h200,h100}_*.json``). A var_mean's
        variance is a level after its mean (``analysis``), so its term finds the mean."""
        terms = [self.term(step, tensor) for tensor in group]
        reduced = reduce_terms(step.emit, [(term, COMBINE[op]) for _, op, term, _ in terms], 1,
                               keep_dims=True)  # fmt: skip
        for tensor, (producer, op, _, accumulator), name in zip(group, terms, reduced,
                                                                strict=True):  # fmt: skip
            self.finish_reduced(producer, tensor, op, name, accumulator)

    def accumulator(self, tensor: TensorView) -> str:
        producer = tensor.definition
        op = "sum" if isinstance(producer, VarMeanOp) else producer.op_name
        accumulator = _accumulator(tensor.dtype)
        identity = reduction_identity(op, accumulator)
        return self.outer.assign(
            f"tl.full((BLOCK_ROWS, BLOCK_COLUMNS), {identity}, {TRITON_TYPES[accumulator.name]})",
            "acc",
        )

    def accumulate(self, step: Step, tensor: TensorView, accumulator: str) -> None:
        _, op, term, _ = self.term(step, tensor)
        step.emit.line(f"{accumulator} = {COMBINE[op]}({accumulator}, {term})")

    def stash_part(self, tensor: TensorView, accumulator: str, kept: list[TensorView]) -> None:
        """A part's reduction of ``tensor`` (float32, unfinished) stored at its row's and
        part's place among the ``kept`` values: a column walk's strips combine the parts
        (``column_sums.column_source``)."""
        op = tensor.definition.op_name
        reduced = self.outer.assign(reduce_call(accumulator, 1, COMBINE[op], keep_dims=True))
        self.outer.line(f"tl.store(stash + (rows[:, None] * row_parts + part) * {len(kept)} + "
                        f"{kept.index(tensor)}, {reduced}, mask=row_mask[:, None])")  # fmt: skip

    def finish(self, tensor: TensorView, accumulator: str) -> None:
        producer = tensor.definition
        op = "sum" if isinstance(producer, VarMeanOp) else producer.op_name
        reduced = self.outer.assign(reduce_call(accumulator, 1, COMBINE[op], keep_dims=True))
        self.finish_reduced(producer, tensor, op, reduced, _accumulator(tensor.dtype))

    def finish_reduced(self, producer, tensor, op, reduced: str, accumulator: DataType) -> None:
        """``tensor``'s row values from ``reduced`` (its ``op`` over the whole row, in
        ``accumulator``): a mean divided by the columns, a variance by the columns less the
        correction, rounded once to the dtype, kept in the row cache."""
        emit = self.outer
        count = f"tl.full((), COLUMNS, {TRITON_TYPES[accumulator.name]})"
        if isinstance(producer, VarMeanOp):
            var, mean = producer.outputs
            if tensor is mean:
                result = emit.assign(f"div({reduced}, {count})")
                self.means[producer] = result
            else:
                kind = TRITON_TYPES[accumulator.name]
                # at least 0, as torch's: a correction past the row gives inf (or NaN)
                divisor = f"tl.maximum(tl.full((), COLUMNS - {producer.correction}, {kind}), 0.0)"
                result = emit.assign(f"div({reduced}, {divisor})")
        elif op == "mean":
            result = emit.assign(f"div({reduced}, {count})")
        else:
            result = reduced
        self.row_cache[tensor] = emit.rounded(result, accumulator, tensor.dtype)


def parts_combine(plan: NormalizationPlan) -> bool:
    """Whether a row's reductions may be taken in parts and combined by the strips: one
    level of sums, means, maxima or minima (no variance: its parts would need Chan's
    combination), accumulated in float32, and no row output (the strips do not store)."""
    return (plan.depth == 1 and not any(plan.kinds[t] == "row" for t in plan.outputs)
            and all(isinstance(e, ReductionOp) and e.op_name in ("sum", "mean", "max", "min")
                    for e in plan.reductions)
            and all(_accumulator(t.dtype) is float32 for t in plan.levels))  # fmt: skip


def stashed(plan: NormalizationPlan) -> list[TensorView]:
    """The row values a column walk's first kernel stores for its second (``stash``): the
    reductions' outputs, a float32 a row each (with parts: a part's, unfinished, a part)."""
    return list(plan.levels)


def _accumulator(dtype: DataType) -> DataType:
    """Reductions of floats accumulate in float32 (float64 for float64)."""
    return float64 if dtype is float64 else float32
