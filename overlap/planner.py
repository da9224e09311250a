"""The stream-lowering planner: whether and how to overlap a communication with a matmul.

It finds the two patterns that pay most, in a resharded fusion:

- ``allgather+matmul``: an all-gather along the rows feeding a matmul/linear
  (sequence-parallel all-gather, then a column-parallel linear);
- ``matmul+reduce_scatter``: a matmul/linear whose partial sum is
  reduce-scattered along its rows (row-parallel linear, then back to a
  sequence split).

For each it predicts, from a cost model fed by hardware figures (matmul rate,
link and copy-engine bandwidth, launch overhead, how much NCCL's kernels slow a
matmul down), the time of every candidate — no overlap, or ``C`` chunks (a
multiple of the team size) moved by a transport (``collective``, ``ring``,
``copy_engine``) in its order (local chunk first for copy-engine all-gathers,
last for reduce-scatters) — and picks the fastest. It chooses no overlap when
no candidate beats the sequential run by at least 3 %. Every choice prints
with its reason and the candidates' predictions; ``OverlapOptions`` overrides
any part of it.

The plan is applied by marking the rows of the communication's and the
matmul's outputs as ``Stream`` axes (with the chunk count) and setting the
communication's ``transport`` and ``order``; stream lowering does the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fusion.exprs import Expr, LinearOp, MatmulOp
from fusion.ir import Fusion, TensorView
from sharding.communication import Communication, CommunicationKind
from sharding.errors import ShardingError
from sharding.layout import layout_of, local_shape
from sharding.rules import dim_map

TRANSPORTS = ("collective", "ring", "copy_engine")
_ORDERS = {
    ("allgather+matmul", "collective"): "global",
    ("allgather+matmul", "ring"): "ring_gather",
    ("allgather+matmul", "copy_engine"): "local_first",
    ("matmul+reduce_scatter", "collective"): "global",
    ("matmul+reduce_scatter", "ring"): "ring_reduce",
    ("matmul+reduce_scatter", "copy_engine"): "local_last",
}


@dataclass(frozen=True)
class HardwareFigures:
    """Measured figures the cost model reads (see ``measure_hardware_figures``)."""

    name: str
    matmul_tflops: float  # dense matmul rate on large shapes, in the benchmark's dtype
    collective_gbps: float  # NCCL/gloo all-gather bandwidth, bytes received per rank per s
    p2p_gbps: float  # send/recv between neighbours
    copy_engine_gbps: float  # copy-engine pulls from a peer's symmetric buffer (0: none)
    memory_gbps: float  # local device copy, read + write
    launch_us: float  # host cost of one launched op or collective
    collective_slowdown: float  # matmul time factor while NCCL kernels run beside it
    sm_count: int = 132
    tile_rows: int = 128
    tile_cols: int = 256

    @property
    def has_copy_engine(self) -> bool:
        return self.copy_engine_gbps > 0


# Measured on 2x H200 (NVLink) by measure_hardware_figures, bf16, in the run recorded in
# benchmarks/results/ag_matmul.json.
H200_FIGURES = HardwareFigures(
    name="H200 (NVLink)",
    matmul_tflops=738.0,
    collective_gbps=197.0,
    p2p_gbps=197.0,
    copy_engine_gbps=349.0,
    memory_gbps=3670.0,
    launch_us=14.2,
    collective_slowdown=1.37,
)
# Processes on one CPU host talking through gloo: chunking rarely pays.
CPU_FIGURES = HardwareFigures(
    name="CPU (gloo)",
    matmul_tflops=0.1,
    collective_gbps=2.0,
    p2p_gbps=2.0,
    copy_engine_gbps=0.0,
    memory_gbps=10.0,
    launch_us=50.0,
    collective_slowdown=1.3,
    sm_count=2,
)


def default_hardware_figures(device: torch.device) -> HardwareFigures:
    """The recorded figures for this device's kind (measure for better ones)."""
    if device.type != "cuda":
        return CPU_FIGURES
    name = torch.cuda.get_device_name(device)
    if "H200" in name or "H100" in name:
        return replace(H200_FIGURES, name=name)
    return replace(H200_FIGURES, name=f"{name} (H200 figures, unmeasured)")


