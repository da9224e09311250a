"""The normalization scheduler in Triton's interpreter against the reference evaluator:
softmax, RMSNorm and LayerNorm forward and backward (examples/norms.py), heuristics on
recorded hardware profiles, and kernel reuse across batch sizes."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from examples.norms import BUILDERS, make_inputs
from fusion import FusionDefinition
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor, ir
from schedulers.analysis import NotSchedulable
from schedulers.cache import KERNEL_CACHE
from schedulers.hardware import B200, H100, H200, INTERPRETER
from schedulers.normalization import (
    COLUMN_WALK,
    MULTIWAVE,
    SPLIT,
    WARP_SPECIALIZED,
    WS_GAINS,
    NormalizationParams,
    NormalizationScheduler,
    split,
)
from schedulers.normalization.codegen import source
from schedulers.normalization.column_sums import row_parts
from schedulers.normalization.combine import combine_constants
from schedulers.normalization.exchange import CLUSTER_SIZES
from schedulers.normalization.heuristics import short_row_params
from schedulers.normalization.scheduler import partial_rows
from schedulers.normalization.split import (
    CLUSTER_PROGRAMS_PER_SM,
    CLUSTER_SUMS_PARTS,
    CLUSTERS_PER_SM,
    SPLIT_SUMS_STAGES,
    SPLIT_SUMS_WARPS_PER_SM,
    SPLIT_TMA_STAGES,
    cluster_programs,
    split_params,
)
from schedulers.registry import split_into_kernels

HIDDEN = [1, 7, 1000, 1024, 4096, 24576, 65536]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LARGE = 24576  # from here on the interpreter takes seconds a case: one dtype per op there


def _grid(names: list[str]) -> list[tuple[str, int, str]]:
    """Every op, hidden size and dtype up to 4096; above, each op in one dtype, the
    dtypes rotating over the ops (each large size still runs in every dtype)."""
    cases = []
    for k, name in enumerate(names):
        for n in HIDDEN:
            dtypes = list(DTYPES) if n < LARGE else [list(DTYPES)[(k + HIDDEN.index(n)) % 3]]
            cases += [(name, n, dtype) for dtype in dtypes]
    return cases


def _run(name: str, n: int, dtype: str, rows: int = 3, params=None, seed: int = 0,
         offset: float = 0.0):  # fmt: skip
    """``name``'s fusion run on ``rows`` rows of ``make_inputs``' (the first input moved by
    ``offset``), its kernels generated (``params`` forced for the first)."""
    fd = BUILDERS[name](n, dtype)
    generator = torch.Generator().manual_seed(seed + n)
    inputs = make_inputs(name, rows, n, DTYPES[dtype], "cpu", generator)
    if offset:
        inputs[0] = (inputs[0].float() + offset).to(inputs[0].dtype)
    overrides = {"k0": params} if params is not None else None
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params=overrides)
    outputs = executor.run(inputs)
    return fd, inputs, outputs, executor


@pytest.mark.parametrize(
    ("name", "n", "dtype"), _grid(["softmax_fwd", "rmsnorm_fwd", "layernorm_fwd"])
)
def test_forward_matches_the_reference(name, n, dtype):
    fd, inputs, outputs, executor = _run(name, n, dtype)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=n)
    report = executor.kernel_report()
    assert report.startswith("k0 [normalization]") and "\n" not in report, report


@pytest.mark.parametrize(
    ("name", "n", "dtype"), _grid(["softmax_bwd", "rmsnorm_bwd", "layernorm_bwd"])
)
def test_backward_matches_the_reference(name, n, dtype):
    """dx, dweight and dbias in one kernel (and a second adding the programs' partial
    column sums in a fixed order)."""
    rows = 5
    fd, inputs, outputs, executor = _run(name, n, dtype, rows=rows)
    expected = fd.execute(inputs)
    assert_close(outputs[0], expected[0], reduction_extent=n)  # dx
    report = executor.kernel_report()
    assert report.startswith("k0 [normalization]") and "\n" not in report, report
    # dweight and dbias (float32 sums over the rows) against float64 arithmetic
    exact = _weight_gradients_in_float64(name, inputs)
    for actual, wanted in zip(outputs[1:], exact, strict=True):
        assert_close(actual, wanted.to(torch.float32), reduction_extent=rows)


@pytest.mark.parametrize("tile_sums", [True, False])
@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_column_sums_by_row_of_the_block_or_added_every_step(name, tile_sums):
    """4 rows a block over 3 programs walking 13 rows (masked rows in the last block):
    each row of the block keeps its own partial column sums, added once after the walk
    (the default), or they are added across the block every step; both against float64,
    and one combining launch adds every column sum's partial rows."""
    params = NormalizationParams(4, 128, 4, True, programs=3, tile_sums=tile_sums)
    KERNEL_CACHE.clear()  # the sources checked below are this run's
    fd, inputs, outputs, _ = _run(name, 100, "bfloat16", rows=13, params=params)
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=100)
    for actual, wanted in zip(outputs[1:], _weight_gradients_in_float64(name, inputs),
                              strict=True):  # fmt: skip
        assert_close(actual, wanted.to(torch.float32), reduction_extent=13)
    main = next(s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s)
    assert ("tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)" in main) == tile_sums
    combines = [s for s in KERNEL_CACHE.sources() if "def combine_kernel" in s]
    assert len(combines) == 1 and combines[0].count("tl.store(out") == len(outputs) - 1


def _weight_gradients_in_float64(name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    if name == "softmax_bwd":
        return []
    x, dy = inputs[0].double(), inputs[1].double()
    if name == "rmsnorm_bwd":
        xhat = x * inputs[3].double()[:, None]
        return [(dy * xhat).sum(dim=0)]
    mean, rstd = inputs[3].double(), inputs[4].double()
    xhat = (x - mean[:, None]) * rstd[:, None]
    return [(dy * xhat).sum(dim=0), dy.sum(dim=0)]


@pytest.mark.parametrize("name", ["softmax_fwd", "layernorm_fwd", "rmsnorm_bwd"])
@pytest.mark.parametrize("n", [7, 1000])
def test_the_chunked_form_matches_the_reference(name, n):
    """Rows walked in steps of 256 (4) columns, once per reduction level and once for
    the outputs, by a grid of 2 programs that walk 9 row blocks."""
    params = NormalizationParams(2, 256 if n > 7 else 4, 4, persistent=False, programs=2)
    KERNEL_CACHE.clear()  # the source checked below is this run's
    fd, inputs, outputs, executor = _run(name, n, "bfloat16", rows=17, params=params)
    expected = fd.execute(inputs)
    assert_close(outputs[0], expected[0], reduction_extent=n)
    assert "persistent=False, programs=2" in executor.kernel_report()
    source = next(s for s in KERNEL_CACHE.sources() if "chunked" in s)
    assert "for start in range(0, COLUMNS, BLOCK_COLUMNS)" in source
    assert "tl.num_programs(0)" in source


@pytest.mark.parametrize("n", HIDDEN)
def test_a_chunked_layernorm_walks_three_times_keeping_rows_in_l2_for_the_later_walks(n):
    """LayerNorm forward walked in chunks (a ragged last step below 1024 columns, rows
    past the end in the last block): the mean's walk and the variance's load the row
    "evict_last" (a later walk reads it again), the outputs' walk "evict_first". Rows far
    from zero (mean 1000, spread 1), where a one-pass variance would lose digits: mean,
    rstd and y against float64."""
    step = 4 if n < 1000 else 64 if n == 1000 else 1024
    params = NormalizationParams(2, step, 4, persistent=False, programs=2)
    fd = BUILDERS["layernorm_fwd"](n, "float32")
    generator = torch.Generator().manual_seed(n)
    x = 1000.0 + torch.randn(5, n, generator=generator)
    w, b = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    KERNEL_CACHE.clear()
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    y, mean, rstd = executor.run([x, w, b])
    source = next(s for s in KERNEL_CACHE.sources() if "chunked" in s)
    walks = source.split("for start in range(0, COLUMNS, BLOCK_COLUMNS)")[1:]
    assert len(walks) == 3, source
    for walk in walks[:2]:
        assert "eviction_policy='evict_last'" in walk and "evict_first" not in walk, walk
    assert "eviction_policy='evict_first'" in walks[2] and "evict_last" not in walks[2]
    var, want_mean = torch.var_mean(x.double(), dim=1, correction=0)
    want_rstd = torch.rsqrt(var + 1e-5)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-5, atol=0)
    want_y = (x.double() - want_mean[:, None]) * want_rstd[:, None] * w.double() + b.double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-3, atol=1e-3)


@pytest.mark.filterwarnings(r"ignore:var_mean\(\).{2}degrees of freedom:UserWarning")
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_a_variance_whose_correction_passes_the_row_is_inf_or_nan_as_torch_s(n, persistent):
    """``var_mean(correction=2)``: a row of 5 divides by 3; rows of 1 and 2 by
    max(0, n - 2) = 0, so torch gives NaN (no spread) or inf; the kernel did -0 and a
    negative variance before."""
    with FusionDefinition("corrected") as fd:
        x = fd.define_tensor(["rows", n], "float32")
        var, mean = fd.ops.var_mean(x, dims=[1], correction=2)
        fd.add_output(x - fd.ops.broadcast(mean, [False, True]))
        fd.add_output(var)
    params = NormalizationParams(1, 8 if persistent else 2, 1, persistent=persistent)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    x = torch.tensor([[1.0, 3.0, 2.0, 7.0, 5.0][:n], [4.0] * n])
    centred, var = executor.run([x])
    expected = fd.execute([x])
    torch.testing.assert_close(centred, expected[0])
    torch.testing.assert_close(var, expected[1], equal_nan=True)
    assert bool(torch.isnan(var[1])) == (n < 5) and bool(torch.isfinite(var[0])) == (n == 5), var


def test_a_persistent_kernel_refuses_a_longer_row_before_launching():
    params = NormalizationParams(1, 512, 4, persistent=True)
    with pytest.raises(ValueError, match="holds 512 columns; the row has 1000"):
        _run("rmsnorm_fwd", 1000, "float32", params=params)


def test_a_batch_size_change_reuses_the_kernel():
    fd = BUILDERS["rmsnorm_fwd"](1024, "bfloat16")
    executor = MultiDeviceExecutor(fd, kernels="generated")
    generator = torch.Generator().manual_seed(1)
    KERNEL_CACHE.clear()
    for rows in (1, 3, 8, 17, 64):
        inputs = make_inputs("rmsnorm_fwd", rows, 1024, torch.bfloat16, "cpu", generator)
        for actual, expected in zip(executor.run(inputs), fd.execute(inputs), strict=True):
            assert_close(actual, expected, reduction_extent=1024)
    assert KERNEL_CACHE.compilations == 1
    assert "COLUMNS: tl.constexpr" in KERNEL_CACHE.sources()[0]
    assert "row_count" in KERNEL_CACHE.sources()[0]  # rows: a runtime argument


def _plan(name: str, n: int, dtype: str = "bfloat16"):
    fd = BUILDERS[name](n, dtype)
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    assert isinstance(group.scheduler, NormalizationScheduler)
    return group.scheduler, group.plan


@pytest.mark.parametrize(
    ("name", "n", "persistent", "warps", "values"),
    [
        ("rmsnorm_fwd", 1024, True, 2, 16),  # 16 bf16 a thread: two 128-bit vectors
        ("rmsnorm_fwd", 4096, True, 8, 16),
        ("layernorm_fwd", 8192, True, 8, 32),  # a variance on fast memory: four
        ("softmax_fwd", 16384, True, 16, 32),
        ("rmsnorm_fwd", 24576, True, 16, 64),  # padded to 32768 columns
        ("rmsnorm_fwd", 65536, False, 16, None),  # 128 values a thread: too many registers
        ("rmsnorm_bwd", 65536, False, 16, None),
    ],
)
def test_heuristics_on_h200(name, n, persistent, warps, values):
    """The multi-wave strategy's (forced: automatically, rows that do not fit are split)."""
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, H200, [32768, n], MULTIWAVE)
    assert params.persistent is persistent and params.num_warps == warps, params
    if persistent:
        assert params.block_columns >= n and params.programs == 0
        assert f"{values} values a thread" in params.why and "reaches 0.25" in params.why
    else:
        assert params.block_columns == 8192 and "does not fit in registers" in params.why
        assert H200.sm_count <= params.programs <= 4 * H200.sm_count
        # the rows in flight stay within half the L2, unless one program an SM is already
        # more (the grid never goes below that)
        in_flight = params.programs * n * 16 * plan.buffers
        assert in_flight <= H200.l2_bits // 2 or params.programs == H200.sm_count


@pytest.mark.parametrize(
    ("name", "n", "hardware", "warps", "values"),
    [
        ("rmsnorm_fwd", 4096, H200, 8, 16),
        ("rmsnorm_fwd", 4096, H100, 8, 16),
        ("rmsnorm_fwd", 1024, H100, 2, 16),
        ("layernorm_fwd", 4096, H200, 4, 32),  # a variance on fast memory
        ("layernorm_fwd", 1024, H200, 1, 32),
        ("layernorm_fwd", 4096, H100, 8, 16),
        ("layernorm_fwd", 8192, H100, 16, 16),
        ("softmax_fwd", 1024, H200, 2, 16),
        ("softmax_bwd", 4096, H100, 8, 16),
    ],
)
def test_a_thread_holds_two_vectors_a_row_but_a_variance_on_fast_memory_four(
    name, n, hardware, warps, values
):
    """The multi-wave rows without column sums: enough values a thread to keep its loads
    busy are two 128-bit vectors (16 bf16), four for a variance (LayerNorm) on fast
    memory (the H200), where fewer lost (``BUSY_VECTORS``)."""
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, hardware, [32768, n])
    assert params.persistent and params.block_rows == 1 and params.num_warps == warps, params
    assert f"{values} values a thread" in params.why, params


def test_more_buffered_inputs_leave_the_registers_sooner():
    """At 24576 columns the forward keeps x in registers; the backward keeps x and dy
    and a program's partial dweight sums too, which no longer fit: it walks the row."""
    forward = _plan("rmsnorm_fwd", 24576)
    backward = _plan("rmsnorm_bwd", 24576)
    assert forward[1].buffers == 1 and backward[1].buffers == 2
    f = forward[0].heuristics(forward[1], H100, [4096, 24576], MULTIWAVE)
    b = backward[0].heuristics(backward[1], H100, [4096, 24576], MULTIWAVE)
    assert f.persistent and not b.persistent, (f, b)
    assert "2 buffered inputs" in b.why and b.programs >= H100.sm_count


def test_column_sums_need_a_fixed_grid():
    params = NormalizationParams(1, 1024, 4, persistent=True)  # programs=0: one per row
    with pytest.raises(ValueError, match="column sums need a fixed grid"):
        _run("rmsnorm_bwd", 1000, "float32", params=params)


def test_the_interpreter_profile_gives_runnable_params():
    scheduler, plan = _plan("softmax_fwd", 1000)
    params = scheduler.heuristics(plan, INTERPRETER, [3, 1000])
    assert params.persistent and params.block_columns == 1024
    assert "best of" in str(params)  # the reasons print


