"""Overlap: a fusion placed on device meshes, compiled to a host program every rank runs,
communication pipelined with compute.

The rooms, each importing only the ones before it (``tests/test_project.py`` checks):

- ``overlap.diag``: timelines of a run (text, PNG, Perfetto, profiler ranges), progress;
- ``overlap.ir``: the host IR, the instructions a rank runs;
- ``overlap.plan``: the overlap planner, its cost model, device figures, the roof meter;
- ``overlap.compile``: the compile pipeline (its passes, each a module) and ``dump``;
- ``overlap.comm``: the communicator, communications, pipelines, symmetric memory, UCX;
- ``overlap.runtime``: the executor, one rank's program, input checks, CUDA graphs;
- ``overlap.train``: backward, ``TrainableFusion``, ``parallelize``, checkpoints.

What users call is importable from here (loaded on first use, so that importing a room
does not import the others)::

    from overlap import Communicator, MultiDeviceExecutor

    executor = MultiDeviceExecutor(fd, Communicator())

See docs/guide.md and docs/architecture.md.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_PUBLIC = {
    "MultiDeviceExecutor": "overlap.runtime.executor",
    "Communicator": "overlap.comm.communicator",
    "PeerError": "overlap.comm.communicator",
    "UcxTransport": "overlap.comm.ucx",
    "OverlapOptions": "overlap.plan.planner",
    "HardwareFigures": "overlap.plan.figures",
    "CompiledProgram": "overlap.compile.pipeline",
    "compile_program": "overlap.compile.pipeline",
    "TrainableFusion": "overlap.train.trainable",
    "parallelize": "overlap.train.parallelize",
    "ParallelModule": "overlap.train.parallelize",
    "Checkpointer": "overlap.train.checkpoint",
    "TrainingPosition": "overlap.train.checkpoint",
    "latest_checkpoint": "overlap.train.checkpoint",
    "load_checkpoint": "overlap.train.checkpoint",
    "resume_or_start": "overlap.train.checkpoint",
    "save_checkpoint": "overlap.train.checkpoint",
    "Timeline": "overlap.diag.timeline",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'overlap' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
