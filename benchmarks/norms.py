"""RMSNorm and LayerNorm, forward and backward: generated kernels against eager PyTorch
and torch.compile, as a fraction of a device-to-device copy.

    python benchmarks/norms.py            # on one GPU; figures to results/norms.json
    python benchmarks/norms.py --smoke    # tiny shapes on CPU (Triton's interpreter)
    python benchmarks/norms.py --op rmsnorm_bwd --shape 8192x16384 \
        --params block_rows=1,block_columns=16384,num_warps=16,persistent=1,programs=132
                                          # explicit params timed beside the others
    python benchmarks/norms.py --no-forced  # the default path (replayed, eager) and peers
    python benchmarks/norms.py --op layernorm_captured_bwd --op rmsnorm_captured_bwd \
        --shape 32768x1024                # a captured module's backward, bf16 and float32

The fusions are those of ``examples/norms.py``. Bytes = every input read once and every
output written once (x, dy, dx and y dominate; weights and saved statistics count too).
Ours runs through the executor, replayed from a CUDA graph, and is checked against the
reference evaluator first; ``ours_eager`` is the same executor run eagerly, its default
(short kernels then run at the pace of the host's 35-130 us a call). Eager:
``F.rms_norm`` and ``F.layer_norm`` forward, ``aten.native_layer_norm_backward`` and the
RMSNorm backward's formula in torch ops; compile: ``torch.compile`` of the same
functions, compiled afresh for each shape (``compiled_alone``). Median of interleaved
rounds (CUDA events), as ``benchmarks/kernels.py``.

The captured ops (``CAPTURED``, run only when named by ``--op``) time the backward
``fusion.autodiff`` writes of a captured ``nn.LayerNorm`` or ``nn.RMSNorm`` (one
normalization kernel that recomputes the statistics from x, the weight gradients cast
to the weight's dtype) against the hand-written backward of ``examples/norms.py`` (which
reads saved statistics, its weight gradients float32), in bf16 and float32, both checked
against torch autograd first. Bytes are the captured backward's: x, dy and the
parameters read, dx and the parameters' gradients written.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from copy import deepcopy
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from benchmarks.kernels import (  # noqa: E402
    benchmark_parser,
    compiled_alone,
    copy_gbps,
    write_results,
)
from benchmarks.timing import time_rounds  # noqa: E402
from examples.norms import BUILDERS, make_inputs  # noqa: E402
from fusion.autodiff import backward  # noqa: E402
from fusion.capture import capture  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import MultiDeviceExecutor  # noqa: E402
from schedulers.analysis import NotSchedulable  # noqa: E402
from schedulers.cache import KERNEL_CACHE  # noqa: E402
from schedulers.normalization import (  # noqa: E402
    COLUMN_WALK,
    MULTIWAVE,
    SPLIT,
    STRATEGIES,
    WARP_SPECIALIZED,
    NormalizationParams,
)
from schedulers.normalization.exchange import CLUSTER_SIZES  # noqa: E402
from schedulers.normalization.split import cluster_programs, sums_programs  # noqa: E402

SHAPES = [(32768, 1024), (32768, 4096), (16384, 8192), (8192, 16384), (4096, 65536)]
OPS = ["rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd"]
# a captured module's backward against the hand-written op of examples/norms.py
CAPTURED = {"layernorm_captured_bwd": "layernorm_bwd", "rmsnorm_captured_bwd": "rmsnorm_bwd"}
CAPTURED_DTYPES = (torch.bfloat16, torch.float32)


def eager_function(op: str, n: int):
    """PyTorch's way to compute what the fusion computes, on the same inputs."""
    if op == "rmsnorm_fwd":

        def rmsnorm_fwd(x, w):
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(dim=1) + 1e-6)
            if not x.is_cuda:  # torch 2.13's CPU rms_norm refuses bf16 here; smoke runs only
                return (xf * rstd[:, None] * w.float()).to(x.dtype), rstd
            return F.rms_norm(x, (n,), w, 1e-6), rstd

        return rmsnorm_fwd
    if op == "layernorm_fwd":
        return lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5)
    if op == "rmsnorm_bwd":

        def rmsnorm_bwd(x, dy, w, rstd):
            xf, dyf, r = x.float(), dy.float(), rstd[:, None]
            xhat, g = xf * r, dyf * w.float()
            dx = r * (g - xhat * (g * xhat).mean(dim=1, keepdim=True))
            return dx.to(x.dtype), (dyf * xhat).sum(dim=0)

        return rmsnorm_bwd
    if op == "layernorm_bwd":

        def layernorm_bwd(x, dy, w, mean, rstd):
            if not x.is_cuda:  # the CPU kernel wants statistics in x's dtype; smoke only
                mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
            return torch.ops.aten.native_layer_norm_backward(
                dy, x, [n], mean[:, None], rstd[:, None], w, None, [True, True, False]
            )[:2]

        return layernorm_bwd
    raise KeyError(op)