def test_a_plain_row_sum_stays_with_the_reduction_scheduler():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 64])
        fd.add_output(fd.ops.sum(x, dims=[1]))
    (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    assert group.scheduler.name == "reduction"


def test_outer_reductions_are_not_normalizations():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 64])
        total = fd.ops.sum(x, dims=[0], keepdim=True)
        fd.add_output(x - total)
    scheduler = NormalizationScheduler()
    with pytest.raises(NotSchedulable, match="no reduction along the rows"):
        scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)


def test_column_sums_pipeline_the_walk_when_registers_allow():
    scheduler, plan = _plan("rmsnorm_bwd", 4096)
    params = scheduler.heuristics(plan, H200, [32768, 4096], MULTIWAVE)
    assert params.persistent and params.programs > 0 and params.stages == 3, params
    assert "pipelined 3 deep" in params.why
    assert scheduler.heuristics(plan, INTERPRETER, [32768, 4096]).stages == 1


# -- the warp-specialized strategy ------------------------------------------------------


def replace_arch(profile, arch):
    return dataclasses.replace(profile, arch=arch)


def replace_registers(profile, registers):
    return dataclasses.replace(profile, registers_per_sm=registers)


@pytest.mark.parametrize(
    ("name", "n", "dtype", "rows"),
    [
        ("rmsnorm_bwd", 1024, "bfloat16", 37),  # rows past the last tile: TMA pads zeros
        ("rmsnorm_bwd", 1000, "float32", 5),  # a row narrower than the tile
        ("layernorm_bwd", 96, "float16", 9),
        ("layernorm_bwd", 4096, "bfloat16", 3),
        ("softmax_bwd", 1000, "float16", 4),
        ("layernorm_fwd", 1000, "bfloat16", 6),
        ("softmax_fwd", 96, "float32", 33),  # a max: the padding must not win it
    ],
)
def test_the_warp_specialized_kernel_matches_the_reference(name, n, dtype, rows):
    """Forced: its full-shape inputs arrive as TMA tensor descriptors, its walk is a
    tl.range with warp_specialize (the interpreter runs it as a plain loop)."""
    fd = BUILDERS[name](n, dtype)
    generator = torch.Generator().manual_seed(rows + n)
    inputs = make_inputs(name, rows, n, DTYPES[dtype], "cpu", generator)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": WARP_SPECIALIZED})
    KERNEL_CACHE.clear()  # the source checked below is this run's, not an earlier test's
    outputs = executor.run(inputs)
    expected = fd.execute(inputs)
    assert_close(outputs[0], expected[0], reduction_extent=n)
    if name.endswith("_bwd") and name != "softmax_bwd":
        exact = _weight_gradients_in_float64(name, inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=rows)
    params = executor.chosen_params["k0"]
    assert params.strategy == WARP_SPECIALIZED and params.stages >= 2, params
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    assert "warp-specialized (TMA tiles)" in source
    assert ".load([row_block * BLOCK_ROWS, 0])" in source
    assert "warp_specialize=True" in source and f"num_stages={params.stages}" in source


def test_a_misaligned_input_is_copied_for_its_descriptor():
    """TMA needs a 16-byte aligned base: an input starting 2 bytes into its storage is
    copied first, and the result stays exact."""
    n, rows = 64, 6
    fd = BUILDERS["rmsnorm_bwd"](n, "bfloat16")
    generator = torch.Generator().manual_seed(5)
    inputs = make_inputs("rmsnorm_bwd", rows, n, torch.bfloat16, "cpu", generator)
    storage = torch.empty(rows * n + 1, dtype=torch.bfloat16)
    storage[1:] = inputs[0].flatten()
    inputs[0] = storage[1:].view(rows, n)
    assert inputs[0].data_ptr() % 16 and inputs[0].is_contiguous()
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": WARP_SPECIALIZED})
    outputs = executor.run(inputs)
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=n)


def test_the_warp_specialized_kernel_is_reused_across_batch_sizes():
    fd = BUILDERS["layernorm_bwd"](256, "bfloat16")
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": WARP_SPECIALIZED})
    generator = torch.Generator().manual_seed(2)
    KERNEL_CACHE.clear()
    chosen = set()
    for rows in (1, 5, 16, 40):
        inputs = make_inputs("layernorm_bwd", rows, 256, torch.bfloat16, "cpu", generator)
        outputs = executor.run(inputs)
        assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=256)
        chosen.add(executor.chosen_params["k0"])
    # the normalization kernel and the combining kernel (dweight's and dbias's are the
    # same source): built once each; the same params (constexprs) for every batch size,
    # so the GPU compiles it once too
    assert KERNEL_CACHE.compilations == 2, KERNEL_CACHE.sources()
    assert sum("warp-specialized" in s for s in KERNEL_CACHE.sources()) == 1
    assert len(chosen) == 1, chosen


@pytest.mark.parametrize(
    ("name", "n", "rows", "strategy", "reason"),
    [
        # rows of 1024 walked in small tiles where the warp-specialized kernel would be taken
        ("rmsnorm_bwd", 1024, 32768, MULTIWAVE, "instead of warp-specialized (249 rows a"),
        ("rmsnorm_bwd", 2048, 32768, WARP_SPECIALIZED, "at least 48"),
        ("layernorm_bwd", 4096, 32768, WARP_SPECIALIZED, "249 rows a program"),
        ("layernorm_bwd", 8192, 16384, WARP_SPECIALIZED, "16 consumer warps"),
        ("rmsnorm_bwd", 16384, 8192, SPLIT, "with column sums): the row split over 4 programs"),
        ("rmsnorm_bwd", 4096, 4096, MULTIWAVE, "32 rows a program, fewer than the 48"),
        # rows of 1024 columns gain from 32 rows a program on the H200 (not on the H100)
        ("rmsnorm_bwd", 1024, 4096, WARP_SPECIALIZED, "32 rows a program, at least 32"),
        ("rmsnorm_bwd", 1024, 2048, MULTIWAVE, "16 rows a program, fewer than the 32"),
        ("layernorm_bwd", 1024, 1024, MULTIWAVE, "8 rows a program, fewer than the 16"),
        ("layernorm_bwd", 1024, 32768, MULTIWAVE, "short rows (2x1024 tiles over 4 warps"),
        ("layernorm_bwd", 4096, 4096, WARP_SPECIALIZED, "32 rows a program, at least 16"),
        ("layernorm_bwd", 65536, 4096, SPLIT, "fell back: degenerate: one stage"),
        ("layernorm_bwd", 16384, 8192, SPLIT, "fell back: degenerate: about 168 registers"),
        ("rmsnorm_fwd", 65536, 4096, SPLIT, "the row split over 8 programs of 8192 columns"),
        ("rmsnorm_fwd", 4096, 32768, MULTIWAVE, "no warp-specialized gain recorded"),
    ],
)
def test_the_automatic_choice_on_h200(name, n, rows, strategy, reason):
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, H200, [rows, n])
    assert params.strategy == strategy and reason in params.why, params
    start = {WARP_SPECIALIZED: "warp-specialized", MULTIWAVE: "multi", SPLIT: "split"}[strategy]
    assert params.why.startswith(start)


@pytest.mark.parametrize(
    ("profile", "name", "n", "dtype", "walked"),
    [
        (H200, "layernorm_fwd", 16384, "bfloat16", True),  # 16.5 MiB held at once
        (H200, "layernorm_fwd", 24576, "bfloat16", True),
        (H200, "layernorm_fwd", 32768, "bfloat16", False),  # 33 MiB: over half the L2
        (H200, "layernorm_fwd", 16384, "float32", False),
        (H200, "layernorm_fwd", 8192, "bfloat16", False),  # shorter rows
        (H200, "rmsnorm_fwd", 16384, "bfloat16", True),  # one level: from 8192 columns
        (H200, "rmsnorm_fwd", 8192, "bfloat16", True),
        (H200, "rmsnorm_fwd", 4096, "bfloat16", False),
        (H200, "rmsnorm_fwd", 32768, "bfloat16", False),  # 33 MiB held
        (H100, "rmsnorm_fwd", 8192, "bfloat16", False),
        (H200, "softmax_fwd", 16384, "bfloat16", False),  # two levels, no variance
        (H200, "layernorm_bwd", 16384, "bfloat16", False),  # column sums (and saved stats)
        (H100, "layernorm_fwd", 16384, "bfloat16", False),  # 3000 GB/s
        (B200, "layernorm_fwd", 16384, "bfloat16", True),  # by its bandwidth: not measured
    ],
)
def test_a_forward_walks_long_rows_in_chunks_on_the_h200(profile, name, n, dtype, walked):
    scheduler, plan = _plan(name, n, dtype)
    params = scheduler.heuristics(plan, profile, [8192, n])
    assert (not params.persistent) == walked, params
    if walked:  # in place of the row in registers, which forcing multiwave still gives
        assert (params.block_columns, params.num_warps, params.programs) == (4096, 16, 0)
        forced = scheduler.heuristics(plan, profile, [8192, n], MULTIWAVE)
        assert forced.persistent and "a forward over rows" not in forced.why, forced
        assert params.why.startswith("chunked (a forward over rows of"), params.why
        assert params.why.endswith(f"{forced.why}]") and "[instead of " in params.why


def test_a_layernorm_forward_of_32768_columns_is_split_on_the_h200_only():
    """Rows that fit the registers (16 warps, 64 values a thread) but are not walked (33
    MiB held at once): the H200 splits LayerNorm's (0.82-0.83 of copy against 0.74-0.77
    in registers), the H100 keeps the registers (0.94-0.97 against 0.80-0.88), and
    RMSNorm (one level) keeps them on the H200 (0.88-0.90 against 0.82-0.83). The split's
    four programs a row are a cluster, CLUSTER_PROGRAMS_PER_SM programs an SM as at 65536
    columns (two clusters an SM: 0.87 of copy, 0.88 in one pass; one an SM 0.74)."""
    scheduler, plan = _plan("layernorm_fwd", 32768)
    for rows in (4096, 8192):
        params = scheduler.heuristics(plan, H200, [rows, 32768])
        assert params.strategy == SPLIT and params.parts == 4, params
        assert params.cluster and params.column_bits and params.one_pass, params
        assert params.contract, params
        assert params.programs == CLUSTER_PROGRAMS_PER_SM * H200.sm_count, params
        assert params.why.startswith("split (a variance over rows of 32768"), params.why
        assert scheduler.heuristics(plan, H100, [rows, 32768]).strategy == MULTIWAVE
    narrower, narrower_plan = _plan("layernorm_fwd", 24576)
    walked = narrower.heuristics(narrower_plan, H200, [8192, 24576])
    assert not walked.persistent, walked  # walked in chunks (25 MiB held)
    rms, rms_plan = _plan("rmsnorm_fwd", 32768)
    assert rms.heuristics(rms_plan, H200, [8192, 32768]).strategy == MULTIWAVE


@pytest.mark.parametrize(
    ("profile", "name", "dtype"),
    [
        (H200, "layernorm_fwd", "bfloat16"),  # 0.82 of copy split, 0.75 chunked
        (H100, "layernorm_fwd", "bfloat16"),  # 0.87 split, 0.79 chunked
        (H200, "layernorm_fwd", "float32"),
        (H200, "rmsnorm_fwd", "bfloat16"),  # 0.85-0.87 split, 0.80 chunked
        (H100, "rmsnorm_fwd", "bfloat16"),
    ],
)
def test_a_forward_of_65536_columns_is_split(profile, name, dtype):
    """Rows too long for registers: split on both devices. The H200 walked LayerNorm's in
    chunks (0.75 of copy against 0.70-0.71 split) until the exchange went into the rows'
    own layout (0.82 split, twice, commit 6b9ab9f); there its bf16 weight and bias are
    kept as their bits since (0.86; on the H100 0.83 against 0.91 kept as float32s), and
    its programs a cluster, CLUSTER_PROGRAMS_PER_SM an SM, each slice's variance in one
    pass, its multiplies and adds contracted (0.89 at 4096x65536, 0.90 at 8192).
    RMSNorm's row, a cluster everywhere, keeps its weight's float32s (0.91 against 0.90
    as bits); float32 weights have no bits to keep (nor LayerNorm's cluster, which needs
    them)."""
    scheduler, plan = _plan(name, 65536, dtype)
    params = scheduler.heuristics(plan, profile, [4096, 65536])
    assert params.strategy == SPLIT and params.persistent, params
    assert params.why.startswith("split (the row does not fit"), params.why
    bits = dtype == "bfloat16" and name == "layernorm_fwd" and profile is H200
    clustered = name == "rmsnorm_fwd" or bits
    assert params.column_bits == bits and params.cluster == clustered, params
    assert params.one_pass == bits, params  # LayerNorm's cluster only
    per_sm = CLUSTER_PROGRAMS_PER_SM if bits else CLUSTERS_PER_SM * params.parts
    assert params.programs == (per_sm * profile.sm_count if clustered else 0), params
    assert params.contract == bits, params  # LayerNorm's cluster: contracted
    text = str(dataclasses.replace(params, why=""))
    assert ("column_bits=True" in text) == bits and ("one_pass=True" in text) == bits
    assert ("the weights kept as their bfloat16 bits" in params.why) == bits, params.why
    assert ("each slice's variance in one reduction" in params.why) == bits, params.why


@pytest.mark.parametrize(
    ("output", "contracted"),
    [("bfloat16", True), ("float8_e4m3fn", False), ("float64", False),
     ("a comparison", False), ("an integer", False)],
)  # fmt: skip
def test_a_layernorm_forward_is_contracted_where_it_computes_floats_only(output, contracted):
    """LayerNorm forward's cluster in one pass contracts its multiplies and adds on the
    H200 where every value it computes is a 16- or 32-bit float; y as fp8 (a code: one
    rounding may move it a whole step), as float64, or made of a comparison or of a
    rounding to integers (an exact value, though cast back to bf16) keeps them apart,
    the cluster and the one pass kept."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 65536], "bfloat16")
        w = fd.define_tensor([65536], "bfloat16")
        b = fd.define_tensor([65536], "bfloat16")
        xf = fd.ops.cast(x, "float32")
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0)
        rstd = fd.ops.broadcast(fd.ops.rsqrt(var + 1e-5), [False, True])
        xhat = (xf - fd.ops.broadcast(mean, [False, True])) * rstd
        wf = fd.ops.broadcast(fd.ops.cast(w, "float32"), [True, False])
        bf = fd.ops.broadcast(fd.ops.cast(b, "float32"), [True, False])
        y = xhat * wf + bf
        if output == "a comparison":
            y = fd.ops.cast(fd.ops.gt(y, 0.0), "bfloat16")
        elif output == "an integer":
            y = fd.ops.cast(fd.ops.cast(y * 100.0, "int32"), "bfloat16")
        exact = output in ("a comparison", "an integer")  # already bf16
        fd.add_output(y if exact else fd.ops.cast(y, output))
    (group, *_) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    params = group.scheduler.heuristics(group.plan, H200, [4096, 65536])
    assert params.strategy == SPLIT and params.cluster and params.one_pass, params
    assert params.contract == contracted, params
    assert ("multiplies and adds contracted into fmas" in params.why) == contracted


def test_two_plain_sums_a_row_exchange_through_global_memory():
    """Two partials a round that are not a variance (a row's sum and sum of squares, bf16
    weights) keep the exchange through global memory on the H200, in two reductions:
    the cluster of two partials is LayerNorm's, measured only there."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 65536], "bfloat16")
        w = fd.define_tensor([65536], "bfloat16")
        xf = fd.ops.cast(x, "float32")
        total = fd.ops.sum(xf, dims=[1])
        squares = fd.ops.sum(xf * xf, dims=[1])
        scale = fd.ops.broadcast(squares - total, [False, True])
        wf = fd.ops.broadcast(fd.ops.cast(w, "float32"), [True, False])
        fd.add_output(fd.ops.cast(xf * scale * wf, "bfloat16"))
    (group, *_) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    assert isinstance(group.scheduler, NormalizationScheduler), group.scheduler
    assert group.plan.exchanges == {1: 2}, group.plan.exchanges
    params = split_params(group.plan, H200, 65536)
    assert params.strategy == SPLIT and params.column_bits, params
    assert not params.cluster and not params.one_pass and params.programs == 0, params


