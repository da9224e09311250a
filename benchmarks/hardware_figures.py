"""The planner's cost-model figures, measured on this host's GPUs (collective).

    from benchmarks.hardware_figures import measure_hardware_figures
    figures = measure_hardware_figures(communicator)  # every rank, together

``benchmarks/ag_matmul.py`` plans with these; ``overlap.plan.figures.H200_FIGURES`` records a
measurement of 2x H200.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from overlap import HardwareFigures
from overlap.plan.figures import CPU_FIGURES
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


def _pull_all(peers: list, targets: list, streams: list, device: torch.device) -> None:
    """Copy every peer's buffer at once, each on a stream of its own."""
    current = torch.cuda.current_stream(device)
    for stream, target, source in zip(streams, targets, peers, strict=True):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            target.copy_(source)
    for stream in streams:
        current.wait_stream(stream)


def measure_hardware_figures(communicator, dtype: torch.dtype = torch.bfloat16) -> HardwareFigures:
    """Measure the cost model's figures on this rank's GPU and its peers (collective).

    Takes about a second: a large matmul alone and beside an NCCL all-gather, an
    all-gather, a send/receive around the ring, copy-engine pulls from peers'
    symmetric buffers (one peer, then every peer at once), a local copy, and the host
    cost of a small launch. Every rank gets the slowest rank's figures.
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
    p2p_gbps = 0.0  # 0: the all-gather's, on one GPU
    if world > 1:  # every rank sends to its successor and receives from its predecessor
        rank = communicator.rank
        received_piece = torch.empty_like(piece)

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, piece, (rank + 1) % world),
                   dist.P2POp(dist.irecv, received_piece, (rank - 1) % world)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        p2p_gbps = piece.numel() * piece.element_size() / (_median_ms(exchange) * 1e6)
    big = torch.empty(2**28, device=device, dtype=torch.uint8)
    copy_ms = _median_ms(lambda: big.clone())
    launch_ms = _median_ms(lambda: [piece[:1].add_(0) for _ in range(100)]) / 100
    copy_engine_gbps = all_peers_gbps = 0.0
    piece_bytes = piece.numel() * piece.element_size()
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(piece.numel(), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        peers = [  # on one GPU, its own buffer
            handle.get_buffer(peer, (piece.numel(),), dtype)
            for peer in range(world)
            if peer != communicator.rank or world == 1
        ]
        pulled = [torch.empty_like(piece) for _ in peers]
        handle.barrier(channel=0)
        # one peer at a time (every rank pulls from its successor, as the pipelines'
        # staggered pulls do), then every peer at once, each pull on a stream of its own
        successor = peers[communicator.rank % len(peers)]
        pull_ms = _median_ms(lambda: pulled[0].copy_(successor))
        streams = [torch.cuda.Stream(device) for _ in peers]
        all_ms = _median_ms(lambda: _pull_all(peers, pulled, streams, device))
        handle.barrier(channel=0)
        copy_engine_gbps = piece_bytes / (pull_ms * 1e6)
        all_peers_gbps = len(peers) * piece_bytes / (all_ms * 1e6)
    except (ImportError, RuntimeError):
        pass
    received = (world - 1) * piece.numel() * piece.element_size()
    figures = torch.tensor(
        [
            2 * m * k * n / (matmul_ms * 1e9),
            received / (gather_ms * 1e6),
            copy_engine_gbps,
            2 * big.numel() / (copy_ms * 1e6),
            all_peers_gbps,
            p2p_gbps,
            launch_ms * 1e3,
            max(beside_ms, matmul_ms) / matmul_ms,
        ],
        device=device,
        dtype=torch.float64,
    )
    slowest = figures.clone()
    rates = [0, 1, 2, 3, 4, 5]
    slowest[rates] *= -1  # rates: take the minimum through a MAX all-reduce
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest[rates] *= -1
    rate, gbps, copy_gbps, memory, all_peers, p2p, launch_us, slowdown = slowest.tolist()
    profile = current_hardware(device)
    return HardwareFigures(
        name=f"{profile.name} x{world} (measured)",
        device=replace(profile, memory_gbps=memory),
        matmul_tflops=rate,
        collective_gbps=gbps,
        p2p_gbps=p2p or gbps,
        copy_engine_gbps=copy_gbps,
        copy_engine_all_peers_gbps=all_peers,
        launch_us=launch_us,
        collective_slowdown=min(slowdown, 2.0),
        ranks=world,
    )
