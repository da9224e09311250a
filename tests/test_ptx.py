"""The benchmark kernels compiled for sm_90 on CPU: aligned forms use wide accesses.

Triton's interpreter says nothing about vectorization, so these tests compile the
generated kernels for Hopper with the real Triton compiler (no GPU needed) in a
process without ``TRITON_INTERPRET`` and read the widths of their global loads and
stores from the PTX. A change that makes the memory-bound kernels fall back to
per-element accesses fails here, before any GPU run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def widths() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_ptx.py"), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert rows, result.stdout[-2000:]
    return rows


def _bits(row: dict, kind: str) -> set[int]:
    return {int(bits) for bits in row[kind]}


def _rows(widths: list[dict], case: str, kernel: str, aligned: bool = True) -> list[dict]:
    found = [
        r for r in widths if r["case"] == case and r["kernel"] == kernel and r["aligned"] == aligned
    ]
    assert found, f"no {kernel} for {case}"
    return found


def test_every_benchmark_kernel_is_compiled_in_both_forms(widths):
    cases = {r["case"] for r in widths}
    assert cases == {"pointwise", "row_sum", "column_sum", "multi_column_sum", "fp32_to_fp4",
                     "fp4_to_bf16"}  # fmt: skip
    for case in cases:
        forms = {r["aligned"] for r in widths if r["case"] == case}
        assert forms == {False, True}


@pytest.mark.parametrize(
    ("case", "kernel", "loads", "stores"),
    [
        ("pointwise", "pointwise_kernel", {128}, {128}),
        ("row_sum", "reduction_kernel", {128}, None),
        ("column_sum", "reduction_kernel", {128}, None),
        ("column_sum", "combine_kernel", {128}, None),  # a tile of parts per step
        ("multi_column_sum", "reduction_kernel", {128}, None),
        ("fp32_to_fp4", "pointwise_kernel", {128}, {64}),  # 16 values per thread: 8 bytes
        ("fp4_to_bf16", "pointwise_kernel", {64}, {128}),  # 32 values per thread: 16 bytes
    ],
)
def test_aligned_kernels_move_data_in_wide_accesses(widths, case, kernel, loads, stores):
    for row in _rows(widths, case, kernel):
        assert _bits(row, "loads") == loads, row
        if stores is not None:
            assert _bits(row, "stores") == stores, row


def test_broadcast_inputs_are_read_once_per_tile_column(widths):
    """x * scale[None, :] + bias[None, :] over 4x1024 tiles and 128 threads: four 128-bit
    loads of x a thread (32 bf16) and one each of scale and bias (1024 bf16 over 128
    threads); a tile-shaped load of a broadcast input would be four for each."""
    for row in _rows(widths, "pointwise", "pointwise_kernel"):
        assert {int(bits): n for bits, n in row["loads"].items()} == {128: 6}, row


def test_the_general_form_is_the_narrow_one(widths):
    """What the aligned form buys: without the facts, Triton can prove no alignment."""
    for row in _rows(widths, "pointwise", "pointwise_kernel", aligned=False):
        assert _bits(row, "loads") == {16} and _bits(row, "stores") == {16}, row


@pytest.mark.parametrize(("case", "most"), [("pointwise", 20), ("fp4_to_bf16", 16)])
def test_pointwise_kernels_stay_within_an_instruction_budget(widths, case, most):
    """At H200's copy bandwidth a bf16 element leaves roughly 30 instructions per thread
    of issue time; bit-exact bf16 rounding in integer ops or a slow fp4 decoder spent
    more than that (41 and 23 instructions an element before they were replaced)."""
    for row in _rows(widths, case, "pointwise_kernel"):
        assert row["instructions"] / row["elements_per_thread"] <= most, row


def test_no_multiply_add_is_contracted(widths):
    """The reference rounds x * s before adding b; an fma would not (COMPILE_OPTIONS)."""
    for row in _rows(widths, "pointwise", "pointwise_kernel"):
        assert row["fused_multiply_adds"] == 0, row


def test_the_fp4_decoder_keeps_subnormals(widths):
    """fp4_decode scales a float32 subnormal (0.5 is 2**-127 * 2**126): no .ftz."""
    for row in _rows(widths, "fp4_to_bf16", "pointwise_kernel"):
        assert row["flush_to_zero"] == 0, row


def test_outer_reductions_pipeline_their_loads(widths):
    """Two stages on Hopper: the next tile's loads are asynchronous copies issued before
    this tile is summed (1 stage measured 0.78-0.86 of copy, 2 stages 0.82-0.89)."""
    for row in _rows(widths, "column_sum", "reduction_kernel"):
        assert row["async_copies"] > 0, row
    for row in _rows(widths, "row_sum", "reduction_kernel"):
        assert row["async_copies"] == 0, row  # one step a row: nothing to overlap


def test_a_weight_of_an_outer_reduction_is_read_once_before_its_loop(widths):
    """sum(x1 * ... * xk * w[None, :], 0) (k = 1, 2, 3, 5) over 64x64 bf16 tiles and 128
    threads: each x takes eight 128-bit loads a thread (four a tile, in the two-stage
    pipeline's loop and its prologue), w one, before the loop (a tile of w in the loop
    would be eight more)."""
    counts = set()
    for row in _rows(widths, "multi_column_sum", "reduction_kernel"):
        (bits,) = row["loads"]
        count = row["loads"][bits]
        assert int(bits) == 128 and count % 8 == 1, row
        counts.add(count)
    assert counts == {8 * k + 1 for k in (1, 2, 3, 5)}, counts


_SPLIT_EXCHANGE = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from examples.norms import BUILDERS
from schedulers.hardware import H200
from schedulers.normalization.heuristics import SPLIT
from schedulers.ptx import compiled
from schedulers.registry import split_into_kernels
name, n = sys.argv[3], int(sys.argv[4])
fd = BUILDERS[name](n, "bfloat16")
group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
params = group.scheduler.heuristics(group.plan, H200, [8192, n], SPLIT)
params = dataclasses.replace(params, **json.loads(sys.argv[2]))
(kernel, *_) = group.scheduler.kernels(group.plan, params, [8192, n], True)
ptx = compiled(kernel.source, kernel.name, kernel.pointers, kernel.constants,
               kernel.num_warps)["ptx"]
print(json.dumps({"parts": params.parts, "polls": ptx.count("ld.relaxed.gpu.global.b64"),
                  "posts": ptx.count("atom.relaxed.gpu.global.exch.b64"),
                  "stores": ptx.count("st.relaxed.gpu.global.b64"),
                  "shuffles": ptx.count("shfl.sync.idx.b32"),
                  "votes": ptx.count("vote.sync.all"),
                  "cluster_stores": ptx.count("st.relaxed.cluster.shared::cluster.b64"),
                  "cluster_polls": ptx.count("ld.relaxed.cluster.shared::cta.b64"),
                  "barriers": ptx.count("barrier.cluster.arrive"),
                  "declared": ptx.count(".shared .align 1024 .b8 xwords[1024]")}))
"""


