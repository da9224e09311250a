"""Lowering: a resharded fusion becomes a host program, with stream lowering.

Exprs outside any stream-parallel run become, in order, ``LaunchKernel``s
(consecutive compute exprs on one mesh share one; a matmul or linear gets its
own, on cuBLAS) and communications (``Allocate``, ``Communicate``, ``Wait``).

Stream lowering: an expr whose output has a stream axis (``StreamAxes``, from
``overlap.compile.apply_plan``: the user's ``Stream`` marks and the plan's pipelines)
runs chunk by chunk in a ``ForLoop`` (which exprs share a loop:
``overlap.compile.runs``). The loop's outputs are allocated once, before it. The
synchronizations with the user's stream are hoisted into a loop of their own before
the work loop, so no iteration waits on another. In the work loop, iteration ``i``
makes stream ``i`` current, selects chunk ``i`` of every tensor it touches
(``AliasSelect``; a reduction over another axis keeps its reduction axes), runs the
exprs on the chunks, restores the user's stream and makes it wait for stream ``i``.

A communication next to a stream-parallel expr joins its loop along the
matching axis (``StreamAxes`` says so): an all-gather feeding a linear is gathered
chunk by chunk, each chunk consumed as soon as it lands; a reduce-scatter of a
linear's output reduces each chunk as soon as it is computed.
"""

from __future__ import annotations

from fusion.exprs import AttentionGradOp, AttentionOp, Expr, LinearOp, MatmulOp, TorchOp
from fusion.ir import Fusion, TensorView
from overlap.compile.apply_plan import StreamAxes, stream_axes
from overlap.compile.runs import loop_keys, runs
from overlap.ir import (
    LOOP_STREAM,
    AliasSelect,
    Allocate,
    ChunkOrder,
    ChunkScheme,
    CombineStaged,
    Communicate,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Instruction,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    StreamRef,
    Synchronize,
    Transport,
    Wait,
)
from overlap.plan.planner import OverlapPlan
from schedulers.registry import KernelGroup, split_into_kernels
from sharding.communication import Communication, CommunicationKind
from sharding.errors import ShardingError
from sharding.layout import Shard, layout_of
from sharding.rules import dim_map
from sharding.segmentation import segment_fusion

USER_STREAM = StreamRef("s0")


def _split_dims(tensor: TensorView) -> tuple | None:
    layout = layout_of(tensor)
    if layout is None:
        return None
    return tuple(p.dim if isinstance(p, Shard) else None for p in layout.placements)


def _splits_alike(group: list[Expr], expr: Expr) -> bool:
    """Whether every output of ``expr`` is split as the group's outputs of its shape."""
    held = {}
    for member in group:
        for out in member.outputs:
            held.setdefault(tuple(out.shape), _split_dims(out))
    return all(
        held.get(tuple(out.shape), _split_dims(out)) == _split_dims(out) for out in expr.outputs
    )


def _is_contraction(expr: Expr) -> bool:
    return isinstance(expr, (MatmulOp, LinearOp))


def _runs_alone(expr: Expr) -> bool:
    """A contraction (cuBLAS) or an ATen op without a translation (PyTorch runs it):
    a kernel of its own, never generated."""
    return _is_contraction(expr) or isinstance(expr, TorchOp)


