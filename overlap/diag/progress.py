"""Progress lines for long steps (compiling generated kernels), on standard error.

Off by default (a library should not print); the ``overlap`` command turns it on, and
so does ``OVERLAP_PROGRESS=1``. ``step(what)`` wraps a step: it says when it starts and
how long it took; a kernel's compile says only how long it took, and only when it was
not already compiled (it took a while).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

_enabled = os.environ.get("OVERLAP_PROGRESS") == "1"


def enable(on: bool = True) -> None:
    """Turn progress lines on (also for processes started after: the environment)."""
    global _enabled
    _enabled = on
    os.environ["OVERLAP_PROGRESS"] = "1" if on else "0"


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def step(what: str, quiet_below_s: float | None = None):
    """Say that ``what`` starts and how long it took. With ``quiet_below_s``, say only
    how long it took, and only where it took that long: a kernel Triton had compiled
    before (its cache) passes silently instead of repeating its line."""
    if not _enabled:
        yield
        return
    start = time.perf_counter()
    if quiet_below_s is None:
        print(f"[overlap] {what} ...", file=sys.stderr, flush=True)
    yield
    took = time.perf_counter() - start
    if quiet_below_s is None or took >= quiet_below_s:
        print(f"[overlap] {what}: {took:.1f} s", file=sys.stderr, flush=True)
