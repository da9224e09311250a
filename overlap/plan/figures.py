"""The figures the planner's cost model reads, per device.

``HardwareFigures`` is the device's own description (``schedulers.hardware``: SMs,
memory bandwidth, the one every heuristic reads) plus what overlapping adds: matmul
rate, link and copy-engine bandwidths, launch cost, how much NCCL slows a matmul down,
and the host's cost of issuing a program (``HostFigures``: per kind of step, per call,
per CUDA-graph replay; measured by ``benchmarks/host_figures.py``).

Recorded here: the H200's, measured by ``overlap.comm.measure.measure_hardware_figures``
(``RECORDED_FIGURES``: the H100 and H200; ``NAMED_FIGURES`` for ``overlap dump --device``).
Any other CUDA device has its links and its host's speed measured at an executor's first
build (``overlap.comm.measure.device_figures``) and kept on disk (``read_link_figures``,
``write_link_figures``, ``read_host_probe``, ``write_host_probe``:
``schedulers.device_cache``); ``measured_figures`` builds its figures from its profile,
those links, and the H200's host figures scaled by the host's speed against the H200
host's (``HostFigures.scaled``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from overlap.plan.host_steps import HostStep
from schedulers.device_cache import read_cached, write_cached
from schedulers.hardware import B200, H100, H200, INTERPRETER, HardwareProfile


@dataclass(frozen=True)
class HostFigures:
    """The host's cost of issuing a run, in microseconds: each step of a rank program by
    its kind (``step_us``, every ``HostStep``), a call's fixed cost around its steps
    (``run_us``: the executor's binding of the inputs, the program's entry and exit),
    and for a run replayed from a CUDA graph, the replay's fixed cost and each input
    copied into the graph's own buffers. ``streams``: the device's rank programs issue
    stream steps (CUDA; on CPUs none). ``source`` says where the figures come from.
    ``probe_us``: the host probe's time (``overlap.comm.measure.host_probe_us``) on the
    host they were measured on, so that another host's can be scaled from them (0: not
    measured)."""

    step_us: Mapping[HostStep, float] = field(hash=False)  # a plain dict: asdict, JSON
    run_us: float
    graph_replay_us: float
    graph_input_copy_us: float
    streams: bool
    source: str
    probe_us: float = 0.0

    def __post_init__(self) -> None:
        missing = [str(kind) for kind in HostStep if kind not in self.step_us]
        if missing:
            raise ValueError(f"host figures without a cost for {', '.join(missing)}")
        costs = {kind: float(self.step_us[kind]) for kind in HostStep}
        object.__setattr__(self, "step_us", costs)

    @classmethod
    def fallback(cls, launch_us: float, streams: bool = True) -> HostFigures:
        """The host model from before any host cost was measured, kept where none is:
        every step ``launch_us``, nothing per call, 15 us a graph replay."""
        return cls(
            step_us=dict.fromkeys(HostStep, launch_us),
            run_us=0.0,
            graph_replay_us=15.0,
            graph_input_copy_us=0.0,
            streams=streams,
            source=f"FALLBACK, not measured: {launch_us:g} us a step",
        )

    def issue_us(self, counts: Mapping[HostStep, int]) -> float:
        """The host's time to issue a call of ``counts`` steps of each kind, step by step."""
        return self.run_us + sum(self.step_us[kind] * count for kind, count in counts.items())

    def replay_us(self, inputs: int) -> float:
        """The host's time of a call replayed from a CUDA graph, ``inputs`` of its inputs
        copied into the graph's buffers."""
        return self.graph_replay_us + inputs * self.graph_input_copy_us

    def scaled(self, factor: float, source: str) -> HostFigures:
        """Every cost times ``factor`` (another host, ``factor`` times slower)."""
        return replace(
            self,
            step_us={kind: us * factor for kind, us in self.step_us.items()},
            run_us=self.run_us * factor,
            graph_replay_us=self.graph_replay_us * factor,
            graph_input_copy_us=self.graph_input_copy_us * factor,
            source=source,
            probe_us=self.probe_us * factor,
        )

    def __str__(self) -> str:
        lines = [f"host figures ({self.source}), us:"]
        lines.extend(f"  {kind}: {us:.2f}" for kind, us in self.step_us.items())
        lines.append(f"  a call: {self.run_us:.2f}; a graph replay: {self.graph_replay_us:.2f}"
                     f" + {self.graph_input_copy_us:.2f} an input copied")  # fmt: skip
        return "\n".join(lines)


