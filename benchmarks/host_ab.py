"""Host time of a call of the default run path, in a tree of this project given by path:
an A/B of two commits, each run in its own process, alternated by the caller.

    git worktree add /tmp/base BASE_COMMIT
    for round in 1 2 3; do for tree in . /tmp/base; do
        python benchmarks/host_ab.py $tree
        torchrun --nproc-per-node 2 benchmarks/host_ab.py $tree
    done; done

One GPU: a pointwise fusion (a generated kernel) of 1024x4096 bf16; several (torchrun):
the demo's tensor-parallel MLP at 512 tokens a rank. Each checks its output against the
reference first, then issues 5 x 300 calls back to back (small shapes: the host, not the
GPU, sets the pace) and prints one JSON line on rank 0: us a call, the smallest and the
median of the 5. Works with trees from before and after ``overlap``'s public names moved
(``overlap.executor`` then, ``overlap`` now).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

TREE = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(TREE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import overlap  # noqa: E402
from fusion import FusionDefinition  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from launch.demo import build_tp_mlp, whole_inputs  # noqa: E402

if hasattr(overlap, "MultiDeviceExecutor"):
    from overlap import Communicator, MultiDeviceExecutor
else:  # a tree before the rooms (59d1ecd)
    from overlap.communicator import Communicator
    from overlap.executor import MultiDeviceExecutor

CALLS, SAMPLES = 300, 5


def per_call_us(run) -> tuple[float, float]:
    """Host time a call of ``run``, us: the smallest and the median of ``SAMPLES``."""
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(CALLS):
            run()
        samples.append((time.perf_counter() - start) / CALLS * 1e6)
        torch.cuda.synchronize()
    return min(samples), statistics.median(samples)


def main() -> None:
    assert Path(overlap.__file__).resolve().is_relative_to(TREE), overlap.__file__
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        with FusionDefinition() as fd:
            x = fd.define_tensor([1024, 4096], "bf16")
            w = fd.define_tensor([4096], "bf16")
            fd.add_output(fd.ops.gelu(x * fd.ops.broadcast(w, [True, False])))
        executor = MultiDeviceExecutor(fd)
        inputs = [torch.randn(1024, 4096, dtype=torch.bfloat16),
                  torch.randn(4096, dtype=torch.bfloat16)]  # fmt: skip
        local = [t.cuda() for t in inputs]
        assert_close(executor.run(local)[0].cpu(), fd.execute(inputs)[0])
        case = "pointwise 1024x4096 (1 GPU)"
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        tokens, hidden, ffn = 512 * world, 1024, 4096
        fd = build_tp_mlp(tokens, hidden, ffn, world)
        executor = MultiDeviceExecutor(fd, Communicator())
        whole = whole_inputs(tokens, hidden, ffn)
        local = executor.shard_inputs([t.cuda() for t in whole])
        (expected,) = executor.shard_outputs(fd.execute(whole))
        assert_close(executor.run(local)[0].cpu(), expected, reduction_extent=ffn,
                     partial_sums=world)  # fmt: skip
        case = f"tp_mlp {tokens}x{hidden}x{ffn} ({world} GPUs, default)"
    smallest, median = per_call_us(lambda: executor.run(local))
    if rank == 0:
        print(json.dumps({"tree": str(TREE), "case": case, "host_us_min": round(smallest, 1),
                          "host_us_median": round(median, 1)}))  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
