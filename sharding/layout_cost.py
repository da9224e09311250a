"""What a layout costs: the bits a rank sends to move a tensor between two layouts, and
the cheapest way for one expr to meet the layouts around it.

The counts follow the communications ``sharding.redistribute`` inserts, one mesh axis
at a time, per rank, over ``n`` ranks along the axis, for a piece of ``b`` bits:
all-gather and reduce-scatter move ``b (n-1)/n``, an all-reduce twice that, an
all-to-all ``b (n-1)/n^2`` (each rank keeps one ``n``-th of what it holds), a local
split nothing; between two meshes the whole tensor moves. Symbolic extents count as
1024. These are the figures propagation's choices are compared by (``choose_layouts``)
and the resharding pass picks what each expr produces by.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from fusion.exprs import Expr, LinearOp, MatmulOp
from fusion.ir import TensorView
from sharding.layout import Layout, Partial, Placement, Replicate, Shard, partial_op
from sharding.rules import MeshRule, mesh_rule

SYMBOLIC_EXTENT = 1024  # what a symbolic extent counts as when sizes are compared
UNREACHABLE = float("inf")
# Matmul work weighed against communication: a Hopper GPU does about 800 TFLOP/s of
# bf16 matmul and sends about 3.2 Tbit/s over NVLink, so one bit moved costs the time
# of some 250 multiply-adds. Layouts that make every rank repeat a whole matmul (to
# save gathering its small result) pay for it.
FLOPS_PER_BIT = 250.0


def tensor_bits(tensor: TensorView) -> int:
    """The whole tensor's size in bits (logical axes; a symbolic extent counts 1024)."""
    extents = (e if isinstance(e, int) else SYMBOLIC_EXTENT for e in tensor.shape)
    return tensor.dtype.size_bits(math.prod(extents))


def moved_bits(tensor: TensorView, before: Layout, after: Layout) -> float:
    """Bits a rank sends to move ``tensor`` from ``before`` to ``after`` (inf: impossible)."""
    if before == after:
        return 0.0
    size = tensor_bits(tensor)
    if before.mesh != after.mesh:
        return float(size)
    mesh = before.mesh
    total = 0.0
    for axis, (old, new) in enumerate(zip(before.placements, after.placements, strict=True)):
        if old == new or (isinstance(old, Replicate) and isinstance(new, Shard)):
            continue
        if isinstance(new, Partial):
            return UNREACHABLE  # nothing turns whole values into partial ones
        ranks = mesh.shape[axis]
        # the piece held while this axis moves: split by the other mesh axes
        divisor = math.prod(
            mesh.shape[other]
            for other, placement in enumerate(before.placements)
            if other != axis and isinstance(placement, Shard)
        )
        piece = size / divisor
        # a one-rank team moves nothing; a millionth keeps ties going to smaller tensors
        share = max((ranks - 1) / ranks, 1e-6)
        if isinstance(old, Partial):
            total += piece * share * (2 if isinstance(new, Replicate) else 1)
        elif isinstance(new, Replicate):
            total += piece * share
        else:
            total += piece * share / ranks
    return total


def candidate_layouts(tensor: TensorView, current: Layout, *, partial: bool) -> list[Layout]:
    """Every layout ``tensor`` could take on ``current``'s mesh: per mesh axis replicated,
    split on any axis of extent above 1, or (with ``partial``, for results of reductions
    and contractions) partial. ``current`` comes first."""
    mesh = current.mesh
    per_axis: list[Placement] = [Replicate()]
    per_axis += [Shard(d) for d, extent in enumerate(tensor.shape) if extent != 1]
    if partial and any(axis.is_reduction for axis in tensor.axes):
        per_axis.append(Partial(partial_op(tensor)))
    layouts = [current]
    for placements in itertools.product(per_axis, repeat=mesh.ndim):
        if sum(isinstance(p, Partial) for p in placements) > free_reductions(tensor):
            continue
        try:
            layout = Layout(mesh, placements)
        except ValueError:  # an axis split twice
            continue
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def free_reductions(tensor: TensorView) -> int:
    """How many reduction axes ``tensor`` keeps (each can hold one mesh axis' partial)."""
    return sum(axis.is_reduction for axis in tensor.axes)


@dataclass(frozen=True)
class Choice:
    """What one expr produces and the moves that puts around it: ``moves`` holds
    (tensor, the layout it is copied to, bits); a copy of an input is shared by every
    consumer that needs the same layout, so sums over several exprs count it once."""

    bits: float
    produced: Layout
    moves: tuple[tuple[TensorView, Layout, float], ...] = ()


def expr_cost(expr: Expr, layouts: Mapping[TensorView, Layout]) -> Choice:
    """The fewest bits ``expr`` needs moved for its inputs and outputs to hold ``layouts``,
    and the layout it should produce to get there (inputs copied to suit it before, the
    output copied from it after). Ties go to the output's own layout."""
    out = expr.outputs[0]
    wanted = layouts[out]
    rule = mesh_rule(expr, wanted.mesh)
    best = Choice(UNREACHABLE, wanted)
    for number, produced in enumerate(_produced_candidates(expr, rule, layouts)):
        if produced.is_partial and isinstance(expr, LinearOp) and expr.has_bias:
            continue  # every rank would add the bias to its partial sum
        needed = rule.backward(produced)
        if needed is None:
            continue
        if number >= 2 and any(
            t.definition is None and layouts[t] != need
            for t, need in zip(expr.inputs, needed, strict=True)
        ):
            continue  # a third way may move what was computed, not the fusion's inputs
        moves = [
            (t, need, moved_bits(t, layouts[t], need))
            for t, need in zip(expr.inputs, needed, strict=True)
            if layouts[t] != need
        ]
        moves += [
            (o, layouts[o], moved_bits(o, produced, layouts[o]))
            for o in expr.outputs
            if layouts[o] != produced
        ]
        bits = sum(move[2] for move in moves) + contraction_cost(expr, produced)
        if bits < best.bits:
            best = Choice(bits, produced, tuple(moves))
    return best


def contraction_cost(expr: Expr, produced: Layout) -> float:
    """A matmul's or linear's multiply-adds on one rank when it produces ``produced``,
    in bit-equivalents (``FLOPS_PER_BIT``); other exprs cost nothing here."""
    if not isinstance(expr, (MatmulOp, LinearOp)):
        return 0.0
    out = expr.outputs[0]
    extents = (a.extent for a in out.axes)  # the contraction's too
    work = 2.0 * math.prod(e if isinstance(e, int) else SYMBOLIC_EXTENT for e in extents)
    parts = math.prod(
        produced.mesh.shape[axis]
        for axis, placement in enumerate(produced.placements)
        if not isinstance(placement, Replicate)
    )
    return work / parts / FLOPS_PER_BIT


def _produced_candidates(
    expr: Expr, rule: MeshRule, layouts: Mapping[TensorView, Layout]
) -> list[Layout]:
    """The output's own layout, what the inputs naturally give, then every other layout
    the output could take (so a contraction may produce a split and gather it after).
    Those others are tried only where they leave the fusion's inputs where they are: a
    weight the user placed is not gathered to save moving a result."""
    out = expr.outputs[0]
    wanted = layouts[out]
    natural = rule.forward([layouts[t] for t in expr.inputs])
    candidates = [wanted, natural]
    for layout in candidate_layouts(out, wanted, partial=True):
        if layout not in candidates:
            candidates.append(layout)
    return candidates
