"""UCX point-to-point between two local ranks: exact bytes and bandwidth, against
torch.distributed's send/recv.

    python benchmarks/ucx_p2p.py           # two GPUs: CUDA tensors (ucxx with CUDA)
    python benchmarks/ucx_p2p.py --smoke   # two CPU processes: host tensors

Rank 0 sends, rank 1 receives into a buffer of the same bytes; every size is checked
byte for byte first, then timed (median of rounds, one transfer each, both ranks
synchronized before it). Figures to ``results/ucx.json`` on GPUs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZES = [2**20, 16 * 2**20, 256 * 2**20]  # bytes
SMOKE_SIZES = [2**10, 2**20]


def rank_job(communicator, sizes: list[int], rounds: int) -> list[dict]:
    import torch.distributed as dist

    from overlap import UcxTransport

    device, rank = communicator.device, communicator.rank
    transport = UcxTransport(communicator)
    rows = []

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        communicator.all_gather_object(None)

    try:
        for size in sizes:
            generator = torch.Generator().manual_seed(size)
            sent = torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8)
            sent = sent.to(device)
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            if rank == 0:
                transport.send(sent, peer=1)
            else:
                transport.recv(buffer, peer=0)
            exact = bool(torch.equal(buffer, sent)) if rank == 1 else True
            times = {"ucx": [], "torch": []}
            for _ in range(rounds):
                for name in times:
                    synchronize()
                    start = time.perf_counter()
                    if name == "ucx":
                        transport.send(sent, 1) if rank == 0 else transport.recv(buffer, 0)
                    else:
                        dist.send(sent, 1) if rank == 0 else dist.recv(buffer, 0)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times[name].append(time.perf_counter() - start)
            median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
            rows.append({"bytes": size, "exact": exact, "device": str(device),
                         **{f"{n}_ms": m * 1e3 for n, m in median.items()},
                         **{f"{n}_gbps": size / m / 1e9 for n, m in median.items()}})  # fmt: skip
    finally:
        transport.close()
    return rows


def main() -> None:
    from benchmarks.kernels import benchmark_parser

    parser = benchmark_parser(__doc__, "ucx", rounds=9, iterations=None)
    args = parser.parse_args()
    from launch.local import run_function

    sizes = SMOKE_SIZES if args.smoke else SIZES
    _, received = run_function(rank_job, (sizes, args.rounds), nproc=2, timeout_s=600)
    print(f"{'bytes':>12} {'exact':>6} {'ucx ms':>9} {'ucx GB/s':>9} {'torch ms':>9} "
          f"{'torch GB/s':>10}   (rank 1, {received[0]['device']})")  # fmt: skip
    for row in received:
        print(
            f"{row['bytes']:>12} {row['exact']!s:>6} {row['ucx_ms']:9.3f} "
            f"{row['ucx_gbps']:9.2f} {row['torch_ms']:9.3f} {row['torch_gbps']:10.2f}"
        )
    if not all(row["exact"] for row in received):
        raise SystemExit("ucx_p2p: some transfer did not deliver the exact bytes")
    if not args.smoke:
        from benchmarks.kernels import write_results

        write_results(args.out, torch.device("cuda"), None, received)


if __name__ == "__main__":
    main()
