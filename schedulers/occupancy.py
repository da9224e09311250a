"""How many programs, or thread-block clusters of them, a device holds at once: a grid
of programs that wait for each other must not be larger, and a persistent grid of
clusters no larger than that either (its last clusters would run in a second wave,
after the first: LayerNorm backward 4096x65536 on an H200 0.63 of copy at 24 clusters of
16 where the device holds 21, 0.82 at 21).

Nothing here imports Triton (``schedulers.runtime``'s docstring says why); the CUDA
driver is loaded only when a cluster's count is asked for.
"""

from __future__ import annotations

import ctypes
import functools

from schedulers.hardware import HardwareProfile
from schedulers.runtime import cdiv

# cuda.h (CUDA 12 and later): what cuOccupancyMaxActiveClusters is given
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_SCHEDULING_POLICY = 5  # CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
_SPREAD = 1  # CU_CLUSTER_SCHEDULING_POLICY_SPREAD: as Triton's launcher launches them
_NON_PORTABLE = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (past 8)


def resident_programs(compiled, hardware: HardwareProfile) -> int:
    """How many programs of the ``compiled`` Triton kernel a device of ``hardware``
    holds at once (every SM as many as its registers, threads and shared memory
    allow): a grid of programs that wait for each other must not be larger."""
    compiled._init_handles()  # registers are read when the kernel loads
    warps = compiled.metadata.num_warps
    threads = warps * hardware.warp_size
    # registers are allocated a warp at a time, in units of 256
    per_warp = cdiv(max(compiled.n_regs, 1) * hardware.warp_size, 256) * 256
    by_registers = hardware.registers_per_sm // (per_warp * warps)
    by_threads = hardware.max_threads_per_sm // threads
    shared = compiled.metadata.shared
    by_shared = (hardware.smem_per_block_bits // 8 + 1024) // (shared + 1024) if shared else 32
    return hardware.sm_count * max(0, min(by_registers, by_threads, by_shared, 32))


class _Value(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("pad", ctypes.c_char * 64), ("dims", ctypes.c_uint * 3),
                ("policy", ctypes.c_int)]  # fmt: skip


class _Attribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _Value)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]  # fmt: skip


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def max_active_clusters(function: int, threads: int, shared: int, cluster: int) -> int:
    """How many clusters of ``cluster`` programs of the loaded kernel ``function`` (a
    ``CUfunction``), each of ``threads`` threads and ``shared`` bytes of dynamic shared
    memory, the current device holds at once, launched as ``BoundKernel`` launches them
    (spread over the SMs of a GPC): the driver's count (``cuOccupancyMaxActiveClusters``),
    which knows how the SMs are grouped. Fewer than the programs the device holds over
    the cluster's size: an H200 holds 396 programs of LayerNorm forward's split (three
    an SM) but 45 clusters of 8 of them; 396 of LayerNorm backward's, 21 clusters of 16.
    The count is an idle device's: kernels running beside (a collective's) leave room
    for fewer, the rest then run after the first (slower, the results the same: a
    cluster waits for no other). ``RuntimeError`` where the driver refuses the
    question."""
    driver = _driver()
    handle = ctypes.c_void_p(function)
    status = driver.cuFuncSetAttribute(handle, _NON_PORTABLE, 1) if cluster > 8 else 0
    if status:
        raise RuntimeError(f"clusters of {cluster} programs (past 8, not portable): "
                           f"cuFuncSetAttribute refused them, CUresult {status}")  # fmt: skip
    attributes = (_Attribute * 2)()
    attributes[0].id = _CLUSTER_DIMENSION
    attributes[0].value.dims[:] = [cluster, 1, 1]
    attributes[1].id = _SCHEDULING_POLICY
    attributes[1].value.policy = _SPREAD
    config = _Config((cluster, 1, 1), (threads, 1, 1), shared, None, attributes, 2)
    count = ctypes.c_int(0)
    status = driver.cuOccupancyMaxActiveClusters(ctypes.byref(count), handle,
                                                 ctypes.byref(config))  # fmt: skip
    if status:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: CUresult {status} for clusters "
                           f"of {cluster} programs of {threads} threads, {shared} bytes of "
                           "shared memory")  # fmt: skip
    return count.value