@dataclass(frozen=True)
class OverlapOptions:
    """User overrides; None leaves a choice to the planner.

    ``overlap=False`` keeps every communication whole; ``num_chunks`` fixes the chunk
    count (a multiple of the team size); ``transport`` one of ``collective``, ``ring``,
    ``copy_engine``. Fixing a chunk count or a transport implies overlap.
    """

    overlap: bool | None = None
    num_chunks: int | None = None
    transport: str | None = None

    def __post_init__(self) -> None:
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.num_chunks is not None and (
            not isinstance(self.num_chunks, int) or self.num_chunks < 1
        ):
            raise ValueError(f"num_chunks must be a positive int, got {self.num_chunks!r}")


@dataclass(frozen=True)
class Candidate:
    transport: str | None  # None: no overlap
    num_chunks: int
    order: str
    predicted_ms: float

    def describe(self) -> str:
        if self.transport is None:
            return "sequential (no overlap)"
        return f"{self.num_chunks} chunks, {self.transport}, {self.order} order"


@dataclass
class OverlapDecision:
    """The planner's choice for one pattern, with its reason and the alternatives."""

    pattern: str
    communication: Communication
    contraction: Expr
    shape: tuple[int, int, int]  # (M, K, N) of the local matmul, M the whole rows
    team_size: int
    chosen: Candidate
    reason: str
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def overlapped(self) -> bool:
        return self.chosen.transport is not None

    def __str__(self) -> str:
        m, k, n = self.shape
        lines = [
            f"{self.pattern} ({self.communication.op_name} {self.communication.output.name}, "
            f"{self.contraction.op_name} {self.contraction.outputs[0].name}; "
            f"M={m} K={k} N={n}, {self.team_size} ranks): {self.chosen.describe()}",
            f"  reason: {self.reason}",
        ]
        for candidate in sorted(self.candidates, key=lambda c: c.predicted_ms):
            mark = "*" if candidate == self.chosen else " "
            lines.append(f"  {mark} {candidate.predicted_ms:8.3f} ms  {candidate.describe()}")
        return "\n".join(lines)


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


def find_patterns(fusion: Fusion) -> list[tuple[str, Communication, Expr, int]]:
    """``(pattern, communication, contraction, row axis of the contraction's output)``."""
    found = []
    for expr in fusion.live_exprs():
        if not isinstance(expr, Communication) or expr.mesh_axis is None:
            continue
        if expr.kind is CommunicationKind.Allgather:
            for consumer in expr.output.uses:
                if isinstance(consumer, (MatmulOp, LinearOp)) and consumer.inputs[0] is expr.output:
                    row = _row_axis(consumer, expr.output, expr.in_dim)
                    if row is not None:
                        found.append(("allgather+matmul", expr, consumer, row))
                        break
        elif expr.kind is CommunicationKind.ReduceScatter:
            producer = expr.inputs[0].definition
            if (
                isinstance(producer, (MatmulOp, LinearOp))
                and expr.out_dim < producer.output.ndim - 1
            ):
                found.append(("matmul+reduce_scatter", expr, producer, expr.out_dim))
    return found


# ---------------------------------------------------------------------------
# The cost model


def _matmul_ms(figures: HardwareFigures, rows: int, k: int, n: int) -> float:
    """A matmul's time, with the wave quantization of a tiled kernel over the SMs."""
    if rows <= 0:
        return 0.0
    tiles = math.ceil(rows / figures.tile_rows) * math.ceil(n / figures.tile_cols)
    waves = math.ceil(tiles / figures.sm_count)
    efficiency = (tiles / figures.sm_count) / waves
    ideal_ms = 2 * rows * k * n / (figures.matmul_tflops * 1e9)
    return ideal_ms / max(efficiency, 1e-3) + figures.launch_us / 1e3


def _transfer_ms(bytes_moved: float, gbps: float, launch_us: float) -> float:
    return bytes_moved / (gbps * 1e6) + launch_us / 1e3


