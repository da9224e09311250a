"""Sharding propagation: give every tensor of a fusion a layout.

Starting from the user's annotations (which always win), the pass sweeps the
whole fusion forward (outputs from inputs) then backward (inputs from
outputs), applying each op family's rule to every mesh axis
(``sharding.rules.mesh_rule``), until no tensor changes. A tensor still
unplaced is replicated on the fusion's mesh. Every decision is recorded so
``explain`` can say which rule set each layout, and from which tensors.

The pass writes the layouts into the fusion (``TensorView.mesh`` and the
axes' parallel types); run it on a copy (``Fusion.clone``) to keep the
user's fusion as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.exprs import Expr, SetOp, TorchOp
from fusion.ir import Fusion, TensorView
from sharding.communication import Communication
from sharding.errors import ShardingError
from sharding.layout import Layout, apply_layout, layout_of
from sharding.layout_cost import Cost
from sharding.mesh import DeviceMesh
from sharding.rules import mesh_rule
from sharding.torch_strategy import fallback_placement


@dataclass(frozen=True)
class Decision:
    """Why a tensor has its layout: ``how`` is annotation, forward, backward, default, resolved
    (a partial fusion output made replicated) or cost (``sharding.choose_layouts``
    replaced propagation's choice, ``replaced``, by the cheapest of ``alternatives``:
    each layout tried with what it costs around the tensor). Any other decision with
    ``alternatives`` was kept by the chooser where a layout moving fewer bits moves a
    pinned fusion input (``sharding.pin``); one with ``produced`` was made by its expr
    from the inputs where they lie, then moved, where producing it directly moves fewer
    bits but moves a pinned input (each layout the expr could produce, with its cost)."""

    layout: Layout
    how: str
    rule: str | None = None
    sources: tuple[TensorView, ...] = ()
    expr: Expr | None = None
    alternatives: tuple[tuple[Layout, Cost], ...] = ()
    replaced: Decision | None = None
    produced: tuple[tuple[Layout, Cost], ...] = ()

    def describe(self) -> str:
        reason = self._reason()
        if self.alternatives and self.how != "cost":
            reason += (
                f"; kept: layouts that move fewer bits move a pinned input (a plan's weight), "
                f"every run ({_WEIGHED}): {_tried(self.alternatives)}"
            )
        if self.produced:
            reason += (
                f"; made from the pinned inputs where they lie, then moved: producing it "
                f"directly moves fewer bits but moves a pinned input (a plan's weight), every "
                f"run ({_WEIGHED}): produced {_tried(self.produced)}"
            )
        return reason

    def _reason(self) -> str:
        if self.how == "cost":
            first = self.replaced.describe()
            if not self.alternatives:
                return f"by cost, turned with a neighbour that changed (was: {first})"
            return f"by cost ({_WEIGHED}): {_tried(self.alternatives)} (was: {first})"
        if self.how == "annotation":
            return "user annotation"
        if self.how == "resolved":
            return f"a fusion output is never partial: resolved (was: {self.replaced.describe()})"
        if self.how == "default":
            return "default: replicated on the fusion's mesh"
        names = ", ".join(t.name for t in self.sources)
        direction = "from input" if self.how == "forward" else "from output"
        plural = "s" if len(self.sources) > 1 else ""
        return (
            f"{self.rule} rule, {self.how} through {self.expr.op_name} {direction}{plural} {names}"
        )


class ShardingPropagation:
    """Propagates layouts over one fusion; ``run()`` returns the decision per tensor."""

    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion
        self.decisions: dict[TensorView, Decision] = {}
        for tensor in fusion.tensors:
            layout = layout_of(tensor)
            if layout is not None:
                self.decisions[tensor] = Decision(layout, "annotation")

    def run(self) -> dict[TensorView, Decision]:
        if not self.decisions:
            raise ShardingError(
                "no tensor of the fusion is placed on a device mesh; annotate at least one "
                "with sharding.shard(tensor, mesh, placements)"
            )
        exprs = self.fusion.exprs
        changed = True
        while changed:
            changed = any([self._forward(e) for e in exprs])
            changed = any([self._backward(e) for e in reversed(exprs)]) or changed
        self._default()
        self._check_meshes()
        for tensor, decision in self.decisions.items():
            if decision.how != "annotation":
                apply_layout(tensor, decision.layout)
        return self.decisions

    def _mesh(self, expr: Expr, tensors: list[TensorView]) -> DeviceMesh:
        meshes = {self.decisions[t].layout.mesh for t in tensors}
        if len(meshes) > 1:
            placed = ", ".join(f"{t} on {self.decisions[t].layout.mesh}" for t in tensors)
            raise ShardingError(
                f"{expr.op_name}: its operands are placed on different meshes ({placed}); "
                "move a tensor to another mesh with fd.ops.set and annotate the copy"
            )
        return next(iter(meshes))

    def _forward(self, expr: Expr) -> bool:
        unknown = [t for t in expr.outputs if t not in self.decisions]
        known = [t for t in expr.inputs if t in self.decisions]
        if not unknown or not known:
            return False
        rule = mesh_rule(expr, self._mesh(expr, known))
        layout = rule.forward(
            [self.decisions[t].layout if t in self.decisions else None for t in expr.inputs]
        )
        for tensor in unknown:
            self.decisions[tensor] = Decision(layout, "forward", rule.name, tuple(known), expr)
        return True

    def _backward(self, expr: Expr) -> bool:
        unknown = [t for t in expr.inputs if t not in self.decisions]
        known = [t for t in expr.outputs if t in self.decisions]
        if not unknown or not known:
            return False
        layout = self.decisions[known[0]].layout
        rule = mesh_rule(expr, layout.mesh)
        required = rule.backward(layout, replicate_if_impossible=True)
        for tensor, needed in zip(expr.inputs, required, strict=True):
            if tensor in unknown and tensor not in self.decisions:
                self.decisions[tensor] = Decision(needed, "backward", rule.name, (known[0],), expr)
        return True

    def _default(self) -> None:
        meshes = {d.layout.mesh for d in self.decisions.values()}
        missing = [t for t in self.fusion.tensors if t not in self.decisions]
        if not missing:
            return
        if len(meshes) != 1:
            raise ShardingError(
                f"cannot tell which mesh {missing[0]} is on (the fusion uses "
                f"{len(meshes)} meshes); annotate it with sharding.shard"
            )
        (mesh,) = meshes
        for tensor in missing:
            self.decisions[tensor] = Decision(Layout.replicated(mesh), "default")

    def _check_meshes(self) -> None:
        """Every op but a copy (``set``) runs on one mesh: its tensors must all be there."""
        for expr in self.fusion.exprs:
            if isinstance(expr, SetOp):
                continue
            tensors = expr.inputs + expr.outputs
            meshes = {self.decisions[t].layout.mesh for t in tensors}
            if len(meshes) > 1:
                where = ", ".join(f"{t.name} on {self.decisions[t].layout.mesh}" for t in tensors)
                raise ShardingError(
                    f"{expr.op_name}: a tensor is used on a mesh it is not placed on ({where}); "
                    "move it with fd.ops.set and annotate the copy with its new mesh"
                )


_WEIGHED = "bits moved per rank around it, matmul work counted as bits"


def _tried(tried: tuple[tuple[Layout, Cost], ...]) -> str:
    """Each layout tried with its cost, and the pinned inputs it moves or keeps."""
    described = []
    for layout, cost in tried:
        text = f"[{', '.join(str(p) for p in layout.placements)}] {_bits(cost.bits)}"
        if cost.pinned:
            text += f" moving {_names(cost.pinned)} (pinned)"
        if cost.kept:
            text += (
                f" ({_bits(cost.bits - cost.forgone_bits)} moving {_names(cost.kept)}, "
                "pinned: kept)"
            )
        described.append(text)
    return "; ".join(described)


def _names(tensors: tuple[TensorView, ...]) -> str:
    return ", ".join(dict.fromkeys(t.name for t in tensors))


def _bits(bits: float) -> str:
    if bits == float("inf"):
        return "impossible"
    for unit, size in (("GiB", 8 << 30), ("MiB", 8 << 20), ("KiB", 8 << 10)):
        if bits >= size:
            return f"{bits / size:.1f} {unit}"
    return f"{bits / 8:g} B"


def propagate_shardings(fusion: Fusion) -> dict[TensorView, Decision]:
    """Give every tensor of ``fusion`` a layout (written into the IR); returns the decisions."""
    return ShardingPropagation(fusion).run()


def explain(fusion: Fusion, decisions: dict[TensorView, Decision]) -> str:
    """One line per tensor: its placements and what set them.

    Tensors the resharding pass added are listed last, with the communication (or
    local copy) that defines them and the expr they were made for.
    """
    width = max(len(str(t)) for t in fusion.tensors)
    meshes = list(dict.fromkeys(t.mesh for t in fusion.tensors if t.mesh is not None))
    lines = [f"M{index} = {mesh}" for index, mesh in enumerate(meshes)]

    def placed(tensor: TensorView) -> str:
        layout = layout_of(tensor)
        placements = ", ".join(str(p) for p in layout.placements)
        return f"{str(tensor):<{width}}  [{placements}] @M{meshes.index(layout.mesh)}"

    inserted = []
    for tensor in fusion.tensors:
        if tensor in decisions:
            lines.append(f"{placed(tensor)}  {decisions[tensor].describe()}")
        elif tensor.definition is not None:
            inserted.append(tensor)
    if inserted:
        lines.append("inserted by resharding:")
        for tensor in inserted:
            definition = tensor.definition
            consumers = ", ".join(dict.fromkeys(e.op_name for e in tensor.uses)) or "the output"
            source = ", ".join(t.name for t in definition.inputs)
            why = _why_moved(tensor, decisions)
            lines.append(f"{placed(tensor)}  {definition.op_name} of {source} for {consumers}{why}")
    fallbacks = _fallbacks(fusion)
    if fallbacks:
        lines.append(f"fell back to torch: {', '.join(fallbacks)}")
    return "\n".join(lines)


def _fallbacks(fusion: Fusion) -> list[str]:
    """Each ATen op left to PyTorch with where it runs (``aten.cumsum.default (torch's
    strategy: S(0))``), once each; a backward is named as its op's."""
    described = []
    for expr in fusion.exprs:
        if isinstance(expr, TorchOp):
            layout = layout_of(expr.outputs[0])
            name = str(expr.target) if expr.vjp is None else f"{expr.target} backward"
            where = fallback_placement(expr, layout.placements, layout.mesh.shape)
            described.append(f"{name} ({where})")
    return list(dict.fromkeys(described))