@dataclass(frozen=True)
class HardwareFigures:
    """What the cost model reads: the device (``schedulers.hardware``: SMs, memory
    bandwidth, the one description every heuristic reads) and what overlapping adds
    (measured by ``overlap.comm.measure``)."""

    name: str
    device: HardwareProfile
    matmul_tflops: float  # dense matmul rate on large shapes, in the benchmark's dtype
    collective_gbps: float  # NCCL/gloo all-gather bandwidth, bytes received per rank per s
    p2p_gbps: float  # send/recv between neighbours
    copy_engine_gbps: float  # copy-engine pulls from a peer's symmetric buffer (0: none)
    launch_us: float  # a launched op's or collective's fixed cost on the device's side
    collective_slowdown: float  # matmul time factor while NCCL kernels run beside it
    tile_rows: int = 128
    tile_cols: int = 256
    ranks: int | None = None  # the team size the link figures were measured at, if any
    # copy-engine pulls from every peer at once, bytes received a second (0: unmeasured);
    # recorded beside the one-peer figure: the pipelines pull one peer at a time
    copy_engine_all_peers_gbps: float = 0.0
    # the host's cost of issuing a run; None: ``HostFigures.fallback(launch_us)``
    host: HostFigures | None = None

    def __post_init__(self) -> None:
        if self.host is None:
            object.__setattr__(self, "host", HostFigures.fallback(self.launch_us))

    @property
    def memory_gbps(self) -> float:
        """The device's copy bandwidth (read + write)."""
        return self.device.memory_gbps

    @property
    def sm_count(self) -> int:
        return self.device.sm_count

    @property
    def has_copy_engine(self) -> bool:
        return self.copy_engine_gbps > 0


