"""Resharding: make every expr's inputs placed the way it needs, with communications.

After propagation every tensor has a layout. For each expr, its rule says
which input layouts let it produce its output's layout locally
(``DimMap.backward``); where an input is placed otherwise, a copy placed as
needed is inserted before the expr. Where the expr cannot produce its output's
layout at all (a contraction over a split axis produces a partial sum, not a
split result), the expr produces what it naturally can and a copy after it
moves that to the output's layout. Fusion outputs are never left partial.

Then every copy whose input and output layouts differ becomes a chain of
``Communication``/``LocalShard`` exprs, one mesh axis per step: partial sums
are resolved first (all-reduce, or reduce-scatter when the consumer wants a
split: the cheapest legal point), then splits are gathered or moved, and local
splits come last.

A row-parallel linear with a bias is first split into a linear and an add, so
the bias is added once, after the partial sums are combined.
"""

from __future__ import annotations

import itertools
import math

from fusion import ops
from fusion.exprs import Expr, LinearOp, SetOp
from fusion.ir import Axis, Fusion, ParallelType, TensorView
from sharding.communication import Communication, CommunicationKind, LocalShard
from sharding.errors import ShardingError
from sharding.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    apply_layout,
    layout_of,
)
from sharding.propagation import Decision, propagate_shardings
from sharding.rules import mesh_rule


def _copy_axes(fusion: Fusion, axes: list[Axis]) -> list[Axis]:
    return [fusion.new_axis(a.extent, a.iter_type) for a in axes]


def _placed_copy(
    fusion: Fusion, tensor: TensorView, layout: Layout, reductions: bool
) -> TensorView:
    """A new tensor shaped like ``tensor`` (with its reduction axes if asked), placed ``layout``."""
    axes = tensor.axes if reductions else tensor.logical_axes
    copy = fusion.new_tensor(tensor.dtype, _copy_axes(fusion, axes))
    apply_layout(copy, layout)
    return copy


def _splice(fusion: Fusion, exprs: list[Expr], index: int) -> None:
    """Move freshly appended ``exprs`` to position ``index`` of the expr list."""
    for expr in exprs:
        fusion.exprs.remove(expr)
    fusion.exprs[index:index] = exprs


# ---------------------------------------------------------------------------
# Row-parallel linear with bias


def decompose_partial_linear_bias(fusion: Fusion) -> bool:
    """Rewrite ``linear(x, w, b)`` whose output is partial as ``linear(x, w) + b``.

    Returns whether anything changed (the layouts of the rewritten part must then be
    propagated again).
    """
    changed = False
    for expr in list(fusion.exprs):
        if not (isinstance(expr, LinearOp) and expr.has_bias):
            continue
        out = expr.output
        layout = layout_of(out)
        if layout is None or not layout.is_partial:
            continue
        x, weight, bias = expr.inputs
        index = fusion.exprs.index(expr)
        with fusion.editing():
            product = ops.linear(x, weight)
            row = ops.broadcast(bias, [True] * (out.ndim - 1) + [False])
            total = ops.add(product, row)
        new_exprs = fusion.exprs[-3:]
        fusion.remove_expr(expr)
        fusion.redirect_output(total.definition, total, out)
        fusion.tensors.remove(total)
        _splice(fusion, new_exprs, index)
        changed = True
    return changed


# ---------------------------------------------------------------------------
# Inserting copies where layouts disagree


