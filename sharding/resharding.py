"""Resharding: make every expr's inputs placed the way it needs, with communications.

After propagation every tensor has a layout (the cheapest where propagation had a
choice: ``sharding.choose_layouts``). For each expr, its rule says
which input layouts let it produce its output's layout locally
(``DimMap.backward``); where an input is placed otherwise, a copy placed as
needed is inserted before the expr. Where the expr cannot produce its output's
layout at all (a contraction over a split axis produces a partial sum, not a
split result), the expr produces what it naturally can and a copy after it
moves that to the output's layout. Fusion outputs are never left partial.
Redistribution (``sharding.redistribute``) then turns the copies into
communications.

Before that, rewrites let ranks combine partial results (``sharding.decompose``): a
row-parallel linear's bias is added once, after the partial sums are combined; a mean
or variance over a split axis becomes sums, combined across ranks.
"""

from __future__ import annotations

from dataclasses import replace

from fusion.definition import FusionDefinition
from fusion.exprs import Expr, SetOp
from fusion.ir import Fusion, ParallelType, TensorView
from sharding.choose_layouts import choose_layouts
from sharding.decompose import decompose_partial_linear_bias, decompose_split_means
from sharding.errors import ShardingError
from sharding.layout import Layout, layout_of, placed_like
from sharding.layout_cost import Cost, expr_cost
from sharding.propagation import Decision, pinned_inputs, propagate_shardings
from sharding.redistribute import redistribute

# ---------------------------------------------------------------------------
# Inserting copies where layouts disagree


class _CopyInserter:
    def __init__(self, fusion: Fusion, decisions: dict[TensorView, Decision] | None) -> None:
        self.fusion = fusion
        self.decisions = decisions
        self.pinned = pinned_inputs(fusion)
        self.copies: dict[tuple[TensorView, Layout], TensorView] = {}

    def run(self) -> None:
        for expr in list(self.fusion.exprs):
            if not isinstance(expr, SetOp):
                self._reshard(expr)
        for position, out in enumerate(self.fusion.outputs):
            layout = layout_of(out)
            if layout.is_partial:  # an output annotated partial: combined at the end
                self.fusion.outputs[position] = self._copy_after(out, layout.resolved())

    def _reshard(self, expr: Expr) -> None:
        """Choose the layout ``expr`` produces, then copy inputs (and output) to fit it.

        The candidates are the output's own layout (inputs moved to suit it), the layout
        the inputs naturally give and every other layout the output could take that
        leaves the fusion's inputs where they are (the output moved afterwards); the
        cheapest wins (``layout_cost.expr_cost``: the fewest copies of pinned inputs, then
        the fewest bits), ties going to the output's own layout. Where a way that moves
        fewer bits moves a pinned input, the output's decision says so.
        """
        layouts = {t: layout_of(t) for t in (*expr.inputs, *expr.outputs)}
        choice = expr_cost(expr, layouts, self.pinned)
        if choice is None:
            raise ShardingError(
                f"{expr.op_name} cannot produce {expr.outputs[0]} from its inputs placed "
                + ", ".join(f"{t.name} {layouts[t]}" for t in expr.inputs)
            )
        cheaper = choice.cheapest_in_bits
        if cheaper is not None and self.decisions is not None:
            out = expr.outputs[0]
            made = Cost(choice.bits, choice.pinned)
            weighed = ((choice.produced, made), (cheaper.produced, cheaper.cost))
            self.decisions[out] = replace(self.decisions[out], produced=weighed)
        for out in list(expr.outputs):
            if layouts[out] != choice.produced:
                self._produce_then_copy(expr, out, choice.produced)
        for index, (tensor, layout) in enumerate(zip(list(expr.inputs), choice.needed,
                                                     strict=True)):  # fmt: skip
            if layouts[tensor] != layout:  # by position: a tensor read twice, copied twice
                self.fusion.replace_input_at(expr, index, self._copy_before(tensor, layout, expr))

    def _copy_before(self, tensor: TensorView, layout: Layout, consumer: Expr) -> TensorView:
        """A copy of ``tensor`` placed ``layout``, defined just before ``consumer`` (shared)."""
        key = (tensor, layout)
        if key not in self.copies:
            copy = placed_like(self.fusion, tensor, layout, reductions=False)
            with self.fusion.editing():
                SetOp(tensor, copy)
            self.fusion.move_before([copy.definition], consumer)
            self.copies[key] = copy
        return self.copies[key]

    def _produce_then_copy(self, expr: Expr, out: TensorView, produced: Layout) -> None:
        """Let ``expr`` produce ``produced`` into a new tensor, then copy it into ``out``."""
        natural = placed_like(self.fusion, out, produced, reductions=True)
        self.fusion.redirect_output(expr, out, natural)
        with self.fusion.editing():
            SetOp(natural, out)
        self.fusion.move_after([out.definition], expr)

    def _copy_after(self, tensor: TensorView, layout: Layout) -> TensorView:
        copy = placed_like(self.fusion, tensor, layout, reductions=False)
        with self.fusion.editing():
            SetOp(tensor, copy)
        return copy


def insert_reshardings(fusion: Fusion, decisions: dict[TensorView, Decision] | None = None) -> None:
    """Insert the copies that make every expr's layouts agree, then turn them into
    communications (``redistribute``). Pinned inputs (``sharding.pin``) are moved only
    where every way moves them; propagation's ``decisions``, where given, say where
    keeping one in place cost bits."""
    _CopyInserter(fusion, decisions).run()
    redistribute(fusion)


def shard_fusion(
    fusion: Fusion | FusionDefinition,
) -> tuple[Fusion, dict[TensorView, Decision]]:
    """A copy of ``fusion`` (or a ``FusionDefinition``'s) with every tensor placed and
    every communication inserted.

    Returns the copy and the propagation decisions (for ``explain``). The user's
    fusion is not changed.
    """
    if isinstance(fusion, FusionDefinition):
        fusion = fusion.fusion
    sharded = fusion.clone()
    annotated = {t for t in sharded.tensors if t.mesh is not None}
    decisions = propagate_shardings(sharded)
    if decompose_partial_linear_bias(sharded) | decompose_split_means(sharded):
        for tensor in sharded.tensors:
            if tensor not in annotated:
                tensor.mesh = None
                for axis in tensor.axes:
                    if axis.parallel_type.is_device:
                        axis.parallel_type = ParallelType.Serial
        decisions = propagate_shardings(sharded)
    choose_layouts(sharded, decisions)
    insert_reshardings(sharded, decisions)
    return sharded, decisions