# The H200 host's cost of issuing a run, measured on 2x H200 by
#     torchrun --nproc-per-node 2 benchmarks/host_figures.py --runs 100 --skip ring
# (benchmarks/results/host_figures_2gpu.json). The ring transport's steps keep the
# fallback: its case stops on GPUs (benchmarks/OWED.md), so it was left out.
H200_HOST = HostFigures(
    step_us={
        HostStep.ALLOCATE: 6.13,
        HostStep.DEALLOCATE: 1.32,
        HostStep.CHUNK_VIEW: 5.50,
        HostStep.STREAM_SWITCH: 3.05,
        HostStep.STREAM_WAIT: 16.84,
        HostStep.GENERATED_KERNEL: 31.06,
        HostStep.LIBRARY_KERNEL: 34.83,
        HostStep.EVALUATED_KERNEL: 66.28,
        HostStep.POST: 69.70,
        HostStep.WAIT: 12.89,
        HostStep.POST_CHUNK_COLLECTIVE: 94.46,
        HostStep.WAIT_CHUNK_COLLECTIVE: 32.35,
        HostStep.POST_CHUNK_RING: 14.20,  # not run: the fallback
        HostStep.WAIT_CHUNK_RING: 14.20,  # not run: the fallback
        HostStep.POST_CHUNK_COPY_ENGINE: 20.77,
        HostStep.WAIT_CHUNK_COPY_ENGINE: 1.48,
        HostStep.STAGE_FOR_PEERS: 120.60,
        HostStep.COMBINE_STAGED: 124.44,
        HostStep.LOOP_END: 0.97,
    },
    run_us=46.30,
    graph_replay_us=48.40,
    graph_input_copy_us=6.95,
    streams=True,
    source="measured on 2x NVIDIA H200 by benchmarks/host_figures.py at 894361a, 2026-11-28; "
    "the ring's steps: FALLBACK, 14.2 us a step",
    probe_us=61.11,
)
# The same at 4 ranks (benchmarks/results/host_figures_4gpu.json, same command with
# --nproc-per-node 4).
H200_X4_HOST = HostFigures(
    step_us={
        HostStep.ALLOCATE: 6.30,
        HostStep.DEALLOCATE: 1.47,
        HostStep.CHUNK_VIEW: 4.49,
        HostStep.STREAM_SWITCH: 2.42,
        HostStep.STREAM_WAIT: 14.58,
        HostStep.GENERATED_KERNEL: 39.28,
        HostStep.LIBRARY_KERNEL: 30.73,
        HostStep.EVALUATED_KERNEL: 84.72,
        HostStep.POST: 84.92,
        HostStep.WAIT: 14.60,
        HostStep.POST_CHUNK_COLLECTIVE: 75.64,
        HostStep.WAIT_CHUNK_COLLECTIVE: 18.85,
        HostStep.POST_CHUNK_RING: 14.20,  # not run: the fallback
        HostStep.WAIT_CHUNK_RING: 14.20,  # not run: the fallback
        HostStep.POST_CHUNK_COPY_ENGINE: 24.24,
        HostStep.WAIT_CHUNK_COPY_ENGINE: 1.34,
        HostStep.STAGE_FOR_PEERS: 154.42,
        HostStep.COMBINE_STAGED: 137.08,
        HostStep.LOOP_END: 1.39,
    },
    run_us=54.68,
    graph_replay_us=56.22,
    graph_input_copy_us=6.97,
    streams=True,
    source="measured on 4x NVIDIA H200 by benchmarks/host_figures.py at 894361a, 2026-11-28; "
    "the ring's steps: FALLBACK, 14.2 us a step",
    probe_us=69.75,
)
# Measured on 2x H200 (NVLink) by measure_hardware_figures, bf16, in the run recorded
# in benchmarks/results/ag_matmul.json.
H200_FIGURES = HardwareFigures(
    name="H200 (NVLink)",
    device=H200,
    matmul_tflops=738.0,
    collective_gbps=197.0,
    p2p_gbps=197.0,
    copy_engine_gbps=349.0,
    launch_us=14.2,
    collective_slowdown=1.37,
    ranks=2,
    host=H200_HOST,
)
# Two gloo processes on the 2-core CPU host the tests run on (shared, loaded), measured
# by `torchrun --nproc-per-node 2 benchmarks/host_figures.py --cpu --runs 300`
# (benchmarks/results/host_figures_cpu.json). No streams, copy engine or generated
# kernels there, and gloo moves the data on the host: a post, a wait and the steps after
# a loop last as long as the transfer and the peer (measured: 50-700 us, varying 2-4x
# between runs), which the device model prices already. Those keep the fallback.
CPU_HOST = HostFigures(
    step_us={
        **dict.fromkeys(HostStep, 50.0),  # the fallback, today's launch cost a step
        HostStep.ALLOCATE: 7.10,
        HostStep.DEALLOCATE: 0.81,
        HostStep.CHUNK_VIEW: 4.06,
        HostStep.LIBRARY_KERNEL: 39.42,
        HostStep.EVALUATED_KERNEL: 49.06,
    },
    run_us=32.03,
    graph_replay_us=15.0,  # no CUDA graphs on CPUs: the fallback
    graph_input_copy_us=0.0,
    streams=False,
    source="measured on 2x CPU (gloo) by benchmarks/host_figures.py at 41ed22d, 2026-11-28; "
    "communication steps and loop ends: FALLBACK, 50 us a step",
    probe_us=15.17,
)
# Processes on one CPU host talking through gloo: chunking rarely pays.
CPU_FIGURES = HardwareFigures(
    name="CPU (gloo)",
    device=replace(INTERPRETER, name="CPU", sm_count=2, memory_gbps=10.0),
    matmul_tflops=0.1,
    collective_gbps=2.0,
    p2p_gbps=2.0,
    copy_engine_gbps=0.0,
    launch_us=50.0,
    collective_slowdown=1.3,
    host=CPU_HOST,
)
# Measured on 4x H200 (NVLink, one host) by measure_hardware_figures at a731014, bf16,
# in the run recorded in benchmarks/results/ag_matmul_4gpu.json: a team of four moves
# more through NCCL's all-gather (each rank receives from three peers at once) and less
# between ring neighbours, and its matmuls slow more beside NCCL's kernels, than a pair.
H200_X4_FIGURES = replace(
    H200_FIGURES,
    name="H200 (NVLink) x4",
    matmul_tflops=700.9,
    collective_gbps=241.8,
    p2p_gbps=103.0,
    copy_engine_gbps=337.1,
    copy_engine_all_peers_gbps=210.7,
    launch_us=14.4,
    collective_slowdown=1.66,
    ranks=4,
    host=H200_X4_HOST,
)
# ``overlap dump --device NAME``: links measured on H200s, the named device's own profile
NAMED_FIGURES = {
    "h200": H200_FIGURES,
    "h100": replace(H200_FIGURES, name="H100 (H200 link figures)", device=H100),
    "b200": replace(H200_FIGURES, name="B200 (H200 link figures)", device=B200),
    "cpu": CPU_FIGURES,
}
# The device kinds whose figures are recorded, by the name their profile starts with; any
# other CUDA device (the B200 too: its profile is the vendor's, its links unmeasured) has
# its links measured at first use.
RECORDED_FIGURES = {H200.name: NAMED_FIGURES["h200"], H100.name: NAMED_FIGURES["h100"]}
# Figures measured at other team sizes, by kind and ranks (a size not here plans with the
# kind's figures above, and the planner's reason says at how many ranks they were measured)
RECORDED_BY_RANKS = {H200.name: {4: H200_X4_FIGURES}}


def recorded_figures(profile: HardwareProfile, ranks: int | None = None) -> HardwareFigures | None:
    """The recorded figures of ``profile``'s kind (``RECORDED_FIGURES``; those measured at
    ``ranks`` ranks where recorded, ``RECORDED_BY_RANKS``), for this very device's
    profile; None for a kind with none."""
    for name, figures in RECORDED_FIGURES.items():
        if profile.name.startswith(name):
            figures = RECORDED_BY_RANKS.get(name, {}).get(ranks, figures)
            return replace(figures, name=profile.name, device=profile)
    return None