def test_short_rows_gain_sooner_on_the_h200_only():
    """RMSNorm backward with 32 rows a program of 1024 columns (4096 rows: one program an
    SM since the partial sums are kept by row of the tile): warp-specialized on the H200
    (where, at two programs an SM, it was 0.38 of copy against 0.28), multi-wave on the
    H100 (where it lost by 5-7 %) and where the memory's speed is not known. At 8192 rows
    (63 a program) both take it (H100: 0.69-0.70 against 0.40, commit 2105a11), and the
    short rows' walk replaces it there (21 rows a program at 3 programs an SM)."""
    scheduler, plan = _plan("rmsnorm_bwd", 1024)
    for profile, strategy in ((H200, WARP_SPECIALIZED), (H100, MULTIWAVE),
                              (dataclasses.replace(H200, memory_gbps=0.0), MULTIWAVE)):  # fmt: skip
        params = scheduler.heuristics(plan, profile, [4096, 1024])
        assert params.strategy == strategy, (profile.name, params.why)
        longer = scheduler.heuristics(plan, profile, [8192, 1024]).why
        assert "short rows" in longer and "[instead of warp-specialized (63 rows" in longer
    assert "fewer than the 48" in scheduler.heuristics(plan, H100, [4096, 1024]).why


@pytest.mark.parametrize("profile", [H200, H100])
@pytest.mark.parametrize(("name", "n", "dtype"), [("rmsnorm_bwd", 1024, "bfloat16"),
                                                  ("layernorm_bwd", 1024, "bfloat16"),
                                                  ("layernorm_bwd", 1000, "bfloat16"),
                                                  ("layernorm_bwd", 1024, "float16")])  # fmt: skip
def test_short_rows_are_walked_in_small_tiles_where_the_warp_specialized_kernel_would_be(
    profile, name, n, dtype
):
    """Column sums over rows of 1024 (16-bit inputs, sm_90): 2x1024 tiles over 4 warps, 3
    programs an SM, loads pipelined 3 deep, weights in registers, partial sums by row of
    the tile (H200 LayerNorm backward 32768x1024: 0.80 of copy against 0.74
    warp-specialized; H100 0.84 against 0.83). One kernel for every batch size it takes;
    forced, the warp-specialized kernel keeps its column sums by row of its tile."""
    scheduler, plan = _plan(name, n, dtype)
    chosen = {rows: scheduler.heuristics(plan, profile, [rows, n]) for rows in (8192, 32768)}
    for params in chosen.values():
        assert params.strategy == MULTIWAVE and params.why.startswith("multi-wave, short rows")
        assert (params.block_rows, params.block_columns, params.num_warps) == (2, 1024, 4)
        assert (params.programs, params.stages) == (3 * profile.sm_count, 3)
        assert params.persistent and params.column_registers and params.tile_sums
    assert chosen[8192] == chosen[32768]  # the same kernel (``why`` is not compared)
    forced = scheduler.heuristics(plan, profile, [32768, n], WARP_SPECIALIZED)
    assert forced.strategy == WARP_SPECIALIZED
    assert "column sums kept by row of the tile" in forced.why, forced.why


@pytest.mark.parametrize(
    "profile",
    [
        # three programs of about 112 registers x 128 threads do not fit (the
        # warp-specialized kernel, one program an SM, is still taken)
        dataclasses.replace(H200, registers_per_sm=40000),
        dataclasses.replace(H200, smem_per_block_bits=64 * 1024 * 8),  # 3 x 3 x 8 KiB tiles
    ],
)
def test_short_rows_keep_the_warp_specialized_kernel_where_three_programs_do_not_fit(profile):
    scheduler, plan = _plan("layernorm_bwd", 1024)
    params = scheduler.heuristics(plan, profile, [32768, 1024])
    assert params.strategy == WARP_SPECIALIZED and "short rows" not in params.why, params


@pytest.mark.parametrize(
    ("profile", "name", "n", "dtype", "rows", "strategy"),
    [
        (H200, "rmsnorm_bwd", 1024, "bfloat16", 4096, WARP_SPECIALIZED),  # 11 rows a program
        (H200, "layernorm_bwd", 1024, "float32", 32768, WARP_SPECIALIZED),  # not measured
        (H200, "layernorm_bwd", 2048, "bfloat16", 32768, WARP_SPECIALIZED),
        (H200, "layernorm_bwd", 512, "bfloat16", 32768, WARP_SPECIALIZED),
        (B200, "layernorm_bwd", 1024, "bfloat16", 32768, MULTIWAVE),  # no gain recorded
        (H200, "layernorm_fwd", 1024, "bfloat16", 32768, MULTIWAVE),  # no column sums
    ],
)
def test_short_rows_keep_their_kernel_elsewhere(profile, name, n, dtype, rows, strategy):
    """The automatic choice, and the rule itself (the B200 and the forward never reach
    it in the automatic choice: no warp-specialized gain recorded), on registers enough
    for any tile (2048 columns would not fit three programs an SM otherwise)."""
    scheduler, plan = _plan(name, n, dtype)
    params = scheduler.heuristics(plan, profile, [rows, n])
    assert params.strategy == strategy and "short rows" not in params.why, params
    roomy = dataclasses.replace(profile, registers_per_sm=1 << 20)
    assert short_row_params(plan, roomy, n, rows) is None


@pytest.mark.parametrize("n", [1000, 1024])
@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_the_short_rows_walk_matches_the_reference(name, n):
    """The H200's short-row params, on 3 programs walking 13 rows (the last tile masked):
    every output against float64."""
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, H200, [32768, n])
    assert "short rows" in params.why
    fd, inputs, outputs, _ = _run(name, n, "bfloat16", rows=13,
                                  params=dataclasses.replace(params, programs=3))  # fmt: skip
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=n)
    for actual, wanted in zip(outputs[1:], _weight_gradients_in_float64(name, inputs),
                              strict=True):  # fmt: skip
        assert_close(actual, wanted.to(torch.float32), reduction_extent=13)


def test_the_warp_specialized_parameter_loop():
    """Stages first (three fit), consumer warps until a thread holds at most two 16-byte
    vectors of a row, then rows a tile until two tiles (64 KiB) are in flight, then, for
    the column sums kept by row of the tile, consumer warps until that tile is at most
    32 values a thread (1024 columns: 8 warps, not 4, and one program an SM)."""
    cases = {1024: (3, 8, 8, 1), 4096: (3, 8, 2, 1), 8192: (3, 16, 1, 1)}
    for n, (stages, warps, rows, blocks) in cases.items():
        scheduler, plan = _plan("rmsnorm_bwd", n)
        params = scheduler.heuristics(plan, H200, [32768, n], WARP_SPECIALIZED)
        assert (params.stages, params.num_warps, params.block_rows) == (stages, warps, rows)
        assert params.programs == blocks * H200.sm_count, params
        assert params.persistent and params.block_columns == n and params.column_registers


def test_the_forced_strategies_ignore_the_recorded_gains():
    scheduler, plan = _plan("rmsnorm_fwd", 4096)
    assert 0 not in WS_GAINS[90]  # the forward has no gain recorded: auto is multi-wave
    forced = scheduler.heuristics(plan, H200, [32768, 4096], WARP_SPECIALIZED)
    assert forced.strategy == WARP_SPECIALIZED and "rows a program" not in forced.why
    scheduler, plan = _plan("rmsnorm_bwd", 1024)
    multiwave = scheduler.heuristics(plan, H200, [32768, 1024], MULTIWAVE)
    assert multiwave.strategy == MULTIWAVE and multiwave.programs > 0
    with pytest.raises(ValueError, match="strategy 'fast'"):
        scheduler.heuristics(plan, H200, [32768, 1024], "fast")


@pytest.mark.parametrize(
    ("name", "n", "profile", "reason", "fallback"),
    [
        ("rmsnorm_bwd", 65536, H200, "degenerate: one stage", SPLIT),
        ("rmsnorm_bwd", 1000 + 4, H100, "not a multiple of 16 bytes", MULTIWAVE),  # 1004 bf16
        ("rmsnorm_bwd", 1024, replace_arch(H100, 80), "need sm_90 or later", MULTIWAVE),
        # a quarter of the registers: the row does not fit them, and a split's programs
        # (4 of 4096 columns, about 168 registers a thread) neither: the columns walked
        ("rmsnorm_bwd", 16384, replace_registers(H200, 16384), "degenerate: about", COLUMN_WALK),
    ],
)
def test_a_forced_warp_specialized_kernel_says_why_it_cannot_be(name, n, profile, reason, fallback):
    """No fallback when forced: NotSchedulable with the reason, before any launch."""
    scheduler, plan = _plan(name, n)
    with pytest.raises(NotSchedulable, match=reason):
        scheduler.heuristics(plan, profile, [8192, n], WARP_SPECIALIZED)
    # automatically, the same case falls back to the multi-wave kernel (or, where its
    # row does not fit, to the split one or the column walk) and says why
    params = scheduler.heuristics(plan, profile, [8192, n])
    assert params.strategy == fallback, params
    if profile.arch == 90 and reason.startswith("degenerate"):
        assert f"fell back: {reason}" in params.why, params.why


def test_other_architectures_keep_the_multi_wave_kernel():
    scheduler, plan = _plan("layernorm_bwd", 4096)
    params = scheduler.heuristics(plan, B200, [32768, 4096])
    assert params.strategy == MULTIWAVE and "sm_100" in params.why


def test_the_executor_checks_strategy_names_before_running():
    fd = BUILDERS["rmsnorm_bwd"](64, "bfloat16")
    with pytest.raises(
        ValueError,
        match="strategies are \\['multiwave', 'warp_specialized', 'split', 'column_walk'\\]",
    ):
        MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": "fastest"})
    with pytest.raises(ValueError, match="no generated kernel 'k9'"):
        MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k9": MULTIWAVE})
    with FusionDefinition() as pointwise:
        x = pointwise.define_tensor(["rows", 64])
        pointwise.add_output(x * 2.0)
    with pytest.raises(ValueError, match="pointwise scheduler's strategies are \\[\\]"):
        MultiDeviceExecutor(pointwise, kernels="generated", kernel_params={"k0": MULTIWAVE})
    # forced where it cannot be built: the first run raises before launching anything
    odd = BUILDERS["rmsnorm_bwd"](7, "bfloat16")
    executor = MultiDeviceExecutor(odd, kernels="generated", kernel_params={"k0": WARP_SPECIALIZED})
    inputs = make_inputs("rmsnorm_bwd", 3, 7, torch.bfloat16, "cpu", torch.Generator())
    with pytest.raises(NotSchedulable, match="not a multiple of 16 bytes"):
        executor.run(inputs)


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_bwd"])
def test_rows_of_one_column_and_more_rows_than_a_warp_has_threads(name):
    """One column and 64 rows: a block of more rows than its threads left a row without
    a thread (the heuristics divided by zero); every candidate gives each row a thread."""
    scheduler, plan = _plan(name, 1)
    params = scheduler.heuristics(plan, H200, [64, 1])
    assert params.num_warps >= 1
    fd, inputs, outputs, _ = _run(name, 1, "float32", rows=64)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=64)


# -- the split strategy -----------------------------------------------------------------


def _split_grid() -> list[tuple[str, int, str]]:
    """Every op over the issue's hidden sizes up to 4096, bf16, and float32 and float16
    at 1000; above, the interpreter takes seconds a case (its programs in threads): the
    two backward ops that split automatically, one at each large size."""
    names = ["softmax_fwd", "rmsnorm_fwd", "layernorm_fwd", "softmax_bwd", "rmsnorm_bwd",
             "layernorm_bwd"]  # fmt: skip
    cases = [(name, n, "bfloat16") for name in names for n in HIDDEN if n < LARGE]
    cases += [("rmsnorm_bwd", 24576, "bfloat16"), ("layernorm_bwd", 65536, "bfloat16")]
    cases += [(name, 1000, dtype) for name in names for dtype in ("float32", "float16")]
    return [
        pytest.param(*case, marks=pytest.mark.slow) if case[1] >= LARGE else case for case in cases
    ]


@pytest.mark.parametrize(("name", "n", "dtype"), _split_grid())
def test_the_split_kernel_matches_the_reference(name, n, dtype):
    """Forced: a row split over programs (2; with column sums 6 at 24576, 16 at 65536)
    that exchange their partial reductions; the interpreter runs a launch's programs
    concurrently (they wait for each other), two groups of them walking 5 rows. Every
    output, the column sums against float64 arithmetic."""
    rows = 5
    KERNEL_CACHE.clear()
    fd = BUILDERS[name](n, dtype)
    generator = torch.Generator().manual_seed(rows + n)
    inputs = make_inputs(name, rows, n, DTYPES[dtype], "cpu", generator)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": SPLIT})
    outputs = executor.run(inputs)
    expected = fd.execute(inputs)
    if name in ("rmsnorm_bwd", "layernorm_bwd"):
        assert_close(outputs[0], expected[0], reduction_extent=n)
        exact = _weight_gradients_in_float64(name, inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=rows)
    else:
        for actual, value in zip(outputs, expected, strict=True):
            assert_close(actual, value, reduction_extent=n)
    params = executor.chosen_params["k0"]
    sums = name in ("rmsnorm_bwd", "layernorm_bwd")  # column sums: slices of 4096
    parts = {24576: 6, 65536: 16}.get(n, 2) if sums else 2
    assert params.strategy == SPLIT and params.parts == parts, params
    # one input of the full shape (a forward, softmax's too) whose rows TMA can stride:
    # its slices come through descriptors, pipelined (the interpreter's profile allows it)
    tma = name.endswith("_fwd") and n * DTYPES[dtype].itemsize % 16 == 0
    assert params.tma == tma and params.prefetch == (not tma and not sums), params
    stages = SPLIT_TMA_STAGES if tma else SPLIT_SUMS_STAGES if sums else 1
    assert params.stages == stages, params
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    assert "split over programs exchanging partial reductions" in source
    # a post and a wait a level, of tagged words, relaxed at GPU scope
    levels = 2 if name == "softmax_fwd" else 1  # its max, then its sum
    assert source.count(" = xpost0(") == levels == source.count(" = xwait1("), source
    # one row a block: exchanged by the first thread, each lane of a warp polling a word
    assert "atom.relaxed.gpu.global.exch.b64" in source and "%tid.x" in source
    assert "ld.relaxed.gpu.global.b64 v, [a]" in source and "vote.sync.all.pred" in source
    assert (".load([row_block * BLOCK_ROWS, part * BLOCK_COLUMNS])" in source) == tma
    # column sums of bf16 inputs: added before the post, the inputs' bits widened again
    # after the wait (``rewiden``), so the float32s are not kept across the exchange
    rewiden = sums and dtype == "bfloat16"
    assert params.rewiden == rewiden and ("widen_bf16(" in source) == rewiden, params
    # a backward's wait adds each partial's words itself (two float32s leave the spin for
    # LayerNorm's two sums); a forward's hands over the words
    summed = sums and params.block_rows == 1
    waits = [line for line in source.splitlines() if "tl.inline_asm_elementwise" in line
             and "vote.sync.all.pred" in line]  # fmt: skip
    assert len(waits) == 1, source  # one helper: softmax's two levels wait alike
    given = len(outputs) - 1 if summed else params.parts * (2 if name == "layernorm_fwd" else 1)
    kind = "=f" if summed else "=r"
    assert f'"{",".join([kind] * given)},l,r"' in waits[-1], waits[-1]
    if rewiden:
        post, wait = source.index(" = xpost0("), source.index(" = xwait1(")
        sums_added = [source.index(f"colsum{i} = colsum{i} + ") for i in range(len(outputs) - 1)]
        assert max(sums_added) < post and wait < source.index("widen_bf16(", wait), source


