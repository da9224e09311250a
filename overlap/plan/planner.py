"""The stream-lowering planner: whether and how to overlap a communication with a matmul.

It finds the two patterns that pay most, in a resharded fusion:

- ``allgather+matmul``: an all-gather along the rows feeding a matmul/linear
  (sequence-parallel all-gather, then a column-parallel linear); every matmul that
  reads the gathered rows (gate and up; Q, K and V) joins the pipeline, so each chunk
  that lands feeds all of them before the next is waited for;
- ``matmul+reduce_scatter``: a matmul/linear whose partial sum is
  reduce-scattered along its rows (row-parallel linear, then back to a
  sequence split).

For each it predicts, from a cost model fed by hardware figures (the device's own
description, ``schedulers.hardware``, plus what overlapping adds: matmul rate, link and
copy-engine bandwidth, launch overhead, how much NCCL's kernels slow a matmul down, the
host's cost of each kind of step), the time of every candidate — no overlap, or ``C``
chunks (a multiple of the team size) moved by a ``Transport`` in its ``ChunkOrder``
(local chunk first for copy-engine all-gathers, last for reduce-scatters) — as the
longer of the device's time and the host's to issue it (the steps its lowering will
have, or a CUDA graph's replay), and picks the fastest. It chooses no overlap when no
candidate beats the sequential run by at least 3 %. Every choice prints with its reason
and the candidates' predictions, device and host; ``OverlapOptions`` overrides any part
of it.

``plan_overlap`` only decides: it returns an ``OverlapPlan`` and changes nothing.
``overlap.compile.apply_plan`` marks the chosen rows as ``Stream`` axes, and lowering reads each
communication's transport and order from the plan.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from fusion.exprs import Expr, LinearOp, MatmulOp
from fusion.ir import Fusion, TensorView
from overlap.ir import ChunkOrder, Transport
from overlap.plan.cost_model import Estimate, Pattern, estimate
from overlap.plan.figures import HardwareFigures
from sharding.communication import Communication, CommunicationKind
from sharding.errors import ShardingError
from sharding.layout import layout_of, local_shape
from sharding.rules import dim_map

_ORDERS = {
    (Pattern.ALLGATHER_MATMUL, Transport.COLLECTIVE): ChunkOrder.GLOBAL,
    (Pattern.ALLGATHER_MATMUL, Transport.RING): ChunkOrder.RING_GATHER,
    (Pattern.ALLGATHER_MATMUL, Transport.COPY_ENGINE): ChunkOrder.LOCAL_FIRST,
    (Pattern.MATMUL_REDUCE_SCATTER, Transport.COLLECTIVE): ChunkOrder.LOCAL_LAST,
    (Pattern.MATMUL_REDUCE_SCATTER, Transport.RING): ChunkOrder.RING_REDUCE,
    (Pattern.MATMUL_REDUCE_SCATTER, Transport.COPY_ENGINE): ChunkOrder.LOCAL_LAST,
}


@dataclass(frozen=True)
class OverlapOptions:
    """User overrides; None leaves a choice to the planner.

    ``overlap=False`` keeps every communication whole; ``num_chunks`` fixes the chunk
    count (a multiple of the team size); ``transport`` one of ``collective``, ``ring``,
    ``copy_engine``. Fixing a chunk count or a transport implies overlap.
    """

    overlap: bool | None = None
    num_chunks: int | None = None
    transport: Transport | str | None = None  # a name is read as the Transport

    def __post_init__(self) -> None:
        if self.transport is not None:
            names = tuple(t.value for t in Transport)
            if self.transport not in names:
                raise ValueError(f"transport must be one of {names}, got {self.transport!r}")
            object.__setattr__(self, "transport", Transport(self.transport))
        if self.num_chunks is not None and (
            not isinstance(self.num_chunks, int) or self.num_chunks < 1
        ):
            raise ValueError(f"num_chunks must be a positive int, got {self.num_chunks!r}")


@dataclass(frozen=True)
class Candidate:
    """One way to run a pattern, with its predicted time: the longer of the device's
    and the host's (``device_ms``, ``host_ms``: issuing ``host_steps`` steps, or
    replaying a CUDA graph); NaN where the cost model could not price it."""

    transport: Transport | None  # None: no overlap
    num_chunks: int
    order: ChunkOrder | None  # None: no overlap
    predicted_ms: float
    device_ms: float = float("nan")
    host_ms: float = float("nan")
    host_steps: int = 0

    @classmethod
    def priced(
        cls, transport: Transport | None, num_chunks: int, order: ChunkOrder | None,
        estimated: Estimate,
    ) -> Candidate:  # fmt: skip
        """A candidate with the cost model's ``estimated`` times."""
        return cls(transport, num_chunks, order, estimated.predicted_ms, estimated.device_ms,
                   estimated.host_ms, estimated.host_steps)  # fmt: skip

    def describe(self) -> str:
        if self.transport is None:
            return "sequential (no overlap)"
        return f"{self.num_chunks} chunks, {self.transport}, {self.order} order"

    def times(self) -> str:
        """Its device and host times, the host's steps (``device 0.41, host 0.07 ms,
        5 steps``; a host-bound candidate says so)."""
        if math.isnan(self.predicted_ms):
            return "not priced"
        bound = ", host-bound" if self.host_ms > self.device_ms else ""
        return (f"device {self.device_ms:.3f}, host {self.host_ms:.3f} ms, "
                f"{self.host_steps} steps{bound}")  # fmt: skip


