"""A pool of Ray actors, one per rank, that run fusions together.

    pool = RayPool(world_size=2)                  # a local Ray instance, or address=...
    outputs = pool.run(fd, [x, w])                # whole inputs: the pool shards them
    pool.shutdown()

The actors sit in one placement group (a GPU bundle per rank on GPUs, a CPU bundle
otherwise), spread over the cluster's nodes by default (``placement``: Ray's strategies),
set up the process group among themselves (NCCL on GPUs, gloo on CPUs; the rendezvous
at rank 0's node, on a port rank 0 found free there), build a ``MultiDeviceExecutor``
for each fusion they are sent (the definition travels by pickle) and run its host
program; the driver assembles the whole outputs from their pieces. Ranks are numbered
node by node, as torchrun numbers them: the ranks of one node are consecutive, so a
mesh's inner axis stays inside a node.

Every call is watched: when any actor raises or dies, the call fails at once with that
rank's error, the pool is torn down (its peers may be blocked in a collective that
will never finish), and ``RayPool`` can be built again; ``call_with_restarts`` does
that by itself, up to ``max_restarts`` times, each attempt's number in the ranks'
``TORCHELASTIC_RESTART_COUNT`` as under torchrun. On GPUs actors see every GPU
of their node (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: hiding all but one has
slowed and hung NCCL on NVSwitch hosts) and take the one of their local rank; a bounded
process-group timeout keeps NCCL from waiting forever on a dead peer.

Ray's token authentication is a setting of the whole process: the first ``ray.init()`` that
starts a cluster turns it on (``RAY_AUTH_MODE=token`` written into ``os.environ``) and Ray
keeps it, cached, after ``ray.shutdown()``. A driver that requires a token on a cluster that
runs without one refuses the cluster's calls to it; the cluster takes the driver for dead
and cancels its actors before they run. A pool that starts Ray reads ``RAY_AUTH_MODE``
again first and leaves ``os.environ`` as it found it; on a driver connected otherwise, a
pool whose actors were cancelled so says why (``AUTH_MISMATCH``).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence

import torch

from launch.env import LaunchError, free_port


class PoolError(LaunchError):
    """A pool call failed: ``rank`` is the first rank that raised or died."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(f"rank {rank} failed: {message}")


class _NotTheDefault(logging.Filter):
    """Drops Ray's notice that token authentication is on (its secure default); keeps
    every other record (the warning that it is off among them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled" not in record.getMessage()


def _quiet_ray() -> None:
    """Ray's output as plain text: no ANSI colour codes around the ranks' lines
    (``RAY_COLOR_PREFIX=0``) and no notice of its default authentication, unless
    ``OVERLAP_RAY_VERBOSE=1``."""
    if os.environ.get("OVERLAP_RAY_VERBOSE") == "1":
        return
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _NotTheDefault) for f in logger.filters):
        logger.addFilter(_NotTheDefault())


_AUTH_MODE = "RAY_AUTH_MODE"

AUTH_MISMATCH = (
    "Ray cancelled the pool's actors before they ran: the cluster could not reach this "
    "driver, which requires Ray's token authentication (an earlier ray.init() in this "
    "process turned it on, and Ray keeps it after ray.shutdown()) where the cluster runs "
    "without it. Let RayPool connect (RayPool(address=...) reads RAY_AUTH_MODE again), "
    "start the cluster with RAY_AUTH_MODE=token, or connect from a new process"
)


def _auth_as_the_environment_says() -> None:
    """Ray's authentication mode and token read again from the environment
    (``RAY_AUTH_MODE``...): Ray caches them for the process at its first use, and a new
    ``ray.init()`` keeps those of the instance before."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token authentication: nothing cached
        return
    Config.initialize("")  # before the token: Ray's order (its reset_auth_token_state)
    AuthenticationTokenLoader.instance().reset_cache()


def _driver_requires_token() -> bool:
    """Whether this process's Ray holds a token to require on the calls it receives: the
    cached one, which a new ``ray.init()`` keeps even where the mode it reads is off."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        return False
    return AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=False)


def _cancelled_before_running(error: PoolError) -> bool:
    """Whether the failure is an actor that Ray cancelled before it ran (its owner, this
    driver, taken for dead), as Ray's message says: it keeps no attribute for it."""
    cause = error.__cause__
    return isinstance(cause, _ray().exceptions.RayActorError) and (
        "cancelled before it started running" in str(cause)
    )