class _Resharder:
    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion
        self.copies: dict[tuple[TensorView, Layout], TensorView] = {}

    def run(self) -> None:
        for expr in list(self.fusion.exprs):
            if not isinstance(expr, SetOp):
                self._reshard(expr)
        for position, out in enumerate(self.fusion.outputs):
            layout = layout_of(out)
            if layout.is_partial:
                resolved = Layout(
                    layout.mesh,
                    tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements),
                )
                self.fusion.outputs[position] = self._copy_after(out, resolved)
        for expr in list(self.fusion.exprs):
            if type(expr) is SetOp:
                self._lower_copy(expr)

    def _reshard(self, expr: Expr) -> None:
        """Choose the layout ``expr`` produces, then copy inputs (and output) to fit it.

        Two candidates: the output's own layout (inputs moved to suit it) and the layout
        the inputs naturally give (the output moved afterwards); the one that moves fewer
        bits wins, ties going to the output's own layout.
        """
        out_layout = layout_of(expr.outputs[0])
        rule = mesh_rule(expr, out_layout.mesh)
        natural = rule.forward([layout_of(t) for t in expr.inputs])
        candidates = [c for c in (out_layout, natural) if rule.backward(c) is not None]
        produced = min(
            candidates,
            key=lambda candidate: (
                sum(
                    _moved_bits(t, layout_of(t), needed)
                    for t, needed in zip(expr.inputs, rule.backward(candidate), strict=True)
                )
                + sum(_moved_bits(out, candidate, layout_of(out)) for out in expr.outputs)
            ),
        )
        for out in list(expr.outputs):
            if layout_of(out) != produced:
                self._produce_then_copy(expr, out, produced)
        for tensor, layout in zip(list(expr.inputs), rule.backward(produced), strict=True):
            if layout_of(tensor) != layout:
                self.fusion.replace_input(expr, tensor, self._copy_before(tensor, layout, expr))

    def _copy_before(self, tensor: TensorView, layout: Layout, consumer: Expr) -> TensorView:
        """A copy of ``tensor`` placed ``layout``, defined just before ``consumer`` (shared)."""
        key = (tensor, layout)
        if key not in self.copies:
            copy = _placed_copy(self.fusion, tensor, layout, reductions=False)
            with self.fusion.editing():
                SetOp(tensor, copy)
            self.fusion.move_before([copy.definition], consumer)
            self.copies[key] = copy
        return self.copies[key]

    def _produce_then_copy(self, expr: Expr, out: TensorView, produced: Layout) -> None:
        """Let ``expr`` produce ``produced`` into a new tensor, then copy it into ``out``."""
        natural = _placed_copy(self.fusion, out, produced, reductions=True)
        self.fusion.redirect_output(expr, out, natural)
        with self.fusion.editing():
            SetOp(natural, out)
        self.fusion.move_after([out.definition], expr)

    def _copy_after(self, tensor: TensorView, layout: Layout) -> TensorView:
        copy = _placed_copy(self.fusion, tensor, layout, reductions=False)
        with self.fusion.editing():
            SetOp(tensor, copy)
        return copy

    # -----------------------------------------------------------------------
    # Copies become communications

    def _lower_copy(self, copy: SetOp) -> None:
        (source,), target = copy.inputs, copy.output
        in_layout, out_layout = layout_of(source), layout_of(target)
        if in_layout == out_layout:
            return
        index = self.fusion.exprs.index(copy)
        self.fusion.remove_expr(copy)
        if in_layout.mesh == out_layout.mesh:
            chain = self._one_mesh_chain(source, target, in_layout, out_layout)
        else:
            chain = [self._between_meshes(source, target, in_layout, out_layout)]
        _splice(self.fusion, chain, index)

    def _one_mesh_chain(
        self, source: TensorView, target: TensorView, in_layout: Layout, out_layout: Layout
    ) -> list[Expr]:
        steps = _plan(in_layout, out_layout, source)
        chain: list[Expr] = []
        current, current_layout = source, in_layout
        for number, (mesh_axis, after) in enumerate(steps):
            next_layout = current_layout.with_placement(mesh_axis, after)
            last = number == len(steps) - 1
            result = target if last else _placed_copy(self.fusion, target, next_layout, False)
            with self.fusion.editing():
                chain.append(_step(current, result, current_layout, next_layout, mesh_axis))
            current, current_layout = result, next_layout
        return chain

    def _between_meshes(
        self, source: TensorView, target: TensorView, in_layout: Layout, out_layout: Layout
    ) -> Expr:
        in_mesh, out_mesh = in_layout.mesh, out_layout.mesh
        kinds = CommunicationKind
        with self.fusion.editing():
            if (
                in_layout.is_replicated
                and out_layout.is_replicated
                and set(out_mesh.ranks) <= set(in_mesh.ranks)
            ):
                return SetOp(source, target)  # every destination rank already holds it
            if in_mesh.size == 1:
                root = in_mesh.ranks[0]
                if out_layout.is_replicated:
                    if out_mesh.size == 1:
                        return Communication(
                            kinds.SendRecv, source, target, in_layout, out_layout,
                            pairs=[(root, out_mesh.ranks[0])],
                        )  # fmt: skip
                    return Communication(
                        kinds.Broadcast, source, target, in_layout, out_layout, root=root
                    )
                split = _single_split(out_layout)
                if split is not None:
                    return Communication(
                        kinds.Scatter, source, target, in_layout, out_layout,
                        out_dim=split, root=root,
                    )  # fmt: skip
            if out_mesh.size == 1:
                root = out_mesh.ranks[0]
                split = _single_split(in_layout)
                if split is not None:
                    return Communication(
                        kinds.Gather, source, target, in_layout, out_layout,
                        in_dim=split, root=root,
                    )  # fmt: skip
                if in_mesh.ndim == 1 and isinstance(in_layout.placements[0], Partial):
                    return Communication(
                        kinds.Reduce, source, target, in_layout, out_layout,
                        root=root, reduce_op=in_layout.placements[0].op,
                    )  # fmt: skip
                if in_layout.is_replicated:
                    return Communication(
                        kinds.SendRecv, source, target, in_layout, out_layout,
                        pairs=[(in_mesh.ranks[0], root)],
                    )  # fmt: skip
            if in_mesh.shape == out_mesh.shape and in_layout.placements == out_layout.placements:
                return Communication(
                    kinds.SendRecv, source, target, in_layout, out_layout,
                    pairs=list(zip(in_mesh.ranks, out_mesh.ranks, strict=True)),
                )  # fmt: skip
        raise ShardingError(
            f"cannot move {source} placed {in_layout} to {target} placed {out_layout}: "
            "between two meshes, place one side on a single rank, or give both meshes the "
            "same shape and the same placements"
        )


