"""One rank's program: the host program specialized for this rank and these extents.

``RankProgram`` unrolls the host program's loops into a flat list of steps, each a
closure that launches work: a kernel (generated, through cuBLAS, or the evaluator),
a communication (``overlap.comm.communications``, or a chunk of a pipeline through
``overlap.comm.pipelined``), a stream switch. Everything a run does not need to decide again
is decided here once. It reads the compiled program and its ``RankSetup`` and writes
only its own fields, and the copy-engine buffers its setup hands it (which its steps
fill and read, as a run must).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusion.binding import Bindings, resolve
from fusion.fp4 import unpack_fp4
from fusion.ir import TensorView
from fusion.storage import is_packed, packed, storage_dtype, storage_shape
from overlap.comm.communications import Pending, RankContext, prepare
from overlap.comm.pipelined import PipelinedComms, chunk_rows, place
from overlap.comm.symmetric import SymmetricBuffers
from overlap.compile.pipeline import CompiledProgram
from overlap.diag.ranges import Recorder, recorder
from overlap.diag.timeline import Timeline
from overlap.ir import (
    AliasSelect,
    Allocate,
    CombineStaged,
    Communicate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    Synchronize,
    Transport,
    Wait,
)
from overlap.runtime.compute_steps import ComputeSteps
from overlap.runtime.listeners import OutputListener, listened_steps
from overlap.runtime.streams import StreamPool
from schedulers.hardware import HardwareProfile
from schedulers.runtime import allocator, contiguous_strides
from sharding.errors import ShardingError
from sharding.layout import Shard, layout_of, local_shape
from sharding.mesh import DeviceMesh


@dataclass
class RankSetup:
    """What a rank program needs from its executor: who it is, where it runs, and the
    user's kernel overrides."""

    rank: int
    communicator: object | None  # a Communicator; None on one device
    device: torch.device
    streams: StreamPool
    symmetric: SymmetricBuffers | None  # copy-engine buffers, on CUDA when used
    kernel_params: dict[str, object]
    hardware: HardwareProfile  # what the kernels' heuristics read
    listener: OutputListener | None = None  # told of each output as it is issued


def rank_shape(tensor: TensorView, rank: int, bindings: Bindings) -> list[int]:
    """``rank``'s (logical) shape of ``tensor`` under ``bindings``."""
    shape = [resolve(e, bindings) for e in tensor.shape]
    layout = layout_of(tensor)
    return shape if layout is None else local_shape(layout, rank, shape)


