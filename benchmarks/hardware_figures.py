"""The planner's cost-model figures, measured on this host's GPUs (collective).

    from benchmarks.hardware_figures import measure_hardware_figures
    figures = measure_hardware_figures(communicator)  # every rank, together

``benchmarks/ag_matmul.py`` plans with these; ``overlap.figures.H200_FIGURES`` records a
measurement of 2x H200.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from overlap.figures import CPU_FIGURES, HardwareFigures
from schedulers.hardware import current_hardware


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
    profile = current_hardware(device)
    return HardwareFigures(
        name=f"{profile.name} x{world} (measured)",
        device=replace(profile, memory_gbps=memory),
        matmul_tflops=rate,
        collective_gbps=gbps,
        p2p_gbps=gbps,
        copy_engine_gbps=copy_gbps,
        launch_us=launch_us,
        collective_slowdown=min(slowdown, 2.0),
        ranks=world,
    )
