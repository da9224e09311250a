"""The benchmark kernels as the GPU will run them, read on a machine without one.

    python benchmarks/kernel_ptx.py            # a line per kernel and form
    python benchmarks/kernel_ptx.py --json     # one JSON object per kernel and form

Compiles each kernel of ``benchmarks/kernels.py`` (at its shapes, with the heuristics'
params) in both forms, general and aligned, for ``--arch`` (90: Hopper) and prints
its global accesses by width and its instruction count (``schedulers.ptx``). Needs a
real Triton: run it without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.kernels import cases  # noqa: E402
from schedulers.hardware import B200, H200  # noqa: E402
from schedulers.ptx import kernel_widths  # noqa: E402
from schedulers.registry import split_into_kernels  # noqa: E402

PROFILES = {90: H200, 100: B200}


def benchmark_kernels(hardware):
    """``(case, scheduler, plan, params, shape)`` of each generated kernel of the
    benchmark (``shape``: its iteration space's)."""
    for case, (fd, _, shapes, _, _) in cases(smoke=False):
        for group in split_into_kernels(fd.fusion.exprs, fd.fusion):
            scheduler, plan = group.scheduler, group.plan
            if scheduler is None:
                continue
            shape = list(shapes[0])
            if plan.inputs[0].dtype.bits == 4:
                shape[-1] *= 2  # the benchmark gives fp4 shapes in bytes
            # every tensor the heuristics ask about has the first input's logical shape
            params = scheduler.configure(plan, hardware, lambda tensor, s=shape: s)
            yield case, scheduler, plan, params, shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=sorted(PROFILES), default=90)
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel")
    args = parser.parse_args()
    for case, scheduler, plan, params, shape in benchmark_kernels(PROFILES[args.arch]):
        for aligned in (False, True):
            widths_of = kernel_widths(scheduler, plan, params, shape, aligned, args.arch)
            for name, widths in widths_of.items():
                per_thread = getattr(params, "block", 0) // (32 * params.num_warps)
                row = {"case": case, "kernel": name, "aligned": aligned, **widths}
                row["elements_per_thread"] = per_thread or None
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    form = "aligned" if aligned else "general"
                    print(f"{case:<12} {name:<17} {form:<8} loads {widths['loads']} "
                          f"stores {widths['stores']} instructions {widths['instructions']}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
