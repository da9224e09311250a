"""``Communicator``: torch.distributed process groups for the teams a program uses.

NCCL on GPU, gloo on CPU. The default process group must be initialized (by
``torchrun``'s environment and ``init_process_group``, or by a launcher).
Sub-groups are created collectively: every rank calls ``prepare`` with the
same teams, in the same order, before any of them is used.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist


class Communicator:
    """This rank's view of the world: rank, size, device and process groups by team."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Communicator: initialize torch.distributed first, e.g. "
                "torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs)"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = dist.get_backend()
        if device is None:
            if self.backend == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        self.device = torch.device(device)
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # Host-side exchanges (input checks) go through gloo, so they never wait on the GPU.
        self._host_group = dist.new_group(backend="gloo") if self.backend == "nccl" else None

    @classmethod
    def initialize(
        cls,
        backend: str | None = None,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> Communicator:
        """Initialize the default process group if needed and return this rank's
        Communicator. NCCL when CUDA is available, else gloo; ``rank`` and
        ``world_size`` default to the environment's (``RANK``, ``WORLD_SIZE``), the
        rendezvous is ``MASTER_ADDR``/``MASTER_PORT``. On a CUDA ``device`` the process
        is put on it and the group bound to it."""
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            options = {"timeout": datetime.timedelta(seconds=timeout_s)}
            if rank is not None:
                options.update(rank=rank, world_size=world_size)
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.set_device(torch.device(device))
                options["device_id"] = torch.device(device)
            dist.init_process_group(backend, **options)
        return cls(device)

    def prepare(self, teams: Iterable[tuple[int, ...]]) -> None:
        """Create the process groups of ``teams`` (collective: call on every rank alike)."""
        world = tuple(range(self.world_size))
        for team in sorted({tuple(sorted(t)) for t in teams}):
            if team in self._groups or len(team) < 2:
                continue
            self._groups[team] = None if team == world else dist.new_group(list(team))

    def group(self, team: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of ``team`` (None is the default group of the whole world)."""
        key = tuple(sorted(team))
        if key not in self._groups:
            raise KeyError(f"team {key} was not prepared; call prepare() on every rank first")
        return self._groups[key]

    def all_gather_object(self, value: object) -> list[object]:
        """``value`` from every rank of the world, in rank order."""
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self._host_group)
        return gathered


class PlanningCommunicator:
    """A rank's place in a world, for planning and printing a host program without
    running it (``overlap dump``): no process group behind it, so any exchange raises."""

    backend = "none"

    def __init__(self, rank: int, world_size: int, device: str = "cpu") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)

    def prepare(self, teams: Iterable[tuple[int, ...]]) -> None:
        del teams  # nothing to create: no process group

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("a PlanningCommunicator only plans: it has no process group")

    group = all_gather_object = _refuse
