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
from collections.abc import Callable
from pathlib import Path

from schedulers.runtime import BoundKernel

# Pitches (row strides) that are multiples of this many elements start every row on a
# 128-bit boundary for every dtype down to 8 bits: kernels told so can issue vector
# loads and stores, which Triton cannot prove for a pitch it does not specialize on.
ALIGN_ELEMENTS = 16


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

    def sources(self) -> list[str]:
        """The sources built so far, oldest first."""
        with self._lock:
            return list(self._kernels)

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self.compilations = 0


KERNEL_CACHE = KernelCache()


class AlignedVariants:
    """One kernel in two forms: the general one, and one that knows some runtime
    arguments (pitches, the extent its mask tests) are multiples of ``ALIGN_ELEMENTS``
    (it takes them divided by it).

    Which form runs is a divisibility fact of the extents, not an extent: a new batch
    size keeps the form, and each form is built once. Both take the compile-time
    arguments ``keywords`` (``tl.constexpr`` values, ``num_warps``, compile options) and
    are launched as ``BoundKernel``: ``kernel(grid, *pointers, *arguments)``.
    """

    def __init__(self, source_of: Callable[[bool], str], name: str, keywords: dict) -> None:
        self._source_of = source_of
        self._name = name
        self._keywords = keywords
        self._kernels: dict[bool, BoundKernel] = {}
        self.used: set[bool] = set()  # which forms have run

    def kernel(self, aligned: bool) -> BoundKernel:
        if aligned not in self._kernels:
            kernel = KERNEL_CACHE.get(self._source_of(aligned), self._name)
            self._kernels[aligned] = BoundKernel(kernel, self._keywords)
        return self._kernels[aligned]

    def bind(self, runtime: dict[str, int], known: list[str]) -> tuple[BoundKernel, list[int]]:
        """The kernel for these runtime arguments (the aligned one when every argument in
        ``known`` is a multiple of ``ALIGN_ELEMENTS``) and the arguments it takes, in order."""
        aligned = all(runtime[name] % ALIGN_ELEMENTS == 0 for name in known)
        self.used.add(aligned)
        arguments = [
            value // ALIGN_ELEMENTS if aligned and name in known else value
            for name, value in runtime.items()
        ]
        return self.kernel(aligned), arguments


def forms_used(variants: list[AlignedVariants]) -> list[str]:
    """The forms that have run: ``"aligned"``, ``"general"``, or both."""
    used = set().union(*(v.used for v in variants))
    return [name for flag, name in ((True, "aligned"), (False, "general")) if flag in used]