@pytest.mark.parametrize(
    ("name", "n"),
    [
        pytest.param(name, n, marks=[pytest.mark.slow] if n >= LARGE else [])
        for name in ("layernorm_fwd", "rmsnorm_fwd")
        for n in HIDDEN
    ],
)
def test_a_split_row_that_keeps_its_weights_as_bits_matches_the_reference(name, n):
    """Forced (``column_bits``, the H200's choice for LayerNorm forward split): the
    split forward's bf16 weights kept as their bits before the walk and widened in it,
    after the wait; 5 rows over two groups of programs, every output against the
    reference."""
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, INTERPRETER, [5, n], SPLIT)
    params = dataclasses.replace(params, column_bits=True)
    KERNEL_CACHE.clear()
    fd, inputs, outputs, _ = _run(name, n, "bfloat16", rows=5, params=params)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=n)
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    walk = source.index(" row_block in ")
    widened = [m.start() for m in re.finditer(r"widen_bf16_here\(", source)]
    assert len(widened) == (2 if name == "layernorm_fwd" else 1), source  # weight (bias)
    assert all(source.index(" = xwait", walk) < at for at in widened), source
    weights = [m.group(1) for m in re.finditer(r"widen_bf16_here\((\w+)\)", source)]
    assert all(source.index(f"{w} = ") < walk for w in weights), source  # bits loaded once
    unkept = dataclasses.replace(params, column_registers=False)  # read with each row
    with pytest.raises(ValueError, match="weights kept as bits are kept in registers"):
        scheduler.kernels(plan, unkept, [5, n])


@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=[pytest.mark.slow] if n >= LARGE else []) for n in HIDDEN]
)
def test_layernorm_forward_as_the_h200_splits_it_matches_the_reference(n):
    """Forced in the interpreter as the H200 takes it at 65536 columns: a row's programs a
    cluster (two of them over 5 rows), the weights as their bits, each slice's variance
    in one reduction (``one_pass``); every output against the reference, inputs about
    zero and moved: by 100 (a mean 100 times the spread: the squares reduced again about
    the slice's mean, where their difference would keep too little), by 10^4 and 10^19
    (constant rows in bf16; the second's sum of squares past float32's range)."""
    scheduler, plan = _plan("layernorm_fwd", n)
    params = scheduler.heuristics(plan, INTERPRETER, [5, n], SPLIT)
    params = dataclasses.replace(params, cluster=True, programs=2 * params.parts,
                                 column_bits=True, one_pass=True)  # fmt: skip
    KERNEL_CACHE.clear()
    for offset in (0.0, 100.0, 1e4, 1e19):
        fd, inputs, outputs, _ = _run("layernorm_fwd", n, "bfloat16", rows=5, params=params,
                                      offset=offset)  # fmt: skip
        for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
            assert_close(actual, expected, reduction_extent=n)
    assert KERNEL_CACHE.compilations == 1, KERNEL_CACHE.sources()  # one kernel for all
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    walk = source[source.index(" row_block in ") :]
    assert walk.count("tl.sum(tl.join(") == 1 and walk.count("tl.sum(") == 2, walk
    again = walk.index("if tl.max(tl.where(")
    assert again < walk.index(" = xpost") and "xwords" in source, walk  # then the post
    whole = dataclasses.replace(params, strategy=MULTIWAVE, parts=1, cluster=False,
                                column_bits=False, column_registers=False)  # fmt: skip
    with pytest.raises(ValueError, match="a variance in one pass is a split row's"):
        scheduler.kernels(plan, whole, [5, n])
    rms, rms_plan = _plan("rmsnorm_fwd", n)  # no variance to take in one pass
    plain = dataclasses.replace(rms.heuristics(rms_plan, INTERPRETER, [5, n], SPLIT),
                                one_pass=True)  # fmt: skip
    with pytest.raises(ValueError, match="a split row's with a variance"):
        rms.kernels(rms_plan, plain, [5, n])


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=[pytest.mark.slow] if n >= LARGE else []) for n in HIDDEN]
)
def test_split_backwards_as_the_h200_runs_them_match_the_reference(name, n):
    """Forced in the interpreter as the H200 takes them: a row's programs a cluster with
    column sums, as many clusters as the launch counts (two over 5 rows here), at the
    H200's parts where it splits into a cluster (six at 24576, sixteen at 65536), else
    CLUSTER_SUMS_PARTS; dx against the reference, the weight gradients against float64."""
    scheduler, plan = _plan(name, n)
    params = split_params(plan, H200, n)
    if not params.cluster:
        params = split_params(plan, H200, n, CLUSTER_SUMS_PARTS)
    assert params.cluster and not params.programs, params
    if n in (24576, 65536):
        assert params == split_params(plan, H200, n), params  # the H200's own choice
    fd, inputs, outputs, _ = _run(name, n, "bfloat16", rows=5, params=params)
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=n)
    exact = _weight_gradients_in_float64(name, inputs)
    for actual, wanted in zip(outputs[1:], exact, strict=True):
        assert_close(actual, wanted.to(torch.float32), reduction_extent=5)


@pytest.mark.parametrize("block_rows", [1, 2])
@pytest.mark.parametrize("n", [1000, 4096])
def test_a_variance_in_one_pass_is_reduced_again_where_the_difference_keeps_too_little(
    n, block_rows
):
    """The one pass's squares are reduced again about the slice's mean exactly where
    their difference keeps less than 1/ONE_PASS_LOSS of the sum of squares, for the
    whole block when any of its rows does: 5 rows of spread about 1, rows 0 and 3 moved
    by ``offset``. Moved by 4.5 or 10 (a sum of squares 21 and 101 times the squares
    about the mean) their block's rstd comes out bit for bit as in two reductions (the
    other row of a block of two too); by 3 (10 times) and about zero (rows kept in one
    pass) it does not."""
    scheduler, plan = _plan("layernorm_fwd", n)
    params = scheduler.heuristics(plan, INTERPRETER, [5, n], SPLIT)
    params = dataclasses.replace(params, cluster=True, programs=2 * params.parts,
                                 column_bits=True, block_rows=block_rows)  # fmt: skip
    fd = BUILDERS["layernorm_fwd"](n, "bfloat16")
    for offset in (3.0, 4.5, 10.0):
        inputs = make_inputs("layernorm_fwd", 5, n, torch.bfloat16, "cpu",
                             torch.Generator().manual_seed(n))  # fmt: skip
        inputs[0][[0, 3]] = (inputs[0][[0, 3]].float() + offset).to(torch.bfloat16)
        rstd = {}
        for one_pass in (True, False):
            forced = {"k0": dataclasses.replace(params, one_pass=one_pass)}
            executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params=forced)
            rstd[one_pass] = executor.run(inputs)[2]
        moved = [0, 3] + ([1, 2] if block_rows == 2 else [])  # blocks (0, 1), (2, 3)
        if offset > 4:  # reduced again
            assert torch.equal(rstd[True][moved], rstd[False][moved]), (offset, rstd)
        else:
            assert not torch.equal(rstd[True][[0, 3]], rstd[False][[0, 3]]), rstd
        kept = [4] if block_rows == 2 else [1, 2, 4]  # about zero: one pass
        assert not torch.equal(rstd[True][kept], rstd[False][kept]), (offset, rstd)
        assert_close(rstd[True], rstd[False], reduction_extent=n)


def test_a_variance_in_one_pass_whose_squares_pass_float32s_range_is_reduced_again():
    """A slice whose sum of squares passes float32's range (2^128) where its squares about
    its mean do not (2^64 and -2^56 in a row of zeros, in one slice): the difference of
    the one pass is inf (an inf less a finite square), so the squares are reduced again
    about the mean; the rstd comes out finite, as the reference's (kept, it was 0)."""
    scheduler, plan = _plan("layernorm_fwd", 1000)
    params = scheduler.heuristics(plan, INTERPRETER, [3, 1000], SPLIT)
    params = dataclasses.replace(params, cluster=True, programs=2 * params.parts,
                                 column_bits=True, one_pass=True)  # fmt: skip
    fd = BUILDERS["layernorm_fwd"](1000, "bfloat16")
    inputs = make_inputs("layernorm_fwd", 3, 1000, torch.bfloat16, "cpu",
                         torch.Generator().manual_seed(0))  # fmt: skip
    inputs[0][0] = 0.0
    inputs[0][0, :2] = torch.tensor([2.0**64, -(2.0**56)])
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    outputs, expected = executor.run(inputs), fd.execute(inputs)
    for actual, wanted in zip(outputs, expected, strict=True):
        assert_close(actual, wanted, reduction_extent=1000)
    rstd = [t for t in outputs if t.dtype == torch.float32 and t.ndim == 1][-1]
    assert 0 < rstd[0] < 1e-17 and torch.isfinite(rstd).all(), rstd


@pytest.mark.parametrize(
    ("dtype", "contracted"),
    [("bfloat16", True), ("float16", True), ("float32", True), ("float8_e4m3fn", False)],
)
def test_layernorm_backward_is_contracted_where_its_outputs_are_floats(dtype, contracted):
    """The H200's split LayerNorm backward at 65536 columns contracts its multiplies and
    adds where every output is a 16- or 32-bit float (within the tolerance its sums
    need); an fp8 dx (a code: one rounding may move it a whole step) keeps them apart.
    The reasons and the params' text say so."""
    scheduler, plan = _plan("layernorm_bwd", 65536, dtype)
    params = scheduler.heuristics(plan, H200, [4096, 65536])
    assert params.strategy == SPLIT and params.contract == contracted, params
    assert ("multiplies and adds contracted into fmas" in params.why) == contracted
    assert ("contract=True" in str(dataclasses.replace(params, why=""))) == contracted


@pytest.mark.parametrize("contract", [True, False])
def test_a_kernel_whose_params_contract_is_compiled_with_fmas(contract, monkeypatch):
    """``contract`` reaches the compiler: the normalization kernel is bound with
    ``enable_fp_fusion`` on (off, as every other kernel, without it); its outputs match
    the reference either way (the interpreter does not contract: on a GPU,
    ``test_ptx`` and ``check_gpu.py``)."""
    from schedulers import runtime

    bound = []
    plain = runtime.BoundKernel.__init__

    def recording(self, kernel, keywords, *args, **kwargs):
        bound.append((getattr(kernel, "__name__", str(kernel)), dict(keywords)))
        plain(self, kernel, keywords, *args, **kwargs)

    monkeypatch.setattr(runtime.BoundKernel, "__init__", recording)
    params = NormalizationParams(1, 256, 2, True, programs=8, strategy=SPLIT, parts=2,
                                 column_registers=True, contract=contract)  # fmt: skip
    _check_eleven_rows_of_500("layernorm_bwd", params)
    options = [keywords for name, keywords in bound if "normalization_kernel" in name]
    assert options and all(o["enable_fp_fusion"] is contract for o in options), bound
    others = [keywords for name, keywords in bound if "normalization_kernel" not in name]
    assert others and not any(o["enable_fp_fusion"] for o in others), bound


@pytest.mark.parametrize("column_registers", [True, False])
def test_a_split_row_with_two_rows_a_block_and_no_prefetch(column_registers):
    """Other params than the heuristics': two rows a block (their partials exchanged
    together), 4 programs a row of 500, no prefetch, a grid capped at 2 groups: 11 rows;
    the weights kept in registers or read with each row."""
    params = NormalizationParams(2, 128, 2, True, programs=8, strategy=SPLIT,
                                 column_registers=column_registers, parts=4)  # fmt: skip
    for name in ("layernorm_bwd", "softmax_fwd"):
        _check_eleven_rows_of_500(name, params)


def _check_eleven_rows_of_500(name: str, params: NormalizationParams) -> None:
    """``name`` with ``params`` over 11 rows of 500 columns against the reference (a
    backward's weight gradients against float64 arithmetic)."""
    fd, inputs, outputs, _ = _run(name, 500, "bfloat16", rows=11, params=params)
    expected = fd.execute(inputs)
    assert_close(outputs[0], expected[0], reduction_extent=500)
    if name == "layernorm_bwd":
        exact = _weight_gradients_in_float64(name, inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=11)


