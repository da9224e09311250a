"""The planner's cost model: the predicted time of one pattern, sequential or pipelined.

Two engines, one for compute and one for transfers, chunk by chunk; the matmul's wave
quantization over the SMs; the host's cost of issuing a program step by step, each step
priced by its kind (``overlap.plan.host_steps``, ``HostFigures``), or of replaying it
from a CUDA graph. ``estimate`` gives both the device's and the host's time; ``predict``
the slowest rank's time, the device's or the host's, whichever is longer.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from overlap.ir import HostProgram, Transport
from overlap.plan.figures import HardwareFigures
from overlap.plan.host_steps import HostStep, issued_steps, pattern_steps, step_counts


class Pattern(enum.StrEnum):
    """The communication-and-matmul pairs the planner can pipeline."""

    ALLGATHER_MATMUL = "allgather+matmul"
    MATMUL_REDUCE_SCATTER = "matmul+reduce_scatter"


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


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted time on the slowest rank: the device's, and the host's to
    issue it (``host_steps`` steps, unless a CUDA graph replays it); the run takes the
    longer of the two."""

    device_ms: float
    host_ms: float
    host_steps: int

    @property
    def predicted_ms(self) -> float:
        return max(self.device_ms, self.host_ms)


def host_ms(
    figures: HardwareFigures, steps: Mapping[HostStep, int], inputs: int, replayed: bool = False
) -> float:
    """The host's time (ms) to issue a call of ``steps`` step by step (the call's fixed
    cost included), or with ``replayed`` to replay it from a CUDA graph, ``inputs`` of
    its inputs copied into the graph's buffers."""
    host = figures.host
    return (host.replay_us(inputs) if replayed else host.issue_us(steps)) / 1e3


def check_figures(figures: HardwareFigures, transport: Transport | None) -> None:
    """Raise ``ValueError`` naming the device and each figure the pattern's cost divides
    by that is not above 0 (a device with nothing measured or recorded for it), instead
    of a ``ZeroDivisionError`` deep in the model."""
    divisors = {
        "SMs (sm_count)": figures.sm_count,
        "matmul rate (matmul_tflops)": figures.matmul_tflops,
        "copy bandwidth (memory_gbps)": figures.memory_gbps,
        "collective bandwidth (collective_gbps)": figures.collective_gbps,
        "send/receive bandwidth (p2p_gbps)": figures.p2p_gbps,
    }
    if transport is Transport.COPY_ENGINE:
        divisors["copy-engine bandwidth (copy_engine_gbps)"] = figures.copy_engine_gbps
    missing = [name for name, value in divisors.items() if not value > 0]  # NaN too
    if missing:
        raise ValueError(
            f"the overlap cost model cannot price a pattern on {figures.name} (device "
            f"{figures.device.name}): no {', '.join(missing)}. Figures measured on one rank "
            "have no links; measure this device's figures for the team "
            "(overlap.comm.measure.device_figures) or pass figures=HardwareFigures(...)"
        )


def estimate(
    pattern: Pattern,
    figures: HardwareFigures,
    shape: tuple[int, int, int],
    parts: int,
    bits: int,
    transport: Transport | None,
    chunks: int,
    replayed: bool = False,
    matmuls: int = 1,
    inputs: int = 2,
) -> Estimate:
    """The device's and the host's time (ms) of one pattern on the slowest rank.

    ``transport`` None: sequential; else a pipeline of ``chunks`` chunks. The host issues
    the steps the pattern's lowering gives a rank (``host_steps.pattern_steps``: an
    all-gather's pipeline runs its ``matmuls`` matmuls chunk by chunk) plus a call's
    fixed cost, as a call that runs the pattern alone would; ``replayed``: it replays a
    CUDA graph instead, copying ``inputs`` inputs in. The pattern and transport may be
    given by name. Figures with a divisor of 0 raise ``ValueError`` (``check_figures``)."""
    pattern = Pattern(pattern)
    transport = None if transport is None else Transport(transport)
    check_figures(figures, transport)
    gather = pattern is Pattern.ALLGATHER_MATMUL
    steps = pattern_steps(gather, transport, chunks, matmuls, figures.host.streams)
    return Estimate(
        _device_ms(pattern, figures, shape, parts, bits, transport, chunks),
        host_ms(figures, steps, inputs, replayed),
        steps.total(),
    )


def predict(*args: object, **kwargs: object) -> float:
    """Predicted time (ms) of one pattern on the slowest rank, ``estimate``'s arguments:
    the device's time, or the host's time to issue the run if that is longer."""
    return estimate(*args, **kwargs).predicted_ms