def _moved_bits(tensor: TensorView, before: Layout, after: Layout) -> int:
    """A rough count of the bits a resharding moves: the tensor's size per collective step
    (twice for an all-reduce); splitting locally is free. Symbolic extents count as 1024."""
    if before == after:
        return 0
    size = tensor.dtype.size_bits(
        math.prod(e if isinstance(e, int) else 1024 for e in tensor.shape)
    )
    if before.mesh != after.mesh:
        return size
    bits = 0
    for old, new in zip(before.placements, after.placements, strict=True):
        if old == new or (isinstance(old, Replicate) and isinstance(new, Shard)):
            continue
        bits += 2 * size if isinstance(old, Partial) and isinstance(new, Replicate) else size
    return bits


def _single_split(layout: Layout) -> int | None:
    """The split axis of a layout on a 1-D mesh split once, else None."""
    if layout.mesh.ndim == 1 and isinstance(layout.placements[0], Shard):
        return layout.placements[0].dim
    return None


_STEP_ORDER = {  # resolve partial sums first, gather and move splits, split locally last
    (Partial, Replicate): 0,
    (Partial, Shard): 0,
    (Shard, Replicate): 1,
    (Shard, Shard): 2,
    (Replicate, Shard): 3,
}


def _plan(in_layout: Layout, out_layout: Layout, tensor: TensorView) -> list[tuple[int, Placement]]:
    """Mesh-axis steps from ``in_layout`` to ``out_layout`` whose intermediates are valid."""
    changes = [
        (axis, before, after)
        for axis, (before, after) in enumerate(
            zip(in_layout.placements, out_layout.placements, strict=True)
        )
        if before != after
    ]
    for before_after in changes:
        if (type(before_after[1]), type(before_after[2])) not in _STEP_ORDER:
            _, before, after = before_after
            raise ShardingError(
                f"cannot reshard {tensor} from {before} to {after} "
                f"(placed {in_layout}, needed {out_layout})"
            )
    changes.sort(key=lambda c: _STEP_ORDER[(type(c[1]), type(c[2]))])
    for order in itertools.permutations(changes):
        layout = in_layout
        try:
            for axis, _, after in order:
                layout = layout.with_placement(axis, after)
        except ValueError:
            continue
        return [(axis, after) for axis, _, after in order]
    raise ShardingError(f"cannot reshard {tensor} from {in_layout} to {out_layout}")


def _step(
    source: TensorView, target: TensorView, before: Layout, after: Layout, mesh_axis: int
) -> Expr:
    old, new = before.placements[mesh_axis], after.placements[mesh_axis]
    kinds = CommunicationKind
    args = (source, target, before, after, mesh_axis)
    if isinstance(old, Partial):
        if isinstance(new, Replicate):
            return Communication(kinds.Allreduce, *args, reduce_op=old.op)
        return Communication(kinds.ReduceScatter, *args, out_dim=new.dim, reduce_op=old.op)
    if isinstance(old, Shard) and isinstance(new, Replicate):
        return Communication(kinds.Allgather, *args, in_dim=old.dim)
    if isinstance(old, Shard):
        return Communication(kinds.AllToAll, *args, in_dim=old.dim, out_dim=new.dim)
    return LocalShard(source, target, before.mesh, mesh_axis, new.dim)


def insert_reshardings(fusion: Fusion) -> None:
    """Insert the copies and communications that make every expr's layouts agree."""
    _Resharder(fusion).run()


def shard_fusion(fusion: Fusion) -> tuple[Fusion, dict[TensorView, Decision]]:
    """A copy of ``fusion`` with every tensor placed and every communication inserted.

    Returns the copy and the propagation decisions (for ``explain``). The user's
    fusion is not changed.
    """
    sharded = fusion.clone()
    annotated = {t for t in sharded.tensors if t.mesh is not None}
    decisions = propagate_shardings(sharded)
    if decompose_partial_linear_bias(sharded):
        for tensor in sharded.tensors:
            if tensor not in annotated:
                tensor.mesh = None
                for axis in tensor.axes:
                    if axis.parallel_type.is_device:
                        axis.parallel_type = ParallelType.Serial
        decisions = propagate_shardings(sharded)
    insert_reshardings(sharded)
    return sharded, decisions
