"""The local launcher: N processes on this machine (one per GPU, or gloo ranks on CPUs),
started and watched by torchelastic (``torch.distributed.launcher.api.elastic_launch``).

``run_script`` runs a script's ``main(communicator)`` in N processes (``overlap run
--launcher local``); ``run_function`` runs ``function(communicator, *args)`` on every rank
and returns the results in rank order. Every rank is ``python -m launch.entry``. Elastic
sets up the rendezvous, stops the other ranks when one fails or dies (it looks every
0.1 s), and starts the whole group again up to ``max_restarts`` times. What it lacks is
added here, each for a reason:

- Which rank caused a failure. Elastic's root cause is the earliest error record by the
  whole second, and a rank that died (it wrote none) dates from when elastic saw it: a
  peer whose collective broke a moment later is named instead. Here a rank that died on
  its own is the cause, else the one that failed first to the microsecond (its record
  by ``launch.failfast``).
- A time limit: elastic waits for its ranks forever. A timer sends this process
  ``SIGUSR1``, added to the signals elastic stops its ranks on; the error names the
  ranks that had not finished (each rank records when it has).
- Restarts that work: the ranks' store a new one in each attempt. Elastic's c10d
  rendezvous shares its store with the ranks, where a restarted group finds the last
  attempt's keys and connects to peers that are gone (pytorch/pytorch#135712): here 3
  restarts of 3 failed or hung with it shared, none without.
- A function's results. Elastic returns a function entrypoint's values, but runs it on
  ``torch.multiprocessing``, which reports one failed rank only, the first exit it sees:
  of a rank that died while its peer waited in a barrier, the peer in 2 runs of 4. So
  functions run as ``launch.entry`` ranks too, and their results come back as files.

Elastic's handlers for the signals it stops on, and its log lines, last only as long
as the run. Call these from the main thread: signal handlers can only be set there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import spawn

import torch

from fusion.portable import portable, restored
from launch.env import LaunchError
from launch.failfast import recorded_failure

TIME_UP = signal.SIGUSR1  # what the timer sends when a run is past its time limit
STOPPED = -signal.SIGTERM  # the exit code of a rank elastic stopped (it did not fail)
ELASTIC_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, TIME_UP)
CALL = "call"  # the records' file holding run_function's function and arguments
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # read by elastic's c10d rendezvous
IMPORTS = ("sys_path", "dir", "init_main_from_name", "init_main_from_path")  # of spawn's


class RankFailure(LaunchError):
    """Some rank raised or died; ``failures`` maps each such rank to what it said (its
    traceback, or how it died), ``exit_codes`` to its exit code, and ``rank`` is the one
    that caused it: a rank that died rather than its peers, whose collectives then broke.
    Ranks the launcher stopped are in neither."""

    def __init__(self, failures: dict[int, str], rank: int, exit_codes: dict[int, int]) -> None:
        self.failures = failures
        self.rank = rank
        self.exit_codes = exit_codes
        text = "\n".join(f"--- rank {r} ---\n{message}" for r, message in failures.items())
        super().__init__(
            f"rank {self.rank} failed first ({len(failures)} rank(s) failed: "
            f"{sorted(failures)})\n{text}"
        )


class RunTimeout(LaunchError):
    """A run past its time limit, stopped; ``waiting`` are the ranks that had not finished."""

    def __init__(self, waiting: list[int], timeout_s: float) -> None:
        self.waiting = waiting
        super().__init__(f"ranks {waiting} did not finish within {timeout_s} s")


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


def run_function(function: Callable, args: tuple = (), nproc: int | None = None,
                 timeout_s: float = 120.0, max_restarts: int = 0) -> list:  # fmt: skip
    """``function(communicator, *args)`` on ``nproc`` local ranks (a module-level
    function: it travels by pickle); the return values in rank order. ``RankFailure``
    when a rank fails (after ``max_restarts`` restarts of them all), ``RunTimeout``
    past ``timeout_s`` (which is also the ranks' process-group timeout)."""
    nproc = nproc or default_nproc()
    with tempfile.TemporaryDirectory(prefix="overlap-run-") as records:
        with open(os.path.join(records, CALL), "wb") as call:
            # the ranks import the function as a spawned process would: on this process's
            # sys.path, from this folder, this script as __main__ (its authkey stays here)
            prepare = spawn.get_preparation_data("overlap-rank")
            pickle.dump({key: prepare[key] for key in IMPORTS if key in prepare}, call)
            pickle.dump((function, portable(args), timeout_s), call)
        _launch(["--call"], records, nproc, timeout_s, max_restarts)
        values = _finished(records, nproc)
        return [restored(values[rank]) for rank in range(nproc)]


def run_script(script: str, argv: list[str], nproc: int | None = None,
               timeout_s: float | None = None, max_restarts: int = 0) -> int:  # fmt: skip
    """Run ``script``'s ``main(communicator)`` in ``nproc`` processes; the first that
    fails stops the others (after ``max_restarts`` restarts of them all). Returns the
    exit code: 0 when every rank succeeded, the failed rank's, or 124 past ``timeout_s``."""
    nproc = nproc or default_nproc()
    with tempfile.TemporaryDirectory(prefix="overlap-run-") as records:
        try:
            _launch([script, *argv], records, nproc, timeout_s, max_restarts)
        except RankFailure as failure:
            codes = failure.exit_codes
            said = f"rank {failure.rank} exited with {codes[failure.rank]}"
            others = [f"rank {r} with {codes[r]}" for r in failure.failures if r != failure.rank]
            if others:
                said += " first; then " + ", ".join(others)
            stopped = "; the others were stopped" if len(failure.failures) < nproc else ""
            print(f"overlap run: {said}{stopped} (each rank's error is above)",
                  file=sys.stderr)  # fmt: skip
            code = codes[failure.rank]
            return code if code > 0 else 128 - code  # killed by a signal: as a shell says
        except RunTimeout as late:
            print(f"overlap run: ranks {late.waiting} still running after {timeout_s} s; "
                  "stopped them", file=sys.stderr)  # fmt: skip
            return 124
    return 0


def _finished(records: str, nproc: int) -> dict[int, object]:
    """What each rank that finished in the last attempt recorded (``launch.entry``), by
    rank: its function's value (portable, see ``fusion.portable``) or None."""
    attempts = [name for name in os.listdir(records) if name.startswith("attempt")]
    if not attempts:
        return {}
    last = os.path.join(records, max(attempts, key=lambda name: int(name[len("attempt") :])))
    values = {}
    for rank in range(nproc):
        path = os.path.join(last, f"rank{rank}")
        if os.path.exists(path):
            with open(path, "rb") as record:
                values[rank] = pickle.load(record)
    return values


def _launch(entry_args: list[str], records: str, nproc: int, timeout_s: float | None,
            max_restarts: int) -> None:  # fmt: skip
    """``python -m launch.entry --records RECORDS *entry_args`` on ``nproc`` ranks under
    elastic; ``RankFailure`` or ``RunTimeout`` as the module says."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise LaunchError(f"nproc={nproc}: at least one process")
    if threading.current_thread() is not threading.main_thread():
        raise LaunchError("the local launcher runs from the main thread (it sets signal handlers)")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # its store on a free port
        max_restarts=max_restarts, monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(records, "elastic")),
        signals_to_handle=",".join(sig.name for sig in ELASTIC_SIGNALS),
    )  # fmt: skip
    command = ["-m", "launch.entry", "--records", records, *entry_args]
    try:
        with (
            _elastic_quiet(), _handlers_restored(), _store_of_its_own_each_attempt(),
            _time_limit(timeout_s, SignalException),
        ):  # fmt: skip
            elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as failed:
        raise _rank_failure(failed.failures) from None
    except SignalException as stopped:
        if stopped.sigval != TIME_UP:
            raise
        done = _finished(records, nproc)
        raise RunTimeout([r for r in range(nproc) if r not in done], timeout_s) from None


def _rank_failure(failures: dict) -> RankFailure:
    """From elastic's ``ProcessFailure`` of each rank that did not exit 0 (``failfast``
    recorded a failing rank's traceback and time), the ranks that failed and the cause."""
    records = {rank: recorded_failure(f.error_file_data) for rank, f in failures.items()}
    # elastic reports the ranks it stopped once one had failed too: they did not fail
    failed = {rank: f for rank, f in sorted(failures.items())
              if records[rank] is not None or f.exitcode != STOPPED} or failures  # fmt: skip
    said = {rank: f"died with exit code {f.exitcode}" if records[rank] is None
            else records[rank][1] for rank, f in failed.items()}  # fmt: skip
    died = [rank for rank in failed if records[rank] is None]
    cause = died[0] if died else min(failed, key=lambda rank: records[rank][0])
    return RankFailure(said, cause, {rank: f.exitcode for rank, f in failed.items()})


@contextlib.contextmanager
def _time_limit(timeout_s: float | None, stop: type[BaseException]) -> Iterator[None]:
    """Past ``timeout_s``, this (main) thread gets ``TIME_UP``: elastic's handler raises
    ``stop`` there once its ranks run, this one before (while it sets them up)."""
    if timeout_s is None:
        yield
        return

    def time_up(signum: int, frame: object) -> None:
        raise stop(f"past the time limit of {timeout_s} s", signal.Signals(signum))

    signal.signal(TIME_UP, time_up)
    timer = threading.Timer(timeout_s, signal.pthread_kill,
                            (threading.main_thread().ident, TIME_UP))  # fmt: skip
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def _store_of_its_own_each_attempt() -> Iterator[None]:
    """The ranks' store (``MASTER_PORT``) a new one in each attempt, as before torch 2.5
    shared the rendezvous' store with them (see the module's text)."""
    saved = os.environ.get(UNSHARED_STORE)
    os.environ[UNSHARED_STORE] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[UNSHARED_STORE]
        else:
            os.environ[UNSHARED_STORE] = saved


@contextlib.contextmanager
def _handlers_restored() -> Iterator[None]:
    """Elastic sets handlers for the signals it stops its ranks on, and leaves them set:
    this process's own come back after the run."""
    saved = {sig: signal.getsignal(sig) for sig in ELASTIC_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _elastic_quiet() -> Iterator[None]:
    """Elastic's log lines off for the run: it logs each rank it stops and names a first
    failure by its own rule (see the module's text); the ranks' own output and this
    launcher's summary say what happened."""
    elastic = ("torch.distributed.elastic", "torch.distributed.launcher")
    names = [name for name in list(logging.root.manager.loggerDict) if name.startswith(elastic)]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
