"""Profiler ranges for a run's spans: each kernel launch and communication the runtime
issues, named as the timeline names it (``k2 matmul``, ``c1.0 Allgather T6``), shows in a
``torch.profiler`` trace and, on CUDA, in Nsight Systems (NVTX).

Only while someone listens, since the run path counts microseconds: ``recorder(timeline,
cuda)`` asks once per run whether a torch profiler records (``torch.profiler.profile``,
``torch.autograd.profiler.emit_nvtx``); ``OVERLAP_NVTX=1`` asks for NVTX ranges without
one (``nsys profile`` alone). Otherwise the run records into its timeline, if it has one,
and nothing else. A CUDA graph replay (``cuda_graph=True``, no timeline) runs none of the
rank program's steps: it shows as the graph's launch::

    with torch.profiler.profile() as profile:
        executor.run(inputs)  # the trace holds "k0 matmul", "c0.1 Allgather T6", ...
"""

from __future__ import annotations

import os

import torch

from overlap.diag.timeline import SpanRecorder, Timeline, span_name

NVTX_VARIABLE = "OVERLAP_NVTX"
_NVTX_ASKED = os.environ.get(NVTX_VARIABLE) == "1"
# whether any torch profiler records (its C++ side's state), bound once: asked every run
_profiler_enabled = torch.autograd._profiler_enabled


class Recorder(SpanRecorder):
    """A run's spans recorded into its ``timeline`` (if any) and opened as profiler
    ranges: ``record_function`` ranges where a torch profiler records, NVTX ranges on
    CUDA. It answers as the timeline does (``start``, ``stop``, ``span``); a
    communication's range runs from its issue to its wait, so ranges may overlap (both
    kinds allow it)."""

    def __init__(self, timeline: Timeline | None, record: bool, nvtx: bool) -> None:
        self.timeline, self.record, self.nvtx = timeline, record, nvtx

    def start(self, lane: str, name: str, detail: str = "", chunk: int | None = None) -> tuple:
        """Open a span's ranges (and its timeline span); ``stop`` takes what it returns."""
        title = span_name(name, detail, chunk)
        function = None
        if self.record:
            function = torch.profiler.record_function(title)
            function.__enter__()
        marker = torch.cuda.nvtx.range_start(title) if self.nvtx else None
        token = None if self.timeline is None else self.timeline.start(lane, name, detail, chunk)
        return token, function, marker

    def stop(self, handle: tuple) -> None:
        """Close the ranges ``start`` opened, in any order."""
        token, function, marker = handle
        if token is not None:
            self.timeline.stop(token)
        if marker is not None:
            torch.cuda.nvtx.range_end(marker)
        if function is not None:
            function.__exit__(None, None, None)


def recorder(timeline: Timeline | None, cuda: bool) -> Timeline | Recorder | None:
    """What records one run's spans: the ``timeline`` itself where no profiler listens
    (None without one: the common case, which costs one check), else a ``Recorder``
    that also opens profiler ranges. Under ``emit_nvtx`` the profiler turns every
    ``record_function`` into a nested NVTX range, which a communication's range (issue
    to wait) would break: there the ranges are NVTX ones only."""
    profiling = _profiler_enabled()
    if not profiling and not (cuda and _NVTX_ASKED):
        return timeline
    nvtx_profiler = profiling and (
        torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.NVTX
    )
    return Recorder(timeline, record=profiling and not nvtx_profiler, nvtx=cuda)
