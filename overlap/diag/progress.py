"""Progress messages for long steps (compiling generated kernels), logged at INFO on the
``overlap`` logger (``logging.getLogger("overlap")``).

Quiet by default, as a library should be: the messages go where the application's own
logging configuration sends the ``overlap`` logger's INFO records (nowhere, unless it
configures logging). ``OVERLAP_LOG_LEVEL`` (``INFO``, ``DEBUG``, ``WARNING``, ... or a
number) or ``enable()`` sets the logger's level and writes its records to standard error
as ``[overlap] ...`` lines; the ``overlap`` command calls ``enable()``, and the ranks it
starts inherit it through the environment.

``step(what)`` wraps a step: it says when it starts and how long it took; a kernel's
compile says only how long it took, and only when it was not already compiled (it took
a while)::

    with progress.step("planning the three programs"):
        ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

logger = logging.getLogger("overlap")
LEVEL_VARIABLE = "OVERLAP_LOG_LEVEL"
_stderr: logging.Handler | None = None  # attached once, by enable() or the environment
_NAMES = "DEBUG, INFO, WARNING, ERROR, CRITICAL"


def _level(name: str) -> int | None:
    """A level's number from its name or its digits (``"INFO"``, ``"20"``); None if neither."""
    return int(name) if name.isdigit() else logging.getLevelNamesMapping().get(name.upper())


def _write_to_stderr(level: int) -> None:
    global _stderr
    logger.setLevel(level)
    if _stderr is None:
        _stderr = logging.StreamHandler()  # standard error
        _stderr.setFormatter(logging.Formatter("[overlap] %(message)s"))
        logger.addHandler(_stderr)
        # once on standard error, not again through the root logger's handlers
        logger.propagate = False


def enable(level: int | str = logging.INFO) -> None:
    """Write the ``overlap`` logger's records of ``level`` (a number or a name such as
    ``"DEBUG"``) and above to standard error, here and in processes started after (they
    inherit ``OVERLAP_LOG_LEVEL``)."""
    number = _level(level) if isinstance(level, str) else level
    if number is None:
        raise ValueError(f"{level!r} is not a logging level ({_NAMES})")
    os.environ[LEVEL_VARIABLE] = str(number)
    _write_to_stderr(number)


def enabled() -> bool:
    """Whether progress messages (INFO) are logged anywhere."""
    return logger.isEnabledFor(logging.INFO)


@contextlib.contextmanager
def step(what: str, quiet_below_s: float | None = None):
    """Say that ``what`` starts and how long it took. With ``quiet_below_s``, say only
    how long it took, and only where it took that long: a kernel Triton had compiled
    before (its cache) passes silently instead of repeating its line."""
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    start = time.perf_counter()
    if quiet_below_s is None:
        logger.info("%s ...", what)
    yield
    took = time.perf_counter() - start
    if quiet_below_s is None or took >= quiet_below_s:
        logger.info("%s: %.1f s", what, took)


def _level_from_environment() -> None:
    name = os.environ.get(LEVEL_VARIABLE, "")
    if not name:
        return
    level = _level(name)
    if level is None:
        warnings.warn(f"{LEVEL_VARIABLE}={name!r} is not a logging level ({_NAMES}); the "
                      "overlap logger keeps its default", stacklevel=2)  # fmt: skip
        return
    _write_to_stderr(level)


_level_from_environment()