class RankProgram:
    """The host program specialized for this rank and these extents: a flat list of steps.

    Loops are unrolled; everything that does not change from run to run (which ranks
    take part, chunk offsets, groups, peers' buffers, streams, kernel launch
    configurations) is worked out here once, so a run only launches work. Each run gets
    fresh buffers. Every instruction type has its step builder in ``_STEPS``.
    ``chosen_params`` and ``kernel_forms`` say what each generated kernel got.
    """

    def __init__(self, compiled: CompiledProgram, setup: RankSetup, bindings: Bindings) -> None:
        self.compiled, self.setup, self.bindings = compiled, setup, bindings
        self.fusion = compiled.fusion
        self.rank = setup.rank
        self.values: dict[TensorView, torch.Tensor | None] = {}
        self.pending: dict[tuple[Communicate, int | None], Pending] = {}
        self.tokens: dict[tuple[Communicate, int | None], object] = {}
        self.saved_streams: dict[str, object] = {}
        self.timeline: Timeline | Recorder | None = None  # a Recorder: profiler ranges too
        self.streams = setup.streams
        self.shapes: dict[TensorView, list[int]] = {}
        self.chosen_params: dict[str, object] = {}
        self.kernel_forms: dict[str, list] = {}  # kernel name -> its launchers' forms()
        self.ctx = RankContext(
            self.rank,
            setup.communicator,
            lambda t: [resolve(e, bindings) for e in t.shape],
            self.local_shape,
            storage_dtype,
            setup.device,
        )
        # sums of partials (overlap.comm.partials) as generated kernels where compute is
        self.pipelined = PipelinedComms(
            self.ctx, setup.symmetric, setup.hardware if compiled.schedule else None
        )
        self.deferred: list[tuple] = []  # CPU waits put off to their loop's end
        self.chunk_offsets: dict[object, tuple[int, int]] = {}  # chunk: (axis, offset)
        self.compute = ComputeSteps(self)
        self.steps: list = []
        if setup.listener is None:
            self._compile(compiled.host.instructions, None)
        else:  # each output told as issued (overlap.runtime.listeners)
            listened_steps(self, setup.listener)
        # the fusion's inputs and outputs: whether this rank holds each, whether fp4-packed
        self.fusion_inputs, self.fusion_outputs = (
            [(t, self.holds(t.mesh), is_packed(t)) for t in tensors]
            for tensors in (self.fusion.inputs, self.fusion.outputs)
        )
        plain = all(held and not packs for _, held, packs in self.fusion_inputs)
        self.plain_inputs = [t for t, _, _ in self.fusion_inputs] if plain else None
        # each held input's shape and dtype in this program (None: not held here)
        self.input_types = [(torch.Size(storage_shape(t, self.local_shape(t))), t.dtype.torch_dtype)
                            if held else None for t, held, _ in self.fusion_inputs]  # fmt: skip

    def holds(self, mesh: DeviceMesh | None) -> bool:
        """Whether this rank runs what is placed on ``mesh`` (None: everywhere)."""
        return mesh is None or self.rank in mesh

    def _slot(self, tensor: TensorView, loop):
        """Where a tensor's value lives: a chunk tensor has one value per iteration."""
        if loop is not None and tensor.fusion is not self.fusion:
            return (tensor, loop[1])
        return tensor

    def local_shape(self, tensor: TensorView) -> list[int]:
        if tensor not in self.shapes:
            self.shapes[tensor] = rank_shape(tensor, self.rank, self.bindings)
        return self.shapes[tensor]

    # -- running ---------------------------------------------------------------

    def run(self, local_inputs, timeline: Timeline | None) -> list[torch.Tensor | None]:
        """Run the steps on this rank's ``local_inputs`` (None where it holds none),
        recording them on ``timeline``; returns this rank's outputs (None where it
        holds none). The inputs must have this program's shapes and dtypes (what the
        executor's input check sees to): a run whose inputs changed unchecked
        (``check_inputs="never"``) raises rather than be read as this program's."""
        self.deferred = []  # none left behind by a run that raised
        self.pipelined.new_run()
        self.timeline = recorder(timeline, self.streams.cuda)
        for value, expected in zip(local_inputs, self.input_types, strict=True):
            if expected is not None and (value.shape, value.dtype) != expected:
                self._refuse_changed(local_inputs)
        if self.plain_inputs:  # every input held, none packed: the common case
            self.values = values = dict(zip(self.plain_inputs, local_inputs, strict=True))
        else:
            self.values = values = {}
            for (tensor, held, packs), value in zip(self.fusion_inputs, local_inputs,
                                                    strict=True):  # fmt: skip
                if held:  # fp4 stays packed, two values per byte, between kernels
                    values[tensor] = value.view(torch.uint8) if packs else value
        polls = timeline is not None  # a timeline's spans end when the host sees them done
        for step in self.steps:
            step()
            if polls and self.deferred:
                self._poll_deferred()
        self.values = {}
        return [
            None if not held
            else values[tensor].contiguous().view(torch.float4_e2m1fn_x2) if packs
            else values[tensor].contiguous()
            for tensor, held, packs in self.fusion_outputs
        ]  # fmt: skip

    def _refuse_changed(self, local_inputs) -> None:
        """Raises for the first input not of this program's shape and dtype."""
        for tensor, value, expected in zip(self.fusion.inputs, local_inputs, self.input_types,
                                           strict=True):  # fmt: skip
            if expected is not None and (value.shape, value.dtype) != expected:
                raise RuntimeError(
                    f"input {tensor} is {list(value.shape)} {value.dtype} where this run's "
                    f"program has {list(expected[0])} {expected[1]}; inputs that change need "
                    "check_inputs='changes' (the default) or 'always'"
                )

    def _lane(self, loop, kind: str) -> str:
        return f"stream {loop[1] % self.streams.count} {kind}" if loop else f"main {kind}"

    # -- compiling -------------------------------------------------------------

    def _compile(self, instructions: list, loop) -> None:
        for index, instruction in enumerate(instructions):
            if isinstance(instruction, ForLoop):
                for iteration in range(instruction.scheme.num_chunks):
                    self._compile(instruction.body, (instruction.scheme, iteration))
                self.steps.append(self._finish_deferred)
                self.steps.append(self.pipelined.drain)
                continue
            if isinstance(instruction, Wait) and self._defers(
                instruction, instructions[index + 1 :], loop
            ):
                step = self._wait(instruction, loop, deferred=True)
            else:
                step = self._STEPS[type(instruction)](self, instruction, loop)
            if step is not None:
                self.steps.append(step)

    def _defers(self, wait: Wait, after: list, loop) -> bool:
        """Whether a wait is put off to the end of its loop. On GPUs a wait blocks a
        stream, not the host; on CPUs the host runs every stream's work in turn, and a
        wait for chunk i's collective would hold back chunk i+1's compute. It is put off
        where nothing in the loop reads its result before the loop ends: the wait ends
        its iteration's work (only stream bookkeeping follows), its chunk has a value
        per iteration, and it went over a collective (no later transfer forwards it)."""
        communicate = wait.communicate
        return (
            loop is not None
            and not self.streams.cuda
            and communicate.transport in (None, Transport.COLLECTIVE)
            and communicate.target.fusion is not self.fusion
            and all(isinstance(i, SetCurrentStream | Synchronize) for i in after)
        )

    def _finish_deferred(self) -> None:
        for wait, _ in self.deferred:
            wait()
        self.deferred.clear()

    def _poll_deferred(self) -> None:
        """Finish the put-off waits whose collectives are done, so that a timeline's span
        ends when the host first saw it done (after the step that was running)."""
        waiting = []
        for wait, done in self.deferred:
            if done():
                wait()
            else:
                waiting.append((wait, done))
        self.deferred = waiting

    def _allocate(self, instruction: Allocate, loop):
        # Allocated before the loop, on the user's stream: a buffer first touched inside
        # a loop would belong to a side stream, and the allocator could hand it out again
        # before the user's stream is done with it.
        tensor = instruction.tensor
        if not self.holds(tensor.mesh):
            return None
        shape = tuple(storage_shape(tensor, self.local_shape(tensor)))
        strides, dtype = contiguous_strides(shape), storage_dtype(tensor)
        empty = allocator(self.ctx.device)

        def allocate() -> None:
            self.values[tensor] = empty(shape, strides, dtype)

        return allocate

    def _deallocate(self, instruction: Deallocate, loop):
        return lambda: self.values.pop(instruction.tensor, None)

    def _get_current_stream(self, instruction: GetCurrentStream, loop):
        if not self.streams.cuda:
            return None
        return lambda: self.saved_streams.__setitem__(instruction.name, self.streams.current())

    def _set_current_stream(self, instruction: SetCurrentStream, loop):
        if not self.streams.cuda:
            return None
        if instruction.stream.saved:
            name = instruction.stream.saved
            return lambda: self.streams.set(self.saved_streams[name])
        stream = self.streams.get(loop[1])
        return lambda: self.streams.set(stream)

    def _synchronize(self, instruction: Synchronize, loop):
        if not self.streams.cuda:
            return None
        if instruction.stream.saved:
            name = instruction.stream.saved
            return lambda: self.streams.wait(self.saved_streams[name])
        stream = self.streams.get(loop[1])
        return lambda: self.streams.wait(stream)

    def _alias_select(self, instruction: AliasSelect, loop):
        source, result, dim = instruction.source, instruction.result, instruction.dim
        if not self.holds(source.mesh):
            return None
        scheme, iteration = loop
        layout = layout_of(source)
        split = (
            scheme.owners > 1
            and layout is not None
            and layout.placements[scheme.mesh_axis] == Shard(dim)
        )
        result = self._slot(result, loop)
        if scheme.owners > 1:
            where = place(scheme, self.rank, iteration)
            if split and not where.owned:
                return lambda: self.values.__setitem__(result, None)
            chunk = where.chunk
        else:
            chunk = scheme.chunk(iteration, 0)
        offset, size = chunk_rows(self.local_shape(source)[dim], scheme, chunk, split)
        self.chunk_offsets[result] = (dim, offset)  # in values (fp4: before halving)
        if is_packed(source) and dim == source.ndim - 1:
            if offset % 2 or size % 2:
                raise ShardingError(
                    f"chunk {chunk} of {source} along its innermost axis starts or ends inside "
                    "a byte of packed fp4 values; choose a chunk count that keeps pieces even"
                )
            offset, size = offset // 2, size // 2

        def select() -> None:
            self.values[result] = self.values[source].narrow(dim, offset, size)

        return select

    def _launch_kernel(self, kernel: LaunchKernel, loop):
        if not self.holds(kernel.mesh):
            return None
        aliases = {t: self._slot(chunk, loop) for t, chunk in kernel.aliases.items()}

        def evaluated() -> list:
            return [self.compute.evaluated(expr, aliases) for expr in kernel.exprs]

        if kernel.scheduler is None or self.compute.holds_an_empty_piece(kernel.analysis):
            # an empty piece (fewer rows than ranks) has nothing to launch a kernel over;
            # the evaluator gives its partial results the identity
            computes = evaluated()
        else:  # in a loop, a chunk may still turn out empty
            for_empty = evaluated() if loop is not None else None
            computes = [self.compute.generated(kernel, aliases, for_empty)]
        lane = self._lane(loop, "compute")
        ops = [expr.op_name for expr in kernel.exprs]
        detail = ", ".join(ops[:3]) + (f" (+{len(ops) - 3} ops)" if len(ops) > 3 else "")
        chunk = loop[1] if loop else None

        def launch() -> None:
            if self.timeline is None:
                for compute in computes:
                    compute()
                return
            with self.timeline.span(lane, kernel.name, detail, chunk):
                for compute in computes:
                    compute()

        return launch

    def _communicate(self, instruction: Communicate, loop):
        comm = instruction.communication
        if self.setup.communicator is None or self.rank not in comm.participants():
            return None
        source, target = self._slot(instruction.source, loop), self._slot(instruction.target, loop)
        lane = self._lane(loop, "comm")
        if loop is not None:
            transfer = self.pipelined.prepare(instruction, *loop)

            def post() -> Pending:
                return transfer(self.values.get(source), self.values.get(target))

        elif is_packed(comm.output):
            # Collectives move fp4 unpacked (one value per byte), then pack it again.
            posted = prepare(comm, self.ctx)

            def post() -> Pending:
                value = self.values.get(source)
                pending = posted(None if value is None else unpack_fp4(value))
                finish = pending.finish
                pending.finish = lambda: packed(comm.output, finish())
                return pending

        else:
            posted = prepare(comm, self.ctx)

            def post() -> Pending:
                return posted(self.values.get(source))

        key = (instruction, loop[1] if loop else None)
        detail, chunk = f"{comm.op_name} {comm.output.name}", key[1]

        def communicate() -> None:
            if self.timeline is not None:
                self.tokens[key] = self.timeline.start(lane, instruction.name, detail, chunk)
            self.pending[key] = post()

        return communicate

    def _wait(self, instruction: Wait, loop, deferred: bool = False):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.setup.communicator is None or self.rank not in comm.participants():
            return None
        key = (communicate, loop[1] if loop else None)
        target = self._slot(communicate.target, loop)

        def wait() -> None:
            # A chunk transfer writes into its target view; it may hand back another
            # tensor to use as the chunk (an owner's chunk used where it is).
            result = self.pending.pop(key).wait()
            if result is not None:
                self.values[target] = result
            if self.timeline is not None:
                self.timeline.stop(self.tokens.pop(key))

        if not deferred:
            return wait

        def done() -> bool:
            return all(work is None or work.is_completed() for work in self.pending[key].works)

        return lambda: self.deferred.append((wait, done))

    def _stage_for_peers(self, instruction: StageForPeers, loop):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.rank not in comm.participants():
            return None
        symmetric = self.setup.symmetric
        return lambda: symmetric.stage(communicate, self.values[comm.inputs[0]])

    def _combine_staged(self, instruction: CombineStaged, loop):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.rank not in comm.participants():
            return None
        symmetric = self.setup.symmetric
        combiner = self.pipelined.combiner(communicate, math.prod(self.local_shape(comm.output)))
        return lambda: symmetric.combine(communicate, self.values[comm.output], combiner)

    def allocate_symmetric(self) -> None:
        for loop in self.compiled.host.instructions:
            for instruction in loop.body if isinstance(loop, ForLoop) else ():
                if getattr(instruction, "transport", None) is not Transport.COPY_ENGINE:
                    continue  # not a copy-engine communication
                comm = instruction.communication
                dim, moving = comm.split_dim, comm.inputs[0]
                shape, whole = self.local_shape(moving), self.ctx.global_shape(comm.output)[dim]
                rest = shape[:dim] + shape[dim + 1 :]
                self.setup.symmetric.allocate(instruction, loop.scheme, whole, dim, rest,
                                              storage_dtype(moving))  # fmt: skip

    # the step builder of each instruction type (a loop is unrolled by ``_compile``)
    _STEPS = {
        Allocate: _allocate,
        Deallocate: _deallocate,
        GetCurrentStream: _get_current_stream,
        SetCurrentStream: _set_current_stream,
        Synchronize: _synchronize,
        AliasSelect: _alias_select,
        LaunchKernel: _launch_kernel,
        Communicate: _communicate,
        Wait: _wait,
        StageForPeers: _stage_for_peers,
        CombineStaged: _combine_staged,
    }
