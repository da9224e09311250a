"""The host's cost of each kind of step a rank program issues, of a call around its steps,
and of a CUDA graph's replay: the figures the planner's host model reads
(``overlap.plan.figures.HostFigures``).

    torchrun --nproc-per-node 2 benchmarks/host_figures.py         # GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/host_figures.py --cpu   # CPU processes (gloo)

Small programs of each shape the planner prices (all-gather + matmul and matmul +
reduce-scatter, sequential and pipelined by each transport; a small tensor-parallel MLP
with generated kernels and, on CUDA, with the evaluator's) are built as an executor
builds them and run ``--runs`` times on every rank, each step timed by the host's clock
(every rank starting each batch of runs together; on CUDA the GPU kept busy by a
sleeping kernel queued before each batch, so that no step waits for it). The host model
names each step's kind (``overlap.plan.host_steps.issued_steps``); the script stops if
its steps are not the rank program's. A kind's cost is the mean over its steps of each
one's trimmed mean (less the timer's own cost); a call's fixed cost, the executor's
around the rank program's run and the run's around its steps (the median over the
programs); on CUDA, a replay's cost is a call replayed from a graph that reads its inputs
in place, and an input's copy the extra of one that copies every input in, per input.
Every figure is the slowest rank's.

Prints a table and the ``HostFigures`` to record in ``overlap/plan/figures.py`` (kinds
this device did not run keep the fallback, marked so; on CPUs so do the communication
steps and the steps after a loop, which wait for gloo's transfers there), and writes
``benchmarks/results/host_figures.json`` (``host_figures_cpu.json`` with ``--cpu``;
``--out``): device, date, commit, command, one object per row.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ag_matmul import build  # noqa: E402
from benchmarks.kernels import commit_id  # noqa: E402
from launch.demo import build_tp_mlp  # noqa: E402
from overlap import Communicator, MultiDeviceExecutor, OverlapOptions  # noqa: E402
from overlap.comm.measure import host_probe_us  # noqa: E402
from overlap.plan.figures import CPU_FIGURES, H200_FIGURES, HostFigures  # noqa: E402
from overlap.plan.host_steps import HostStep, issued_steps  # noqa: E402
from overlap.runtime.rank_program import RankProgram, RankSetup  # noqa: E402
from overlap.runtime.rank_programs import RankPrograms  # noqa: E402
from overlap.runtime.streams import StreamPool  # noqa: E402
from schedulers.hardware import current_hardware  # noqa: E402

# runs between two synchronizations: few enough that the launches queued behind the
# sleeping kernel never fill CUDA's queue (the host would then wait for the GPU)
BATCH = 5
SLEEP_MARGIN = 2.0  # the GPU sleeps this many times a batch's expected host time
# ... and never longer than this: a batch whose host waited for the GPU (a step that
# synchronizes) took as long as the sleep, and the sleep fed on it doubled every batch,
# which ran for hours on 2x H200 (nothing printed after minutes)
SLEEP_MAX_MS = 50.0


# On CPUs gloo moves the data on the host: posting and waiting for a communication, and
# the steps after a loop (its put-off waits, its sends drained), last as long as the
# transfer and the peer take, which the device model already prices. Their measured
# times are shown, not recorded.
WAITING_ON_CPUS = {
    HostStep.POST, HostStep.WAIT, HostStep.POST_CHUNK_COLLECTIVE,
    HostStep.WAIT_CHUNK_COLLECTIVE, HostStep.POST_CHUNK_RING, HostStep.WAIT_CHUNK_RING,
    HostStep.LOOP_END,
}  # fmt: skip


def cases(world: int, cuda: bool) -> list[tuple[str, Callable, OverlapOptions, str]]:
    """``(name, build the fusion, options, kernels)``: every kind of step, on this device."""
    transports = [("collective", 2 * world), ("ring", world)]
    if cuda:
        transports.append(("copy_engine", 2 * world))
    found = []
    for pattern in ("ag_matmul", "matmul_rs"):

        def fusion(pattern=pattern):
            return build(pattern, 32 * world, 64, 64, world)

        found.append((f"{pattern} sequential", fusion, OverlapOptions(overlap=False), "auto"))
        for transport, chunks in transports:
            options = OverlapOptions(transport=transport, num_chunks=chunks)
            found.append((f"{pattern} {transport} x{chunks}", fusion, options, "auto"))

    def mlp():
        return build_tp_mlp(32 * world, 64, 64 * world, world)

    found.append(("tp_mlp sequential", mlp, OverlapOptions(overlap=False), "auto"))
    if cuda:  # elsewhere "auto" evaluates already
        found.append(("tp_mlp evaluated", mlp, OverlapOptions(overlap=False), "reference"))
    return found


class Busy:
    """Keeps the GPU busy while the host issues a batch (a sleeping kernel queued first,
    as long as ``SLEEP_MARGIN`` times the last batch's host time); nothing on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cycles_per_ms = 0.0
        self.last_ms = 1.0
        self.waited = 0  # batches whose host outlasted the GPU's sleep (it may have waited)
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_ms = 10_000_000 / begin.elapsed_time(end)

    def batch(self, run: Callable[[], object], calls: int) -> float:
        """The host's time (ms) a call of ``calls`` calls of ``run`` in a row, every rank
        starting together (collective)."""
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        sleep_ms = min(self.last_ms * SLEEP_MARGIN, SLEEP_MAX_MS)
        if self.cuda:
            torch.cuda._sleep(int(self.cycles_per_ms * sleep_ms))
        start = time.perf_counter()
        for _ in range(calls):
            run()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if self.cuda:
            torch.cuda.synchronize()
            if elapsed_ms >= sleep_ms:
                self.waited += 1
        self.last_ms = elapsed_ms
        return elapsed_ms / calls


def trimmed_mean(values: list[float]) -> float:
    """The mean of ``values`` without the highest and lowest tenth (a collection pause,
    a rank descheduled): unlike medians, the means of the steps add up to a run's."""
    ordered = sorted(values)
    cut = len(ordered) // 10
    kept = ordered[cut : len(ordered) - cut]
    return sum(kept) / len(kept)


def timer_costs_us() -> tuple[float, float]:
    """What timing a step costs by itself, us: what a timed step that does nothing
    measures, and what it takes in all (its call and the record included)."""
    durations: list[float] = []

    def nothing() -> None:
        return None

    step = _timed(nothing, durations)
    calls = 20_000
    start = time.perf_counter()
    for _ in range(calls):
        step()
    whole_us = (time.perf_counter() - start) / calls * 1e6
    return statistics.median(durations) * 1e6, whole_us


def _timed(step: Callable[[], object], durations: list[float]) -> Callable[[], None]:
    def timed() -> None:
        start = time.perf_counter()
        step()
        durations.append(time.perf_counter() - start)

    return timed


def measure_case(communicator, case, runs: int, busy: Busy, timer_us: tuple[float, float]) -> dict:
    """One program's steps by kind (each step's trimmed mean, us), a call's host time on
    the lean path and its fixed part, and on CUDA a replay's and a moved input's.

    The fixed part is the executor's own (a call less its rank program's run in it) and
    the rank program's (a run less its steps in it): each a difference of times taken in
    one call, which waited alike for the peers."""
    measured_us, wrapped_us = timer_us
    name, fusion, options, kernels = case
    device, rank = communicator.device, communicator.rank
    cuda = device.type == "cuda"
    if rank == 0:  # where a run that never ends stopped (on 2x H200 it printed nothing)
        print(f"[{name}] measuring", flush=True)
    fd = fusion()
    executor = MultiDeviceExecutor(fd, communicator, options, cuda_graph=False, kernels=kernels)
    generator = torch.Generator(device=device).manual_seed(rank)
    local = [torch.randn(executor.local_shape(t), generator=generator, device=device,
                         dtype=torch.bfloat16) for t in executor.fusion.inputs]  # fmt: skip
    setup = RankSetup(rank, communicator, device, StreamPool(device), None, {},
                      current_hardware(device))  # fmt: skip
    programs = RankPrograms(executor.compiled, setup)
    programs.next_run()
    program = programs.get({})
    kinds = [step.kind for step in issued_steps(executor.compiled.host, rank, streams=cuda)]
    if len(kinds) != len(program.steps):
        raise SystemExit(
            f"{name}: the host model counts {len(kinds)} steps on rank {rank}, the rank "
            f"program has {len(program.steps)}: overlap.plan.host_steps no longer follows "
            "overlap.runtime.rank_program"
        )
    durations: list[list[float]] = [[] for _ in program.steps]
    program.steps = [_timed(step, times) for step, times in zip(program.steps, durations,
                                                                 strict=True)]  # fmt: skip

    totals: list[float] = []

    def run_program() -> None:
        programs.next_run()
        start = time.perf_counter()
        program.run(local, None)
        totals.append(time.perf_counter() - start)

    for _ in range(2):  # warm: kernels compiled, buffers cached
        executor.run(local)
        run_program()
    for times in (*durations, totals):
        times.clear()
    if rank == 0:
        print(f"[{name}] warm", flush=True)
    calls, runs_in_calls = [], []

    def run_executor() -> None:
        start = time.perf_counter()
        executor.run(local)
        calls.append(time.perf_counter() - start)

    def timed_run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            runs_in_calls.append(time.perf_counter() - start)

    run = RankProgram.run
    executor_calls = []
    for _ in range(runs // BATCH):  # interleaved: a drift falls on both alike
        busy.batch(run_program, BATCH)
        with mock.patch.object(RankProgram, "run", timed_run):  # the executor's own
            executor_calls.append(busy.batch(run_executor, BATCH))
    if any(len(times) != runs // BATCH * BATCH for times in durations):
        raise SystemExit(f"{name}: the rank program ran steps other than its list of steps")
    means = [max(0.0, trimmed_mean(times) * 1e6 - measured_us) for times in durations]
    by_kind: dict[str, list[float]] = {}
    for kind, us in zip(kinds, means, strict=True):
        by_kind.setdefault(kind, []).append(us)
    steps = len(kinds)
    own = [total - sum(times[run] for times in durations) for run, total in enumerate(totals)]
    own_us = trimmed_mean(own) * 1e6 - steps * (wrapped_us - measured_us)
    around = [call - inner for call, inner in zip(calls, runs_in_calls, strict=True)]
    call_us = trimmed_mean(executor_calls) * 1e3
    row = {"case": name, "steps": steps, "steps_us": sum(means), "call_us": call_us,
           "executor_us": trimmed_mean(around) * 1e6, "program_us": own_us,
           "fixed_us": trimmed_mean(around) * 1e6 + own_us, "by_kind": by_kind}  # fmt: skip
    if cuda and kernels == "auto":  # the evaluator's programs are not captured
        row.update(_replay(fd, communicator, options, kernels, local, runs, busy))
    row["gpu_waits"], busy.waited = busy.waited, 0  # batches that outlasted the sleep
    if rank == 0:
        print(
            f"[{name}] {call_us:.1f} us a call, {row['gpu_waits']} batches outlasted "
            "the GPU's sleep",
            flush=True,
        )
    return row


def _replay(fd, communicator, options, kernels, local, runs: int, busy: Busy) -> dict:
    """A call's host time replayed from a CUDA graph that reads every input in place
    (at the same address at the key's first two calls), and the extra per input of one
    that copies every input in (captured from inputs that moved between those calls)."""
    moved = [value.clone() for value in local]
    in_place = MultiDeviceExecutor(fd, communicator, options, cuda_graph=True, kernels=kernels)
    copied = MultiDeviceExecutor(fd, communicator, options, cuda_graph=True, kernels=kernels)
    for inputs in (local, local, local):  # lean, captured, replayed
        in_place.run(inputs)
    for inputs in (local, moved, local):
        copied.run(inputs)
    read_in_place, copied_in = [], []
    for _ in range(runs // BATCH):
        read_in_place.append(busy.batch(lambda: in_place.run(local), BATCH))
        copied_in.append(busy.batch(lambda: copied.run(local), BATCH))
    replay_us, copy_us = trimmed_mean(read_in_place) * 1e3, trimmed_mean(copied_in) * 1e3
    return {"replay_us": replay_us, "input_copy_us": max(0.0, copy_us - replay_us) / len(local)}


def summarize(rows_by_rank: list[list[dict]]) -> dict:
    """Each kind's cost (the mean of its steps' costs, the slowest rank's), a call's
    fixed cost, a replay's and an input copy's (the median over the cases, the slowest
    rank's)."""
    kinds: dict[str, dict] = {}
    for kind in HostStep:
        per_rank = []
        steps, names = 0, []
        for rows in rows_by_rank:
            values = [us for row in rows for us in row["by_kind"].get(kind, [])]
            if values:
                per_rank.append(sum(values) / len(values))
                steps = len(values)
                names = [row["case"] for row in rows if kind in row["by_kind"]]
        if per_rank:
            kinds[kind] = {"us": max(per_rank), "steps": steps, "cases": names}
    calls = {}
    for field in ("fixed_us", "replay_us", "input_copy_us"):
        per_rank = [statistics.median([row[field] for row in rows if field in row])
                    for rows in rows_by_rank if any(field in row for row in rows)]  # fmt: skip
        if per_rank:
            calls[field] = max(per_rank)
    return {"kinds": kinds, "calls": calls}


def record_text(summary: dict, fallback: HostFigures, cuda: bool, probe_us: float,
                where: str) -> str:  # fmt: skip
    """The ``HostFigures`` to record, as Python."""
    lines = ["HostFigures(", "    step_us={"]
    for kind in HostStep:
        measured = summary["kinds"].get(kind)
        value = measured["us"] if measured else fallback.step_us[kind]
        note = "" if measured else "  # not run here: the fallback"
        if measured and not cuda and kind in WAITING_ON_CPUS:
            value, note = fallback.step_us[kind], "  # on CPUs, the transfer's: the fallback"
        lines.append(f"        HostStep.{kind.name}: {value:.2f},{note}")
    calls = summary["calls"]
    replay = calls.get("replay_us", fallback.graph_replay_us)
    copy = calls.get("input_copy_us", fallback.graph_input_copy_us)
    replay_note = "" if "replay_us" in calls else "  # no CUDA graphs here: the fallback"
    lines += [
        "    },",
        f"    run_us={calls['fixed_us']:.2f},",
        f"    graph_replay_us={replay:.2f},{replay_note}",
        f"    graph_input_copy_us={copy:.2f},{replay_note}",
        f"    streams={cuda},",
        f'    source="{where}",',
        f"    probe_us={probe_us:.2f},",
        ")",
    ]
    return "\n".join(lines)


def print_table(summary: dict, rows_by_rank: list[list[dict]], probe_us: float) -> None:
    print(f"{'kind':<26} {'us':>8} {'steps':>6}  cases")
    for kind, measured in summary["kinds"].items():
        print(f"{kind:<26} {measured['us']:8.2f} {measured['steps']:6d}  "
              f"{', '.join(measured['cases'])}")  # fmt: skip
    for field, value in summary["calls"].items():
        print(f"{field:<26} {value:8.2f}")
    print(f"{'host probe':<26} {probe_us:8.2f}")
    print(f"\n{'case (rank 0)':<28} {'steps':>6} {'steps_us':>9} {'call_us':>9} {'fixed_us':>9}"
          f" {'executor':>9} {'program':>9} {'replay_us':>9}")  # fmt: skip
    for row in rows_by_rank[0]:
        print(f"{row['case']:<28} {row['steps']:6d} {row['steps_us']:9.1f} {row['call_us']:9.1f}"
              f" {row['fixed_us']:9.1f} {row['executor_us']:9.1f} {row['program_us']:9.1f}"
              f" {row.get('replay_us', float('nan')):9.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU processes, gloo")
    parser.add_argument("--runs", type=int, default=50, help="timed runs of each program")
    parser.add_argument("--out", help="the JSON written (default benchmarks/results/...)")
    parser.add_argument("--only", help="measure only the cases whose name contains this")
    parser.add_argument("--skip", help="leave out the cases whose name contains this")
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=300.0,
        help="seconds a case may take: past it every rank prints its threads' stacks and "
        "exits (a hang and where it waits, told from a crawl, which prints its batches)",
    )
    args = parser.parse_args()
    if args.cpu:
        dist.init_process_group("gloo")
        communicator = Communicator("cpu")
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        communicator = Communicator()
    device, world = communicator.device, communicator.world_size
    cuda = device.type == "cuda"
    busy = Busy(device)
    timer_us = timer_costs_us()
    rows = []
    for case in cases(world, cuda):
        if (args.only and args.only not in case[0]) or (args.skip and args.skip in case[0]):
            continue
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        rows.append(measure_case(communicator, case, args.runs, busy, timer_us))
        faulthandler.cancel_dump_traceback_later()
    probe_us = max(communicator.all_gather_object(host_probe_us(device)))
    rows_by_rank = communicator.all_gather_object(rows)
    if communicator.rank == 0:
        summary = summarize(rows_by_rank)
        name = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
        commit, date = commit_id(), datetime.date.today().isoformat()
        where = f"measured on {world}x {name} by benchmarks/host_figures.py at {commit}, {date}"
        print_table(summary, rows_by_rank, probe_us)
        launch_us = (H200_FIGURES if cuda else CPU_FIGURES).launch_us
        fallback = HostFigures.fallback(launch_us, streams=cuda)
        print("\nto record in overlap/plan/figures.py:")
        print(record_text(summary, fallback, cuda, probe_us, where))
        out = Path(args.out or ROOT / "benchmarks" / "results" /
                   ("host_figures.json" if cuda else "host_figures_cpu.json"))  # fmt: skip
        result = {
            "device": f"{world}x {name}",
            "date": date,
            "commit": commit,
            "command": " ".join(["torchrun --nproc-per-node", str(world), *sys.argv]),
            "torch": torch.__version__,
            "rows": [{"kind": kind, **measured} for kind, measured in summary["kinds"].items()]
            + [{"kind": field, "us": value} for field, value in summary["calls"].items()]
            + [{"kind": "host probe", "us": probe_us}],
            "cases": [{key: value for key, value in row.items() if key != "by_kind"}
                      for row in rows_by_rank[0]],
        }  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    dist.barrier()
    if cuda:
        # Tearing down symmetric memory and captured graphs at exit has hung torch 2.11
        # (benchmarks/ag_matmul.py); the results are written, so leave without it.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