class _Lowering:
    def __init__(
        self,
        fusion: Fusion,
        plan: OverlapPlan,
        streams: StreamAxes,
        schedule: bool,
        name_generated: bool = False,
    ) -> None:
        self.fusion = fusion
        self.plan = plan
        self.streams = streams
        self.schedule = schedule
        self.instructions: list[Instruction] = []
        # the generated kernels' names and schedulers; evaluating compute, those a
        # scheduled lowering would give (``name_generated``), for checks by name
        self.generated: dict[str, object] | None = {} if schedule or name_generated else None
        self.scheduled_kernels = 0
        self.scratch = Fusion("chunks")
        self.scratch.finalized = True
        self.next_tensor_id = fusion.next_tensor_id()
        self.kernels = 0
        self.communications = 0
        self.saved_user_stream = False

    # -- helpers --------------------------------------------------------------

    def _chunk_tensor(self, source: TensorView) -> TensorView:
        axes = [self.scratch.new_axis(a.extent, a.iter_type, a.parallel_type) for a in source.axes]
        chunk = TensorView(self.scratch, self.next_tensor_id, source.dtype, axes)
        chunk.mesh = source.mesh
        self.next_tensor_id += 1
        return chunk

    def _kernel(
        self,
        exprs: list[Expr],
        aliases: dict[TensorView, TensorView] | None = None,
        group: KernelGroup | None = None,
    ) -> LaunchKernel:
        aliases = aliases or {}
        inputs, outputs = self.fusion.boundary(exprs)
        name = f"k{self.kernels}"
        self.kernels += 1
        # PyTorch's own kernels: contractions, attention (both run natively in their
        # dtype), ATen ops without a translation
        native = all(_runs_alone(e) or isinstance(e, (AttentionOp, AttentionGradOp))
                     for e in exprs)  # fmt: skip
        backend = "torch" if native else "reference"
        if group is not None and group.scheduler is not None:
            backend = group.scheduler.name
        return LaunchKernel(
            name,
            exprs,
            [aliases.get(t, t) for t in inputs],
            [aliases.get(t, t) for t in outputs],
            exprs[0].outputs[0].mesh,
            backend,
            aliases,
            group.scheduler if group else None,
            group.plan if group else None,
            group.reason if group else "",
        )

    def _compute_kernels(
        self, exprs: list[Expr], aliases: dict[TensorView, TensorView] | None = None
    ) -> list[LaunchKernel]:
        """Consecutive compute exprs on one mesh share a kernel; a contraction is alone,
        and so are exprs whose outputs, of one whole shape, are split unlike the
        kernel's (a kernel runs one iteration space: a whole tensor beside a piece of
        the same shape would be written over the piece's extent only)."""
        groups: list[list[Expr]] = []
        for expr in exprs:
            alone = _runs_alone(expr)
            if groups and not alone and not _runs_alone(groups[-1][-1]):
                if groups[-1][-1].outputs[0].mesh == expr.outputs[0].mesh and _splits_alike(
                    groups[-1], expr
                ):
                    groups[-1].append(expr)
                    continue
            groups.append([expr])
        kernels = []
        for group in groups:
            pieces = self._scheduled(group)
            if not self.schedule or pieces is None:
                kernels.append(self._kernel(group, aliases))
                continue
            for piece in pieces:
                kernels.append(self._kernel(piece.exprs, aliases, piece))
        return kernels

    def _scheduled(self, group: list[Expr]) -> list[KernelGroup] | None:
        """The kernels a scheduled lowering makes of ``group`` (None: not asked, or a
        contraction, a kernel of its own), each generated one named in
        ``self.generated`` as that lowering names it (every kernel takes a name)."""
        if self.generated is None:
            return None
        if _runs_alone(group[0]):
            self.scheduled_kernels += 1
            return None
        pieces = split_into_kernels(group, self.fusion)
        for piece in pieces:
            if piece.scheduler is not None:
                self.generated[f"k{self.scheduled_kernels}"] = piece.scheduler
            self.scheduled_kernels += 1
        return pieces

    def _communicate(
        self,
        comm: Communication,
        source: TensorView,
        target: TensorView,
        pipelined: bool = False,
        alias_owned: bool = False,
    ) -> Communicate:
        name = f"c{self.communications}"
        self.communications += 1
        transport = _transport(self.plan, comm)
        return Communicate(name, comm, source, target, transport, pipelined, alias_owned)

    # -- runs -----------------------------------------------------------------

    def lower(self) -> HostProgram:
        for run in runs(self.fusion.live_exprs(), loop_keys(self.plan, self.streams)):
            if run.looped:
                self._lower_loop(run.exprs)
            else:
                self._lower_plain(run.exprs)
        return HostProgram(self.fusion, tuple(self.instructions))

    def _lower_plain(self, exprs: list[Expr]) -> None:
        for segment in segment_fusion(self.fusion, exprs):
            if not segment.is_communication:
                self.instructions.extend(self._compute_kernels(segment.exprs))
                continue
            comm = segment.communication
            communicate = self._communicate(comm, comm.inputs[0], comm.output)
            self.instructions += [Allocate(comm.output), communicate, Wait(communicate)]

    def _scheme(self, exprs: list[Expr], pipelined: list[Communication]) -> ChunkScheme:
        chunks = self.streams.chunks(exprs[0].outputs[0])
        scheme = ChunkScheme(chunks)
        # Unplanned (marked by hand), reduce-scatters alone take own chunks last (each rank
        # sends one partial a step); an all-gather's broadcasts need the global order.
        alone = all(c.kind is CommunicationKind.ReduceScatter for c in pipelined)
        unplanned = ChunkOrder.LOCAL_LAST if alone else ChunkOrder.GLOBAL
        for expr in pipelined:
            mesh = expr.in_layout.mesh
            owners = mesh.shape[expr.mesh_axis]
            if chunks % owners:
                raise ShardingError(
                    f"{expr.op_name} of {expr.inputs[0]} is pipelined over {owners} ranks in "
                    f"{chunks} chunks; the chunk count must be a multiple of {owners}"
                )
            pipeline = self.plan.pipeline(expr)
            order = pipeline.order if pipeline is not None else unplanned
            scheme = ChunkScheme(chunks, owners, mesh, expr.mesh_axis, order)
        return scheme

    def _lower_loop(self, exprs: list[Expr]) -> None:
        comms = [e for e in exprs if isinstance(e, Communication)]
        pipelined = _pipelined(comms, self.streams)
        scheme = self._scheme(exprs, pipelined)
        instructions = self.instructions
        instructions.extend(Allocate(t, self.streams.dim(t)) for e in exprs for t in e.outputs)
        if not self.saved_user_stream:
            instructions.append(GetCurrentStream(USER_STREAM.saved))
            self.saved_user_stream = True
        sync_loop = ForLoop(scheme, (SetCurrentStream(LOOP_STREAM), Synchronize(USER_STREAM)))
        body: list[Instruction] = [SetCurrentStream(LOOP_STREAM)]
        chunks: dict[TensorView, TensorView] = {}
        before: list[Instruction] = []
        after: list[Instruction] = []

        def select(tensor: TensorView, dim: int) -> TensorView:
            if tensor not in chunks:
                chunks[tensor] = self._chunk_tensor(tensor)
                body.append(AliasSelect(chunks[tensor], tensor, dim))
            return chunks[tensor]

        pending: list[Expr] = []

        def flush() -> None:
            if pending:
                body.extend(self._compute_kernels(list(pending), dict(chunks)))
                pending.clear()

        for expr in exprs:
            out_dim = self.streams.dim(expr.outputs[0])
            for tensor, dim in _input_dims(expr, out_dim):
                if dim is not None:
                    select(tensor, dim)
            for out in expr.outputs:
                select(out, out_dim)
            if isinstance(expr, Communication):
                if expr.output.dtype.is_packed:
                    raise ShardingError(
                        f"{expr.op_name} of {expr.inputs[0]}: pipelining a communication of "
                        f"packed {expr.output.dtype} values is not supported; keep it whole"
                    )
                flush()
                alias_owned = (
                    _transport(self.plan, expr) is Transport.COPY_ENGINE
                    and expr.kind is CommunicationKind.Allgather
                    and expr.output not in self.fusion.outputs
                    and all(use in exprs for use in expr.output.uses)
                )
                communicate = self._communicate(
                    expr, chunks[expr.inputs[0]], chunks[expr.output],
                    expr in pipelined and scheme.owners > 1, alias_owned,
                )  # fmt: skip
                body += [communicate, Wait(communicate)]
                if communicate.transport is Transport.COPY_ENGINE:
                    if expr.kind is CommunicationKind.Allgather:
                        before.append(StageForPeers(communicate))
                    else:
                        after.append(CombineStaged(communicate))
            else:
                pending.append(expr)
        flush()
        body += [SetCurrentStream(USER_STREAM), Synchronize(LOOP_STREAM)]
        # Staging for peers comes before the streams fork from the user's stream, so every
        # stream's transfers come after the barrier that says the peers are staged.
        instructions.extend(before)
        instructions.append(sync_loop)
        posting = _hoisted_transfers(exprs[0], _transport(self.plan, exprs[0]), body, scheme)
        if posting:
            instructions.append(ForLoop(scheme, tuple(posting), "post every transfer first"))
        instructions.append(ForLoop(scheme, tuple(body), scheme.describe()))
        instructions.extend(after)


