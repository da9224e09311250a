"""The host IR: the instructions of the program every rank runs (``HostProgram``).

Imports only ``fusion`` and ``sharding``; every other room of ``overlap`` reads it.
"""

from overlap.ir.instructions import (
    LOOP_STREAM,
    AliasSelect,
    Allocate,
    ChunkOrder,
    ChunkScheme,
    CombineStaged,
    Communicate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Instruction,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    StreamRef,
    Synchronize,
    Transport,
    Wait,
    stream_dim,
    walk,
)

__all__ = [
    "LOOP_STREAM",
    "AliasSelect",
    "Allocate",
    "ChunkOrder",
    "ChunkScheme",
    "CombineStaged",
    "Communicate",
    "Deallocate",
    "ForLoop",
    "GetCurrentStream",
    "HostProgram",
    "Instruction",
    "LaunchKernel",
    "SetCurrentStream",
    "StageForPeers",
    "StreamRef",
    "Synchronize",
    "Transport",
    "Wait",
    "stream_dim",
    "walk",
]