@pytest.mark.parametrize("block_rows", [1, 2])
def test_a_split_row_exchanging_through_a_clusters_shared_memory(block_rows):
    """Forced (``cluster=True``): compiled, a row's programs are a thread-block cluster:
    each declares its exchange words (static shared memory) and zeroes them, the cluster
    waits at its barrier, then a program stores its partials into every program's words
    (one row a block: a thread a program) and polls its own; the barrier again before
    it leaves. The interpreter runs the same words' arithmetic on a block of global
    memory a program (the ``INTERPRETED`` branch): every output against the reference,
    11 rows over 2 groups, softmax forward's two rounds a row too."""
    params = NormalizationParams(block_rows, 128, 2, True, programs=8, strategy=SPLIT,
                                 column_registers=True, parts=4, cluster=True)  # fmt: skip
    for name in ("layernorm_bwd", "rmsnorm_fwd", "layernorm_fwd", "softmax_fwd"):
        KERNEL_CACHE.clear()
        _check_eleven_rows_of_500(name, params)
        rounds = 2 if name == "softmax_fwd" else 1  # its max, then its sum
        (text,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
        # declared once, a multiple of 1024 bytes: the dynamic shared memory after it
        # holds TMA tiles on 1024-byte boundaries (64 bytes faulted on an H200)
        assert text.count(".shared .align 1024 .b8 xwords[1024]") == 1, text
        # the start's, the post's and the wait's (one of each, for every round)
        assert text.count("mov.u32 a, xwords;") == 3, text
        assert text.count(" = xwait") == rounds, text
        assert text.count("barrier.cluster.arrive.release") == 2, text
        assert "xstart = xstart0(" in text.split(" row_block in ")[0]  # before the walk
        last = text[text.index("def normalization_kernel") :].rstrip().splitlines()[-1]
        assert last.startswith("    xbarrier"), last  # the kernel's last line, not in the walk
        assert "mapa.shared::cluster.u32" in text and "%cluster_ctarank" in text
        assert "st.relaxed.cluster.shared::cluster.b64" in text
        assert "ld.relaxed.cluster.shared::cta.b64" in text and "ld.relaxed.gpu.global" not in text
        assert ("setp.ge.u32 q, t, 4;" in text) == (block_rows == 1)  # a thread a program
    # 9-15 programs: past the portable 8, and the launch asks for more only at 16; one
    # has nothing to exchange
    _, plan = _plan("rmsnorm_fwd", 500)
    for parts in (1, 12):
        with pytest.raises(ValueError, match="holds 2, 3, 4, 5, 6, 7, 8, 16 of them"):
            source(plan, dataclasses.replace(params, parts=parts))


def test_a_split_forward_exchanges_through_global_memory_where_clusters_cannot_launch(
    monkeypatch,
):
    """Clusters only on sm_90 (measured there) and where ``BoundKernel`` can launch them
    (``cluster_launches``: straight to a Triton 3.6 compiled kernel): otherwise the
    programs exchange through global memory, as many as the device holds."""
    scheduler, plan = _plan("rmsnorm_fwd", 65536)
    assert scheduler.heuristics(plan, H200, [4096, 65536]).cluster
    for profile in (B200, H200):
        if profile is H200:
            monkeypatch.setattr(split, "cluster_launches", lambda: False)
        params = split_params(plan, profile, 65536)
        assert params.strategy == SPLIT and not params.cluster and params.programs == 0, params
        assert "as many programs as the device holds at once" in params.why


@pytest.mark.parametrize("parts", list(CLUSTER_SIZES))
def test_a_clusters_grid_is_whole_clusters(parts):
    """One partial a round: CLUSTERS_PER_SM clusters an SM; more (a variance's two): as
    many whole clusters as CLUSTER_PROGRAMS_PER_SM programs an SM hold, at least one."""
    for sm_count in (132, 114, 148, 1):
        one = cluster_programs(parts, sm_count)
        assert one == parts * sm_count * CLUSTERS_PER_SM
        two = cluster_programs(parts, sm_count, 2)
        most = CLUSTER_PROGRAMS_PER_SM * sm_count
        assert two % parts == 0 and (most - parts < two <= most or two == parts), two


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_a_split_row_in_three_pipelined_slices(name):
    """The column sums' split as the heuristics give it (no prefetch, loads pipelined
    SPLIT_SUMS_STAGES rows deep), over a number of programs a row that is not a power of
    two (three slices of 512, the last one ragged, as 12288 columns in three of 4096):
    7 rows, each output against the reference, the column sums against float64."""
    params = NormalizationParams(1, 512, 1, True, 0, SPLIT_SUMS_STAGES, strategy=SPLIT,
                                 column_registers=True, parts=3)  # fmt: skip
    fd, inputs, outputs, executor = _run(name, 1300, "bfloat16", rows=7, params=params)
    text = source(_plan(name, 1300)[1], params)  # the walk pipelined by Triton, no prefetch
    assert f"num_stages={SPLIT_SUMS_STAGES})" in text and "tl.range(group," in text
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=1300)
    exact = _weight_gradients_in_float64(name, inputs)
    for actual, wanted in zip(outputs[1:], exact, strict=True):
        assert_close(actual, wanted.to(torch.float32), reduction_extent=7)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 7, 8, 12, 16, 17, 32])
def test_a_waits_sums_add_the_words_in_the_order_the_kernel_would(count):
    """The fixed order of a split row's partials (``_pairwise``: pairs of neighbours, then
    pairs of those, a leftover carried to the end), which both ``combine_in_order`` (the
    kernel's additions) and the summed wait follow: its steps, and the kernel's lines run
    in float32, against that order written out level by level here, bit for bit, on
    values whose sum depends on the order (float32 addition is not associative); added
    left to right they differ."""
    import numpy as np

    from schedulers.normalization.exchange import _pairwise

    rng = np.random.default_rng(count)
    # 2**24, 1, 1, -2**24 first: left to right the ones are lost (0), in pairs one is not
    head = [2.0**24, 1.0, 1.0, -(2.0**24)]
    words = {f"w{i}": np.float32(head[i] if i < 4 else rng.uniform(1, 3)) for i in range(count)}
    names = list(words)
    level = list(words.values())  # the order, level by level
    while len(level) > 1:
        pairs = [np.float32(a + b) for a, b in zip(level[::2], level[1::2], strict=False)]
        level = pairs + level[len(pairs) * 2 :]
    waited = dict(words)
    steps = _pairwise(names, "s")
    for out, a, b in steps:
        waited[out] = np.float32(waited[a] + waited[b])
    got = waited[steps[-1][0]] if steps else waited[names[0]]
    kernel = _added_in_combine_order(words)
    assert got.tobytes() == level[0].tobytes() == kernel.tobytes(), (got, level, kernel)
    assert len(steps) == count - 1
    if count == 5:
        assert steps == [("s0", "w0", "w1"), ("s1", "w2", "w3"), ("s2", "s0", "s1"),
                         ("s3", "s2", "w4")], steps  # fmt: skip
    if count >= 5:  # left to right: another order, other bits
        ordered = words[names[0]]
        for name in names[1:]:
            ordered = np.float32(ordered + words[name])
        assert ordered.tobytes() != got.tobytes(), (ordered, got)


def _added_in_combine_order(words: dict):
    """``words`` (name -> float32) added as the kernel adds a split row's partials
    (``combine_in_order``'s lines, run in float32)."""
    import numpy as np

    from schedulers.codegen import Emitter
    from schedulers.normalization.exchange import combine_in_order

    emit, values = Emitter(), dict(words)
    total = combine_in_order(emit, "add", list(words))
    for line in emit.lines:
        out, expression = line.split(" = ")
        a, b = expression.split(" + ")
        values[out] = np.float32(values[a] + values[b])
    return values[total]


def _run_summed_wait_asm(text: str, lanes: list) -> list:
    """The summed wait's PTX after its spin (``_summed_shuffles``) run on one warp's ``lo``
    words (``lanes``, float32): shuffles, moves and additions in order; its outputs."""
    import numpy as np

    values: dict[str, np.float32] = {}
    outputs: dict[int, np.float32] = {}
    for statement in (part.strip() for part in text.split(";")):
        if not statement or statement.startswith(".reg"):
            continue
        op, _, rest = statement.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == "shfl.sync.idx.b32":  # i, lo, lane, 0x1f, -1
            values[args[0]] = lanes[int(args[2])]
        elif op in ("mov.b32", "mov.f32") and args[0].startswith("$"):
            outputs[int(args[0][1:])] = values[args[1]]
        elif op in ("mov.b32", "mov.f32"):
            values[args[0]] = values[args[1]]
        elif op == "add.rn.f32":
            values[args[0]] = np.float32(values[args[1]] + values[args[2]])
        else:
            raise AssertionError(f"an instruction the summed wait does not use: {statement}")
    return [outputs[k] for k in range(len(outputs))]


@pytest.mark.parametrize(("parts", "count"), [(2, 1), (3, 2), (6, 2), (8, 2), (16, 2), (17, 1)])
def test_a_summed_wait_adds_each_partials_words_from_its_own_lanes(parts, count):
    """The compiled summed wait (its PTX after the spin, run instruction by instruction)
    and its interpreted branch (the Triton lines, run on float32 words) give, for each
    partial k, the words of lanes p * count + k added in ``combine_in_order``'s order, bit
    for bit: a lane off by one, or another order, gives other bits here."""
    import numpy as np

    from schedulers.normalization.exchange import _summed_shuffles, wait_source

    words = parts * count
    head = [2.0**24, 1.0, 1.0, -(2.0**24)]  # where a one is lost depends on the order
    rng = np.random.default_rng(words)
    lanes = [np.float32(head[i // count] * (i % count + 1) if i // count < 4
                        else rng.uniform(1, 3) + i) for i in range(words)]  # fmt: skip
    expected = [_added_in_combine_order({f"w{p}": lanes[p * count + k] for p in range(parts)})
                .tobytes() for k in range(count)]  # fmt: skip
    compiled = _run_summed_wait_asm(_summed_shuffles(parts, count), lanes)
    assert [v.tobytes() for v in compiled] == expected
    # the interpreted branch: its additions after the words are picked out
    source = wait_source("xwait", parts, 2 if count == 2 else 1, count, 1, summed=True)
    interpreted = {f"w{i}": lanes[i] for i in range(words)}
    returned = None
    for line in (line.strip() for line in source.split("else:")[0].splitlines()):
        if line.startswith("return "):
            returned = [name.strip() for name in line[len("return ") :].split(",")]
        elif addition := re.fullmatch(r"(s\d+_\d+) = (\w+) \+ (\w+)", line):
            out, a, b = addition.groups()
            interpreted[out] = np.float32(interpreted[a] + interpreted[b])
    assert [interpreted[name].tobytes() for name in returned] == expected


def test_a_split_row_whose_warps_may_hold_copies_of_it_waits_at_a_barrier():
    """Where a slice is narrower than 256 columns a warp, warps may each hold the whole row
    and reduce it without crossing warps: the block waits at a barrier after the
    exchange's wait, so no thread reads a row's slots after a partner reused them. The
    heuristics' slices (2048 columns over 2 warps, 4096 over 4, 8192 over 4-16) have none."""
    scheduler, plan = _plan("layernorm_bwd", 16384)
    chosen = scheduler.heuristics(plan, H200, [8192, 16384], SPLIT)
    assert chosen.block_columns >= 256 * chosen.num_warps, chosen
    # 32 programs a row: more than a cluster holds, through global memory
    narrow = dataclasses.replace(chosen, block_columns=512, parts=32, num_warps=4, cluster=False)
    assert "tl.debug_barrier()" not in source(plan, chosen)
    assert source(plan, narrow).count("tl.debug_barrier()") == 1
    # the H200's cluster of 8 programs, its slices over 16 warps: the barrier too
    assert chosen.cluster and chosen.parts == 8, chosen
    clustered = dataclasses.replace(chosen, num_warps=16)
    assert source(plan, clustered).count("tl.debug_barrier()") == 1


@pytest.mark.parametrize(
    ("name", "n", "strategy", "kernels"),
    # the split kernel and the combining one; the column walk's rows, strips and combining
    # (at 16384 columns a row in 2, 2 and 1 parts, as many as the rows leave room for: the
    # rows' and strips' kernels of a row in parts, and of a row in one, two forms at most)
    [("rmsnorm_bwd", 1000, SPLIT, 2), ("layernorm_bwd", 1000, COLUMN_WALK, 3),
     ("rmsnorm_bwd", 16384, COLUMN_WALK, 5)],
)  # fmt: skip
def test_a_forced_strategy_s_kernels_are_reused_across_batch_sizes(name, n, strategy, kernels):
    fd = BUILDERS[name](n, "bfloat16")
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": strategy})
    generator = torch.Generator().manual_seed(4)
    KERNEL_CACHE.clear()
    for rows in (1, 3, 8):  # the column walk: 1, 3 and 4 groups of rows (their partials)
        inputs = make_inputs(name, rows, n, torch.bfloat16, "cpu", generator)
        outputs = executor.run(inputs)
        assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=n)
        exact = _weight_gradients_in_float64(name, inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=rows)
    assert KERNEL_CACHE.compilations == kernels, KERNEL_CACHE.sources()


@pytest.mark.parametrize(
    ("name", "n", "parts", "clustered"),
    [("rmsnorm_bwd", 16384, 4, False), ("rmsnorm_bwd", 24576, 6, True),
     ("layernorm_bwd", 12288, 6, True), ("layernorm_bwd", 16384, 8, True),
     ("rmsnorm_bwd", 32768, 8, True), ("layernorm_bwd", 32768, 8, True),
     ("rmsnorm_bwd", 65536, 16, True), ("layernorm_bwd", 65536, 16, True),
     ("rmsnorm_bwd", 40960, 10, False)],  # ten programs: no cluster's size
)  # fmt: skip
def test_split_backwards_are_clusters_on_the_h200_from_six_programs_a_row(name, n, parts,
                                                                            clustered):  # fmt: skip
    """A split row with column sums forms a cluster on the H200 (fast memory) where a row
    has CLUSTER_SUMS_PARTS programs or more and a cluster holds them (6-8 or 16), its grid
    left to the launch (as many clusters as the device holds at once, the driver's count),
    said in the reasons; with fewer programs, and on the H100, the exchange stays in
    global memory, its grid set."""
    scheduler, plan = _plan(name, n)
    for rows in (2048, 8192):
        h200 = scheduler.heuristics(plan, H200, [rows, n])
        assert h200.strategy == SPLIT and h200.parts == parts, h200
        assert h200.cluster == clustered and (h200.programs == 0) == clustered, h200
        assert ("as many clusters as the device holds at once" in h200.why) == clustered
        h100 = scheduler.heuristics(plan, H100, [rows, n])
        assert h100.strategy == SPLIT and not h100.cluster and h100.programs > 0, h100