@dataclass(frozen=True)
class OverlapDecision:
    """The planner's choice for one pattern, with its reason and the alternatives.

    ``row`` is the contraction output's axis that the chunks cut (its rows). ``chunked``:
    the other exprs that run chunk by chunk in the same loop, each with its output's
    row axis (the matmuls of the gathered rows after the first).
    ``shape``'s N counts every matmul of the loop."""

    pattern: Pattern
    communication: Communication
    contraction: Expr
    row: int
    shape: tuple[int, int, int]  # (M, K, N) of the local matmul, M the whole rows
    team_size: int
    chosen: Candidate
    reason: str
    candidates: tuple[Candidate, ...] = ()
    chunked: tuple[tuple[Expr, int], ...] = ()

    @property
    def overlapped(self) -> bool:
        return self.chosen.transport is not None

    def __str__(self) -> str:
        m, k, n = self.shape
        exprs = " + ".join(
            f"{expr.op_name} {expr.outputs[0].name}"
            for expr in (self.contraction, *(expr for expr, _ in self.chunked))
        )
        lines = [
            f"{self.pattern} ({self.communication.op_name} {self.communication.output.name}, "
            f"{exprs}; M={m} K={k} N={n}, {self.team_size} ranks): {self.chosen.describe()}",
            f"  reason: {self.reason}",
        ]
        for candidate in sorted(self.candidates, key=lambda c: c.predicted_ms):
            mark = "*" if candidate == self.chosen else " "
            lines.append(f"  {mark} {candidate.predicted_ms:8.3f} ms  {candidate.describe()}  "
                         f"({candidate.times()})")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class OverlapPlan:
    """Every decision of the planner, in the order the patterns occur: a value, read by
    the passes after it (``overlap.compile.apply_plan``, lowering), never applied to the
    IR. Iterates over the decisions; ``pipeline(comm)`` is the chosen pipeline of a
    communication, if any."""

    decisions: tuple[OverlapDecision, ...] = ()

    def __iter__(self) -> Iterator[OverlapDecision]:
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, index: int) -> OverlapDecision:
        return self.decisions[index]

    def pipeline(self, communication: Communication) -> Candidate | None:
        """The candidate chosen for ``communication`` when it is pipelined, else None."""
        return self._pipelines.get(communication)

    @functools.cached_property
    def _pipelines(self) -> dict[Communication, Candidate]:
        return {d.communication: d.chosen for d in self.decisions if d.overlapped}

    def __str__(self) -> str:
        if not self.decisions:
            return "no all-gather+matmul or matmul+reduce-scatter to overlap"
        return "\n".join(str(decision) for decision in self.decisions)


