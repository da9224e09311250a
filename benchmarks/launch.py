"""The same sequence-parallel block under torchrun and on a Ray pool: outputs and times.

    python benchmarks/launch.py            # every local GPU; figures to results/launch.json
    python benchmarks/launch.py --smoke    # two CPU processes (gloo), tiny shapes

The block: LayerNorm over the token pieces each rank holds (a generated normalization
kernel on GPUs), all-gather + matmul (overlapped as the planner decides), GELU,
matmul + reduce-scatter back to token pieces. The torchrun run is a subprocess
(``torch.distributed.run``, this file's ``--rank-job`` mode); the Ray run is a
``RayPool`` of one actor per GPU in this process. Both build the same fusion from the
same seeded inputs; the table compares their outputs (bitwise) and their times
(median of interleaved rounds inside each rank, the slowest rank).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fusion import FusionDefinition  # noqa: E402
from sharding import DeviceMesh, Shard, shard  # noqa: E402

GPU_SIZES = (16384, 4096, 16384)  # tokens, hidden, ffn
SMOKE_SIZES = (64, 32, 128)
ROW, COLUMN = [False, True], [True, False]


def build_block(tokens: int, hidden: int, ffn: int, world: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("sequence_parallel_block") as fd:
        x = fd.define_tensor([tokens, hidden], "bf16")
        gamma = fd.define_tensor([hidden], "bf16")
        beta = fd.define_tensor([hidden], "bf16")
        w1 = fd.define_tensor([hidden, ffn], "bf16")
        w2 = fd.define_tensor([ffn, hidden], "bf16")
        xf = fd.ops.cast(x, "float32")
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0)
        xhat = (xf - fd.ops.broadcast(mean, ROW)) * fd.ops.broadcast(fd.ops.rsqrt(var + 1e-5), ROW)
        g = fd.ops.broadcast(fd.ops.cast(gamma, "float32"), COLUMN)
        b = fd.ops.broadcast(fd.ops.cast(beta, "float32"), COLUMN)
        normed = fd.ops.cast(xhat * g + b, "bf16")
        h = fd.ops.gelu(fd.ops.matmul(normed, w1), approximate="tanh")
        fd.add_output(fd.ops.matmul(h, w2))
        for tensor, placement in ((x, Shard(0)), (gamma, None), (beta, None), (w1, Shard(1)),
                                  (w2, Shard(0)), (fd.fusion.outputs[0], Shard(0))):  # fmt: skip
            if placement is not None:
                shard(tensor, mesh, [placement])
    return fd


def whole_inputs(tokens: int, hidden: int, ffn: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(tokens, hidden, generator=generator).bfloat16(),
        (1 + 0.1 * torch.randn(hidden, generator=generator)).bfloat16(),
        (0.1 * torch.randn(hidden, generator=generator)).bfloat16(),
        (torch.randn(hidden, ffn, generator=generator) / hidden**0.5).bfloat16(),
        (torch.randn(ffn, hidden, generator=generator) / ffn**0.5).bfloat16(),
    ]


def rank_job(communicator, sizes: tuple[int, int, int], rounds: int, iterations: int) -> dict:
    """One rank: build, run, check against the reference, time. Returns its output
    piece (on the CPU), its times and what ran."""
    from benchmarks.timing import time_rounds
    from fusion.testing import assert_close
    from overlap import MultiDeviceExecutor

    device = communicator.device
    fd = build_block(*sizes, communicator.world_size)
    whole = [t.to(device) for t in whole_inputs(*sizes)]
    executor = MultiDeviceExecutor(fd, communicator, cuda_graph=device.type == "cuda")
    local = executor.shard_inputs(whole)
    (piece,) = executor.run(local)
    piece = piece.clone()
    (expected,) = executor.shard_outputs(fd.execute(whole))
    assert_close(piece, expected, reduction_extent=sizes[2], partial_sums=communicator.world_size)
    run = {"run": lambda: executor.run(local, check_inputs=False)}
    return {
        "rank": communicator.rank, "piece": piece.cpu(),
        "ms": time_rounds(run, device, rounds, iterations)["run"],
        "device": str(device), "kernels": executor.kernel_report(),
        "overlap": [line for line in executor.explain_overlap().splitlines()
                    if not line.startswith(" ")],  # each decision, without its candidates
    }  # fmt: skip


def _torchrun_job(out: str, sizes, rounds: int, iterations: int) -> None:
    """``--rank-job``: one torchrun rank; rank 0 writes every rank's result to ``out``."""
    from launch.env import init

    communicator = init()
    result = rank_job(communicator, sizes, rounds, iterations)
    everyone = communicator.all_gather_object(result)
    if communicator.rank == 0:
        torch.save(everyone, out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.kernels import benchmark_parser

    parser = benchmark_parser(__doc__, "launch")
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)  # torchrun's ranks
    args = parser.parse_args()
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    if args.rank_job:
        _torchrun_job(args.rank_job, sizes, args.rounds, args.iterations)
        return
    from launch.env import free_port
    from launch.local import default_nproc
    from launch.ray_pool import RayPool

    world = 2 if args.smoke else default_nproc()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "torchrun.pt")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                   "--master-port", str(free_port()), __file__, "--rank-job", out,
                   "--rounds", str(args.rounds), "--iterations", str(args.iterations)]  # fmt: skip
        command += ["--smoke"] if args.smoke else []
        start = time.perf_counter()
        subprocess.run(command, check=True, timeout=900)
        torchrun_s = time.perf_counter() - start
        by_torchrun = torch.load(out)
    start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with RayPool(world, init_options={"include_dashboard": False}) as pool:
        pool_s = time.perf_counter() - start
        by_ray = pool.call(rank_job, sizes, args.rounds, args.iterations, timeout_s=900)
        ray_s = time.perf_counter() - start
    equal = all(
        torch.equal(a["piece"], b["piece"]) for a, b in zip(by_torchrun, by_ray, strict=True)
    )
    diff = max((a["piece"].float() - b["piece"].float()).abs().max().item()
               for a, b in zip(by_torchrun, by_ray, strict=True))  # fmt: skip
    slowest = {"torchrun": max(r["ms"] for r in by_torchrun), "ray": max(r["ms"] for r in by_ray)}
    print(f"sequence-parallel block tokens={sizes[0]} hidden={sizes[1]} ffn={sizes[2]}, "
          f"{world} ranks on {by_ray[0]['device']} and its peers")  # fmt: skip
    print(f"  kernels (rank 0, Ray): {by_ray[0]['kernels']}")
    print(f"  overlap (rank 0, Ray): {by_ray[0]['overlap']}")
    print(f"{'launcher':<10} {'ms (slowest rank)':>18} {'per rank':>24}")
    for name, results in (("torchrun", by_torchrun), ("ray", by_ray)):
        per_rank = ", ".join(f"{r['ms']:.3f}" for r in results)
        print(f"{name:<10} {slowest[name]:18.3f} {per_rank:>24}")
    print(f"ray / torchrun = {slowest['ray'] / slowest['torchrun']:.3f}; outputs bitwise "
          f"equal: {equal} (max |diff| {diff:.3g}); torchrun run {torchrun_s:.1f} s, Ray pool "
          f"up in {pool_s:.1f} s, its run {ray_s - pool_s:.1f} s")  # fmt: skip
    if not args.smoke:
        from benchmarks.kernels import write_results

        rows = [{"launcher": name, "world": world, "tokens": sizes[0], "hidden": sizes[1],
                 "ffn": sizes[2], "ms": slowest[name],
                 "ms_per_rank": [r["ms"] for r in results]}
                for name, results in (("torchrun", by_torchrun), ("ray", by_ray))]  # fmt: skip
        rows.append({"outputs_bitwise_equal": equal, "max_abs_diff": diff,
                     "kernels": by_ray[0]["kernels"], "overlap": by_ray[0]["overlap"]})  # fmt: skip
        write_results(args.out, torch.device("cuda"), None, rows)  # no copy figure here


if __name__ == "__main__":
    main()
