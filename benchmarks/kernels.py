"""Generated kernels against eager PyTorch and torch.compile, as a fraction of a copy.

    python benchmarks/kernels.py            # on one GPU; figures to results/kernels.json
    python benchmarks/kernels.py --smoke    # tiny shapes on CPU (Triton's interpreter)

For each case (bytes = inputs read + outputs written) it times ours (the executor with
generated kernels, replayed from a CUDA graph), eager PyTorch, torch.compile (compiled
afresh for each shape) and a copy of the same number of bytes with CUDA events (median of
interleaved rounds), and reports GB/s and the fraction of a measured 1 GiB
device-to-device copy. Ours is checked against the reference evaluator first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.timing import time_rounds  # noqa: E402
from fusion import FusionDefinition  # noqa: E402
from fusion.fp4 import from_fp4, to_fp4  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import MultiDeviceExecutor  # noqa: E402
from schedulers.pointwise import PointwiseParams  # noqa: E402
from schedulers.reduction import ReductionParams  # noqa: E402


def pointwise_case(m: int, n: int):
    with FusionDefinition("pointwise_chain") as fd:
        x = fd.define_tensor([m, n], "bf16")
        scale = fd.define_tensor([n], "bf16")
        bias = fd.define_tensor([n], "bf16")
        row = [True, False]
        h = x * fd.ops.broadcast(scale, row) + fd.ops.broadcast(bias, row)
        fd.add_output(fd.ops.silu(h))

    def eager(x, scale, bias):
        return F.silu(x * scale + bias)

    shapes = [(m, n), (n,), (n,)]
    return fd, eager, shapes, [torch.bfloat16] * 3, 2 * (2 * m * n)


def row_sum_case(m: int, n: int):
    with FusionDefinition("row_sum") as fd:
        x = fd.define_tensor([m, n], "bf16")
        fd.add_output(fd.ops.sum(fd.ops.cast(x, "f32"), dims=[1]))

    def eager(x):
        return x.float().sum(dim=1)

    return fd, eager, [(m, n)], [torch.bfloat16], 2 * m * n + 4 * m


def column_sum_case(m: int, n: int):
    with FusionDefinition("column_sum") as fd:
        x = fd.define_tensor([m, n], "bf16")
        fd.add_output(fd.ops.sum(fd.ops.cast(x, "f32"), dims=[0]))

    def eager(x):
        return x.float().sum(dim=0)

    return fd, eager, [(m, n)], [torch.bfloat16], 2 * m * n + 4 * n


def multi_column_sum_case(m: int, n: int, k: int):
    """A column sum over the product of ``k`` full inputs and a broadcast weight (the
    shape of a weight gradient): the multi-input outer reduction TMA tiles are for."""
    with FusionDefinition(f"column_sum_of_{k}") as fd:
        xs = [fd.define_tensor([m, n], "bf16") for _ in range(k)]
        w = fd.define_tensor([n], "bf16")
        product = fd.ops.cast(xs[0], "f32")
        for x in xs[1:]:
            product = product * fd.ops.cast(x, "f32")
        product = product * fd.ops.broadcast(fd.ops.cast(w, "f32"), [True, False])
        fd.add_output(fd.ops.sum(product, dims=[0]))

    def eager(*inputs):
        *xs, w = inputs
        product = xs[0].float()
        for x in xs[1:]:
            product = product * x.float()
        return (product * w.float()).sum(dim=0)

    return fd, eager, [(m, n)] * k + [(n,)], [torch.bfloat16] * (k + 1), 2 * (k * m + 1) * n + 4 * n


def fp32_to_fp4_case(m: int, n: int):
    with FusionDefinition("fp32_to_fp4") as fd:
        x = fd.define_tensor([m, n], "f32")
        fd.add_output(fd.ops.cast(x, "f4e2m1"))
    return fd, to_fp4, [(m, n)], [torch.float32], 4 * m * n + m * n // 2


def fp4_to_bf16_case(m: int, n: int):
    with FusionDefinition("fp4_to_bf16") as fd:
        x = fd.define_tensor([m, n], "f4e2m1")
        fd.add_output(fd.ops.cast(x, "bf16"))

    def eager(x):
        return from_fp4(x, torch.bfloat16)

    return fd, eager, [(m, n // 2)], [torch.float4_e2m1fn_x2], m * n // 2 + 2 * m * n


def cases(smoke: bool):
    if smoke:
        yield "pointwise", pointwise_case(7, 96)
        yield "row_sum", row_sum_case(7, 300)
        yield "column_sum", column_sum_case(300, 33)
        yield "multi_column_sum", multi_column_sum_case(300, 40, 2)
        yield "fp32_to_fp4", fp32_to_fp4_case(5, 64)
        yield "fp4_to_bf16", fp4_to_bf16_case(5, 64)
        return
    yield "pointwise", pointwise_case(16384, 8192)
    yield "row_sum", row_sum_case(32768, 4096)
    for n in (256, 1024, 4096, 16384, 65536):
        yield "column_sum", column_sum_case(128 * 2**20 // n, n)
    yield "fp32_to_fp4", fp32_to_fp4_case(16384, 8192)
    yield "fp4_to_bf16", fp4_to_bf16_case(16384, 16384)
    for k in (1, 2, 3, 5):  # the reduction scheduler's outer kernel, tiled and TMA
        for n in (1024, 4096):
            yield "multi_column_sum", multi_column_sum_case(64 * 2**20 // n, n, k)


def alternatives(executor: MultiDeviceExecutor) -> dict[str, dict]:
    """Other launch configurations of each generated kernel, to time beside the
    heuristics' choice (``--sweep``): a label -> ``kernel_params`` of an executor."""
    variants: dict[str, dict] = {}
    for name, params in executor.chosen_params.items():
        if isinstance(params, PointwiseParams):
            for warps, unroll in ((4, 2), (4, 4), (4, 8), (8, 1), (8, 2), (8, 4), (8, 8)):
                if (warps, unroll) != (params.num_warps, params.unroll):
                    other = replace(params, num_warps=warps, unroll=unroll)
                    variants[f"{name}.warps={warps},unroll={unroll}"] = {name: other}
            if params.block_columns:
                for columns in (256, 512):
                    other = replace(params, block_columns=columns)
                    variants[f"{name}.block_columns={columns}"] = {name: other}
        elif isinstance(params, ReductionParams):
            if params.layout == "outer":
                for waves in (4, 8, 32):
                    variants[f"{name}.waves={waves}"] = {name: replace(params, waves=waves)}
                atomics = replace(params, deterministic=False)
                variants[f"{name}.atomics"] = {name: atomics}
                for stages in (1, 2, 3):
                    if stages == params.stages:
                        continue
                    other = replace(params, stages=stages)
                    variants[f"{name}.stages={stages}"] = {name: other}
                for rows, columns in ((32, 128), (16, 256), (128, 32)):
                    other = replace(params, block_rows=rows, block_reduce=columns)
                    variants[f"{name}.tile={rows}x{columns}"] = {name: other}
            else:
                tiles = [(params.block_rows * 2, params.block_reduce // 2)]
                if params.block_rows > 1:
                    tiles.append((params.block_rows // 2, params.block_reduce * 2))
                for rows, reduce in tiles:
                    other = replace(params, block_rows=rows, block_reduce=reduce)
                    variants[f"{name}.tile={rows}x{reduce}"] = {name: other}
            for warps in (4, 8, 16):
                if warps != params.num_warps:
                    variants[f"{name}.warps={warps}"] = {name: replace(params, num_warps=warps)}
    return variants


def make_input(shape, dtype, device, generator):
    if dtype == torch.float4_e2m1fn_x2:
        rows, half = shape
        return to_fp4(3 * torch.randn(rows, 2 * half, generator=generator)).to(device)
    return torch.randn(shape, generator=generator).to(device, dtype)


def compiled_alone(function, backend="inductor"):
    """``torch.compile`` of ``function`` as a user with this one shape gets it. Dynamo
    caches compiled code by code object, and the eager functions of a table share one
    for every shape: from the second shape on it recompiles with dynamic shapes. On
    H200, LayerNorm forward at 8192x16384 ran at 0.32 of copy so (the full table of
    ``norms.py``) and at 0.95 compiled alone (``results/norms_split_h200.json``).
    The cache is cleared, so each shape is compiled alone, for its static shape."""
    torch._dynamo.reset()
    return torch.compile(function, backend=backend, dynamic=False)


def copy_gbps(device) -> float:
    if device.type != "cuda":
        return float("nan")
    source = torch.empty(2**30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = time_rounds({"copy": lambda: target.copy_(source)}, device, 5, 10, settle=True)["copy"]
    return 2 * source.numel() / (ms * 1e6)


def benchmark_parser(doc: str, name: str, rounds: int = 7, iterations: int | None = 10,
                     sweep: bool = False) -> argparse.ArgumentParser:  # fmt: skip
    """The arguments the benchmark scripts share: ``--smoke``, ``--out`` (by default
    ``results/NAME.json``), ``--rounds``, unless ``iterations`` is None ``--iterations``
    (calls timed together in a round), and with ``sweep`` ``--sweep``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{name}.json"))
    parser.add_argument("--rounds", type=int, default=rounds)
    if iterations is not None:
        parser.add_argument("--iterations", type=int, default=iterations)
    if sweep:
        parser.add_argument(
            "--sweep",
            action="store_true",
            help="also time other launch configurations (providers ours[...])",
        )
    return parser


def commit_id() -> str:
    """The commit measured: ``BENCH_COMMIT`` (a GPU machine's copy has no git), else git's,
    with ``+modified`` where tracked files differ from it: a GPU machine's copy of a
    working tree may carry the git of an older checkout (its HEAD is not what ran)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        git = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"],
                             capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        head = git.stdout.strip()
        if not head:
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    except OSError:  # no git at all
        return "unknown"
    return f"{head}+modified" if status.stdout.strip() else head


def write_results(path: str, device, copy: float, rows: list[dict], world: int = 1) -> None:
    """The figures as ``benchmarks/results/*.json`` hold them: device, date, commit (or
    ``BENCH_COMMIT`` where the tree has no git), the exact command, copy bandwidth, rows;
    ``world``: the ranks torchrun ran, one GPU each."""
    name = torch.cuda.get_device_name(device)
    launcher = ["torchrun --nproc-per-node", str(world)] if world > 1 else ["python"]
    result = {
        "device": f"{world}x {name}" if world > 1 else name,
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "command": " ".join([*launcher, *sys.argv]),
        "torch": torch.__version__,
        "copy_gbps": copy,
        "rows": rows,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = benchmark_parser(__doc__, "kernels", iterations=40, sweep=True)
    parser.add_argument("--case", action="append", help="only these cases (repeatable)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    copy = copy_gbps(device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for case, (fd, eager, shapes, dtypes, nbytes) in cases(args.smoke):
        if args.case and case not in args.case:
            continue
        inputs = [make_input(s, d, device, generator) for s, d in zip(shapes, dtypes, strict=True)]
        executor = MultiDeviceExecutor(fd, kernels="generated", cuda_graph=device.type == "cuda")
        outputs = executor.run(inputs)
        expected = fd.execute(inputs)
        extent = max(s[0] for s in shapes) if "column_sum" in case else shapes[0][-1]
        for actual, wanted in zip(outputs, expected, strict=True):
            assert_close(actual, wanted, reduction_extent=extent)
        functions = {
            "ours": lambda e=executor, i=inputs: e.run(i),
            "eager": lambda f=eager, i=inputs: f(*i),
        }
        if case == "multi_column_sum":  # the outer reduction through TMA tiles, forced
            variant = MultiDeviceExecutor(fd, kernels="generated",
                                          cuda_graph=device.type == "cuda",
                                          kernel_params={"k0": "tma"})  # fmt: skip
            for actual, wanted in zip(variant.run(inputs), expected, strict=True):
                assert_close(actual, wanted, reduction_extent=extent)
            functions["ours_tma"] = lambda e=variant, i=inputs: e.run(i)
            print(f"  tma: {variant.kernel_report()}")
        if args.sweep:
            for label, overrides in alternatives(executor).items():
                variant = MultiDeviceExecutor(
                    fd, kernels="generated", cuda_graph=device.type == "cuda",
                    kernel_params=overrides,
                )  # fmt: skip
                for actual, wanted in zip(variant.run(inputs), expected, strict=True):
                    assert_close(actual, wanted, reduction_extent=extent)
                functions[f"ours[{label}]"] = lambda e=variant, i=inputs: e.run(i)
        if device.type == "cuda":  # a copy of the same bytes: what this size allows
            source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
            target = torch.empty_like(source)
            functions["copy"] = lambda s=source, t=target: t.copy_(s)
        if not args.smoke:
            compiled = compiled_alone(eager)
            functions["compile"] = lambda f=compiled, i=inputs: f(*i)
        times = time_rounds(functions, device, args.rounds, args.iterations, settle=True)
        shape = (
            list(shapes[0])
            if dtypes[0] != torch.float4_e2m1fn_x2
            else [shapes[0][0], 2 * shapes[0][1]]
        )
        for provider, ms in times.items():
            gbps = nbytes / (ms * 1e6)
            rows.append({
                "case": case, "shape": shape, "dtype": str(dtypes[0]).replace("torch.", ""),
                "bytes": nbytes, "provider": provider, "ms": ms, "gbps": gbps,
                "frac_copy": gbps / copy,
            })  # fmt: skip
            print(f"{case:<12} {str(shape):<16} {provider:<22} {ms:8.3f} ms {gbps:8.1f} GB/s "
                  f"{gbps / copy:6.2f} of copy", flush=True)  # fmt: skip
        print(f"  {executor.kernel_report()}", flush=True)
    print(f"device copy: {copy:.1f} GB/s")
    if not args.smoke:
        write_results(args.out, device, copy, rows)


if __name__ == "__main__":
    main()