def _ray():
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "the Ray pool needs Ray: pip install 'overlap[ray]' (or pip install ray)"
        ) from None
    return ray


class _Rank:
    """One rank: an actor's state (created remotely through ``ray.remote``)."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool) -> None:
        # before any CUDA call: see every GPU of the node, pick one by local rank
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        self.rank, self.world_size, self.use_gpu = rank, world_size, use_gpu
        self.communicator = None
        self.executors: dict[bytes, object] = {}

    def address(self) -> tuple[str, str, int]:
        """This node's IP, id and a free port on it (rank 0's are the rendezvous)."""
        ray = _ray()
        port = free_port("")  # every interface: the other nodes' ranks connect to it
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), port

    def setup(self, master: str, port: int, local_rank: int, restart_count: int,
              timeout_s: float) -> str:  # fmt: skip
        from overlap import Communicator

        # what a launched rank reads (``launch.rank_environment``), named as torchrun names it
        os.environ.update(OVERLAP_LAUNCHER="ray", RANK=str(self.rank), LOCAL_RANK=str(local_rank),
                          WORLD_SIZE=str(self.world_size), MASTER_ADDR=master,
                          MASTER_PORT=str(port),
                          TORCHELASTIC_RESTART_COUNT=str(restart_count))  # fmt: skip
        backend, device = ("nccl", f"cuda:{local_rank}") if self.use_gpu else ("gloo", "cpu")
        self.communicator = Communicator.initialize(backend, timeout_s, device, self.rank,
                                                    self.world_size)  # fmt: skip
        return str(self.communicator.device)

    def call(self, function: Callable, args: tuple) -> object:
        return function(self.communicator, *args)

    def run(self, definition: bytes, inputs: list, whole: bool, options: dict) -> list:
        from fusion.portable import portable, restored
        from overlap import MultiDeviceExecutor

        inputs = restored(inputs)
        key = definition + pickle.dumps(sorted(options.items()))
        executor = self.executors.get(key)
        if executor is None:
            executor = MultiDeviceExecutor(pickle.loads(definition), self.communicator, **options)
            self.executors[key] = executor
        device = self.communicator.device
        if whole:  # this rank's pieces, cut on the host: only they go to the device
            inputs = executor.shard_inputs(inputs, check=False)  # one driver sent them all
        inputs = [None if t is None else t.to(device) for t in inputs]
        outputs = executor.run(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        pieces = portable([None if t is None else t.cpu() for t in outputs])
        # rank 0 also sends the outputs as placed (their layouts): the driver assembles
        return pieces, (executor.fusion.outputs if self.rank == 0 else None)


# Ray's placement strategies: SPREAD puts the bundles on as many nodes as it can, PACK on
# as few, the STRICT ones insist (one node a rank; one node for all)
PLACEMENTS = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")


def ranks_node_by_node(bundle_nodes: dict[int, str]) -> list[int]:
    """The bundle of each rank: the bundles grouped by their node (the nodes in the order
    of their first bundle), in bundle order within a node; ``bundle_nodes`` maps each
    bundle to its node. SPREAD places bundles 0, 1, 2, 3 on nodes A, B, A, B: ranks 0, 1
    then take bundles 0, 2 on A, and ranks 2, 3 bundles 1, 3 on B."""
    first_bundle: dict[str, int] = {}
    for bundle in sorted(bundle_nodes):
        first_bundle.setdefault(bundle_nodes[bundle], bundle)
    return sorted(bundle_nodes, key=lambda bundle: (first_bundle[bundle_nodes[bundle]], bundle))


class RayPool:
    """``world_size`` actors, one per rank; see the module's text.

    ``placement``: how the ranks' bundles go over the nodes, one of Ray's strategies
    (``PLACEMENTS``): ``SPREAD`` (default) over as many nodes as have room, ``PACK`` on
    as few as hold them (a job smaller than a node's GPUs stays on its NVLink),
    ``STRICT_SPREAD`` one node per rank, ``STRICT_PACK`` all on one node.
    ``restart_count``: the attempt this pool runs (``call_with_restarts`` counts them);
    every rank reads it in ``launch.rank_environment().restart_count``. After the start,
    ``nodes`` holds each rank's node id and ``devices`` its device."""

    def __init__(
        self,
        world_size: int,
        address: str | None = None,
        use_gpus: bool | None = None,
        timeout_s: float = 120.0,  # for starting: placement group, actors, process group
        init_options: dict | None = None,
        placement: str = "SPREAD",
        restart_count: int = 0,
    ) -> None:
        ray = _ray()
        if world_size < 1:
            raise LaunchError(f"world_size={world_size}: at least one rank")
        if placement not in PLACEMENTS:
            raise LaunchError(f"placement {placement!r}: one of {', '.join(PLACEMENTS)}")
        if not ray.is_initialized():
            _quiet_ray()
            options = {"include_dashboard": False, "log_to_driver": True, **(init_options or {})}
            _auth_as_the_environment_says()
            auth_mode_set = _AUTH_MODE in os.environ
            try:
                ray.init(address=address, **options)
            except ConnectionError as error:  # no cluster where the address says
                raise LaunchError(f"Ray: no cluster at address {address!r} ({error}); "
                                  "leave --address out to start one here") from None  # fmt: skip
            finally:
                # Ray's default, written for the processes it started (they have it): a
                # later instance in this process reads the user's environment, not it
                if not auth_mode_set:
                    os.environ.pop(_AUTH_MODE, None)
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        self.use_gpus = gpus >= world_size if use_gpus is None else use_gpus
        if self.use_gpus and gpus < world_size:
            raise LaunchError(f"{world_size} GPU ranks asked for; the cluster has {gpus} GPUs")
        cpus = int(resources.get("CPU", 0))
        if not self.use_gpus and cpus < world_size:
            raise LaunchError(f"{world_size} CPU ranks asked for; the cluster has {cpus} CPUs")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._ray = ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1} if self.use_gpus else {"CPU": 1}
        self._group = placement_group([bundle] * world_size, strategy=placement)
        ready, _ = ray.wait([self._group.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self._group)
            raise LaunchError(f"the placement group of {world_size} {bundle} bundles "
                              f"({placement}) was not ready within {timeout_s} s")  # fmt: skip
        bundles = ranks_node_by_node(placement_group_table(self._group)["bundles_to_node_id"])
        actor = ray.remote(_Rank)
        self.actors = [
            actor.options(
                num_gpus=1 if self.use_gpus else 0,
                num_cpus=0 if self.use_gpus else 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=bundles[rank]
                ),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            ).remote(rank, world_size, self.use_gpus)
            for rank in range(world_size)
        ]
        try:
            places = self._gather([a.address.remote() for a in self.actors], timeout_s)
            master, _, port = places[0]
            self.nodes = [node for _, node, _ in places]
            local_ranks = [self.nodes[:rank].count(self.nodes[rank]) for rank in range(world_size)]
            self.devices = self._gather([
                a.setup.remote(master, port, local_ranks[rank], restart_count, timeout_s)
                for rank, a in enumerate(self.actors)
            ], timeout_s)  # fmt: skip
        except PoolError as error:
            self.shutdown()
            if _cancelled_before_running(error) and _driver_requires_token():
                raise LaunchError(AUTH_MISMATCH) from error
            raise
        except BaseException:
            self.shutdown()
            raise

    # -- calls -----------------------------------------------------------------------

    def _gather(self, refs: list, timeout_s: float | None) -> list:
        """Every rank's result, in rank order; the first failure ends the call (and the
        pool) at once with its rank (a dead actor's result fails as soon as it dies, so
        no deadline is needed for that); ``timeout_s`` (None: none) bounds the call."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, object] = {}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(rank_of[ref] for ref in pending)
                self.shutdown()
                raise PoolError(ranks[0], f"ranks {ranks} did not answer within {timeout_s} s")
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for ref in done:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except Exception as error:  # a raise in the actor, or the actor died
                    self._fail(rank, error, pending, rank_of)
        return [results[rank] for rank in range(len(refs))]

    def _fail(self, rank: int, error: Exception, pending: list, rank_of: dict) -> None:
        """End the pool and raise for the rank that caused the failure: a rank that
        died rather than its peers, whose collectives then fail (wait briefly for them:
        the death may be reported after the peers' errors)."""
        ray = self._ray
        failures = {rank: error}
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as other:
                failures[rank_of[ref]] = other
        dead = [r for r, e in sorted(failures.items())
                if isinstance(e, ray.exceptions.RayActorError)]  # fmt: skip
        cause = dead[0] if dead else rank
        # every rank raised and none died (a bad input, refused on all ranks before any
        # collective): the actors agree, and the pool stays usable; otherwise some rank
        # may wait in a collective forever, and the pool goes
        agreed = len(failures) == len(rank_of) and not dead
        if not agreed:
            self.shutdown()
        others = {r: e for r, e in failures.items() if r != cause}
        message = f"{type(failures[cause]).__name__}: {failures[cause]}"
        if others:
            message += "; then " + "; ".join(
                f"rank {r}: {type(e).__name__}" for r, e in sorted(others.items())
            )
        message += " (every rank refused it: the pool is still usable)" if agreed else ""
        raise PoolError(cause, message) from failures[cause]

    def call(self, function: Callable, *args, timeout_s: float | None = None) -> list:
        """``function(communicator, *args)`` on every rank (a picklable function); the
        results in rank order. ``timeout_s`` bounds the call (default: no bound; a rank
        that raises or dies still ends it at once)."""
        self._check_alive()
        return self._gather([a.call.remote(function, args) for a in self.actors], timeout_s)

    def run(
        self,
        definition,
        inputs: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor | None]],
        per_rank: bool = False,
        timeout_s: float | None = None,
        **executor_options,
    ) -> list[torch.Tensor]:
        """Run a ``FusionDefinition`` on every rank; the whole outputs.

        ``inputs``: the whole tensors (every actor gets them and keeps its pieces), or
        with ``per_rank=True`` one list of local pieces per rank. ``executor_options`` go
        to each rank's ``MultiDeviceExecutor`` (``options``, ``kernels``...)."""
        self._check_alive()
        try:
            blob = pickle.dumps(definition)
        except Exception as error:
            raise LaunchError(f"the fusion definition does not pickle: {error}") from error
        if per_rank and len(inputs) != self.world_size:
            raise LaunchError(f"per_rank inputs: {len(inputs)} lists for {self.world_size} ranks")
        from fusion.portable import portable, restored
        from sharding.pieces import assemble

        # fp8 and fp4 travel as bytes (torch cannot unpickle them)
        if per_rank:
            pieces = [portable([None if t is None else t.cpu() for t in rank]) for rank in inputs]
            refs = [a.run.remote(blob, pieces[r], False, executor_options)
                    for r, a in enumerate(self.actors)]  # fmt: skip
        else:
            # one copy in the object store
            shared = self._ray.put(portable([t.cpu() for t in inputs]))
            refs = [a.run.remote(blob, shared, True, executor_options) for a in self.actors]
        answers = self._gather(refs, timeout_s)
        placed = answers[0][1]
        pieces = [restored(answer[0]) for answer in answers]
        return [
            assemble({rank: pieces[rank][position] for rank in range(len(pieces))}, tensor)
            for position, tensor in enumerate(placed)
        ]

    # -- life ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.actors:
            raise LaunchError("this pool was shut down (after a failure, or by shutdown()); "
                              "build a new RayPool")  # fmt: skip

    def shutdown(self) -> None:
        """Kill the actors and free their placement group (safe to call twice)."""
        ray = self._ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []
        group = getattr(self, "_group", None)
        if group is not None:
            try:
                ray.util.remove_placement_group(group)
            except Exception:
                pass
            self._group = None

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def call_with_restarts(
    world_size: int, function: Callable, *args, max_restarts: int = 0, **pool_options
) -> list:
    """``function(communicator, *args)`` on every rank of a new ``RayPool``; the results
    in rank order. When a rank raises or dies the pool is torn down (fail-fast), built
    again and the function called again, up to ``max_restarts`` times, as torchrun
    restarts its workers; each attempt's ranks read its number in
    ``launch.rank_environment().restart_count`` (``TORCHELASTIC_RESTART_COUNT``: 0, then
    1...), so a training loop can resume from its last checkpoint. ``pool_options`` go to
    ``RayPool``. The last attempt's ``PoolError`` is raised when no restart is left::

        def train(communicator):
            if rank_environment().restart_count:
                ...  # load the last checkpoint
        call_with_restarts(8, train, max_restarts=3, address="auto")
    """
    if max_restarts < 0:
        raise LaunchError(f"max_restarts={max_restarts}: 0 or more")
    attempt = 0
    while True:
        try:
            with RayPool(world_size, restart_count=attempt, **pool_options) as pool:
                return pool.call(function, *args)
        except PoolError as error:
            if attempt == max_restarts:
                raise
            attempt += 1
            sys.stderr.write(f"[overlap] {error}; starting every rank again (restart {attempt} "
                             f"of {max_restarts})\n")  # fmt: skip
            sys.stderr.flush()
