"""Diagnostics: a run's spans as profiler ranges, progress messages through ``logging``."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.demo import build_tp_mlp, whole_inputs
from overlap import MultiDeviceExecutor, OverlapOptions, Timeline
from overlap.diag import progress
from overlap.diag.ranges import Recorder, recorder
from overlap.diag.timeline import span_name

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# Profiler ranges


def test_spans_become_profiler_ranges_only_while_a_profiler_records():
    timeline = Timeline("cpu")
    # no profiler: the run keeps its timeline (or none), nothing in between
    assert recorder(None, cuda=False) is None and recorder(timeline, cuda=False) is timeline
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        spans = recorder(timeline, cuda=False)
        assert isinstance(spans, Recorder) and spans.record and not spans.nvtx
        comm = spans.start("stream 0 comm", "c0", "Allgather T6", 1)
        with spans.span("stream 0 compute", "k1", "matmul", 0):
            pass
        spans.stop(comm)  # after the kernel's: a communication's range is not nested
    names = {event.name for event in profile.events()}
    assert {"c0.1 Allgather T6", "k1.0 matmul"} <= names
    assert [s.label for s in timeline.spans()] == ["c0.1", "k1.0"]  # the timeline too


def profiled_run(communicator) -> tuple[list[str], list[str]]:
    """The demo's tensor-parallel MLP (an all-gather, two matmuls, a reduce-scatter),
    pipelined, run under ``torch.profiler`` with a timeline: the profiler's event names
    and the timeline's spans' names."""
    world = communicator.world_size
    fd = build_tp_mlp(8 * world, 16, 16 * world, world)
    options = OverlapOptions(num_chunks=world, transport="collective")
    executor = MultiDeviceExecutor(fd, communicator, options)
    local = executor.shard_inputs(whole_inputs(8 * world, 16, 16 * world))
    executor.run(local)  # the first run compiles
    timeline = Timeline("cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        executor.run(local, timeline=timeline)
    spans = [span_name(s.name, s.detail, s.chunk) for s in timeline.spans()]
    return sorted({event.name for event in profile.events()}), spans


def test_a_placed_run_under_the_profiler_shows_its_kernels_and_communications(rank_pools):
    for names, spans in rank_pools(2).run(profiled_run):
        # every span of the timeline is in the profiler's events, under the same name
        assert set(spans) <= set(names), sorted(set(spans) - set(names))
        # each chunk's transfers and matmuls among them ("c0.1 Allgather T6")
        kinds = {re.sub(r"^([ck])\d+(\.\d)? (\w+).*", r"\1\2 \3", s) for s in spans}
        assert {"c.0 Allgather", "c.1 Allgather", "c.0 ReduceScatter", "c.1 ReduceScatter",
                "k.0 matmul", "k.1 matmul"} <= kinds, spans  # fmt: skip


# ---------------------------------------------------------------------------
# Progress


def test_a_step_says_when_it_starts_and_how_long_it_took(caplog):
    caplog.set_level(logging.INFO, logger="overlap")
    with progress.step("planning"):
        pass
    with progress.step("compiled k0", quiet_below_s=60.0):  # quick: Triton's cache, silent
        pass
    with progress.step("compiled k1", quiet_below_s=0.0):
        pass
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert said[0] == ("overlap", "INFO", "planning ...") and len(said) == 3, said
    assert re.fullmatch(r"planning: \d+\.\d s", said[1][2]), said
    assert re.fullmatch(r"compiled k1: \d+\.\d s", said[2][2]), said


_SAYS = "from overlap.diag import progress\nwith progress.step('planning'):\n    pass\n"


def _stderr(code: str, **environment: str) -> list[str]:
    """Standard error's lines of ``code`` run in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != progress.LEVEL_VARIABLE}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env | environment,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr.splitlines()


@pytest.mark.slow
def test_progress_is_quiet_unless_the_environment_or_enable_turns_it_on():
    assert _stderr(_SAYS) == []  # a library says nothing by default
    lines = _stderr(_SAYS, OVERLAP_LOG_LEVEL="info")
    assert lines[0] == "[overlap] planning ..." and len(lines) == 2, lines
    assert re.fullmatch(r"\[overlap\] planning: \d+\.\d s", lines[1]), lines
    assert _stderr(_SAYS, OVERLAP_LOG_LEVEL="WARNING") == []  # above INFO
    lines = _stderr(_SAYS, OVERLAP_LOG_LEVEL="loud")  # warned, and quiet
    assert any("OVERLAP_LOG_LEVEL='loud' is not a logging level" in line for line in lines)
    assert not any(line.startswith("[overlap]") for line in lines), lines
    # enable() here: a process started after says its steps (the environment)
    started = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {_SAYS!r}])\n"
    lines = _stderr("from overlap.diag import progress\nprogress.enable()\n" + started)
    assert lines[0] == "[overlap] planning ..." and len(lines) == 2, lines