def _pipelined(comms: list[Communication], streams: StreamAxes) -> list[Communication]:
    """The communications a loop pipelines (they gather or scatter its stream axis). The
    others run chunk by chunk: one that split or gathered that axis (an all-to-all of the
    rows) would move each chunk's rows as if they were the whole, so it is refused."""
    pipelined = []
    for comm in comms:
        dim, chunks = streams.dim(comm.output), streams.chunks(comm.output)
        if comm.split_dim is not None and comm.split_dim == dim:
            pipelined.append(comm)
        elif dim in (comm.in_dim, comm.out_dim):
            raise ShardingError(
                f"{comm.op_name} of {comm.inputs[0]} splits or gathers axis {dim}, which a "
                f"stream loop cuts into {chunks} chunks: chunk by chunk it would move the "
                "wrong rows. Mark another axis as Stream, or leave this one unmarked"
            )
    return pipelined


def _transport(plan: OverlapPlan, expr: Expr) -> Transport | None:
    """How the plan moves a communication's chunks (None: not a planned pipeline)."""
    pipeline = plan.pipeline(expr) if isinstance(expr, Communication) else None
    return pipeline.transport if pipeline is not None else None


def _hoisted_transfers(
    first: Expr, transport: Transport | None, body: list[Instruction], scheme: ChunkScheme
):
    """Take the transfers of a pipelined all-gather out of the work loop, into a loop of
    their own before it: they depend on no compute, so posting them all first lets every
    chunk's transfer start at once instead of after the host has issued the matmuls before
    it. The work loop keeps each chunk's ``Wait``. Ring transfers stay in the work loop:
    they forward what the previous step received."""
    if not (
        isinstance(first, Communication)
        and first.kind is CommunicationKind.Allgather
        and scheme.owners > 1
        and transport is not Transport.RING
    ):
        return []
    end = next(i for i, inst in enumerate(body) if isinstance(inst, Communicate)) + 1
    moved = body[1:end]
    del body[1:end]
    return [SetCurrentStream(LOOP_STREAM), *moved]


