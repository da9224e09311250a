"""The planner's host model: the steps a rank issues, by kind, and what they cost.

The count the planner charges a pattern's candidate before lowering
(``host_steps.pattern_steps``) is the lowered program's (``issued_steps``), which is the
rank program's the runtime builds (on two gloo ranks; streams as on CUDA too). The host
time prices each kind by the device's ``HostFigures``; a replayed run pays the replay and
its inputs' copies instead; the planner keeps a pipeline the host cannot issue in time
from beating sequential, and says so.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch
from test_pipelined import _linear_rs

from fusion import FusionDefinition
from launch.demo import build_tp_mlp
from overlap import OverlapOptions, compile_program
from overlap.ir import Transport
from overlap.plan.cost_model import estimate
from overlap.plan.figures import H200_FIGURES, HostFigures
from overlap.plan.host_steps import HostStep, issued_steps, pattern_steps, step_counts
from overlap.plan.planner import Pattern, plan_overlap
from overlap.runtime.rank_program import RankProgram, RankSetup
from overlap.runtime.streams import StreamPool
from schedulers.hardware import current_hardware
from sharding import DeviceMesh, Shard, shard, shard_fusion


def _gathered_into(
    matmuls: int, world: int, rows: int = 16, width: int = 8, columns: int = 4,
    dtype: str = "float32",
) -> FusionDefinition:  # fmt: skip
    """``rows`` rows a rank of ``width``, gathered, read by ``matmuls`` column-parallel
    linears (Q, K, V, say) of ``columns`` columns a rank."""
    mesh = DeviceMesh(world)
    with FusionDefinition(f"ag_{matmuls}_linears") as fd:
        x = fd.define_tensor([rows * world, width], dtype)
        weights = [fd.define_tensor([columns * world, width], dtype) for _ in range(matmuls)]
        outputs = [fd.ops.linear(x, w) for w in weights]
        for output in outputs:
            fd.add_output(output)
    shard(x, mesh, [Shard(0)])
    for tensor in (*weights, *outputs):
        shard(tensor, mesh, [Shard(tensor.ndim - 1 if tensor in outputs else 0)])
    return fd


def _scattered(world: int, rows: int = 16) -> FusionDefinition:
    """A row-parallel linear: the contraction split, its partial sums reduce-scattered
    along the rows (``rows`` a rank)."""
    return _linear_rs(world, rows * world)


# (build(world), gather, matmuls): one pattern each
SINGLE_PATTERNS = {
    "ag-1-matmul": (lambda world: _gathered_into(1, world), True, 1),
    "ag-3-matmuls": (lambda world: _gathered_into(3, world), True, 3),
    "matmul-rs": (_scattered, False, 1),
}
# the candidates the planner prices: sequential, or a pipeline of chunks a rank times
# the team by a transport (ring included at every count: forced, it runs so)
PLANS = [(None, 1)] + [(t, per_rank) for t in Transport for per_rank in (1, 2, 4)]


def _options(transport: Transport | None, per_rank: int, world: int) -> OverlapOptions:
    if transport is None:
        return OverlapOptions(overlap=False)
    return OverlapOptions(transport=transport, num_chunks=per_rank * world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(SINGLE_PATTERNS))
def test_a_candidates_counted_steps_are_those_of_its_lowered_program_on_every_rank(case, world):
    """For each candidate (sequential; collective, ring and copy-engine pipelines of 1, 2
    and 4 chunks a rank), the steps counted before lowering, by kind, are the lowered
    program's with its loops unrolled, on every rank, with streams (CUDA) and without."""
    build, gather, matmuls = SINGLE_PATTERNS[case]
    for transport, per_rank in PLANS:
        options = _options(transport, per_rank, world)
        compiled = compile_program(build(world), world, options, H200_FIGURES, schedule=True)
        (decision,) = compiled.plan
        assert decision.chosen.transport == transport, decision
        chunks = per_rank * world if transport else 1
        for streams in (False, True):
            counted = pattern_steps(gather, transport, chunks, matmuls, streams)
            for rank in range(world):
                lowered = step_counts(issued_steps(compiled.host, rank, streams))
                assert lowered == counted, (transport, chunks, streams, rank, compiled.host)
            assert (counted[HostStep.STREAM_SWITCH] > 0) == (streams and transport is not None)
        kernels = counted[HostStep.LIBRARY_KERNEL]
        assert kernels == matmuls * chunks if gather else chunks, counted


def _block(world: int) -> FusionDefinition:
    """The demo's tensor-parallel MLP: an all-gather into a matmul, a generated kernel
    (gelu), a matmul whose partials are reduce-scattered."""
    return build_tp_mlp(32 * world, 16, 32 * world, world)


