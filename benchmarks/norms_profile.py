"""Where a normalization's time goes: each CUDA kernel of the generated program
(the normalization kernel, the column sums' combining kernels, memsets) and of eager
PyTorch, from torch.profiler, for a few shapes.

    python benchmarks/norms_profile.py --shape 1024x4096 --op layernorm_bwd

Prints a table per case (kernel, calls, mean us); every output is checked against the
reference evaluator first. Figures to results/norms_profile.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.kernels import benchmark_parser, copy_gbps, write_results  # noqa: E402
from benchmarks.norms import eager_function  # noqa: E402
from examples.norms import BUILDERS, make_inputs  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import MultiDeviceExecutor  # noqa: E402


def kernel_times(function, iterations: int) -> dict[str, tuple[int, float]]:
    """Each CUDA kernel's calls and mean time (us) over ``iterations`` calls."""
    function()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            function()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:60], []).append(event.device_time_total)
    return {name: (len(v), sum(v) / len(v)) for name, v in times.items()}


def main() -> None:
    parser = benchmark_parser(__doc__, "norms_profile", iterations=20)
    parser.add_argument("--op", action="append", required=True)
    parser.add_argument("--shape", action="append", required=True, help="MxN")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_gbps(device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for op in args.op:
        for shape in args.shape:
            m, n = (int(v) for v in shape.split("x"))
            fd = BUILDERS[op](n, "bfloat16")
            inputs = make_inputs(op, m, n, torch.bfloat16, device, generator)
            functions = {}
            for provider, forced in (("ours_auto", None), ("ours_split", {"k0": "split"})):
                executor = MultiDeviceExecutor(fd, kernels="generated", cuda_graph=True,
                                               kernel_params=forced)  # fmt: skip
                outputs = executor.run(inputs)
                for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
                    assert_close(actual, expected, reduction_extent=max(m, n))
                print(f"{op} {m}x{n} {provider}: {executor.kernel_report()}")
                functions[provider] = lambda e=executor, i=inputs: e.run(i)
            eager = eager_function(op, n)
            functions["eager"] = lambda f=eager, i=inputs: f(*i)
            for provider, function in functions.items():
                for name, (calls, us) in kernel_times(function, args.iterations).items():
                    print(f"  {provider:<6} {calls:>4} x {us:8.1f} us  {name}")
                    rows.append({"op": op, "M": m, "N": n, "provider": provider,
                                 "kernel": name, "calls": calls, "us": us})  # fmt: skip
    write_results(args.out, device, copy, rows)


if __name__ == "__main__":
    main()
