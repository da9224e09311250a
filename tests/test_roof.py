"""The roof meter: measured per pattern from a run's timeline, loud when a planned overlap
did not happen."""

from __future__ import annotations

import re

import pytest
import torch

from fusion import FusionDefinition
from overlap import MultiDeviceExecutor, OverlapOptions, Timeline, compile_program
from overlap.diag.timeline import Span
from overlap.ir import Communicate, LaunchKernel, walk
from overlap.plan.figures import H200_FIGURES
from overlap.plan.roof import measure, report
from sharding import DeviceMesh, Shard, shard


def _ag_linear(world: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("ag_linear") as fd:
        x = fd.define_tensor([16 * world, 64])
        w = fd.define_tensor([32 * world, 64])
        fd.add_output(fd.ops.linear(x, w))
    shard(x, mesh, [Shard(0)])
    shard(w, mesh, [Shard(0)])
    return fd


def _pipelined_program():
    options = OverlapOptions(num_chunks=2, transport="collective")
    return compile_program(_ag_linear(2).fusion, 2, options, H200_FIGURES, schedule=True)


def _names(program) -> tuple[str, str]:
    (comm,) = {i.name for i in walk(program.instructions) if isinstance(i, Communicate)}
    (kernel,) = {
        i.name for i in walk(program.instructions) if isinstance(i, LaunchKernel)
    }  # the pipelined linear, one kernel launched per chunk
    return comm, kernel


def test_a_pipeline_whose_transfers_ran_beside_its_matmuls_is_measured_against_its_limit():
    compiled = _pipelined_program()
    comm, kernel = _names(compiled.host)
    # chunk 0's transfer 0-1 ms, chunk 1's 1-2 ms; matmul of chunk 0 1-2.5, chunk 1 2.5-4
    spans = [Span("stream 0 comm", comm, 0.0, 1.0), Span("stream 1 comm", comm, 1.0, 2.0),
             Span("stream 0 compute", kernel, 1.0, 2.5),
             Span("stream 1 compute", kernel, 2.5, 4.0)]  # fmt: skip
    (meter,) = measure(compiled.plan, compiled.host, spans)
    assert (meter.compute_ms, meter.comm_ms, meter.wall_ms) == (3.0, 2.0, 4.0)
    assert meter.overlapped_ms == 1.0 and meter.exposed_ms == 1.0
    assert meter.ratio == pytest.approx(4.0 / 3.0)
    assert not meter.overlap_missing
    text = report([meter])
    assert "measured: 4.000 ms = 1.33 x its limit" in text, text
    assert "exposed 1.000 ms" in text and "NOT OVERLAPPED" not in text, text


def test_a_planned_overlap_that_did_not_happen_is_reported_loudly():
    compiled = _pipelined_program()
    comm, kernel = _names(compiled.host)
    # every transfer waited for before any matmul started: the pipeline ran in sequence
    spans = [Span("stream 0 comm", comm, 0.0, 1.0), Span("stream 1 comm", comm, 1.0, 2.0),
             Span("stream 0 compute", kernel, 2.0, 3.0),
             Span("stream 1 compute", kernel, 3.0, 4.0)]  # fmt: skip
    (meter,) = measure(compiled.plan, compiled.host, spans)
    assert meter.overlap_missing and meter.ratio == 2.0
    assert "NOT OVERLAPPED: the plan pipelines this pattern" in report([meter])


def test_a_sequential_plan_says_so_and_no_run_says_nothing_ran():
    options = OverlapOptions(overlap=False)
    compiled = compile_program(_ag_linear(2).fusion, 2, options, H200_FIGURES, schedule=True)
    comm, kernel = _names(compiled.host)
    spans = [Span("comm", comm, 0.0, 1.0), Span("compute", kernel, 1.0, 3.0)]
    (meter,) = measure(compiled.plan, compiled.host, spans)
    assert not meter.overlap_missing  # nothing was planned to overlap
    assert "(sequential, as planned)" in str(meter)
    assert measure(compiled.plan, compiled.host, []) == []
    assert "no pattern of the plan ran" in report([])


def metered_run(communicator) -> str:
    options = OverlapOptions(num_chunks=2 * communicator.world_size, transport="collective")
    fd = _ag_linear(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator, options)
    generator = torch.Generator().manual_seed(0)  # the same whole inputs on every rank
    full = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    executor.run(executor.shard_inputs(full))
    timeline = Timeline(communicator.device)
    executor.run(executor.shard_inputs(full), timeline=timeline)
    return executor.explain_overlap(timeline)


def test_explain_overlap_with_a_timeline_measures_every_rank(rank_pools):
    for rank, text in enumerate(rank_pools(2).run(metered_run)):
        assert text.startswith("allgather+matmul"), text  # the plan first, as without
        assert "roof meter (this rank, the recorded run):" in text, (rank, text)
        measured = re.search(
            r"measured: ([\d.]+) ms = [\d.]+ x its limit; matmuls ([\d.]+) ms, "
            r"communication ([\d.]+) ms",
            text,
        )
        # the pattern's own kernels and transfers were found in the timeline and timed
        assert measured, (rank, text)
        wall, matmuls, communication = (float(measured.group(i)) for i in (1, 2, 3))
        assert matmuls > 0 and communication > 0 and wall > 0
