"""The normalization scheduler: its analysis, the choice between its strategies, its
kernels and their launcher."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fusion.exprs import Expr
from fusion.ir import TensorView
from fusion.storage import storage_dtype
from schedulers.analysis import NotSchedulable
from schedulers.base import (
    BoundLaunch,
    KernelSource,
    Launcher,
    LocalShape,
    Scheduler,
    Shapes,
    check_strategy,
    launch_nothing,
)
from schedulers.cache import KERNEL_CACHE
from schedulers.codegen import COMPILE_OPTIONS, memory_type, pointer_types
from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan, plan_normalization
from schedulers.normalization.codegen import constants, source, stashed
from schedulers.normalization.column_sums import (
    column_constants,
    column_source,
    column_walk_params,
    combine_rows,
    row_parts,
    split_short_of_rows,
    strip_grid,
)
from schedulers.normalization.combine import (
    COMBINE_WARPS,
    DEPENDENT_LAUNCH,
    combine_constants,
    combine_source,
)
from schedulers.normalization.exchange import cluster_exchange, exchange_slots
from schedulers.normalization.heuristics import (
    COLUMN_WALK,
    MULTIWAVE,
    SPLIT,
    STRATEGIES,
    WARP_SPECIALIZED,
    NormalizationParams,
    forward_chunks,
    multiwave_params,
    short_row_params,
    splits_variance,
    tma_inputs,
)
from schedulers.normalization.split import SPLIT_SUMS_FROM, split_params
from schedulers.normalization.warp_specialized import (
    WS_GAINS,
    rows_in_flight,
    warp_specialized_params,
    ws_threshold,
)
from schedulers.occupancy import resident_programs
from schedulers.runtime import (
    BYTE_CODED,
    BoundKernel,
    allocator,
    as_bytes,
    cdiv,
    concurrent_programs,
    interpreted,
)
from schedulers.tma_tensors import tma_descriptor

# The shapes a launcher keeps bound launches for (``NormalizationLauncher.bind``).
BOUND_SHAPES = 64


class NormalizationScheduler(Scheduler[NormalizationPlan, NormalizationParams]):
    """Takes row reductions whose results are used back along the rows (softmax,
    LayerNorm, RMSNorm forward and backward), with column sums beside them."""

    name = "normalization"
    strategies: tuple[str, ...] = STRATEGIES

    def plan(
        self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
    ) -> NormalizationPlan:
        return plan_normalization(exprs, inputs, outputs)

    def heuristics(
        self,
        plan: NormalizationPlan,
        hardware: HardwareProfile,
        shape: list[int],
        strategy: str | None = None,
    ) -> NormalizationParams:
        """The launch configuration for S's ``shape``. ``strategy`` forces one strategy
        (``MULTIWAVE``, ``WARP_SPECIALIZED``, ``SPLIT`` or ``COLUMN_WALK``, no fallback:
        a kernel that cannot be built raises ``NotSchedulable`` saying why); None (or
        ``"auto"``) takes the warp-specialized one where ``WS_GAINS`` records a gain for
        this architecture and number of column sums and each program walks enough rows, and
        falls back to the multi-wave one when the warp-specialized parameters are
        degenerate (one stage, or too few registers left), or short of registers where a
        multi-wave program loads a row of at least 64 KiB at once (``rows_in_flight``);
        over rows of ``SHORT_ROW_COLUMNS`` a multi-wave walk of small tiles, several
        programs an SM, replaces the warp-specialized kernel (``short_row_params``).
        Where the multi-wave one
        would walk the row in chunks (it does not fit a program's registers) and the
        reductions take one round of exchanges (RMSNorm and LayerNorm, forward and
        backward; not softmax), sm_90 and later split the row over programs instead
        (``split_params``; H200, 4096x65536: RMSNorm forward 0.78 of copy against 0.72
        chunked, backward 0.63 against 0.29, LayerNorm backward 0.56 against 0.19;
        H100: LayerNorm forward 0.87 with 4 warps a slice against 0.68 chunked, 0.60
        with 8; H200: 0.71 with 4 against 0.62 chunked). Rows with column sums that
        would be walked in chunks walk their columns instead (``column_walk_params``,
        on every architecture), unless they are split: the split stays where its
        programs hold at least ``SPLIT_LEAST_ROWS`` rows at once (``split_short_of_rows``).
        The interpreter never splits (its programs run one after the other; a forced
        split row's run concurrently, ``schedulers.runtime.concurrent_programs``)."""
        strategy = check_strategy(self, strategy)
        rank = len(shape)
        columns = math.prod(shape[rank - plan.reduced :])
        rows = math.prod(shape[: rank - plan.reduced])
        if strategy in (SPLIT, COLUMN_WALK):
            forced = split_params if strategy == SPLIT else column_walk_params
            chosen = forced(plan, hardware, columns)
            if isinstance(chosen, str):
                raise NotSchedulable(f"the {strategy} strategy (forced): {chosen}")
            return chosen
        chosen = self._heuristics(plan, hardware, columns, rows, strategy)
        if chosen.persistent and not strategy:
            walked = forward_chunks(plan, hardware, columns)
            if walked is not None:
                return replace(walked, why=f"chunked ({walked.why}) [instead of {chosen.why}]")
            if splits_variance(plan, hardware, columns):
                split = split_params(plan, hardware, columns)
                if not isinstance(split, str):
                    return replace(split, why=f"split (a variance over rows of {columns} on "
                                              f"a device of {hardware.memory_gbps:.0f} GB/s): "
                                              f"{split.why} [instead of {chosen.why}]")  # fmt: skip
        if strategy:
            return chosen
        if plan.column_sums and not chosen.persistent:  # the columns walked, not chunks
            walk = column_walk_params(plan, hardware, columns)
            if not isinstance(walk, str):
                chosen = replace(walk, why=f"column walk (rows of {columns} with column sums "
                                           f"do not fit the registers): {walk.why} [instead "
                                           f"of {chosen.why}]")  # fmt: skip
        if hardware.arch < 90:
            return chosen
        held = plan.column_sums and chosen.strategy == MULTIWAVE and columns >= SPLIT_SUMS_FROM
        if chosen.persistent and not held:
            return chosen
        rounds = len(plan.exchanges)
        if rounds > 1:  # an exchange a level a row: the chunks' second pass is faster
            return replace(chosen, why=f"{chosen.why} (not split: {rounds} levels of "
                                       "reductions, an exchange each a row)")  # fmt: skip
        split = split_params(plan, hardware, columns)
        if isinstance(split, str):
            return replace(chosen, why=f"{chosen.why} (not split: {split})")
        short = chosen.strategy == COLUMN_WALK and split_short_of_rows(plan, hardware, split)
        if short:
            return replace(chosen, why=f"{chosen.why} (not split: {short})")
        reason = (f"rows of {columns} with column sums"
                  if chosen.persistent else "the row does not fit one program's registers, "
                  f"and walked in chunks it is read {plan.depth + 1} times")  # fmt: skip
        return replace(split, why=f"split ({reason}): {split.why} [instead of {chosen.why}]")

    def _heuristics(self, plan, hardware, columns, rows, strategy) -> NormalizationParams:
        """The multi-wave or the warp-specialized params (``heuristics``, split aside)."""
        if strategy == WARP_SPECIALIZED:
            chosen = warp_specialized_params(plan, hardware, columns, rows)
            if isinstance(chosen, str):
                raise NotSchedulable(f"the warp-specialized strategy (forced): {chosen}")
            return chosen
        multiwave = multiwave_params(plan, hardware, columns, rows)
        if strategy == MULTIWAVE:
            return multiwave
        gains = WS_GAINS.get(hardware.arch, {})
        if len(plan.column_sums) not in gains:
            why = (f"no warp-specialized gain recorded for sm_{hardware.arch} with "
                   f"{len(plan.column_sums)} column sums")  # fmt: skip
            return replace(multiwave, why=f"multi-wave ({why}): {multiwave.why}")
        chosen = warp_specialized_params(plan, hardware, columns, rows)
        if isinstance(chosen, str):
            return replace(multiwave, why=f"multi-wave (warp-specialized fell back: "
                                          f"{chosen}): {multiwave.why}")  # fmt: skip
        enough = rows_in_flight(plan, multiwave, chosen, columns)
        if enough:
            return replace(multiwave, why=f"multi-wave ({enough}): {multiwave.why}")
        walked = cdiv(rows, chosen.programs)
        threshold = ws_threshold(hardware, len(plan.column_sums), columns)
        if walked < threshold:
            why = (f"{walked} rows a program, fewer than the {threshold} that amortize a "
                   "warp-specialized program's weights and partial sums")  # fmt: skip
            return replace(multiwave, why=f"multi-wave ({why}): {multiwave.why}")
        why = f"warp-specialized ({walked} rows a program, at least {threshold}): {chosen.why}"
        short = short_row_params(plan, hardware, columns, rows)
        if short is not None:
            return replace(short, why=f"multi-wave, short rows ({short.why}) [instead of {why}]")
        return replace(chosen, why=why)

    def kernels(
        self,
        plan: NormalizationPlan,
        params: NormalizationParams,
        shape: list[int],
        aligned: bool = False,
    ) -> list[KernelSource]:
        """The normalization kernel (a column walk's: and its strips' kernel) and one
        combining kernel for its column sums (an ordinary launch, as on every device: sm_90
        and later launch it as a programmatic dependent, ``DEPENDENT``), for rows of
        ``shape``'s reduced extent (a constexpr); one form only (``aligned`` is not read)."""
        columns = math.prod(shape[plan.rank - plan.reduced :])
        pointers = pointer_types(plan.inputs, plan.outputs)
        pointers |= {f"part{i}": "tl.float32" for i in range(len(plan.column_sums))}
        if params.strategy == SPLIT:
            pointers["slots"] = "tl.int64"
        walks = params.strategy == COLUMN_WALK
        if walks:
            pointers["stash"] = "tl.float32"
        main = source(plan, params)
        kernels = [KernelSource("normalization_kernel", main, constants(plan, params, columns),
                                params.num_warps, pointers, params.compile_options)]  # fmt: skip
        if walks:
            kernels.append(KernelSource("column_kernel", column_source(plan, params),
                                        column_constants(params, columns),
                                        params.strip_warps, pointers))  # fmt: skip
        if plan.column_sums:
            combining = {f"partial{i}": "tl.float32" for i in range(len(plan.column_sums))}
            combining |= {f"out{i}": memory_type(written.dtype)
                          for i, written in enumerate(plan.column_outputs)}  # fmt: skip
            kernels.append(KernelSource("combine_kernel", combine_source(plan),
                                        combine_constants(columns, combine_rows(params, columns),
                                                          dependent=False),
                                        COMBINE_WARPS, combining))  # fmt: skip
        return kernels

    def launcher(
        self,
        plan: NormalizationPlan,
        params: NormalizationParams,
        hardware: HardwareProfile,
        local_shape: LocalShape,
    ) -> NormalizationLauncher:
        """Builds the kernels now: params they cannot have raise ``ValueError`` here."""
        if params.block_columns & (params.block_columns - 1) or params.block_rows < 1:
            raise ValueError(f"{params}: block_columns must be a power of two")
        strip = params.strip_columns
        if params.strategy == COLUMN_WALK and (strip < 1 or strip & (strip - 1)
                                               or params.strip_warps < 1):  # fmt: skip
            raise ValueError(f"{params}: a column walk's strip_columns is a power of two, "
                             "its strip_warps at least 1")  # fmt: skip
        return NormalizationLauncher(
            plan,
            params,
            kernel=KERNEL_CACHE.get(source(plan, params), "normalization_kernel"),
            strips=(KERNEL_CACHE.get(column_source(plan, params), "column_kernel")
                    if params.strategy == COLUMN_WALK else None),
            whole=(_walk_kernels(plan, replace(params, parts=1))
                   if params.strategy == COLUMN_WALK and params.parts > 1 else None),
            combine=(KERNEL_CACHE.get(combine_source(plan), "combine_kernel")
                     if plan.column_sums else None),
            sum_outputs=[plan.outputs.index(written) for written in plan.column_outputs],
            tiles=[plan.inputs.index(t) for t in tma_inputs(plan, params)],
            coded=[i for i, t in enumerate([*plan.inputs, *plan.outputs])
                   if storage_dtype(t) in BYTE_CODED],
            hardware=hardware,
            dependent=hardware.arch >= DEPENDENT_LAUNCH and not interpreted(),
        )  # fmt: skip


@dataclass(frozen=True)
class NormalizationLauncher(Launcher):
    """Launches a normalization: a program per ``block_rows`` rows (or a grid of
    ``programs`` walking them), then one combining kernel for its column sums; a column
    walk: a program per row block, then a program per strip and group of rows, then the
    combining kernel."""

    plan: NormalizationPlan
    params: NormalizationParams
    kernel: object  # the compiled normalization kernel
    strips: object | None  # (COLUMN_WALK) the compiled kernel walking strips down the rows
    # (COLUMN_WALK with parts) the rows' and the strips' kernels of a row in one part and
    # their params, for launches whose rows fill the device: the kernels of a row in parts
    # read its row values from a tile of parts (H200, LayerNorm backward 1024x135168: 0.49
    # of copy that way, 0.58 in one part); compiled at their first launch: two forms
    whole: tuple | None
    combine: object | None  # the kernel adding every column sum's partial rows
    sum_outputs: list[int]  # the output each column sum writes
    tiles: list[int]  # inputs passed as TMA descriptors
    coded: list[int]  # inputs and outputs (in turn) read and written as byte codes
    hardware: HardwareProfile
    # the combining kernel a programmatic dependent of the kernel before it (sm_90 and
    # later, compiled code: not the interpreter), for CUDA tensors
    dependent: bool
    # (SPLIT) programs the device holds at once, by device and row length
    resident: dict[tuple, int] = field(default_factory=dict, compare=False)
    # the launches bound so far, by their normalization's shape (``bind``)
    bound: dict[tuple, BoundLaunch] = field(default_factory=dict, compare=False)

    def __call__(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], shapes: Shapes
    ) -> None:
        self.bind(shapes)(inputs, targets)

    def bind(self, shapes: Shapes) -> BoundLaunch:
        """The launch for these shapes (their normalization's rows and columns): its
        grids, its kernels with their ``tl.constexpr`` arguments bound, worked out once
        a shape; the ``BOUND_SHAPES`` shapes launched last kept."""
        shape = tuple(_space_shape(self.plan, shapes))
        launch = self.bound.pop(shape, None)  # put back last: the most recent
        if launch is None:
            if len(self.bound) >= BOUND_SHAPES:  # extents keep changing: the oldest goes
                self.bound.pop(next(iter(self.bound)))
            launch = self._bind(shape)
        self.bound[shape] = launch
        return launch

    def _bind(self, shape: tuple) -> BoundLaunch:
        plan, params = self.plan, self.params
        columns = math.prod(shape[plan.rank - plan.reduced :])
        rows = math.prod(shape[: plan.rank - plan.reduced])
        if rows == 0:
            return launch_nothing
        if columns == 0:
            raise ValueError(
                "a normalization over rows of 0 columns: generated kernels do not run "
                "it; use kernels='reference'"
            )
        if params.persistent and columns > params.block_columns * params.parts:
            raise ValueError(
                f"{params} holds {params.block_columns * params.parts} columns; the row has "
                f"{columns}"
            )
        options = {**constants(plan, params, columns), "num_warps": params.num_warps,
                   **COMPILE_OPTIONS, **params.compile_options}  # fmt: skip
        if self.strips is not None:  # a column walk: the rows' values, then the strips
            return self._bind_walk(rows, columns, options)
        combine = self._bind_combine(columns)
        # a group's exchange words in global memory: its slots; a cluster's are in its
        # shared memory (none here), interpreted in a block of global memory a program
        if params.cluster:
            exchange_bytes = cluster_exchange(plan, params)
            kernel = BoundKernel(self.kernel, options, params.parts, exchange_bytes)
            group_words = 0 if kernel.cluster > 1 else params.parts * exchange_bytes // 8
        else:
            kernel = BoundKernel(self.kernel, options)
            group_words = exchange_slots(plan, params, 1)
        allocate_slots = torch.zeros if group_words else torch.empty  # tags start at 0
        grid = (cdiv(rows, params.block_rows),)
        if params.programs:
            grid = (min(grid[0], params.programs),)
        box = [params.block_rows, params.block_columns]
        split = params.strategy == SPLIT
        sums = len(plan.column_sums)
        planned = combine_rows(params, columns)  # the most partial rows of a column sum

        def launch(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
            pointers = [*inputs, *targets]
            for i in self.coded:
                pointers[i] = as_bytes(pointers[i])
            for i in self.tiles:
                pointers[i] = tma_descriptor(pointers[i], rows, columns, box, params)
            device = inputs[0].device
            launched, count, most, slots = grid, grid[0], planned, ()
            if split:  # groups of `parts` programs, every one of them resident at once
                most = self._resident(device, kernel, pointers, rows, options) // params.parts
                count = min(grid[0], most)
                launched = (count * params.parts,)
                slots = (allocate_slots(max(count * group_words, 1), dtype=torch.int64,
                                        device=device),)  # fmt: skip
            # one row of float32 partial column sums per program (a split row's: per
            # group; zeroed when the row is walked in chunks: each chunk adds into it)
            partials = partial_rows(device, sums, count, columns, not params.persistent)
            if split and device.type != "cuda":  # the interpreter's programs, concurrently
                with concurrent_programs():
                    kernel(launched, *pointers, *partials, *slots, rows)
            else:
                kernel(launched, *pointers, *partials, *slots, rows)
            combine(partials, targets, count, most)

        return launch

    def _bind_combine(self, columns: int):
        """Adds ``count`` partial rows (of at most ``most``) of each column sum into its
        target: ``combine(partials, targets, count, most)``."""
        if self.combine is None:
            return launch_nothing
        bound: dict[tuple, tuple] = {}  # by (most, dependent): the kernel and its grid

        def combine(partials: list, targets: list, count: int, most: int) -> None:
            sums = [targets[index] for index in self.sum_outputs]
            dependent = self.dependent and sums[0].device.type == "cuda"
            if (most, dependent) not in bound:
                fixed = combine_constants(columns, most, dependent=dependent)
                launch = {"launch_pdl": True} if dependent else {}
                kernel = BoundKernel(self.combine, {**fixed, "num_warps": COMBINE_WARPS,
                                                    **launch, **COMPILE_OPTIONS})  # fmt: skip
                bound[most, dependent] = kernel, (cdiv(columns, fixed["BLOCK_COLUMNS"]),)
            kernel, grid = bound[most, dependent]
            kernel(grid, *partials, *sums, count)

        return combine

    def _bind_walk(self, rows: int, columns: int, options: dict) -> BoundLaunch:
        """A column walk's kernels: a program a row block (and part) for the rows'
        values, then a program a strip and group of rows, then the combining kernel."""
        plan, params = self.plan, self.params
        parts, span = row_parts(params, self.hardware, rows, columns)
        kernel, walk = self.kernel, self.strips
        if parts == 1 and self.whole is not None:  # the rows fill the device: one part
            kernel, walk, params = self.whole
        # how many parts this launch, and the steps of each
        runtime = [parts, span // params.block_columns] if params.parts > 1 else []
        rows_kernel = BoundKernel(kernel, options)
        grid = (cdiv(rows, params.block_rows) * parts,)
        strips, groups = strip_grid(params, rows, columns)
        strips_kernel = BoundKernel(walk, {**column_constants(params, columns),
            "num_warps": params.strip_warps, **COMPILE_OPTIONS})  # fmt: skip
        combine, most = self._bind_combine(columns), combine_rows(params, columns)
        values = len(stashed(plan))

        def launch(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
            pointers = [*inputs, *targets]
            for i in self.coded:
                pointers[i] = as_bytes(pointers[i])
            device = inputs[0].device
            stash = torch.empty((rows, parts, values), dtype=torch.float32, device=device)
            rows_kernel(grid, *pointers, stash, rows, *runtime)
            partials = partial_rows(device, len(plan.column_sums), groups, columns)
            strips_kernel((strips * groups,), *pointers, *partials, stash, rows, *runtime[:1])
            combine(partials, targets, groups, most)

        return launch

    def _resident(self, device: torch.device, kernel: BoundKernel, pointers: list, rows: int,
                  options: dict) -> int:  # fmt: skip
        """(SPLIT) the programs that may run: as many as the device holds at once (the
        interpreter: two groups; ``params.programs``, when set, at most); a device that
        cannot hold one group raises ``RuntimeError`` (they would wait forever). A
        cluster's groups wait for no others: on a GPU, ``params.programs`` exactly, or
        without it as many clusters as the device holds at once (the driver's count:
        ``BoundKernel.resident_clusters``), each walking its rows to the end."""
        params = self.params
        if device.type == "cuda" and params.cluster and params.programs:
            if params.programs < params.parts:
                raise RuntimeError(f"{params}: fewer programs than the {params.parts} of "
                                   "one cluster")  # fmt: skip
            return params.programs
        if device.type != "cuda":
            resident = 2 * params.parts
        else:
            # by what the kernel's specialization may change here (a tensor's alignment, a
            # count's class; the dtypes are the plan's, a descriptor's base is aligned):
            # each compiles to its own registers
            aligned = [p.data_ptr() % 16 == 0 for p in pointers if isinstance(p, torch.Tensor)]
            key = (device.index, options["COLUMNS"], rows == 1, rows % 16 == 0, *aligned)
            if key not in self.resident:
                partials = [torch.empty(1, dtype=torch.float32, device=device)
                            for _ in self.plan.column_sums]  # fmt: skip
                slots = torch.empty(1, dtype=torch.int64, device=device)
                arguments = (*pointers, *partials, slots, rows)
                if params.cluster:  # a kernel bound to clusters: the driver counts them
                    clusters = kernel.resident_clusters((params.parts,), *arguments)
                    self.resident[key] = clusters * params.parts
                else:
                    compiled = kernel.warmup((params.parts,), *arguments)
                    self.resident[key] = resident_programs(compiled, self.hardware)
            resident = self.resident[key]
        if params.programs:
            resident = min(resident, params.programs)
        if resident < params.parts:
            held = (f"no cluster of the {params.parts} programs" if params.cluster
                    else f"{resident} of this kernel's programs at once, fewer than the "
                    f"{params.parts}")  # fmt: skip
            raise RuntimeError(f"{params}: the device holds {held} that share a row and wait "
                               "for each other")  # fmt: skip
        return resident

    def forms(self) -> list[str]:
        return []  # one form: the reduced extent is a constexpr


def partial_rows(device: torch.device, sums: int, count: int, columns: int,
                 zeroed: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``sums`` column sums' ``count`` float32 partial rows of ``columns``, in one
    allocation, each sum's rows starting on a ``PARTIALS_ALIGN``-float boundary (a row
    block at an unaligned offset is another kernel specialization, its loads scalar),
    zeroed where asked."""
    if not sums:
        return ()
    block = cdiv(count * columns, PARTIALS_ALIGN) * PARTIALS_ALIGN
    rows = allocator(device)((sums, count, columns), (block, columns, 1), torch.float32)
    return (rows.zero_() if zeroed else rows).unbind()


PARTIALS_ALIGN = 32  # floats: 128 bytes


def _space_shape(plan: NormalizationPlan, shapes: Shapes) -> list[int]:
    for tensor, shape in shapes.items():
        if plan.kinds.get(tensor) == "full" and len(shape) == plan.rank:
            return list(shape)
    raise ValueError("no tensor of the normalization's full shape")


def _walk_kernels(plan: NormalizationPlan, params: NormalizationParams) -> tuple:
    """A column walk's rows' and strips' kernels for ``params``, and ``params``."""
    return (KERNEL_CACHE.get(source(plan, params), "normalization_kernel"),
            KERNEL_CACHE.get(column_source(plan, params), "column_kernel"), params)  # fmt: skip
