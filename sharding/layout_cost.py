"""What a layout costs: the bits a rank sends to move a tensor between two layouts, and
the cheapest way for one expr to meet the layouts around it.

The counts follow the communications ``sharding.redistribute`` inserts, one mesh axis
at a time, per rank, over ``n`` ranks along the axis, for a piece of ``b`` bits:
all-gather and reduce-scatter move ``b (n-1)/n``, an all-reduce twice that, an
all-to-all ``b (n-1)/n^2`` (each rank keeps one ``n``-th of what it holds), a local
split nothing; between two meshes the whole tensor moves. Each communication also
counts ``COLLECTIVE_BITS``: where layouts move about as many bits, the one with fewer
collectives wins (each has a fixed latency; a mean over a split axis all-reduces its
few values rather than reduce-scattering and gathering them). Symbolic extents count as
1024. These are the figures propagation's choices are compared by (``choose_layouts``)
and the resharding pass picks what each expr produces by.

Before the bits, a way to lay tensors out is weighed by the moves it makes of pinned
fusion inputs (``Cost``): the user placed those to be computed with where they lie (a
plan's weights, ``sharding.pin``), so a way that moves one every run is taken only
where no way avoids it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from fusion.exprs import Expr, LinearOp, MatmulOp
from fusion.ir import TensorView
from sharding.layout import Layout, Partial, Placement, Replicate, Shard, partial_op
from sharding.rules import mesh_rule

SYMBOLIC_EXTENT = 1024  # what a symbolic extent counts as when sizes are compared
UNREACHABLE = float("inf")
# Matmul work weighed against communication: a Hopper GPU does about 800 TFLOP/s of
# bf16 matmul and sends about 3.2 Tbit/s over NVLink, so one bit moved costs the time
# of some 250 multiply-adds. Layouts that make every rank repeat a whole matmul (to
# save gathering its small result) pay for it.
FLOPS_PER_BIT = 250.0
# A tie-break, not a latency model: small against any tensor worth moving
COLLECTIVE_BITS = 64.0


def _count(extents) -> int:
    return math.prod(e if isinstance(e, int) else SYMBOLIC_EXTENT for e in extents)


def moved_bits(tensor: TensorView, before: Layout, after: Layout) -> float:
    """Bits a rank sends to move ``tensor`` from ``before`` to ``after`` (inf: impossible)."""
    if before == after:
        return 0.0
    size = tensor.dtype.size_bits(_count(tensor.shape))
    if before.mesh != after.mesh:
        return float(size) + COLLECTIVE_BITS
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
        if ranks > 1:
            total += COLLECTIVE_BITS
    return total


def candidate_layouts(tensor: TensorView, current: Layout) -> list[Layout]:
    """Every layout ``tensor`` could take on ``current``'s mesh: per mesh axis replicated,
    split on any axis of extent above 1, or partial (as many mesh axes as it keeps
    reduction axes: results of reductions and contractions). ``current`` comes first."""
    reductions = sum(axis.is_reduction for axis in tensor.axes)
    per_axis: list[Placement] = [Replicate()]
    per_axis += [Shard(d) for d, extent in enumerate(tensor.shape) if extent != 1]
    if reductions:
        per_axis.append(Partial(partial_op(tensor)))
    layouts = [current]
    for placements in itertools.product(per_axis, repeat=current.mesh.ndim):
        if sum(isinstance(p, Partial) for p in placements) > reductions:
            continue
        try:
            layout = Layout(current.mesh, placements)
        except ValueError:  # an axis split twice
            continue
        if layout not in layouts:
            layouts.append(layout)
    return layouts


@dataclass(frozen=True)
class Cost:
    """What a way to lay tensors out costs, compared in order: first the copies it makes
    of pinned fusion inputs (``pinned``, a tensor per copy), then the bits
    it moves per rank with its matmul work (``bits``). Moving a pinned input is paid
    every run for a tensor the user meant to be computed with where it lies: a plan's
    weight gathered whole costs its memory and a reduce-scatter of its gradient in the
    backward, and the collective before its matmul cannot be pipelined with it the way
    a partial result's reduce-scatter is; so fewer such copies win whatever bits they
    save, and bits decide among ways that make as many. ``kept``: the pinned inputs it
    computes with where they lie although moving them would move ``forgone_bits`` fewer
    bits (what ``explain`` says it was kept from)."""

    bits: float
    pinned: tuple[TensorView, ...] = ()
    kept: tuple[TensorView, ...] = ()
    forgone_bits: float = 0.0

    def cheaper(self, other: Cost, tolerance: float = 0.0) -> bool:
        """Whether this costs less than ``other``; bits must be lower by ``tolerance``
        (relative) where both move as many pinned inputs. Impossible is dearest."""
        if math.isinf(self.bits) or math.isinf(other.bits):
            return self.bits < other.bits
        if len(self.pinned) != len(other.pinned):
            return len(self.pinned) < len(other.pinned)
        return self.bits < other.bits - tolerance * (1.0 + other.bits)


@dataclass(frozen=True)
class Choice:
    """What one expr produces (``produced``, from its inputs copied to ``needed``), the
    moves that puts around it, and the matmul work it does (``work_bits``). ``moves``
    holds (tensor, the layout it is copied to, bits): a copy of an input is shared by
    every consumer that needs the same layout, so sums over several exprs count it once.
    ``pinned`` lists the pinned fusion inputs among the tensors moved (a local split
    of a replicated one moves nothing between ranks, and is not listed);
    ``cheapest_in_bits`` is the choice that moves fewer bits, where one did but moved
    more of those (what ``explain`` says this one was kept from)."""

    produced: Layout
    needed: tuple[Layout, ...] = ()
    moves: tuple[tuple[TensorView, Layout, float], ...] = ()
    work_bits: float = 0.0
    pinned: tuple[TensorView, ...] = ()
    cheapest_in_bits: Choice | None = None

    @property
    def bits(self) -> float:
        return sum(bits for _, _, bits in self.moves) + self.work_bits

    @property
    def cost(self) -> Cost:
        cheaper = self.cheapest_in_bits
        if cheaper is None:
            return Cost(self.bits, self.pinned)
        return Cost(self.bits, self.pinned, cheaper.pinned, self.bits - cheaper.bits)


def natural_layout(expr: Expr, layouts: Mapping[TensorView, Layout]) -> Layout:
    """The layout ``expr`` gives its output from its inputs as they are laid out."""
    mesh = layouts[expr.outputs[0]].mesh
    return mesh_rule(expr, mesh).forward([layouts[t] for t in expr.inputs])


def expr_cost(
    expr: Expr, layouts: Mapping[TensorView, Layout], pinned: Collection[TensorView] = ()
) -> Choice | None:
    """The cheapest way (``Cost``) for ``expr``'s inputs and outputs to hold ``layouts``:
    the layout it produces (inputs copied to suit it before, the output copied from it
    after), or None when none can. Tried: the output's own layout (ties go to it), the
    natural one, then every other layout the output could take where that leaves the
    fusion's inputs where they are (so a contraction may produce a split and gather it
    after, but a weight the user placed is not gathered to save moving a result).
    ``pinned``: the pinned fusion inputs (``sharding.pin``), moved only where every way
    moves them (a row-parallel weight is not gathered to save reduce-scattering its
    partial result, though its all-gather and the activation's all-to-all move fewer
    bits)."""
    out = expr.outputs[0]
    wanted = layouts[out]
    rule = mesh_rule(expr, wanted.mesh)
    own = [wanted, natural_layout(expr, layouts)]
    best: Choice | None = None
    fewest_bits: Choice | None = None
    for produced in dict.fromkeys([*own, *candidate_layouts(out, wanted)]):
        needed = rule.backward(produced, current=[layouts[t] for t in expr.inputs])
        if needed is None:
            continue
        moves = [
            (t, need, moved_bits(t, layouts[t], need))
            for t, need in zip(expr.inputs, needed, strict=True)
            if layouts[t] != need
        ]
        if produced not in own and any(t.definition is None for t, _, _ in moves):
            continue
        moves += [
            (o, layouts[o], moved_bits(o, produced, layouts[o]))
            for o in expr.outputs
            if layouts[o] != produced
        ]
        # a local split of a replicated input moves nothing between ranks
        copied = dict.fromkeys((t, need) for t, need, bits in moves if t in pinned and bits > 0)
        work = contraction_bits(expr, produced)
        choice = Choice(produced, tuple(needed), tuple(moves), work, tuple(t for t, _ in copied))
        if best is None or choice.cost.cheaper(best.cost):
            best = choice
        if fewest_bits is None or choice.bits < fewest_bits.bits:
            fewest_bits = choice
    if best is None or best.bits >= UNREACHABLE:
        return None
    if fewest_bits.bits < best.bits:
        best = replace(best, cheapest_in_bits=fewest_bits)
    return best


def contraction_bits(expr: Expr, produced: Layout) -> float:
    """A matmul's or linear's multiply-adds on one rank when it produces ``produced``,
    in bit-equivalents (``FLOPS_PER_BIT``); other exprs cost nothing here."""
    if not isinstance(expr, (MatmulOp, LinearOp)):
        return 0.0
    work = 2.0 * _count(a.extent for a in expr.outputs[0].axes)  # the contraction's too
    parts = math.prod(
        produced.mesh.shape[axis]
        for axis, placement in enumerate(produced.placements)
        if not isinstance(placement, Replicate)
    )
    return work / parts / FLOPS_PER_BIT
