"""The host IR: the program every rank runs, as a list of instructions.

One program serves every rank (SPMD): an instruction runs on the ranks of its
mesh (a kernel) or its teams (a communication) and is skipped elsewhere.
Stream-parallel work is a ``ForLoop`` over chunks: each iteration selects its
chunk of every tensor (``AliasSelect``), runs on its own stream, and hands
back to the user's stream. Example (all-gather + linear, 2 chunks)::

    HostProgram ag_linear: 2 inputs, 1 output
    meshes:
      M0 = mesh(x=2: [0, 1])
    inputs: T0, T1
      Allocate T4_f32[iStream8{8}, iS9{4}]  @M0
      Allocate T2_f32[iStream4{8}, iDIDx5{6}, rS6{4}]  @M0
      s0 = GetCurrentStream
      FOR i in range(2):
        SetCurrentStream(stream i)
        Synchronize(s0)
      FOR i in range(2):  # post every transfer first
        SetCurrentStream(stream i)
        T5 = AliasSelect(T0, dim=0, chunk=i)
        T6 = AliasSelect(T4, dim=0, chunk=i)
        c0 = Allgather(T5 -> T6, axis='x', in_dim=0) [collective]
      FOR i in range(2):  # 2 chunks, 1 per rank of x, order global
        SetCurrentStream(stream i)
        Wait c0
        T7 = AliasSelect(T2, dim=0, chunk=i)
        LaunchKernel k0 [torch] (T6, T1) -> (T7)
          linear
        SetCurrentStream(s0)
        Synchronize(stream i)
    outputs: T2

Size: one instruction set, every instruction with its text and its placement, and the
program's printing and fingerprint, kept in one file so that the IR reads in one place.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from fusion.exprs import Expr
from fusion.ir import Fusion, TensorView
from fusion.printer import count
from sharding.communication import Communication
from sharding.mesh import DeviceMesh


class Transport(enum.StrEnum):
    """How a pipelined communication moves a chunk (its value prints in programs)."""

    # a broadcast per chunk (all-gather), or every partial sent whole to its owner
    # (reduce-scatter), every rank taking part at each step
    COLLECTIVE = "collective"
    RING = "ring"  # send/receive to the ring neighbours, chunk by chunk
    COPY_ENGINE = "copy_engine"  # copies from/to peers' symmetric memory: no SMs


class ChunkOrder(enum.StrEnum):
    """The order in which a rank visits the chunks of a pipelined loop."""

    GLOBAL = "global"  # the same on every rank
    LOCAL_FIRST = "local_first"  # own chunks first (a copy-engine all-gather)
    LOCAL_LAST = "local_last"  # own chunks last (a copy-engine reduce-scatter)
    RING_GATHER = "ring_gather"  # the ring's all-gather schedule
    RING_REDUCE = "ring_reduce"  # the ring's reduce-scatter schedule


class Instruction:
    """One step of a host program."""

    def text(self, labels: dict[object, str]) -> list[str]:
        raise NotImplementedError

    def runs_on(self, rank: int) -> bool:
        """Whether ``rank`` takes part in this step (every rank, unless placed)."""
        return True


def _on(mesh: DeviceMesh | None, rank: int) -> bool:
    return mesh is None or rank in mesh


def _moved(tensor: TensorView) -> str:
    """A tensor as a communication moves it, without names (which shift with any op
    added elsewhere): dtype and axes, ``bf16[iDIDx{8}, iS{16}]``."""
    axes = ", ".join(
        f"{a.iter_type.value}{a.parallel_type.value}{{{a.extent}}}" for a in tensor.axes
    )
    return f"{tensor.dtype.short}[{axes}]"


def _posted(communicate: Communicate, labels: dict[object, str]) -> str:
    attrs, where = communicate.described(labels)
    return (
        f"{communicate.name} = {communicate.communication.op_name}({', '.join(attrs)}){where}: "
        f"{_moved(communicate.source)} -> {_moved(communicate.target)}"
    )


def _at(mesh: object, labels: dict[object, str]) -> str:
    return f"  @{labels[mesh]}" if mesh in labels else ""


@dataclass(eq=False, frozen=True)
class Allocate(Instruction):
    """Allocate the local buffer of ``tensor`` (filled later, whole or, along
    ``stream_dim``, chunk by chunk)."""

    tensor: TensorView
    stream_dim: int | None = None

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"Allocate {self.tensor.text(self.stream_dim)}{_at(self.tensor.mesh, labels)}"]

    def runs_on(self, rank: int) -> bool:
        return _on(self.tensor.mesh, rank)


@dataclass(eq=False, frozen=True)
class LaunchKernel(Instruction):
    """Run ``exprs`` on the ranks of ``mesh`` (everywhere when None).

    ``aliases`` maps the fusion's tensors to the chunk tensors this launch reads and
    writes inside a loop. ``backend`` names what computes it: ``reference`` (the eager
    reference evaluator), ``torch`` (PyTorch's own kernels: matmul and linear, cuBLAS on
    GPUs and the CPU's BLAS elsewhere; attention) or a scheduler's generated kernel.
    """

    name: str
    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    mesh: DeviceMesh | None
    backend: str = "reference"
    aliases: dict[TensorView, TensorView] = field(default_factory=dict)
    scheduler: object | None = None  # the scheduler that generates the kernel
    analysis: object | None = None  # its analysis of ``exprs`` (its ``plan()``'s result)
    note: str = ""  # why no scheduler took the exprs, for a reference kernel

    def text(self, labels: dict[object, str]) -> list[str]:
        ins = ", ".join(t.name for t in self.inputs)
        outs = ", ".join(t.name for t in self.outputs)
        ops = ", ".join(e.op_name for e in self.exprs)
        at = _at(self.mesh, labels)
        lines = [f"LaunchKernel {self.name} [{self.backend}] ({ins}) -> ({outs}){at}", f"  {ops}"]
        if self.note:
            lines.append(f"  no scheduler: {self.note}")
        return lines

    def runs_on(self, rank: int) -> bool:
        return _on(self.mesh, rank)


@dataclass(eq=False, frozen=True)
class Communicate(Instruction):
    """Start a communication (asynchronously where the backend allows).

    Inside a loop, ``source`` and ``target`` are chunk tensors and ``transport`` says
    how a chunk moves: ``collective`` (a broadcast of each chunk, or each partial
    sent to its owner, every rank taking part at each step), ``ring``
    (send/receive around the ring) or ``copy_engine`` (copies from or to peers'
    symmetric-memory buffers, no SMs used). ``pipelined``: the loop cuts the axis it
    gathers or scatters (chunk ``c`` moves between its owner and the others); else a
    loop's communication moves each chunk whole, as the communication it is.
    """

    name: str
    communication: Communication
    source: TensorView
    target: TensorView
    transport: Transport | None = None
    pipelined: bool = False
    # A copy-engine all-gather whose gathered tensor is used only chunk by chunk: a
    # rank's own chunk is used where it is instead of being copied in.
    alias_owned: bool = False

    def __post_init__(self) -> None:
        if self.transport is not None:  # a name reads as its member
            object.__setattr__(self, "transport", Transport(self.transport))

    def described(self, labels: dict[object, str]) -> tuple[list[str], str]:
        """Its attributes (``axis='x'``...), and its transport and meshes as printed."""
        comm = self.communication
        attrs = [f"{key}={value!r}" for key, value in comm.attrs.items()]
        meshes = _at(comm.in_layout.mesh, labels)
        if not comm.same_mesh:
            meshes += f" -> {labels[comm.out_layout.mesh]}"
        transport = f" [{self.transport}]" if self.transport else ""
        return attrs, transport + meshes

    def text(self, labels: dict[object, str]) -> list[str]:
        attrs, where = self.described(labels)
        moved = ", ".join([f"{self.source.name} -> {self.target.name}", *attrs])
        return [f"{self.name} = {self.communication.op_name}({moved}){where}"]

    def runs_on(self, rank: int) -> bool:
        return rank in self.communication.participants()


@dataclass(eq=False, frozen=True)
class Wait(Instruction):
    """Make the current stream wait until a communication has delivered its output."""

    communicate: Communicate

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"Wait {self.communicate.name}"]

    def runs_on(self, rank: int) -> bool:
        return self.communicate.runs_on(rank)


@dataclass(eq=False, frozen=True)
class Deallocate(Instruction):
    """Release ``tensor``'s local buffer after its last use."""

    tensor: TensorView

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"Deallocate {self.tensor.name}"]

    def runs_on(self, rank: int) -> bool:
        return _on(self.tensor.mesh, rank)