@pytest.mark.parametrize(
    ("name", "n", "rows", "parts", "warps", "profiles"),
    [
        ("rmsnorm_fwd", 65536, 4096, 8, 4, (H100, H200)),  # a forward: 64 values a thread
        # its variance in one round (the H200 walks it: the test after the next)
        ("layernorm_fwd", 65536, 4096, 8, 4, (H100,)),
        # column sums: 4096 columns a program over 4 warps
        ("rmsnorm_bwd", 65536, 4096, 16, 4, (H100, H200)),
        ("layernorm_bwd", 65536, 4096, 16, 4, (H100, H200)),
        # two partials, at most 16 words a round: 2048 columns a program over 2 warps
        ("layernorm_bwd", 16384, 8192, 8, 2, (H100, H200)),
        # six programs of 4096 columns (a forward's would be four of 8192, one empty)
        ("rmsnorm_bwd", 24576, 4096, 6, 4, (H100, H200)),
        ("layernorm_bwd", 12288, 4096, 6, 2, (H100, H200)),
    ],
)
def test_rows_that_do_not_fit_are_split_on_hopper(name, n, rows, parts, warps, profiles):
    """Where the multi-wave kernel would walk the row in chunks (and the warp-specialized
    one is degenerate), H100 and H200 split it: with column sums a program per 4096
    columns over 4 warps, its loads pipelined, its bf16 inputs widened again after the
    exchange, as many programs as the device holds of 12 warps an SM, exchanging through
    global memory (on the H200, where a row has CLUSTER_SUMS_PARTS programs or more: a
    cluster a row, as many as the device holds, counted at the launch); a forward a
    program per 8192 columns over 4 warps, through TMA (prefetched where TMA cannot
    stride its rows); RMSNorm's (one partial a row) a cluster a row exchanging through
    its shared memory, CLUSTERS_PER_SM clusters an SM. The interpreter keeps the chunks
    (its programs would run one at a time; with column sums the columns walked), as do
    rows that fit."""
    scheduler, plan = _plan(name, n)
    forward = not plan.column_sums  # its input through TMA, SPLIT_TMA_STAGES rows deep
    for profile in profiles:
        params = scheduler.heuristics(plan, profile, [rows, n])
        assert params.strategy == SPLIT and params.parts == parts, params
        # every backward here has 6, 8 or 16 programs a row: a cluster on the H200
        sums_clustered = not forward and profile is H200
        clustered = name == "rmsnorm_fwd" or sums_clustered
        # column sums: the bf16 inputs widened again after the exchange, at most
        # SPLIT_SUMS_WARPS_PER_SM warps an SM (fewer registers a thread: more fit)
        widened = profile.sm_count * (SPLIT_SUMS_WARPS_PER_SM // warps)
        programs = (parts * profile.sm_count * CLUSTERS_PER_SM if name == "rmsnorm_fwd"
                    else 0 if forward or sums_clustered else widened)  # fmt: skip
        assert params.num_warps == warps and params.programs == programs, params
        assert params.cluster == clustered and params.rewiden == (not forward), params
        # LayerNorm backward's two partials, on the H200: multiplies and adds contracted
        assert params.contract == (name == "layernorm_bwd" and profile is H200), params
        assert params.max_registers == 0, params  # the compiler's own count
        assert params.tma == forward and not params.prefetch, params
        assert params.stages == (SPLIT_TMA_STAGES if forward else SPLIT_SUMS_STAGES), params
        assert params.block_columns * parts >= n and "[instead of " in params.why
        if forward:  # rows TMA cannot stride (not a multiple of 16 bytes): prefetched
            odd = scheduler.heuristics(plan, profile, [rows, n - 1])
            assert odd.strategy == SPLIT and odd.prefetch and not odd.tma, odd
            assert odd.stages == 1, odd
    interpreted = scheduler.heuristics(plan, INTERPRETER, [rows, n])
    walked = COLUMN_WALK if plan.column_sums else MULTIWAVE
    assert interpreted.strategy == walked and not interpreted.persistent, interpreted
    fitting = scheduler.heuristics(plan, H200, [rows, 4096])
    assert fitting.strategy != SPLIT


@pytest.mark.parametrize(
    ("name", "n", "parts", "width", "warps"),
    [
        ("rmsnorm_bwd", 131072, 32, 4096, 4),  # one partial a program: 32 slices of 4096
        ("rmsnorm_bwd", 262144, 32, 8192, 8),  # 64 would be past the cap: wider slices
        ("layernorm_bwd", 131072, 16, 8192, 8),  # two partials a program: 16 at most
        ("layernorm_bwd", 135168, 9, 16384, 16),  # capped: as many wider slices as it fills
        ("layernorm_fwd", 262144, 16, 16384, 8),  # a forward's: a power of two, 64 values
    ],
)
def test_a_split_row_has_no_more_words_a_round_than_a_warp_polls(name, n, parts, width, warps):
    """A warp polls a round's words a lane each (``wait_source``), at most 32 (every
    thread loading every word was half as fast; LayerNorm backward over 32 programs, 64
    words, read 0.20-0.22 of copy on the H200): past that the slices widen, over more
    warps (32 values a thread with column sums, 64 without), none of them empty."""
    _, plan = _plan(name, n)
    params = split_params(plan, H200, n)
    assert (params.parts, params.block_columns, params.num_warps) == (parts, width, warps)
    assert params.parts * max(plan.exchanges.values()) <= 32
    assert (params.parts - 1) * params.block_columns < n <= params.parts * params.block_columns


def test_two_rounds_of_exchanges_keep_the_chunks():
    """An exchange a level a row: LayerNorm forward split with two (its mean, then its
    variance) took 0.31 of copy against 0.62 chunked (H200, 4096x65536), so a softmax
    (its max, then its sum) is walked in chunks."""
    scheduler, plan = _plan("softmax_fwd", 65536)
    assert plan.exchanges == {1: 1, 2: 1}
    params = scheduler.heuristics(plan, H200, [4096, 65536])
    assert params.strategy == MULTIWAVE and not params.persistent
    assert "not split: 2 levels of reductions" in params.why


def test_a_variance_and_its_mean_are_exchanged_in_one_round():
    """LayerNorm forward: the slices' sums and sums of squares about their own means,
    combined as Chan et al. do (one round, not a mean's then a variance's)."""
    scheduler, plan = _plan("layernorm_fwd", 65536)
    assert plan.depth == 2 and plan.exchanges == {1: 2}
    KERNEL_CACHE.clear()
    params = dataclasses.replace(scheduler.heuristics(plan, H200, [4096, 65536], SPLIT), why="")
    assert params.strategy == SPLIT, params
    # automatically split too on the H100: with 4 warps a slice, 0.87 of copy against
    # 0.68 in chunks (with 8 warps 0.60, which kept it in chunks before); the H200 walks
    # it (test_a_layernorm_forward_of_65536_columns_stays_in_chunks_on_the_h200)
    auto = scheduler.heuristics(plan, H100, [4096, 65536])
    assert auto.strategy == SPLIT and auto.num_warps == 4, auto
    small = dataclasses.replace(params, block_columns=256, num_warps=2)  # 4 of 8 slices empty
    fd, inputs, outputs, _ = _run("layernorm_fwd", 1000, "float32", rows=4, params=small)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=1000)
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    # one round: one post of two words (sum, squares), one wait
    assert source.count(" = xwait") == 1, source
    assert re.search(r"def xpost\d\(pointer, word, tag, v0, v1\):", source), source


def test_rmsnorm_backward_at_16384_is_split_in_four():
    """Its row (64 KiB of x and dy) held by one multi-wave program takes 16 warps, a
    program an SM, about 136 registers a thread against the 128 of a block of 512 threads
    (within the spill allowance). Split in four slices of 4096, loads pipelined, it read
    0.81-0.82 of copy against 0.76-0.78 on the H200, 0.91 against 0.90-0.92 on the H100
    (8192 rows; 4096 and 16384 rows measured too), so from ``SPLIT_SUMS_FROM`` columns
    rows with column sums are split, whatever the batch size (the rule does not look at
    it); the multi-wave kernel forced is still that row of 16 warps. At 12288
    columns (48 KiB rows) the multi-wave (0.78-0.79 of copy against 0.74 split in three,
    H200, 4096 rows) and warp-specialized kernels stay where they were chosen."""
    scheduler, plan = _plan("rmsnorm_bwd", 16384)
    narrower, narrower_plan = _plan("rmsnorm_bwd", 12288)
    for profile in (H100, H200):
        for rows in (1024, 8192, 32768):
            params = scheduler.heuristics(plan, profile, [rows, 16384])
            assert params.strategy == SPLIT and params.parts == 4, params
            assert params.num_warps == 4 and params.block_columns == 4096, params
            assert "split (rows of 16384 with column sums)" in params.why, params
            held = scheduler.heuristics(plan, profile, [rows, 16384], MULTIWAVE)
            assert (held.num_warps, held.block_rows, held.stages) == (16, 1, 1), held
            assert held.persistent and held.programs == profile.sm_count, held
        kept = narrower.heuristics(narrower_plan, profile, [32768, 12288])
        assert kept.strategy == WARP_SPECIALIZED, kept
        kept = narrower.heuristics(narrower_plan, profile, [4096, 12288])
        assert kept.strategy == MULTIWAVE and kept.persistent, kept


def test_the_spill_allowance_of_a_multi_wave_block():
    """A block over its share of the register file by at most ``SPILL_ALLOWANCE`` counts
    as one block an SM; LayerNorm backward at 16384 columns (two column sums: about 168
    registers against 128, 1.31 times over, measured 0.18 of copy) is not persistent."""
    scheduler, plan = _plan("layernorm_bwd", 16384)
    params = scheduler.heuristics(plan, H100, [8192, 16384], MULTIWAVE)
    assert not params.persistent, params


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [("float64", "integer and float64 reductions are not split")],
)
def test_a_forced_split_says_why_it_cannot_be(dtype, reason):
    """Its exchange carries float32 partials: a float64 row sum is refused."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 64], dtype)
        fd.add_output(x - fd.ops.sum(x, dims=[1], keepdim=True))
    (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    scheduler, plan = group.scheduler, group.plan
    with pytest.raises(NotSchedulable, match=reason):
        scheduler.heuristics(plan, H200, [8, 64], SPLIT)
    scheduler, plan = _plan("rmsnorm_fwd", 1000)
    with pytest.raises(NotSchedulable, match="needs sm_70 or later"):
        scheduler.heuristics(plan, replace_arch(H100, 60), [8, 1000], SPLIT)


class _Compiled:
    """What ``resident_programs`` reads of a compiled Triton kernel."""

    def __init__(self, registers: int, warps: int, shared: int) -> None:
        self.n_regs, self.metadata = (
            registers,
            dataclasses.make_dataclass("Metadata", ["num_warps", "shared"])(warps, shared),
        )

    def _init_handles(self) -> None:
        pass


@pytest.mark.parametrize(
    ("registers", "warps", "shared", "per_sm"),
    [
        (228, 8, 0, 1),  # 228 -> 232 registers a thread: 59392 a block of 8 warps
        (112, 8, 0, 2),
        (60, 8, 0, 4),
        (32, 4, 0, 16),  # by threads: 2048 / 128
        (32, 4, 100 * 1024, 2),  # by shared memory: 228 KiB
        (255, 16, 0, 0),  # 16 warps of 256 registers overflow the SM: none fit
    ],
)
def test_resident_programs_on_an_h100(registers, warps, shared, per_sm):
    from schedulers.occupancy import resident_programs

    assert resident_programs(_Compiled(registers, warps, shared), H100) == 132 * per_sm


def test_a_device_that_cannot_hold_a_row_s_programs_refuses_before_launching():
    """A grid capped below the programs a row needs would wait forever: refused."""
    params = NormalizationParams(1, 256, 2, True, programs=2, strategy=SPLIT,
                                 column_registers=True, parts=4)  # fmt: skip
    with pytest.raises(RuntimeError, match="fewer than the 4 that share a row"):
        _run("rmsnorm_fwd", 1000, "bfloat16", params=params)


def test_a_persistent_rows_two_sums_are_reduced_together():
    """LayerNorm backward's two sums of a row (of dy * w and of dy * w * x-hat) in one
    ``sum_pair`` where the row is persistent (one exchange between warps on a GPU; the
    interpreter sums each, so its GPU branch, a ``tl.reduce`` of a pair, runs only on
    GPUs: ``benchmarks/norms.py``, ``check_gpu.py``), each alone in a split row's slice;
    both match the reference with the weight gradients against float64."""
    scheduler, plan = _plan("layernorm_bwd", 1000)
    for strategy, pairs in ((WARP_SPECIALIZED, 1), (MULTIWAVE, 1), (SPLIT, 0)):
        KERNEL_CACHE.clear()
        params = scheduler.heuristics(plan, H200, [64, 1000], strategy)
        fd, inputs, outputs, _ = _run("layernorm_bwd", 1000, "bfloat16", rows=9,
                                      params=dataclasses.replace(params, why=""))  # fmt: skip
        assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=1000)
        exact = _weight_gradients_in_float64("layernorm_bwd", inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=9)
        (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
        assert source.count(" = sum_pair(") == pairs, (strategy, source)


@pytest.mark.parametrize(
    ("block_rows", "block_columns", "parts"), [(1, 32, 4), (2, 32, 4), (2, 16, 8), (4, 128, 2)]
)
def test_a_split_rows_exchange_keeps_special_values_and_the_sign_of_zero(
    block_rows, block_columns, parts
):
    """Forced split rows of a max, a min and a sum (and the row minus all three): rows with
    a NaN, infinities of either sign, a row of -0.0 and rows of one infinity, 9 rows
    over 2 groups. Every output as the reference's, signs of zero included (the
    exchanged partials' bits are picked out exactly, not by a float sum)."""
    rows, columns = 9, 100
    with FusionDefinition("special") as fd:
        x = fd.define_tensor([rows, columns], "float32")
        shifted = x
        for op in ("max", "min", "sum"):
            reduced = getattr(fd.ops, op)(x, dims=[1])
            fd.add_output(reduced)
            shifted = shifted - fd.ops.broadcast(reduced, [False, True])
        fd.add_output(shifted)
    values = torch.randn(rows, columns, generator=torch.Generator().manual_seed(5))
    values[0, 99], values[1, 0], values[2, 99] = float("nan"), float("inf"), -float("inf")
    values[3, 0], values[3, 99] = float("inf"), -float("inf")
    values[5], values[6], values[7] = -0.0, -float("inf"), float("inf")
    params = NormalizationParams(block_rows, block_columns, 1, True, 0, strategy=SPLIT,
                                 column_registers=True, parts=parts)  # fmt: skip
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    outputs = executor.run([values.clone()])
    for position, (actual, expected) in enumerate(
        zip(outputs, fd.execute([values.clone()]), strict=True)
    ):
        assert_close(actual, expected, reduction_extent=columns)
        assert torch.equal(torch.signbit(actual), torch.signbit(expected)), position


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_fwd", "softmax_fwd"])
@pytest.mark.parametrize(
    ("n", "block_rows", "block_columns", "parts"),
    [(1000, 2, 256, 4), (600, 2, 256, 4), (1000, 4, 128, 8), (1000, 1, 512, 2)],
)
def test_a_split_forward_through_tma_tiles(name, n, block_rows, block_columns, parts):
    """Forced split rows whose input comes through TMA descriptors, pipelined 3 deep:
    several rows a tile, a ragged last slice (1000 columns), an empty one (600 columns
    over 4 slices of 256), 7 rows over 2 groups (rows past the end)."""
    params = NormalizationParams(block_rows, block_columns, 2, True, 0, 3, strategy=SPLIT,
                                 column_registers=True, parts=parts, tma=True)  # fmt: skip
    KERNEL_CACHE.clear()
    fd, inputs, outputs, _ = _run(name, n, "bfloat16", rows=7, params=params)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=n)
    (source,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    assert ".load([row_block * BLOCK_ROWS, part * BLOCK_COLUMNS])" in source


# -- the column walk ----------------------------------------------------------------------


def _column_walk_grid() -> list[tuple[str, int, str]]:
    """Both backward ops over the issue's hidden sizes up to 4096 in bf16, and float32 and
    float16 at 1000. At 24576 and 65536 the interpreter's automatic choice is this walk
    (``test_rows_with_column_sums_walk_their_columns_where_nothing_splits``), so
    ``test_backward_matches_the_reference`` runs it there in every dtype (15-25 s a case)."""
    names = ("rmsnorm_bwd", "layernorm_bwd")
    cases = [(name, n, "bfloat16") for name in names for n in HIDDEN if n < LARGE]
    return cases + [(name, 1000, dtype) for name in names for dtype in ("float32", "float16")]


@pytest.mark.parametrize(("name", "n", "dtype"), _column_walk_grid())
def test_the_column_walk_matches_the_reference(name, n, dtype):
    """Forced: the rows' reductions first (their values kept in float32), then strips of
    columns walked down 5 rows. Every output, the column sums against float64."""
    rows = 5
    fd = BUILDERS[name](n, dtype)
    generator = torch.Generator().manual_seed(rows + n)
    inputs = make_inputs(name, rows, n, DTYPES[dtype], "cpu", generator)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": COLUMN_WALK})
    outputs = executor.run(inputs)
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=n)
    exact = _weight_gradients_in_float64(name, inputs)
    for actual, wanted in zip(outputs[1:], exact, strict=True):
        assert_close(actual, wanted.to(torch.float32), reduction_extent=rows)
    params = executor.chosen_params["k0"]
    assert params.strategy == COLUMN_WALK and not params.persistent, params
    assert params.strip_columns == min(2048, 1 << (n - 1).bit_length()), params


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_a_column_walk_of_ragged_strips_two_rows_a_block_and_three_groups(name):
    """Strips of 256 over 1000 columns (the last ragged), two rows a block, 12 programs:
    three groups of rows over the four strips, each group's partial rows added by the
    combining kernel; 17 rows (the last block half empty), not pipelined. The first
    kernel keeps no partial column sums; the second stores its once, after its walk."""
    params = NormalizationParams(2, 256, 4, False, programs=12, strategy=COLUMN_WALK,
                                 strip_columns=256, strip_warps=2)  # fmt: skip
    KERNEL_CACHE.clear()  # the sources checked below are this run's
    fd, inputs, outputs, executor = _run(name, 1000, "bfloat16", rows=17, params=params)
    assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=1000)
    exact = _weight_gradients_in_float64(name, inputs)
    for actual, wanted in zip(outputs[1:], exact, strict=True):
        assert_close(actual, wanted.to(torch.float32), reduction_extent=17)
    assert "strip_columns=256, strip_warps=2" in executor.kernel_report()
    sums = len(outputs) - 1
    (rows,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    assert "part0" not in rows and rows.count("tl.store(stash + ") == sums, rows
    (strips,) = [s for s in KERNEL_CACHE.sources() if "def column_kernel" in s]
    assert "tl.load(part" not in strips and strips.count("tl.store(part") == sums, strips
    walk = strips[strips.index("for row_block in range(group, ") :]  # one stage: range
    assert all(line.startswith("        ") for line in walk.splitlines()[1:-sums])
    assert all(line.startswith("    tl.store(part") for line in walk.splitlines()[-sums:])


@pytest.mark.parametrize(
    ("name", "n", "rows", "profile", "strategy", "reason"),
    [
        # LayerNorm's slices of 16384 (16 warps) do not fit an SM's registers
        ("layernorm_bwd", 135168, 1024, H200, COLUMN_WALK, "hold 0 rows at once"),
        ("layernorm_bwd", 135168, 1024, H100, COLUMN_WALK, "hold 0 rows at once"),
        ("layernorm_bwd", 262144, 512, H100, COLUMN_WALK, "hold 0 rows at once"),
        ("rmsnorm_bwd", 524288, 256, H200, COLUMN_WALK, "hold 0 rows at once"),
        # 32 programs of 8192 columns, one an SM: 4 rows, fewer than the H200's 5, not
        # than the H100's 3.5
        ("rmsnorm_bwd", 262144, 512, H200, COLUMN_WALK,
         "32 programs a row hold 4 rows at once, fewer than 5.0 on a device of 4300 GB/s"),
        ("rmsnorm_bwd", 262144, 512, H100, SPLIT, "split (the row does not fit"),
        ("rmsnorm_bwd", 196608, 1024, H200, SPLIT, "split (the row does not fit"),  # 5 rows
        ("layernorm_bwd", 131072, 2048, H200, SPLIT, "split (the row does not fit"),  # 8
        ("layernorm_bwd", 65536, 4096, H100, SPLIT, "split (the row does not fit"),
    ],
)  # fmt: skip
def test_rows_a_split_cannot_hold_walk_their_columns(name, n, rows, profile, strategy, reason):
    """Wide rows with column sums: split while its programs hold at least
    SPLIT_LEAST_ROWS rows at once on an H200 (by their estimated registers; in proportion
    to the memory's bandwidth elsewhere), the columns walked below that; every choice
    says why."""
    scheduler, plan = _plan(name, n)
    params = scheduler.heuristics(plan, profile, [rows, n])
    assert params.strategy == strategy and reason in params.why, params
    if strategy == COLUMN_WALK:
        assert "column walk (rows of " in params.why and "[instead of " in params.why
        assert (params.block_columns, params.num_warps, params.stages) == (8192, 8, 3)
        assert (params.strip_columns, params.strip_warps) == (2048, 4), params
        assert params.programs == 4 * profile.sm_count, params


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_rows_with_column_sums_walk_their_columns_where_nothing_splits(name):
    """Before sm_90 (no split) and in the interpreter, rows with column sums that do not
    fit the registers walk their columns instead of chunks; forwards keep the multi-wave
    kernel, and rows that fit keep the registers."""
    for n, profile in ((65536, replace_arch(H100, 80)), (24576, INTERPRETER),
                       (65536, INTERPRETER)):  # fmt: skip
        scheduler, plan = _plan(name, n)
        params = scheduler.heuristics(plan, profile, [4096, n])
        assert params.strategy == COLUMN_WALK, params
        assert "[instead of " in params.why, params
        assert f"a row of {n} does not fit in registers" in params.why, params
        forward_scheduler, forward = _plan(name.replace("_bwd", "_fwd"), n)
        kept = forward_scheduler.heuristics(forward, profile, [4096, n])
        assert kept.strategy == MULTIWAVE, kept  # in registers or in chunks
    scheduler, plan = _plan(name, 4096)
    assert scheduler.heuristics(plan, replace_arch(H100, 80), [4096, 4096]).persistent


def test_a_forced_column_walk_says_why_it_cannot_be():
    """It writes column sums, and keeps row values as float32."""
    scheduler, plan = _plan("rmsnorm_fwd", 1000)
    with pytest.raises(NotSchedulable, match="no column sums: the column walk writes them"):
        scheduler.heuristics(plan, H200, [8, 1000], COLUMN_WALK)
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 64], "float64")
        centred = x - fd.ops.sum(x, dims=[1], keepdim=True)
        fd.add_output(centred)
        fd.add_output(fd.ops.sum(centred, dims=[0]))
    (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    with pytest.raises(NotSchedulable, match="keeps row values as float32"):
        group.scheduler.heuristics(group.plan, H200, [8, 64], COLUMN_WALK)


def _two_level_column_sums(kind: str, n: int, dtype: str) -> FusionDefinition:
    """Column sums behind two levels of reductions: a variance with its mean (a
    LayerNorm forward's, and the column sums of y and of xhat rounded to ``dtype``), or
    a max then a sum (a softmax's, and the column sums of p)."""
    with FusionDefinition(kind) as fd:
        x = fd.define_tensor(["rows", n], dtype)
        xf = fd.ops.cast(x, "float32")
        if kind == "variance":
            var, mean = fd.ops.var_mean(xf, dims=[1], correction=1)
            rstd = fd.ops.rsqrt(var + 1e-5)
            xhat = (xf - fd.ops.broadcast(mean, [False, True])) * fd.ops.broadcast(
                rstd, [False, True]
            )
            fd.add_output(fd.ops.cast(xhat, dtype))
            fd.add_output(mean)
            fd.add_output(fd.ops.sum(xhat, dims=[0]))
            fd.add_output(fd.ops.sum(fd.ops.cast(xhat, dtype), dims=[0]))
        else:
            e = fd.ops.exp(xf - fd.ops.max(xf, dims=[1], keepdim=True))
            p = e / fd.ops.sum(e, dims=[1], keepdim=True)
            fd.add_output(fd.ops.cast(p, dtype))
            fd.add_output(fd.ops.sum(p, dims=[0]))
    return fd


def _bf16_weight_gradients(n: int) -> FusionDefinition:
    """LayerNorm's backward as autodiff writes it for bf16 parameters: dweight and dbias
    summed in float32 over the rows, then each cast to bf16 (the parameters' dtype)."""
    with FusionDefinition("bf16_weight_gradients") as fd:
        x = fd.define_tensor(["rows", n], "bfloat16")
        dy = fd.define_tensor(["rows", n], "bfloat16")
        w = fd.define_tensor([n], "bfloat16")
        xf, dyf = fd.ops.cast(x, "float32"), fd.ops.cast(dy, "float32")
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0)
        r = fd.ops.broadcast(fd.ops.rsqrt(var + 1e-5), [False, True])
        xhat = (xf - fd.ops.broadcast(mean, [False, True])) * r
        g = dyf * fd.ops.broadcast(fd.ops.cast(w, "float32"), [True, False])
        mean_g = fd.ops.mean(g, dims=[1], keepdim=True)
        projection = fd.ops.mean(g * xhat, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(r * (g - mean_g - xhat * projection), "bfloat16"))
        fd.add_output(fd.ops.cast(fd.ops.sum(dyf * xhat, dims=[0]), "bfloat16"))
        fd.add_output(fd.ops.cast(fd.ops.sum(dyf, dims=[0]), "bfloat16"))
    return fd


