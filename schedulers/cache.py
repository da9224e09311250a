"""The kernel cache: one compiled kernel per distinct generated source.

A kernel's source holds its structure (ops, dtypes, broadcast pattern) and its
``Params``, never an extent: extents are runtime arguments that Triton does not
specialize on (``do_not_specialize``), so a new batch size reuses the kernel. The
cache counts its compilations so tests can assert that reuse.

Triton needs a kernel's source in a file it can read back, so each source is written
once under a per-process directory and imported from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import threading
from pathlib import Path


class KernelCache:
    """Compiled kernel functions by source text; ``compilations`` counts the builds."""

    def __init__(self) -> None:
        self._kernels: dict[str, object] = {}
        self._lock = threading.Lock()
        self._directory: Path | None = None
        self.compilations = 0

    def _folder(self) -> Path:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix=f"overlap_kernels_{os.getpid()}_"))
        return self._directory

    def get(self, source: str, name: str):
        """The function ``name`` defined by ``source``, built the first time it is asked for."""
        with self._lock:
            if source not in self._kernels:
                digest = hashlib.sha256(source.encode()).hexdigest()[:16]
                path = self._folder() / f"kernel_{digest}.py"
                path.write_text(source)
                spec = importlib.util.spec_from_file_location(f"overlap_kernel_{digest}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                self._kernels[source] = getattr(module, name)
                self.compilations += 1
            return self._kernels[source]

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self.compilations = 0


KERNEL_CACHE = KernelCache()
