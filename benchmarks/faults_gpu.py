"""A rank that fails mid-job: how long until the whole job ends, under each launcher.

    python benchmarks/faults_gpu.py [--launchers torchrun,local,ray] [--out FILE]

Each case starts a 2-rank job (``--nproc N``: N ranks) with ``overlap run --launcher L``
running this file's ``main``: a tensor-parallel MLP run in a loop. At its 6th run rank 1
fails, while rank 0 goes on into its next run and waits in a collective for rank 1 (on
NCCL it would wait forever): rank 1 either raises (``raise``), dies (``exit``:
``os._exit(3)``), passes a bad input (``bad_input``: a piece one row short, which it
finds alone and raises at once) or an input that changed alone (``changed_alone``: a
tensor-parallel MLP whose tokens are a symbolic extent every rank holds whole, and rank
1's copy one row short, which only an exchange could judge: rank 1 learns after the
input-check timeout, set to 10 s for these jobs with ``OVERLAP_INPUT_CHECK_TIMEOUT_S``,
that rank 0 is not coming). Every run checks its inputs as the default does (an exchange
only when a rank's inputs change). The variants put rank 0's wait in a plain NCCL
collective issued by the host (``collectives``: ``cuda_graph=False``), in a CUDA-graph
replay (``cuda_graph``: the default options, graphs on GPUs), or in a copy-engine
pipeline's symmetric-memory barrier (``copy_engine``, replayed from graphs as by
default). Measured: the seconds from rank 1's failure to the job's end, the exit code,
whether the failing rank's traceback was shown, and whether the launcher named rank 1 as
the cause (torchrun: its "Root Cause"; local: ``overlap run: rank 1 exited``; Ray:
``PoolError`` for rank 1). A job still running after ``--limit`` seconds is killed and
counted as hung.

Without GPUs the same runs on gloo processes, only the ``collectives`` variant.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAILING_RUN = 5
SIZES = {"cuda": (8192, 4096, 8192), "cpu": (64, 32, 64)}  # tokens, hidden, ffn
# How each launcher names the rank that caused the failure (a pattern on its output)
# What the failing rank's traceback says, by fault
FAULT_MESSAGES = {
    "raise": "rank 1 fails on purpose",
    "exit": "rank 1 fails on purpose",
    "bad_input": "InputError: rank 1: input 0",
    "changed_alone": "InputChangeError: rank 1: its inputs changed at run 6",
}
LAUNCHER_NAMES = {
    "local": r"overlap run: rank 1 exited",
    "torchrun": r"Root Cause \(first observed failure\):\n\[\d+\]:\n(?:  .*\n)*?  rank\s+: 1 ",
    "ray": r"overlap run: rank 1 failed",
}


# -- the job: each rank runs this (``overlap run ... faults_gpu.py FAULT VARIANT DIR``) --


def main(communicator) -> None:
    import torch

    from launch.demo import build_tp_mlp, whole_inputs
    from overlap import MultiDeviceExecutor, OverlapOptions

    fault, variant, folder = sys.argv[1:4]
    cuda = communicator.device.type == "cuda"
    sizes = SIZES["cuda" if cuda else "cpu"]
    if fault == "changed_alone":
        fd = tokens_whole_tp_mlp(*sizes[1:], communicator.world_size)
    else:
        fd = build_tp_mlp(*sizes, communicator.world_size)
    options = {
        "collectives": {"options": OverlapOptions(overlap=False), "cuda_graph": False},
        "cuda_graph": {},
        "copy_engine": {"options": OverlapOptions(transport="copy_engine")},
    }[variant]
    executor = MultiDeviceExecutor(fd, communicator, **options)
    inputs = [t.to(communicator.device) for t in executor.shard_inputs(whole_inputs(*sizes))]
    for run in range(1000):
        if run == FAILING_RUN and communicator.rank == 1:
            Path(folder, "failed_at").write_text(repr(time.time()))
            if fault == "exit":
                os._exit(3)
            if fault == "raise":
                raise RuntimeError(f"rank 1 fails on purpose in run {run}")
            inputs[0] = inputs[0][1:]
        # after the first run the inputs do not change (but on rank 1 at its fault): no
        # host-side exchange, rank 0 goes straight into the program's collectives (NCCL,
        # a graph replay or a symmetric-memory barrier)
        executor.run(inputs)
        if cuda:
            torch.cuda.synchronize()
    raise AssertionError("rank 0 ran 1000 times: rank 1 never failed")


def tokens_whole_tp_mlp(hidden: int, ffn: int, world: int):
    """The tensor-parallel MLP with symbolic tokens that every rank holds whole."""
    from fusion import FusionDefinition
    from sharding import DeviceMesh, Replicate, Shard, shard

    mesh = DeviceMesh(world)
    with FusionDefinition("tp_mlp_tokens") as fd:
        x = fd.define_tensor(["tokens", hidden], "bf16")
        w1 = fd.define_tensor([hidden, ffn], "bf16")
        w2 = fd.define_tensor([ffn, hidden], "bf16")
        y = fd.ops.matmul(fd.ops.gelu(fd.ops.matmul(x, w1), approximate="tanh"), w2)
        fd.add_output(y)
    for tensor, placement in ((x, Replicate()), (w1, Shard(1)), (w2, Shard(0)), (y, Replicate())):
        shard(tensor, mesh, [placement])
    return fd


# -- the driver ----------------------------------------------------------------------


def run_case(launcher: str, fault: str, variant: str, limit_s: float, nproc: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "launch.cli", "run", "--launcher", launcher,
                   "--nproc", str(nproc), __file__, fault, variant, folder]  # fmt: skip
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0",
               "PYTHONUNBUFFERED": "1", "OVERLAP_INPUT_CHECK_TIMEOUT_S": "10"}  # fmt: skip
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OVERLAP_LAUNCHER"):
            env.pop(name, None)
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)  # fmt: skip
        try:
            output, _ = process.communicate(timeout=limit_s)
            ended, code = time.time(), process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            output, _ = process.communicate()
            ended, code = None, None
        stamp = Path(folder, "failed_at")
        failed_at = float(stamp.read_text()) if stamp.exists() else None
    seconds = None if ended is None or failed_at is None else ended - failed_at
    # the launcher names the failed rank (not the rank's own "[overlap] rank 1 failed")
    named = re.search(LAUNCHER_NAMES[launcher], output) is not None
    return {
        "launcher": launcher,
        "fault": fault,
        "variant": variant,
        "seconds_to_end": None if seconds is None else round(seconds, 2),
        "exit_code": code,
        "hung": ended is None,
        "failing_rank_reached_its_fault": failed_at is not None,
        # the failing rank's own frames (Ray relays them without the "Traceback" line)
        "traceback_shown": FAULT_MESSAGES[fault] in output and "in main\n" in output,
        "failed_rank_named": named,
        "output_tail": output[-1500:],
    }


def main_driver() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", default="torchrun,local,ray")
    parser.add_argument(
        "--faults",
        default="raise,exit,bad_input,changed_alone",
        help="bad_input and changed_alone run in the collectives variant only",
    )
    parser.add_argument("--variants", default=None, help="default: every one this device has")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds before 'hung'")
    parser.add_argument("--nproc", type=int, default=2, help="ranks a job (rank 1 fails)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults_gpu.json"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc
    variants = args.variants or ("collectives,cuda_graph,copy_engine" if cuda else "collectives")
    rows = []
    print(f"{'launcher':9s} {'fault':6s} {'variant':12s} {'s to end':>8s} {'exit':>5s} "
          f"{'traceback':>9s} {'named':>6s}", flush=True)  # fmt: skip
    for launcher in args.launchers.split(","):
        for variant in variants.split(","):
            for fault in args.faults.split(","):
                if fault in ("bad_input", "changed_alone") and variant != "collectives":
                    continue
                row = run_case(launcher, fault, variant, args.limit, args.nproc)
                rows.append(row)
                seconds = "HUNG" if row["hung"] else f"{row['seconds_to_end']:.2f}"
                print(f"{launcher:9s} {fault:6s} {variant:12s} {seconds:>8s} "
                      f"{row['exit_code']!s:>5s} {row['traceback_shown']!s:>9s} "
                      f"{row['failed_rank_named']!s:>6s}", flush=True)  # fmt: skip
                if row["hung"] or not row["failing_rank_reached_its_fault"]:
                    print(row["output_tail"], flush=True)
    from benchmarks.kernels import commit_id

    record = {
        "device": f"{args.nproc}x {torch.cuda.get_device_name()}" if cuda else "cpu (gloo)",
        "nproc": args.nproc,
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
        "sizes": SIZES["cuda" if cuda else "cpu"],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    worst = [r for r in rows if r["hung"] or r["seconds_to_end"] is None]
    sys.exit(1 if worst else 0)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main_driver()