def pinned_inputs(fusion: Fusion) -> frozenset[TensorView]:
    """The fusion's inputs placed to stay (``sharding.pin``: a plan's weights): the
    layout chooser and the resharding pass move one only where no way to lay the
    tensors out avoids it (``layout_cost.Cost``)."""
    return frozenset(t for t in fusion.inputs if t.pinned)


def moved_inputs(fusion: Fusion) -> list[Communication]:
    """The communications of a placed fusion that read one of its inputs as given: where
    a weight placed by a plan (``parallelize``'s) is moved, every run, instead of
    computed with where it lies (``explain`` says which op needs it placed otherwise)."""
    inputs = set(fusion.inputs)
    return [e for e in fusion.exprs if isinstance(e, Communication) and e.inputs[0] in inputs]


def _why_moved(copy: TensorView, decisions: dict[TensorView, Decision]) -> str:
    """Why a communication moves a fusion input the user placed ("" for any other copy):
    which expr needs it placed otherwise, and the layout that expr must produce."""
    definition = copy.definition
    source = definition.inputs[0]
    decision = decisions.get(source)
    if not isinstance(definition, Communication) or decision is None:
        return ""
    if decision.how != "annotation" or source.definition is not None:
        return ""

    def placements(tensor: TensorView) -> str:
        return ", ".join(str(p) for p in layout_of(tensor).placements)

    reasons = [
        f"{use.op_name} makes {use.outputs[0].name} [{placements(use.outputs[0])}] only from "
        f"it [{placements(copy)}]"
        + (f" ({decisions[use.outputs[0]].describe()})" if use.outputs[0] in decisions else "")
        for use in dict.fromkeys(copy.uses)
    ]
    return f"; {source.name} is placed [{placements(source)}] by annotation: {'; '.join(reasons)}"
