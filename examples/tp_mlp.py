"""A tensor-parallel MLP on every rank, start to finish: build, place, run, check, time.

    torchrun --nproc-per-node 2 examples/tp_mlp.py                   # plain torchrun
    overlap run --launcher ray --nproc 2 examples/tp_mlp.py          # a Ray pool (the
                                                                     # ray extra: .[ray])
    overlap run --launcher local --nproc 2 examples/tp_mlp.py        # local processes
    ... examples/tp_mlp.py --tokens 8192 --hidden 4096 --ffn 16384   # other sizes

One script for every launcher: run directly (under torchrun, or alone: a world of one)
it joins the process group itself (``launch.init``); ``overlap run`` calls its
``main(communicator)`` on every rank (local processes, torchrun, or one Ray actor per
rank). On GPUs the ranks use NCCL, on CPUs gloo.

Every rank builds the same fusion, ``y = gelu(x @ w1.T) @ w2.T``: ``x`` whole on every
rank, ``w1`` split by rows and ``w2`` by columns (Megatron's column- then row-parallel
pair), ``y`` whole: the framework inserts the all-reduce of the second matmul's partial
sums. The whole inputs come from one seeded generator, so every rank holds the same
ones (unseeded, each rank would cut its piece from a different whole). Each rank runs its
piece, checks its output against the single-device reference (``partial_sums=world``:
the ranks' partial sums are added in another order than one device adds them, which the
tolerance allows for), then times the sequential program against the planner's choice:
a few untimed runs of each first, then rounds that run each once, the ranks lined up
before every run, and the median round of each (the one run first in a process pays for
warming caches, which a single warm-up does not cover). Where the planner keeps the
sequential program there is one program to time, and it says so. A wrong piece on any
rank fails the job (the launcher stops the others). ``fusion(world_size)`` is the fusion
at the default sizes, for ``overlap dump examples/tp_mlp.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusion import DataType, FusionDefinition  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import (
    MultiDeviceExecutor,  # noqa: E402
    OverlapOptions,  # noqa: E402
)
from sharding import DeviceMesh, Replicate, Shard, shard  # noqa: E402

SIZES = {"tokens": 512, "hidden": 256, "ffn": 1024}  # the defaults
WARMUP = 3  # untimed runs of each program before the timed rounds


def build(tokens: int, hidden: int, ffn: int, world: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("tp_mlp") as fd:
        x = fd.define_tensor([tokens, hidden], DataType.float32)
        w1 = fd.define_tensor([ffn, hidden], DataType.float32)
        w2 = fd.define_tensor([hidden, ffn], DataType.float32)
        y = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2)
        fd.add_output(y)
    shard(x, mesh, [Replicate()])
    shard(w1, mesh, [Shard(0)])  # rows: each rank a slice of the ffn features
    shard(w2, mesh, [Shard(1)])  # columns: each rank's slice contracted, a partial sum
    shard(y, mesh, [Replicate()])
    return fd


def fusion(world_size: int) -> FusionDefinition:
    """The fusion at the default sizes, for ``overlap dump``."""
    return build(SIZES["tokens"], SIZES["hidden"], SIZES["ffn"], world_size)


def main(communicator) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, what in (("tokens", "rows of x"), ("hidden", "model width"),
                       ("ffn", "inner width")):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=SIZES[name],
                            help=f"{what} (default {SIZES[name]})")  # fmt: skip
    parser.add_argument("--runs", type=int, default=9,
                        help="timed runs of each program, interleaved (default 9)")  # fmt: skip
    args = parser.parse_args(sys.argv[1:])
    world, rank, device = communicator.world_size, communicator.rank, communicator.device
    fd = build(args.tokens, args.hidden, args.ffn, world)
    generator = torch.Generator().manual_seed(0)  # the same whole inputs on every rank
    whole = [torch.randn([int(e) for e in t.shape], generator=generator) / 8
             for t in fd.fusion.inputs]  # fmt: skip
    executor = MultiDeviceExecutor(fd, communicator)
    local = [piece.to(device) for piece in executor.shard_inputs(whole)]
    (y,) = executor.run(local)
    (expected,) = fd.execute(whole)  # one device: the reference
    assert_close(y.cpu(), expected, reduction_extent=args.ffn, partial_sums=world,
                 message=f"rank {rank}'s output")  # fmt: skip
    sequential = MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=False))
    same = str(executor.program) == str(sequential.program)
    variants = {"sequential": sequential} if same else {"sequential": sequential,
                                                        "planner's choice": executor}  # fmt: skip
    ms = _median_ms(variants, local, args.runs, device)
    if rank == 0:
        ranks = f"{world} rank{'s' if world > 1 else ''}"
        times = ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items())
        chosen = "; the planner's choice is the same program" if same else ""
        print(f"tp_mlp on {ranks} ({device.type}): every rank's output matches one device; "
              f"{times} (median of {args.runs} runs){chosen}", flush=True)  # fmt: skip
        print(executor.explain_overlap(), flush=True)


def _median_ms(variants: dict[str, MultiDeviceExecutor], local: list, rounds: int,
               device: torch.device) -> dict[str, float]:  # fmt: skip
    """Each variant's median time: ``WARMUP`` untimed rounds, then ``rounds`` timed ones,
    each running every variant once in turn (ABAB...), so that neither profits from its
    place; the ranks line up before every run."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(WARMUP + rounds):
        for name, executor in variants.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            executor.run(local)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index >= WARMUP:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


if __name__ == "__main__":  # run directly: under torchrun, or alone
    from launch import init

    main(init())
