"""Measuring the cost model's figures on this rank's GPU and the links to its peers.

``device_figures`` is what an executor plans with: the recorded figures of an H100 or
H200 (``overlap.plan.figures.RECORDED_FIGURES``), the CPU's off CUDA, and for any other
GPU figures measured at its first build and kept on disk for the runs after: its copy
bandwidth (``schedulers.hardware``, one device's), the all-gather bandwidth between the
ranks and whether (and how fast) a rank pulls from a peer's symmetric buffer
(``measure_links``, under a second), and how fast its host issues work (``host_probe_us``,
a few ms: the recorded host figures are scaled by it). ``measure_hardware_figures``
measures all of the figures, as the recorded ones were (``benchmarks/ag_matmul.py``,
``benchmarks/blocks.py``); the host's cost of each kind of step is measured on the
rank programs themselves by ``benchmarks/host_figures.py``.

Links are measured together: every rank says whether it has them kept for this team (its
device, rank and host count, torch version), and all measure if any has not; every rank
then plans with the slowest rank's figures, so that all plan the same program.

Example (on every rank of a placed fusion's team, at the same point)::

    figures = device_figures(communicator.device, communicator)
"""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from overlap.plan.figures import (
    CPU_FIGURES,
    HardwareFigures,
    LinkFigures,
    host_figures_for,
    measured_figures,
    read_host_probe,
    read_link_figures,
    recorded_figures,
    write_host_probe,
    write_link_figures,
)
from schedulers.hardware import current_hardware, measure_copy_gbps, median_ms

LINK_PIECE_BYTES = 16 * 2**20  # each rank's piece of the first-use all-gather and pulls
HOST_PROBE_CALLS, HOST_PROBE_ROUNDS = 40, 3  # a few ms on a GPU's host


def device_figures(device: torch.device, communicator=None) -> HardwareFigures:
    """The figures to plan with on ``device``, the same on every rank of
    ``communicator``'s world (collective when it has more than one rank and the device is
    a GPU: every rank calls it at the same point; None: one rank, nothing exchanged).

    Raises ``RuntimeError`` on every rank when their GPUs, not all of them recorded,
    are of different kinds: the links are measured for one kind."""
    if device.type != "cuda":
        return CPU_FIGURES
    profile = current_hardware(device)
    ranks = communicator.world_size if communicator is not None else 1
    if ranks == 1:
        return recorded_figures(profile) or measured_figures(profile, 1, None, kept_probe(device))
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    said = communicator.all_gather_object(
        (profile.name, profile.memory_gbps, socket.gethostname(), uuid)
    )
    names = sorted({name for name, _, _, _ in said})
    if all(recorded_figures(replace(profile, name=name)) for name in names):
        return recorded_figures(profile, ranks)
    if len(names) > 1:
        raise RuntimeError(
            f"the ranks run on GPUs of different kinds ({', '.join(names)}), not all of them "
            "with recorded figures: measuring the links needs one kind on every rank; pass "
            "figures=HardwareFigures(...) to the executor"
        )
    hosts = [host for _, _, host, _ in said]
    probe_us = max(communicator.all_gather_object(kept_probe(device)))  # the slowest host's
    profile = replace(profile, memory_gbps=min(memory for _, memory, _, _ in said))
    kept = communicator.all_gather_object(read_link_figures(profile.name, ranks, len(set(hosts))))
    if any(links is None for links in kept):
        links = measure_links(communicator, hosts, [uuid for _, _, _, uuid in said])
        write_link_figures(profile.name, ranks, len(set(hosts)), links)
    else:
        links = LinkFigures(
            min(links.collective_gbps for links in kept),
            min(links.copy_engine_gbps for links in kept),
        )
    return measured_figures(profile, ranks, links, probe_us)


def kept_probe(device: torch.device) -> float:
    """This host's probe time for ``device``'s kind (``host_probe_us``): kept on disk
    from an earlier run, or measured now and kept."""
    name, host = current_hardware(device).name, socket.gethostname()
    probe_us = read_host_probe(name, host)
    if probe_us is None:
        probe_us = host_probe_us(device)
        write_host_probe(name, host, probe_us)
    return probe_us


