"""The host IR: the program every rank runs, as a list of instructions.

One program serves every rank (SPMD): an instruction runs on the ranks of its
mesh (a kernel) or its teams (a communication) and is skipped elsewhere.

Example (sequence-parallel block on two ranks)::

    HostProgram sp_block: 4 inputs, 1 output
    meshes:
      M0 = mesh(x=2: [0, 1])
    inputs: T0, T1, T2, T3
      LaunchKernel k0 [reference] (T0, T1) -> (T16)  @M0
        cast, var_mean, broadcast, ...
      Allocate T20_bf16[iS40{8}, iS41{16}]  @M0
      c0 = Allgather(T16 -> T20, axis='x', in_dim=0)  @M0
      Wait c0
      Deallocate T16
      ...
    outputs: T19
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusion.ir import Fusion, TensorView
from fusion.printer import count
from sharding.communication import Communication
from sharding.segmentation import Segment


class Instruction:
    """One step of a host program."""

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        raise NotImplementedError


def _at(mesh: object, mesh_label: dict[object, str]) -> str:
    return f"  @{mesh_label[mesh]}" if mesh in mesh_label else ""


@dataclass(eq=False)
class Allocate(Instruction):
    """Allocate the local buffer of ``tensor`` (a communication's output)."""

    tensor: TensorView

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        return [f"Allocate {self.tensor}{_at(self.tensor.mesh, mesh_label)}"]


@dataclass(eq=False)
class LaunchKernel(Instruction):
    """Run a compute segment on the ranks of its mesh.

    ``backend`` names what computes it: ``reference`` (the eager reference evaluator)
    until generated kernels take over.
    """

    name: str
    segment: Segment
    backend: str = "reference"

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        ins = ", ".join(t.name for t in self.segment.inputs)
        outs = ", ".join(t.name for t in self.segment.outputs)
        ops = ", ".join(e.op_name for e in self.segment.exprs)
        at = _at(self.segment.mesh, mesh_label)
        return [f"LaunchKernel {self.name} [{self.backend}] ({ins}) -> ({outs}){at}", f"  {ops}"]


@dataclass(eq=False)
class Communicate(Instruction):
    """Start a communication (asynchronously where the backend allows)."""

    name: str
    communication: Communication

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        comm = self.communication
        attrs = "".join(f", {key}={value!r}" for key, value in comm.attrs.items())
        meshes = _at(comm.in_layout.mesh, mesh_label)
        if not comm.same_mesh:
            meshes += f" -> {mesh_label[comm.out_layout.mesh]}"
        return [
            f"{self.name} = {comm.op_name}({comm.inputs[0].name} -> {comm.output.name}{attrs})"
            f"{meshes}"
        ]


@dataclass(eq=False)
class Wait(Instruction):
    """Wait until a communication has finished and its output is ready."""

    communicate: Communicate

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        return [f"Wait {self.communicate.name}"]


@dataclass(eq=False)
class Deallocate(Instruction):
    """Release ``tensor``'s local buffer after its last use."""

    tensor: TensorView

    def text(self, mesh_label: dict[object, str]) -> list[str]:
        return [f"Deallocate {self.tensor.name}"]


@dataclass
class HostProgram:
    """The instructions of one fusion, for every rank, with its inputs and outputs."""

    fusion: Fusion
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def communications(self) -> list[Communication]:
        return [i.communication for i in self.instructions if isinstance(i, Communicate)]

    def __str__(self) -> str:
        fusion = self.fusion
        meshes: list[object] = []
        for tensor in fusion.tensors:
            if tensor.mesh is not None and tensor.mesh not in meshes:
                meshes.append(tensor.mesh)
        label = {mesh: f"M{index}" for index, mesh in enumerate(meshes)}
        name = f" {fusion.name}" if fusion.name else ""
        lines = [
            f"HostProgram{name}: {count(len(fusion.inputs), 'input')}, "
            f"{count(len(fusion.outputs), 'output')}",
            "meshes:",
            *(f"  {label[mesh]} = {mesh}" for mesh in meshes),
            "inputs: " + ", ".join(t.name for t in fusion.inputs),
        ]
        for instruction in self.instructions:
            lines.extend(f"  {line}" for line in instruction.text(label))
        lines.append("outputs: " + ", ".join(t.name for t in fusion.outputs))
        return "\n".join(lines)
