"""Choosing layouts by cost: where propagation had a choice, keep the cheapest.

Propagation places tensors first-come: the first known input decides, so a partial sum
cast before a residual add is all-reduced and then split again (twice the bits of a
reduce-scatter), and a row-parallel weight may be moved instead of a few activation
rows. This pass revisits every tensor the user did not annotate and tries each layout it
could take (``layout_cost.candidate_layouts``), keeping the one that makes the exprs
around it (its producer and its consumers) move the fewest bits per rank
(``layout_cost.expr_cost``). Fusion outputs keep propagation's layout (what a user gets
back does not depend on sizes), a partial one resolved to replicated first, so the exprs
before it weigh the all-reduce. An unannotated fusion input has no producer to pay for
its layout, so each try also re-chooses the free inputs beside it (a weight the user
supplies in the layout its matmul wants costs nothing to move). Sweeps repeat until no
change pays; ties keep propagation's choice. A changed tensor's ``Decision`` says how
many bits its layout moves and what the alternatives would have moved (``explain``).
"""

from __future__ import annotations

from fusion.exprs import Expr, SetOp
from fusion.ir import Fusion, TensorView
from sharding.layout import Layout, Partial, Replicate, apply_layout
from sharding.layout_cost import (
    UNREACHABLE,
    Choice,
    candidate_layouts,
    expr_cost,
    free_reductions,
)
from sharding.propagation import Decision
from sharding.rules import mesh_rule

MAX_SWEEPS = 8
MAX_FOLLOWERS = 24