def host_probe_us(device: torch.device) -> float:
    """How long this host takes to issue one round of small work on ``device`` (us): a
    small allocation, a view, a pointwise launch and a small matmul, and on CUDA a
    stream switch there and back and a stream wait; the median of a few rounds of
    calls, the device synchronized before each (a few ms). What the recorded host
    figures were measured beside (``HostFigures.probe_us``), so that another host's can
    be scaled from them."""
    x = torch.ones(64, 64, device=device)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None

    def issue() -> None:
        torch.empty(256, device=device)
        y = x.narrow(0, 0, 32)
        y.add_(1.0)
        torch.mm(x, x)
        if cuda:
            current = torch.cuda.current_stream(device)
            torch.cuda.set_stream(side)
            torch.cuda.set_stream(current)
            current.wait_stream(side)

    rounds = []
    for _ in range(HOST_PROBE_ROUNDS + 1):  # the first warms up, untimed
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(HOST_PROBE_CALLS):
            issue()
        rounds.append((time.perf_counter() - start) / HOST_PROBE_CALLS * 1e6)
    if cuda:
        torch.cuda.synchronize(device)
    return sorted(rounds[1:])[len(rounds[1:]) // 2]


def measure_links(communicator, hosts: list[str], uuids: list[str]) -> LinkFigures:
    """The links between the ranks (collective: every rank, at the same point), the
    slowest rank's: the all-gather bandwidth, and a pull from the next rank's symmetric
    buffer where every rank's GPU can map its peers' memory (one host, peer access
    between the GPUs each rank sees, symmetric memory), else 0. ``hosts`` and ``uuids``:
    every rank's host name and GPU, in rank order."""
    device = communicator.device
    with torch.cuda.device(device):
        piece = torch.randn(LINK_PIECE_BYTES // 2, device=device, dtype=torch.bfloat16)
        collective_gbps = gather_gbps(communicator, piece)
        reachable = len(set(hosts)) == 1 and _peer_access(device, uuids)
        copy_engine_gbps = 0.0
        if all(communicator.all_gather_object(reachable)):
            copy_engine_gbps, _ = pull_gbps(communicator, piece)
        slowest = torch.tensor(
            [collective_gbps, copy_engine_gbps], device=device, dtype=torch.float64
        )
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    return LinkFigures(*slowest.tolist())


def _peer_access(device: torch.device, uuids: list[str]) -> bool:
    """Whether this rank's GPU reaches every peer GPU this process sees (one that it does
    not see, hidden by ``CUDA_VISIBLE_DEVICES``, is left to symmetric memory to map)."""
    own = device.index if device.index is not None else torch.cuda.current_device()
    seen = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    peers = [seen[uuid] for uuid in uuids if uuid in seen and seen[uuid] != own]
    return all(torch.cuda.can_device_access_peer(own, peer) for peer in peers)


def gather_gbps(communicator, piece: torch.Tensor) -> float:
    """Bytes a rank receives a second in an all-gather of every rank's ``piece``
    (collective)."""
    gathered = piece.new_empty(communicator.world_size * piece.numel())
    gather_ms = median_ms(lambda: dist.all_gather_into_tensor(gathered, piece))
    received = (communicator.world_size - 1) * piece.numel() * piece.element_size()
    return received / (gather_ms * 1e6)


def _pull_all(peers: list, targets: list, streams: list, device: torch.device) -> None:
    """Copy every peer's buffer at once, each on a stream of its own."""
    current = torch.cuda.current_stream(device)
    for stream, target, source in zip(streams, targets, peers, strict=True):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            target.copy_(source)
    for stream in streams:
        current.wait_stream(stream)


def pull_gbps(communicator, piece: torch.Tensor) -> tuple[float, float]:
    """Bytes a rank pulls a second from peers' symmetric buffers of ``piece``'s size:
    from one peer at a time (its successor, as the pipelines' staggered pulls do), and
    from every peer at once, each on a stream of its own (collective; one rank pulls its
    own buffer). ``(0, 0)`` where symmetric memory is not to be had."""
    device = communicator.device
    world, rank = communicator.world_size, communicator.rank
    try:
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        buffer = symm_mem.empty(piece.numel(), dtype=piece.dtype, device=device)
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        peers = [  # on one GPU, its own buffer
            handle.get_buffer(peer, (piece.numel(),), piece.dtype)
            for peer in range(world)
            if peer != rank or world == 1
        ]
        pulled = [torch.empty_like(piece) for _ in peers]
        handle.barrier(channel=0)
        successor = peers[rank % len(peers)]
        pull_ms = median_ms(lambda: pulled[0].copy_(successor))
        streams = [torch.cuda.Stream(device) for _ in peers]
        all_ms = median_ms(lambda: _pull_all(peers, pulled, streams, device))
        handle.barrier(channel=0)
    except (ImportError, RuntimeError):
        return 0.0, 0.0
    piece_bytes = piece.numel() * piece.element_size()
    return piece_bytes / (pull_ms * 1e6), len(peers) * piece_bytes / (all_ms * 1e6)


def measure_hardware_figures(communicator, dtype: torch.dtype = torch.bfloat16) -> HardwareFigures:
    """Measure every figure of the cost model on this rank's GPU and its peers
    (collective), as the recorded ones were.

    Takes about a second: a large matmul alone and beside an NCCL all-gather, an
    all-gather, a send/receive around the ring, copy-engine pulls from peers'
    symmetric buffers (one peer, then every peer at once), a local copy, the host
    cost of a small launch, and the host probe (the recorded host figures scaled by
    it: ``host_figures_for``). Every rank gets the slowest rank's figures.
    """
    device = communicator.device
    if device.type != "cuda":
        return CPU_FIGURES
    m = k = 8192
    n = 4096
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    matmul_ms = median_ms(lambda: torch.mm(a, b))
    world = communicator.world_size
    piece = torch.randn(64 * 2**20 // 2, device=device, dtype=dtype)
    gbps = gather_gbps(communicator, piece)
    gathered = torch.empty(world * piece.numel(), device=device, dtype=dtype)
    side = torch.cuda.Stream(device)

    def matmul_beside_gather() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(gathered, piece)
        torch.mm(a, b)
        torch.cuda.current_stream(device).wait_stream(side)

    beside_ms = median_ms(matmul_beside_gather)
    p2p_gbps = 0.0  # 0: the all-gather's, on one GPU
    if world > 1:  # every rank sends to its successor and receives from its predecessor
        rank = communicator.rank
        received_piece = torch.empty_like(piece)

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, piece, (rank + 1) % world),
                   dist.P2POp(dist.irecv, received_piece, (rank - 1) % world)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        p2p_gbps = piece.numel() * piece.element_size() / (median_ms(exchange) * 1e6)
    memory = measure_copy_gbps(device)
    launch_ms = median_ms(lambda: [piece[:1].add_(0) for _ in range(100)]) / 100
    probe_us = host_probe_us(device)
    copy_gbps, all_peers = pull_gbps(communicator, piece)
    figures = torch.tensor(
        [
            2 * m * k * n / (matmul_ms * 1e9),
            gbps,
            copy_gbps,
            memory,
            all_peers,
            p2p_gbps,
            launch_ms * 1e3,
            max(beside_ms, matmul_ms) / matmul_ms,
            probe_us,
        ],
        device=device,
        dtype=torch.float64,
    )
    slowest = figures.clone()
    rates = [0, 1, 2, 3, 4, 5]
    slowest[rates] *= -1  # rates: take the minimum through a MAX all-reduce
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest[rates] *= -1
    rate, gbps, copy_gbps, memory, all_peers, p2p, launch_us, slowdown, probe_us = slowest.tolist()
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
        host=host_figures_for(probe_us),
    )
