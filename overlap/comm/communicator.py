"""``Communicator``: torch.distributed process groups for the teams a program uses.

NCCL on GPU, gloo on CPU. The default process group must be initialized (by
``torchrun``'s environment and ``init_process_group``, or by a launcher).
Sub-groups are created collectively: every rank calls ``prepare`` with the
same teams, in the same order, before any of them is used.

Host-side exchanges (input checks, agreements) go through gloo, never waiting on the GPU.
One gloo group has a timeout of its own (``input_check_timeout_s``: 60 s, or the
``OVERLAP_INPUT_CHECK_TIMEOUT_S`` environment variable): a rank whose inputs changed
alone exchanges there, and learns within that time that its peers are not coming
(``overlap.runtime.inputs.InputCheck``).

``split(team_size)`` runs programs over a sub-team (the tensor-parallel team of a 2-D
mesh): a ``Communicator`` whose ``rank`` and ``world_size`` are the team's, so every
executor works unchanged inside it. Its programs' teams are tuples of team ranks, its
process groups those teams' global ranks (``global_rank``: what point-to-point calls
and collectives' roots name); ``replica`` says which team this rank is in,
``replica_group`` links it to its counterparts in the other teams (the data-parallel
axis). Every rank creates every team's groups, in the same order, as
``torch.distributed.new_group`` asks; host exchanges and agreements stay inside the team.

A process that built a ``Communicator`` destroys its process groups when it exits
(``atexit``), before the interpreter finalizes. Left alive, a gloo worker thread that
releases a finished collective's tensors after finalization began cannot take the GIL
and aborts the process ("terminate called without an active exception", SIGABRT): a
finished job reported failed. ``destroy_process_group`` joins those threads first.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

INPUT_CHECK_TIMEOUT_ENV = "OVERLAP_INPUT_CHECK_TIMEOUT_S"


class PeerError(RuntimeError):
    """Another rank failed a step that every rank must pass together; this rank stops
    too, before any collective of the step, and says which rank failed and why."""


class ProgramMismatch(PeerError):
    """Ranks built host programs that post different communications: run together,
    some rank would wait forever in a collective its peers never post."""


def _compare_postings(postings: list[list[str]], step: str) -> None:
    first = postings[0]
    odd = next((rank for rank, other in enumerate(postings) if other != first), None)
    if odd is None:
        return
    other = postings[odd]
    line = next(
        (i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b),
        min(len(first), len(other)),
    )

    def at(lines: list[str]) -> str:
        return repr(lines[line]) if line < len(lines) else "nothing more"

    raise ProgramMismatch(
        f"{step}: the ranks built different host programs (from different fusions, layouts "
        f"or options): ranks 0 and {odd} first differ at step {line} of what they post: "
        f"rank 0 posts {at(first)}, rank {odd} posts {at(other)}. Every rank must build the "
        "same fusion with the same layouts and options"
    )


def _destroy_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_teardown_registered = False


def _register_teardown() -> None:
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(_destroy_at_exit)
        _teardown_registered = True


class Communicator:
    """This rank's view of the world (or of its team: ``split``): rank, size, device and
    process groups by team."""

    def __init__(
        self, device: torch.device | str | None = None, input_check_timeout_s: float | None = None
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Communicator: initialize torch.distributed first, e.g. "
                "torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs)"
            )
        _register_teardown()
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
        self._host_group = dist.new_group(backend="gloo") if self.backend == "nccl" else None
        if input_check_timeout_s is None:
            input_check_timeout_s = float(os.environ.get(INPUT_CHECK_TIMEOUT_ENV, 60.0))
        self.input_check_timeout_s = input_check_timeout_s
        self._check_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=input_check_timeout_s)
        )
        self.host_exchanges = 0  # host all-gathers so far (a run should cost none)
        # the global rank of each of this world's ranks; the teams this one is cut from
        # alike (its siblings, itself included), which create their groups together
        self.ranks = tuple(range(self.world_size))
        self._siblings = (self.ranks,)
        self._groups[self.ranks] = None  # the default group
        self.replica, self.replicas, self.replica_group = 0, 1, None
        self._splits: dict[int, Communicator] = {}

    @classmethod
    def initialize(
        cls,
        backend: str | None = None,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        input_check_timeout_s: float | None = None,
    ) -> Communicator:
        """Initialize the default process group if needed and return this rank's
        Communicator. NCCL when CUDA is available, else gloo; ``rank`` and
        ``world_size`` default to the environment's (``RANK``, ``WORLD_SIZE``), the
        rendezvous is ``MASTER_ADDR``/``MASTER_PORT``. On a CUDA ``device`` the process
        is put on it and the group bound to it. ``input_check_timeout_s``: how long a
        rank whose inputs changed waits for its peers to check theirs."""
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            options = {"timeout": datetime.timedelta(seconds=timeout_s)}
            if rank is not None:
                options.update(rank=rank, world_size=world_size)
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.set_device(torch.device(device))
                options["device_id"] = torch.device(device)
            dist.init_process_group(backend, **options)
        return cls(device, input_check_timeout_s)

    def split(self, team_size: int) -> Communicator:
        """This rank's team of ``team_size`` consecutive ranks (``rank // team_size``-th,
        ``replica``) as a ``Communicator`` of its own (collective: every rank of the world
        alike; kept, so a second call returns the same one). Its ``replica_group`` links
        this rank to the ranks of the other teams at its place (``rank % team_size``).

        Example (4 ranks, two data-parallel replicas of a 2-rank tensor-parallel team)::

            team = communicator.split(2)  # rank 3: team.rank 1, team.replica 1
        """
        if self.ranks != tuple(range(dist.get_world_size())):
            raise ValueError("Communicator.split: split the whole world's communicator")
        if team_size < 1 or self.world_size % team_size:
            raise ValueError(f"Communicator.split: {self.world_size} ranks do not make teams "
                             f"of {team_size}")  # fmt: skip
        if team_size not in self._splits:
            self._splits[team_size] = self._team(team_size)
        return self._splits[team_size]

    def _team(self, team_size: int) -> Communicator:
        teams = [tuple(range(start, start + team_size))
                 for start in range(0, self.world_size, team_size)]  # fmt: skip
        replica = self.rank // team_size
        team = copy.copy(self)
        team.rank, team.world_size, team.ranks = self.rank % team_size, team_size, teams[replica]
        team._siblings, team._splits = tuple(teams), {}
        team.replica, team.replicas, team.host_exchanges = replica, len(teams), 0

        def mine(**options) -> dist.ProcessGroup:  # every team's group, this rank's kept
            groups = [dist.new_group(list(t), **options) for t in teams]
            return groups[replica]

        whole = mine()
        team._groups = {tuple(range(team_size)): whole}
        gloo = self.backend != "nccl"
        team._host_group = whole if gloo else mine(backend="gloo")
        timeout = datetime.timedelta(seconds=self.input_check_timeout_s)
        team._check_group = mine(backend="gloo", timeout=timeout)
        across = [dist.new_group(list(t)) for t in zip(*teams, strict=True)]
        team.replica_group = across[team.rank]
        return team

    def global_rank(self, rank: int) -> int:
        """The global rank (torch.distributed's) of this world's ``rank``."""
        return self.ranks[rank]

    def prepare(self, teams: Iterable[tuple[int, ...]]) -> None:
        """Create the process groups of ``teams`` (collective: call on every rank alike;
        in a team, on every rank of the whole world, each team with its own teams)."""
        for team in sorted({tuple(sorted(t)) for t in teams}):
            if team in self._groups or len(team) < 2:
                continue
            groups = [dist.new_group([sibling[r] for r in team]) for sibling in self._siblings]
            self._groups[team] = groups[self._siblings.index(self.ranks)]

    def group(self, team: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of ``team`` (None is the default group of the whole world);
        ``team`` in this world's ranks."""
        key = tuple(sorted(team))
        if key not in self._groups:
            raise KeyError(f"team {key} was not prepared; call prepare() on every rank first")
        return self._groups[key]

    def agree(
        self, failure: BaseException | None, step: str, posted: list[str] | None = None
    ) -> None:
        """Every rank says whether ``step`` failed on it and, with ``posted`` (a program's
        ``posting_order()``), what it will post (collective: one exchange).

        If any rank failed, every rank raises: the failing one its own error, the others
        a ``PeerError`` naming it. If what they post differs, every rank raises
        ``ProgramMismatch`` showing the first difference. Either way no rank goes on into
        a collective that some peer never posts.
        """
        said = None if failure is None else f"{type(failure).__name__}: {failure}"
        everyone = self.all_gather_object((said, posted))
        if failure is not None:
            raise failure
        failed = [(rank, message) for rank, (message, _) in enumerate(everyone) if message]
        if failed:
            rank, message = failed[0]
            raise PeerError(f"{step} failed on rank {rank}: {message}")
        if posted is not None:
            _compare_postings([other for _, other in everyone], step)

    def all_gather_object(self, value: object) -> list[object]:
        """``value`` from every rank of the world, in rank order."""
        gathered: list[object] = [None] * self.world_size
        self.host_exchanges += 1
        dist.all_gather_object(gathered, value, group=self._host_group)
        return gathered

    def input_check_exchange(self, value: object) -> list[object]:
        """``value`` from every rank, in rank order, on the input-check group: raises
        (``RuntimeError``) when some rank has not come within ``input_check_timeout_s``."""
        gathered: list[object] = [None] * self.world_size
        self.host_exchanges += 1
        dist.all_gather_object(gathered, value, group=self._check_group)
        return gathered
