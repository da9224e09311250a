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

from collections.abc import Sequence

import torch

from fusion.definition import FusionDefinition
from fusion.dtypes import float4_e2m1
from fusion.errors import InputError
from fusion.exprs import Expr, LinearOp, MatmulOp
from fusion.fp4 import pack_fp4, unpack_fp4
from fusion.ir import ExtentConstraint, Fusion, Symbol, TensorView
from fusion.reference import Bindings, bind_inputs, evaluate_expr, resolve
from overlap.communications import Pending, RankContext, start
from overlap.communicator import Communicator
from overlap.host_ir import (
    AliasSelect,
    Allocate,
    ChunkScheme,
    CombineStaged,
    Communicate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    StreamRef,
    Synchronize,
    Wait,
    walk,
)
from overlap.lowering import lower_to_host_program
from overlap.pipelined import PipelinedComms, chunk_rows, place, split_dim
from overlap.planner import (
    HardwareFigures,
    OverlapOptions,
    default_hardware_figures,
    plan_overlap,
)
from overlap.streams import StreamPool
from overlap.symmetric import SymmetricBuffers
from overlap.timeline import Timeline
from sharding.communication import LocalShard
from sharding.errors import ShardingError
from sharding.layout import Layout, Shard, layout_of, local_shape, split_range
from sharding.mesh import DeviceMesh
from sharding.propagation import explain
from sharding.resharding import shard_fusion