class LayoutChooser:
    """Coordinate descent over the unannotated tensors' layouts; ``run()`` writes them."""

    def __init__(self, fusion: Fusion, decisions: dict[TensorView, Decision]) -> None:
        self.fusion = fusion
        self.decisions = decisions
        self.layouts = {t: d.layout for t, d in decisions.items()}
        # A fusion output keeps propagation's layout (a partial one is all-reduced to
        # replicated at the end): what the user gets back does not change with sizes.
        outputs = set(fusion.outputs)
        self.free = [
            t for t in fusion.tensors if decisions[t].how != "annotation" and t not in outputs
        ]
        for out in outputs:
            layout = self.layouts[out]
            if layout.is_partial and decisions[out].how != "annotation":
                resolved = Layout(
                    layout.mesh,
                    tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements),
                )
                self.layouts[out] = resolved
                apply_layout(out, resolved)
                decisions[out] = Decision(resolved, "resolved", replaced=decisions[out])
        self.free_set = set(self.free)
        self.free_inputs = {t for t in self.free if t.definition is None}
        self._cache: dict[tuple, Choice] = {}

    def run(self) -> dict[TensorView, Decision]:
        original = dict(self.layouts)
        alternatives: dict[TensorView, list[tuple[Layout, float]]] = {}
        for _ in range(MAX_SWEEPS):
            changed = False
            for tensor in self.free:
                tried = self._improve(tensor)
                if tried is not None:
                    alternatives[tensor] = tried
                    changed = True
            if not changed:
                break
        for tensor in self.free:
            layout = self.layouts[tensor]
            if layout == original[tensor]:
                continue
            apply_layout(tensor, layout)
            before = self.decisions[tensor]
            self.decisions[tensor] = Decision(
                layout, "cost", before.rule, before.sources, before.expr,
                alternatives=tuple(alternatives.get(tensor, ())), replaced=before,
            )  # fmt: skip
        return self.decisions

    # -- one move ----------------------------------------------------------------

    def _improve(self, tensor: TensorView) -> list[tuple[Layout, float]] | None:
        """Give ``tensor`` the layout that costs least around it, the free tensors it
        touches following (``_followers``); returns every layout tried with its cost when
        that changed it, else None."""
        current = self.layouts[tensor]
        followers = self._followers(tensor)
        scope = self._neighbourhood(tensor)
        for follower in followers:
            scope |= self._neighbourhood(follower)
        baseline = self._cost(scope)
        best_cost, best_layout, best_followed = baseline, current, {}
        tried: list[tuple[Layout, float]] = [(current, baseline)]
        partial = tensor.definition is not None
        for layout in candidate_layouts(tensor, current, partial=partial)[1:]:
            self.layouts[tensor] = layout
            followed = self._follow(followers)
            cost = self._cost(scope)
            tried.append((layout, cost))
            if cost < best_cost - 1e-9 * (1.0 + best_cost):
                best_cost, best_layout, best_followed = cost, layout, dict(followed)
            for follower, (old, _) in followed.items():
                self.layouts[follower] = old
        self.layouts[tensor] = best_layout
        for follower, (_, new) in best_followed.items():
            self.layouts[follower] = new
        return None if best_layout is current else tried

    def _followers(self, tensor: TensorView) -> list[TensorView]:
        """The free tensors re-chosen when ``tensor`` changes: the free fusion inputs its
        exprs read (a weight supplied as its matmul wants), then, in program order, up to
        ``MAX_FOLLOWERS`` free tensors computed from it (a chain of pointwise ops and
        statistics turns as one: one at a time, each would pay for the split it breaks)."""
        exprs = sorted(self._neighbourhood(tensor), key=self.fusion.exprs.index)
        followers = [
            t for e in exprs for t in e.inputs if t in self.free_inputs and t is not tensor
        ]
        reached = {tensor}
        for expr in self.fusion.exprs[self.fusion.exprs.index(exprs[0]) if exprs else 0 :]:
            if len(followers) >= MAX_FOLLOWERS:
                break
            if isinstance(expr, SetOp) or not any(t in reached for t in expr.inputs):
                continue
            for out in expr.outputs:
                reached.add(out)
                if out in self.free_set and out is not tensor:
                    followers.append(out)
        return list(dict.fromkeys(followers))[:MAX_FOLLOWERS]

    def _follow(self, tensors: list[TensorView]) -> dict[TensorView, tuple[Layout, Layout]]:
        """Re-choose each of ``tensors`` in turn for its neighbourhood as it now stands;
        returns each changed one's (old, new) layout."""
        changed: dict[TensorView, tuple[Layout, Layout]] = {}
        for follower in tensors:
            old = self.layouts[follower]
            scope = self._neighbourhood(follower)
            # ties go to what its producer now gives (a chain follows the change)
            options = [*self._natural(follower), *candidate_layouts(
                follower, old, partial=follower.definition is not None
            )]  # fmt: skip
            best, best_cost = old, UNREACHABLE
            for layout in dict.fromkeys(options):
                self.layouts[follower] = layout
                cost = self._cost(scope)
                if cost < best_cost:
                    best, best_cost = layout, cost
            self.layouts[follower] = best
            if best != old:
                changed[follower] = (old, best)
        return changed

    def _natural(self, tensor: TensorView) -> list[Layout]:
        """The layout ``tensor``'s producer gives it from its inputs as they stand."""
        expr = tensor.definition
        if expr is None or isinstance(expr, SetOp):
            return []
        mesh = self.layouts[tensor].mesh
        if any(self.layouts[t].mesh != mesh for t in expr.inputs):
            return []
        natural = mesh_rule(expr, mesh).forward([self.layouts[t] for t in expr.inputs])
        return [natural] if natural.is_partial <= (free_reductions(tensor) > 0) else []

    def _neighbourhood(self, tensor: TensorView) -> set[Expr]:
        exprs = {e for e in tensor.uses if not isinstance(e, SetOp)}
        if tensor.definition is not None and not isinstance(tensor.definition, SetOp):
            exprs.add(tensor.definition)
        return exprs

    # -- costs -------------------------------------------------------------------

    def _cost(self, exprs: set[Expr]) -> float:
        """Bits moved around ``exprs`` (a copy shared by several counted once)."""
        moves: dict[tuple[TensorView, Layout], float] = {}
        for expr in exprs:
            choice = self._choice(expr)
            if choice.bits == UNREACHABLE:
                return UNREACHABLE
            for moved, target, bits in choice.moves:
                moves[(moved, target)] = bits
        return sum(moves.values())

    def _choice(self, expr: Expr) -> Choice:
        tensors = (*expr.inputs, *expr.outputs)
        key = (expr, tuple(self.layouts[t] for t in tensors))
        if key not in self._cache:
            self._cache[key] = expr_cost(expr, self.layouts)
        return self._cache[key]


def choose_layouts(fusion: Fusion, decisions: dict[TensorView, Decision]) -> None:
    """Re-place the tensors propagation placed where another layout moves fewer bits
    (written into the IR; ``decisions`` updated with what was weighed)."""
    LayoutChooser(fusion, decisions).run()