def copy_engine_refused(where: str) -> ShardingError:
    """The error for a copy-engine pipeline where there is no copy engine (``where``
    says which device or rank): raised by the planner for forced options, and by the
    executor for a program planned for another device."""
    return ShardingError(
        f"the copy_engine transport needs CUDA devices with symmetric memory; {where}. "
        "Use collective or ring"
    )


def _static_local_shape(tensor: TensorView) -> list[int] | None:
    if not all(isinstance(e, int) for e in tensor.shape):
        return None
    layout = layout_of(tensor)
    return local_shape(layout, layout.mesh.ranks[0], list(tensor.shape))


def _row_axis(contraction: Expr, operand: TensorView, dim: int) -> int | None:
    """The output axis that operand axis ``dim`` becomes, if it is a row (not the K) axis."""
    mapping = dim_map(contraction, 1)
    position = contraction.inputs.index(operand)
    out_dim = mapping.maps[position].get(dim)
    if out_dim is None or out_dim == contraction.outputs[0].ndim - 1:
        return None
    return out_dim


def find_patterns(fusion: Fusion) -> list[tuple[Pattern, Communication, Expr, int, tuple]]:
    """``(pattern, communication, contraction, row axis of the contraction's output,
    chunked)``: ``chunked`` the further exprs of the pipeline with their row axes."""
    found = []
    live = fusion.live_exprs()
    alive = set(live)
    for expr in live:
        if not isinstance(expr, Communication) or expr.mesh_axis is None:
            continue
        if expr.kind is CommunicationKind.Allgather:
            readers = [
                (consumer, row)
                for consumer in expr.output.uses
                if consumer in alive
                and isinstance(consumer, (MatmulOp, LinearOp))
                and consumer.inputs[0] is expr.output
                for row in [_row_axis(consumer, expr.output, expr.in_dim)]
                if row is not None
            ]
            if readers:
                (first, row), *more = readers
                found.append((Pattern.ALLGATHER_MATMUL, expr, first, row, tuple(more)))
        elif expr.kind is CommunicationKind.ReduceScatter:
            # (sharding never places a pointwise op on partial sums: the reduce-scatter
            # reads the contraction's output itself)
            producer = expr.inputs[0].definition
            if (
                isinstance(producer, (MatmulOp, LinearOp))
                and expr.out_dim < producer.output.ndim - 1
            ):
                found.append((Pattern.MATMUL_REDUCE_SCATTER, expr, producer, expr.out_dim, ()))
    return found


def _candidates(
    pattern: Pattern, figures: HardwareFigures, shape, parts: int, bits: int, options, replayed,
    matmuls: int, inputs: int,
) -> list[Candidate]:  # fmt: skip
    def priced(transport: Transport | None, chunks: int) -> Candidate:
        estimated = estimate(pattern, figures, shape, parts, bits, transport, chunks, replayed,
                             matmuls, inputs)  # fmt: skip
        order = None if transport is None else _ORDERS[(pattern, transport)]
        return Candidate.priced(transport, chunks, order, estimated)

    transports = [options.transport] if options.transport else list(Transport)
    if not figures.has_copy_engine and options.transport is None:
        transports.remove(Transport.COPY_ENGINE)
    if figures.device.arch and options.transport is None:
        # On GPUs the ring's sends and receives (NCCL, unbatched, on the default group) hung
        # with runs queued behind a busy GPU and faulted (an illegal address) in a
        # replayed backward (benchmarks/OWED.md, 2026-11-28): taken only when asked for
        transports.remove(Transport.RING)
    chunk_counts = [options.num_chunks] if options.num_chunks else [parts * k for k in (1, 2, 4)]
    candidates = []
    # Fixing a chunk count or a transport asks for a pipeline: no sequential candidate.
    wants_pipeline = options.num_chunks is not None or options.transport is not None
    if options.overlap is False or (options.overlap is None and not wants_pipeline):
        candidates.append(priced(None, 1))
    if options.overlap is False:
        return candidates
    for transport in transports:
        for chunks in chunk_counts:
            if transport is Transport.RING and chunks != parts and options.num_chunks is None:
                continue  # the model's ring moves one whole piece a step; more when forced
            candidates.append(priced(transport, chunks))
    return candidates


