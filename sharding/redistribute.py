"""Redistribution: turn every copy between two layouts into communications.

After resharding, a copy (``SetOp``) whose input and output layouts differ
stands wherever a tensor must move. On one mesh it becomes a chain of
``Communication``/``LocalShard`` exprs, one mesh axis per step: partial sums
are resolved first (all-reduce, or reduce-scatter when the consumer wants a
split), then splits are gathered or moved, and local splits come last
(S->R all-gather, P->R all-reduce, P->S reduce-scatter, S->S all-to-all,
R->S a local split). Between two meshes it becomes one point-to-point or
rooted communication (send/recv, broadcast, scatter, gather, reduce).
"""

from __future__ import annotations

import itertools

from fusion.exprs import Expr, SetOp
from fusion.ir import Fusion, TensorView
from sharding.communication import Communication, CommunicationKind, LocalShard
from sharding.errors import ShardingError
from sharding.layout import Layout, Partial, Placement, Replicate, Shard, layout_of, placed_like


def redistribute(fusion: Fusion) -> None:
    """Replace every copy (``SetOp``) of ``fusion`` that changes a layout with communications."""
    for expr in list(fusion.exprs):
        if type(expr) is SetOp:
            _redistribute_copy(fusion, expr)


def _redistribute_copy(fusion: Fusion, copy: SetOp) -> None:
    (source,), target = copy.inputs, copy.output
    in_layout, out_layout = layout_of(source), layout_of(target)
    if in_layout == out_layout:
        return
    if in_layout.mesh == out_layout.mesh:
        chain = _one_mesh_chain(fusion, source, target, in_layout, out_layout)
    else:
        chain = [_between_meshes(fusion, source, target, in_layout, out_layout)]
    fusion.move_after(chain, copy)
    fusion.remove_expr(copy)


def _one_mesh_chain(
    fusion: Fusion, source: TensorView, target: TensorView, in_layout: Layout, out_layout: Layout
) -> list[Expr]:
    steps = _plan(in_layout, out_layout, source)
    chain: list[Expr] = []
    current, current_layout = source, in_layout
    for number, (mesh_axis, after) in enumerate(steps):
        next_layout = current_layout.with_placement(mesh_axis, after)
        last = number == len(steps) - 1
        if last:
            result = target
        elif next_layout.is_partial:  # still partial on another mesh axis: keep the reduction
            result = placed_like(fusion, source, next_layout, reductions=True)
        else:
            result = placed_like(fusion, target, next_layout, reductions=False)
        with fusion.editing():
            chain.append(_step(current, result, current_layout, next_layout, mesh_axis))
        current, current_layout = result, next_layout
    return chain


def _between_meshes(
    fusion: Fusion, source: TensorView, target: TensorView, in_layout: Layout, out_layout: Layout
) -> Expr:
    in_mesh, out_mesh = in_layout.mesh, out_layout.mesh
    kinds = CommunicationKind
    with fusion.editing():
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