@pytest.mark.parametrize("world", [2, 4])
def test_a_programs_pipelines_each_add_their_patterns_steps_but_save_the_users_stream_once(
    world,
):
    """With both patterns of a block pipelined, the program issues, beyond its
    sequential self, what each pattern's pipeline adds over its sequential run, save that
    it keeps the user's stream once for both (counted per pattern: one stream switch
    fewer than the patterns' sum)."""
    sequential = compile_program(_block(world), world, OverlapOptions(overlap=False),
                                 H200_FIGURES, schedule=True)  # fmt: skip
    for transport in Transport:
        options = OverlapOptions(transport=transport, num_chunks=2 * world)
        pipelined = compile_program(_block(world), world, options, H200_FIGURES, schedule=True)
        assert len(pipelined.plan) == 2
        added = step_counts(issued_steps(pipelined.host, 0, True))
        added.subtract(step_counts(issued_steps(sequential.host, 0, True)))
        expected: Counter[HostStep] = Counter()
        for decision in pipelined.plan:
            gather = decision.pattern is Pattern.ALLGATHER_MATMUL
            matmuls = 1 + len(decision.chunked)
            expected.update(pattern_steps(gather, transport, 2 * world, matmuls, True))
            expected.subtract(pattern_steps(gather, None, 1, matmuls, True))
        expected[HostStep.STREAM_SWITCH] -= len(pipelined.plan) - 1
        assert +added == +expected and -added == -expected, (transport, added, expected)