def _input_dims(expr: Expr, out_dim: int) -> list[tuple[TensorView, int | None]]:
    """For each input, the axis that lines up with the output's stream axis (or None)."""
    if isinstance(expr, Communication):
        return [(expr.inputs[0], out_dim)]
    # One part: chunks need no divisibility (the reshape rule's concern with ranks).
    needs = dim_map(expr, 1).backward(Shard(out_dim))
    if needs is None:
        raise ShardingError(
            f"{expr.op_name}: cannot run chunk by chunk along axis {out_dim} of {expr.outputs[0]}"
        )
    return [
        (t, p.dim if isinstance(p, Shard) else None)
        for t, p in zip(expr.inputs, needs, strict=True)
    ]


def lower_to_host_program(
    fusion: Fusion,
    plan: OverlapPlan | None = None,
    schedule: bool = False,
    streams: StreamAxes | None = None,
) -> HostProgram:
    """The host program of a resharded (or single-device) fusion. ``plan`` gives each
    pipelined communication's transport and chunk order; ``streams`` which tensors run
    chunk by chunk (default: ``stream_axes(fusion, plan)``, the user's marks and the
    plan's pipelines).

    ``schedule``: compute that a scheduler takes becomes generated Triton kernels (the
    rest, and everything when False, runs through the reference evaluator).
    """
    return lower_naming_kernels(fusion, plan, schedule, streams, name_generated=False)[0]


def lower_naming_kernels(
    fusion: Fusion,
    plan: OverlapPlan | None = None,
    schedule: bool = False,
    streams: StreamAxes | None = None,
    name_generated: bool = True,
) -> tuple[HostProgram, dict[str, object]]:
    """``lower_to_host_program``'s program, and the generated kernels' schedulers by
    name: the program's own, or where it evaluates compute and ``name_generated``, those
    the same lowering would generate with ``schedule`` (so that names given for the
    generated kernels are checked on a machine that evaluates; it costs the schedulers'
    analysis)."""
    plan = plan or OverlapPlan()
    streams = streams if streams is not None else stream_axes(fusion, plan)
    lowering = _Lowering(fusion, plan, streams, schedule, name_generated)
    return lowering.lower(), dict(lowering.generated or {})