def _device_ms(
    pattern: Pattern,
    figures: HardwareFigures,
    shape: tuple[int, int, int],
    parts: int,
    bits: int,
    transport: Transport | None,
    chunks: int,
) -> float:
    m, k, n = shape
    moved_width = k if pattern is Pattern.ALLGATHER_MATMUL else n
    total_bytes = m * moved_width * bits / 8 * (parts - 1) / parts
    if transport is None:
        comm = _transfer_ms(total_bytes, figures.collective_gbps, figures.launch_us)
        return _matmul_ms(figures, m, k, n) + comm
    rows = [m // chunks + (1 if c < m % chunks else 0) for c in range(chunks)]
    per_rank = chunks // parts
    if transport is Transport.COPY_ENGINE:
        gbps, slowdown = figures.copy_engine_gbps, 1.0
    elif transport is Transport.RING:
        gbps, slowdown = figures.p2p_gbps, figures.collective_slowdown
    else:
        gbps, slowdown = figures.collective_gbps, figures.collective_slowdown
    compute = [_matmul_ms(figures, r, k, n) * slowdown for r in rows]
    chunk_bytes = [r * moved_width * bits / 8 for r in rows]
    if transport is Transport.COPY_ENGINE:
        # Own chunks need no transfer; the peers' arrive one after another (each pull
        # waits for the one before: overlap.comm.symmetric), after this rank's piece is staged
        # for them (beside the first matmuls, on its own stream).
        own = set(range(per_rank))
        staging = (m / parts) * k * bits / 8 * 2 / (figures.memory_gbps * 1e6)
        transfer = [
            0.0 if c in own else _transfer_ms(b, gbps, figures.launch_us)
            for c, b in enumerate(chunk_bytes)
        ]
        if pattern is Pattern.ALLGATHER_MATMUL:
            transfer[per_rank % chunks] += staging
            return _pipeline_ms(compute, transfer, gather=True)
        transfer = transfer[per_rank:] + transfer[:per_rank]  # own chunks last
        combine = (m / parts) * n * bits / 8 * (parts + 1) / (figures.memory_gbps * 1e6)
        return _pipeline_ms(compute, transfer, gather=False) + combine
    if transport is Transport.COLLECTIVE and pattern is Pattern.MATMUL_REDUCE_SCATTER:
        # Every partial goes whole to its owner, each rank sending one chunk and
        # receiving one an iteration (local_last order: its own chunks come last and
        # send nothing); at each of its own iterations the owner combines the chunk's
        # partials, in one pass over them, once the last has come in.
        sent = chunks - per_rank
        transfer = [_transfer_ms(b, figures.p2p_gbps, figures.launch_us)
                    for b in chunk_bytes[:sent]]  # fmt: skip
        end = _pipeline_ms(compute[:sent], transfer, gather=False)
        combine_ms = sum(chunk_bytes[sent:]) * (parts + 1) / (figures.memory_gbps * 1e6)
        return max(end, sum(compute)) + combine_ms
    if transport is Transport.RING:
        # Every link carries one chunk per step; a rank's first chunks are its own.
        transfer = [
            0.0 if c < per_rank else _transfer_ms(b, gbps, figures.launch_us)
            for c, b in enumerate(chunk_bytes)
        ]
        return _pipeline_ms(compute, transfer, gather=pattern is Pattern.ALLGATHER_MATMUL)
    # Collective all-gather: one broadcast per chunk, in the same global order on every
    # rank; the last owner waits longest.
    transfer = [_transfer_ms(b * (parts - 1), gbps * (parts - 1), figures.launch_us)
                for b in chunk_bytes]  # fmt: skip
    return _pipeline_ms(compute, transfer, gather=pattern is Pattern.ALLGATHER_MATMUL)


def describe_host(
    figures: HardwareFigures, program: HostProgram, world_size: int, replayed: bool
) -> str:
    """The host's predicted time a call of ``program`` on its slowest rank: issued step
    by step (its steps by kind), and replayed from a CUDA graph where ``replayed``
    (``host 0.312 ms a call step by step, rank 0 (34 steps: ...)``)."""
    streams = figures.host.streams
    counted = [step_counts(issued_steps(program, rank, streams)) for rank in range(world_size)]
    rank = max(range(world_size), key=lambda r: figures.host.issue_us(counted[r]))
    counts = counted[rank]
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.most_common())
    inputs = len(program.fusion.inputs)
    lines = [
        f"host: {host_ms(figures, counts, inputs):.3f} ms a call step by step, rank {rank} "
        f"({counts.total()} steps: {kinds})"
    ]
    if replayed:
        lines.append(f"  replayed from a CUDA graph (as planned): "
                     f"{host_ms(figures, counts, inputs, replayed=True):.3f} ms a call, "
                     f"{inputs} inputs copied in")  # fmt: skip
    lines.append(f"  host figures: {figures.host.source}")
    return "\n".join(lines)
