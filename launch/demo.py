"""The README's main job: a tensor-parallel MLP block, sequential against overlapped.

``y = gelu(x @ w1) @ w2`` with the tokens of ``x`` and ``y`` split over the ranks
(sequence parallel), ``w1`` split by columns and ``w2`` by rows: the framework inserts
an all-gather before the first matmul and a reduce-scatter after the second. The
demo runs it on every local GPU (NCCL), or on two CPU processes (gloo) when there is
none, and prints the fusion, the inserted communications, each rank's host program
(sequential, and overlapped: the all-gather of chunk i+1 beside the matmul of chunk i),
what the overlap planner would choose and why, and the timings; both runs are checked
against the single-device reference on the whole inputs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fusion import FusionDefinition
from fusion.testing import assert_close
from sharding import DeviceMesh, Shard, shard

CPU_SIZES = (512, 256, 1024)  # tokens, hidden, ffn: seconds on two gloo processes
GPU_SIZES = (16384, 4096, 16384)


def build_tp_mlp(tokens: int, hidden: int, ffn: int, world: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("tp_mlp") as fd:
        x = fd.define_tensor([tokens, hidden], "bf16")
        w1 = fd.define_tensor([hidden, ffn], "bf16")
        w2 = fd.define_tensor([ffn, hidden], "bf16")
        y = fd.ops.matmul(fd.ops.gelu(fd.ops.matmul(x, w1), approximate="tanh"), w2)
        fd.add_output(y)
        shard(x, mesh, [Shard(0)])  # tokens split: all-gathered before the first matmul
        shard(w1, mesh, [Shard(1)])  # columns split: each rank its part of the ffn
        shard(w2, mesh, [Shard(0)])  # rows split: partial sums ...
        shard(y, mesh, [Shard(0)])  # ... reduce-scattered back to token pieces
    return fd


def whole_inputs(tokens: int, hidden: int, ffn: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(tokens, hidden, generator=generator).bfloat16(),
        (torch.randn(hidden, ffn, generator=generator) / hidden**0.5).bfloat16(),
        (torch.randn(ffn, hidden, generator=generator) / ffn**0.5).bfloat16(),
    ]


def _ms(function, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def demo_rank(communicator, sizes: tuple[int, int, int], repeats: int) -> dict:
    """One rank's part: both executors, the checks, the timings."""
    from overlap.executor import MultiDeviceExecutor
    from overlap.planner import OverlapOptions

    tokens, hidden, ffn = sizes
    world, device = communicator.world_size, communicator.device
    fd = build_tp_mlp(tokens, hidden, ffn, world)
    whole = whole_inputs(tokens, hidden, ffn)
    chunks = OverlapOptions(overlap=True, num_chunks=world, transport="collective")
    runs = {
        "sequential": MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=False)),
        "overlapped": MultiDeviceExecutor(fd, communicator, chunks),
        "planner's choice": MultiDeviceExecutor(fd, communicator),
    }
    local = runs["sequential"].shard_inputs([t.to(device) for t in whole])
    expected = runs["sequential"].shard_outputs(fd.execute([t.to(device) for t in whole]))
    result = {"device": str(device), "world": world, "checks": {}, "ms": {}}
    for name, executor in runs.items():
        (piece,) = executor.run(local)  # the first run compiles and allocates
        try:
            # the second matmul's partial sums are rounded to bf16 before the reduce-scatter
            assert_close(piece, expected[0], reduction_extent=ffn, partial_sums=world)
            result["checks"][name] = True
        except AssertionError:
            result["checks"][name] = False
    # interleaved rounds, the ranks lined up before each run: the same program times
    # alike whichever name it runs under (one after the other, the later ones paid for
    # the ranks drifting apart)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, executor in runs.items():
            dist.barrier()
            times[name].append(_ms(lambda e=executor: e.run(local), device))
    result["ms"] = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    if communicator.rank == 0:
        result["fusion"] = str(fd)
        result["communications"] = [str(c) for c in runs["sequential"].communications]
        result["programs"] = {n: str(e.program) for n, e in runs.items() if n != "planner's choice"}
        result["planner"] = runs["planner's choice"].explain_overlap()
    return result


def run_demo(tokens=None, hidden=None, ffn=None, nproc=None, repeats: int = 9) -> bool:
    """Run the demo on the local devices; print it; True when every check passed."""
    from launch.local import default_nproc, run_function

    gpu = torch.cuda.is_available()
    default = GPU_SIZES if gpu else CPU_SIZES
    sizes = (tokens or default[0], hidden or default[1], ffn or default[2])
    nproc = nproc or default_nproc()
    if sizes[0] % nproc or sizes[2] % nproc:
        print(f"demo: tokens and ffn must divide by the {nproc} ranks, got {sizes}")
        return False
    where = f"{nproc} GPUs (NCCL)" if gpu else f"{nproc} CPU processes (gloo)"
    print(f"overlap demo: tensor-parallel MLP, tokens={sizes[0]} hidden={sizes[1]} "
          f"ffn={sizes[2]} on {where}", flush=True)  # fmt: skip
    print("starting the ranks, building and compiling both programs ...", flush=True)
    results = run_function(demo_rank, (sizes, repeats), nproc=nproc, timeout_s=600.0)
    first = results[0]
    print("\n== the fusion (one device's view; shardings as given) ==")
    print(first["fusion"])
    print("\n== communications the framework inserted ==")
    for line in first["communications"]:
        print(f"  {line}")
    for name, program in first["programs"].items():
        print(f"\n== rank 0's host program, {name} ==")
        print(program)
    print("\n== what the overlap planner would choose here, and why ==")
    print(first["planner"])
    print("\n== timings (median of each rank's runs; the slowest rank) ==")
    passed = True
    for name in first["ms"]:
        slowest = max(r["ms"][name] for r in results)
        checks = all(r["checks"][name] for r in results)
        passed = passed and checks
        print(f"  {name:<17} {slowest:9.3f} ms   matches the reference: {checks}")
    slowest = {name: max(r["ms"][name] for r in results) for name in first["ms"]}
    chosen = "planner's choice"
    print(
        f"  sequential / overlapped = {slowest['sequential'] / slowest['overlapped']:.2f}; "
        f"sequential / {chosen} = {slowest['sequential'] / slowest[chosen]:.2f}"
        + ("" if gpu else " (CPU processes share the cores: overlap has little to gain)")
    )
    print("demo: " + ("PASS" if passed else "FAIL"))
    return passed
