"""Segmentation: split a resharded fusion into compute and communication segments.

Communications are segments of their own. The other exprs are grouped, in
definition order, into compute segments: a run of exprs on one mesh, not
interrupted by a communication, becomes one segment (one kernel launch, later
one scheduler's generated kernel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusion.exprs import Expr
from fusion.ir import Fusion, TensorView
from sharding.communication import Communication
from sharding.mesh import DeviceMesh


@dataclass
class Segment:
    """A compute segment (``exprs`` run together on ``mesh``) or one communication."""

    index: int
    exprs: list[Expr]
    mesh: DeviceMesh | None
    inputs: list[TensorView] = field(default_factory=list)
    outputs: list[TensorView] = field(default_factory=list)

    @property
    def is_communication(self) -> bool:
        return isinstance(self.exprs[0], Communication)

    @property
    def communication(self) -> Communication:
        (expr,) = self.exprs
        assert isinstance(expr, Communication)
        return expr

    def __str__(self) -> str:
        names = ", ".join(e.op_name for e in self.exprs)
        ins = ", ".join(t.name for t in self.inputs)
        outs = ", ".join(t.name for t in self.outputs)
        kind = "communication" if self.is_communication else "compute"
        return f"segment {self.index} ({kind}: {names}) ({ins}) -> ({outs})"


def segment_fusion(fusion: Fusion, exprs: list[Expr] | None = None) -> list[Segment]:
    """The segments of ``exprs`` (by default ``fusion``'s live exprs), in an order that
    respects dependencies. A segment's outputs are what the rest of the fusion reads."""
    exprs = fusion.live_exprs() if exprs is None else exprs
    groups: list[tuple[list[Expr], DeviceMesh | None]] = []
    for expr in exprs:
        mesh = expr.outputs[0].mesh
        alone = isinstance(expr, Communication)
        if groups and not alone and not isinstance(groups[-1][0][-1], Communication):
            if groups[-1][1] == mesh:
                groups[-1][0].append(expr)
                continue
        groups.append(([expr], mesh))
    segments = []
    for index, (members, mesh) in enumerate(groups):
        inputs, outputs = fusion.boundary(members)
        segments.append(Segment(index, members, mesh, inputs, outputs))
    return segments
