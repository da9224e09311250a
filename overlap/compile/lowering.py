"""Lowering: a resharded fusion becomes a host program, with stream lowering.

Exprs outside any stream-parallel run become, in order, ``LaunchKernel``s
(consecutive compute exprs on one mesh share one; a matmul or linear gets its
own, on cuBLAS) and communications (``Allocate``, ``Communicate``, ``Wait``).

Stream lowering: an expr whose output has a ``Stream`` axis runs chunk by chunk
in a ``ForLoop``. Consecutive stream-parallel exprs over the same axis (same
extent, same number of chunks) share one loop; any other expr between them ends
the loop. A stream-parallel compute expr that reads nothing computed since the
last loop of its kind is moved up into that loop (the up projection next to the
gate projection, both fed by one gathered chunk). The loop's outputs are
allocated once, before it. The synchronizations with the user's stream are
hoisted into a loop of their own before the work loop, so no iteration waits on
another. In the work loop, iteration ``i`` makes stream ``i`` current, selects
chunk ``i`` of every tensor it touches (``AliasSelect``; a reduction over
another axis keeps its reduction axes), runs the exprs on the chunks, restores
the user's stream and makes it wait for stream ``i``.

A communication next to a stream-parallel expr joins its loop along the
matching axis: an all-gather feeding a linear is gathered chunk by chunk, each
chunk consumed as soon as it lands; a reduce-scatter of a linear's output
reduces each chunk as soon as it is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion.exprs import AttentionGradOp, AttentionOp, Expr, LinearOp, MatmulOp
from fusion.ir import Axis, Fusion, TensorView
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
    stream_dim,
)
from overlap.plan.planner import OverlapPlan
from schedulers.registry import KernelGroup, split_into_kernels
from sharding.communication import Communication, CommunicationKind
from sharding.errors import ShardingError
from sharding.layout import Shard, layout_of
from sharding.rules import dim_map
from sharding.segmentation import segment_fusion

USER_STREAM = StreamRef("s0")
DEFAULT_CHUNKS = 2


def _chunks(axis: Axis) -> int:
    return axis.stream_chunks or DEFAULT_CHUNKS


def propagate_stream_axes(fusion: Fusion) -> None:
    """Pull communications next to stream-parallel exprs into their loops.

    A communication whose output feeds a stream-parallel expr along the stream axis
    (an all-gather feeding a pipelined linear), or whose input comes from one (the
    reduce-scatter of a pipelined linear), gets the same Stream axis.
    """
    for expr in fusion.live_exprs():
        if not isinstance(expr, Communication) or stream_dim(expr.output) is not None:
            continue
        (source,) = expr.inputs
        producer = source.definition
        if producer is not None and stream_dim(source) is not None:
            dim = stream_dim(source)
            if dim < expr.output.ndim:
                expr.output.axis(dim).stream(_chunks(source.axis(dim)))
                continue
        for consumer in expr.output.uses:
            dim = stream_dim(consumer.outputs[0])
            if dim is None:
                continue
            needs = dim_map(consumer, 1).backward(Shard(dim))
            position = consumer.inputs.index(expr.output)
            wanted = needs[position] if needs else None
            if isinstance(wanted, Shard):
                expr.output.axis(wanted.dim).stream(_chunks(consumer.outputs[0].axis(dim)))
                break


@dataclass
class _Run:
    exprs: list[Expr]
    looped: bool


def _loop_key(expr: Expr, owners: dict[Expr, int]) -> tuple | None:
    """Which loop ``expr`` may share: its stream axis's extent and chunk count, and the
    planned pattern it belongs to (two patterns never share a loop: their chunks may
    go in different orders)."""
    out = expr.outputs[0]
    dim = stream_dim(out)
    if dim is None:
        return None
    axis = out.axis(dim)
    return (axis.extent, _chunks(axis), owners.get(expr))


def _pattern_owners(plan: OverlapPlan) -> dict[Expr, int]:
    """Each expr of a pipelined pattern, with the pattern's position in ``plan``."""
    owners: dict[Expr, int] = {}
    for position, decision in enumerate(plan):
        if decision.overlapped:
            members = [decision.communication, decision.contraction]
            for expr in (*members, *(expr for expr, _ in decision.chunked)):
                owners[expr] = position
    return owners


def _pulled_into_loops(exprs: list[Expr], owners: dict[Expr, int]) -> list[Expr]:
    """``exprs`` with each stream-parallel expr moved up to just after the last expr of
    its loop key, when none of the exprs it would pass computes its inputs (they cannot
    read its outputs: they came first). A reduce-scatter placed late (a backward's,
    after the weight gradients computed beside it) joins the loop of its matmul."""
    order: list[Expr] = []
    for expr in exprs:
        key = _loop_key(expr, owners)
        if key is not None:
            last = next(
                (i for i in range(len(order) - 1, -1, -1) if _loop_key(order[i], owners) == key),
                None,
            )
            if last is not None and last < len(order) - 1:
                passed = {t for e in order[last + 1 :] for t in e.outputs}
                if not passed.intersection(expr.inputs):
                    order.insert(last + 1, expr)
                    continue
        order.append(expr)
    return order


