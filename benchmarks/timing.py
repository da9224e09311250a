"""How the benchmarks time: interleaved rounds, each the mean of calls back to back, the
median of the rounds; across ranks, the slowest rank's.

    times = time_rounds({"ours": run_ours, "eager": run_eager}, device, rounds=7,
                        iterations=10)          # ms per call, each the median of 7 rounds
    times = slowest(times, device)              # collective: every rank calls it

A round times each callable once (A B C A B C ...: a drift of clocks or temperature
falls on all alike), as ``iterations`` calls in a row: on a GPU between two CUDA events
on the current stream, on a CPU (and with ``on_host``) by ``time.perf_counter``, the
device synchronized before and after. ``host_ms`` is the other clock the benchmarks
read: how long the host takes to issue calls, the device left to catch up.

Not ``triton.testing.do_bench``: it times one callable's repetitions in a row, clears
the L2 cache before each, and picks their count from a first estimate. Each benchmark
here compares its variants interleaved, times calls back to back (as a program issues
them; ``settle`` below is the one untimed call kernels.py needs), and on many ranks
every rank must make the same calls: a count estimated on each rank alone would leave
some rank waiting in a collective its peers never post.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count: one that was measured)."""
    return sorted(values)[len(values) // 2]


class Timer:
    """Times named callables a round at a time; ``medians()`` gives each one's median
    over its rounds, in ms per call.

    ``settle`` (GPU only): one untimed call before each timed batch, so no callable pays
    for the state the previous one left (dirty L2 lines of a large write: measured on
    H200, the first of a round of 40 us kernels read 0.75 of copy where the same kernel
    later in the round read 0.82). ``on_host``: time by the host's clock, the device
    synchronized before and after (work the CUDA events of one stream do not see, a UCX
    transfer); ``before``: called untimed before each timed batch (a barrier of the ranks).
    """

    def __init__(
        self,
        device: torch.device,
        iterations: int = 1,
        settle: bool = False,
        on_host: bool = False,
        before: Callable[[], object] | None = None,
    ) -> None:
        self.device = device
        self.iterations = iterations
        self.settle = settle and device.type == "cuda"
        self.events = device.type == "cuda" and not on_host
        self.before = before
        self.times: dict[str, list[float]] = {}

    def time(self, name: str, function: Callable[[], object]) -> None:
        """One round of ``function``: ``iterations`` calls in a row, their mean kept."""
        if self.settle:
            function()
        if self.before is not None:
            self.before()
        if self.events:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(self.iterations):
                function()
            end.record()
            end.synchronize()
            elapsed_ms = begin.elapsed_time(end)
        else:
            _synchronize(self.device)
            start = time.perf_counter()
            for _ in range(self.iterations):
                function()
            _synchronize(self.device)
            elapsed_ms = (time.perf_counter() - start) * 1e3
        self.times.setdefault(name, []).append(elapsed_ms / self.iterations)

    def rounds(self, functions: dict[str, Callable[[], object]], count: int) -> None:
        """``count`` rounds, each timing every one of ``functions`` in turn."""
        for _ in range(count):
            for name, function in functions.items():
                self.time(name, function)

    def medians(self) -> dict[str, float]:
        """Each callable's median over its rounds, ms per call."""
        return {name: median(times) for name, times in self.times.items()}


def time_rounds(
    functions: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    iterations: int,
    settle: bool = False,
    before: Callable[[], object] | None = None,
    each_round: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Each of ``functions``' median ms per call over ``rounds`` interleaved rounds of
    ``iterations`` calls. With ``settle``, on a GPU each runs once before the rounds
    too, and once untimed before each of its batches (``Timer``); ``before``: called
    untimed before each batch (``Timer``); ``each_round``, a dict: filled with every
    round's time of each function, ms per call."""
    timer = Timer(device, iterations, settle, before=before)
    for function in functions.values() if timer.settle else ():
        function()
    timer.rounds(functions, rounds)
    if each_round is not None:
        each_round.update(timer.times)
    return timer.medians()


# ``torch.cuda._sleep`` counts clock cycles: about 2 GHz on H100 and H200 (a wait that is
# a little off is still a busy device)
SLEEP_CYCLES_PER_MS = 2e6


def host_ms(
    function: Callable[[], object], calls: int, device: torch.device, busy_ms: float = 0.0
) -> float:
    """The host's time to issue one call (ms, the mean of ``calls`` in a row): the
    device synchronized before, and after the clock stops (it may still be busy).
    ``busy_ms`` (GPU): the device is first given that long a wait, so that the calls are
    issued while it is busy (the host never waits for it: its issue time alone)."""
    _synchronize(device)
    # garbage collected now, not during the calls: freeing an unreachable executor's
    # CUDA memory there waits for the busy device (a 200 ms wait over 20 calls read as
    # 10 ms a call, blocks.py on 2x H200)
    gc.collect()
    if busy_ms and device.type == "cuda":
        torch.cuda._sleep(int(busy_ms * SLEEP_CYCLES_PER_MS))
    start = time.perf_counter()
    for _ in range(calls):
        function()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    _synchronize(device)
    return elapsed_ms / calls


def slowest(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value's largest over the ranks (a MAX all-reduce in float64: call on every
    rank, with the same names)."""
    names = sorted(values)
    tensor = torch.tensor([values[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(names, tensor.tolist(), strict=True))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(
    calls: dict, names, label: str, folder: str, communicator, steps: int = 3
) -> None:
    """``steps`` steps of each of ``names`` under ``torch.profiler`` on every rank (their
    collectives need all), rank 0's kernels and host calls written to ``folder`` as a
    table (by GPU time, and by host time) and a Chrome trace: where one step spends what
    another does not (the replayed default against the lean path)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = communicator.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name in names:
        if name not in calls:
            continue
        calls[name]()  # the profiler's own start-up outside the steps
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                calls[name]()
            if cuda:
                torch.cuda.synchronize()
        if communicator.rank == 0:
            stem = Path(folder) / f"{label}_{name}"
            averages = prof.key_averages()
            tables = [f"{steps} steps of {name} ({label}), rank 0",
                      averages.table(sort_by="self_device_time_total" if cuda else
                                     "self_cpu_time_total", row_limit=30),
                      averages.table(sort_by="self_cpu_time_total", row_limit=30)]  # fmt: skip
            stem.with_suffix(".txt").write_text("\n\n".join(tables))
            prof.export_chrome_trace(str(stem.with_suffix(".json")))
