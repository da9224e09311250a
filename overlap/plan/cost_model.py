"""The planner's cost model: the predicted time of one pattern, sequential or pipelined.

Two engines, one for compute and one for transfers, chunk by chunk; the matmul's wave
quantization over the SMs; the host's cost of issuing a program step by step (unless a
CUDA graph replays it). ``predict`` is the slowest rank's time, the device's or the
host's, whichever is longer.
"""

from __future__ import annotations

import enum
import math

from overlap.ir import Transport
from overlap.plan.figures import HardwareFigures


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


# The host issues a host program step by step (about one launch each); a pipeline of C
# chunks takes about FIXED + PER_CHUNK * C steps, a sequential run SEQUENTIAL_STEPS. When
# the GPU work is shorter than that, the host is the limit.
SEQUENTIAL_STEPS = 6
PIPELINE_FIXED_STEPS = 8
PIPELINE_STEPS_PER_CHUNK = 12


GRAPH_REPLAY_MS = 0.015  # the host's cost of replaying a captured CUDA graph


def host_ms(
    figures: HardwareFigures, transport: Transport | None, chunks: int, replayed: bool = False
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


def predict(
    pattern: Pattern,
    figures: HardwareFigures,
    shape: tuple[int, int, int],
    parts: int,
    bits: int,
    transport: Transport | None,
    chunks: int,
    replayed: bool = False,
) -> float:
    """Predicted time (ms) of one pattern on the slowest rank: the device's time, or the
    host's time to issue the run if that is longer (``replayed``: from a CUDA graph).
    The pattern and transport may be given by name. Figures with a divisor of 0 raise
    ``ValueError`` (``check_figures``)."""
    pattern = Pattern(pattern)
    transport = None if transport is None else Transport(transport)
    check_figures(figures, transport)
    return max(
        _device_ms(pattern, figures, shape, parts, bits, transport, chunks),
        host_ms(figures, transport, chunks, replayed),
    )


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
