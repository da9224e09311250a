"""Where this process runs: under torchrun, under ``overlap run --launcher local``, in a
Ray pool's actor, or alone; and the process group and ``Communicator`` for it.

torchrun is detected with ``torch.distributed.is_torchelastic_launched()`` (Ray Train and
others set ``RANK`` too, so ``RANK`` alone proves nothing); its ``LOCAL_RANK`` comes from
the environment. The local launcher runs on torchelastic too, and marks its processes
with ``OVERLAP_LAUNCHER=local``, a Ray pool (``launch.ray_pool``) its actors with
``OVERLAP_LAUNCHER=ray`` and torchrun's variables (the attempt in
``TORCHELASTIC_RESTART_COUNT`` among them). NCCL on GPUs (each process on the GPU of its local
rank), gloo on CPUs.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlap import Communicator

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """A launch that cannot go on: raised before any collective starts."""


@dataclass(frozen=True)
class RankEnvironment:
    """What a launcher told this process."""

    launcher: str  # "torchrun", "local", "ray" or "none"
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str = ""  # TORCHELASTIC_RUN_ID under torchelastic (torchrun, local)
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT under torchelastic and Ray


def launcher() -> str:
    """``"torchrun"``, ``"local"`` (``overlap run --launcher local``), ``"ray"`` (a Ray
    pool's actor) or ``"none"``."""
    if os.environ.get("OVERLAP_LAUNCHER") in ("local", "ray"):
        return os.environ["OVERLAP_LAUNCHER"]
    if dist.is_torchelastic_launched():
        return "torchrun"
    return "none"


def rank_environment() -> RankEnvironment:
    """This process's rank, world and rendezvous, read from its launcher's environment;
    ``LaunchError`` naming what is missing or wrong."""
    kind = launcher()
    if kind == "none":
        return RankEnvironment("none", 0, 0, 1, "127.0.0.1", 0)
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        raise LaunchError(f"launched by {kind}, but {', '.join(missing)} not set")
    try:
        values = {name: int(os.environ[name]) for name in REQUIRED if name != "MASTER_ADDR"}
    except ValueError as error:
        raise LaunchError(f"launched by {kind} with a non-integer rank variable: {error}") from None
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return RankEnvironment(
        kind, rank, values["LOCAL_RANK"], world, os.environ["MASTER_ADDR"], values["MASTER_PORT"],
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    )  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (``""``: on every interface), for a rendezvous."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def device_for(local_rank: int, backend: str | None = None) -> torch.device:
    """The device of a process: the GPU of its local rank with NCCL, else the CPU."""
    if (backend or ("nccl" if torch.cuda.is_available() else "gloo")) != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise LaunchError(
            f"local rank {local_rank} has no GPU: this node has {count}; start at most "
            f"{count} processes a node, or use gloo (backend='gloo') on CPUs"
        )
    return torch.device("cuda", local_rank)


def init(backend: str | None = None, timeout_s: float = 300.0) -> Communicator:
    """Join the process group the launcher set up (NCCL on GPUs, gloo on CPUs), on the
    GPU of this process's local rank, and return the ``Communicator``. A process no
    launcher started gets a world of one (gloo, a local rendezvous).

    In a launched process an uncaught exception then fails fast (``launch.failfast``):
    traceback printed, communicators aborted, exit 1, so the launcher stops the other
    ranks instead of the job hanging in a collective."""
    env = rank_environment()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend {backend!r}: 'nccl' (GPUs) or 'gloo' (CPUs)")
    device = device_for(env.local_rank, backend)
    if env.launcher == "none" and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:  # a launched rank: an uncaught exception aborts its communicators and exits
        from launch import failfast

        failfast.install()
    return Communicator.initialize(backend, timeout_s, device, env.rank, env.world_size)
