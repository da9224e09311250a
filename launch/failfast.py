"""A rank that fails ends at once: its traceback printed, its communicators aborted.

On NCCL a graceful teardown (``destroy_process_group``) of a failing rank waits for its
peers, which wait in their next collective for the failed rank: the job hangs and the
traceback is never printed. A failing rank must instead print what went wrong, abort its
process groups (no waiting for anyone), and exit nonzero; its launcher (torchrun, ``overlap
run --launcher local``, the Ray pool) then stops the other ranks.

``fail(...)`` does that for an exception in hand; ``install()`` (done by ``launch.init``)
makes every uncaught exception of a launched process do it; ``finish(...)`` ends a rank
whose work is done without the interpreter's teardown. Example::

    try:
        train(communicator)
    except BaseException:
        failfast.fail()  # prints the traceback, aborts, exits 1
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

ABORT_WAIT_S = 10.0  # an abort that has not returned by then is left behind


def abort_process_groups(timeout_s: float = ABORT_WAIT_S) -> bool:
    """Abort every process group of this process without waiting for peers; True when
    the abort returned within ``timeout_s`` (it runs in a thread: nothing blocks past)."""
    if not dist.is_available() or not dist.is_initialized():
        return True

    def abort() -> None:
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # gloo groups have no abort: the exit closes their sockets
            pass

    return _within(abort, timeout_s, "overlap-abort")


def _within(target, timeout_s: float, name: str) -> bool:
    """Run ``target`` in a daemon thread; True when it returned within ``timeout_s``."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def fail(exit_code: int = 1, error: BaseException | None = None) -> None:
    """Print the current (or given) exception's traceback naming this rank, record it
    where torchelastic reads a rank's error (``TORCHELASTIC_ERROR_FILE``: under torchrun
    and the local launcher), abort the process groups, and exit with ``exit_code`` at once
    (no interpreter teardown that could wait on a peer). Never returns."""
    rank = os.environ.get("RANK", "?")
    # the process's own stderr: torch's excepthook (set by init_process_group around
    # ours) points sys.stderr at a buffer it prints only after we return, and we do not
    stderr = sys.__stderr__ or sys.stderr
    try:
        if error is None:
            error = sys.exc_info()[1]
            text = traceback.format_exc()
        else:
            text = "".join(traceback.format_exception(error))
        stderr.write(f"[overlap] rank {rank} failed:\n{text}")
        _record_failure(text, error)
        stderr.write(
            f"[overlap] rank {rank}: aborting its communicators and exiting with {exit_code}; "
            "the launcher stops the other ranks\n"
        )
        stderr.flush()
        sys.stdout.flush()
        abort_process_groups()
    finally:
        os._exit(exit_code)


def finish(exit_code: int = 0, timeout_s: float = ABORT_WAIT_S) -> None:
    """End a rank whose work is done: flush its output, destroy its process groups while
    the interpreter is whole (at most ``timeout_s``: a destroy that waits for a peer is
    left behind, and one that raises is printed), and exit with ``exit_code`` without
    the interpreter's teardown. Torch objects still holding a finished collective's
    tensors are otherwise released during that teardown, when a gloo worker thread can
    no longer take the GIL and aborts the process ("terminate called without an active
    exception", SIGABRT): a finished job reported failed. Destroying the groups at exit
    (``overlap.comm.communicator``) leaves such objects behind: ``benchmarks/check_gpu.py``
    on 2 gloo ranks aborted so once in 8 runs, after every check had passed on both
    ranks (PyTorch tried the same destroy at exit, pytorch/pytorch#179291, and
    abandoned it). Never returns."""
    rank = os.environ.get("RANK", "?")

    def destroy() -> None:
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            sys.stderr.write(f"[overlap] rank {rank}: destroying its process groups at the "
                             f"end failed:\n{traceback.format_exc()}")  # fmt: skip

    try:
        sys.stdout.flush()
        sys.stderr.flush()
        if not _within(destroy, timeout_s, "overlap-finish"):
            sys.stderr.write(f"[overlap] rank {rank}: destroying its process groups did not "
                             f"return in {timeout_s:.0f} s; exiting without\n")  # fmt: skip
        sys.stderr.flush()
    finally:
        os._exit(exit_code)


# torchelastic (torchrun, and the local launcher on it) names a file for each rank's
# error (its ``record`` format); a failing rank writes its traceback there, and the time
# it failed to the microsecond: elastic's own ``timestamp`` is in whole seconds, too
# coarse to tell a rank that failed from its peers, whose collectives broke just after.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _record_failure(text: str, error: BaseException | None) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    said = "" if error is None else f"{type(error).__name__}: {error}"
    extra = {"py_callstack": text, "timestamp": str(int(now)), "failed_at": repr(now)}
    with open(path, "w") as record:
        json.dump({"message": {"message": said, "extraInfo": extra}}, record)


def recorded_failure(error_file_data: dict) -> tuple[float, str] | None:
    """What a rank's error record (``ProcessFailure.error_file_data``) says: when the rank
    failed, to the microsecond, and its traceback; None for a record ``fail`` did not write."""
    message = error_file_data.get("message")
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    if "failed_at" not in extra:
        return None
    return float(extra["failed_at"]), extra["py_callstack"]


def _hook(kind, value, tb) -> None:
    fail(1, value.with_traceback(tb))


def install() -> None:
    """Make an uncaught exception in this process fail fast (see ``fail``)."""
    sys.excepthook = _hook
