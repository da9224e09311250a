"""Communications: the exprs resharding inserts where layouts disagree.

A ``Communication`` is a copy (a ``SetOp`` subclass, so the single-device
reference evaluates it as the identity) whose output is placed differently
from its input. Its kind says how the data moves:

============== =========================================== ==============================
kind           input -> output                             over
============== =========================================== ==============================
Allgather      S(d) -> R                                   one mesh axis
Allreduce      P(op) -> R                                  one mesh axis
ReduceScatter  P(op) -> S(d)                               one mesh axis
AllToAll       S(d) -> S(e)                                one mesh axis
Broadcast      whole on one rank -> R on a mesh            two meshes
Scatter        whole on one rank -> S(d) on a mesh         two meshes
Gather         S(d) on a mesh -> whole on one rank         two meshes
Reduce         P(op) on a mesh -> whole on one rank        two meshes
SendRecv       a mesh -> an equally shaped mesh            two meshes, rank to rank
============== =========================================== ==============================

``LocalShard`` (R -> S(d)) needs no communication: each rank keeps its piece.
"""

from __future__ import annotations

import enum

from fusion.exprs import SetOp
from fusion.ir import TensorView
from sharding.layout import Layout
from sharding.mesh import DeviceMesh


class CommunicationKind(enum.Enum):
    Allgather = "Allgather"
    Allreduce = "Allreduce"
    ReduceScatter = "ReduceScatter"
    AllToAll = "AllToAll"
    Broadcast = "Broadcast"
    Scatter = "Scatter"
    Gather = "Gather"
    Reduce = "Reduce"
    SendRecv = "SendRecv"


class Communication(SetOp):
    """Moves ``x`` (placed ``in_layout``) to ``out`` (placed ``out_layout``).

    ``mesh_axis`` is the mesh axis a one-mesh collective runs over (its teams are
    ``mesh.teams(mesh_axis)``); ``in_dim``/``out_dim`` are the split tensor axes;
    ``root`` is the single rank of a Broadcast, Scatter, Gather or Reduce;
    ``reduce_op`` combines partial values; ``pairs`` are a SendRecv's (source,
    destination) ranks.
    """

    def __init__(
        self,
        kind: CommunicationKind,
        x: TensorView,
        out: TensorView,
        in_layout: Layout,
        out_layout: Layout,
        mesh_axis: int | None = None,
        in_dim: int | None = None,
        out_dim: int | None = None,
        root: int | None = None,
        reduce_op: str | None = None,
        pairs: list[tuple[int, int]] | None = None,
    ) -> None:
        self.kind = kind
        self.pairs = pairs or []
        self.in_layout, self.out_layout = in_layout, out_layout
        self.mesh_axis, self.in_dim, self.out_dim = mesh_axis, in_dim, out_dim
        self.root, self.reduce_op = root, reduce_op
        attrs: dict[str, object] = {}
        if mesh_axis is not None:
            attrs["axis"] = in_layout.mesh.axis_names[mesh_axis]
        if in_dim is not None:
            attrs["in_dim"] = in_dim
        if out_dim is not None:
            attrs["out_dim"] = out_dim
        if root is not None:
            attrs["root"] = root
        if reduce_op is not None:
            attrs["op"] = reduce_op
        if pairs:
            attrs["pairs"] = ", ".join(f"{src}->{dst}" for src, dst in pairs)
        super().__init__(x, out)
        self.op_name = kind.value
        self.attrs = attrs

    @property
    def same_mesh(self) -> bool:
        return self.in_layout.mesh == self.out_layout.mesh

    @property
    def split_dim(self) -> int | None:
        """The axis an all-gather gathers or a reduce-scatter scatters (None for others)."""
        if self.kind is CommunicationKind.Allgather:
            return self.in_dim
        if self.kind is CommunicationKind.ReduceScatter:
            return self.out_dim
        return None

    def teams(self) -> list[tuple[int, ...]]:
        """The groups of ranks that take part together (each team runs its own collective)."""
        in_mesh, out_mesh = self.in_layout.mesh, self.out_layout.mesh
        if self.same_mesh:
            return in_mesh.teams(self.mesh_axis)
        if self.kind is CommunicationKind.SendRecv:
            return [pair for pair in self.pairs if pair[0] != pair[1]]
        if self.kind in (CommunicationKind.Broadcast, CommunicationKind.Scatter):
            return [tuple(sorted({self.root, *out_mesh.ranks}))]
        return [tuple(sorted({self.root, *in_mesh.ranks}))]

    def participants(self) -> set[int]:
        return {rank for team in self.teams() for rank in team}


class LocalShard(SetOp):
    """R -> S(dim) over ``mesh_axis``: every rank keeps its own piece, nothing moves."""

    def __init__(
        self, x: TensorView, out: TensorView, mesh: DeviceMesh, mesh_axis: int, dim: int
    ) -> None:
        self.mesh, self.mesh_axis, self.dim = mesh, mesh_axis, dim
        super().__init__(x, out)
        self.op_name = "shard_locally"
        self.attrs = {"axis": mesh.axis_names[mesh_axis], "dim": dim}
