"""What a reduction group is: its one reduction, the pointwise ops around it, the
layout (inner: the innermost axes reduced; outer: the outermost) and how every tensor
maps into the reduction's input space S."""

from __future__ import annotations

from dataclasses import dataclass

from fusion.dtypes import DataType, compute_dtype, float64, int64
from fusion.exprs import Expr, ReductionOp
from fusion.ir import TensorView
from schedulers.analysis import POINTWISE, NotSchedulable, map_into_space
from schedulers.codegen import check_supported


@dataclass
class ReductionPlan:
    """What the kernels compute: the reduction, the pointwise ops before (prologue) and
    after it (epilogue), and how each tensor maps into S; independent of extents."""

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
    def space(self) -> TensorView:
        """The reduction's input: its shape is the iteration space S."""
        return self.reduction.inputs[0]

    @property
    def tma_inputs(self) -> list[int]:
        """Inputs an outer reduction reads as TMA tiles: those of S's full shape read
        before the reduction (the rest are loaded as before)."""
        before = {t for e in self.prologue for t in e.inputs} | {self.space}
        everything = tuple(range(self.space.ndim))
        return [i for i, t in enumerate(self.inputs)
                if t in before and self.mappings[t] == everything]  # fmt: skip

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


def plan_reduction(
    exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
) -> ReductionPlan:
    """The plan of a reduction with pointwise ops before and after it, or
    ``NotSchedulable`` saying why ``exprs`` are not one."""
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
