"""A GPU with no recorded figures, measured at its first use: this machine's GPU, its
recorded profile and figures (if any) left out for the run.

    OVERLAP_CACHE_DIR=/tmp/overlap_cache python benchmarks/unknown_gpu_figures.py \\
        --out first.json [--full]

Run it twice with one cache folder: the first process measures the copy bandwidth and
keeps it, the second reads it back. Each builds a ``MultiDeviceExecutor`` (one device, no
communicator) for a matmul and a pointwise op, runs it with generated kernels and checks
its output against the reference evaluator on the CPU, and writes (JSON) the figures it
planned with beside the recorded ones, how long ``device_figures`` took, whether the cache
file was there before, and the file's content. ``--full`` also measures every figure on a
one-rank NCCL group (``measure_hardware_figures``, as the recorded tables were).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fusion import FusionDefinition  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import Communicator, MultiDeviceExecutor  # noqa: E402
from overlap.comm.measure import device_figures, measure_hardware_figures  # noqa: E402
from overlap.plan import figures as recorded  # noqa: E402
from schedulers import hardware  # noqa: E402
from schedulers.device_cache import cache_path  # noqa: E402

ROWS, CONTRACTION, COLUMNS = 1000, 512, 768  # odd rows: the kernels' masks are exercised


def forget_recorded(device_name: str) -> dict[str, object]:
    """Leave this device's recorded profile and figures out for this process; returns
    what was recorded, to print beside what is measured."""
    forgotten = {}
    for name in [name for name in hardware.PROFILES if device_name.startswith(name)]:
        forgotten["profile"] = dataclasses.asdict(hardware.PROFILES.pop(name))
    for name in [name for name in recorded.RECORDED_FIGURES if device_name.startswith(name)]:
        forgotten["figures"] = _figures(recorded.RECORDED_FIGURES.pop(name))
    return forgotten


def _figures(figures: recorded.HardwareFigures) -> dict[str, object]:
    fields = dataclasses.asdict(figures)
    fields["device"] = figures.device.name
    fields["memory_gbps"] = figures.memory_gbps
    return fields


def matmul_gelu() -> FusionDefinition:
    with FusionDefinition("matmul_gelu") as fd:
        a = fd.define_tensor([ROWS, CONTRACTION])
        b = fd.define_tensor([CONTRACTION, COLUMNS])
        fd.add_output(fd.ops.gelu(fd.ops.matmul(a, b)))
    return fd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write this process's record here")
    parser.add_argument("--full", action="store_true", help="also measure every figure")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the CUDA context, outside the timings
    name = torch.cuda.get_device_properties(device).name
    record = {"device": name, "torch": torch.__version__, "recorded": forget_recorded(name)}
    kept = cache_path("memory", {"device": name, "torch": torch.__version__})
    record["cache_file"] = str(kept)
    record["cache_existed_before"] = kept.exists()
    start = time.perf_counter()
    figures = device_figures(device)
    record["device_figures_s"] = round(time.perf_counter() - start, 4)
    record["planned_with"] = _figures(figures)
    record["cache_content"] = json.loads(kept.read_text())

    fd = matmul_gelu()
    start = time.perf_counter()
    executor = MultiDeviceExecutor(fd)
    record["executor_build_s"] = round(time.perf_counter() - start, 4)
    assert executor.figures == figures, (executor.figures, figures)
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    inputs = [torch.randn(ROWS, CONTRACTION, generator=generator),
              torch.randn(CONTRACTION, COLUMNS, generator=generator)]  # fmt: skip
    (output,) = executor.run([tensor.to(device) for tensor in inputs])
    (expected,) = fd.execute(inputs)
    output = output.cpu()
    error = (output.double() - expected.double()).norm() / expected.double().norm()
    assert_close(output, expected, reduction_extent=CONTRACTION)
    record["relative_error"] = float(error)
    record["kernels"] = executor.kernel_report()

    if args.full:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        communicator = Communicator.initialize("nccl", 120.0, device, rank=0, world_size=1)
        start = time.perf_counter()
        record["measure_hardware_figures"] = _figures(measure_hardware_figures(communicator))
        record["measure_hardware_figures_s"] = round(time.perf_counter() - start, 3)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1), flush=True)


if __name__ == "__main__":
    main()
