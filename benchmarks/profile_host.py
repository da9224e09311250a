"""Where the host's time goes when it issues one overlapped run (cProfile), and whether a
run can be captured in a CUDA graph. A diagnostic for developers:

    torchrun --nproc-per-node 2 benchmarks/profile_host.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ag_matmul import build  # noqa: E402

from benchmarks.timing import host_ms  # noqa: E402
from overlap import (  # noqa: E402
    Communicator,
    MultiDeviceExecutor,
    OverlapOptions,
)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    communicator = Communicator()
    world = communicator.world_size
    for pattern in ("ag_matmul", "matmul_rs"):
        fd = build(pattern, 8192, 8192, 4096, world)
        options = OverlapOptions(overlap=True, num_chunks=2, transport="copy_engine")
        executor = MultiDeviceExecutor(fd, communicator, options)
        local = [
            torch.randn(executor.local_shape(t), device="cuda", dtype=torch.bfloat16)
            for t in executor.fusion.inputs
        ]
        (reference,) = executor.run(local)
        for _ in range(3):
            executor.run(local, check_inputs=False)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(20):
            executor.run(local, check_inputs=False)
        profiler.disable()
        host = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        if communicator.rank == 0:
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(18)
            print(f"== {pattern}: host {host:.3f} ms per run")
            print(stream.getvalue()[-4500:])
        # Can a run be captured in a CUDA graph and replayed?
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                with torch.cuda.graph(graph):
                    (captured,) = executor.run(local, check_inputs=False)
            torch.cuda.current_stream().wait_stream(side)
            graph.replay()
            torch.cuda.synchronize()
            same = torch.equal(captured, reference)
            replay_host = host_ms(graph.replay, 20, torch.device("cuda", local_rank))
            message = f"graph: replay equal={same}, host {replay_host:.3f} ms per replay"
        except Exception as error:  # report what capture refused
            message = f"graph capture failed: {type(error).__name__}: {str(error)[:300]}"
        if communicator.rank == 0:
            print(message, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