def named_figures(device: str, ranks: int | None = None) -> HardwareFigures:
    """``NAMED_FIGURES[device]``, or the figures measured at ``ranks`` ranks on that kind
    where recorded (``RECORDED_BY_RANKS``): what a run on ``ranks`` such GPUs plans with."""
    figures = NAMED_FIGURES[device]
    by_ranks = RECORDED_BY_RANKS.get(figures.device.name, {})
    if ranks in by_ranks:
        return replace(by_ranks[ranks], name=f"{figures.name} x{ranks}", device=figures.device)
    return figures


@dataclass(frozen=True)
class LinkFigures:
    """The links between a team's ranks, measured at first use on a device kind with no
    recorded figures (``overlap.comm.measure.measure_links``), bytes received a second."""

    collective_gbps: float  # a rank's share of a timed all-gather
    copy_engine_gbps: float  # a pull from a peer's symmetric buffer; 0: no copy-engine path


def _link_key(device_name: str, ranks: int, hosts: int) -> dict[str, object]:
    return {"device": device_name, "ranks": ranks, "hosts": hosts, "torch": torch.__version__}


def read_link_figures(device_name: str, ranks: int, hosts: int) -> LinkFigures | None:
    """The links kept for ``ranks`` ranks of ``device_name`` over ``hosts`` hosts (this
    torch version), or None when none can be trusted (``schedulers.device_cache``)."""
    key = _link_key(device_name, ranks, hosts)
    kept = read_cached(
        "links", key, positive=("collective_gbps",), non_negative=("copy_engine_gbps",)
    )
    return None if kept is None else LinkFigures(**kept)


def write_link_figures(device_name: str, ranks: int, hosts: int, links: LinkFigures) -> None:
    """Keep ``links`` for the runs after (atomically; a warning if the folder cannot be
    written)."""
    figures = {"collective_gbps": links.collective_gbps, "copy_engine_gbps": links.copy_engine_gbps}
    write_cached("links", _link_key(device_name, ranks, hosts), figures)


def _host_key(device_name: str, host_name: str) -> dict[str, object]:
    return {"device": device_name, "host": host_name, "torch": torch.__version__}


def read_host_probe(device_name: str, host_name: str) -> float | None:
    """The host probe's time (us, ``overlap.comm.measure.host_probe_us``) kept for
    ``device_name`` on the host named ``host_name`` (this torch version), or None."""
    kept = read_cached("host", _host_key(device_name, host_name), positive=("probe_us",))
    return None if kept is None else kept["probe_us"]


def write_host_probe(device_name: str, host_name: str, probe_us: float) -> None:
    """Keep the host probe's time for the runs after (``schedulers.device_cache``)."""
    write_cached("host", _host_key(device_name, host_name), {"probe_us": probe_us})


def host_figures_for(probe_us: float) -> HostFigures:
    """The host figures of a host whose probe took ``probe_us``: the H200's, scaled by
    how much slower this host issues the probe than the H200's did (the H200's as they
    are where either probe is missing)."""
    reference = H200_FIGURES.host
    if not (probe_us > 0 and reference.probe_us > 0):
        return reference
    factor = probe_us / reference.probe_us
    return reference.scaled(
        factor, f"the H200's, scaled by this host's probe: {probe_us:.1f} us, x{factor:.2f}"
    )


def measured_figures(
    profile: HardwareProfile, ranks: int, links: LinkFigures | None, probe_us: float = 0.0
) -> HardwareFigures:
    """The figures of a device kind with none recorded: its profile (copy bandwidth
    measured, ``schedulers.hardware``), the ``links`` measured between its ``ranks`` (None
    for one rank: nothing to move, and no link a cost could be read from), the host
    figures scaled by the slowest rank's host probe, ``probe_us`` (``host_figures_for``;
    0: the H200's), and the H200's matmul rate, launch cost and NCCL slowdown
    (unmeasured, named so).

    A send/receive between neighbours is priced at the all-gather's rate."""
    links = links or LinkFigures(collective_gbps=0.0, copy_engine_gbps=0.0)
    return replace(
        H200_FIGURES,
        name=f"{profile.name} x{ranks} (measured; the H200's matmul and launch figures)",
        device=profile,
        collective_gbps=links.collective_gbps,
        p2p_gbps=links.collective_gbps,
        copy_engine_gbps=links.copy_engine_gbps,
        copy_engine_all_peers_gbps=0.0,
        ranks=ranks,
        host=host_figures_for(probe_us),
    )
