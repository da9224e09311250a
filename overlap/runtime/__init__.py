"""Running a compiled program on this rank: the executor (binds inputs, picks the rank
program, runs it), one rank's program and its compute steps, input checks, DTensor
pieces, CUDA graphs.
"""

from overlap.runtime.executor import MultiDeviceExecutor

__all__ = ["MultiDeviceExecutor"]
