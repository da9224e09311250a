"""The device a scheduler plans for: every size in bits.

Heuristics read only this object, so they are tested on a CPU against the
recorded profiles of real devices (H100, H200, B200).

Example::

    >>> H200.smem_per_block_bits // 8 // 1024
    227
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

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
    memory_gbps: float = 0.0  # measured device copy bandwidth (read + write), if known

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


def current_hardware(device: torch.device | str | None = None) -> HardwareProfile:
    """The profile of ``device``: read from torch on CUDA, the interpreter's on CPU."""
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
        profile = replace(profile, memory_gbps=recorded.memory_gbps)
    return profile
