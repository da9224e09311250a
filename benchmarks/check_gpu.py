"""Correctness of the multi-device scenarios on GPUs with NCCL (the CPU tests, on GPUs).

    torchrun --nproc-per-node 2 benchmarks/check_gpu.py

Runs the scenarios of ``tests/test_multidevice.py`` and ``tests/test_pipelined.py`` on
every rank with NCCL and CUDA tensors, each checked against the reference evaluator,
plus the pipelined patterns with the copy-engine transport. Prints one line per check.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_multidevice as scenarios  # noqa: E402
import test_pipelined as pipelined  # noqa: E402

from overlap.communicator import Communicator  # noqa: E402


def checks(world: int):
    yield "tensor-parallel MLP", scenarios.tensor_parallel_mlp, (11, True)
    yield "sequence-parallel block", scenarios.sequence_parallel_block, (12, 4 * world)
    yield "uneven sequence (7 rows)", scenarios.sequence_parallel_block, (13, 7)
    yield "pipeline stages", scenarios.pipeline_stages, (14,)
    yield "sequence to heads (all-to-all)", scenarios.sequence_to_heads, (16,)
    yield "symbolic sequence", scenarios.symbolic_sequence, (17, 50)
    yield "fp8/fp4/bool/bf16 gathers", scenarios.gather_storage_types, (18,)
    yield "bf16 row-parallel", scenarios.bf16_row_parallel, (19,)
    for kind in ("Broadcast", "Scatter", "Gather", "Reduce"):
        yield f"one rank and a mesh: {kind}", scenarios.one_rank_and_a_mesh, (20, kind)
    for pattern in ("ag", "rs"):
        for transport, per_rank in (("collective", 2), ("ring", 1), ("copy_engine", 1),
                                    ("copy_engine", 3)):  # fmt: skip
            yield (
                f"pipelined {pattern} {transport} {per_rank * world} chunks",
                pipelined.pipelined,
                (pattern, 13, per_rank * world, transport, 21),
            )


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    communicator = Communicator()
    failures = 0
    for name, function, args in checks(communicator.world_size):
        try:
            function(communicator, *args)
            status = "ok"
        except Exception:  # report and go on: every rank runs every check
            failures += 1
            status = "FAILED\n" + traceback.format_exc()
        flags = torch.tensor([status != "ok"], device=communicator.device, dtype=torch.int32)
        dist.all_reduce(flags)
        if communicator.rank == 0 or status != "ok":
            print(f"rank {communicator.rank}: {name}: {status}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