class MultiDeviceExecutor:
    """Runs ``fusion`` on this rank as part of every rank running it.

    A fusion with no tensor placed on a mesh runs whole on one device (the
    communicator may then be None). ``options`` override the overlap planner and
    ``hardware`` feeds its cost model (by default the recorded figures of this
    device kind).
    """

    def __init__(
        self,
        fusion: Fusion | FusionDefinition,
        communicator: Communicator | None = None,
        options: OverlapOptions | None = None,
        hardware: HardwareFigures | None = None,
    ) -> None:
        fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
        if not fusion.finalized:
            raise ShardingError("finish the fusion definition (leave its `with` block) first")
        self.communicator = communicator
        self.rank = communicator.rank if communicator else 0
        self.device = communicator.device if communicator else torch.device("cpu")
        self.sharded = any(t.mesh is not None for t in fusion.tensors)
        if self.sharded:
            if communicator is None:
                raise ShardingError("a fusion placed on device meshes needs a Communicator")
            self.fusion, self.decisions = shard_fusion(fusion)
            self._check_meshes_fit_the_world()
        else:
            self.fusion, self.decisions = fusion.clone(), {}
        self.hardware = hardware or default_hardware_figures(self.device)
        self.overlap = plan_overlap(self.fusion, self.hardware, options)
        self.program: HostProgram = lower_to_host_program(self.fusion)
        self._check_transports()
        if communicator is not None:
            communicator.prepare(team for c in self.program.communications for team in c.teams())
        self._symmetric: SymmetricBuffers | None = None
        self._streams = StreamPool(self.device)
        self._last_bindings: Bindings | None = None

    def _check_meshes_fit_the_world(self) -> None:
        world = self.communicator.world_size
        for tensor in self.fusion.tensors:
            too_large = [r for r in tensor.mesh.ranks if r >= world]
            if too_large:
                raise ShardingError(
                    f"{tensor} is placed on {tensor.mesh}, but the world has {world} ranks "
                    f"(0..{world - 1}); rank {too_large[0]} does not exist"
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
        everyone = self.communicator.all_gather_object(cpu)
        return [
            assemble({rank: pieces[position] for rank, pieces in enumerate(everyone)}, tensor)
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
        if not check_inputs and self._last_bindings is not None:
            bindings = self._last_bindings
        elif self.sharded:
            bindings = self._check_inputs(local_inputs)
        else:
            bindings = bind_inputs(self.fusion, list(local_inputs))
        self._last_bindings = bindings
        if self._uses_copy_engine() and self._symmetric is None:
            self._symmetric = SymmetricBuffers(self.communicator)
        if self._symmetric is not None:
            self._symmetric.next_run()
        return _Run(self, bindings, timeline).execute(local_inputs)

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

    def _check_inputs(self, local_inputs: Sequence[torch.Tensor | None]) -> Bindings:
        try:
            described = _describe_inputs(local_inputs, len(self.fusion.inputs))
        except InputError as error:
            described = str(error)
        everyone = self.communicator.all_gather_object(described)
        for rank, description in enumerate(everyone):
            if isinstance(description, str):
                raise InputError(f"rank {rank}: {description}")
        return check_local_inputs(self.fusion, everyone)


class _Run:
    """One run of the host program on this rank."""

    def __init__(self, executor: MultiDeviceExecutor, bindings: Bindings, timeline) -> None:
        self.executor = executor
        self.rank = executor.rank
        self.bindings = bindings
        self.timeline = timeline
        self.values: dict[TensorView, torch.Tensor | None] = {}
        self.allocated: set[TensorView] = set()
        self.pending: dict[Communicate, Pending] = {}
        self.started: dict[Communicate, object] = {}
        self.saved_streams: dict[str, object] = {}
        self.streams = executor._streams
        self.ctx = RankContext(
            self.rank,
            executor.communicator,
            lambda t: [resolve(e, bindings) for e in t.shape],
            lambda t: executor.local_shape(t, bindings),
            _storage_dtype,
        )
        self.pipelined = PipelinedComms(self.ctx, executor._symmetric)
        self.loop: tuple[ChunkScheme, int] | None = None

    def execute(self, local_inputs) -> list[torch.Tensor | None]:
        executor = self.executor
        for tensor, value in zip(executor.fusion.inputs, local_inputs, strict=True):
            if executor.holds(tensor.mesh):
                self.values[tensor] = unpack_fp4(value) if tensor.dtype is float4_e2m1 else value
        if executor._symmetric is not None:
            self._allocate_symmetric()
        self._instructions(executor.program.instructions)
        outputs: list[torch.Tensor | None] = []
        for tensor in executor.fusion.outputs:
            if not executor.holds(tensor.mesh):
                outputs.append(None)
                continue
            value = self.values[tensor]
            outputs.append(pack_fp4(value) if tensor.dtype is float4_e2m1 else value.contiguous())
        return outputs

    def _lane(self, kind: str) -> str:
        return f"stream {self.loop[1] % self.streams.count} {kind}" if self.loop else f"main {kind}"

    def _instructions(self, instructions: list) -> None:
        for instruction in instructions:
            handler = getattr(self, f"_{type(instruction).__name__}")
            handler(instruction)

    # -- memory ----------------------------------------------------------------

    def _Allocate(self, instruction: Allocate) -> None:
        # Allocated now, on the current (user's) stream: a buffer first touched inside a
        # loop would belong to a side stream, and the allocator could hand it out again
        # before the user's stream is done with it.
        self.allocated.add(instruction.tensor)
        if self.executor.holds(instruction.tensor.mesh):
            self._buffer(instruction.tensor)

    def _Deallocate(self, instruction: Deallocate) -> None:
        self.values.pop(instruction.tensor, None)

    def _buffer(self, tensor: TensorView) -> torch.Tensor:
        if tensor not in self.values:
            self.values[tensor] = torch.empty(
                self.ctx.local_shape(tensor), dtype=_storage_dtype(tensor),
                device=self.executor.device,
            )  # fmt: skip
        return self.values[tensor]

    # -- streams and loops -----------------------------------------------------

    def _GetCurrentStream(self, instruction: GetCurrentStream) -> None:
        self.saved_streams[instruction.name] = self.streams.current()

    def _stream(self, ref: StreamRef):
        if ref.saved:
            return self.saved_streams[ref.saved]
        return self.streams.get(self.loop[1])

    def _SetCurrentStream(self, instruction: SetCurrentStream) -> None:
        self.streams.set(self._stream(instruction.stream))

    def _Synchronize(self, instruction: Synchronize) -> None:
        self.streams.wait(self._stream(instruction.stream))

    def _ForLoop(self, instruction: ForLoop) -> None:
        outer = self.loop
        for iteration in range(instruction.scheme.num_chunks):
            self.loop = (instruction.scheme, iteration)
            self._instructions(instruction.body)
        self.loop = outer
        self.pipelined.drain()

    def _AliasSelect(self, instruction: AliasSelect) -> None:
        source = instruction.source
        if not self.executor.holds(source.mesh):
            return
        scheme, iteration = self.loop
        value = self._buffer(source) if source in self.allocated else self.values.get(source)
        layout = layout_of(source)
        split = (
            scheme.owners > 1
            and layout is not None
            and layout.placements[scheme.mesh_axis] == Shard(instruction.dim)
        )
        if scheme.owners > 1:
            where = place(scheme, self.rank, iteration)
            chunk = where.chunk
            if split and where.owner != where.mine:
                self.values[instruction.result] = None
                return
        else:
            chunk = scheme.chunk(iteration, 0)
        offset, size = chunk_rows(value.shape[instruction.dim], scheme, chunk, split)
        self.values[instruction.result] = value.narrow(instruction.dim, offset, size)

    # -- compute ---------------------------------------------------------------

    def _LaunchKernel(self, kernel: LaunchKernel) -> None:
        if not self.executor.holds(kernel.mesh):
            return
        span = self.timeline.span(self._lane("compute"), kernel.name) if self.timeline else None
        if span:
            span.__enter__()
        for expr in kernel.exprs:
            self._compute(expr, kernel.aliases)
        if span:
            span.__exit__(None, None, None)

    def _compute(self, expr: Expr, aliases: dict[TensorView, TensorView]) -> None:
        def read(tensor: TensorView) -> torch.Tensor:
            return self.values[aliases.get(tensor, tensor)]

        destinations = {
            out: self.values.get(aliases[out]) for out in expr.outputs if out in aliases
        }
        if isinstance(expr, LocalShard):
            (source,) = expr.inputs
            coordinate = expr.mesh.coords(self.rank)[expr.mesh_axis]
            extent = read(source).shape[expr.dim]
            offset, size = split_range(extent, expr.mesh.shape[expr.mesh_axis], coordinate)
            result = {expr.output: read(source).narrow(expr.dim, offset, size).contiguous()}
        elif isinstance(expr, (MatmulOp, LinearOp)):
            result = {expr.output: _contract(expr, read, destinations.get(expr.output))}
        else:
            local = {t: read(t) for t in expr.inputs}

            def shape_of(tensor: TensorView) -> list[int]:
                if tensor in local:
                    return list(local[tensor].shape)
                if destinations.get(tensor) is not None:
                    return list(destinations[tensor].shape)
                return self.ctx.local_shape(tensor)

            evaluate_expr(expr, local, shape_of)
            result = {out: local[out] for out in expr.outputs}
        for out, value in result.items():
            destination = destinations.get(out)
            if destination is not None:
                if destination.data_ptr() != value.data_ptr():
                    destination.copy_(value)
            else:
                self.values[aliases.get(out, out)] = value

    # -- communication ---------------------------------------------------------

    def _Communicate(self, instruction: Communicate) -> None:
        comm = instruction.communication
        if self.executor.communicator is None or self.rank not in comm.participants():
            return
        source = self.values.get(instruction.source)
        if self.timeline:
            self.started[instruction] = self.timeline.start(self._lane("comm"), instruction.name)
        if self.loop is not None:
            target = self.values.get(instruction.target)
            scheme, iteration = self.loop
            self.pending[instruction] = self.pipelined.start(
                instruction, source, target, scheme, iteration
            )
        else:
            self.pending[instruction] = start(comm, source, self.ctx)

    def _Wait(self, instruction: Wait) -> None:
        communicate = instruction.communicate
        if communicate not in self.pending:
            return
        result = self.pending.pop(communicate).wait()
        if self.loop is None and result is not None:
            self.values[communicate.target] = result
        if self.timeline and communicate in self.started:
            self.timeline.stop(self.started.pop(communicate))

    def _StageForPeers(self, instruction: StageForPeers) -> None:
        comm = instruction.communicate.communication
        if self.rank in comm.participants():
            self.executor._symmetric.stage(instruction.communicate, self.values[comm.inputs[0]])

    def _CombineStaged(self, instruction: CombineStaged) -> None:
        comm = instruction.communicate.communication
        if self.rank in comm.participants():
            self.executor._symmetric.combine(instruction.communicate, self._buffer(comm.output))

    def _allocate_symmetric(self) -> None:
        for loop in self.executor.program.instructions:
            if not isinstance(loop, ForLoop):
                continue
            for instruction in loop.body:
                if not (
                    isinstance(instruction, Communicate) and instruction.transport == "copy_engine"
                ):
                    continue
                comm = instruction.communication
                dim = split_dim(comm)
                moving = comm.inputs[0]
                shape = self.ctx.local_shape(moving)
                whole = self.ctx.global_shape(comm.output)[dim]
                rest = shape[:dim] + shape[dim + 1 :]
                self.executor._symmetric.allocate(
                    instruction, loop.scheme, whole, dim, rest, _storage_dtype(moving)
                )


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


def _storage_dtype(tensor: TensorView) -> torch.dtype:
    """The torch dtype of a tensor as a rank holds it between ops (fp4: one byte per value)."""
    return torch.uint8 if tensor.dtype is float4_e2m1 else tensor.dtype.torch_dtype


def _describe_inputs(
    local_inputs: Sequence[torch.Tensor | None], count: int
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


def local_piece(value: torch.Tensor, tensor: TensorView, rank: int) -> torch.Tensor | None:
    """``rank``'s piece of the whole ``value`` of ``tensor`` (None if not on ``rank``).

    fp4 values (``float4_e2m1fn_x2``) are split on values, not bytes.
    """
    layout = layout_of(tensor)
    if rank not in layout.mesh:
        return None
    packed = tensor.dtype is float4_e2m1
    piece = unpack_fp4(value) if packed else value
    coords = layout.mesh.coords(rank)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            extent = piece.shape[placement.dim]
            offset, size = split_range(extent, layout.mesh.shape[mesh_axis], coords[mesh_axis])
            piece = piece.narrow(placement.dim, offset, size)
    return pack_fp4(piece) if packed else piece.contiguous()


def assemble(pieces: dict[int, torch.Tensor | None], tensor: TensorView) -> torch.Tensor:
    """The whole value of ``tensor`` from its pieces by rank (the inverse of ``local_piece``).

    Replicated copies must agree; the first rank's copy is kept.
    """
    layout = layout_of(tensor)
    mesh = layout.mesh
    packed = tensor.dtype is float4_e2m1

    def along(mesh_axis: int, fixed: dict[int, int]) -> torch.Tensor:
        """Concatenate over mesh axes from ``mesh_axis`` on, the others fixed at ``fixed``."""
        if mesh_axis == mesh.ndim:
            rank = mesh.rank_at([fixed[a] for a in range(mesh.ndim)])
            piece = pieces[rank]
            if piece is None:
                raise ValueError(f"rank {rank} holds a piece of {tensor} but gave None")
            return unpack_fp4(piece) if packed else piece
        placement = layout.placements[mesh_axis]
        if not isinstance(placement, Shard):
            return along(mesh_axis + 1, {**fixed, mesh_axis: 0})
        parts = [
            along(mesh_axis + 1, {**fixed, mesh_axis: coordinate})
            for coordinate in range(mesh.shape[mesh_axis])
        ]
        return torch.cat(parts, placement.dim)

    whole = along(0, {})
    return pack_fp4(whole) if packed else whole
