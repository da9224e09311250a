"""``MultiDeviceExecutor``: runs a sharded fusion's host program on this rank.

Construction (the same on every rank, no communication until the last step):
place every tensor and insert the communications (``sharding.shard_fusion``),
segment, lower to a host program, refuse meshes larger than the world, then
create the process groups the program needs (collectively).

``run(local_inputs)`` first checks every rank's inputs against the fusion:
the ranks exchange their inputs' shapes and dtypes (one small all-gather) and
each rank checks all of them, so a bad input on any rank raises the same
``InputError`` on every rank, before any communication of the program starts.
Then it runs the program: compute segments with the reference evaluator on
local pieces, communications through torch.distributed.

Example (on every rank)::

    executor = MultiDeviceExecutor(fd, Communicator())
    outputs = executor.run(executor.shard_inputs(full_inputs))
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

import torch

from fusion.definition import FusionDefinition
from fusion.dtypes import float4_e2m1
from fusion.errors import InputError
from fusion.exprs import Expr, LinearOp, MatmulOp, ReductionOp
from fusion.fp4 import pack_fp4, unpack_fp4
from fusion.ir import ExtentConstraint, Fusion, Symbol, TensorView
from fusion.portable import portable, restored
from fusion.reference import Bindings, bind_inputs, evaluate_expr, resolve
from overlap import progress
from overlap.communications import Pending, RankContext, identity, start
from overlap.communicator import Communicator
from overlap.host_ir import (
    AliasSelect,
    Allocate,
    CombineStaged,
    Communicate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    Synchronize,
    Wait,
    walk,
)
from overlap.lowering import lower_to_host_program
from overlap.pipelined import PipelinedComms, chunk_rows, place
from overlap.planner import (
    HardwareFigures,
    OverlapOptions,
    default_hardware_figures,
    plan_overlap,
)
from overlap.streams import StreamPool
from overlap.symmetric import SymmetricBuffers
from overlap.timeline import Timeline
from schedulers.hardware import current_hardware
from sharding.communication import LocalShard
from sharding.errors import ShardingError
from sharding.layout import Layout, Shard, layout_of, local_shape, split_range, split_sizes
from sharding.mesh import DeviceMesh
from sharding.pieces import assemble, local_piece
from sharding.propagation import explain
from sharding.resharding import shard_fusion


class MultiDeviceExecutor:
    """Runs ``fusion`` on this rank as part of every rank running it.

    A fusion with no tensor placed on a mesh runs whole on one device (the
    communicator may then be None). ``options`` override the overlap planner and
    ``hardware`` feeds its cost model (by default the recorded figures of this
    device kind).

    ``kernels`` chooses how compute segments run: ``"generated"`` (Triton kernels from
    the schedulers wherever one takes the segment; on CPU this needs Triton's
    interpreter, ``TRITON_INTERPRET=1``), ``"reference"`` (the reference evaluator) or
    ``"auto"`` (generated on CUDA, reference elsewhere). ``kernel_params`` overrides the
    heuristics' launch configuration of a kernel by its name (``{"k0": params}``), or
    forces one of its scheduler's strategies, the rest still chosen by the heuristics
    (``{"k0": "warp_specialized"}``; the normalization scheduler has ``"multiwave"`` and
    ``"warp_specialized"``; no fallback: a strategy that cannot run raises);
    ``kernel_report()`` says what each kernel got.

    ``cuda_graph=True`` (CUDA only) captures a run in a CUDA graph the first time it
    sees a set of input buffers and replays it after that, so the host no longer
    issues the program step by step. The outputs are then the graph's own buffers:
    the next run with the same inputs overwrites them (clone what you keep). Every
    rank must use the same setting.
    """

    def __init__(
        self,
        fusion: Fusion | FusionDefinition,
        communicator: Communicator | None = None,
        options: OverlapOptions | None = None,
        hardware: HardwareFigures | None = None,
        cuda_graph: bool = False,
        kernels: str = "auto",
        kernel_params: dict[str, object] | None = None,
    ) -> None:
        fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
        self.communicator = communicator
        self.rank = communicator.rank if communicator else 0
        if communicator is not None:
            self.device = communicator.device
        else:  # one device: the GPU when there is one
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.sharded = any(t.mesh is not None for t in fusion.tensors)
        try:
            self._build(fusion, options, hardware, cuda_graph, kernels, kernel_params)
            failure = None
        except Exception as error:  # told to the peers first, then raised
            failure = error
        if self.sharded and communicator is not None:
            # One exchange before any group is created: a rank that could not build its
            # program, or built another one, fails with its peers instead of leaving
            # them waiting in a collective it never posts.
            plan = None if failure else self.program.communication_plan()
            communicator.agree(failure, "building the program", plan)
        elif failure is not None:
            raise failure
        if communicator is not None:
            communicator.prepare(team for c in self.program.communications for team in c.teams())
        self._symmetric: SymmetricBuffers | None = None
        self._streams = StreamPool(self.device)
        self.hardware_profile = current_hardware(self.device)
        self._last_bindings: Bindings | None = None
        self._last_buffers: list[tuple | None] = []  # by rank, at the last checked run
        self._own_buffers: tuple | None = None
        self._compiled: dict[tuple, _Compiled] = {}
        self.cuda_graph = cuda_graph
        self._graphs: dict[tuple, tuple] = {}

    def _build(self, fusion: Fusion, options, hardware, cuda_graph, kernels, kernel_params):
        """Everything a rank works out alone: layouts, the overlap plan, the program."""
        if not fusion.finalized:
            raise ShardingError("finish the fusion definition (leave its `with` block) first")
        if self.sharded:
            if self.communicator is None:
                raise ShardingError("a fusion placed on device meshes needs a Communicator")
            self.fusion, self.decisions = shard_fusion(fusion)
            self._check_meshes_fit_the_world()
            check_packed_pieces(self.fusion, {}, ShardingError)
        else:
            self.fusion, self.decisions = fusion.clone(), {}
        self.hardware = hardware or default_hardware_figures(self.device)
        replayed = cuda_graph and self.device.type == "cuda"
        self.overlap = plan_overlap(self.fusion, self.hardware, options, replayed)
        if kernels not in ("auto", "generated", "reference"):
            raise ValueError(f"kernels must be auto, generated or reference, got {kernels!r}")
        if kernels == "generated" and self.device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "generated kernels on CPU run in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before starting Python"
                )
        generated = kernels == "generated" or (kernels == "auto" and self.device.type == "cuda")
        self.kernel_params = dict(kernel_params or {})
        self.chosen_params: dict[str, object] = {}
        # kernel name -> the forms() of each launcher built for it (one per set of shapes)
        self.kernel_forms: dict[str, list] = {}
        self.program: HostProgram = lower_to_host_program(self.fusion, schedule=generated)
        self._check_transports()
        # kernels="auto" off CUDA evaluates instead of generating: the params a user tuned
        # for the generated kernels are checked against those, and left unused here
        self._check_kernel_params(
            self.program
            if generated or kernels != "auto" or not self.kernel_params
            else lower_to_host_program(self.fusion, schedule=True)
        )
        self.fingerprint = self.program.fingerprint()

    def _check_meshes_fit_the_world(self) -> None:
        world = self.communicator.world_size
        for tensor in self.fusion.tensors:
            too_large = [r for r in tensor.mesh.ranks if r >= world]
            if too_large:
                raise ShardingError(
                    f"{tensor} is placed on {tensor.mesh}, but the world has {world} ranks "
                    f"(0..{world - 1}); rank {too_large[0]} does not exist"
                )

    def _check_kernel_params(self, program: HostProgram) -> None:
        """Every kernel named in ``kernel_params`` is a generated kernel of ``program``,
        and a strategy named there is one its kernel's scheduler has."""
        kernels = {i.name: i for i in walk(program.instructions)
                   if isinstance(i, LaunchKernel) and i.scheduler is not None}  # fmt: skip
        for name, override in self.kernel_params.items():
            kernel = kernels.get(name)
            if kernel is None:
                raise ValueError(
                    f"kernel_params[{name!r}] = {override!r}: this program has no generated "
                    f"kernel {name!r} (generated: {sorted(kernels) or 'none'}; see "
                    "print(executor.program))"
                )
            if not isinstance(override, str):
                continue
            strategies = getattr(kernel.scheduler, "strategies", ())
            if override not in strategies:
                raise ValueError(
                    f"kernel_params[{name!r}] = {override!r}: the {kernel.scheduler.name} "
                    f"scheduler's strategies are {list(strategies)}"
                )

    def _check_transports(self) -> None:
        for instruction in walk(self.program.instructions):
            if isinstance(instruction, Communicate) and instruction.transport == "copy_engine":
                if self.device.type != "cuda":
                    raise ShardingError(
                        f"{instruction.name}: the copy_engine transport needs CUDA devices with "
                        f"symmetric memory; this rank runs on {self.device}. Use collective or ring"
                    )

    # -----------------------------------------------------------------------
    # What users and tests need around a run

    def explain(self) -> str:
        """Which rule placed each tensor (see ``sharding.explain``)."""
        return explain(self.fusion, self.decisions)

    def kernel_report(self) -> str:
        """Each generated kernel's scheduler and launch configuration (after a first run)."""
        lines = []
        for instruction in walk(self.program.instructions):
            if isinstance(instruction, LaunchKernel) and instruction.scheduler is not None:
                params = self.chosen_params.get(instruction.name, "(not run yet)")
                line = f"{instruction.name} [{instruction.backend}] {params}"
                launchers = self.kernel_forms.get(instruction.name, [])
                forms = {form for forms_of in launchers for form in forms_of()}
                if forms:
                    line += f" form: {', '.join(sorted(forms))}"
                lines.append(line)
        return "\n".join(lines) or "no generated kernels"

    def explain_overlap(self) -> str:
        """The planner's choices, with reasons and predicted times."""
        if not self.overlap:
            return "no all-gather+matmul or matmul+reduce-scatter to overlap"
        return "\n".join(str(decision) for decision in self.overlap)

    @property
    def communications(self) -> list:
        return self.program.communications

    def input_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.inputs]

    def output_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.outputs]

    def shard_inputs(self, full_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs (None where an input is not on this rank)."""
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_inputs, self.fusion.inputs, strict=True)
        ]

    def shard_outputs(self, full_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs: what ``run`` should return here."""
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_outputs, self.fusion.outputs, strict=True)
        ]

    def gather_outputs(self, local_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The whole outputs, assembled from every rank's pieces (collective: call on all ranks).

        Pieces travel through ``all_gather_object`` (host memory): meant for checking and
        small results, not for the hot path.
        """
        if not self.sharded:
            return list(local_outputs)
        cpu = [None if t is None else t.cpu() for t in local_outputs]
        everyone = restored(self.communicator.all_gather_object(portable(cpu)))
        return [
            assemble({rank: pieces[position] for rank, pieces in enumerate(everyone)}, tensor).to(
                self.device
            )
            for position, tensor in enumerate(self.fusion.outputs)
        ]

    # -----------------------------------------------------------------------
    # Running

    def run(
        self,
        local_inputs: Sequence[torch.Tensor | None],
        timeline: Timeline | None = None,
        check_inputs: bool = True,
    ) -> list[torch.Tensor | None]:
        """Run the program on this rank; returns this rank's output pieces (None off-mesh).

        With a ``timeline``, every kernel and communication is recorded per stream.
        ``check_inputs`` exchanges every rank's input shapes first (one small host-side
        all-gather) so a bad input fails everywhere before any collective; a hot loop
        that has checked its shapes once may turn it off (then the shapes must stay).
        """
        replay = self.cuda_graph and timeline is None and self.device.type == "cuda"
        # A graph is captured per set of input buffers, and capturing runs the program
        # once more: every rank must capture at the same runs, so the graphs are keyed by
        # every rank's buffers, learnt in the input check.
        buffers = _addresses(local_inputs) if replay else None
        if not check_inputs and self._last_bindings is not None:
            bindings = self._last_bindings
            if buffers is not None and buffers != self._own_buffers:
                raise InputError(
                    "cuda_graph=True and check_inputs=False: this rank's inputs are not in "
                    "the buffers of the last checked run. A new graph must be captured on "
                    "every rank at once, which only the input check can arrange: run with "
                    "check_inputs=True when the inputs move"
                )
        elif self.sharded:
            bindings, self._last_buffers = self._check_inputs(local_inputs, buffers)
        else:
            _describe_inputs(local_inputs, len(self.fusion.inputs), self.device)
            bindings, self._last_buffers = bind_inputs(self.fusion, list(local_inputs)), [buffers]
        self._last_bindings, self._own_buffers = bindings, buffers
        if self._uses_copy_engine() and self._symmetric is None:
            self._symmetric = SymmetricBuffers(self.communicator)
        if self._symmetric is not None:
            self._symmetric.next_run()
        key = tuple(sorted((symbol.name, value) for symbol, value in bindings.items()))
        if key not in self._compiled:
            self._compiled[key] = self._compile_on_every_rank(bindings)
        compiled = self._compiled[key]
        with torch.no_grad():  # no autograd graph: its gradients would be one rank's
            if replay:
                outputs = self._replay(compiled, (key, tuple(self._last_buffers)), local_inputs)
            else:
                outputs = compiled.run(local_inputs, timeline)
        return _refusing_backward(outputs, local_inputs)

    def _replay(self, compiled: _Compiled, key: tuple, local_inputs) -> list:
        """Run through a CUDA graph captured for these extents and every rank's input
        buffers (``key``: the same on every rank), one per symmetric buffer half."""
        parity = self._symmetric.parity if self._symmetric is not None else 0
        graph_key = (key, parity)
        if graph_key not in self._graphs:
            compiled.run(local_inputs, None)  # warm up: handles, allocations
            graph = torch.cuda.CUDAGraph()
            # No garbage collection while capturing: freeing an unreachable executor's
            # symmetric memory then would be a CUDA call the capture forbids.
            gc.collect()
            gc.disable()
            try:
                with torch.cuda.graph(graph):
                    outputs = compiled.run(local_inputs, None)
            finally:
                gc.enable()
            if len(self._graphs) >= 8:  # inputs keep moving: drop the oldest graphs
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[graph_key] = (graph, outputs)
        graph, outputs = self._graphs[graph_key]
        graph.replay()
        return list(outputs)

    def _compile_on_every_rank(self, bindings: Bindings) -> _Compiled:
        """This rank's program for these extents; in a sharded run the ranks agree on the
        outcome first (a heuristic refusing one rank's local shapes, say), so that a rank
        that cannot build its program fails with its peers, not alone while they wait."""
        try:
            compiled, failure = _Compiled(self, bindings), None
        except Exception as error:  # reported to the peers, then raised here
            compiled, failure = None, error
        if self.sharded:
            self.communicator.agree(failure, "preparing the run")
        elif failure is not None:
            raise failure
        if self._symmetric is not None:  # collective: only once every rank is ready
            compiled.allocate_symmetric()
        return compiled

    def _uses_copy_engine(self) -> bool:
        return any(
            isinstance(i, Communicate) and i.transport == "copy_engine"
            for i in walk(self.program.instructions)
        )

    def ctx_local_shape(self, tensor: TensorView) -> list[int]:
        """This rank's shape of ``tensor`` when every extent is static."""
        return self.local_shape(tensor, {})

    def local_shape(self, tensor: TensorView, bindings: Bindings) -> list[int]:
        shape = [resolve(e, bindings) for e in tensor.shape]
        layout = layout_of(tensor)
        return shape if layout is None else local_shape(layout, self.rank, shape)

    def holds(self, mesh: DeviceMesh | None) -> bool:
        """Whether this rank runs what is placed on ``mesh`` (None: everywhere)."""
        return mesh is None or self.rank in mesh

    # -----------------------------------------------------------------------
    # Input checks, the same verdict on every rank

    def _check_inputs(
        self, local_inputs: Sequence[torch.Tensor | None], buffers: tuple | None
    ) -> tuple[Bindings, list]:
        """Bind the extents from every rank's inputs, checked on every rank alike; also
        every rank's input buffers (for its CUDA graphs)."""
        try:
            described = _describe_inputs(local_inputs, len(self.fusion.inputs), self.device)
        except InputError as error:
            described = str(error)
        everyone = self.communicator.all_gather_object((self.fingerprint, described, buffers))
        if any(fingerprint != self.fingerprint for fingerprint, _, _ in everyone):
            # the ranks run different programs (rank 0 one executor, rank 1 another)
            self.communicator.agree(None, "run", self.program.communication_plan())
        for rank, (_, description, _) in enumerate(everyone):
            if isinstance(description, str):
                raise InputError(f"rank {rank}: {description}")
        descriptions = [description for _, description, _ in everyone]
        return check_local_inputs(self.fusion, descriptions), [b for _, _, b in everyone]


class _Compiled:
    """The host program specialized for this rank and these extents: a flat list of steps.

    Loops are unrolled; everything that does not change from run to run (which ranks
    take part, chunk offsets, groups, peers' buffers, streams) is worked out here once,
    so a run only launches work. Each run gets fresh buffers.
    """

    def __init__(self, executor: MultiDeviceExecutor, bindings: Bindings) -> None:
        self.executor = executor
        self.rank = executor.rank
        self.values: dict[TensorView, torch.Tensor | None] = {}
        self.pending: dict[tuple[Communicate, int | None], Pending] = {}
        self.tokens: dict[tuple[Communicate, int | None], int] = {}
        self.saved_streams: dict[str, object] = {}
        self.timeline: Timeline | None = None
        self.streams = executor._streams
        self.shapes: dict[TensorView, list[int]] = {}
        self.ctx = RankContext(
            self.rank,
            executor.communicator,
            lambda t: [resolve(e, bindings) for e in t.shape],
            self.local_shape,
            _storage_dtype,
            executor.device,
        )
        self.bindings = bindings
        self.pipelined = PipelinedComms(self.ctx, executor._symmetric)
        self.steps: list = []
        self._compile(executor.program.instructions, None)

    def _slot(self, tensor: TensorView, loop):
        """Where a tensor's value lives: a chunk tensor has one value per iteration."""
        if loop is not None and tensor.fusion is not self.executor.fusion:
            return (tensor, loop[1])
        return tensor

    def local_shape(self, tensor: TensorView) -> list[int]:
        if tensor not in self.shapes:
            self.shapes[tensor] = self.executor.local_shape(tensor, self.bindings)
        return self.shapes[tensor]

    # -- running ---------------------------------------------------------------

    def run(self, local_inputs, timeline: Timeline | None) -> list[torch.Tensor | None]:
        executor = self.executor
        self.values = {}
        self.timeline = timeline
        for tensor, value in zip(executor.fusion.inputs, local_inputs, strict=True):
            if executor.holds(tensor.mesh):
                # fp4 stays packed, two values per byte, between kernels.
                self.values[tensor] = value.view(torch.uint8) if _is_fp4(tensor) else value
        for step in self.steps:
            step()
        outputs: list[torch.Tensor | None] = []
        for tensor in executor.fusion.outputs:
            if not executor.holds(tensor.mesh):
                outputs.append(None)
                continue
            value = self.values[tensor]
            value = value.contiguous()
            outputs.append(value.view(torch.float4_e2m1fn_x2) if _is_fp4(tensor) else value)
        self.values = {}
        return outputs

    def _lane(self, loop, kind: str) -> str:
        return f"stream {loop[1] % self.streams.count} {kind}" if loop else f"main {kind}"

    # -- compiling -------------------------------------------------------------

    def _compile(self, instructions: list, loop) -> None:
        for instruction in instructions:
            if isinstance(instruction, ForLoop):
                for iteration in range(instruction.scheme.num_chunks):
                    self._compile(instruction.body, (instruction.scheme, iteration))
                self.steps.append(self.pipelined.drain)
                continue
            compile_step = getattr(self, f"_{type(instruction).__name__}")
            step = compile_step(instruction, loop)
            if step is not None:
                self.steps.append(step)

    def _Allocate(self, instruction: Allocate, loop):
        # Allocated before the loop, on the user's stream: a buffer first touched inside
        # a loop would belong to a side stream, and the allocator could hand it out again
        # before the user's stream is done with it.
        tensor = instruction.tensor
        if not self.executor.holds(tensor.mesh):
            return None
        shape = _storage_shape(tensor, self.local_shape(tensor))
        dtype, device = _storage_dtype(tensor), self.ctx.device

        def allocate() -> None:
            self.values[tensor] = torch.empty(shape, dtype=dtype, device=device)

        return allocate

    def _Deallocate(self, instruction: Deallocate, loop):
        return lambda: self.values.pop(instruction.tensor, None)

    def _GetCurrentStream(self, instruction: GetCurrentStream, loop):
        if not self.streams.cuda:
            return None
        return lambda: self.saved_streams.__setitem__(instruction.name, self.streams.current())

    def _SetCurrentStream(self, instruction: SetCurrentStream, loop):
        if not self.streams.cuda:
            return None
        if instruction.stream.saved:
            name = instruction.stream.saved
            return lambda: self.streams.set(self.saved_streams[name])
        stream = self.streams.get(loop[1])
        return lambda: self.streams.set(stream)

    def _Synchronize(self, instruction: Synchronize, loop):
        if not self.streams.cuda:
            return None
        if instruction.stream.saved:
            name = instruction.stream.saved
            return lambda: self.streams.wait(self.saved_streams[name])
        stream = self.streams.get(loop[1])
        return lambda: self.streams.wait(stream)

    def _AliasSelect(self, instruction: AliasSelect, loop):
        source, result, dim = instruction.source, instruction.result, instruction.dim
        if not self.executor.holds(source.mesh):
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
        if _is_fp4(source) and dim == source.ndim - 1:
            if offset % 2 or size % 2:
                raise ShardingError(
                    f"chunk {chunk} of {source} along its innermost axis starts or ends inside "
                    "a byte of packed fp4 values; choose a chunk count that keeps pieces even"
                )
            offset, size = offset // 2, size // 2

        def select() -> None:
            self.values[result] = self.values[source].narrow(dim, offset, size)

        return select

    def _LaunchKernel(self, kernel: LaunchKernel, loop):
        if not self.executor.holds(kernel.mesh):
            return None
        aliases = {t: self._slot(chunk, loop) for t, chunk in kernel.aliases.items()}
        evaluated = [self._compile_expr(expr, aliases) for expr in kernel.exprs]
        if kernel.scheduler is None or self._holds_an_empty_piece(kernel.plan):
            # an empty piece (fewer rows than ranks) has nothing to launch a kernel over;
            # the evaluator gives its partial results the identity
            computes = evaluated
        else:
            computes = [self._compile_generated(kernel, aliases, evaluated, loop is None)]
        lane = self._lane(loop, "compute")

        def launch() -> None:
            if self.timeline is None:
                for compute in computes:
                    compute()
                return
            with self.timeline.span(lane, kernel.name):
                for compute in computes:
                    compute()

        return launch

    def _holds_an_empty_piece(self, plan) -> bool:
        return any(0 in self.local_shape(t) for t in [*plan.inputs, *plan.outputs])

    def _compile_generated(self, kernel: LaunchKernel, aliases: dict[TensorView, object],
                           evaluated: list, warm_up: bool) -> object:  # fmt: skip
        """A generated kernel: heuristics (or the user's override) pick its params now.

        ``evaluated`` computes the same with the evaluator: taken for an empty chunk. With
        ``warm_up`` (a kernel outside chunk loops) a CUDA kernel is compiled now."""
        executor = self.executor
        scheduler, plan = kernel.scheduler, kernel.plan
        hardware = executor.hardware_profile
        override = executor.kernel_params.get(kernel.name)
        if isinstance(override, str):  # a strategy, forced
            params = scheduler.configure(plan, hardware, self.local_shape, strategy=override)
        else:
            params = override or scheduler.configure(plan, hardware, self.local_shape)
        launch = scheduler.launcher(plan, params, hardware, self.local_shape)
        executor.chosen_params[kernel.name] = params
        executor.kernel_forms.setdefault(kernel.name, []).append(launch.forms)
        device = self.ctx.device
        # the first launch compiles the kernel (Triton's JIT): with progress on, say so
        # and wait for it, so the time printed is the compile's
        unannounced = progress.enabled()
        if warm_up and device.type == "cuda":
            self._warm_up(kernel, launch)
            unannounced = False

        def run() -> None:
            nonlocal unannounced
            inputs = [self.values[aliases.get(t, t)].contiguous() for t in plan.inputs]
            if any(value.numel() == 0 for value in inputs):
                for compute in evaluated:
                    compute()
                return
            targets = []
            for tensor in plan.outputs:
                destination = self.values.get(aliases[tensor]) if tensor in aliases else None
                if destination is None or not destination.is_contiguous():
                    shape = _storage_shape(tensor, self._logical_shape_of(tensor, destination))
                    targets.append(torch.empty(shape, dtype=_storage_dtype(tensor), device=device))
                else:
                    targets.append(destination)
            shapes = {t: _logical_shape(t, v) for t, v in zip(plan.inputs, inputs, strict=True)}
            shapes.update(
                {t: _logical_shape(t, v) for t, v in zip(plan.outputs, targets, strict=True)}
            )
            if unannounced:
                unannounced = False
                with progress.step(f"rank {executor.rank}: compiling {kernel.name} "
                                   f"[{scheduler.name}]"):  # fmt: skip
                    launch(inputs, targets, shapes)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
            else:
                launch(inputs, targets, shapes)
            for tensor, target in zip(plan.outputs, targets, strict=True):
                key = aliases.get(tensor, tensor)
                destination = self.values.get(key) if tensor in aliases else None
                if destination is not None and destination is not target:
                    destination.copy_(target)
                else:
                    self.values[key] = target

        return run

    def _warm_up(self, kernel: LaunchKernel, launch) -> None:
        """Launch ``kernel`` once on zeros of this rank's shapes, so that Triton compiles
        it now, while the ranks can still agree that the run may start: a kernel the
        device refuses on one rank (its resources at its local shapes) then fails every
        rank before any collective, not this rank alone in the middle of the run."""
        plan, device = kernel.plan, self.ctx.device
        shapes = {t: self.local_shape(t) for t in [*plan.inputs, *plan.outputs]}

        def zeros(tensor: TensorView) -> torch.Tensor:
            shape = _storage_shape(tensor, shapes[tensor])
            return torch.zeros(shape, dtype=_storage_dtype(tensor), device=device)

        with progress.step(f"rank {self.rank}: compiling {kernel.name} [{kernel.scheduler.name}]"):
            launch([zeros(t) for t in plan.inputs], [zeros(t) for t in plan.outputs], shapes)
            torch.cuda.synchronize(device)

    def _logical_shape_of(self, tensor: TensorView, destination) -> list[int]:
        if destination is not None:
            return _logical_shape(tensor, destination)
        return self.local_shape(tensor)

    def _compile_expr(self, expr: Expr, aliases: dict[TensorView, object]):
        values = self  # read through self.values: it is replaced on every run

        def read(tensor: TensorView) -> torch.Tensor:
            return values.values[aliases.get(tensor, tensor)]

        outputs = [(out, aliases.get(out, out), out in aliases) for out in expr.outputs]
        if isinstance(expr, LocalShard):
            (source,) = expr.inputs
            coordinate = expr.mesh.coords(self.rank)[expr.mesh_axis]
            extent = self.local_shape(source)[expr.dim]
            offset, size = split_range(extent, expr.mesh.shape[expr.mesh_axis], coordinate)
            ((_, key, _),) = outputs

            def shard_locally() -> None:
                whole = _unpacked(source, read(source))
                piece = whole.narrow(expr.dim, offset, size).contiguous()
                values.values[key] = _packed(source, piece)

            return shard_locally
        if _partial_extreme(expr):
            ((out, key, _),) = outputs
            dims = expr.dims
            evaluate_nonempty = self._compile_expr_plain(expr, aliases)

            def extreme() -> None:
                value = read(expr.inputs[0])
                if all(value.shape[d] > 0 for d in dims):
                    evaluate_nonempty()
                    return
                # this rank's piece of the reduced axis is empty: the identity, which
                # leaves the other ranks' partial results as they are
                shape = [e for d, e in enumerate(value.shape) if d not in dims]
                empty = torch.empty(shape, dtype=_storage_dtype(out), device=self.ctx.device)
                values.values[key] = identity(empty, expr.op_name)

            return extreme
        return self._compile_expr_plain(expr, aliases)

    def _compile_expr_plain(self, expr: Expr, aliases: dict[TensorView, object]):
        values = self

        def read(tensor: TensorView) -> torch.Tensor:
            return values.values[aliases.get(tensor, tensor)]

        outputs = [(out, aliases.get(out, out), out in aliases) for out in expr.outputs]
        if isinstance(expr, (MatmulOp, LinearOp)):
            ((_, key, into_chunk),) = outputs

            def contract() -> None:
                destination = values.values.get(key) if into_chunk else None
                result = _contract(expr, read, destination)
                if destination is None:
                    values.values[key] = result
                elif result.data_ptr() != destination.data_ptr():
                    destination.copy_(result)

            return contract

        def evaluate() -> None:
            # The reference evaluator holds fp4 unpacked, one code per byte.
            local = {t: _unpacked(t, read(t)) for t in expr.inputs}
            destinations = {out: values.values.get(key) for out, key, chunk in outputs if chunk}

            def shape_of(tensor: TensorView) -> list[int]:
                if tensor in local:
                    return list(local[tensor].shape)
                destination = destinations.get(tensor)
                if destination is not None and not _is_fp4(tensor):
                    return list(destination.shape)
                if destination is not None:
                    return list(destination.shape[:-1]) + [2 * destination.shape[-1]]
                return self.local_shape(tensor)

            evaluate_expr(expr, local, shape_of)
            for out, key, into_chunk in outputs:
                result = _packed(out, local[out])
                if into_chunk and destinations[out] is not None:
                    destinations[out].copy_(result)
                else:
                    values.values[key] = result

        return evaluate

    def _Communicate(self, instruction: Communicate, loop):
        comm = instruction.communication
        if self.executor.communicator is None or self.rank not in comm.participants():
            return None
        source, target = self._slot(instruction.source, loop), self._slot(instruction.target, loop)
        lane = self._lane(loop, "comm")
        if loop is not None:
            transfer = self.pipelined.prepare(instruction, *loop)

            def post() -> Pending:
                return transfer(self.values.get(source), self.values.get(target))

        elif _is_fp4(comm.output):
            # Collectives move fp4 unpacked (one value per byte), then pack it again.
            def post() -> Pending:
                value = self.values.get(source)
                pending = start(comm, None if value is None else unpack_fp4(value), self.ctx)
                finish = pending.finish
                pending.finish = lambda: _packed(comm.output, finish())
                return pending

        else:

            def post() -> Pending:
                return start(comm, self.values.get(source), self.ctx)

        key = (instruction, loop[1] if loop else None)

        def communicate() -> None:
            if self.timeline is not None:
                self.tokens[key] = self.timeline.start(lane, instruction.name)
            self.pending[key] = post()

        return communicate

    def _Wait(self, instruction: Wait, loop):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.executor.communicator is None or self.rank not in comm.participants():
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

        return wait

    def _StageForPeers(self, instruction: StageForPeers, loop):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.rank not in comm.participants():
            return None
        symmetric = self.executor._symmetric
        return lambda: symmetric.stage(communicate, self.values[comm.inputs[0]])

    def _CombineStaged(self, instruction: CombineStaged, loop):
        communicate = instruction.communicate
        comm = communicate.communication
        if self.rank not in comm.participants():
            return None
        symmetric = self.executor._symmetric
        return lambda: symmetric.combine(communicate, self.values[comm.output])

    def allocate_symmetric(self) -> None:
        for loop in self.executor.program.instructions:
            if not isinstance(loop, ForLoop):
                continue
            for instruction in loop.body:
                if not isinstance(instruction, Communicate):
                    continue
                if instruction.transport != "copy_engine":
                    continue
                comm = instruction.communication
                dim = comm.split_dim
                moving = comm.inputs[0]
                shape = self.local_shape(moving)
                whole = self.ctx.global_shape(comm.output)[dim]
                rest = shape[:dim] + shape[dim + 1 :]
                self.executor._symmetric.allocate(
                    instruction, loop.scheme, whole, dim, rest, _storage_dtype(moving)
                )


class _NoBackward(torch.autograd.Function):
    """Stands between a run's outputs and its inputs in autograd: ``backward`` raises."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "MultiDeviceExecutor.run has no backward yet: gradients through a run (whose "
            "compute is split over ranks, and partly in generated kernels) are not "
            "computed, and one rank's partial gradient would be wrong. Differentiate the "
            "single-device fd.execute, or run the forward under torch.no_grad()"
        )


_DIFFERENTIABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _refusing_backward(outputs: list, inputs: Sequence) -> list:
    """``outputs``, tied to the inputs that require a gradient so that a backward raises
    a clear error instead of giving no gradient or one rank's partial one."""
    wanting = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanting or not torch.is_grad_enabled():
        return outputs
    return [
        _NoBackward.apply(out, *wanting)
        if out is not None and out.dtype in _DIFFERENTIABLE
        else out
        for out in outputs
    ]


def _partial_extreme(expr: Expr) -> bool:
    """A max or min over an axis split across ranks (its result a partial max/min)."""
    if not isinstance(expr, ReductionOp) or expr.op_name not in ("max", "min"):
        return False
    layout = layout_of(expr.output)
    return layout is not None and layout.is_partial


def _contract(expr: Expr, read, out: torch.Tensor | None) -> torch.Tensor:
    """A matmul or linear through cuBLAS (natively in its dtype, fp32 accumulation)."""
    if isinstance(expr, MatmulOp):
        a, b = (read(t) for t in expr.inputs)
        if out is not None and out.is_contiguous() and a.dim() == 2 and b.dim() == 2:
            return torch.mm(a, b, out=out)
        return torch.matmul(a, b)
    x, weight, *bias = (read(t) for t in expr.inputs)
    if out is not None and out.is_contiguous() and x.dim() == 2:
        if bias:
            return torch.addmm(bias[0], x, weight.t(), out=out)
        return torch.mm(x, weight.t(), out=out)
    return torch.nn.functional.linear(x, weight, bias[0] if bias else None)


def _is_fp4(tensor: TensorView) -> bool:
    return tensor.dtype is float4_e2m1


def _storage_dtype(tensor: TensorView) -> torch.dtype:
    """The torch dtype a rank holds a tensor in between kernels (fp4: bytes)."""
    return torch.uint8 if _is_fp4(tensor) else tensor.dtype.torch_dtype


def _logical_shape(tensor: TensorView, value: torch.Tensor) -> list[int]:
    """The logical shape of a held value (packed fp4 holds two values per byte)."""
    shape = list(value.shape)
    return shape[:-1] + [2 * shape[-1]] if _is_fp4(tensor) else shape


def _storage_shape(tensor: TensorView, shape: list[int]) -> list[int]:
    """The storage shape of a logical shape: packed fp4 halves the innermost extent."""
    return shape[:-1] + [shape[-1] // 2] if _is_fp4(tensor) else shape


def _unpacked(tensor: TensorView, value: torch.Tensor | None) -> torch.Tensor | None:
    """fp4 bytes as one code per value (what the reference evaluator computes with)."""
    return unpack_fp4(value) if value is not None and _is_fp4(tensor) else value


def _packed(tensor: TensorView, value: torch.Tensor | None) -> torch.Tensor | None:
    """fp4 codes packed two per byte (how kernels and buffers hold fp4)."""
    if value is None or not _is_fp4(tensor):
        return value
    return pack_fp4(value).view(torch.uint8)


def _addresses(local_inputs: Sequence[torch.Tensor | None]) -> tuple[int, ...]:
    return tuple(t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in local_inputs)


def _describe_inputs(
    local_inputs: Sequence[torch.Tensor | None], count: int, device: torch.device
) -> list[tuple[list[int], str] | None]:
    if not isinstance(local_inputs, (list, tuple)):
        raise InputError(f"local inputs must be a list, got {type(local_inputs).__name__}")
    if len(local_inputs) != count:
        raise InputError(f"the fusion takes {count} inputs, got {len(local_inputs)}")
    described = []
    for position, value in enumerate(local_inputs):
        if value is None:
            described.append(None)
        elif isinstance(value, torch.Tensor):
            if value.device.type != device.type or (
                device.index is not None and value.device.index != device.index
            ):
                raise InputError(
                    f"input {position}: on {value.device}, but this rank runs on {device}"
                    + (" (meta tensors hold no values to run on)" if value.is_meta else "")
                )
            described.append((list(value.shape), str(value.dtype)))
        else:
            raise InputError(
                f"input {position}: expected a torch.Tensor or None, got {type(value).__name__}"
            )
    return described


def check_local_inputs(fusion: Fusion, everyone: list[list]) -> Bindings:
    """Check every rank's described inputs (shape, dtype per input) and bind the symbols.

    A symbolic extent split over a mesh axis is the sum of the pieces along that axis.
    Raises ``InputError`` naming the rank, the input and the mismatch.
    """
    bindings: Bindings = {}
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        where = f"input {position} ({tensor})"
        expected_dtype = str(tensor.dtype.torch_dtype)
        shapes: dict[int, list[int]] = {}
        for rank in tensor.mesh.ranks:
            entry = everyone[rank][position]
            if entry is None:
                raise InputError(f"rank {rank}: {where} is on this rank but got None")
            shape, dtype = entry
            if dtype != expected_dtype:
                raise InputError(
                    f"rank {rank}: {where}: expected dtype {expected_dtype}, got {dtype}"
                )
            if len(shape) != tensor.ndim:
                raise InputError(
                    f"rank {rank}: {where}: expected rank {tensor.ndim}, got shape {shape}"
                )
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            shapes[rank] = shape
        _bind_symbols(tensor, layout, shapes, bindings, where)
    for constraint in fusion.constraints:
        _check_constraint(constraint, bindings)
    check_packed_pieces(fusion, bindings, InputError)
    _check_extremes_have_values(fusion, bindings)
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        whole = [resolve(e, bindings) for e in tensor.shape]
        for rank in tensor.mesh.ranks:
            shape, _ = everyone[rank][position]
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            expected = local_shape(layout, rank, whole)
            if list(shape) != expected:
                raise InputError(
                    f"rank {rank}: input {position} ({tensor}) placed {layout}: expected the "
                    f"local shape {expected} (of the whole {whole}), got {list(shape)}"
                )
    return bindings


def check_packed_pieces(fusion: Fusion, bindings: Bindings, error: type[Exception]) -> None:
    """Every rank's piece of a packed tensor (fp4, two values a byte) split along its
    innermost axis must fill whole bytes; else ``error``, the same verdict on every rank.
    Extents still unbound (symbols before the inputs come) are checked when they are."""
    for tensor in fusion.tensors:
        layout = layout_of(tensor)
        if not tensor.dtype.is_packed or layout is None:
            continue
        innermost = tensor.ndim - 1
        mesh_axis = layout.mesh_axis_of(innermost)
        extent = tensor.shape[innermost]
        if mesh_axis is None or (isinstance(extent, Symbol) and extent not in bindings):
            continue
        extent = resolve(extent, bindings)
        pieces = split_sizes(extent, layout.mesh.shape[mesh_axis])
        per_byte = tensor.dtype.values_per_storage_element
        if any(piece % per_byte for piece in pieces):
            raise error(
                f"{tensor} holds {tensor.dtype} packed {per_byte} values a byte, and its "
                f"innermost axis ({extent} values) is split over mesh axis "
                f"{layout.mesh.axis_names[mesh_axis]!r} into pieces of {pieces} values: a piece "
                f"must fill whole bytes. Make the extent split into multiples of {per_byte} "
                "or split another axis"
            )


def _check_extremes_have_values(fusion: Fusion, bindings: Bindings) -> None:
    """A max or min over an axis that is empty on every rank has no value (the reference
    refuses it too); a piece empty on some ranks only is fine (the identity there)."""
    for expr in fusion.exprs:
        if not isinstance(expr, ReductionOp) or expr.op_name not in ("max", "min"):
            continue
        source = expr.inputs[0]
        empty = [d for d in expr.dims if resolve(source.shape[d], bindings) == 0]
        if empty:
            raise InputError(
                f"{expr.op_name} over axis {empty[0]} of {source}, which is empty (extent 0 "
                f"with these inputs): a {expr.op_name} of no values has none"
            )


def _bind_symbols(
    tensor: TensorView, layout: Layout, shapes: dict[int, list[int]], bindings: Bindings, where: str
) -> None:
    for dim, extent in enumerate(tensor.shape):
        if not isinstance(extent, Symbol):
            continue
        mesh_axis = layout.mesh_axis_of(dim)
        first = tensor.mesh.ranks[0]
        if mesh_axis is None:
            value = shapes[first][dim]
        else:
            value = sum(shapes[r][dim] for r in tensor.mesh.team(first, mesh_axis))
        if extent in bindings and bindings[extent] != value:
            raise InputError(
                f"{where}: axis {dim} is {value} in all, but symbol {extent} is already "
                f"{bindings[extent]}"
            )
        bindings[extent] = value


def _check_constraint(constraint: ExtentConstraint, bindings: Bindings) -> None:
    lhs, rhs = resolve(constraint.lhs, bindings), resolve(constraint.rhs, bindings)
    if not constraint.holds(lhs, rhs):
        raise InputError(
            f"extents violate {constraint.lhs} {constraint.relation} {constraint.rhs} "
            f"({lhs} vs {rhs}), required by {constraint.reason}"
        )
