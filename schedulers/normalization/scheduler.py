"""The normalization scheduler: its analysis, the choice between its strategies, its
kernels and their launcher."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fusion.exprs import Expr
from fusion.ir import TensorView
from schedulers.analysis import NotSchedulable
from schedulers.base import (
    KernelSource,
    Launcher,
    LocalShape,
    Scheduler,
    Shapes,
    check_strategy,
)
from schedulers.cache import KERNEL_CACHE
from schedulers.codegen import COMPILE_OPTIONS, memory_type, pointer_types
from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan, plan_normalization
from schedulers.normalization.codegen import (
    COMBINE_COLUMNS,
    COMBINE_WARPS,
    combine_constants,
    combine_source,
    constants,
    source,
)
from schedulers.normalization.heuristics import (
    MULTIWAVE,
    STRATEGIES,
    WARP_SPECIALIZED,
    NormalizationParams,
    multiwave_params,
)
from schedulers.normalization.warp_specialized import (
    WS_GAINS,
    warp_specialized_params,
    ws_threshold,
)
from schedulers.runtime import as_bytes, cdiv, tma_descriptor


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
        (``MULTIWAVE`` or ``WARP_SPECIALIZED``, no fallback: a warp-specialized kernel
        that cannot be built raises ``NotSchedulable`` saying why); None (or ``"auto"``)
        takes the warp-specialized one where ``WS_GAINS`` records a gain for this
        architecture and number of column sums and each program walks enough rows, and
        falls back to the multi-wave one when the warp-specialized parameters are
        degenerate (one stage, or too few registers left)."""
        strategy = check_strategy(self, strategy)
        rank = len(shape)
        columns = math.prod(shape[rank - plan.reduced :])
        rows = math.prod(shape[: rank - plan.reduced])
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
        walked = cdiv(rows, chosen.programs)
        threshold = ws_threshold(hardware, len(plan.column_sums), columns)
        if walked < threshold:
            why = (f"{walked} rows a program, fewer than the {threshold} that amortize a "
                   "warp-specialized program's weights and partial sums")  # fmt: skip
            return replace(multiwave, why=f"multi-wave ({why}): {multiwave.why}")
        return replace(chosen, why=f"warp-specialized ({walked} rows a program, at least "
                                   f"{threshold}): {chosen.why}")  # fmt: skip

    def kernels(
        self,
        plan: NormalizationPlan,
        params: NormalizationParams,
        shape: list[int],
        aligned: bool = False,
    ) -> list[KernelSource]:
        """The normalization kernel and a combining kernel per column sum, for rows of
        ``shape``'s reduced extent (a constexpr); one form only (``aligned`` is not read)."""
        columns = math.prod(shape[plan.rank - plan.reduced :])
        pointers = pointer_types(plan.inputs, plan.outputs)
        pointers |= {f"part{i}": "tl.float32" for i in range(len(plan.column_sums))}
        main = source(plan, params)
        kernels = [KernelSource("normalization_kernel", main, constants(plan, params, columns),
                                params.num_warps, pointers)]  # fmt: skip
        for i, expr in enumerate(plan.column_sums):
            combining = {"partial": "tl.float32", "out": memory_type(expr.output.dtype)}
            kernels.append(KernelSource("combine_kernel", combine_source(plan, i),
                                        combine_constants(columns), COMBINE_WARPS,
                                        combining))  # fmt: skip
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
        return NormalizationLauncher(
            plan,
            params,
            kernel=KERNEL_CACHE.get(source(plan, params), "normalization_kernel"),
            combines=[KERNEL_CACHE.get(combine_source(plan, i), "combine_kernel")
                      for i in range(len(plan.column_sums))],
            sum_outputs=[plan.outputs.index(e.output) for e in plan.column_sums],
            tiles=[i for i, t in enumerate(plan.inputs)
                   if params.strategy == WARP_SPECIALIZED and plan.kinds[t] == "full"],
        )  # fmt: skip


@dataclass(frozen=True)
class NormalizationLauncher(Launcher):
    """Launches a normalization: a program per ``block_rows`` rows (or a grid of
    ``programs`` walking them), then a combining kernel per column sum."""

    plan: NormalizationPlan
    params: NormalizationParams
    kernel: object  # the compiled normalization kernel
    combines: list[object]  # a combining kernel per column sum
    sum_outputs: list[int]  # the output each column sum writes
    tiles: list[int]  # inputs passed as TMA descriptors

    def __call__(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], shapes: Shapes
    ) -> None:
        plan, params = self.plan, self.params
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
        pointers = [as_bytes(t) for t in (*inputs, *targets)]
        box = [params.block_rows, params.block_columns]
        for i in self.tiles:
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
        self.kernel[grid](*pointers, *partials, rows, **constants(plan, params, columns),
                          num_warps=params.num_warps, **COMPILE_OPTIONS)  # fmt: skip
        for combine, partial, index in zip(self.combines, partials, self.sum_outputs,
                                           strict=True):  # fmt: skip
            combine[(cdiv(columns, COMBINE_COLUMNS),)](partial, targets[index], grid[0],
                **combine_constants(columns), num_warps=COMBINE_WARPS,
                **COMPILE_OPTIONS)  # fmt: skip

    def forms(self) -> list[str]:
        return []  # one form: the reduced extent is a constexpr


def _space_shape(plan: NormalizationPlan, shapes: Shapes) -> list[int]:
    for tensor, shape in shapes.items():
        if plan.kinds.get(tensor) == "full" and len(shape) == plan.rank:
            return list(shape)
    raise ValueError("no tensor of the normalization's full shape")