@dataclass(frozen=True)
class StreamRef:
    """A stream: the one saved under ``saved`` (the user's), or the loop's stream ``i``."""

    saved: str | None = None

    def __str__(self) -> str:
        return self.saved if self.saved else "stream i"


LOOP_STREAM = StreamRef()


@dataclass(eq=False, frozen=True)
class GetCurrentStream(Instruction):
    """Remember the user's current stream under ``name``."""

    name: str

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"{self.name} = GetCurrentStream"]


@dataclass(eq=False, frozen=True)
class SetCurrentStream(Instruction):
    """Make ``stream`` current: work launched next runs on it."""

    stream: StreamRef

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"SetCurrentStream({self.stream})"]


@dataclass(eq=False, frozen=True)
class Synchronize(Instruction):
    """Make the current stream wait for the work already queued on ``stream``."""

    stream: StreamRef

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"Synchronize({self.stream})"]


@dataclass(eq=False, frozen=True)
class AliasSelect(Instruction):
    """``result`` is a view of chunk ``i`` of ``source`` along ``dim`` (reduction axes kept).

    A rank whose ``source`` holds a split of ``dim`` has data only for the chunks it
    owns; elsewhere the view is empty (a communication fills or empties it).
    """

    result: TensorView
    source: TensorView
    dim: int

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"{self.result.name} = AliasSelect({self.source.name}, dim={self.dim}, chunk=i)"]

    def runs_on(self, rank: int) -> bool:
        return _on(self.source.mesh, rank)


