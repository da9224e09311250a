"""The local launcher: N processes on this machine (one per GPU, or gloo ranks on CPUs).

``run_function`` runs ``function(communicator, *args)`` on every rank and returns the
results in rank order; ``run_script`` runs a script's ``main(communicator)`` in N
processes (``overlap run --launcher local``). Both fail fast: the first rank that fails
or dies stops the others, and the error names it; a run past its time limit is stopped
and says which ranks had not finished.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from fusion.portable import portable, restored
from launch.env import LaunchError, free_port
from launch.failfast import FAILURES_ENV, first_failure


class RankFailure(LaunchError):
    """Some rank raised or died; ``failures`` maps each such rank to what it said, and
    ``rank`` is the one that caused it: a rank that died rather than its peers, whose
    collectives then broke."""

    def __init__(self, failures: dict[int, str], rank: int | None = None) -> None:
        self.failures = failures
        self.rank = min(failures) if rank is None else rank
        text = "\n".join(f"--- rank {r} ---\n{message}" for r, message in failures.items())
        super().__init__(
            f"rank {self.rank} failed first ({len(failures)} rank(s) failed: "
            f"{sorted(failures)})\n{text}"
        )


def default_nproc() -> int:
    """One process per local GPU; two CPU processes when there is none."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def fits_the_devices(nproc: int | None, launcher: str = "local") -> None:
    """Refuse (``LaunchError``) more ranks than this machine's GPUs where ranks get one
    each (local processes and torchrun on a machine with GPUs); a Ray pool asks its
    cluster, CPU processes take any count."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc is not None and launcher != "ray" and count and nproc > count:
        raise LaunchError(f"--nproc {nproc}: this machine has {count} GPU"
                          f"{'s' if count > 1 else ''}, one per rank")  # fmt: skip


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "OVERLAP_LAUNCHER": "local", "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def _function_worker(rank, world_size, port, function, args, results, timeout_s) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    try:
        from launch.env import init

        communicator = init(timeout_s=timeout_s)
        # by value: a tensor put as is travels as a shared-memory handle that the parent
        # can only open while this process lives
        value = pickle.dumps(portable(function(communicator, *args)))
        results.put((rank, "ok", value))
    except BaseException:  # every failure goes back to the parent, with its traceback
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        # no graceful teardown: on NCCL it would wait for peers stuck in a collective
        from launch.failfast import abort_process_groups

        abort_process_groups()
        os._exit(1)
    # the result is written out before anything is torn down
    results.close()
    results.join_thread()
    import torch.distributed as dist

    dist.destroy_process_group()


def run_function(
    function: Callable, args: tuple = (), nproc: int | None = None, timeout_s: float = 120.0
) -> list:
    """``function(communicator, *args)`` on ``nproc`` local ranks (a module-level
    function: it travels by pickle); the return values in rank order."""
    nproc = nproc or default_nproc()
    if nproc < 1:
        raise LaunchError(f"nproc={nproc}: at least one process")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_function_worker,
                        args=(rank, nproc, port, function, args, results, timeout_s))
        for rank in range(nproc)
    ]  # fmt: skip
    for process in processes:
        process.start()
    values: dict[int, object] = {}
    failures: dict[int, str] = {}
    died: list[int] = []
    deadline = time.monotonic() + timeout_s

    def collect(wait_s: float) -> None:
        """Take one report (waiting up to ``wait_s``), then note ranks that died silently."""
        try:
            rank, status, value = results.get(timeout=wait_s)
            if status == "ok":
                values[rank] = restored(pickle.loads(value))
            else:
                failures[rank] = value
                if rank in died:  # its exit was seen before its report: it did not die
                    died.remove(rank)
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if process.exitcode not in (None, 0) and rank not in values and rank not in failures:
                failures[rank] = f"died with exit code {process.exitcode}"
                died.append(rank)

    try:
        while len(values) + len(failures) < nproc and not failures:
            collect(0.2)
            if not failures and time.monotonic() > deadline:
                waiting = [r for r in range(nproc) if r not in values]
                raise LaunchError(f"ranks {waiting} did not finish within {timeout_s} s")
        if failures:
            # A rank that dies breaks its peers' collectives, and their reports may come
            # first: wait a moment for the process exits before naming the cause.
            settle = time.monotonic() + 2.0
            while time.monotonic() < settle and len(values) + len(failures) < nproc:
                collect(0.1)
            raise RankFailure(failures, died[0] if died else next(iter(failures)))
        return [values[rank] for rank in range(nproc)]
    finally:
        for process in processes:
            process.join(timeout=5 if not failures else 0.5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def run_script(script: str, argv: list[str], nproc: int | None = None,
               timeout_s: float | None = None) -> int:  # fmt: skip
    """Run ``script``'s ``main(communicator)`` in ``nproc`` processes; the first that
    fails stops the others. Returns the exit code (0 when every rank succeeded)."""
    nproc = nproc or default_nproc()
    port = free_port()
    failures = tempfile.TemporaryDirectory(prefix="overlap-failures-")
    processes = []
    for rank in range(nproc):
        env = {**os.environ, **rank_env(rank, nproc, port), FAILURES_ENV: failures.name}
        command = [sys.executable, "-m", "launch.entry", script, *argv]
        processes.append(subprocess.Popen(command, env=env))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in processes]
            if any(code not in (None, 0) for code in codes):
                # a rank's peers fail right after it (their collectives break): give
                # them a moment, then name the rank that caused it, and the others
                time.sleep(1.0)
                codes = [p.poll() for p in processes]
                failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
                cause = first_failure(failures.name, failed)
                said = f"rank {cause} exited with {codes[cause]}"
                others = [f"rank {r} with {codes[r]}" for r in failed if r != cause]
                if others:
                    said += " first; then " + ", ".join(others)
                print(f"overlap run: {said}; stopping the others (each rank's error is above)",
                      file=sys.stderr)  # fmt: skip
                return codes[cause]
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                waiting = [rank for rank, code in enumerate(codes) if code is None]
                print(f"overlap run: ranks {waiting} still running after {timeout_s} s; "
                      "stopping them", file=sys.stderr)  # fmt: skip
                return 124
            time.sleep(0.1)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        failures.cleanup()