def _pipeline_ms(compute: list[float], transfer: list[float], gather: bool) -> float:
    """Two engines, one for compute and one for transfers, chunk by chunk.

    ``gather``: a chunk's compute waits for its transfer; else its transfer waits for
    its compute (a reduce-scatter).
    """
    compute_end = transfer_end = 0.0
    for compute_ms, transfer_ms in zip(compute, transfer, strict=True):
        if gather:
            transfer_end += transfer_ms
            compute_end = max(compute_end, transfer_end) + compute_ms
        else:
            compute_end += compute_ms
            transfer_end = max(transfer_end, compute_end) + transfer_ms
    return max(compute_end, transfer_end)


# The host issues a host program step by step (about one launch each); a pipeline of C
# chunks takes about FIXED + PER_CHUNK * C steps, a sequential run SEQUENTIAL_STEPS. When
# the GPU work is shorter than that, the host is the limit.
SEQUENTIAL_STEPS = 6
PIPELINE_FIXED_STEPS = 8
PIPELINE_STEPS_PER_CHUNK = 12


GRAPH_REPLAY_MS = 0.015  # the host's cost of replaying a captured CUDA graph


def host_ms(
    figures: HardwareFigures, transport: str | None, chunks: int, replayed: bool = False
) -> float:
    """The host's time to issue one run of a candidate (a graph replay when ``replayed``)."""
    if replayed:
        return GRAPH_REPLAY_MS
    steps = (
        SEQUENTIAL_STEPS
        if transport is None
        else PIPELINE_FIXED_STEPS + PIPELINE_STEPS_PER_CHUNK * chunks
    )
    return steps * figures.launch_us / 1e3


def predict(
    pattern: str,
    figures: HardwareFigures,
    shape: tuple[int, int, int],
    parts: int,
    bits: int,
    transport: str | None,
    chunks: int,
    replayed: bool = False,
) -> float:
    """Predicted time (ms) of one pattern on the slowest rank: the device's time, or the
    host's time to issue the run if that is longer (``replayed``: from a CUDA graph)."""
    return max(
        _device_ms(pattern, figures, shape, parts, bits, transport, chunks),
        host_ms(figures, transport, chunks, replayed),
    )


