"""Choosing layouts by cost: where propagation had a choice, keep the cheapest.

Propagation places tensors first-come: the first known input decides, so a partial sum
cast before a residual add is all-reduced and then split again (twice the bits of a
reduce-scatter), and a row-parallel weight may be moved instead of a few activation
rows. This pass revisits every tensor the user did not annotate and tries each layout it
could take (``layout_cost.candidate_layouts``), keeping the one that makes the exprs
around it (its producer and its consumers) cost least: the bits they move per rank and
their matmul work (``layout_cost.expr_cost``). Fusion outputs keep propagation's layout
(what a user gets back does not depend on sizes), a partial one resolved to replicated
first, so the exprs before it weigh the all-reduce. Each try also re-chooses the free
tensors that follow the changed one (``LayoutChooser._followers``): the unannotated
fusion inputs its exprs read (a weight the user supplies as its matmul wants costs
nothing to move) and the chain computed from it. Sweeps repeat until no change pays;
ties keep propagation's choice. Costs compare the copies of pinned fusion inputs first
(``sharding.pin``, ``layout_cost.Cost``): a layout that moves fewer bits by gathering a
plan's weight every run is not taken where another leaves the weight in place. A
changed tensor's ``Decision`` says what each layout tried would have cost (``explain``),
as does one kept where a layout moving fewer bits moved a pinned input.
"""

from __future__ import annotations

from dataclasses import replace

from fusion.exprs import Expr, SetOp
from fusion.ir import Fusion, TensorView
from sharding.layout import Layout, apply_layout
from sharding.layout_cost import (
    UNREACHABLE,
    Choice,
    Cost,
    candidate_layouts,
    expr_cost,
    natural_layout,
)
from sharding.propagation import Decision, pinned_inputs

MAX_SWEEPS = 8
MAX_FOLLOWERS = 24

Tried = list[tuple[Layout, Cost]]
# relative: a change must pay more than rounding in the sums of bits
TOLERANCE = 1e-9