def _split_exchange(overrides: dict, name: str = "layernorm_bwd", n: int = 16384) -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SPLIT_EXCHANGE, str(ROOT),
                             json.dumps(overrides), name, str(n)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_split_rows_exchange_compiles_to_one_spin_and_one_post_a_row():
    """LayerNorm backward's split kernel for sm_90 exchanging through global memory (the
    H100's; the H200's is a cluster, below): its two partials posted by one atomic each,
    one spin (one load a lane, a vote), the words shuffled to every lane. A wait with
    side effects and no dependency on the post was copied by Triton into every layout
    its users wanted, each copy kept (7 spins a row); the exchange before gathered the
    words across warps through shared memory."""
    found = _split_exchange({"cluster": False})
    assert found["polls"] == 1 and found["posts"] == 2 and found["votes"] == 1, found
    assert found["shuffles"] == found["parts"] * 2 and found["stores"] == 0, found


@pytest.mark.parametrize(
    ("overrides", "polls"),
    [
        # 64 words (32 programs of 2 partials): every lane polls every word
        ({"parts": 32, "block_columns": 512, "num_warps": 2, "cluster": False}, 64),
        # two rows a block: every thread holding a row stores and polls its words
        (
            {"block_rows": 2, "block_columns": 4096, "parts": 4, "num_warps": 8, "cluster": False},
            8,
        ),  # fmt: skip
    ],
)
def test_a_split_rows_exchange_falls_back_to_polling_every_word(overrides, polls):
    """The other forms of the exchange's PTX, accepted by ptxas: no vote, no shuffle."""
    found = _split_exchange(overrides)
    assert found["votes"] == 0 and found["shuffles"] == 0, found
    assert found["polls"] % polls == 0 and found["polls"] > 0, found
    if overrides.get("block_rows", 1) == 1:
        assert found["posts"] == 2 and found["stores"] == 0, found
    else:
        assert found["stores"] > 0 and found["posts"] == 0, found