def plan_overlap(
    fusion: Fusion,
    figures: HardwareFigures,
    options: OverlapOptions | None = None,
    replayed: bool = False,
) -> OverlapPlan:
    """Decide the overlap of every pattern found in ``fusion``; changes nothing
    (``overlap.compile.apply_plan.stream_axes`` reads the plan).

    ``replayed``: runs replay a CUDA graph, so the host pays a replay and the copies of
    the inputs into the graph's buffers instead of issuing each step.
    """
    options = options or OverlapOptions()
    if options.transport is Transport.COPY_ENGINE and not figures.has_copy_engine:
        raise copy_engine_refused(f"{figures.name} has none")
    decisions = []
    for pattern, comm, contraction, row, chunked in find_patterns(fusion):
        parts = comm.in_layout.mesh.shape[comm.mesh_axis]
        if parts < 2:
            continue
        decision = _decide(pattern, comm, contraction, row, chunked, parts, figures, options,
                           replayed, len(fusion.inputs))  # fmt: skip
        if decision is not None:
            decisions.append(decision)
    return OverlapPlan(tuple(decisions))


def _local_matmul_shape(pattern, comm, contraction, row, chunked) -> tuple[int, int, int] | None:
    """``(M, K, N)`` of one rank's matmuls in the loop (N summed over the gathered rows'
    matmuls), M the whole rows; None when not static."""
    gathered = comm.output if pattern is Pattern.ALLGATHER_MATMUL else contraction.inputs[0]
    operand_shape = _static_local_shape(gathered)
    matmuls = [contraction, *(e for e, _ in chunked if isinstance(e, (MatmulOp, LinearOp)))]
    out_shapes = [_static_local_shape(matmul.outputs[0]) for matmul in matmuls]
    if operand_shape is None or None in out_shapes:
        return None
    return out_shapes[0][row], operand_shape[-1], sum(shape[-1] for shape in out_shapes)


def _decide(pattern, comm, contraction, row, chunked, parts, figures, options, replayed, inputs):
    shape = _local_matmul_shape(pattern, comm, contraction, row, chunked)
    if shape is None:
        if not (options.num_chunks and options.transport and options.overlap is not False):
            return None  # no static shapes, nothing forced: leave it whole
        chosen = Candidate(
            options.transport, options.num_chunks, _ORDERS[(pattern, options.transport)],
            float("nan"),
        )  # fmt: skip
        reason = "symbolic extents: the cost model needs static shapes; as forced"
        return OverlapDecision(pattern, comm, contraction, row, (0, 0, 0), parts, chosen,
                               reason, (chosen,), chunked)  # fmt: skip
    bits = comm.output.dtype.bits
    matmuls = 1 + sum(isinstance(expr, (MatmulOp, LinearOp)) for expr, _ in chunked)
    candidates = _candidates(pattern, figures, shape, parts, bits, options, replayed, matmuls,
                             inputs)  # fmt: skip
    best = min(candidates, key=lambda c: c.predicted_ms)
    sequential = next((c for c in candidates if c.transport is None), None)
    if sequential is None:
        reason = f"fastest predicted on {figures.name} among the forced candidates"
    elif best is sequential:
        reason = f"no pipeline is predicted faster than sequential on {figures.name}"
    elif best.predicted_ms > 0.97 * sequential.predicted_ms and options.overlap is None:
        reason = (
            f"overlap cannot pay on {figures.name}: the best pipeline "
            f"({best.predicted_ms:.3f} ms) saves under 3 % of the sequential "
            f"{sequential.predicted_ms:.3f} ms"
        )
        best = sequential
    else:
        reason = (
            f"fastest predicted on {figures.name}: {best.predicted_ms:.3f} ms against "
            f"{sequential.predicted_ms:.3f} ms sequential"
        )
    if figures.ranks is not None and parts != figures.ranks:
        reason += f" (link figures measured at {figures.ranks} ranks, not {parts})"
    forced = [name for name, value in vars(options).items() if value is not None]
    if forced:
        reason += f" (forced: {', '.join(forced)})"
    return OverlapDecision(pattern, comm, contraction, row, shape, parts, best, reason,
                           tuple(candidates), chunked)  # fmt: skip