def _runs(exprs: list[Expr], owners: dict[Expr, int]) -> list[_Run]:
    runs: list[_Run] = []
    for expr in _pulled_into_loops(exprs, owners):
        key = _loop_key(expr, owners)
        looped = key is not None
        if (
            runs
            and runs[-1].looped == looped
            and (not looped or _loop_key(runs[-1].exprs[-1], owners) == key)
        ):
            runs[-1].exprs.append(expr)
        else:
            runs.append(_Run([expr], looped))
    return runs


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


class _Lowering:
    def __init__(self, fusion: Fusion, plan: OverlapPlan | None, schedule: bool) -> None:
        self.fusion = fusion
        self.plan = plan or OverlapPlan()
        self.schedule = schedule
        self.program = HostProgram(fusion)
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
        produced = {t for e in exprs for t in e.outputs}
        inputs = list(dict.fromkeys(t for e in exprs for t in e.inputs if t not in produced))
        inside = set(exprs)
        outputs = [
            t
            for e in exprs
            for t in e.outputs
            if t in self.fusion.outputs or any(use not in inside for use in t.uses)
        ]
        name = f"k{self.kernels}"
        self.kernels += 1
        # PyTorch's own kernels: contractions, attention (both run natively in their dtype)
        native = all(_is_contraction(e) or isinstance(e, (AttentionOp, AttentionGradOp))
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
            alone = _is_contraction(expr)
            if groups and not alone and not _is_contraction(groups[-1][-1]):
                if groups[-1][-1].outputs[0].mesh == expr.outputs[0].mesh and _splits_alike(
                    groups[-1], expr
                ):
                    groups[-1].append(expr)
                    continue
            groups.append([expr])
        kernels = []
        for group in groups:
            if not self.schedule or _is_contraction(group[0]):
                kernels.append(self._kernel(group, aliases))
                continue
            for piece in split_into_kernels(group, self.fusion):
                kernels.append(self._kernel(piece.exprs, aliases, piece))
        return kernels

    def _communicate(self, comm: Communication, source: TensorView, target: TensorView):
        name = f"c{self.communications}"
        self.communications += 1
        return Communicate(name, comm, source, target, _transport(self.plan, comm))

    # -- runs -----------------------------------------------------------------

    def lower(self) -> HostProgram:
        for run in _runs(self.fusion.live_exprs(), _pattern_owners(self.plan)):
            if run.looped:
                self._lower_loop(run.exprs)
            else:
                self._lower_plain(run.exprs)
        return self.program

    def _lower_plain(self, exprs: list[Expr]) -> None:
        for segment in segment_fusion(self.fusion, exprs):
            if not segment.is_communication:
                self.program.instructions.extend(self._compute_kernels(segment.exprs))
                continue
            comm = segment.communication
            communicate = self._communicate(comm, comm.inputs[0], comm.output)
            self.program.instructions += [Allocate(comm.output), communicate, Wait(communicate)]

    def _scheme(self, exprs: list[Expr]) -> ChunkScheme:
        out = exprs[0].outputs[0]
        chunks = _chunks(out.axis(stream_dim(out)))
        scheme = ChunkScheme(chunks)
        pipelined = _pipelined([e for e in exprs if isinstance(e, Communication)], chunks)
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
        scheme = self._scheme(exprs)
        instructions = self.program.instructions
        instructions.extend(Allocate(t) for e in exprs for t in e.outputs)
        if not self.saved_user_stream:
            instructions.append(GetCurrentStream(USER_STREAM.saved))
            self.saved_user_stream = True
        sync_loop = ForLoop(scheme, [SetCurrentStream(LOOP_STREAM), Synchronize(USER_STREAM)])
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
            out_dim = stream_dim(expr.outputs[0])
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
                communicate = self._communicate(expr, chunks[expr.inputs[0]], chunks[expr.output])
                communicate.alias_owned = (
                    communicate.transport is Transport.COPY_ENGINE
                    and expr.kind is CommunicationKind.Allgather
                    and expr.output not in self.fusion.outputs
                    and all(use in exprs for use in expr.output.uses)
                )
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
            instructions.append(ForLoop(scheme, posting, "post every transfer first"))
        instructions.append(ForLoop(scheme, body, scheme.describe()))
        instructions.extend(after)


def _pipelined(comms: list[Communication], chunks: int) -> list[Communication]:
    """The communications a loop pipelines (they gather or scatter its stream axis). The
    others run chunk by chunk: one that split or gathered that axis (an all-to-all of the
    rows) would move each chunk's rows as if they were the whole, so it is refused."""
    pipelined = []
    for comm in comms:
        dim = stream_dim(comm.output)
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
    fusion: Fusion, plan: OverlapPlan | None = None, schedule: bool = False
) -> HostProgram:
    """The host program of a resharded (or single-device) fusion, its stream axes marked
    (by ``apply_overlap_plan`` or the user); ``plan`` gives each pipelined
    communication's transport and chunk order.

    ``schedule``: compute that a scheduler takes becomes generated Triton kernels (the
    rest, and everything when False, runs through the reference evaluator).
    """
    propagate_stream_axes(fusion)
    return _Lowering(fusion, plan, schedule).lower()