@pytest.mark.parametrize(
    ("name", "n", "rows"),
    [("softmax_bwd", 48, 1), ("rmsnorm_fwd", 65535, 1), ("layernorm_bwd", 16384, 2)],
)
def test_a_clusters_exchange_assembles_for_sm_90(name, n, rows):
    """A split row's programs as a cluster (forced), accepted by ptxas: the exchange
    words declared once by the kernel (its own shared memory: a one-warp kernel whose
    compiler took none has no other to name, and ptxas refused one named so), stores
    into the others' words and polls of its own, no word in global memory; the barrier
    once before the walk and once after it."""
    found = _split_exchange({"cluster": True, "programs": 64, "block_rows": rows}, name, n)
    assert found["declared"] == 1 and found["barriers"] == 2, found
    assert found["cluster_stores"] > 0 and found["cluster_polls"] > 0, found
    assert found["polls"] == found["posts"] == found["stores"] == 0, found


@pytest.mark.parametrize(("name", "n", "parts"), [("layernorm_bwd", 24576, 6),
                                                 ("rmsnorm_bwd", 28672, 7)])  # fmt: skip
def test_the_h200_s_split_backward_in_a_cluster_of_six_or_seven_assembles(name, n, parts):
    """The H200's own choice at these widths (no override): a cluster of six or seven
    programs a row with column sums, accepted by ptxas, its exchange in shared memory."""
    found = _split_exchange({}, name, n)
    assert found["parts"] == parts and found["declared"] == 1, found
    assert found["cluster_stores"] > 0 and found["cluster_polls"] > 0, found
    assert found["polls"] == found["posts"] == found["stores"] == 0, found


_COLUMN_WALK = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from examples.norms import BUILDERS
from schedulers.hardware import H200
from schedulers.ptx import kernel_widths
from schedulers.registry import split_into_kernels
fd = BUILDERS["layernorm_bwd"](135168, "bfloat16")
group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
params = group.scheduler.heuristics(group.plan, H200, [1024, 135168])
for form in (params, dataclasses.replace(params, parts=1)):  # in parts, and in one
    print(json.dumps({"strategy": form.strategy, "parts": form.parts, **kernel_widths(
        group.scheduler, group.plan, form, [1024, 135168], True)}))
"""


def test_a_column_walks_kernels_pipeline_wide_accesses():
    """LayerNorm backward at 135168 columns on the H200 (the column walk), both forms (a
    row in parts where rows are few, in one where they fill the device, as at 1024 rows):
    the rows' kernel reads x and dy in 128-bit pipelined loads and stores only its row
    values (32 bits); the strips' kernel reads and writes 128 bits a thread, pipelined
    too, and stores its two column sums' partial rows in 128-bit stores as well."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COLUMN_WALK, str(ROOT)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    forms = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(form["strategy"], form["parts"]) for form in forms] == [
        ("column_walk", 17), ("column_walk", 1)], forms  # fmt: skip
    for found in forms:
        rows, strips = found["normalization_kernel"], found["column_kernel"]
        assert "128" in rows["loads"] and rows["async_copies"] > 0, rows
        assert set(rows["stores"]) == {"32"}, rows  # the stash: a float32 a row value
        assert set(strips["stores"]) == {"128"} and "128" in strips["loads"], strips
        assert strips["async_copies"] > 0, strips


_SPLIT_REGISTERS = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from examples.norms import BUILDERS
from schedulers.hardware import H200
from schedulers.normalization.heuristics import tma_inputs
from schedulers.ptx import compiled, registers
from schedulers.registry import split_into_kernels
for name, columns, rows, fields in json.loads(sys.argv[2]):
    fd = BUILDERS[name](columns, "bfloat16")
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    params = group.scheduler.heuristics(group.plan, H200, [rows, columns])
    chosen = dataclasses.replace(params, **fields)
    (kernel, *_) = group.scheduler.kernels(group.plan, chosen, [rows, columns], True)
    tiles = {f"in{group.plan.inputs.index(t)}" for t in tma_inputs(group.plan, chosen)}
    descriptors = {a: f"tensordesc<bf16[1, {chosen.block_columns}]>" for a in tiles}
    print(json.dumps({"name": name, "fields": fields, "strategy": params.strategy,
                      "rewiden": params.rewiden, "column_bits": params.column_bits,
                      "cluster": chosen.cluster, "one_pass": chosen.one_pass,
                      "options": kernel.options,
                      "warps": chosen.num_warps, "parts": chosen.parts, "tma": chosen.tma,
                      "registers": registers(compiled(kernel.source, kernel.name,
                          kernel.pointers, kernel.constants, kernel.num_warps,
                          descriptors=descriptors, integers="i32",
                          options=kernel.options)["cubin"])}))
