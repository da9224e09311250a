"""The device a scheduler plans for: every size in bits.

Heuristics read only this object, so they are tested on a CPU against the
recorded profiles of real devices (H100, H200, B200). A CUDA device with no recorded
profile is read from torch, and its copy bandwidth (``memory_gbps``, which the heuristics
read) measured at its first use and kept on disk for later runs
(``schedulers.device_cache``).

Example::

    >>> H200.smem_per_block_bits // 8 // 1024
    227
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from schedulers.device_cache import read_cached, write_cached

KIB_BITS = 1024 * 8
MIB_BITS = 1024 * KIB_BITS


@dataclass(frozen=True)
class HardwareProfile:
    """What a heuristic may know about a device."""

    name: str
    arch: int  # compute capability, e.g. 90 for Hopper; 0 for the interpreter
    sm_count: int
    smem_per_block_bits: int  # the most shared memory one block may ask for
    registers_per_sm: int  # 32-bit registers
    l2_bits: int
    warp_size: int = 32
    max_threads_per_sm: int = 2048
    memory_gbps: float = 0.0  # measured device copy bandwidth (read + write); 0: unknown (CPU)

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    def blocks_per_sm(self, warps: int, registers: int, shared_bits: int = 0) -> int:
        """Blocks of ``warps`` warps, ``registers`` a thread and ``shared_bits`` of shared
        memory an SM holds at once (32 at most, as Hopper's)."""
        by_registers = self.registers_per_sm // (max(registers, 1) * warps * self.warp_size)
        by_shared = self.smem_per_block_bits // shared_bits if shared_bits else 32
        return max(0, min(32, self.max_warps_per_sm // warps, by_registers, by_shared))


# Recorded from torch.cuda.get_device_properties on the machines here (H100, H200) and
# from NVIDIA's published figures (B200); memory_gbps is a measured device-to-device copy.
H100 = HardwareProfile("NVIDIA H100 80GB HBM3", 90, 132, 227 * KIB_BITS, 65536, 50 * MIB_BITS,
                       memory_gbps=3000.0)  # fmt: skip
H200 = HardwareProfile("NVIDIA H200", 90, 132, 227 * KIB_BITS, 65536, 60 * MIB_BITS,
                       memory_gbps=4300.0)  # fmt: skip
B200 = HardwareProfile("NVIDIA B200", 100, 148, 227 * KIB_BITS, 65536, 126 * MIB_BITS,
                       memory_gbps=7000.0)  # fmt: skip
# Triton's interpreter on a CPU: a single "SM"; heuristics still produce valid kernels.
INTERPRETER = HardwareProfile("Triton interpreter (CPU)", 0, 1, 227 * KIB_BITS, 65536,
                              4 * MIB_BITS)  # fmt: skip

PROFILES = {profile.name: profile for profile in (H100, H200, B200)}


def median_ms(function: Callable[[], object], repeats: int = 10) -> float:
    """Median time of ``function()`` on the current CUDA stream, timed with CUDA events
    after one warm-up run."""
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


COPY_BYTES = 2**28  # well past any L2: the copy runs at the memory's speed


def measure_copy_gbps(device: torch.device) -> float:
    """``device``'s copy bandwidth: a device-to-device copy of ``COPY_BYTES`` random bytes,
    bytes read plus bytes written a second (a few milliseconds)."""
    with torch.cuda.device(device):
        source = torch.randint(0, 256, (COPY_BYTES,), dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copy_ms = median_ms(lambda: target.copy_(source))
    return 2 * COPY_BYTES / (copy_ms * 1e6)


def measured_memory_gbps(device: torch.device, name: str) -> float:
    """The copy bandwidth of ``device`` (named ``name``): kept from an earlier run of this
    torch version, else measured now and kept (``schedulers.device_cache``)."""
    key = {"device": name, "torch": torch.__version__}
    cached = read_cached("memory", key, positive=("memory_gbps",))
    if cached is not None:
        return cached["memory_gbps"]
    memory_gbps = measure_copy_gbps(device)
    write_cached("memory", key, {"memory_gbps": memory_gbps})
    return memory_gbps


def current_hardware(device: torch.device | str | None = None) -> HardwareProfile:
    """The profile of ``device``: read from torch on CUDA, the interpreter's on CPU. A
    CUDA device with no recorded profile gets its copy bandwidth measured
    (``measured_memory_gbps``: once, then read back from the cache)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return INTERPRETER
    props = torch.cuda.get_device_properties(device)
    recorded = next((p for name, p in PROFILES.items() if props.name.startswith(name)), None)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    profile = HardwareProfile(
        name=props.name,
        arch=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
        smem_per_block_bits=smem * 8,
        registers_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
        l2_bits=props.L2_cache_size * 8,
        warp_size=getattr(props, "warp_size", 32),
        max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048),
    )
    if recorded is not None:
        return replace(profile, memory_gbps=recorded.memory_gbps)
    return replace(profile, memory_gbps=measured_memory_gbps(device, props.name))
