"""The figures the planner's cost model reads, per device.

``HardwareFigures`` is the device's own description (``schedulers.hardware``: SMs,
memory bandwidth, the one every heuristic reads) plus what overlapping adds: matmul
rate, link and copy-engine bandwidths, launch cost, how much NCCL slows a matmul down.

Recorded here: the H200's, measured by ``overlap.comm.measure.measure_hardware_figures``
(``RECORDED_FIGURES``: the H100 and H200; ``NAMED_FIGURES`` for ``overlap dump --device``).
Any other CUDA device has its links measured at an executor's first build
(``overlap.comm.measure.device_figures``) and kept on disk (``read_link_figures``,
``write_link_figures``: ``schedulers.device_cache``); ``measured_figures`` builds its
figures from its profile and those links.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from schedulers.device_cache import read_cached, write_cached
from schedulers.hardware import B200, H100, H200, INTERPRETER, HardwareProfile


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
    launch_us: float  # host cost of one launched op or collective
    collective_slowdown: float  # matmul time factor while NCCL kernels run beside it
    tile_rows: int = 128
    tile_cols: int = 256
    ranks: int | None = None  # the team size the link figures were measured at, if any
    # copy-engine pulls from every peer at once, bytes received a second (0: unmeasured);
    # recorded beside the one-peer figure: the pipelines pull one peer at a time
    copy_engine_all_peers_gbps: float = 0.0

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


def recorded_figures(profile: HardwareProfile) -> HardwareFigures | None:
    """The recorded figures of ``profile``'s kind (``RECORDED_FIGURES``), for this very
    device's profile; None for a kind with none."""
    for name, figures in RECORDED_FIGURES.items():
        if profile.name.startswith(name):
            return replace(figures, name=profile.name, device=profile)
    return None


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


def measured_figures(
    profile: HardwareProfile, ranks: int, links: LinkFigures | None
) -> HardwareFigures:
    """The figures of a device kind with none recorded: its profile (copy bandwidth
    measured, ``schedulers.hardware``), the ``links`` measured between its ``ranks`` (None
    for one rank: nothing to move, and no link a cost could be read from), and the H200's
    matmul rate, launch cost and NCCL slowdown (unmeasured, named so).

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
    )