def _device_ms(
    pattern: str,
    figures: HardwareFigures,
    shape: tuple[int, int, int],
    parts: int,
    bits: int,
    transport: str | None,
    chunks: int,
) -> float:
    m, k, n = shape
    moved_width = k if pattern == "allgather+matmul" else n
    total_bytes = m * moved_width * bits / 8 * (parts - 1) / parts
    if transport is None:
        comm = _transfer_ms(total_bytes, figures.collective_gbps, figures.launch_us)
        return _matmul_ms(figures, m, k, n) + comm
    rows = [m // chunks + (1 if c < m % chunks else 0) for c in range(chunks)]
    per_rank = chunks // parts
    if transport == "copy_engine":
        gbps, slowdown = figures.copy_engine_gbps, 1.0
    elif transport == "ring":
        gbps, slowdown = figures.p2p_gbps, figures.collective_slowdown
    else:
        gbps, slowdown = figures.collective_gbps, figures.collective_slowdown
    compute = [_matmul_ms(figures, r, k, n) * slowdown for r in rows]
    chunk_bytes = [r * moved_width * bits / 8 for r in rows]
    if transport == "copy_engine":
        # Own chunks need no transfer; the peers' arrive one after another, after this
        # rank's piece is staged for them (beside the first matmuls, on its own stream).
        own = set(range(per_rank))
        staging = (m / parts) * k * bits / 8 * 2 / (figures.memory_gbps * 1e6)
        transfer = [
            0.0 if c in own else _transfer_ms(b, gbps, figures.launch_us)
            for c, b in enumerate(chunk_bytes)
        ]
        if pattern == "allgather+matmul":
            transfer[per_rank % chunks] += staging
            return _pipeline_ms(compute, transfer, gather=True)
        transfer = transfer[per_rank:] + transfer[:per_rank]  # own chunks last
        combine = (m / parts) * n * bits / 8 * (parts + 1) / (figures.memory_gbps * 1e6)
        return _pipeline_ms(compute, transfer, gather=False) + combine
    if transport == "ring":
        # Every link carries one chunk per step; a rank's first chunks are its own.
        transfer = [
            0.0 if c < per_rank else _transfer_ms(b, gbps, figures.launch_us)
            for c, b in enumerate(chunk_bytes)
        ]
        return _pipeline_ms(compute, transfer, gather=pattern == "allgather+matmul")
    # Collective: one collective per chunk, in the same global order on every rank; the
    # last owner waits longest (all-gather) or its chunks come last (reduce-scatter).
    transfer = [_transfer_ms(b * (parts - 1), gbps * (parts - 1), figures.launch_us)
                for b in chunk_bytes]  # fmt: skip
    return _pipeline_ms(compute, transfer, gather=pattern == "allgather+matmul")


def _candidates(
    pattern: str, figures: HardwareFigures, shape, parts: int, bits: int, options, replayed
) -> list[Candidate]:
    transports = [options.transport] if options.transport else list(TRANSPORTS)
    if not figures.has_copy_engine and options.transport is None:
        transports.remove("copy_engine")
    chunk_counts = [options.num_chunks] if options.num_chunks else [parts * k for k in (1, 2, 4)]
    candidates = []
    # Fixing a chunk count or a transport asks for a pipeline: no sequential candidate.
    wants_pipeline = options.num_chunks is not None or options.transport is not None
    if options.overlap is False or (options.overlap is None and not wants_pipeline):
        candidates.append(
            Candidate(
                None, 1, "-", predict(pattern, figures, shape, parts, bits, None, 1, replayed)
            )
        )
    if options.overlap is False:
        return candidates
    for transport in transports:
        for chunks in chunk_counts:
            if transport == "ring" and chunks != parts and options.num_chunks is None:
                continue  # the model's ring moves one whole piece a step; more when forced
            time_ms = predict(pattern, figures, shape, parts, bits, transport, chunks, replayed)
            candidates.append(Candidate(transport, chunks, _ORDERS[(pattern, transport)], time_ms))
    return candidates


def plan_overlap(
    fusion: Fusion,
    figures: HardwareFigures,
    options: OverlapOptions | None = None,
    replayed: bool = False,
) -> list[OverlapDecision]:
    """Decide, apply and return the overlap of every pattern found in ``fusion``.

    ``replayed``: runs replay a CUDA graph, so the host's cost of issuing a long
    pipeline does not count.
    """
    options = options or OverlapOptions()
    if options.transport == "copy_engine" and not figures.has_copy_engine:
        raise ShardingError(
            f"the copy_engine transport needs CUDA devices with symmetric memory; "
            f"{figures.name} has none. Use collective or ring"
        )
    decisions = []
    for pattern, comm, contraction, row in find_patterns(fusion):
        parts = comm.in_layout.mesh.shape[comm.mesh_axis]
        if parts < 2:
            continue
        decision = _decide(pattern, comm, contraction, row, parts, figures, options, replayed)
        if decision is None:
            continue
        if decision.overlapped:
            _apply(decision, row)
        decisions.append(decision)
    return decisions


def _local_matmul_shape(pattern, comm, contraction, row) -> tuple[int, int, int] | None:
    """``(M, K, N)`` of one rank's matmul, M the whole rows; None when not static."""
    gathered = comm.output if pattern == "allgather+matmul" else contraction.inputs[0]
    operand_shape = _static_local_shape(gathered)
    out_shape = _static_local_shape(contraction.outputs[0])
    if operand_shape is None or out_shape is None:
        return None
    return out_shape[row], operand_shape[-1], out_shape[-1]


def _decide(pattern, comm, contraction, row, parts, figures, options, replayed):
    shape = _local_matmul_shape(pattern, comm, contraction, row)
    if shape is None:
        if not (options.num_chunks and options.transport and options.overlap is not False):
            return None  # no static shapes, nothing forced: leave it whole
        chosen = Candidate(
            options.transport, options.num_chunks, _ORDERS[(pattern, options.transport)],
            float("nan"),
        )  # fmt: skip
        reason = "symbolic extents: the cost model needs static shapes; as forced"
        return OverlapDecision(pattern, comm, contraction, (0, 0, 0), parts, chosen, reason,
                               [chosen])  # fmt: skip
    bits = comm.output.dtype.bits
    candidates = _candidates(pattern, figures, shape, parts, bits, options, replayed)
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
    forced = [name for name, value in vars(options).items() if value is not None]
    if forced:
        reason += f" (forced: {', '.join(forced)})"
    return OverlapDecision(pattern, comm, contraction, shape, parts, best, reason, candidates)


def _apply(decision: OverlapDecision, row: int) -> None:
    """Mark the pattern's rows as a Stream axis and set the transport on the communication."""
    chosen = decision.chosen
    comm, contraction = decision.communication, decision.contraction
    out = contraction.outputs[0]
    out.axis(row).stream(chosen.num_chunks)
    comm_dim = comm.in_dim if decision.pattern == "allgather+matmul" else comm.out_dim
    comm.output.axis(comm_dim).stream(chosen.num_chunks)
    comm.transport = chosen.transport
    comm.order = chosen.order


def _median_ms(function, repeats: int = 10) -> float:
    """Median time of ``function()`` on the current CUDA stream, after a warm-up."""
    function()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        function()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_hardware_figures(communicator, dtype: torch.dtype = torch.bfloat16) -> HardwareFigures:
    """Measure the cost model's figures on this rank's GPU and its peers (collective).

    Takes about a second: a large matmul alone and beside an NCCL all-gather, an
    all-gather, a copy-engine pull from a peer's symmetric buffer, a local copy, and
    the host cost of a small launch. Every rank gets the slowest rank's figures.
    """
    import torch.distributed as dist

    device = communicator.device
    if device.type != "cuda":
        return CPU_FIGURES
    m = k = 8192
    n = 4096
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    matmul_ms = _median_ms(lambda: torch.mm(a, b))
    world = communicator.world_size
    piece = torch.randn(64 * 2**20 // 2, device=device, dtype=dtype)
    gathered = torch.empty(world * piece.numel(), device=device, dtype=dtype)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_ms = _median_ms(lambda: gather(gathered, piece))
    side = torch.cuda.Stream(device)

    def matmul_beside_gather() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            gather(gathered, piece)
        torch.mm(a, b)
        torch.cuda.current_stream(device).wait_stream(side)

    beside_ms = _median_ms(matmul_beside_gather)
    big = torch.empty(2**28, device=device, dtype=torch.uint8)
    copy_ms = _median_ms(lambda: big.clone())
    launch_ms = _median_ms(lambda: [piece[:1].add_(0) for _ in range(100)]) / 100
    copy_engine_gbps = 0.0
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(piece.numel(), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        peer = handle.get_buffer((communicator.rank + 1) % world, (piece.numel(),), dtype)
        pulled = torch.empty_like(piece)
        handle.barrier(channel=0)
        pull_ms = _median_ms(lambda: pulled.copy_(peer))
        handle.barrier(channel=0)
        copy_engine_gbps = piece.numel() * piece.element_size() / (pull_ms * 1e6)
    except (ImportError, RuntimeError):
        pass
    received = (world - 1) * piece.numel() * piece.element_size()
    figures = torch.tensor(
        [
            2 * m * k * n / (matmul_ms * 1e9),
            received / (gather_ms * 1e6),
            copy_engine_gbps,
            2 * big.numel() / (copy_ms * 1e6),
            launch_ms * 1e3,
            max(beside_ms, matmul_ms) / matmul_ms,
        ],
        device=device,
        dtype=torch.float64,
    )
    slowest = figures.clone()
    slowest[[0, 1, 2, 3]] *= -1  # rates: take the minimum through a MAX all-reduce
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest[[0, 1, 2, 3]] *= -1
    rate, gbps, copy_gbps, memory, launch_us, slowdown = slowest.tolist()
    return HardwareFigures(
        name=f"{torch.cuda.get_device_name(device)} x{world} (measured)",
        matmul_tflops=rate,
        collective_gbps=gbps,
        p2p_gbps=gbps,
        copy_engine_gbps=copy_gbps,
        memory_gbps=memory,
        launch_us=launch_us,
        collective_slowdown=min(slowdown, 2.0),
        sm_count=torch.cuda.get_device_properties(device).multi_processor_count,
    )