class _StreamsAsOnCuda(StreamPool):
    """A CPU rank's streams, claiming to be CUDA's: a rank program is built with its
    stream steps (and never run)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cuda = True

    def get(self, index: int) -> int:
        return index


def _builder(step) -> str:
    """The name of the ``RankProgram`` step builder that made ``step`` (``_allocate``),
    or ``loop end`` for a step no builder made (those after each loop)."""
    builders = {builder.__name__ for builder in RankProgram._STEPS.values()}
    name = getattr(step, "__qualname__", type(step).__qualname__)
    name = name.split(".<locals>")[0].rsplit(".", 1)[-1]
    return name if name in builders else "loop end"


def built_and_counted_steps(communicator) -> list[tuple[str, list[str], list[str]]]:
    """On each rank, for every candidate of each single pattern and of the block, with
    and without stream steps: the builders of the rank program's steps, and those of
    the steps the host model counts."""
    world, rank = communicator.world_size, communicator.rank
    found = []
    fusions = {name: build for name, (build, _, _) in SINGLE_PATTERNS.items()}
    fusions["tp-mlp"] = _block
    for name, build in fusions.items():
        for transport, per_rank in PLANS:
            if per_rank > 2:
                continue  # four chunks a rank count as two do
            compiled = compile_program(build(world), world, _options(transport, per_rank, world),
                                       H200_FIGURES, schedule=True)  # fmt: skip
            communicator.prepare(team for c in compiled.host.communications for team in c.teams())
            for streams in (False, True):
                pool = _StreamsAsOnCuda() if streams else StreamPool(communicator.device)
                setup = RankSetup(rank, communicator, communicator.device, pool, None, {},
                                  current_hardware(communicator.device))  # fmt: skip
                program = RankProgram(compiled, setup, {})
                built = [_builder(step) for step in program.steps]
                counted = [
                    "loop end" if step.kind is HostStep.LOOP_END
                    else RankProgram._STEPS[type(step.instruction)].__name__
                    for step in issued_steps(compiled.host, rank, streams)
                ]  # fmt: skip
                found.append((f"{name} {transport} x{per_rank} streams={streams}", built, counted))
    return found


def test_the_rank_programs_the_runtime_builds_issue_the_counted_steps_in_order(rank_pools):
    """On two gloo ranks, the rank program of every candidate (copy-engine ones too,
    built without being run), of a single pattern and of a block with generated kernels,
    with stream steps as on CUDA and without: its steps, in order, are the host model's,
    each made by the builder of the instruction the model counted it for."""
    for rank, cases in enumerate(rank_pools(2).run(built_and_counted_steps, timeout=300)):
        plans = [plan for plan in PLANS if plan[1] <= 2]
        assert len(cases) == (len(SINGLE_PATTERNS) + 1) * len(plans) * 2, len(cases)
        for case, built, counted in cases:
            assert built == counted, (rank, case)
        assert any("_set_current_stream" in built for _, built, _ in cases)


# -- pricing ----------------------------------------------------------------------------

# a distinct cost for every kind, so a sum that used the wrong kind's shows
DISTINCT_HOST = HostFigures(
    step_us={kind: 1.0 + 0.37 * index for index, kind in enumerate(HostStep)},
    run_us=23.0,
    graph_replay_us=31.0,
    graph_input_copy_us=4.5,
    streams=True,
    source="made up for a test",
)


def test_a_candidates_host_time_prices_each_kind_of_step_and_a_replay_its_inputs():
    figures = dataclasses.replace(H200_FIGURES, host=DISTINCT_HOST)
    args = (Pattern.ALLGATHER_MATMUL, figures, (4096, 4096, 4096), 2, 16)
    for transport, chunks in [(None, 1), (Transport.COLLECTIVE, 4), (Transport.RING, 2)]:
        steps = pattern_steps(True, transport, chunks, 2, streams=True)
        issued = estimate(*args, transport, chunks, matmuls=2, inputs=3)
        priced = 23.0 + sum(DISTINCT_HOST.step_us[kind] * count for kind, count in steps.items())
        assert issued.host_ms == pytest.approx(priced / 1e3)
        assert issued.host_steps == steps.total()
        replayed = estimate(*args, transport, chunks, replayed=True, matmuls=2, inputs=3)
        assert replayed.host_ms == pytest.approx((31.0 + 3 * 4.5) / 1e3)
        assert replayed.device_ms == issued.device_ms
        assert issued.predicted_ms == max(issued.device_ms, issued.host_ms)


def test_host_figures_price_every_kind_and_print_each():
    text = str(DISTINCT_HOST)
    assert text.startswith("host figures (made up for a test), us:")
    for kind, us in DISTINCT_HOST.step_us.items():
        assert f"\n  {kind}: {us:.2f}" in text
    assert "a call: 23.00; a graph replay: 31.00 + 4.50 an input copied" in text
    costs = dict(DISTINCT_HOST.step_us)
    del costs[HostStep.LOOP_END]
    with pytest.raises(ValueError, match="without a cost for loop end"):
        HostFigures(costs, 0.0, 0.0, 0.0, True, "incomplete")


def test_a_pipeline_the_host_cannot_issue_in_time_loses_to_sequential_unless_replayed():
    """On a host that takes 40 us a step, a pipeline whose device time alone beats the
    sequential run is host-bound and loses to it: the planner keeps the communication
    whole, and says that the pipelines are host-bound. Replayed from a CUDA graph, the
    host issues no step, and the pipeline wins."""
    slow_host = HostFigures.fallback(launch_us=40.0)
    figures = dataclasses.replace(H200_FIGURES, host=slow_host)
    fusion = shard_fusion(_gathered_into(1, 2, 2048, 8192, 2048, "bf16").fusion)[0]
    (decision,) = plan_overlap(fusion, figures)
    assert decision.shape == (4096, 8192, 2048)
    sequential = next(c for c in decision.candidates if c.transport is None)
    assert decision.chosen == sequential
    device_faster = [c for c in decision.candidates if c.device_ms < sequential.device_ms]
    assert device_faster and all(c.host_ms > sequential.predicted_ms for c in device_faster)
    assert "host-bound" in str(decision)
    (replayed,) = plan_overlap(fusion, figures, replayed=True)
    assert replayed.overlapped and replayed.chosen.host_ms < replayed.chosen.device_ms


def test_explain_overlap_shows_each_candidates_device_and_host_time_and_the_programs():
    """Every candidate line reads its prediction as the longer of its device and host
    times, with its steps; after the plan, the whole program's host time a call on its
    slowest rank, its steps by kind (as many as the rank issues), and where the host
    figures come from; planned for replays, the replay's time too."""
    fd = _block(2)
    for replayed in (False, True):
        compiled = compile_program(fd, 2, None, H200_FIGURES, schedule=True, replayed=replayed)
        text = compiled.explain_overlap()
        lines = re.findall(
            r"^  [* ] +([\d.]+) ms  .*\(device ([\d.]+), host ([\d.]+) ms, (\d+) steps", text, re.M
        )
        assert len(lines) == sum(len(decision.candidates) for decision in compiled.plan)
        for predicted, device, host, _ in lines:
            assert float(predicted) == pytest.approx(max(float(device), float(host)), abs=1e-3)
        program = re.search(r"^host: ([\d.]+) ms a call step by step, rank (\d) \((\d+) steps",
                            text, re.M)  # fmt: skip
        assert program, text
        rank = int(program.group(2))
        assert int(program.group(3)) == len(issued_steps(compiled.host, rank, streams=True))
        assert f"host figures: {H200_FIGURES.host.source}" in text
        assert ("replayed from a CUDA graph (as planned)" in text) == replayed
