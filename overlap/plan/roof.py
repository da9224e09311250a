"""The roof meter: how close each planned pattern came to its limit in a recorded run.

For every decision of the overlap plan, the spans that a ``Timeline`` recorded on this
rank for the pattern's communication (issue to wait) and its matmuls are measured:

- ``compute_ms``: the time some matmul of the pattern ran (union of its kernel spans);
- ``comm_ms``: the time its communication was in flight (union of its spans);
- ``wall_ms``: from the pattern's first span's start to its last span's end;
- ``exposed_ms``: ``wall_ms - compute_ms``, the time the pattern ran no matmul: its
  communication not hidden (or the host late to issue);
- ``ratio``: ``wall_ms / max(compute_ms, comm_ms)``; 1.00 is the limit (the shorter of
  the two hidden under the longer).

A pattern the plan pipelines whose communication never ran while one of its matmuls
did is reported loudly (``NOT OVERLAPPED``): the overlap was planned and did not happen.
A backward that averaged its gradients over data-parallel replicas gets a line of its
own (``data_parallel_meter``): the all-reduces' time in flight, beside the kernels, and
past the last one.
Example::

    timeline = Timeline(device)
    executor.run(local_inputs, timeline=timeline)
    print(executor.explain_overlap(timeline))
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.diag.timeline import DATA_PARALLEL_LANE, Span
from overlap.ir import Communicate, HostProgram, LaunchKernel, walk
from overlap.plan.planner import OverlapDecision, OverlapPlan

# Below this share of its communication time spent beside a matmul, a planned overlap
# did not happen.
OVERLAPPED_SHARE = 0.05


@dataclass(frozen=True)
class PatternMeter:
    """One pattern's measured times on this rank (ms), see the module."""

    decision: OverlapDecision
    compute_ms: float
    comm_ms: float
    wall_ms: float
    overlapped_ms: float  # communication in flight while a matmul of the pattern ran

    @property
    def exposed_ms(self) -> float:
        return max(self.wall_ms - self.compute_ms, 0.0)

    @property
    def ratio(self) -> float:
        limit = max(self.compute_ms, self.comm_ms)
        return self.wall_ms / limit if limit > 0 else float("nan")

    @property
    def overlap_missing(self) -> bool:
        """Planned as a pipeline, yet the communication never ran beside a matmul."""
        return self.decision.overlapped and self.overlapped_ms < OVERLAPPED_SHARE * self.comm_ms

    def __str__(self) -> str:
        decision = self.decision
        head = (
            f"{decision.pattern} ({decision.communication.op_name} "
            f"{decision.communication.output.name}): {decision.chosen.describe()}"
        )
        line = (
            f"  measured: {self.wall_ms:.3f} ms = {self.ratio:.2f} x its limit; matmuls "
            f"{self.compute_ms:.3f} ms, communication {self.comm_ms:.3f} ms "
            f"({self.overlapped_ms:.3f} ms of it beside a matmul), exposed "
            f"{self.exposed_ms:.3f} ms"
        )
        if self.overlap_missing:
            line += (
                "\n  NOT OVERLAPPED: the plan pipelines this pattern, but its communication "
                "never ran while one of its matmuls did (see the timeline)"
            )
        elif not decision.overlapped:
            line += " (sequential, as planned)"
        return f"{head}\n{line}"


def measure(plan: OverlapPlan, program: HostProgram, spans: list[Span]) -> list[PatternMeter]:
    """Each decision of ``plan`` measured on ``spans`` (one run of ``program``); a pattern
    with no recorded span on this rank is left out."""
    meters = []
    for decision in plan:
        comm_names, kernel_names = _names(decision, program)
        comm = _union([(s.start_ms, s.end_ms) for s in spans if s.name in comm_names])
        compute = _union([(s.start_ms, s.end_ms) for s in spans if s.name in kernel_names])
        if not comm and not compute:
            continue
        everything = comm + compute
        wall = max(end for _, end in everything) - min(start for start, _ in everything)
        meters.append(
            PatternMeter(
                decision,
                _length(compute),
                _length(comm),
                wall,
                _length(_intersection(comm, compute)),
            )  # fmt: skip
        )
    return meters


def report(meters: list[PatternMeter]) -> str:
    if not meters:
        return "roof meter: no pattern of the plan ran on this rank in the recorded run"
    return "roof meter (this rank, the recorded run):\n" + "\n".join(str(m) for m in meters)


def data_parallel_meter(spans: list[Span]) -> str | None:
    """The gradients' all-reduces over data-parallel replicas in a recorded backward (its
    spans on ``DATA_PARALLEL_LANE``) against the run's kernels: how long they were in
    flight, how much of it beside a kernel, and how long the last one ran past the last
    kernel (what the step waits for); None where the run reduced none."""
    reduces = [(s.start_ms, s.end_ms) for s in spans if s.lane == DATA_PARALLEL_LANE]
    if not reduces:
        return None
    comm = _union(reduces)
    compute = _union([(s.start_ms, s.end_ms) for s in spans if s.lane.endswith("compute")])
    in_flight, beside = _length(comm), _length(_intersection(comm, compute))
    last_kernel = max((end for _, end in compute), default=comm[0][0])
    after = max(0.0, comm[-1][1] - last_kernel)
    share = beside / in_flight if in_flight > 0 else 0.0
    return (
        f"data-parallel reduce: {len(reduces)} all-reduces, {in_flight:.3f} ms in flight, "
        f"{beside:.3f} ms of it beside the backward's kernels ({share:.0%}), exposed "
        f"{after:.3f} ms after its last kernel"
    )


def _names(decision: OverlapDecision, program: HostProgram) -> tuple[set[str], set[str]]:
    """The names of the pattern's communication and matmul instructions."""
    matmuls = {decision.contraction, *(expr for expr, _ in decision.chunked)}
    comms, kernels = set(), set()
    for instruction in walk(program.instructions):
        if isinstance(instruction, Communicate):
            if instruction.communication is decision.communication:
                comms.add(instruction.name)
        elif isinstance(instruction, LaunchKernel) and matmuls.intersection(instruction.exprs):
            kernels.add(instruction.name)
    return comms, kernels


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(first: list[tuple[float, float]], second: list[tuple[float, float]]):
    return [(max(a, c), min(b, d)) for a, b in first for c, d in second if min(b, d) > max(a, c)]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)
