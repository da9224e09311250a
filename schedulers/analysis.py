"""What a group of exprs looks like to a kernel: its iteration space and how each tensor
it reads maps into it.

A pointwise kernel computes every value at every point of one iteration space S (the
shape of its outputs). A tensor read from memory may cover only some axes of S: it was
broadcast or expanded on the way. ``map_into_space`` works out, for every tensor of the
group, which axis of S each of its axes runs along (None for an axis of extent 1 that is
broadcast). Axes of S along which every input behaves alike are then merged
(``collapse``), so a kernel divides its flat index by as few extents as possible.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.exprs import (
    BinaryOp,
    BroadcastOp,
    CastOp,
    CompareOp,
    DetachOp,
    DropoutMaskOp,
    ExpandOp,
    Expr,
    ReductionOp,
    SetOp,
    UnaryOp,
    VarMeanOp,
    WhereOp,
)
from fusion.ir import Extent, TensorView

ELEMENTWISE = (UnaryOp, BinaryOp, CompareOp, WhereOp, CastOp, SetOp, DetachOp)
POINTWISE = ELEMENTWISE + (BroadcastOp, ExpandOp)

Mapping = tuple[int | None, ...]  # per axis of a tensor: the axis of S it runs along


class NotSchedulable(Exception):
    """Why a scheduler does not take a group of exprs."""


def _broadcasts(source: Extent, target: Extent) -> bool:
    return source == 1 and target != 1


def map_into_space(
    exprs: list[Expr],
    roots: dict[TensorView, Mapping],
    reduced_axes: tuple[int, ...] | None = None,
) -> dict[TensorView, Mapping]:
    """Map every tensor the pointwise ``exprs`` touch into the space of the ``roots``.

    ``roots`` gives the mapping of the tensors the walk starts from (the outputs, or a
    reduction's input). With ``reduced_axes`` (the innermost axes of S), reductions over
    their input's innermost axes are walked through too (the input runs along the
    output's axes and then ``reduced_axes``), and so are sums over all the other axes
    (column sums: the input runs along S's kept axes, then the output's). Raises
    ``NotSchedulable`` when a tensor would need two mappings.
    """
    mapping = dict(roots)

    def assign(tensor: TensorView, value: Mapping) -> None:
        if mapping.get(tensor, value) != value:
            raise NotSchedulable(f"{tensor} is used along two different sets of axes")
        mapping[tensor] = value

    for expr in reversed(exprs):
        outs = [o for o in expr.outputs if o in mapping]
        if not outs:
            raise NotSchedulable(f"{expr.op_name}: its result is not used by the kernel")
        out = outs[0]
        target = mapping[out]
        if isinstance(expr, ELEMENTWISE):
            for tensor in expr.inputs:
                assign(
                    tensor,
                    tuple(
                        None if _broadcasts(a, b) else target[d]
                        for d, (a, b) in enumerate(zip(tensor.shape, out.shape, strict=True))
                    ),
                )
        elif isinstance(expr, BroadcastOp):
            kept = [d for d, flag in enumerate(expr.is_broadcast_dim) if not flag]
            (source,) = expr.inputs
            assign(source, tuple(target[d] for d in kept))
        elif isinstance(expr, ExpandOp):
            (source,) = expr.inputs
            assign(
                source,
                tuple(
                    None if _broadcasts(a, b) else target[d]
                    for d, (a, b) in enumerate(zip(source.shape, out.shape, strict=True))
                ),
            )
        elif isinstance(expr, DropoutMaskOp):
            (seed,) = expr.inputs  # one element, the same at every point
            assign(seed, (None,) * seed.ndim)
        elif reduced_axes is not None and isinstance(expr, (ReductionOp, VarMeanOp)):
            (source,) = expr.inputs
            count, rank = len(reduced_axes), source.ndim
            if tuple(expr.dims) == tuple(range(rank - count, rank)):
                assign(source, tuple(target) + tuple(reduced_axes))
            elif isinstance(expr, ReductionOp) and tuple(expr.dims) == tuple(range(rank - count)):
                # a column reduction (over S's kept axes): its result runs along the
                # reduced axes, its input along all of them
                assign(source, tuple(range(rank - count)) + tuple(target))
            else:
                raise NotSchedulable(f"{expr.op_name} reduces neither the inner axes nor the rest")
        else:
            raise NotSchedulable(f"{expr.op_name} is not a pointwise op")
    return mapping


@dataclass(frozen=True)
class Collapsed:
    """Groups of consecutive axes of S that every input treats alike."""

    groups: tuple[tuple[int, ...], ...]  # axes of S, outermost group first
    present: tuple[tuple[bool, ...], ...]  # per input: whether it varies along each group

    def signature(self) -> tuple:
        return (len(self.groups), self.present)


def collapse(rank: int, inputs: list[Mapping], starts: frozenset[int] = frozenset()) -> Collapsed:
    """Merge neighbouring axes of a rank-``rank`` space where no input tells them apart;
    an axis in ``starts`` always starts a group of its own."""
    flags = [tuple(d in mapping for d in range(rank)) for mapping in inputs]
    groups: list[list[int]] = []
    for axis in range(rank):
        if groups and axis not in starts and all(f[axis] == f[groups[-1][-1]] for f in flags):
            groups[-1].append(axis)
        else:
            groups.append([axis])
    present = tuple(tuple(f[group[0]] for group in groups) for f in flags)
    return Collapsed(tuple(tuple(g) for g in groups), present)


def group_sizes(collapsed: Collapsed, shape: list[int]) -> list[int]:
    """The extents of the groups for a concrete shape of S."""
    sizes = []
    for group in collapsed.groups:
        size = 1
        for axis in group:
            size *= shape[axis]
        sizes.append(size)
    return sizes


def group_strides(collapsed: Collapsed, mapping: Mapping, shape: list[int]) -> list[int]:
    """A contiguous input's stride (in elements) along each group; 0 where it is absent.

    ``shape`` is the input's own logical shape.
    """
    strides = []
    for group in collapsed.groups:
        dims = [d for d, axis in enumerate(mapping) if axis in group]
        if not dims:
            strides.append(0)
            continue
        stride = 1
        for extent in shape[dims[-1] + 1 :]:
            stride *= extent
        strides.append(stride)
    return strides


def unit_stride_group(collapsed: Collapsed, mapping: Mapping) -> int | None:
    """The group along which a contiguous input steps by one element: the group of its
    innermost dimension (None when that dimension is in no group)."""
    if not mapping or mapping[-1] is None:
        return None
    for g, group in enumerate(collapsed.groups):
        if mapping[-1] in group:
            return g
    return None
