"""The framework's spans in a ``torch.profiler`` trace, on every rank, with NCCL.

    torchrun --nproc-per-node 2 benchmarks/profiler_spans.py [--out results/profiler_spans.json]
        [--trace-dir DIR]

Runs the demo's tensor-parallel MLP (an all-gather, two matmuls, a reduce-scatter),
pipelined in two chunks per rank, checked against the single-device reference on every
rank; then once with a timeline (the names its spans carry) and once under
``torch.profiler`` without one (what a user profiling the default run sees). Every
span's name must be among the profiler's events on every rank, the CUDA kernels too
where there are GPUs. Writes each rank's Chrome trace to ``--trace-dir`` (Perfetto opens
it) and a results file. Exits 1 if any rank misses a name. On CPUs it runs on gloo.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fusion.testing import assert_close  # noqa: E402
from launch.demo import build_tp_mlp, whole_inputs  # noqa: E402
from launch.env import init  # noqa: E402
from overlap import Communicator, MultiDeviceExecutor, OverlapOptions, Timeline  # noqa: E402
from overlap.diag.timeline import span_name  # noqa: E402


def check_rank(communicator: Communicator, trace_dir: Path | None) -> dict:
    world = communicator.world_size
    tokens, hidden, ffn = 1024 * world, 1024, 4096
    fd = build_tp_mlp(tokens, hidden, ffn, world)
    options = OverlapOptions(num_chunks=2 * world, transport="collective")
    executor = MultiDeviceExecutor(fd, communicator, options)
    whole = whole_inputs(tokens, hidden, ffn)
    local = executor.shard_inputs([t.to(communicator.device) for t in whole])
    (out,) = executor.run(local)  # the first run compiles
    (expected,) = executor.shard_outputs(fd.execute(whole))
    assert_close(out.cpu(), expected, reduction_extent=ffn, partial_sums=world)
    timeline = Timeline(communicator.device)
    executor.run(local, timeline=timeline)
    spans = sorted({span_name(s.name, s.detail, s.chunk) for s in timeline.spans()})
    activities = [torch.profiler.ProfilerActivity.CPU]
    if communicator.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        executor.run(local)
        if communicator.device.type == "cuda":
            torch.cuda.synchronize()
    events = profile.events()
    names = {event.name for event in events}
    on_device = sorted({e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA})
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(trace_dir / f"trace_rank{communicator.rank}.json"))
    missing = sorted(set(spans) - names)
    return {"rank": communicator.rank, "spans": spans, "missing": missing,
            "device_kernels": len(on_device), "ok": not missing and bool(spans)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trace-dir", type=Path, default=None)
    args = parser.parse_args()
    communicator = init()
    row = check_rank(communicator, args.trace_dir)
    rows = communicator.all_gather_object(row)
    if communicator.rank == 0:
        for r in rows:
            print(f"rank {r['rank']}: {len(r['spans'])} spans, missing {r['missing'] or 'none'}, "
                  f"{r['device_kernels']} device kernels in the trace: "
                  f"{'PASS' if r['ok'] else 'FAIL'}")  # fmt: skip
        print("spans:", ", ".join(rows[0]["spans"]))
        if args.out is not None:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip()  # fmt: skip
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
            args.out.write_text(json.dumps({
                "device": f"{communicator.world_size}x {device}",
                "date": datetime.date.today().isoformat(), "commit": commit,
                "command": " ".join(["torchrun", "--nproc-per-node",
                                     str(communicator.world_size), *sys.argv]),
                "rows": rows}, indent=1))  # fmt: skip
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
