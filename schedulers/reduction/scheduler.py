"""The reduction scheduler: its analysis, the choice between its strategies, its kernels
and their launcher."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusion.exprs import Expr
from fusion.ir import TensorView
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
from schedulers.cache import AlignedVariants, forms_used
from schedulers.codegen import COMPILE_OPTIONS, memory_type, pointer_types
from schedulers.hardware import HardwareProfile
from schedulers.reduction.analysis import ReductionPlan, plan_reduction
from schedulers.reduction.codegen import (
    COMBINE_WARPS,
    aligned_arguments,
    combine_constants,
    combine_source,
    constants,
    source,
)
from schedulers.reduction.heuristics import ReductionParams, tiled_params
from schedulers.reduction.tma import tma_params
from schedulers.runtime import allocator, as_bytes, cdiv, contiguous_strides
from schedulers.tma_tensors import tma_descriptor


class ReductionScheduler(Scheduler[ReductionPlan, ReductionParams]):
    """Takes one sum, max, min or mean over the innermost or outermost axes, with
    pointwise ops before and after it."""

    name = "reduction"
    # "tiled": ordinary loads (the heuristics' choice); "tma": an outer reduction's
    # full-shape inputs read as TMA tiles, forced only (no fallback)
    strategies: tuple[str, ...] = ("tiled", "tma")

    def plan(
        self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
    ) -> ReductionPlan:
        return plan_reduction(exprs, inputs, outputs)

    def heuristics(
        self,
        plan: ReductionPlan,
        hardware: HardwareProfile,
        shape: list[int],
        strategy: str | None = None,
    ) -> ReductionParams:
        """The tiled strategy's params (``tiled_params``) unless ``strategy="tma"``
        forces an outer reduction through TMA tiles (``tma_params``)."""
        strategy = check_strategy(self, strategy)
        reduced = math.prod(shape[axis] for axis in plan.reduced)
        if strategy == "tma":
            kept = math.prod(shape[axis] for axis in plan.kept)
            return tma_params(plan, hardware, reduced, kept)
        return tiled_params(plan, hardware, reduced)

    def kernels(
        self, plan: ReductionPlan, params: ReductionParams, shape: list[int], aligned: bool = False
    ) -> list[KernelSource]:
        """The reduction kernel, and for an outer reduction the kernel combining its
        parts (no extent in either: ``shape`` is not read)."""
        pointers = pointer_types(plan.inputs, plan.outputs)
        pointers["partial"] = memory_type(plan.accumulator)
        main = source(plan, params, aligned)
        kernels = [KernelSource("reduction_kernel", main, constants(plan, params),
                                params.num_warps, pointers)]  # fmt: skip
        if plan.layout == "outer":
            combine = combine_source(plan, params, aligned)
            kernels.append(KernelSource("combine_kernel", combine, combine_constants(params),
                                        COMBINE_WARPS, pointers))  # fmt: skip
        return kernels

    def launcher(
        self,
        plan: ReductionPlan,
        params: ReductionParams,
        hardware: HardwareProfile,
        local_shape: LocalShape,
    ) -> ReductionLauncher:
        """Raises ``NotSchedulable`` for atomics (``deterministic=False``) anywhere but a
        float32 outer sum or mean."""
        if not params.deterministic and (
            plan.layout != "outer" or plan.accumulator.name != "float32"
            or plan.reduction.op_name not in ("sum", "mean")
        ):  # fmt: skip
            raise NotSchedulable("atomics are for float32 outer sums and means only")
        space = local_shape(plan.space)
        rank = len(space)
        names = ["kept_count", "reduced_count", "split"] + [f"size{axis}" for axis in range(rank)]
        names += [f"stride{i}_{axis}" for i in range(len(plan.inputs)) for axis in range(rank)]
        keywords = {**constants(plan, params), "num_warps": params.num_warps, **COMPILE_OPTIONS}
        combining = {**combine_constants(params), "num_warps": COMBINE_WARPS, **COMPILE_OPTIONS}
        return ReductionLauncher(
            plan,
            params,
            sm_count=hardware.sm_count,
            reduced_extents=[space[axis] for axis in plan.reduced],
            main=AlignedVariants(lambda aligned: source(plan, params, aligned),
                                 "reduction_kernel", keywords),
            combine=AlignedVariants(lambda aligned: combine_source(plan, params, aligned),
                                    "combine_kernel", combining),
            names=names,
            known=aligned_arguments(plan),
            described=plan.tma_inputs if params.tma else [],
            combine_columns=combining["BLOCK_KEPT"],
        )  # fmt: skip


@dataclass(frozen=True)
class ReductionLauncher(Launcher):
    """Launches a reduction: inner, one kernel (a program per ``block_rows`` rows);
    outer, the reduction kernel over a grid of kept tiles by parts of the reduced
    extent (a few waves of ``sm_count`` programs), then the combining kernel."""

    plan: ReductionPlan
    params: ReductionParams
    sm_count: int
    reduced_extents: list[int]  # the reduced axes' (the kept ones come from the outputs)
    main: AlignedVariants
    combine: AlignedVariants
    names: list[str]  # the runtime arguments of both kernels
    known: list[str]  # those the aligned forms know are multiples (aligned_arguments)
    described: list[int]  # inputs passed as TMA descriptors
    combine_columns: int  # a combining program's kept columns

    def __call__(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], shapes: Shapes
    ) -> None:
        self.bind(shapes)(inputs, targets)

    def bind(self, shapes: Shapes) -> BoundLaunch:
        """The launch for these shapes: its grids, runtime arguments and kernel forms
        worked out once; a launch passes the tensors (as bytes or TMA descriptors) and,
        for an outer reduction, a new row of partial results."""
        plan, params = self.plan, self.params
        rank = plan.space.ndim
        kept_shape = iter(shapes[plan.outputs[0]])
        reduced_shape = iter(self.reduced_extents)
        shape = [
            next(reduced_shape) if axis in plan.reduced else next(kept_shape)
            for axis in range(rank)
        ]
        kept_count = math.prod(shape[a] for a in plan.kept)
        reduced_count = math.prod(shape[a] for a in plan.reduced)
        if kept_count == 0:
            return launch_nothing
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
        box = [params.block_rows, params.block_reduce]
        described = self.described

        def pointers_of(inputs: list[torch.Tensor]) -> list:
            pointers = [as_bytes(t) for t in inputs]
            for i in described:
                pointers[i] = tma_descriptor(pointers[i], reduced_count, kept_count, box, params)
            return pointers

        def bind(variants: AlignedVariants, split: int):
            """The kernel of ``variants`` for this shape, its runtime arguments bound."""
            values = [kept_count, reduced_count, split, *shape, *strides]
            kernel, arguments = variants.bind(dict(zip(self.names, values, strict=True)),
                                              self.known)  # fmt: skip
            return kernel.with_scalars(*arguments)

        if plan.layout == "inner":
            grid = (cdiv(kept_count, params.block_rows),)
            kernel = bind(self.main, 1)

            def launch_inner(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
                kernel(grid, *pointers_of(inputs), *[as_bytes(t) for t in targets])

            return launch_inner
        tiles = cdiv(kept_count, params.block_reduce)
        most = max(1, cdiv(reduced_count, params.block_rows))
        split = min(most, max(1, params.waves * self.sm_count // tiles))
        # Deterministic: every part writes its row of partial results (no fill needed);
        # atomics add into one zeroed row, and the float32 sum is the result.
        partial_shape = (split if params.deterministic else 1, kept_count)
        partial_strides, zeroed = contiguous_strides(partial_shape), not params.deterministic
        main = bind(self.main, split)
        combine = bind(self.combine, split if params.deterministic else 1)
        combine_grid = (cdiv(kept_count, self.combine_columns),)

        def launch_outer(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
            pointers = pointers_of(inputs)
            partial = allocator(inputs[0].device)(partial_shape, partial_strides,
                                                  plan.accumulator.torch_dtype)  # fmt: skip
            if zeroed:
                partial.zero_()
            main((tiles, split), partial, *pointers)
            combine(combine_grid, partial, *pointers, *[as_bytes(t) for t in targets])

        return launch_outer

    def forms(self) -> list[str]:
        return forms_used([self.main, self.combine])
