"""Host time a call of our lean run path, against the same ops written as plain torch calls.

    torchrun --nproc-per-node 2 benchmarks/profile_host.py                 # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/profile_host.py --device cpu    # CPU processes, gloo
    ... --cprofile 25      # and where ours spends it: cProfile's top 25 functions, rank 0

The lean path is ``MultiDeviceExecutor(..., cuda_graph=False)``: the host issues every
step of the rank program at every call, as it does wherever no CUDA graph is replayed
(CPU, a timeline, the first call at new extents, an explicit opt-out). Cases: the
sequence-parallel MLP of the demo (``launch.demo.build_tp_mlp``: 512 tokens a rank, 1024,
4096; gelu between the matmuls) and the two blocks of ``benchmarks/blocks.py`` (SwiGLU
MLP and attention projections, 2048x4096x14336), each as

- ``ours``: ``executor.run(local)`` with default options (the planner's choice);
- ``ours_no_check``: the same with ``check_inputs="never"`` (no input bookkeeping);
- ``ours_sequential``: ``OverlapOptions(overlap=False)``: op for op what ``torch`` does;
- ``ours_pipelined``: ``OverlapOptions(num_chunks=world, transport="collective")``: the
  chunk loops (the planner keeps CPU runs sequential);
- ``torch``: the same ops as plain torch calls (matmuls, the elementwise ops, and
  torch.distributed's all-gather and reduce-scatter into tensors).

Every variant's output on every rank is checked against the reference first (the
fusion's reference evaluator on the whole inputs for the demo's MLP, the float32 block
of ``blocks.py`` for the blocks); a wrong one stops the run before anything is timed.

Host time a call: ``CALLS`` calls in a row, the median (and the smallest) of
``--samples`` such runs, the slowest rank's. On a GPU the device is first kept busy (a
spin kernel that outlasts the calls), so a call returns as soon as the host has issued
its work, whatever the kernels' sizes; a call that waits for the device shows up as the
spin's length. On CPUs the calls do their work as they go (small shapes keep it small)
and the time is the calling thread's CPU time. Figures go to
``benchmarks/results/profile_host.json`` (``_cpu`` on CPUs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import blocks  # noqa: E402
from benchmarks.timing import slowest  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from launch.demo import build_tp_mlp  # noqa: E402
from launch.demo import whole_inputs as demo_inputs  # noqa: E402
from overlap import Communicator, MultiDeviceExecutor, OverlapOptions  # noqa: E402

# (tokens a rank, hidden, ffn) of the demo's MLP; (tokens, hidden, ffn) of the blocks
GPU_SHAPES = {"sp_mlp": (512, 1024, 4096), "blocks": (2048, 4096, 14336)}
CPU_SHAPES = {"sp_mlp": (64, 64, 128), "blocks": blocks.SMOKE_SHAPES[0]}
CALLS = 20  # calls in a row, a sample
BUSY_MS_PER_CALL = 10.0  # the spin that keeps the GPU busy: this long for each call


# torch 2.13 renames the tensor collectives; 2.11 (the GPU machines) has the old names only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def torch_sp_mlp(world: int) -> Callable:
    """The demo's MLP on a rank's pieces, in plain torch calls."""

    def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
        gathered = x.new_empty((x.shape[0] * world, x.shape[1]))
        _all_gather(gathered, x)
        partial = torch.nn.functional.gelu(gathered @ w1, approximate="tanh") @ w2
        out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        _reduce_scatter(out, partial)
        return [out]

    return mlp


class Case:
    """One row: a fusion on this rank's pieces, its torch version and how to check both."""

    def __init__(self, name: str, shape: tuple, fd, full: list, torch_version: Callable,
                 check: Callable) -> None:  # fmt: skip
        self.name, self.shape, self.fd = name, shape, fd
        self.full, self.torch_version, self.check = full, torch_version, check


def sp_mlp_case(shape: tuple, world: int, device: torch.device) -> Case:
    tokens, hidden, ffn = shape[0] * world, shape[1], shape[2]
    fd = build_tp_mlp(tokens, hidden, ffn, world)
    full = demo_inputs(tokens, hidden, ffn)
    (expected,) = fd.execute(full)

    def check(executor, outputs, what: str) -> None:
        (piece,) = executor.shard_outputs([expected])
        assert_close(outputs[0].cpu(), piece, reduction_extent=ffn, partial_sums=world,
                     message=what)  # fmt: skip

    full = [t.to(device) for t in full]
    return Case("sp_mlp", (tokens, hidden, ffn), fd, full, torch_sp_mlp(world), check)


def block_case(block: str, shape: tuple, world: int, device: torch.device, small: bool) -> Case:
    tokens, hidden, ffn = shape
    if block == "mlp":
        fd = blocks.build_mlp(tokens, hidden, ffn, world)
    else:
        kv = blocks.KV_HEADS * (blocks.SMOKE_HEAD_DIM if small else blocks.HEAD_DIM)
        fd = blocks.build_attention(tokens, hidden, kv, world)
    full = blocks.whole_inputs(fd, device)
    exact = blocks.exact_outputs(block, full)

    def check(executor, outputs, what: str) -> None:
        blocks.checked_error(outputs, executor.shard_outputs(exact), what)

    return Case(f"{block}_block", shape, fd, full, blocks.eager_block(block, world), check)


