"""Progress lines for long steps (compiling generated kernels), on standard error.

Off by default (a library should not print); the ``overlap`` command turns it on, and
so does ``OVERLAP_PROGRESS=1``. ``step(what)`` wraps a step: it says when it starts and
how long it took.
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
def step(what: str):
    if not _enabled:
        yield
        return
    start = time.perf_counter()
    print(f"[overlap] {what} ...", file=sys.stderr, flush=True)
    yield
    print(f"[overlap] {what}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