class LayoutChooser:
    """Coordinate descent over the unannotated tensors' layouts; ``run()`` writes them."""

    def __init__(self, fusion: Fusion, decisions: dict[TensorView, Decision]) -> None:
        self.fusion = fusion
        self.decisions = decisions
        self.layouts = {t: d.layout for t, d in decisions.items()}
        self.position = {expr: index for index, expr in enumerate(fusion.exprs)}
        outputs = set(fusion.outputs)
        for out in outputs:
            if self.layouts[out].is_partial and decisions[out].how != "annotation":
                resolved = self.layouts[out].resolved()
                self.layouts[out] = resolved
                apply_layout(out, resolved)
                decisions[out] = Decision(resolved, "resolved", replaced=decisions[out])
        self.free = {
            t: None for t in fusion.tensors if decisions[t].how != "annotation" and t not in outputs
        }  # an ordered set
        self.pinned = pinned_inputs(fusion)
        self._cache: dict[tuple, Choice | None] = {}

    def run(self) -> dict[TensorView, Decision]:
        original = dict(self.layouts)
        tried_by: dict[TensorView, Tried] = {}  # what a tensor's own last change weighed
        # what a tensor weighed when a layout moving fewer bits moved a pinned input
        kept_by: dict[TensorView, Tried] = {}
        for _ in range(MAX_SWEEPS):
            changed = False
            for tensor in self.free:
                tried, followed = self._improve(tensor)
                if tried[0][0] == self.layouts[tensor]:
                    kept_bits = tried[0][1].bits
                    fewest_bits = min(cost.bits - cost.forgone_bits for _, cost in tried)
                    if fewest_bits < kept_bits - TOLERANCE * (1.0 + kept_bits):
                        kept_by[tensor] = tried
                    continue
                tried_by[tensor] = tried
                for follower in (tensor, *followed):
                    kept_by.pop(follower, None)
                for follower in followed:
                    tried_by.pop(follower, None)
                changed = True
            if not changed:
                break
        for tensor in self.free:
            layout = self.layouts[tensor]
            before = self.decisions[tensor]
            if layout == original[tensor]:
                if tensor in kept_by:
                    self.decisions[tensor] = replace(before, alternatives=tuple(kept_by[tensor]))
                continue
            apply_layout(tensor, layout)
            tried = tuple(tried_by.get(tensor, ()))
            self.decisions[tensor] = Decision(layout, "cost", alternatives=tried, replaced=before)
        return self.decisions

    # -- one move ----------------------------------------------------------------

    def _improve(self, tensor: TensorView) -> tuple[Tried, list[TensorView]]:
        """Give ``tensor`` the layout that costs least around it, its followers re-chosen
        for each try; returns every layout tried with its cost (its layout before
        first) and the followers that changed with it."""
        current = self.layouts[tensor]
        followers = self._followers(tensor)
        scope = self._neighbourhood(tensor)
        for follower in followers:
            scope |= self._neighbourhood(follower)
        # and the other readers of what those exprs read: a copy they share with them
        # (an output's gradient gathered for one matmul, and for its transpose) is one
        scope |= {
            use
            for expr in list(scope)
            for read in expr.inputs
            for use in read.uses
            if not isinstance(use, SetOp)
        }
        baseline = self._cost(scope)
        best_cost, best_layout, best_followed = baseline, current, {}
        tried: Tried = [(current, baseline)]
        for layout in candidate_layouts(tensor, current)[1:]:
            self.layouts[tensor] = layout
            followed = self._follow(followers)
            cost = self._cost(scope)
            tried.append((layout, cost))
            if cost.cheaper(best_cost, TOLERANCE):
                best_cost, best_layout, best_followed = cost, layout, followed
            for follower, (old, _) in followed.items():
                self.layouts[follower] = old
        self.layouts[tensor] = best_layout
        for follower, (_, new) in best_followed.items():
            self.layouts[follower] = new
        return tried, list(best_followed)

    def _followers(self, tensor: TensorView) -> list[TensorView]:
        """The free tensors re-chosen when ``tensor`` changes: the free fusion inputs its
        exprs read (a weight supplied as its matmul wants), then, in program order, up to
        ``MAX_FOLLOWERS`` free tensors computed from it (a chain of pointwise ops and
        statistics turns as one: one at a time, each would pay for the split it breaks)."""
        exprs = sorted(self._neighbourhood(tensor), key=self.position.__getitem__)
        followers = [t for e in exprs for t in e.inputs if t.definition is None and t in self.free]
        reached = {tensor}
        start = self.position[exprs[0]] if exprs else len(self.fusion.exprs)
        for expr in self.fusion.exprs[start:]:
            if len(followers) >= MAX_FOLLOWERS:
                break
            if isinstance(expr, SetOp) or not any(t in reached for t in expr.inputs):
                continue
            reached.update(expr.outputs)
            followers += [out for out in expr.outputs if out in self.free]
        return [t for t in dict.fromkeys(followers) if t is not tensor][:MAX_FOLLOWERS]

    def _follow(self, tensors: list[TensorView]) -> dict[TensorView, tuple[Layout, Layout]]:
        """Re-choose each of ``tensors`` in turn for its neighbourhood as it now stands;
        returns each changed one's (old, new) layout."""
        changed: dict[TensorView, tuple[Layout, Layout]] = {}
        for follower in tensors:
            old = self.layouts[follower]
            scope = self._neighbourhood(follower)
            options = candidate_layouts(follower, old)
            definition = follower.definition
            if definition is not None and not isinstance(definition, SetOp):
                # ties go to what its producer now gives: a chain follows the change
                options.insert(0, natural_layout(definition, self.layouts))
            best, best_cost = old, Cost(UNREACHABLE)
            for layout in dict.fromkeys(options):
                self.layouts[follower] = layout
                cost = self._cost(scope)
                if cost.cheaper(best_cost):
                    best, best_cost = layout, cost
            self.layouts[follower] = best
            if best != old:
                changed[follower] = (old, best)
        return changed

    @staticmethod
    def _neighbourhood(tensor: TensorView) -> set[Expr]:
        exprs = {e for e in tensor.uses if not isinstance(e, SetOp)}
        if tensor.definition is not None and not isinstance(tensor.definition, SetOp):
            exprs.add(tensor.definition)
        return exprs

    # -- costs -------------------------------------------------------------------

    def _cost(self, exprs: set[Expr]) -> Cost:
        """What ``exprs`` cost: the copies of pinned inputs they make, the bits moved
        around them (a copy shared by several counted once) and their matmul work; and
        the bits they forgo keeping pinned inputs where they lie."""
        moves: dict[tuple[TensorView, Layout], float] = {}
        work = forgone = 0.0
        kept: list[TensorView] = []
        for expr in exprs:
            choice = self._choice(expr)
            if choice is None:
                return Cost(UNREACHABLE)
            work += choice.work_bits
            for moved, target, bits in choice.moves:
                moves[(moved, target)] = bits
            cost = choice.cost
            kept += cost.kept
            forgone += cost.forgone_bits
        pinned = tuple(t for (t, _), bits in moves.items() if t in self.pinned and bits > 0)
        return Cost(sum(moves.values()) + work, pinned, tuple(kept), forgone)

    def _choice(self, expr: Expr) -> Choice | None:
        key = (expr, tuple(self.layouts[t] for t in (*expr.inputs, *expr.outputs)))
        if key not in self._cache:
            self._cache[key] = expr_cost(expr, self.layouts, self.pinned)
        return self._cache[key]


def choose_layouts(fusion: Fusion, decisions: dict[TensorView, Decision]) -> None:
    """Re-place the tensors propagation placed where another layout costs less (written
    into the IR; ``decisions`` updated with what was weighed)."""
    LayoutChooser(fusion, decisions).run()
