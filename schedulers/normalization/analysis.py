"""What a normalization group is: which tensors run along S's rows, its reduced
columns, both or neither (``kinds``), and how many passes over a row its reductions
need (``levels``)."""

from __future__ import annotations

from dataclasses import dataclass

from fusion.dtypes import float4_e2m1, float32
from fusion.exprs import CastOp, Expr, ReductionOp, VarMeanOp
from fusion.ir import TensorView
from schedulers.analysis import POINTWISE, NotSchedulable, map_into_space
from schedulers.codegen import check_supported


@dataclass
class NormalizationPlan:
    """What the kernel computes; independent of extents."""

    column_sums: list[Expr]  # sums over the rows (a backward's dweight): partials per program
    # the output each column sum writes: its own, or a cast of it (rounded once by the
    # kernel adding the partials, as the cast of the float32 sum rounds)
    column_outputs: list[TensorView]
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
    def exchanges(self) -> dict[int, int]:
        """A split row's partials exchanged at each level that has any (the split
        strategy): one a reduction, a variance's with its mean (mean and sum of squares
        about it, combined in one round as Chan et al. combine partial variances)."""
        counts: dict[int, int] = {}
        for expr in self.reductions:
            for tensor in expr.outputs:
                if tensor not in self.levels:
                    continue
                folded = isinstance(expr, VarMeanOp) and tensor is expr.outputs[0]
                level = self.levels[expr.outputs[1]] if folded else self.levels[tensor]
                counts[level] = counts.get(level, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def variance(self) -> bool:
        """Whether one of the reductions is a variance (``var_mean``)."""
        return any(isinstance(expr, VarMeanOp) for expr in self.reductions)

    @property
    def full_inputs(self) -> list[TensorView]:
        """The inputs of the full shape S (a row each), in order."""
        return [t for t in self.inputs if self.kinds[t] == "full"]

    @property
    def unreduced_column_sums(self) -> list[bool]:
        """Whether each column sum's terms need no reduction of the row (a backward's
        dweight from the forward's saved statistics)."""
        depths = _levels(self.exprs)
        return [depths.get(e.inputs[0], 0) == 0 for e in self.column_sums]

    @property
    def buffers(self) -> int:
        """Full-row inputs a persistent kernel keeps in registers."""
        return max(1, len(self.full_inputs))


def plan_normalization(
    exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
) -> NormalizationPlan:
    """The plan of a normalization: row reductions whose results are used back along
    the rows (and column sums beside them), or ``NotSchedulable`` saying why ``exprs``
    are not one."""
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
    written = [_column_output(expr, exprs, outputs) for expr in columns]
    roots = {out: _root(out, space, reduced) for out in outputs}
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
    for out in outputs:
        if kinds[out] not in ("full", "row") and out not in written:
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
        written,
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


def _column_output(expr: Expr, exprs: list[Expr], outputs: list[TensorView]) -> TensorView:
    """The output column sum ``expr`` writes: its own, read by nothing else in ``exprs``,
    or a float cast of it that is (a 16-bit weight's gradient, summed in float32);
    ``NotSchedulable`` where it is neither."""
    summed = expr.output
    readers = [use for use in summed.uses if use in exprs]
    if summed in outputs and not readers:
        return summed
    if summed not in outputs and summed.dtype is float32 and len(readers) == 1:
        (cast,) = readers
        written = cast.outputs[0]
        if (isinstance(cast, CastOp) and written.dtype.is_floating
                and not written.dtype.storage_only and written in outputs
                and not any(use in exprs for use in written.uses)):  # fmt: skip
            return written
    raise NotSchedulable(f"{summed}: a column sum must be an output (or cast to one), unused")


def _root(out: TensorView, space: TensorView, reduced: int) -> tuple[int | None, ...]:
    """How output ``out`` maps into S: along its rows, its columns (a column sum) or
    all of it (with broadcast reduced axes)."""
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
