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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SIZES = [2**20, 16 * 2**20, 256 * 2**20]  # bytes
SMOKE_SIZES = [2**10, 2**20]


def rank_job(communicator, sizes: list[int], rounds: int) -> list[dict]:
    import torch.distributed as dist

    from benchmarks.timing import Timer
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
            if rank == 0:
                transfers = {"ucx": lambda t=sent: transport.send(t, 1),
                             "torch": lambda t=sent: dist.send(t, 1)}  # fmt: skip
            else:
                transfers = {"ucx": lambda b=buffer: transport.recv(b, 0),
                             "torch": lambda b=buffer: dist.recv(b, 0)}  # fmt: skip
            timer = Timer(device, on_host=True, before=synchronize)  # one transfer a round
            timer.rounds(transfers, rounds)
            median = timer.medians()  # ms
            rows.append({"bytes": size, "exact": exact, "device": str(device),
                         **{f"{n}_ms": ms for n, ms in median.items()},
                         **{f"{n}_gbps": size / ms / 1e6 for n, ms in median.items()}})  # fmt: skip
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