@dataclass(frozen=True)
class ChunkScheme:
    """How a loop cuts its stream axis into chunks and in which order ranks visit them.

    With ``owners`` > 1 the axis is split over the ranks of ``mesh_axis`` of ``mesh``
    (a pipelined all-gather or reduce-scatter): chunk ``c`` is sub-chunk ``c % k`` of
    owner ``c // k``'s rows, ``k = num_chunks / owners``. ``order`` maps the iteration
    index to a chunk on each rank: ``global`` (the same everywhere), ``local_first``,
    ``local_last`` (own chunks first or last), ``ring_gather``/``ring_reduce``
    (the ring's schedule).
    """

    num_chunks: int
    owners: int = 1
    mesh: DeviceMesh | None = None
    mesh_axis: int | None = None
    order: ChunkOrder = ChunkOrder.GLOBAL

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", ChunkOrder(self.order))  # a name reads as its member

    @property
    def per_owner(self) -> int:
        return self.num_chunks // self.owners

    def chunk(self, iteration: int, coordinate: int) -> int:
        """The chunk this rank (at ``coordinate`` along the split axis) takes at ``iteration``."""
        k, owners = self.per_owner, self.owners
        if self.order is ChunkOrder.LOCAL_FIRST:
            return (coordinate * k + iteration) % self.num_chunks
        if self.order is ChunkOrder.LOCAL_LAST:
            return ((coordinate + 1) * k + iteration) % self.num_chunks
        if self.order is ChunkOrder.RING_GATHER:
            return ((coordinate - iteration // k) % owners) * k + iteration % k
        if self.order is ChunkOrder.RING_REDUCE:
            return ((coordinate - 1 - iteration // k) % owners) * k + iteration % k
        return iteration

    def describe(self) -> str:
        if self.owners == 1:
            return f"{self.num_chunks} chunks"
        return (
            f"{self.num_chunks} chunks, {self.per_owner} per rank of "
            f"{self.mesh.axis_names[self.mesh_axis]}, order {self.order}"
        )


@dataclass(eq=False, frozen=True)
class ForLoop(Instruction):
    """``body`` once per chunk of a stream-parallel axis, iteration ``i`` on stream ``i``."""

    scheme: ChunkScheme
    body: tuple[Instruction, ...] = ()
    comment: str = ""

    def text(self, labels: dict[object, str], rank: int | None = None) -> list[str]:
        note = f"  # {self.comment}" if self.comment else ""
        lines = [f"FOR i in range({self.scheme.num_chunks}):{note}"]
        for instruction in self.body:
            if rank is None or instruction.runs_on(rank):
                lines.extend(f"  {line}" for line in _text(instruction, labels, rank))
        return lines

    def runs_on(self, rank: int) -> bool:
        return any(instruction.runs_on(rank) for instruction in self.body)


def _text(instruction: Instruction, labels: dict[object, str], rank: int | None) -> list[str]:
    """An instruction's lines; a loop's body only with what ``rank`` runs (all: None)."""
    if isinstance(instruction, ForLoop):
        return instruction.text(labels, rank)
    return instruction.text(labels)


@dataclass(eq=False, frozen=True)
class StageForPeers(Instruction):
    """Copy this rank's piece of ``tensor`` into its symmetric-memory buffer, then wait at a
    barrier until every peer has done the same (before a copy-engine all-gather)."""

    communicate: Communicate

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"StageForPeers({self.communicate.communication.inputs[0].name})"]

    def runs_on(self, rank: int) -> bool:
        return self.communicate.runs_on(rank)


@dataclass(eq=False, frozen=True)
class CombineStaged(Instruction):
    """After a copy-engine reduce-scatter: wait at a barrier until every peer has pushed
    its partial chunks, then sum them into this rank's piece of ``tensor``."""

    communicate: Communicate

    def text(self, labels: dict[object, str]) -> list[str]:
        return [f"CombineStaged({self.communicate.communication.output.name})"]

    def runs_on(self, rank: int) -> bool:
        return self.communicate.runs_on(rank)


def stream_dim(tensor: TensorView) -> int | None:
    """The logical axis of ``tensor`` that is stream-parallel, if any (at most one)."""
    dims = [d for d, a in enumerate(tensor.logical_axes) if a.is_stream]
    if len(dims) > 1:
        raise ValueError(f"{tensor} has {len(dims)} Stream axes; at most one is supported")
    return dims[0] if dims else None


def walk(instructions: list[Instruction]):
    """Every instruction, loop bodies included, in program order."""
    for instruction in instructions:
        yield instruction
        if isinstance(instruction, ForLoop):
            yield from walk(instruction.body)


@dataclass(frozen=True)
class HostProgram:
    """The instructions of one fusion, for every rank, with its inputs and outputs (a
    value: a pass after lowering returns a new program)."""

    fusion: Fusion
    instructions: tuple[Instruction, ...] = ()

    @property
    def communications(self) -> list[Communication]:
        seen: list[Communication] = []
        for instruction in walk(self.instructions):
            if isinstance(instruction, Communicate) and instruction.communication not in seen:
                seen.append(instruction.communication)
        return seen

    def generated_kernels(self) -> dict[str, LaunchKernel]:
        """The program's generated kernels by name."""
        return {
            i.name: i
            for i in walk(self.instructions)
            if isinstance(i, LaunchKernel) and i.scheduler is not None
        }

    def posting_order(self) -> list[str]:
        """What this program posts, in order: every communication (with its transport
        and the tensors it moves: dtypes, extents), chunk loop and symmetric-memory step,
        with its meshes. Ranks that run together
        must agree on it, or some rank waits forever in a collective its peers never
        post."""
        labels = self._mesh_labels()
        lines = [f"{label} = {mesh}" for mesh, label in labels.items()]
        for instruction in walk(self.instructions):
            if isinstance(instruction, ForLoop):
                lines.append(f"FOR {instruction.scheme.describe()}")
            elif isinstance(instruction, Communicate):
                lines.append(_posted(instruction, labels))
            elif isinstance(instruction, (Wait, StageForPeers, CombineStaged)):
                lines.extend(instruction.text(labels))
        return lines

    def fingerprint(self, posted: list[str] | None = None) -> str:
        """A short hash of ``posting_order()`` (or of ``posted``, already made): equal
        on ranks that post the same."""
        text = "\n".join(self.posting_order() if posted is None else posted)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def transports(self) -> set[Transport]:
        """The transports its pipelined communications use."""
        return {
            i.transport
            for i in walk(self.instructions)
            if isinstance(i, Communicate) and i.transport is not None
        }

    def _mesh_labels(self) -> dict[object, str]:
        meshes: list[object] = []
        for tensor in self.fusion.tensors:
            if tensor.mesh is not None and tensor.mesh not in meshes:
                meshes.append(tensor.mesh)
        return {mesh: f"M{index}" for index, mesh in enumerate(meshes)}

    def __str__(self) -> str:
        return self.text_for_rank(None)

    def text_for_rank(self, rank: int | None) -> str:
        """The program as ``rank`` runs it: only the instructions it takes part in
        (``None``: every instruction, as ``str`` prints it)."""
        fusion = self.fusion
        labels = self._mesh_labels()
        meshes = list(labels)
        name = f" {fusion.name}" if fusion.name else ""
        lines = [
            f"HostProgram{name}: {count(len(fusion.inputs), 'input')}, "
            f"{count(len(fusion.outputs), 'output')}"
        ]
        if meshes:
            lines.append("meshes:")
            lines.extend(f"  {labels[mesh]} = {mesh}" for mesh in meshes)
        lines.append("inputs: " + ", ".join(t.name for t in fusion.inputs))
        for instruction in self.instructions:
            if rank is None or instruction.runs_on(rank):
                lines.extend(f"  {line}" for line in _text(instruction, labels, rank))
        lines.append("outputs: " + ", ".join(t.name for t in fusion.outputs))
        return "\n".join(lines)