@pytest.mark.parametrize("strategy", [None, COLUMN_WALK])
def test_column_sums_cast_to_their_outputs_dtype_stay_in_the_kernel(strategy):
    """A column sum read only by a cast that is an output writes the cast's dtype: the
    combining kernel rounds the float32 total once, as the cast does, and the row
    reductions, dx and both weight gradients stay one kernel (a column walk's too)."""
    n, rows = 300, 5
    fd = _bf16_weight_gradients(n)
    (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    plan = group.plan
    assert [t.dtype.name for t in plan.column_outputs] == ["bfloat16", "bfloat16"]
    assert plan.column_outputs == fd.fusion.outputs[1:]
    params = group.scheduler.heuristics(plan, INTERPRETER, [rows, n], strategy)
    generator = torch.Generator().manual_seed(11)
    inputs = [torch.randn(rows, n, generator=generator).to(torch.bfloat16) for _ in range(2)]
    inputs.append((1 + 0.1 * torch.randn(n, generator=generator)).to(torch.bfloat16))
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    outputs = executor.run(inputs)
    report = executor.kernel_report()
    assert report.startswith("k0 [normalization]") and "\n" not in report, report
    assert all(output.dtype == torch.bfloat16 for output in outputs)
    extents = [n, rows, rows]  # dx reduces over the row, the weight gradients the rows
    for actual, wanted, extent in zip(outputs, fd.execute(inputs), extents, strict=True):
        assert_close(actual, wanted, reduction_extent=extent)


def test_a_column_sum_read_by_more_than_its_cast_is_not_a_normalization_output():
    """The float32 sum used again (here: also an output itself) is not rounded into its
    cast's dtype: the column sum leaves the normalization kernel, said why."""
    with FusionDefinition("sum_kept_and_cast") as fd:
        x = fd.define_tensor(["rows", 64], "float32")
        centred = x - fd.ops.mean(x, dims=[1], keepdim=True)
        fd.add_output(centred)
        total = fd.ops.sum(centred, dims=[0])
        fd.add_output(total)
        fd.add_output(fd.ops.cast(total, "bfloat16"))
    scheduler = NormalizationScheduler()
    inputs, outputs = fd.fusion.boundary(fd.fusion.exprs)
    with pytest.raises(NotSchedulable, match=r"must be an output \(or cast to one\), unused"):
        scheduler.plan(fd.fusion.exprs, inputs, outputs)


@pytest.mark.parametrize("n", [300, 1000])
def test_a_split_row_adds_before_its_exchange_only_the_column_sums_that_need_no_reduction(n):
    """A variance computed in the kernel, and two column sums: of dy * xhat (after the
    variance's exchange) and of dy (none needed: added before it). Forced split over 2
    programs, the bf16 inputs widened again after the exchange; the wait hands over the
    words (a variance's partials are combined by Chan's rule, not summed). Every output
    against the reference over 5 rows."""
    with FusionDefinition("centred") as fd:
        x = fd.define_tensor(["rows", n], "bfloat16")
        dy = fd.define_tensor(["rows", n], "bfloat16")
        xf, dyf = fd.ops.cast(x, "float32"), fd.ops.cast(dy, "float32")
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0)
        rstd = fd.ops.rsqrt(var + 1e-5)
        xhat = (xf - fd.ops.broadcast(mean, [False, True])) * fd.ops.broadcast(rstd, [False, True])
        fd.add_output(fd.ops.cast(dyf * xhat, "bfloat16"))
        fd.add_output(fd.ops.sum(dyf * xhat, dims=[0]))
        fd.add_output(fd.ops.sum(dyf, dims=[0]))
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    plan = group.plan
    assert plan.unreduced_column_sums == [False, True]
    params = split_params(plan, INTERPRETER, n, 2)
    assert params.rewiden, params
    source_text = source(plan, params)
    post, wait = source_text.index(" = xpost0("), source_text.index(" = xwait1(")
    assert source_text.index("colsum1 = colsum1 + ") < post, source_text
    assert source_text.index("colsum0 = colsum0 + ") > wait, source_text
    assert '"=r,=r,=r,=r,l,r"' in source_text, source_text  # 2 programs x 2 partials: words
    generator = torch.Generator().manual_seed(n)
    inputs = [torch.randn(5, n, generator=generator).to(torch.bfloat16) for _ in range(2)]
    KERNEL_CACHE.clear()
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    for actual, wanted in zip(executor.run(inputs), fd.execute(inputs), strict=True):
        assert_close(actual, wanted, reduction_extent=max(5, n))