"""


def _split_registers(cases: list) -> list[dict]:
    """``_SPLIT_REGISTERS`` over ``cases`` ((op, columns, rows, fields replacing the
    H200's params) each): the split kernels compiled for sm_90 with their compile options
    (LayerNorm's contracted, as the H200 takes them), their registers a thread."""
    return _compiled_rows(_SPLIT_REGISTERS, json.dumps(cases))


def test_a_split_row_that_widens_its_inputs_again_takes_fewer_registers():
    """The backwards' split kernels at 16384 columns in 4 programs a row of 4096 columns
    over 4 warps (RMSNorm's choice; LayerNorm's is 8 of 2048 over 2) for sm_90, not held
    to a register count: their bf16 inputs' bits kept across the exchange and widened
    again after it (as chosen), three programs an SM fit the registers
    (``SPLIT_SUMS_WARPS_PER_SM``; RMSNorm 128 a thread, LayerNorm 168 with Triton 3.6),
    where keeping the float32s (200, 254) fits two."""
    from schedulers.normalization.split import SPLIT_SUMS_WARPS_PER_SM

    shape = {"parts": 4, "block_columns": 4096, "num_warps": 4, "max_registers": 0}
    found = _split_registers([[name, 16384, 8192, {**shape, "rewiden": rewiden}]
                              for name in ("rmsnorm_bwd", "layernorm_bwd")
                              for rewiden in (True, False)])  # fmt: skip
    assert len(found) == 4, found
    for row in found:
        assert row["rewiden"] and row["strategy"] == "split" and row["warps"] == 4, row
        fit = 65536 // (row["registers"] * 32 * row["warps"])  # an SM's 64 Ki registers
        widened = row["fields"]["rewiden"]
        assert fit >= SPLIT_SUMS_WARPS_PER_SM // 4 if widened else fit <= 2, row


def test_a_split_row_that_keeps_its_weights_as_bits_takes_fewer_registers():
    """LayerNorm forward split on the H200 (4096x65536: 8 programs a row of 8192 columns
    over 4 warps, through TMA, a cluster, each slice's variance in one pass, contracted:
    compiled with ``enable_fp_fusion``) for sm_90: its bf16 weight and bias kept as their
    bits and widened where used after the exchange (as chosen), three programs an SM fit
    the registers (168 a thread with Triton 3.6, as through global memory in two passes
    uncontracted); their float32s kept (254), two. A widening the compiler may hoist out
    of the walk (a pure one) gives the float32s back."""
    found = _split_registers([["layernorm_fwd", 65536, 4096, {"column_bits": bits}]
                              for bits in (True, False)])  # fmt: skip
    assert len(found) == 2, found
    for row in found:
        assert row["column_bits"] and row["strategy"] == "split" and row["tma"], row
        assert (row["warps"], row["parts"]) == (4, 8) and row["cluster"], row
        assert row["one_pass"] and row["options"].get("enable_fp_fusion"), row
        fit = 65536 // (row["registers"] * 32 * row["warps"])  # an SM's 64 Ki registers
        assert fit >= 3 if row["fields"]["column_bits"] else fit <= 2, row


_CONTRACT = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from examples.norms import BUILDERS
from schedulers import ptx
from schedulers.hardware import H200
from schedulers.registry import split_into_kernels
passed = {}  # what kernel_widths asks the compiler for, by kernel
plain = ptx.compiled
def compiled(source, name, *args, options=None, **kwargs):
    passed[name] = bool((options or {}).get("enable_fp_fusion"))
    return plain(source, name, *args, options=options, **kwargs)
ptx.compiled = compiled
fd = BUILDERS["layernorm_bwd"](65536, "bfloat16")
group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
params = group.scheduler.heuristics(group.plan, H200, [4096, 65536])
for contract in (True, False):
    chosen = dataclasses.replace(params, contract=contract)
    for name, row in ptx.kernel_widths(group.scheduler, group.plan, chosen, [4096, 65536],
                                       True).items():
        print(json.dumps({"chosen": params.contract, "contract": contract, "name": name,
                          "fmas": row["fused_multiply_adds"], "passed": passed[name]}))
"""


def test_a_split_layernorm_backward_on_the_h200_is_compiled_with_fmas():
    """Its params say ``contract`` (H200: 0.80 of copy against 0.78 at 4096x65536): the
    split kernel is compiled with contraction and its PTX holds fused multiply-adds,
    none without it; the combining kernel is compiled without it either way (it keeps
    ``COMPILE_OPTIONS``; it has no multiply and add to fuse, so its PTX alone could not
    tell)."""
    found = _compiled_rows(_CONTRACT)
    assert {(row["name"], row["contract"]) for row in found} == {
        ("normalization_kernel", True), ("normalization_kernel", False),
        ("combine_kernel", True), ("combine_kernel", False)}, found  # fmt: skip
    for row in found:
        assert row["chosen"], row
        fused = row["contract"] and row["name"] == "normalization_kernel"
        assert row["passed"] == fused, row
        assert row["fmas"] > 0 if fused else row["fmas"] == 0, row


def _compiled_rows(script: str, *arguments: str) -> list[dict]:
    """The JSON lines ``script`` prints, run (compiling for sm_90) in a process without
    ``TRITON_INTERPRET``, the repository's root its first argument, ``arguments`` after."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script, str(ROOT), *arguments], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


_COMBINE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from examples.norms import BUILDERS
from schedulers.hardware import H200
from schedulers.ptx import compiled
from schedulers.registry import split_into_kernels
fd = BUILDERS["layernorm_bwd"](1024, "bfloat16")
group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
params = group.scheduler.heuristics(group.plan, H200, [32768, 1024])
kernel = [k for k in group.scheduler.kernels(group.plan, params, [32768, 1024])
          if k.name == "combine_kernel"][0]
for dependent in (False, True):  # as listed (an ordinary launch), and as sm_90 launches it
    constants = {**kernel.constants, "DEPENDENT": dependent}
    ptx = compiled(kernel.source, kernel.name, kernel.pointers, constants, kernel.num_warps)["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    print(json.dumps({"dependent": constants["DEPENDENT"],
                      "waits": ptx.count("griddepcontrol.wait"),
                      "before_loads": 0 <= wait < ptx.find("ld.global")}))
"""


def test_the_combining_kernel_waits_for_the_kernel_before_it_only_when_dependent():
    """LayerNorm backward's combining kernel for sm_90, as sm_90 launches it (a
    programmatic dependent of the normalization kernel, ``DEPENDENT``): it waits once
    (``griddepcontrol.wait``), before its first load of the partial rows; as listed (an
    ordinary launch, as before sm_90), it does not wait at all."""
    found = _compiled_rows(_COMBINE)
    assert found == [{"dependent": False, "waits": 0, "before_loads": False},
                     {"dependent": True, "waits": 1, "before_loads": True}], found  # fmt: skip


def test_the_widening_kept_in_place_gives_a_bfloat16_s_float32_bits():
    """``widen_bf16_here``'s assembly (what a GPU runs; the interpreter runs
    ``widen_bf16``), its instructions run one by one on every 16-bit pattern: the bits
    in the upper half of the float32, zeros below (``mov.b32 d, {lo, hi}``), as torch
    widens a bfloat16."""
    import inspect

    import numpy as np
    import torch

    from schedulers import triton_math

    module = inspect.getsource(triton_math)
    text = module[module.index("def widen_bf16_here(") :].split("\n@triton.jit")[0]
    (asm,) = re.findall(r'"\{(.*?)\}", "=r,h"', text)
    patterns = np.arange(1 << 16, dtype=np.uint32)
    values: dict[str, np.ndarray] = {"$1": patterns}
    for statement in (s.strip() for s in asm.split(";") if s.strip()):
        op, _, rest = statement.partition(" ")
        target, _, source = (part.strip() for part in rest.partition(","))
        if op == ".reg":
            continue
        if op == "mov.b16":
            values[target] = np.full_like(patterns, int(source, 0) & 0xFFFF)
        elif op == "mov.b32" and (pair := re.fullmatch(r"\{(\S+), (\S+)\}", source)):
            low, high = (values[name] & 0xFFFF for name in pair.groups())
            values[target] = low | (high << 16)
        else:
            raise AssertionError(f"an instruction the widening does not use: {statement}")
    wanted = torch.from_numpy(patterns.astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    expected = wanted.to(torch.float32).view(torch.int32).numpy().astype(np.uint32)
    assert np.array_equal(values["$0"], expected)
