"""The figures the planner's cost model reads, per device.

``HardwareFigures`` is the device's own description (``schedulers.hardware``: SMs,
memory bandwidth, the one every heuristic reads) plus what overlapping adds: matmul
rate, link and copy-engine bandwidths, launch cost, how much NCCL slows a matmul down.
``benchmarks/hardware_figures.py`` measures them; the ones recorded here are named for
``overlap dump --device``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from schedulers.hardware import B200, H100, H200, INTERPRETER, HardwareProfile, current_hardware


@dataclass(frozen=True)
class HardwareFigures:
    """What the cost model reads: the device (``schedulers.hardware``: SMs, memory
    bandwidth, the one description every heuristic reads) and what overlapping adds
    (measured by ``benchmarks/hardware_figures.py``)."""

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


# Measured on 2x H200 (NVLink) by benchmarks/hardware_figures.py, bf16, in the run recorded
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


def default_hardware_figures(device: torch.device) -> HardwareFigures:
    """The recorded figures for this device's kind (measure for better ones)."""
    if device.type != "cuda":
        return CPU_FIGURES
    profile = current_hardware(device)
    if "H200" in profile.name or "H100" in profile.name:
        return replace(H200_FIGURES, name=profile.name, device=profile)
    name = f"{profile.name} (H200 figures, unmeasured)"
    return replace(H200_FIGURES, name=name, device=profile)