def norm_module(hand_op: str, inputs: list[torch.Tensor]) -> torch.nn.Module:
    """The module whose backward ``hand_op`` (``examples/norms.py``) computes, with the
    weight of its ``inputs`` (their eps; a LayerNorm's bias, which no gradient reads,
    small and random)."""
    x, weight = inputs[0], inputs[2]
    n = x.shape[-1]
    if hand_op == "layernorm_bwd":
        module = torch.nn.LayerNorm(n, eps=1e-5)
        bias = 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1))
        module.bias.data = bias.to(device=x.device, dtype=x.dtype)
    else:
        module = torch.nn.RMSNorm(n, eps=1e-6)
    module.weight.data = weight.clone()
    return module.to(device=x.device, dtype=x.dtype)


def autograd_gradients(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Torch autograd's gradients of ``module`` at ``x`` for ``dy``, in float32 from the
    same values (by name: its parameters' and ``"input"``)."""
    wide = deepcopy(module).float()
    leaf = x.float().requires_grad_()
    names = [name for name, _ in wide.named_parameters()]
    grads = torch.autograd.grad(wide(leaf), [*wide.parameters(), leaf], dy.float())
    return dict(zip([*names, "input"], grads, strict=True))


def check_gradients(label: str, found: dict, expected: dict, extent: int) -> None:
    """``found`` gradients (by name) against torch autograd's, each in its own dtype."""
    for name, value in found.items():
        assert_close(value, expected[name].to(value.dtype), reduction_extent=extent,
                     message=f"{label}: gradient of {name}")  # fmt: skip


def captured_rows(op: str, m: int, n: int, dtype: torch.dtype, device: torch.device,
                  args, copy_rate: float) -> list[dict]:  # fmt: skip
    """``op`` of ``CAPTURED`` at ``m`` x ``n`` in ``dtype``: the captured module's
    backward and the hand-written one, each checked against torch autograd, then timed
    with eager PyTorch's backward (and, on a GPU, ``torch.compile`` of it and a copy)."""
    hand_op = CAPTURED[op]
    generator = torch.Generator().manual_seed(0)
    hand_inputs = make_inputs(hand_op, m, n, dtype, device, generator)
    x, dy = hand_inputs[0], hand_inputs[1]
    module = norm_module(hand_op, hand_inputs)
    expected = autograd_gradients(module, x, dy)
    extent = max(m, n)
    captured = capture(module, [x])
    grads = backward(captured.fd.fusion)
    names = [*captured.parameter_names, "input"]
    ours = MultiDeviceExecutor(grads.fusion, kernels="generated", cuda_graph=not args.smoke)
    inputs = [*captured.inputs(module, x), dy]
    outputs = ours.run(inputs)
    found = {names[position]: value for position, value in zip(grads.wrt, outputs, strict=True)}
    check_gradients(f"{op} captured", found, expected, extent)
    nbytes = sum(t.numel() * t.element_size() for t in [*inputs, *outputs])
    hand = MultiDeviceExecutor(BUILDERS[hand_op](n, str(dtype).removeprefix("torch.")),
                               kernels="generated", cuda_graph=not args.smoke)  # fmt: skip
    written = dict(zip(["input", "weight", "bias"], hand.run(hand_inputs), strict=False))
    check_gradients(f"{op} hand-written", written, expected, extent)
    eager = eager_function(hand_op, n)
    functions = {
        "ours_captured": lambda: ours.run(inputs),
        "ours_hand": lambda: hand.run(hand_inputs),
        "eager": lambda: eager(*hand_inputs),
    }
    if not args.smoke:
        compiled = compiled_alone(eager)
        functions["compile"] = lambda: compiled(*hand_inputs)
        source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        functions["copy"] = lambda: target.copy_(source)
    times = time_rounds(functions, device, args.rounds, args.iterations, settle=True)
    rows = []
    name = str(dtype).removeprefix("torch.")
    for provider, ms in times.items():
        gbps = nbytes / (ms * 1e6)
        rows.append({"op": op, "M": m, "N": n, "dtype": name, "bytes": nbytes,
                     "provider": provider, "ms": ms, "gbps": gbps,
                     "frac_copy": gbps / copy_rate})  # fmt: skip
        print(f"{op:<22} {m:>6}x{n:<6} {name:<8} {provider:<14} {ms:8.3f} ms "
              f"{gbps:8.1f} GB/s {gbps / copy_rate:6.2f} of copy", flush=True)  # fmt: skip
    for label, executor in (("captured", ours), ("hand", hand)):
        print(f"  {label}: " + executor.kernel_report().replace("\n", "\n  "), flush=True)
    return rows


def alternatives(executor: MultiDeviceExecutor, sm_count: int) -> dict[str, dict]:
    """Other launch configurations of the normalization kernel to time beside the
    heuristics' choice (``--sweep``): a label -> ``kernel_params``."""
    params = executor.chosen_params.get("k0")
    if not isinstance(params, NormalizationParams):
        return {}
    variants = {}
    if params.strategy == COLUMN_WALK:  # its strips, their programs, the rows' steps
        for strip in (params.strip_columns // 2, params.strip_columns * 2):
            if strip >= 256:
                variants[f"column,strip={strip}"] = replace(params, strip_columns=strip)
        for warps in (params.strip_warps // 2, params.strip_warps * 2):
            if 1 <= warps <= 16:
                variants[f"column,strip warps={warps}"] = replace(params, strip_warps=warps)
        for programs in (params.programs // 2, params.programs * 2):
            variants[f"column,programs={programs}"] = replace(params, programs=programs)
        for stages in (1, 2, 4):
            if stages != params.stages:
                variants[f"column,stages={stages}"] = replace(params, stages=stages)
        if params.num_warps >= 8:
            warps = params.num_warps // 2
            variants[f"column,row warps={warps}"] = replace(params, num_warps=warps)
        return {label: {"k0": replace(p, why="")} for label, p in variants.items()}
    if params.strategy == SPLIT:  # more or fewer programs a row, warps, rows, prefetch
        for parts in (params.parts // 2, params.parts * 2):
            if parts >= 2:
                width = params.block_columns * params.parts // parts
                variants[f"split,parts={parts}"] = replace(
                    params,
                    parts=parts,
                    block_columns=width,
                    num_warps=max(1, min(16, params.num_warps * params.parts // parts)),
                    cluster=params.cluster and parts in CLUSTER_SIZES,
                )
        for warps in (params.num_warps // 2, params.num_warps * 2):
            if 1 <= warps <= 16:
                variants[f"split,warps={warps}"] = replace(params, num_warps=warps)
        variants["split,rows=2"] = replace(params, block_rows=2)
        variants["split,rows=4"] = replace(params, block_rows=4)
        if params.prefetch:
            variants["split,no prefetch"] = replace(params, prefetch=False)
        if params.tma:  # the register prefetch it replaces; fewer and more stages
            variants["split,prefetched"] = replace(params, tma=False, stages=1, prefetch=True)
            for stages in (2, 4):
                variants[f"split,stages={stages}"] = replace(params, stages=stages)
        if params.one_pass:  # each slice's variance in two reductions
            variants["split,two passes"] = replace(params, one_pass=False)
        if params.cluster:  # the exchange through global memory; half and twice the grid
            # (with column sums, the grid the heuristics take for that exchange)
            programs = (sums_programs(params.parts, params.num_warps, sm_count) if params.rewiden
                        else 0)  # fmt: skip
            variants["split,global exchange"] = replace(params, cluster=False, programs=programs)
            for programs in (params.programs // 2, params.programs * 2) if params.programs else ():
                variants[f"split,programs={programs}"] = replace(params, programs=programs)
        elif params.parts in CLUSTER_SIZES:  # a cluster a row, as the heuristics take it
            # (with column sums as many as the device holds, counted at the launch; without,
            # one partial's grid)
            programs = 0 if params.rewiden else cluster_programs(params.parts, sm_count)
            variants["split,cluster"] = replace(params, cluster=True, programs=programs)
        return {label: {"k0": replace(p, why="")} for label, p in variants.items()}
    if params.strategy == WARP_SPECIALIZED:  # its parameter loop's neighbours
        for stages in (2, 3, 4):
            if stages != params.stages:
                variants[f"ws,stages={stages}"] = replace(params, stages=stages)
        for rows in (params.block_rows // 2, params.block_rows * 2):
            if 1 <= rows and rows * params.block_columns * params.stages <= 65536:
                variants[f"ws,rows={rows}"] = replace(params, block_rows=rows)
        variants[f"ws,programs={params.programs * 2}"] = replace(
            params, programs=params.programs * 2
        )
        for fewer in (2, 4, 8):  # fewer programs: fewer partial rows to write and add
            if params.programs // fewer >= 16:
                programs = params.programs // fewer
                variants[f"ws,programs={programs}"] = replace(params, programs=programs)
        if params.num_warps > 4:  # two programs an SM, each with fewer consumer warps
            variants[f"ws,programs={params.programs * 2},warps={params.num_warps // 2}"] = replace(
                params, programs=params.programs * 2, num_warps=params.num_warps // 2
            )
        if params.num_warps < 16:  # more consumer warps over the same tile
            warps = params.num_warps * 2
            variants[f"ws,warps={warps}"] = replace(params, num_warps=warps)
        if params.block_rows > 1:  # half the tile, two programs an SM where registers allow
            rows, programs = params.block_rows // 2, params.programs * 2
            variants[f"ws,rows={rows},programs={programs}"] = replace(
                params, block_rows=rows, programs=programs
            )
        if params.column_registers:
            variants["ws,weights in walk"] = replace(params, column_registers=False)
    elif params.persistent:
        programs = params.programs or 2 * sm_count
        for stages in (2, 3):
            if stages != params.stages:
                variants[f"stages={stages}"] = replace(params, programs=programs, stages=stages)
        if not params.programs:
            variants[f"programs={programs}"] = replace(params, programs=programs)
        for fewer in (2, 4):  # fewer programs: fewer partial rows to write and add
            if programs // fewer >= 16:
                variants[f"programs={programs // fewer}"] = replace(
                    params, programs=programs // fewer
                )
        if params.block_rows * params.block_columns * 2 <= 65536:
            variants["rows*2"] = replace(params, block_rows=params.block_rows * 2)
    multiwave = params.strategy != WARP_SPECIALIZED
    if multiwave and params.persistent and params.programs and params.stages != 1:
        variants["stages=1"] = replace(params, stages=1)
    for rows in (4, 8):  # a warp per row: reductions without shared memory
        if (multiwave and params.persistent and rows * params.block_columns <= 16384
                and rows != params.block_rows):  # fmt: skip
            variants[f"rows={rows},warps={rows}"] = replace(params, block_rows=rows, num_warps=rows)
    if not params.persistent:  # chunked: how many rows in flight, how long a step
        for programs in (sm_count, 2 * sm_count, 4 * sm_count):
            if programs != params.programs:
                variants[f"programs={programs}"] = replace(params, programs=programs)
        for step in (params.block_columns // 2, params.block_columns * 2):
            if 1024 <= step <= 16384:
                variants[f"step={step}"] = replace(params, block_columns=step)
    prefix, fewest = ("", 1) if multiwave else ("ws,", 4)  # consumer warp groups: 4 warps
    if "column sums kept by row" in params.why:  # added across the block's rows every
        # step, as before #20
        variants[f"{prefix}sums a step"] = replace(params, tile_sums=False)
    for warps in (params.num_warps // 2, params.num_warps * 2):
        if fewest <= warps <= 16:
            variants[f"{prefix}warps={warps}"] = replace(params, num_warps=warps)
    return {label: {"k0": replace(p, why="")} for label, p in variants.items()}


# the fields 0 or 1 in --params: NormalizationParams' booleans
FLAGS = tuple(f.name for f in dataclasses.fields(NormalizationParams) if f.type == "bool")


def parse_params(text: str) -> NormalizationParams:
    """``NormalizationParams`` from ``field=value,...`` (``--params``): integers, 0 or 1
    for the flags, ``strategy`` by name; anything else ends the run saying why."""
    fields = [f.name for f in dataclasses.fields(NormalizationParams) if f.name != "why"]
    values: dict = {}

    def refuse(why: str) -> SystemExit:
        return SystemExit(f"--params {text!r}: {why}")

    for item in text.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in fields or not value:
            raise refuse(f"{key!r} is not a NormalizationParams field=value (fields: "
                         f"{', '.join(fields)})")  # fmt: skip
        if key in values:
            raise refuse(f"{key} given twice")
        if key == "strategy":
            if value not in STRATEGIES:
                raise refuse(f"strategy {value!r} is not one of {', '.join(STRATEGIES)}")
            values[key] = value
        elif key in FLAGS:
            if value not in ("0", "1"):
                raise refuse(f"{key}={value}: a flag is 0 or 1")
            values[key] = value == "1"
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise refuse(f"{key}={value}: not an integer") from None
    try:
        return NormalizationParams(**values)
    except TypeError as error:  # a required field left out
        raise refuse(str(error)) from None


def print_resources() -> None:
    """Registers, spills and shared memory of every normalization kernel compiled."""
    for source in KERNEL_CACHE.sources():
        if "def normalization_kernel" not in source:
            continue
        kernel = KERNEL_CACHE.get(source, "normalization_kernel")
        comment = next(line for line in source.splitlines() if line.startswith("# normalization"))
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                try:
                    compiled._init_handles()  # registers and spills are read when it loads
                except OutOfResources as error:  # a sweep variant the device refused
                    print(f"{comment[2:]}: not loaded ({error})")
                    continue
                constants = ", ".join(
                    f"{kernel.arg_names[path[0]]}={value}"
                    for path, value in compiled.src.constants.items()
                    if isinstance(value, int) and kernel.arg_names[path[0]].isupper()
                )
                print(f"{comment[2:]} [{constants}] warps={compiled.metadata.num_warps}: "
                      f"{compiled.n_regs} registers, {compiled.n_spills} spilled, "
                      f"{compiled.metadata.shared} bytes shared")  # fmt: skip


def main() -> None:
    parser = benchmark_parser(__doc__, "norms", iterations=20, sweep=True)
    parser.add_argument("--op", action="append", help="only these ops (repeatable)")
    parser.add_argument("--hidden", type=int, action="append", help="only these N (repeatable)")
    parser.add_argument("--shape", action="append", help="MxN instead of the issue's shapes")
    parser.add_argument("--no-forced", action="store_true",
                        help="no strategy forced: the automatic choice (replayed and eager) "
                        "against the peers alone")  # fmt: skip
    parser.add_argument("--params", action="append", default=[],
                        help="field=value,... of NormalizationParams, timed beside the "
                        "others as ours[params:...] (repeatable)")  # fmt: skip
    args = parser.parse_args()
    explicit = {f"params:{text}": {"k0": parse_params(text)} for text in args.params}
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = [(5, 96), (3, 1000)] if args.smoke else SHAPES
    if args.shape:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shape]
    copy = copy_gbps(device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for op in CAPTURED:
        if op in (args.op or []):
            for m, n in shapes:
                for dtype in CAPTURED_DTYPES:
                    rows += captured_rows(op, m, n, dtype, device, args, copy)
    for op in OPS:
        if args.op and op not in args.op:
            continue
        for m, n in shapes:
            if args.hidden and n not in args.hidden:
                continue
            fd = BUILDERS[op](n, "bfloat16")
            inputs = make_inputs(op, m, n, torch.bfloat16, device, generator)
            executor = MultiDeviceExecutor(fd, kernels="generated", cuda_graph=not args.smoke)
            outputs = executor.run(inputs)
            for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
                assert_close(actual, expected, reduction_extent=max(m, n))
            nbytes = sum(t.numel() * t.element_size() for t in [*inputs, *outputs])
            eager = eager_function(op, n)
            functions = {
                "ours_auto": lambda e=executor, i=inputs: e.run(i),
                "eager": lambda f=eager, i=inputs: f(*i),
            }
            forced = {}  # each strategy forced, no fallback
            for provider, strategy in () if args.no_forced else (
                ("ours_ws", WARP_SPECIALIZED),
                ("ours_multiwave", MULTIWAVE),
                ("ours_split", SPLIT),
                ("ours_column", COLUMN_WALK),
            ):  # fmt: skip
                variant = MultiDeviceExecutor(fd, kernels="generated", cuda_graph=not args.smoke,
                                              kernel_params={"k0": strategy})  # fmt: skip
                try:
                    results = variant.run(inputs)
                except (NotSchedulable, OutOfResources) as error:  # refused, or no room
                    print(f"{op:<14} {m:>6}x{n:<6} {provider} skipped: {error}")
                    continue
                for actual, expected in zip(results, fd.execute(inputs), strict=True):
                    assert_close(actual, expected, reduction_extent=max(m, n))
                functions[provider] = lambda e=variant, i=inputs: e.run(i)
                forced[provider] = variant
            swept = dict(explicit)
            if args.sweep:
                sm_count = torch.cuda.get_device_properties(device).multi_processor_count if (
                    device.type == "cuda") else 1  # fmt: skip
                for source in (executor, *forced.values()):
                    if args.smoke and source is forced.get("ours_split"):
                        continue  # its neighbours: 0.1-0.5 s a call in the interpreter
                    for label, overrides in alternatives(source, sm_count).items():
                        swept.setdefault(label, overrides)
            for label, overrides in swept.items():
                variant = MultiDeviceExecutor(fd, kernels="generated", cuda_graph=not args.smoke,
                                              kernel_params=overrides)  # fmt: skip
                try:
                    results = variant.run(inputs)
                # a hand-made variant the device or Triton's passes refuse; explicit
                # params (--params) also those the shape refuses
                except (OutOfResources, CompilationError, RuntimeError, ValueError) as error:
                    if isinstance(error, ValueError) and label not in explicit:
                        raise
                    print(f"{op:<14} {m:>6}x{n:<6} ours[{label}] skipped: {error}")
                    continue
                for actual, expected in zip(results, fd.execute(inputs), strict=True):
                    assert_close(actual, expected, reduction_extent=max(m, n))
                functions[f"ours[{label}]"] = lambda e=variant, i=inputs: e.run(i)
            if not args.smoke:  # the executor's default: eager launches, no graph
                default = MultiDeviceExecutor(fd, kernels="generated")
                for actual, expected in zip(default.run(inputs), fd.execute(inputs), strict=True):
                    assert_close(actual, expected, reduction_extent=max(m, n))
                functions["ours_eager"] = lambda e=default, i=inputs: e.run(i)
                compiled = compiled_alone(eager)
                functions["compile"] = lambda f=compiled, i=inputs: f(*i)
                source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
                target = torch.empty_like(source)
                functions["copy"] = lambda s=source, t=target: t.copy_(s)
            times = time_rounds(functions, device, args.rounds, args.iterations, settle=True)
            for provider, ms in times.items():
                gbps = nbytes / (ms * 1e6)
                rows.append({"op": op, "M": m, "N": n, "dtype": "bfloat16", "bytes": nbytes,
                             "provider": provider, "ms": ms, "gbps": gbps,
                             "frac_copy": gbps / copy})  # fmt: skip
                print(f"{op:<14} {m:>6}x{n:<6} {provider:<16} {ms:8.3f} ms {gbps:8.1f} GB/s "
                      f"{gbps / copy:6.2f} of copy", flush=True)  # fmt: skip
            for label, source in (("auto", executor), *forced.items()):
                print(f"  {label}: " + source.kernel_report().replace("\n", "\n  "), flush=True)
    print(f"device copy: {copy:.1f} GB/s")
    if not args.smoke:
        write_results(args.out, device, copy, rows)
        print_resources()


if __name__ == "__main__":
    main()
