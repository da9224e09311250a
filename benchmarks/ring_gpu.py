"""The ring transport under NCCL: chunks past NCCL's buffers, runs queued without
synchronizing, on the lean path and replayed from CUDA graphs; every rank's output against
the sequential program's.

    torchrun --nproc-per-node 2 benchmarks/ring_gpu.py          # GPUs (NCCL)
    torchrun --nproc-per-node 2 benchmarks/ring_gpu.py --cpu    # CPU processes (gloo)

The ring's sends and receives were unbatched: each rank sent before it received, which
NCCL (a send blocks its GPU until the peer's receive runs, unless both are one group)
may hold for ever, and small chunks that fit NCCL's buffers did not show it
(``overlap.comm.ring``). Each case (all-gather + matmul and matmul + reduce-scatter, one
and two chunks a rank, lean and replayed) queues ``--runs`` runs before reading the last
output; a case that takes longer than ``--case-timeout`` seconds prints every thread's
stack and exits (a hang). Prints one line a case; exits 1 if any rank's output was wrong.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ag_matmul import build  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import Communicator, MultiDeviceExecutor, OverlapOptions  # noqa: E402


def check_case(communicator, pattern: str, rows: int, width: int, per_rank: int,
               graphs: bool, runs: int) -> str:  # fmt: skip
    """``runs`` runs of the ring pipeline queued, the last output checked against the
    sequential program's on the same inputs: "ok" or the error."""
    world, device = communicator.world_size, communicator.device
    fd = build(pattern, rows, width, width, world)
    options = OverlapOptions(transport="ring", num_chunks=per_rank * world)
    ring = MultiDeviceExecutor(fd, communicator, options, cuda_graph=graphs)
    sequential = MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=False),
                                     cuda_graph=False)  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(communicator.rank)
    local = [torch.randn(ring.local_shape(t), generator=generator, device=device,
                         dtype=torch.bfloat16) for t in ring.fusion.inputs]  # fmt: skip
    (expected,) = sequential.run(local)
    for _ in range(runs - 1):
        ring.run(local)
    (out,) = ring.run(local)
    # the ring sums a reduce-scatter's partials in its own order (overlap.comm.pipelined)
    extent = width * (world if pattern == "matmul_rs" else 1)
    try:
        assert_close(out, expected, reduction_extent=extent, partial_sums=world)
    except AssertionError as error:
        return f"WRONG: {str(error).splitlines()[0]}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU processes, gloo")
    parser.add_argument("--rows", type=int, default=8192, help="whole rows (M)")
    parser.add_argument("--width", type=int, default=4096, help="K and N of a rank's matmul")
    parser.add_argument("--runs", type=int, default=5, help="runs queued a case")
    parser.add_argument("--case-timeout", type=float, default=120.0,
                        help="seconds a case may take before every rank prints its stacks "
                        "and exits")  # fmt: skip
    args = parser.parse_args()
    # on GPUs eagerly initialized (device_id), as host_figures.py and the launchers do
    device = "cpu" if args.cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    communicator = Communicator.initialize("gloo" if args.cpu else "nccl", device=device)
    cuda = communicator.device.type == "cuda"
    wrong = 0
    for pattern in ("ag_matmul", "matmul_rs"):
        for per_rank in (1, 2):
            for graphs in (False, True) if cuda else (False,):
                name = f"{pattern} ring x{per_rank * communicator.world_size}" + (
                    " graphs" if graphs else " lean"
                )
                faulthandler.dump_traceback_later(args.case_timeout, exit=True)
                start = time.perf_counter()
                verdict = check_case(communicator, pattern, args.rows, args.width, per_rank,
                                     graphs, args.runs)  # fmt: skip
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                faulthandler.cancel_dump_traceback_later()
                verdicts = communicator.all_gather_object(verdict)
                wrong += any(v != "ok" for v in verdicts)
                if communicator.rank == 0:
                    print(f"{name:<32} {seconds:7.2f} s  " + " | ".join(verdicts), flush=True)
    dist.barrier()
    if cuda:
        # Tearing down captured graphs at exit has hung torch 2.11 (benchmarks/ag_matmul.py)
        sys.stdout.flush()
        os._exit(1 if wrong else 0)
    dist.destroy_process_group()
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
