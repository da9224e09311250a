"""Figures measured on a device once, kept on disk for the runs after.

A device with no recorded profile (``schedulers.hardware.PROFILES``) is measured at its
first use: its copy bandwidth here, the links between its ranks in ``overlap``. Each
measurement is kept as one JSON file per what it depends on (its key: the device's name,
torch's version, the ranks...) in the cache folder: ``$OVERLAP_CACHE_DIR``, else
``$XDG_CACHE_HOME/overlap``, else ``~/.cache/overlap``.

A file is written whole or not at all (a temporary file in the same folder, renamed over
it), so ranks of one host that measure together leave one valid file. It is read back
only when it holds the same key and every figure it must: a file that cannot be read, is
not JSON, holds another key or a figure out of range is measured again, never trusted.

Example::

    key = {"device": "NVIDIA Made-Up GPU", "torch": torch.__version__}
    cached = read_cached("memory", key, positive=("memory_gbps",))
    if cached is None:
        write_cached("memory", key, {"memory_gbps": measure()})
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

CACHE_DIR_ENV = "OVERLAP_CACHE_DIR"


def cache_dir() -> Path:
    """The folder measured figures are kept in (see the module's docstring)."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "overlap"


def cache_path(kind: str, key: dict[str, object]) -> Path:
    """The file of ``kind``'s figures for ``key``: the key's values in words a person can
    read, and a digest of the whole key, so that two keys whose words read alike never
    share a file."""
    words = "_".join(
        re.sub(r"[^A-Za-z0-9.]+", "-", str(value)).strip("-") for value in key.values()
    )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / f"{kind}_{words}_{digest}.json"


def _in_range(value: object, least: float, inclusive: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= least if inclusive else value > least


def read_cached(
    kind: str, key: dict[str, object], positive: Iterable[str], non_negative: Iterable[str] = ()
) -> dict[str, float] | None:
    """The figures kept for ``kind`` and ``key``, or None when there are none to trust:
    no file, one that cannot be read or is not JSON, another key in it, or a figure of
    ``positive`` not above 0 (of ``non_negative``: below 0), missing or not a number."""
    try:
        kept = json.loads(cache_path(kind, key).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    figures = kept.get("figures")
    if not isinstance(figures, dict):
        return None
    wanted = [(name, False) for name in positive] + [(name, True) for name in non_negative]
    if not all(_in_range(figures.get(name), 0.0, inclusive) for name, inclusive in wanted):
        return None
    return {name: float(figures[name]) for name, _ in wanted}


def write_cached(kind: str, key: dict[str, object], figures: dict[str, float]) -> Path | None:
    """Keep ``figures`` for ``kind`` and ``key`` (atomically: a temporary file renamed
    over the old one). Returns the file, or None with a warning when the folder cannot be
    written: the run goes on, and the next one measures again."""
    path = cache_path(kind, key)
    measured_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    text = json.dumps({"key": key, "figures": figures, "measured_at": measured_at}, indent=1)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.stem}_", suffix=".tmp"
        )
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        warnings.warn(
            f"could not keep the measured {kind} figures of {key} in {path} ({error}): they "
            f"are measured again next time; set {CACHE_DIR_ENV} to a folder that can be written",
            stacklevel=2,
        )
        return None
    return path