def keep_busy(device: torch.device, milliseconds: float, cycles_per_ms: list[float]) -> None:
    """A spin kernel on the current stream that keeps ``device`` busy about that long
    (its clock measured at the first call)."""
    if not cycles_per_ms:
        probe = 10_000_000
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        cycles_per_ms.append(probe / begin.elapsed_time(end))
    torch.cuda._sleep(int(milliseconds * cycles_per_ms[0]))


def host_us(call: Callable, device: torch.device, samples: int,
            spin: list[float]) -> tuple[float, float]:  # fmt: skip
    """The host's time to issue one call, us, the median and the smallest over
    ``samples`` of ``CALLS`` calls in a row: on a GPU the wall clock's, the device kept
    busy through them; on CPUs the calling thread's CPU time (gloo's own threads move
    the data: the host's wait for them is not its work, and the other processes of a
    shared machine take its cores at random)."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    times = []
    for _ in range(samples):
        if cuda:
            torch.cuda.synchronize(device)
            keep_busy(device, CALLS * BUSY_MS_PER_CALL, spin)
        start = clock()
        for _ in range(CALLS):
            call()
        times.append((clock() - start) / CALLS * 1e6)
        if cuda:
            torch.cuda.synchronize(device)
    return statistics.median(times), min(times)


def profiled(call: Callable, device: torch.device, top: int) -> str:
    """cProfile's table of ``CALLS`` calls of ``call``: its ``top`` functions by own time
    (on CPUs the thread's CPU time, as ``host_us`` counts it)."""
    profiler = cProfile.Profile(*([] if device.type == "cuda" else [time.thread_time]))
    profiler.enable()
    for _ in range(CALLS):
        call()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def run_case(case: Case, communicator, args) -> dict:
    device, world = communicator.device, communicator.world_size
    default = MultiDeviceExecutor(case.fd, communicator, cuda_graph=False)
    sequential = MultiDeviceExecutor(case.fd, communicator, OverlapOptions(overlap=False),
                                     cuda_graph=False)  # fmt: skip
    pipelined = MultiDeviceExecutor(
        case.fd, communicator, OverlapOptions(num_chunks=world, transport="collective"),
        cuda_graph=False,
    )  # fmt: skip
    local = default.shard_inputs(case.full)
    calls = {
        "ours": lambda: default.run(local),
        "ours_no_check": lambda: default.run(local, check_inputs="never"),
        "ours_sequential": lambda: sequential.run(local),
        "ours_pipelined": lambda: pipelined.run(local),
        "torch": lambda: case.torch_version(*local),
    }
    for name, call in calls.items():
        for _ in range(3):  # the first run builds the rank program; then steady state
            outputs = call()
        case.check(default, outputs, f"{case.name} {name} rank {communicator.rank}")
    spin: list[float] = []
    times = {}
    for name, call in calls.items():
        times[name], times[f"{name}_min"] = host_us(call, device, args.samples, spin)
    times = slowest(times, device)
    if args.cprofile:
        table = profiled(calls["ours"], device, args.cprofile)
        if communicator.rank == 0:
            print(f"== {case.name}: ours, {CALLS} calls, rank 0\n{table[-6000:]}", flush=True)
    return {
        "case": case.name, "shape": list(case.shape), "world": world,
        **{f"{name}_us": round(value, 1) for name, value in times.items()},
        "ours_over_torch": round(times["ours"] / times["torch"], 2),
        "plan": [str(decision) for decision in default.overlap],
        "checked_every_rank": True,
    }  # fmt: skip


def print_table(rows: list[dict]) -> None:
    columns = ["ours", "ours_no_check", "ours_sequential", "ours_pipelined", "torch"]
    print(f"\nhost us a call (the slowest rank's)\n{'case':<18} {'shape':<18} "
          + " ".join(f"{c:>15}" for c in columns) + f" {'ours/torch':>10}")  # fmt: skip
    for row in rows:
        shape = "x".join(str(e) for e in row["shape"])
        print(f"{row['case']:<18} {shape:<18} "
              + " ".join(f"{row[f'{c}_us']:15.1f}" for c in columns)
              + f" {row['ours_over_torch']:10.2f}")  # fmt: skip


def communicator_for(device: str) -> Communicator:
    if device == "cpu":
        dist.init_process_group("gloo")
        return Communicator("cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return Communicator()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    parser.add_argument("--cases", default="sp_mlp,mlp_block,attention_block")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="TOP",
        help="print cProfile's TOP functions of ours' calls (rank 0)",
    )
    parser.add_argument("--out", help="default: benchmarks/results/profile_host[_cpu].json")
    args = parser.parse_args()
    communicator = communicator_for(args.device)
    device, world = communicator.device, communicator.world_size
    small = device.type == "cpu"
    shapes = CPU_SHAPES if small else GPU_SHAPES
    rows = []
    for name in args.cases.split(","):
        if name == "sp_mlp":
            case = sp_mlp_case(shapes["sp_mlp"], world, device)
        else:
            case = block_case(name.removesuffix("_block"), shapes["blocks"], world, device, small)
        rows.append(run_case(case, communicator, args))
    if communicator.rank == 0:
        print_table(rows)
        suffix = "_cpu" if small else ""
        out = args.out or str(ROOT / "benchmarks" / "results" / f"profile_host{suffix}.json")
        blocks.write_results(out, rows, communicator)
    dist.barrier()
    if not small:
        # Tearing down symmetric memory at exit has hung torch 2.11 (benchmarks/ag_matmul.py):
        # the results are written, so leave without it.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