@pytest.mark.parametrize("kind", ["variance", "max_then_sum"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_column_walk_behind_two_levels_of_reductions(kind, dtype):
    """Forced over 9 rows of 300: the first kernel walks each row once a level (the
    variance after its mean, the sum after the max) and keeps every level's row values;
    the strips read them back. Every output against the reference."""
    fd = _two_level_column_sums(kind, 300, dtype)
    generator = torch.Generator().manual_seed(6)
    inputs = [(3 * torch.randn(9, 300, generator=generator) + 1).to(DTYPES[dtype])]
    params = NormalizationParams(2, 128, 4, False, programs=6, strategy=COLUMN_WALK,
                                 strip_columns=64, strip_warps=2)  # fmt: skip
    KERNEL_CACHE.clear()
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    for actual, expected in zip(executor.run(inputs), fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=300)
    (rows,) = [s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s]
    assert rows.count("for start in range(0, COLUMNS, BLOCK_COLUMNS)") == 2, rows
    assert rows.count("tl.store(stash + ") == 2, rows  # both levels' row values


@pytest.mark.parametrize(
    ("fields", "reason"),
    [({"strip_columns": 0}, "power of two"), ({"strip_columns": 24}, "power of two"),
     ({"strip_warps": 0}, "strip_warps at least 1")],
)  # fmt: skip
def test_a_column_walk_s_strips_are_checked_before_launching(fields, reason):
    scheduler, plan = _plan("rmsnorm_bwd", 1000)
    params = dataclasses.replace(scheduler.heuristics(plan, H200, [8, 1000], COLUMN_WALK),
                                 **fields)  # fmt: skip
    with pytest.raises(ValueError, match=reason):
        scheduler.launcher(plan, params, H200, None)


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
@pytest.mark.parametrize("block_rows", [1, 2])
def test_a_column_walk_s_rows_reduced_in_parts(name, block_rows):
    """At most 3 parts a row (of 8 steps of 128 columns over 1000): the interpreter's
    profile (one SM, 4 programs) takes 3 parts for one row block, 2 for two (the same
    kernels: the parts are runtime arguments), 1 for five (the kernels of a row in one
    part, compiled then); each part's sums stored unfinished, the strips add them in a
    fixed order and finish them (a mean's division). Every output against the reference,
    the column sums against float64."""
    params = NormalizationParams(block_rows, 128, 4, False, programs=8, parts=3,
                                 strategy=COLUMN_WALK, strip_columns=256,
                                 strip_warps=2)  # fmt: skip
    fd = BUILDERS[name](1000, "bfloat16")
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    generator = torch.Generator().manual_seed(7)
    KERNEL_CACHE.clear()  # the sources checked below are this run's
    for blocks, parts in ((1, 3), (2, 2), (5, 1)):
        assert row_parts(params, INTERPRETER, blocks * block_rows, 1000)[0] == parts
        inputs = make_inputs(name, blocks * block_rows, 1000, torch.bfloat16, "cpu", generator)
        outputs = executor.run(inputs)
        assert_close(outputs[0], fd.execute(inputs)[0], reduction_extent=1000)
        exact = _weight_gradients_in_float64(name, inputs)
        for actual, wanted in zip(outputs[1:], exact, strict=True):
            assert_close(actual, wanted.to(torch.float32), reduction_extent=blocks * block_rows)
    assert KERNEL_CACHE.compilations == 5, KERNEL_CACHE.sources()  # two forms, combining
    plan = _plan(name, 1000)[1]
    whole = dataclasses.replace(params, parts=1)
    rows = sorted((s for s in KERNEL_CACHE.sources() if "def normalization_kernel" in s), key=len)
    assert rows == sorted([source(plan, params), source(plan, whole)], key=len)
    parted = source(plan, params)
    assert "for offset in range(0, part_steps * BLOCK_COLUMNS, BLOCK_COLUMNS)" in parted
    assert "div(" not in parted and "div(" in source(plan, whole)
    (strips,) = [s for s in KERNEL_CACHE.sources()
                 if "def column_kernel" in s and "row_parts" in s]  # fmt: skip
    assert "(rows[:, None] * row_parts + parts[None, :])" in strips and "div(" in strips


def test_rows_too_few_to_fill_the_device_are_reduced_in_parts():
    """The params allow a part a step (32 at 262144 columns, steps of 8192); a launch takes
    as many as fill ROW_PROGRAMS programs an SM, of whole steps, none empty: on an H200 64
    rows 8 parts of 4 steps (9 asked), 512 rows 2, 1024 rows 1, 8 rows 32. A variance
    (two levels) is never taken in parts, and forced parts of it are refused before
    launching."""
    scheduler, plan = _plan("layernorm_bwd", 262144)
    params = scheduler.heuristics(plan, H200, [64, 262144])
    assert params.strategy == COLUMN_WALK and params.parts == 32, params
    assert "in up to 32 parts a row where rows are few" in params.why, params.why
    assert scheduler.heuristics(plan, H200, [4096, 262144]) == params  # not of the rows
    for rows, parts in ((64, 8), (512, 2), (1024, 1), (8, 32)):
        assert row_parts(params, H200, rows, 262144) == (parts, 262144 // parts), rows
    fd = _two_level_column_sums("variance", 262144, "bfloat16")
    (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
    params = group.scheduler.heuristics(group.plan, H200, [64, 262144], COLUMN_WALK)
    assert params.parts == 1, params
    with pytest.raises(ValueError, match="reduced in parts"):
        group.scheduler.launcher(group.plan, dataclasses.replace(params, parts=2), H200, None)


@pytest.mark.parametrize(
    ("columns", "most", "parts", "width"),
    [
        (262144, 4, 4, 1024),  # a column walk's 4 groups: 4 rows a step, 1024 columns
        (1024, 396, 256, 16),  # three programs an SM: tiles of 256 rows, 16 columns
        (65536, 16, 16, 256),  # a split's 16 groups
        (96, 2, 2, 128),  # the row, to a power of two
        (7, 1, 1, 16),  # never narrower than COMBINE_COLUMNS
    ],
)
def test_the_combining_kernel_takes_as_many_rows_a_step_as_there_are(columns, most, parts, width):
    """Fewer partial rows than COMBINE_PARTS: as many a step, and the columns widened to
    keep the tile (4 rows of 262144 in 256-row tiles took 72 us on the H200)."""
    for dependent in (False, True):
        fixed = combine_constants(columns, most, dependent=dependent)
        assert fixed == {"COLUMNS": columns, "BLOCK_COLUMNS": width, "PARTS": parts,
                         "DEPENDENT": dependent}, fixed  # fmt: skip


def test_inputs_changed_under_check_inputs_never_raise_instead_of_being_misread():
    """A kernel outside loops has its launch bound to its program's shapes: with
    ``check_inputs="never"`` an input of other rows or another dtype raises, naming the
    setting, rather than be read as the program's."""
    fd = BUILDERS["rmsnorm_fwd"](96, "bfloat16")
    executor = MultiDeviceExecutor(fd, kernels="generated")
    generator = torch.Generator().manual_seed(4)
    x, w = make_inputs("rmsnorm_fwd", 8, 96, torch.bfloat16, torch.device("cpu"), generator)
    for actual, expected in zip(executor.run([x, w]), fd.execute([x, w]), strict=True):
        assert_close(actual, expected, reduction_extent=96)
    for changed in (torch.cat([x, x]), x.half()):
        with pytest.raises(RuntimeError, match="check_inputs='changes'"):
            executor.run([changed, w], check_inputs="never")


def test_a_launcher_keeps_the_shapes_launched_last():
    """Bound launches are kept for the ``BOUND_SHAPES`` shapes launched last: a shape in
    use stays however many others come and go."""
    from schedulers.normalization.scheduler import BOUND_SHAPES

    fd = BUILDERS["rmsnorm_fwd"](96, "bfloat16")
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    params = group.scheduler.heuristics(group.plan, INTERPRETER, [8, 96])
    launcher = group.scheduler.launcher(group.plan, params, INTERPRETER, None)
    x = group.plan.inputs[0]
    used = launcher.bind({x: [8, 96]})
    for rows in range(9, 9 + 2 * BOUND_SHAPES):
        launcher.bind({x: [rows, 96]})
        assert launcher.bind({x: [8, 96]}) is used
    assert len(launcher.bound) == BOUND_SHAPES


@pytest.mark.parametrize(
    ("device", "arch", "interpreted", "dependent"),
    [
        ("cuda", 90, False, True),  # H200: a programmatic dependent launch
        ("cuda", 80, False, False),  # no griddepcontrol before sm_90
        ("cuda", 90, True, False),  # Triton's interpreter runs no PTX
        ("cpu", 90, False, False),
    ],
)
def test_the_combining_kernel_waits_on_the_kernel_before_it_only_on_sm_90_and_later(
    monkeypatch, device, arch, interpreted, dependent
):
    """The launcher launches the combining kernel with ``launch_pdl`` and ``DEPENDENT``
    together (a wait without the dependent launch would only cost; a dependent launch
    without the wait would read partial rows still being written), only for CUDA
    tensors, compiled code and sm_90 or later."""
    from types import SimpleNamespace

    from schedulers.normalization import scheduler

    fd = BUILDERS["layernorm_bwd"](1024, "bfloat16")
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    profile = dataclasses.replace(H200, arch=arch)
    params = group.scheduler.heuristics(group.plan, profile, [32768, 1024])
    # what the launcher asks (setting Triton's knob would pin it past the test: a knob
    # set, then set back, no longer follows TRITON_INTERPRET)
    monkeypatch.setattr(scheduler, "interpreted", lambda: interpreted)
    launcher = group.scheduler.launcher(group.plan, params, profile, None)
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *arguments, **options: calls.append((grid, arguments, options))

    object.__setattr__(launcher, "combine", Recorder())
    targets = [SimpleNamespace(device=torch.device(device)) for _ in group.plan.outputs]
    launcher._bind_combine(1024)(["p0", "p1"], targets, 396, 396)
    [(grid, arguments, options)] = calls
    assert options["DEPENDENT"] is dependent, options
    assert options.get("launch_pdl", False) is dependent, options
    assert grid == (64,) and arguments[:2] == ("p0", "p1") and arguments[-1] == 396


def test_fp8_rows_in_and_out_pass_through_the_kernel_as_byte_codes():
    """An RMSNorm reading e4m3 rows and writing e5m2 ones: the launcher hands fp8
    tensors to the kernel as bytes (``as_bytes``) at every run, bytewise equal
    to the reference's."""
    with FusionDefinition("rmsnorm_fp8") as fd:
        x = fd.define_tensor(["rows", 96], "float8_e4m3fn")
        w = fd.define_tensor([96], "bfloat16")
        xf = fd.ops.cast(x, "float32")
        rstd = fd.ops.rsqrt(fd.ops.mean(xf * xf, dims=[1], keepdim=True) + 1e-6)
        wf = fd.ops.broadcast(fd.ops.cast(w, "float32"), [True, False])
        fd.add_output(fd.ops.cast(xf * rstd * wf, "float8_e5m2"))
    executor = MultiDeviceExecutor(fd, kernels="generated")
    launches = [i for i in ir.walk(executor.program.instructions)
                if isinstance(i, ir.LaunchKernel)]  # fmt: skip
    assert [launch.backend for launch in launches] == ["normalization"]
    generator = torch.Generator().manual_seed(3)
    for rows in (5, 5, 9):
        x = (3 * torch.randn(rows, 96, generator=generator)).to(torch.float8_e4m3fn)
        w = torch.randn(96, generator=generator).to(torch.bfloat16)
        [actual], [expected] = executor.run([x, w]), fd.execute([x, w])
        assert actual.dtype == torch.float8_e5m2
        assert_close(actual, expected, reduction_extent=96)


def test_a_maximum_reduced_in_parts_keeps_special_values():
    """A row's maximum in 3 parts (one row: the interpreter's 4 programs), the strips
    taking the largest in a fixed order: +inf in the last part, NaN in the first, and a
    row whose last part holds only masked columns past the row's 1000."""
    with FusionDefinition("max_parts") as fd:
        x = fd.define_tensor(["rows", 1000], "float32")
        shifted = x - fd.ops.max(x, dims=[1], keepdim=True)
        fd.add_output(shifted)
        fd.add_output(fd.ops.sum(shifted, dims=[0]))
    params = NormalizationParams(1, 128, 4, False, programs=8, parts=3, strategy=COLUMN_WALK,
                                 strip_columns=256, strip_warps=2)  # fmt: skip
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    for special in (float("inf"), float("nan"), None):
        x = torch.randn(1, 1000, generator=torch.Generator().manual_seed(8))
        if special is not None:
            x[0, 999 if special == float("inf") else 3] = special
        for actual, expected in zip(executor.run([x]), fd.execute([x]), strict=True):
            assert_close(actual, expected, reduction_extent=1000)


@pytest.mark.parametrize("count, columns", [(1, 1), (3, 7), (5, 1000), (132, 4096)])
def test_partial_rows_of_every_column_sum_start_aligned(count, columns):
    """Every column sum's partial rows, in one allocation: each sum's block contiguous,
    a multiple of 128 bytes past the allocation's start however many floats the block
    before holds (an allocation starts at least 16-byte aligned; CUDA's at 512), and
    zeroed where asked. New memory is filled with NaN here (deterministic algorithms),
    so rows not zeroed would show."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        rows = partial_rows(torch.device("cpu"), 3, count, columns, zeroed=True)
        unzeroed = partial_rows(torch.device("cpu"), 3, count, columns)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert len(rows) == 3 and partial_rows(torch.device("cpu"), 0, count, columns) == ()
    (start,) = {block.untyped_storage().data_ptr() for block in rows}  # one allocation
    for block in rows:
        assert block.shape == (count, columns) and block.is_contiguous()
        assert (block.data_ptr() - start) % 128 == 0 and not block.any()
    assert start % 16 == 0 and all(block.isnan().all() for block in unzeroed)


def test_a_global_memory_splits_count_compiles_its_tma_tensors_as_triton_descriptors(
    monkeypatch,
):
    """The H100's LayerNorm forward at 65536 (a split through TMA slices, exchanging
    through global memory) counts the programs the device holds from its kernel
    compiled for the launch's arguments: its TMA tensors reach the JITFunction as
    Triton's ``TensorDescriptor``, the rest as they are."""
    from types import SimpleNamespace

    from triton.tools.tensor_descriptor import TensorDescriptor

    import schedulers.normalization.scheduler as module
    from schedulers.runtime import BoundKernel
    from schedulers.tma_tensors import tma_descriptor

    scheduler, plan = _plan("layernorm_fwd", 65536)
    params = split_params(plan, H100, 65536)
    assert params.tma and not params.cluster and not params.programs, params
    launcher = scheduler.launcher(plan, params, H100, None)
    warmed, options = [], {"COLUMNS": 65536}
    stand_in = SimpleNamespace(warmup=lambda *a, grid, **k: warmed.append(a) or "k")
    kernel = BoundKernel(stand_in, options)  # as the launch binds it
    monkeypatch.setattr(module, "resident_programs", lambda compiled, hardware: 264)
    zeros = torch.zeros  # the dummy partial rows and slots: CPU stand-ins for the device's
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype, device: zeros(*shape, dtype=dtype))
    x, weights = torch.zeros(4, 65536, dtype=torch.bfloat16), torch.zeros(65536)
    tiles = tma_descriptor(x, 4, 65536, (1, params.block_columns), params)
    cuda = torch.device("cuda", 0)
    assert launcher._resident(cuda, kernel, [tiles, weights], 4, options) == 264
    ((first, second, *_),) = warmed
    assert type(first) is TensorDescriptor and first.base is x and second is weights


def test_a_clusters_grid_is_the_drivers_count_kept_by_specialization(monkeypatch):
    """The H200's split backward (clusters of 16, no grid in its params) launches as many
    programs as the device holds clusters of them (``BoundKernel.resident_clusters``,
    the driver's count) times 16, asked once a specialization: again for a misaligned
    tensor or another class of row count, not for the same ones; a device with room for
    no cluster refuses; a grid in the params is taken as it is."""
    from types import SimpleNamespace

    scheduler, plan = _plan("layernorm_bwd", 65536)
    params = split_params(plan, H200, 65536)
    assert params.cluster and params.parts == 16 and not params.programs, params
    launcher = scheduler.launcher(plan, params, H200, None)
    asked, room = [], {"clusters": 21}

    def resident_clusters(grid, *arguments):
        asked.append((grid, arguments[-1]))
        return room["clusters"]

    kernel = SimpleNamespace(resident_clusters=resident_clusters)
    # the dummy partial rows and slots: CPU stand-ins for the device's
    zeros = torch.zeros
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype, device: zeros(*shape, dtype=dtype))
    cuda, options = torch.device("cuda", 0), {"COLUMNS": 65536}
    held = torch.zeros(64, dtype=torch.bfloat16)
    pointers = [held[:16], held[16:32]]
    assert launcher._resident(cuda, kernel, pointers, 4096, options) == 21 * 16
    assert launcher._resident(cuda, kernel, pointers, 2048, options) == 21 * 16
    assert asked == [((16,), 4096)], asked  # rows of the same class: asked once
    launcher._resident(cuda, kernel, [held[1:17], held[16:32]], 4096, options)
    launcher._resident(cuda, kernel, pointers, 1, options)
    assert [rows for _, rows in asked] == [4096, 4096, 1], asked
    room["clusters"] = 0
    with pytest.raises(RuntimeError, match="holds no cluster of the 16 programs"):
        launcher._resident(cuda, kernel, pointers, 4095, options)
    fixed = scheduler.launcher(plan, dataclasses.replace(params, programs=64), H200, None)
    assert fixed._resident(cuda, kernel, pointers, 4096, options) == 64
    assert len(asked) == 4, asked
