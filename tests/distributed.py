"""Multi-rank tests as real processes: a pool of gloo ranks that runs test functions.

Starting processes and importing torch costs seconds, so each world size gets
one pool per test session; a job is a module-level function run on every rank
as ``function(communicator, *args)``. Every job has a timeout: a hang fails the
test (and restarts the pool) instead of blocking CI.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

from fusion.portable import portable, restored
from launch.env import free_port


class RankError(Exception):
    """A job raised on some rank; the message holds every failing rank's traceback."""

    def __init__(self, failures: dict[int, tuple[str, str]]) -> None:
        self.failures = failures  # rank -> (exception type name, formatted traceback)
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, (_, tb) in failures.items())
        super().__init__(text)

    def messages(self) -> dict[int, str]:
        """The last line of each failing rank's traceback (type and message)."""
        return {rank: tb.strip().splitlines()[-1] for rank, (_, tb) in self.failures.items()}


def _worker(rank: int, world_size: int, port: int, jobs, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # jobs may run generated kernels: Triton's interpreter, set before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    from overlap import Communicator

    # one thread a rank: the ranks share the machine's cores, and torch's intra-op threads
    # spinning against each other's (and the other tests') made small matmuls take ms
    torch.set_num_threads(1)
    communicator = Communicator.initialize("gloo", 60.0, "cpu", rank, world_size)
    while True:
        job = jobs.get()
        if job is None:
            break
        function, args = job
        try:
            results.put((rank, "ok", portable(function(communicator, *args))))
        except BaseException as error:  # report every failure to the parent
            results.put((rank, "error", (type(error).__name__, traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo processes waiting for jobs."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self.processes = [
            context.Process(
                target=_worker, args=(rank, world_size, port, self.jobs[rank], self.results)
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.daemon = True
            process.start()

    def run(self, function: Callable, *args, timeout: float = 90.0) -> list:
        """``function(communicator, *args)`` on every rank; returns the results by rank."""
        for jobs in self.jobs:
            jobs.put((function, args))
        outcomes: dict[int, tuple[str, object]] = {}
        try:
            while len(outcomes) < self.world_size:
                rank, status, payload = self.results.get(timeout=timeout)
                outcomes[rank] = (status, restored(payload))
        except queue.Empty:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            raise TimeoutError(
                f"{function.__name__} did not finish within {timeout} s on ranks {missing}"
            ) from None
        failures = {r: p for r, (s, p) in sorted(outcomes.items()) if s == "error"}
        if failures:
            raise RankError(failures)
        return [outcomes[rank][1] for rank in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)


def no_ray_processes(timeout_s: float = 60.0) -> None:
    """Wait until no Ray process on this machine names a GCS address (which ``auto`` finds
    by listing processes): after ``ray.shutdown()`` (``test_launch.py``'s Ray instance) its
    processes may outlive the call by seconds on a busy machine (seen under two
    pytest-xdist workers)."""
    import time

    from ray._private.services import find_gcs_addresses

    deadline = time.monotonic() + timeout_s
    while find_gcs_addresses() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = find_gcs_addresses()
    assert not left, f"Ray processes still serve {sorted(left)} after {timeout_s} s"
