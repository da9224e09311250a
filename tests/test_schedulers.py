"""Generated Triton kernels (in Triton's CPU interpreter) against the reference evaluator.

Every case builds a fusion, runs it through the executor with ``kernels="generated"``
on fresh random inputs and compares each output with ``fusion.reference`` using the
per-dtype tolerances of ``fusion.testing`` (fp8 and fp4 compare bytewise). Each case
also checks which scheduler took the work, so a silent fallback to the reference
evaluator cannot pass for a generated kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from fusion import FusionDefinition
from fusion.dtypes import as_dtype
from fusion.fp4 import FP4_MAGNITUDES, FP4_MIDPOINTS, pack_fp4, to_fp4
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor
from overlap.ir import LaunchKernel, walk
from schedulers import runtime
from schedulers.analysis import NotSchedulable
from schedulers.cache import KERNEL_CACHE
from schedulers.hardware import B200, H100, H200, INTERPRETER, current_hardware
from schedulers.pointwise import PointwiseParams, PointwiseScheduler
from schedulers.pointwise import aligned_arguments as pointwise_aligned_arguments
from schedulers.reduction import ReductionParams, ReductionScheduler, tma_outer_tile
from schedulers.reduction.codegen import (
    aligned_arguments as reduction_aligned_arguments,
)
from schedulers.registry import split_into_kernels
from schedulers.runtime import (
    CONCURRENT_TIMEOUT_S,
    BoundKernel,
    allocator,
    concurrent_programs,
    contiguous_strides,
    specialization,
)
from schedulers.tma_tensors import tma_descriptor, triton_arguments

SHAPES = [(1,), (7,), (1000,), (7, 1000), (1000, 7), (3, 333), (1, 1), (64, 513)]
FLOATS = ["float32", "bfloat16", "float16"]


def _random(shape, dtype: str, generator, low=None, high=None) -> torch.Tensor:
    if dtype.startswith("float8"):
        return (3 * torch.randn(shape, generator=generator)).to(getattr(torch, dtype))
    if dtype == "float4_e2m1":
        return to_fp4(3 * torch.randn(shape, generator=generator))
    if low is not None:
        values = low + (high - low) * torch.rand(shape, generator=generator)
    else:
        values = torch.randn(shape, generator=generator)
    return values.to(as_dtype(dtype).torch_dtype)


def _backends(executor: MultiDeviceExecutor) -> list[str]:
    return [i.backend for i in walk(executor.program.instructions) if isinstance(i, LaunchKernel)]


def _check(fd, inputs, reduction_extent: int = 1):
    executor = MultiDeviceExecutor(fd, kernels="generated")
    outputs = executor.run(inputs)
    for actual, expected in zip(outputs, fd.execute(inputs), strict=True):
        assert_close(actual, expected, reduction_extent=reduction_extent)
    return executor


# ---------------------------------------------------------------------------
# Pointwise


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_a_pointwise_chain_with_broadcasts_is_one_kernel(shape, dtype, rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype)
        w = fd.define_tensor([shape[-1]], dtype)
        y = fd.define_tensor(list(shape), dtype)
        wb = fd.ops.broadcast(w, [True] * (len(shape) - 1) + [False])
        h = fd.ops.gelu(x * wb + 0.5, approximate="tanh")
        g = fd.ops.silu(fd.ops.tanh(h) * fd.ops.sigmoid(y)) / (fd.ops.abs(y) + 1.0)
        fd.add_output(fd.ops.maximum(fd.ops.exp(-fd.ops.abs(g)), fd.ops.relu(g) * 2))
        fd.add_output(fd.ops.sqrt(fd.ops.abs(h) + 1.0) + fd.ops.rsqrt(fd.ops.abs(y) + 0.25) ** 2)
    inputs = [_random(s, dtype, rng) for s in (shape, (shape[-1],), shape)]
    # Each op of the chain rounds once, as the reference does, but tanh, exp and erf are
    # implemented differently (numpy in the interpreter, libm in torch): each of the ~12
    # ops may add a few float32 ulps, which count like the terms of a reduction.
    executor = _check(fd, inputs, reduction_extent=12)
    assert _backends(executor) == ["pointwise"]


@pytest.mark.parametrize("op", ["log", "reciprocal", "neg", "gelu", "exp", "pow", "tanh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_each_unary_op(op, dtype, rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 1000], dtype)
        if op == "pow":
            fd.add_output(fd.ops.pow(x, 3) + fd.ops.pow(x, -2) + fd.ops.pow(x, 0.5))
        else:
            fd.add_output(getattr(fd.ops, op)(x))
    _check(fd, [_random((7, 1000), dtype, rng, 0.5, 4.0)])


def test_comparisons_and_erf_are_generated_with_nan_and_infinities(rng):
    with FusionDefinition() as fd:
        a = fd.define_tensor([7, 333], "bfloat16")
        b = fd.define_tensor([1, 333], "float32")
        n = fd.define_tensor([7, 1], "int32")
        fd.add_output(fd.ops.eq(a, b))
        fd.add_output(fd.ops.ne(a, 0.5))
        fd.add_output(fd.ops.le(n, 2.5))  # an int against a float: compared as floats
        fd.add_output(fd.ops.where(fd.ops.lt(a, b), a * 2.0, b))
        fd.add_output(
            fd.ops.cast(fd.ops.gt(a, b), "float32") + fd.ops.cast(fd.ops.ge(n, 3), "float32")
        )
        fd.add_output(fd.ops.erf(a))
    a = (_random((7, 333), "float32", rng) * 2).round() / 2  # ties with b
    a[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, float("nan")])
    b = (_random((1, 333), "float32", rng) * 2).round() / 2
    b[0, :5] = torch.tensor([float("nan"), float("inf"), float("inf"), 0.5, 1.0])
    n = torch.randint(-5, 6, (7, 1), generator=rng, dtype=torch.int32)
    executor = _check(fd, [a.to(torch.bfloat16), b, n], reduction_extent=2)
    assert set(_backends(executor)) == {"pointwise"}  # no reference fallback


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_comparisons_with_inexact_scalars_round_them_to_the_tensors_type(dtype, rng):
    """A bf16 tensor against 0.1 compares with bf16's 0.1, a float64 one with float64's
    (a bare literal would be a float32 constant in Triton); either side; an int64
    tensor against a bf16 one compares in bf16."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 333], dtype)
        n = fd.define_tensor([4, 333], "int64")
        w = fd.define_tensor([4, 333], "bfloat16")
        for scalar in (0.1, 1 / 3):
            fd.add_output(fd.ops.eq(x, scalar))
            fd.add_output(fd.ops.lt(scalar, x))
            fd.add_output(fd.ops.ge(x, scalar))
        fd.add_output(fd.ops.eq(n, w))
    torch_dtype = as_dtype(dtype).torch_dtype
    picks = torch.tensor([0.1, 1 / 3], dtype=torch.float64)
    near = torch.cat([picks.to(torch_dtype).double(), picks.float().double(), picks])
    x = near[torch.randint(0, 6, (4, 333), generator=rng)].to(torch_dtype)
    n = torch.randint(250, 262, (4, 333), generator=rng)  # 257..261 round in bf16
    w = n.to(torch.bfloat16)
    executor = _check(fd, [x, n, w])
    assert set(_backends(executor)) == {"pointwise"}
    outputs = executor.run([x, n, w])
    for position, scalar in enumerate((0.1, 1 / 3)):
        assert torch.equal(outputs[3 * position], torch.eq(x, scalar))
        assert torch.equal(outputs[3 * position + 1], torch.lt(torch.full_like(x, scalar), x))
    assert torch.equal(outputs[-1], torch.eq(n, w))


@pytest.mark.parametrize("dtype", ["int32", "int64", "int8"])
def test_integer_pointwise_and_promotion(dtype, rng):
    with FusionDefinition() as fd:
        a = fd.define_tensor([7, 333], dtype)
        b = fd.define_tensor([1, 333], dtype)
        fd.add_output(fd.ops.maximum(a, b) * 2 - fd.ops.abs(b))
        fd.add_output(a / (fd.ops.abs(b) + 1))  # true division: float32
        fd.add_output(fd.ops.cast(a, "float32") * 0.5)
    low, high = -50, 50
    inputs = [torch.randint(low, high, shape, generator=rng).to(as_dtype(dtype).torch_dtype)
              for shape in ((7, 333), (1, 333))]  # fmt: skip
    executor = _check(fd, inputs)
    assert _backends(executor) == ["pointwise"]


@pytest.mark.parametrize("storage", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1"])
@pytest.mark.parametrize("compute", FLOATS)
def test_storage_casts_in_and_out_of_one_kernel(storage, compute, rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([33, 64], storage)
        y = fd.ops.cast(fd.ops.silu(fd.ops.cast(x, compute)) * 4.0, storage)
        fd.add_output(y)
        fd.add_output(fd.ops.cast(fd.ops.cast(x, compute), "float32"))
    executor = _check(fd, [_random((33, 64), storage, rng)])
    assert _backends(executor) == ["pointwise"]


def test_fp4_round_trip_is_exact_over_every_code():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)
    with FusionDefinition() as fd:
        x = fd.define_tensor([64], "float4_e2m1")
        fd.add_output(fd.ops.cast(fd.ops.cast(x, "float32"), "float4_e2m1"))
        fd.add_output(fd.ops.cast(x, "float32"))
    executor = MultiDeviceExecutor(fd, kernels="generated")
    packed, decoded = executor.run([pack_fp4(codes)])
    assert torch.equal(packed.view(torch.uint8), pack_fp4(codes).view(torch.uint8))
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    assert torch.equal(decoded, torch.cat([magnitudes, -magnitudes]).repeat(4))


@pytest.mark.parametrize("source", ["float32", "bfloat16", "float16"])
def test_fp4_encoding_of_every_tie_and_its_neighbours(source):
    dtype = as_dtype(source).torch_dtype
    midpoints = torch.tensor(FP4_MIDPOINTS, dtype=dtype)
    above = torch.nextafter(midpoints, torch.full_like(midpoints, 10))
    below = torch.nextafter(midpoints, torch.zeros_like(midpoints))
    saturating = torch.tensor([6.0, 7.0, 1e4, float("inf"), float("nan"), -0.0], dtype=dtype)
    values = torch.cat([midpoints, above, below, saturating])
    values = torch.cat([values, -values])
    with FusionDefinition() as fd:
        x = fd.define_tensor([values.numel()], source)
        fd.add_output(fd.ops.cast(x, "float4_e2m1"))
    executor = _check(fd, [values])
    assert _backends(executor) == ["pointwise"]


# ---------------------------------------------------------------------------
# Reductions


@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("shape", "dims"),
    [((7, 1000), [1]), ((1000, 7), [0]), ((1, 1), [1]), ((3, 5, 64), [1, 2]),
     ((64, 3, 5), [0]), ((513, 300), [0]), ((1, 4099), [1]), ((1000,), [0])],
    ids=str,
)  # fmt: skip
def test_a_reduction_with_prologue_and_epilogue_is_one_kernel(op, dtype, shape, dims, rng):
    rows = shape[-1]
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(shape), dtype)
        w = fd.define_tensor([rows], dtype)
        scaled = x * fd.ops.broadcast(w, [True] * (len(shape) - 1) + [False])
        reduced = getattr(fd.ops, op)(fd.ops.cast(scaled, "float32"), dims=dims)
        fd.add_output(fd.ops.cast(fd.ops.exp(reduced * 0.01), dtype))
    inputs = [_random(shape, dtype, rng), _random((rows,), dtype, rng)]
    extent = 1
    for d in dims:
        extent *= shape[d]
    executor = _check(fd, inputs, reduction_extent=extent)
    assert _backends(executor) == ["reduction"]


@pytest.mark.parametrize("dtype", ["int32", "int8", "bool"])
def test_integer_sums_accumulate_in_int64(dtype, rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([300, 17], dtype)
        fd.add_output(fd.ops.sum(x, dims=[0]))
        fd.add_output(fd.ops.max(x, dims=[1]))
    values = torch.randint(-100, 100, (300, 17), generator=rng)
    value = values > 0 if dtype == "bool" else values.to(getattr(torch, dtype))
    executor = _check(fd, [value])
    # max of bools is left to the reference evaluator
    expected = ["reduction", "reference"] if dtype == "bool" else ["reduction", "reduction"]
    assert _backends(executor) == expected


def test_an_outer_sum_with_atomics_is_an_option(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([2000, 40])
        fd.add_output(fd.ops.sum(x, dims=[0]))
    options = ReductionParams("outer", 32, 64, 4, waves=4, deterministic=False)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": options})
    inputs = [torch.randn(2000, 40, generator=rng)]
    (out,) = executor.run(inputs)
    assert_close(out, fd.execute(inputs)[0], reduction_extent=2000)
    assert "deterministic=False" in executor.kernel_report()


@pytest.mark.parametrize("layout", ["inner", "outer"])
def test_a_pipelined_reduction_loop_matches_the_reference(rng, layout):
    """``stages=3``: Triton's async-copy pipeline over the reduction loop (on GPU); the
    sums must not change, at extents that leave a partial last tile."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([1000, 77], "bfloat16")
        total = fd.ops.sum(fd.ops.cast(x, "float32"), dims=[1 if layout == "inner" else 0])
        fd.add_output(total)
    if layout == "inner":
        options = ReductionParams("inner", 4, 16, 4, stages=3)
    else:
        options = ReductionParams("outer", 16, 32, 4, waves=1, stages=3)
    KERNEL_CACHE.clear()
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": options})
    inputs = [torch.randn(1000, 77, generator=rng).to(torch.bfloat16)]
    (out,) = executor.run(inputs)
    assert_close(out, fd.execute(inputs)[0], reduction_extent=77 if layout == "inner" else 1000)
    assert "stages=3" in executor.kernel_report()
    assert any("num_stages=3" in source for source in KERNEL_CACHE.sources())


def test_what_no_scheduler_takes_falls_back_and_says_so(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 64])
        var, mean = fd.ops.var_mean(x, dims=[1])
        fd.add_output(fd.ops.exp(var + mean))
    executor = _check(fd, [torch.randn(7, 64, generator=rng)], reduction_extent=64)
    text = str(executor.program)
    assert "[reference]" in text and "reduction: 0 reductions" in text
    assert "no scheduler: normalization: no reduction result is used back along the rows" in text
    assert "[pointwise]" in text  # the exp after it is still generated


def test_what_no_scheduler_takes_moves_up_so_that_the_kernels_around_it_join(rng):
    """A sum over the outer and inner axes (no scheduler's) written between a broadcast
    and the product reading it, as a GroupNorm's backward has its bias's gradient: run
    first, the broadcast and the product one pointwise kernel (three launches before)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 3, 5])
        weight = fd.define_tensor([3])
        spread = fd.ops.broadcast(weight, [True, False, True])
        fd.add_output(fd.ops.sum(x, dims=[0, 2]))
        fd.add_output(fd.ops.mul(x, spread))
    inputs = [torch.randn(2, 3, 5, generator=rng), torch.randn(3, generator=rng)]
    executor = _check(fd, inputs, reduction_extent=10)
    assert _backends(executor) == ["reference", "pointwise"], executor.program


# ---------------------------------------------------------------------------
# Kernel reuse, heuristics and hardware


def test_specialization_keys_what_triton_specializes_on():
    """Launches of a ``BoundKernel`` share a compiled kernel only where Triton's would
    be the same: a tensor's dtype and 16-byte alignment, an integer's class (1, a
    multiple of 16, its width); anything else is not keyed (the JITFunction's path)."""
    held = torch.zeros(64, dtype=torch.bfloat16)
    aligned, shifted = held[:8], held[1:9]
    assert specialization(aligned) != specialization(shifted)
    assert specialization(aligned) != specialization(aligned.float())
    assert specialization(aligned) == specialization(held[8:16])
    keys = [specialization(v) for v in (1, 16, 17, 2**31, 2**63, -(2**31) - 1)]
    assert len(set(keys)) == len(keys)
    assert specialization(32) == specialization(48) and specialization(3) == specialization(5)
    for other in (True, 1.0, None):
        with pytest.raises(TypeError):
            specialization(other)


@pytest.mark.parametrize("shape", [(3, 4), (1, 7, 1), (2, 0, 5), (0,), (5,), ()])
def test_the_allocator_gives_what_torch_empty_gives(shape):
    """``allocator``'s tensors have torch's contiguous strides (``contiguous_strides``,
    extents of 0 and 1 included), the dtype and device asked for, and no gradient."""
    strides = contiguous_strides(shape)
    assert strides == torch.empty(shape).stride()
    made = allocator(torch.device("cpu"))(shape, strides, torch.bfloat16)
    assert (made.shape, made.stride(), made.dtype, made.device.type, made.requires_grad) == (
        torch.Size(shape), strides, torch.bfloat16, "cpu", False)  # fmt: skip


def test_the_allocator_keeps_to_torch_where_its_fast_entry_would_differ(monkeypatch):
    """Deterministic algorithms fill new memory (NaN shows an output a kernel left
    unwritten): then, and on a CUDA device other than the current one (the fast entry
    allocates on the current one), ``torch.empty_strided`` allocates."""
    made = []
    monkeypatch.setattr(
        torch, "empty_strided", lambda shape, strides, dtype, device: made.append(device) or "torch"
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guards = torch._C._dynamo.guards
    monkeypatch.setattr(guards, "_empty_strided_cuda", lambda *a: "fast")
    monkeypatch.setattr(guards, "_empty_strided_cpu", lambda *a: "fast")
    allocator.cache_clear()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        shape = ((2,), (1,), torch.float32)
        on = {d: allocator(torch.device(d))(*shape) for d in ("cpu", "cuda", "cuda:0", "cuda:1")}
        assert on == {"cpu": "fast", "cuda": "fast", "cuda:0": "fast", "cuda:1": "torch"}
        torch.use_deterministic_algorithms(True)
        assert [allocator(torch.device(d))(*shape) for d in ("cpu", "cuda")] == ["torch"] * 2
        assert made == [torch.device("cuda:1"), torch.device("cpu"), torch.device("cuda")]
    finally:
        torch.use_deterministic_algorithms(deterministic)
        allocator.cache_clear()


def _two_constants(x, y, n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pass


def _a_constant_between(x, BLOCK: tl.constexpr, n):
    pass


class _RecordedLauncher(SimpleNamespace):
    """A compiled kernel's launcher (Triton 3.6's ``CudaLauncher``): its Python wrapper's
    launches recorded in ``wrapped``, its compiled entry's (``launch``) in ``direct``."""

    def __init__(self, direct: list, scratch: int = 0) -> None:
        super().__init__(global_scratch_size=scratch, profile_scratch_size=0,
                         launch_cooperative_grid=0, launch_pdl=1, wrapped=[],
                         launch=lambda *a: direct.append(a))  # fmt: skip

    def __call__(self, *arguments) -> None:
        self.wrapped.append(arguments)


class _RecordedLaunches(JITFunction):
    """A JITFunction whose launches are recorded, its compiled kernel's too."""

    def __init__(self, function):
        super().__init__(function)
        self.jitted, self.direct = [], []
        self.compiled_kernel = SimpleNamespace(function="f", packed_metadata="m",
                                               run=_RecordedLauncher(self.direct))  # fmt: skip

    def __getitem__(self, grid):
        def launch(*arguments, **keywords):
            self.jitted.append((grid, arguments, keywords))
            return self.compiled_kernel

        return launch


def _bound(monkeypatch, function, keywords: dict) -> tuple[BoundKernel, _RecordedLaunches]:
    monkeypatch.setattr(runtime, "interpreted", lambda: False)  # as on a GPU
    kernel = _RecordedLaunches(function)
    bound = BoundKernel(kernel, keywords)
    device = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 77)
    bound.driver = SimpleNamespace(active=device)
    return bound, kernel


def test_a_bound_kernel_launches_its_compiled_kernel_after_the_first_launch(monkeypatch):
    """The first launch of a specialization goes through the JITFunction (which
    compiles); later ones straight to the compiled kernel, the grid made 3-D and the
    constexprs' values after the runtime arguments in the kernel's order; a misaligned
    tensor is a new specialization, an argument of another type always the JIT's."""
    keywords = {"WIDE": 8, "BLOCK": 64, "num_warps": 4}
    bound, kernel = _bound(monkeypatch, _two_constants, keywords)
    held = torch.zeros(64)
    x, y = held[:16], held[16:32]
    bound((3,), x, y, 16)
    assert kernel.jitted == [((3,), (x, y, 16), keywords)] and not kernel.direct
    bound((5, 2), x, y, 32)
    # to the launcher's compiled entry (cooperative grid and PDL as compiled, no scratch)
    assert kernel.direct == [(5, 2, 1, 77, "f", 0, 1, None, None, "m", None, None, None, x, y,
                              32, 64, 8)]  # fmt: skip
    bound((5,), held[1:17], y, 32)
    assert len(kernel.jitted) == 2 and len(kernel.direct) == 1
    bound((5,), held[1:17], y, 48)
    assert len(kernel.jitted) == 2 and len(kernel.direct) == 2
    bound((5,), x, y, 1.5)
    assert len(kernel.jitted) == 3 and len(kernel.direct) == 2
    assert not kernel.compiled_kernel.run.wrapped


def test_a_launch_with_its_scalars_bound_is_the_launch_with_them_passed(monkeypatch):
    """``with_scalars``: launches as passing the scalars would, sharing compiled kernels
    with such launches (the same specialization), a scalar of another class compiled
    anew, one of a type not keyed here always through the JITFunction."""
    keywords = {"WIDE": 8, "BLOCK": 64, "num_warps": 4}
    bound, kernel = _bound(monkeypatch, _two_constants, keywords)
    held = torch.zeros(64)
    x, y = held[:16], held[16:32]
    launch = bound.with_scalars(16)
    launch((3,), x, y)
    assert kernel.jitted == [((3,), (x, y, 16), keywords)] and not kernel.direct
    launch((5, 2), x, y)
    assert kernel.direct == [(5, 2, 1, 77, "f", 0, 1, None, None, "m", None, None, None, x, y,
                              16, 64, 8)]  # fmt: skip
    bound((5,), x, y, 32)  # as 16 is: the same compiled kernel
    assert len(kernel.jitted) == 1 and kernel.direct[-1][13:] == (x, y, 32, 64, 8)
    bound.with_scalars(17)((5,), x, y)  # not a multiple of 16: compiled anew
    assert len(kernel.jitted) == 2 and len(kernel.direct) == 2
    floating = bound.with_scalars(1.5)
    floating((5,), x, y)
    floating((5,), x, y)
    assert len(kernel.jitted) == 4 and kernel.jitted[-1] == ((5,), (x, y, 1.5), keywords)


def test_a_bound_kernel_with_scratch_memory_launches_through_tritons_wrapper(monkeypatch):
    """A compiled kernel that takes scratch memory is launched through the launcher's
    Python wrapper, which allocates it."""
    bound, kernel = _bound(monkeypatch, _two_constants, {"WIDE": 8, "BLOCK": 64})
    kernel.compiled_kernel.run = _RecordedLauncher(kernel.direct, scratch=256)
    x = torch.zeros(16)
    bound((3,), x, x, 16)
    bound((4,), x, x, 16)
    assert kernel.compiled_kernel.run.wrapped == [(4, 1, 1, 77, "f", "m", None, None, None, x,
                                                   x, 16, 64, 8)]  # fmt: skip
    assert not kernel.direct


def _descriptors(x, a, n, b, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pass


def _bound_with_descriptors(monkeypatch, metas) -> tuple:
    """``_descriptors`` bound, its launcher's entry wrapped by Triton 3.6's own
    ``wrap_handle_tensordesc`` with ``metas``; the encodings (``make_tensordesc_arg``,
    a stand-in) recorded as (address, meta)."""
    import triton.backends.nvidia.driver as nvidia

    encodings = []

    def encode(descriptor, meta):
        encodings.append((descriptor.base.data_ptr(), meta))
        return [("map", descriptor.base.data_ptr()), *descriptor.shape, *descriptor.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    bound, kernel = _bound(monkeypatch, _descriptors, {"WIDE": 8, "BLOCK": 64})
    launcher = kernel.compiled_kernel.run
    desc = "tensordesc<fp32[2, 16]>"
    signature = {"x": "*fp32", "a": desc, "n": "i32",
                 "b": desc, "BLOCK": "constexpr", "WIDE": "constexpr"}  # fmt: skip
    launcher.launch = nvidia.wrap_handle_tensordesc(launcher.launch, signature, metas)
    return bound, kernel, encodings


def _triton_descriptor(tensor: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor(tensor, [4, 16], [16, 1], [2, 16])


def _tma_tensor(tensor: torch.Tensor):
    return tma_descriptor(tensor.view(4, 16), 4, 16, (2, 16), "p")


@pytest.mark.parametrize("describe", [_triton_descriptor, _tma_tensor])
@pytest.mark.parametrize("metas", [[{"swizzle": 128}, {"swizzle": 64}], None])
def test_a_bound_kernel_encodes_tensor_descriptors_once_an_address(monkeypatch, metas,
                                                                   describe):  # fmt: skip
    """A kernel taking tensor descriptors (Triton's, or ``tma_descriptor``'s
    ``TmaTensor``s), its launcher's entry wrapped by Triton 3.6's own
    ``wrap_handle_tensordesc``: launched at the entry, each descriptor encoded
    (``make_tensordesc_arg``) once an address and spliced in its place, the later one
    first; a descriptor of another tensor encoded anew. Without the compiler's metadata
    (decomposed on the host, the tensor among them) encoded at every launch."""
    bound, kernel, encodings = _bound_with_descriptors(monkeypatch, metas)
    held = torch.zeros(512)
    x = held[:16]
    first, second, third = (describe(held[at : at + 64]) for at in (64, 128, 192))
    again = describe(held[64:128])  # first's address
    launches = [(first, third), (first, third), (again, third), (second, third)]
    for a, b in launches:
        bound((2,), x, a, 16, b)
    head = (2, 1, 1, 77, "f", 0, 1, None, None, "m", None, None, None)

    def spliced(d):
        return (("map", d.base.data_ptr()), 4, 16, 16, 1)

    assert kernel.direct == [(*head, x, *spliced(a), 16, *spliced(b), 64, 8)
                             for a, b in launches[1:]]  # fmt: skip
    assert len(kernel.jitted) == 1
    if metas:  # the later position first, then each new address
        expected = [(third.base.data_ptr(), metas[1]), (first.base.data_ptr(), metas[0]),
                    (second.base.data_ptr(), metas[0])]  # fmt: skip
    else:
        expected = [(d.base.data_ptr(), None) for a, b in launches[1:] for d in (b, a)]
    assert encodings == expected


def test_a_bound_kernel_takes_tma_tensors_as_triton_descriptors(monkeypatch):
    """``tma_descriptor``'s ``TmaTensor``: the first launch of a layout reaches the
    JITFunction as Triton's ``TensorDescriptor`` of the same fields (its checks run),
    later ones the compiled kernel (encoded: above); another tile, rows or dtype is
    another specialization (through the JITFunction again); a misaligned tensor is
    copied, so its base is aligned; a padding is kept."""
    bound, kernel, _ = _bound_with_descriptors(monkeypatch, [{"swizzle": 128}] * 2)
    held = torch.zeros(1024)
    x = held[:16]

    def tiles(at, rows=4, box=(2, 16), source=held):
        return tma_descriptor(source[at : at + rows * 16].view(rows, 16), rows, 16, box, "p")

    bound((2,), x, tiles(64), 16, tiles(128))  # the first: through the JITFunction
    ((_, jitted, _),) = kernel.jitted
    assert [type(a) for a in jitted] == [torch.Tensor, TensorDescriptor, int, TensorDescriptor]
    assert (jitted[1].base.data_ptr(), jitted[1].shape, jitted[1].strides,
            jitted[1].block_shape, jitted[1].padding) == (
            held[64:].data_ptr(), [4, 16], [16, 1], [2, 16], "zero")  # fmt: skip
    bound((2,), x, tiles(192), 16, tiles(256))  # the same layout, new addresses
    assert len(kernel.jitted) == 1 and len(kernel.direct) == 1
    bound((2,), x, tiles(64, box=(1, 16)), 16, tiles(128))  # another tile
    bound((2,), x, tiles(64, rows=8), 16, tiles(128))  # other rows
    halves = torch.zeros(1024, dtype=torch.float16)
    bound((2,), x, tiles(64, source=halves), 16, tiles(128))  # another dtype
    assert len(kernel.jitted) == 4 and len(kernel.direct) == 1
    misaligned = tiles(65)
    assert misaligned.base.data_ptr() % 16 == 0
    assert torch.equal(misaligned.base, held[65:129].view(4, 16))
    assert tiles(64)._replace(padding="nan").triton().padding == "nan"


def test_a_kernel_that_failed_to_load_is_launched_through_its_raising_launcher():
    """Triton 3.6 leaves a kernel that failed to load (too many resources) a launcher
    that raises why: launched through it, that error, not an AttributeError."""

    def refuse(*_):
        raise OutOfResources(300000, 232448, "shared memory")

    launch, function, head, descriptors = runtime._direct(
        SimpleNamespace(run=functools.partial(refuse), function=None), "m"
    )
    assert descriptors is None
    with pytest.raises(OutOfResources):
        launch(1, 1, 1, 0, function, *head)


def test_a_bound_kernel_hands_cuda_tensors_to_the_launcher_as_addresses(monkeypatch):
    """A CUDA tensor reaches the launcher's entry as its address (the entry would ask it
    and then the driver); a CPU tensor as itself, for the launcher to refuse."""
    bound, kernel = _bound(monkeypatch, _two_constants, {"WIDE": 8, "BLOCK": 64})
    x, y = torch.zeros(16), torch.zeros(16)
    bound((1,), x, y, 16)
    bound((1,), x, y, 16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bound((1,), x, y, 16)
    arguments = [launch[13:16] for launch in kernel.direct]
    assert arguments == [(x, y, 16), (x.data_ptr(), y.data_ptr(), 16)]


def test_a_bound_kernel_launches_clusters_of_programs_with_more_shared_memory(monkeypatch):
    """``cluster``: compiled without a launch (``warmup``), loaded again allowing for its
    dynamic shared memory and ``shared`` static bytes, every launch straight to it in clusters
    (Triton's launcher: the grid in clusters, the cluster's size as its CTA count), a
    launch hook or not; refused: a grid not made of clusters, an argument not keyed, more
    shared memory than the device has, scratch memory. The interpreter runs it
    one program after another through the JIT; a Triton not launched directly refuses."""
    keywords = {"WIDE": 8, "BLOCK": 64, "num_warps": 4}
    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    kernel = _RecordedLaunches(_two_constants)
    warmed, loaded = [], []
    metadata = SimpleNamespace(shared=1000, num_warps=4, num_ctas=1, global_scratch_size=0,
                               profile_scratch_size=0)  # fmt: skip
    compiled = SimpleNamespace(name="k", kernel=b"cubin", metadata=metadata, function="f",
                               run=_RecordedLauncher(kernel.direct))  # fmt: skip
    kernel.warmup = lambda *a, grid, **k: warmed.append((grid, a, k)) or compiled
    bound = BoundKernel(kernel, keywords, cluster=4, shared=64)
    load = lambda name, binary, shared, device: loaded.append((name, binary, shared, device)) or (  # noqa: E731
        "module", "clustered", 32, 0, 1024)  # fmt: skip
    properties = lambda device: {"max_shared_mem": 99 * 1024}  # noqa: E731
    device = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 77,
                             utils=SimpleNamespace(load_binary=load,
                                                   get_device_properties=properties))  # fmt: skip
    bound.driver = SimpleNamespace(active=device)
    x, y = torch.zeros(16), torch.zeros(16)
    from triton import knobs

    knobs.runtime.launch_enter_hook.add(print)
    try:
        bound((8,), x, y, 16)
        bound((12,), x, y, 16)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    assert warmed == [((8,), (x, y, 16), keywords)] and not kernel.jitted
    assert loaded == [("k", b"cubin", 1000 + 64, 0)]
    launch = ("clustered", 0, 1, None, None, (4, 4, 1000), None, None, None, x, y, 16, 64, 8)
    assert kernel.direct == [(2, 1, 1, 77, *launch), (3, 1, 1, 77, *launch)]
    with pytest.raises(ValueError, match="not made of clusters of 4"):
        bound((6,), x, y, 32)
    with pytest.raises(ValueError, match="not keyed here"):
        bound((8,), x, y, 1.5)
    metadata.shared = 99 * 1024  # with the 64 bytes, past the device's most
    with pytest.raises(OutOfResources):
        bound((8,), x, y, 1)
    metadata.shared, metadata.global_scratch_size = 1000, 128
    with pytest.raises(ValueError, match="scratch memory"):
        bound((8,), x, y, 1)
    metadata.global_scratch_size = 0  # a TMA tensor: compiled as Triton's descriptor
    bound((8,), x, tma_descriptor(torch.zeros(4, 16), 4, 16, (2, 16), "p"), 16)
    assert type(warmed[-1][1][1]) is TensorDescriptor
    monkeypatch.setattr(runtime, "interpreted", lambda: True)
    assert BoundKernel(kernel, keywords, cluster=4).cluster == 1
    monkeypatch.setattr(runtime, "interpreted", lambda: False)
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    with pytest.raises(ValueError, match="straight to the compiled kernel"):
        BoundKernel(kernel, keywords, cluster=4)


KEPT_TO_THE_JIT = ["constant between", "constant missing", "runtime keyword", "enter hook",
                   "exit hook", "hook function", "pre-run hook", "other Triton"]  # fmt: skip


@pytest.mark.parametrize("case", KEPT_TO_THE_JIT)
def test_a_bound_kernel_keeps_to_the_jit_where_its_arguments_cannot_be_laid_out(monkeypatch, case):
    """A constexpr before a runtime argument, one not given, a runtime argument given
    by name, a launch hook (a profiler's, which wants Triton's launch metadata; set in
    Triton's chain or as a plain function), a pre-run hook, or a Triton whose compiled
    kernels' launch may take other arguments: every launch through the JIT."""
    from triton import knobs

    if case == "other Triton":
        monkeypatch.setattr(triton, "__version__", "3.7.0")
    if case == "constant between":
        bound, kernel = _bound(monkeypatch, _a_constant_between, {"BLOCK": 64})
        arguments = (torch.zeros(4), 4)
    else:
        given = {"BLOCK": 64, "WIDE": 8}
        if case == "constant missing":
            given = {"BLOCK": 64}
        elif case == "runtime keyword":
            given = {"BLOCK": 64, "WIDE": 8, "n": 4}
        bound, kernel = _bound(monkeypatch, _two_constants, given)
        arguments = (torch.zeros(4), torch.zeros(4)) + (() if "n" in given else (4,))
    if case == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    if case == "hook function":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print)
    chain = {"enter hook": "launch_enter_hook", "exit hook": "launch_exit_hook"}.get(case)
    if chain:
        getattr(knobs.runtime, chain).add(print)
    try:
        for _ in range(3):
            bound((1,), *arguments)
    finally:
        if chain:
            getattr(knobs.runtime, chain).remove(print)
    assert len(kernel.jitted) == 3 and not kernel.direct


def test_a_bound_kernel_recompiles_where_tritons_debug_knob_changes(monkeypatch):
    """Triton's debug mode is one of its compile options: turned on after a launch, the
    next launch goes through the JIT (which compiles the debug kernel) again."""
    from triton import knobs

    bound, kernel = _bound(monkeypatch, _two_constants, {"BLOCK": 64, "WIDE": 8})
    x = torch.zeros(16)
    bound((1,), x, x, 16)
    bound((1,), x, x, 16)
    assert (len(kernel.jitted), len(kernel.direct)) == (1, 1)
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    bound((1,), x, x, 16)
    assert (len(kernel.jitted), len(kernel.direct)) == (2, 1)


def test_specialization_refines_tritons_own():
    """Two arguments ``specialization`` keys alike are specialized alike by Triton itself
    (its native binder, as a CUDA launch calls it): integers across the edges of its
    classes, tensors of several dtypes, aligned and not, TMA tensors of several dtypes,
    rows, tiles and paddings (as the JITFunction gets them)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    held = {dtype: torch.zeros(64, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    values = [v for edge in (0, 1, 16, 2**31, 2**32, 2**63) for v in (edge - 1, edge, edge + 1)]
    values += [-16, -(2**31) - 1, 48, 4096 * 4096]
    values += [t[offset : offset + 8] for t in held.values() for offset in (0, 1, 8, 16)]
    values += [tma_descriptor(t[at : at + rows * 8].view(rows, 8), rows, 8, box, "p")
               for t in held.values() for at in (0, 16) for rows in (2, 4)
               for box in ((1, 8), (2, 8))]  # fmt: skip
    values.append(values[-1]._replace(padding="nan"))
    for a in values:
        for b in values:
            if type(a) is type(b) and specialization(a) == specialization(b):
                triton_a, triton_b = (native_specialize_impl(CUDABackend, v, False, True, True)
                                      for v in triton_arguments((a, b)))  # fmt: skip
                assert triton_a == triton_b, (a, b)


def test_ten_batch_sizes_compile_once():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 96], "bfloat16")
        fd.add_output(fd.ops.gelu(x) * 2.0)
        fd.add_output(fd.ops.sum(fd.ops.cast(x, "float32"), dims=[1]))
    executor = MultiDeviceExecutor(fd, kernels="generated")
    generator = torch.Generator().manual_seed(5)
    executor.run([torch.randn(3, 96, generator=generator).bfloat16()])
    before = KERNEL_CACHE.compilations
    for batch in (1, 2, 5, 7, 16, 17, 100, 129, 255, 1000):
        x_in = torch.randn(batch, 96, generator=generator).bfloat16()
        for actual, expected in zip(executor.run([x_in]), fd.execute([x_in]), strict=True):
            assert_close(actual, expected, reduction_extent=96)
    assert KERNEL_CACHE.compilations == before


def _aligned_cases():
    """Fusions over ["batch", "hidden"] whose kernels have an aligned form."""
    with FusionDefinition() as tiled:
        x = tiled.define_tensor(["batch", "hidden"], "bfloat16")
        w = tiled.define_tensor(["hidden"], "bfloat16")
        tiled.add_output(tiled.ops.silu(x * tiled.ops.broadcast(w, [True, False])))
    with FusionDefinition() as rows:
        x = rows.define_tensor(["batch", "hidden"], "bfloat16")
        rows.add_output(rows.ops.sum(rows.ops.cast(x, "float32"), dims=[1]))
    with FusionDefinition() as columns:
        x = columns.define_tensor(["batch", "hidden"], "bfloat16")
        b = columns.define_tensor(["hidden"], "float32")
        total = columns.ops.sum(columns.ops.cast(x, "float32"), dims=[0])
        columns.add_output(total + b)
    return {"tiled": (tiled, 2, None), "rows": (rows, 1, 1), "columns": (columns, 2, 0)}


@pytest.mark.parametrize("case", ["tiled", "rows", "columns"])
def test_aligned_and_general_forms_both_match_the_reference(case):
    """Hidden 96 takes the aligned form (pitches and masked extents multiples of 16);
    hidden 100 the general one. Each form is built once, whatever the batch."""
    fd, n_inputs, reduced = _aligned_cases()[case]
    executor = MultiDeviceExecutor(fd, kernels="generated")
    generator = torch.Generator().manual_seed(11)

    def run(batch: int, hidden: int) -> None:
        shapes = [(batch, hidden), (hidden,)][:n_inputs]
        dtypes = ["bfloat16", "bfloat16" if case == "tiled" else "float32"]
        inputs = [_random(s, d, generator) for s, d in zip(shapes, dtypes, strict=False)]
        extent = 1 if reduced is None else (batch, hidden)[reduced]
        for actual, expected in zip(executor.run(inputs), fd.execute(inputs), strict=True):
            assert_close(actual, expected, reduction_extent=extent)

    KERNEL_CACHE.clear()
    run(32, 96)
    aligned = KERNEL_CACHE.sources()
    run(48, 100)
    general = KERNEL_CACHE.sources()[len(aligned) :]
    assert aligned and all("_16 * 16" in text for text in aligned)
    assert general and not any("_16 * 16" in text for text in general)
    for batch in (1, 7, 32, 33):
        run(batch, 96)
        run(batch, 100)
    assert KERNEL_CACHE.compilations == len(aligned) + len(general)
    assert "form: aligned, general" in executor.kernel_report()


def test_aligned_sources_state_their_facts_and_drop_unit_strides():
    fd, _, _ = _aligned_cases()["columns"]
    scheduler = ReductionScheduler()
    plan = scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)
    params = scheduler.heuristics(plan, H200, [1000, 96])
    general, aligned = (scheduler.kernels(plan, params, [1000, 96], aligned)[0].source
                        for aligned in (False, True))  # fmt: skip
    assert reduction_aligned_arguments(plan) == ["kept_count", "stride0_0"]
    assert "kept_count_16" in aligned and "stride0_0 = stride0_0_16 * 16" in aligned
    assert "kept_count_16" not in general and "stride0_0_16" not in general
    for text in (general, aligned):
        assert "(k1)[None, :]" in text and "k1 * stride0_1" not in text

    fd, _, _ = _aligned_cases()["tiled"]
    scheduler = PointwiseScheduler()
    plan = scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)
    params = scheduler.heuristics(plan, H200, [64, 4096])
    (kernel,) = scheduler.kernels(plan, params, [64, 4096], aligned=True)
    aligned = kernel.source
    assert pointwise_aligned_arguments(plan, params) == ["size1"]
    assert "size1 = size1_16 * 16" in aligned and "columns * stride1_1" not in aligned


@pytest.mark.parametrize(
    ("dtype", "width"),
    [("float64", 2), ("float32", 4), ("bfloat16", 8), ("float8_e4m3fn", 16), ("float4_e2m1", 32)],
)
def test_the_vector_width_is_128_bits_over_the_widest_dtype(dtype, width):
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 64], dtype)
        fd.add_output(fd.ops.set(x))
    scheduler = PointwiseScheduler()
    plan = scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)
    params = scheduler.heuristics(plan, H200, [8, 64])
    assert params.vector_width == width
    assert params.block == width * 32 * params.num_warps * params.unroll


def test_reduction_params_follow_the_reduced_extent_not_the_batch():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", "hidden"], "bfloat16")
        fd.add_output(fd.ops.sum(fd.ops.cast(x, "float32"), dims=[1]))
    scheduler = ReductionScheduler()
    plan = scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)
    small = scheduler.heuristics(plan, H100, [4096, 96])
    large = scheduler.heuristics(plan, H100, [4096, 65536])
    assert small.block_reduce == 128 and large.block_reduce == 2048
    assert small.block_rows * small.block_reduce == large.block_rows * large.block_reduce
    assert large.block_rows == 2  # two rows a program even when rows are long


@pytest.mark.parametrize(
    ("dtype", "columns"), [("bfloat16", 64), ("float32", 32), ("float8_e4m3fn", 128)]
)
def test_outer_reduction_tiles_read_a_cache_line_a_row(dtype, columns):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", "hidden"], dtype)
        fd.add_output(fd.ops.sum(fd.ops.cast(x, "float32"), dims=[0]))
    scheduler = ReductionScheduler()
    plan = scheduler.plan(fd.fusion.exprs, fd.fusion.inputs, fd.fusion.outputs)
    params = scheduler.heuristics(plan, H200, [1 << 20, 4096])
    assert params.block_reduce == columns  # outer: columns a program
    assert params.block_reduce * as_dtype(dtype).bits == 128 * 8
    assert params.block_rows * params.block_reduce * 32 == 16 * 1024 * 8  # float32 tile
    assert params.stages == 2 and params.waves == 8
    assert scheduler.heuristics(plan, INTERPRETER, [1 << 20, 4096]).stages == 1  # no async copies


def test_hardware_profiles_count_in_bits():
    assert H200.smem_per_block_bits == 227 * 1024 * 8
    assert B200.sm_count == 148 and H100.arch == 90
    assert current_hardware("cpu") is INTERPRETER


@pytest.mark.parametrize(
    ("warps", "registers", "shared_kib", "blocks"),
    [
        (4, 200, 0, 2),  # registers: 65536 // (200 * 128)
        (16, 200, 0, 0),  # a block over the register file
        (4, 16, 0, 16),  # warps: 64 // 4 (the registers would allow 32)
        (1, 16, 0, 32),  # at most 32 blocks
        (4, 32, 96, 2),  # shared memory: 227 KiB // 96
    ],
)
def test_blocks_an_sm_holds(warps, registers, shared_kib, blocks):
    assert H200.blocks_per_sm(warps, registers, shared_kib * 1024 * 8) == blocks


def test_user_params_override_the_heuristics(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 1000])
        fd.add_output(fd.ops.exp(x))
    params = PointwiseParams(vector_width=4, unroll=1, num_warps=2)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})
    inputs = [torch.randn(7, 1000, generator=rng)]
    assert_close(executor.run(inputs)[0], fd.execute(inputs)[0])
    assert executor.kernel_report() == f"k0 [pointwise] {params} form: general"  # 7000 elements


def test_params_for_a_kernel_the_program_does_not_have_are_refused():
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 1000])
        fd.add_output(fd.ops.exp(x))
    params = PointwiseParams(vector_width=4, unroll=1, num_warps=2)
    with pytest.raises(ValueError, match="has no generated kernel 'k9' \\(generated: \\['k0'\\]"):
        MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k9": params})
    # the reference evaluator, asked for, runs no generated kernel: params would be ignored
    with pytest.raises(ValueError, match="no generated kernel 'k0' \\(generated: none"):
        MultiDeviceExecutor(fd, kernels="reference", kernel_params={"k0": params})
    # "auto" evaluates off CUDA: params tuned for the GPU's kernels are checked, not used
    if not torch.cuda.is_available():
        executor = MultiDeviceExecutor(fd, kernels="auto", kernel_params={"k0": params})
        assert "[reference]" in str(executor.program)
        with pytest.raises(ValueError, match="has no generated kernel 'k9'"):
            MultiDeviceExecutor(fd, kernels="auto", kernel_params={"k9": params})


def _matmul_then_pointwise() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16])
        w = fd.define_tensor([16, 24])
        fd.add_output(fd.ops.exp(fd.ops.matmul(x, w)))
    return fd


def _pipelined_mlp():
    """The demo's tensor-parallel MLP pipelined in 2 chunks: its matmuls in chunk loops,
    its GELU a generated kernel between them."""
    from launch.demo import build_tp_mlp
    from overlap import OverlapOptions, compile_program

    fd = build_tp_mlp(16, 8, 32, 2)
    options = OverlapOptions(num_chunks=2, transport="collective")
    return fd, lambda schedule: compile_program(
        fd, 2, options, schedule=schedule, kernel_params={} if schedule else {"k1": "auto"}
    )


def test_the_kernels_an_evaluating_program_names_are_those_it_would_generate():
    """Where compute is evaluated, ``kernel_params`` are checked against the names the
    scheduled lowering gives its generated kernels: each name and scheduler the same, a
    matmul's kernel (cuBLAS) counted among the names as it is there, in loops too."""
    from overlap import compile_program

    fd = _matmul_then_pointwise()
    generated = compile_program(fd, schedule=True).host.generated_kernels()
    assert [(n, k.scheduler.name) for n, k in generated.items()] == [("k1", "pointwise")]
    evaluated = compile_program(fd, kernel_params={"k1": "auto"})
    assert "[reference]" in str(evaluated.host)
    assert {n: s.name for n, s in evaluated.generated.items()} == {"k1": "pointwise"}
    _, compile_for = _pipelined_mlp()
    scheduled, evaluating = compile_for(True), compile_for(False)
    names = {n: k.scheduler.name for n, k in scheduled.host.generated_kernels().items()}
    assert "FOR i in range(2)" in str(scheduled.host) and names
    assert {n: s.name for n, s in evaluating.generated.items()} == names


def test_params_for_the_kernel_after_a_matmul_reach_it(rng):
    fd = _matmul_then_pointwise()
    params = PointwiseParams(vector_width=4, unroll=1, num_warps=2)
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k1": params})
    inputs = [torch.randn(8, 16, generator=rng), torch.randn(16, 24, generator=rng)]
    assert_close(executor.run(inputs)[0], fd.execute(inputs)[0], reduction_extent=16)
    assert executor.kernel_report().startswith(f"k1 [pointwise] {params}")
    with pytest.raises(ValueError, match="no generated kernel 'k0' \\(generated: \\['k1'\\]"):
        MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": params})


def test_params_given_with_a_compiled_program_are_checked_or_refused():
    """A ``CompiledProgram`` handed to the executor with ``kernel_params``: checked
    against the names it checked at compile time; refused with ``kernels="reference"``
    (nothing generated) and where it cannot tell (evaluating, compiled without them):
    never silently unused."""
    from overlap import compile_program

    fd = _matmul_then_pointwise()
    params = {"k1": PointwiseParams(vector_width=4, unroll=1, num_warps=2)}
    with pytest.raises(ValueError, match="no generated kernel 'k1' \\(generated: none"):
        MultiDeviceExecutor(compile_program(fd, kernel_params=params), kernels="reference",
                            kernel_params=params)  # fmt: skip
    if torch.cuda.is_available():
        return  # "auto" generates on CUDA: an evaluating program is refused as such
    executor = MultiDeviceExecutor(compile_program(fd, kernel_params=params), kernels="auto",
                                   kernel_params=params)  # fmt: skip
    assert "[reference]" in str(executor.program)
    with pytest.raises(ValueError, match="no generated kernel 'k0'"):
        MultiDeviceExecutor(compile_program(fd, kernel_params=params), kernels="auto",
                            kernel_params={"k0": params["k1"]})  # fmt: skip
    with pytest.raises(ValueError, match="compiled without kernel_params"):
        MultiDeviceExecutor(compile_program(fd), kernels="auto", kernel_params=params)


def test_generated_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.exp(fd.define_tensor([4])))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        MultiDeviceExecutor(fd, kernels="generated")


# -- outer reductions through TMA tiles ---------------------------------------------------

TMA_TILES = {  # (bits, inputs) -> (reduced rows, kept columns) at 4096x1024 on H200
    (32, 1): (32, 256),
    (32, 2): (16, 256),
    (32, 3): (16, 256),
    (32, 5): (8, 256),
    (16, 1): (64, 256),
    (16, 2): (32, 256),
    (16, 3): (32, 256),
    (16, 5): (16, 256),
}


@pytest.mark.parametrize(("bits", "inputs"), list(TMA_TILES))
def test_tma_tile_sizes_for_several_inputs(bits, inputs):
    """Three stages of every input's tile (and the one more Triton allocates) beside the
    accumulators' scratch and the outputs: the reduced side halves from the descriptor's
    256 until they fit."""
    tile = tma_outer_tile([bits] * inputs, 32, [32], H200, 4096, 1024)
    assert (tile.block_reduced, tile.block_kept) == TMA_TILES[bits, inputs], tile
    used = (tile.stages + 1) * tile.block_reduced * tile.block_kept * bits * inputs
    assert used == tile.buffer_bits
    assert used + tile.reserved_bits <= H200.smem_per_block_bits
    # the next larger reduced side would not have fit
    assert 2 * used + tile.reserved_bits > H200.smem_per_block_bits


def test_a_tma_tile_shrinks_the_reduced_side_first_then_the_kept_side():
    small = dataclasses.replace(H200, smem_per_block_bits=48 * 1024 * 8)
    tile = tma_outer_tile([16] * 5, 32, [32], small, 4096, 1024)
    # 8 rows (the floor), then 256 -> 128 columns: 4 x 8 x 128 x 10 bytes (40 KiB) and
    # the scratch fit in 48 KiB; 256 columns (80 KiB) do not
    assert (tile.block_reduced, tile.block_kept) == (8, 128), tile
    assert "from 256x256" in tile.why


@pytest.mark.parametrize("bits", [32, 16, 8])
def test_a_tma_tile_never_has_a_vector_width_of_one(bits):
    """Short of shared memory the kept side stops at one 16-byte vector of the input."""
    for kib in (227, 64, 16, 8, 4):
        profile = dataclasses.replace(H200, smem_per_block_bits=kib * 1024 * 8)
        try:
            tile = tma_outer_tile([bits] * 3, 32, [32], profile, 4096, 1024)
        except NotSchedulable:
            continue
        assert tile.block_kept * bits >= 128 and tile.block_kept >= 2, (kib, tile)


def test_a_tma_tile_that_cannot_fit_is_refused():
    # 3 stages (and one more) of 8x4 float32 tiles of 2 inputs (1024 bytes), 1 KiB of
    # barriers and 4 columns of scratch and output (80 bytes): 2128 bytes, over 1.5 KiB
    tiny = dataclasses.replace(H200, smem_per_block_bits=1536 * 8)
    match = "smallest TMA tile \\(8x4, 2 inputs, 3 stages\\) needs 2128 bytes"
    with pytest.raises(NotSchedulable, match=match):
        tma_outer_tile([32, 32], 32, [32], tiny, 4096, 1024)


def test_welford_is_refused_on_the_tma_path():
    with pytest.raises(NotSchedulable, match="Welford"):
        tma_outer_tile([32], 32, [32], H200, 4096, 1024, op="var_mean")


def _product_column_sum(k: int, rows: int, columns: int, dtype: str):
    with FusionDefinition() as fd:
        xs = [fd.define_tensor([rows, columns], dtype=dtype) for _ in range(k)]
        w = fd.define_tensor([columns], dtype=dtype)
        product = xs[0]
        for x in xs[1:]:
            product = product * x
        fd.add_output(fd.ops.sum(product * fd.ops.broadcast(w, [True, False]), dims=[0]))
    return fd


@pytest.mark.parametrize(
    ("k", "rows", "columns", "dtype"),
    [(1, 37, 64, "bfloat16"), (2, 300, 40, "float32"), (3, 65, 24, "float16"),
     (5, 100, 48, "float16")],
)  # fmt: skip
def test_an_outer_reduction_through_tma_tiles_matches_the_reference(k, rows, columns, dtype):
    """Forced (``kernel_params={"k0": "tma"}``): the full inputs arrive as tensor
    descriptors, the broadcast weight is loaded as before; parts of the reduced axis
    that end inside a tile are masked."""
    fd = _product_column_sum(k, rows, columns, dtype)
    generator = torch.Generator().manual_seed(k * rows)
    inputs = [_random([rows, columns], dtype, generator) for _ in range(k)]
    inputs.append(_random([columns], dtype, generator))
    executor = MultiDeviceExecutor(fd, kernels="generated", kernel_params={"k0": "tma"})
    KERNEL_CACHE.clear()  # the source checked below is this run's
    (actual,) = executor.run(inputs)
    assert_close(actual, fd.execute(inputs)[0], reduction_extent=rows)
    params = executor.chosen_params["k0"]
    assert params.tma and params.layout == "outer" and params.stages == 3, params
    (source,) = [s for s in KERNEL_CACHE.sources() if "def reduction_kernel" in s]
    assert source.count(".load([tl.cast(start") == k  # the weight is not a TMA tile


def test_tma_tiles_are_refused_where_they_cannot_be():
    scheduler = ReductionScheduler()
    odd = _product_column_sum(2, 64, 12, "float16")  # 24-byte rows
    (group,) = split_into_kernels(odd.fusion.exprs, odd.fusion)
    with pytest.raises(NotSchedulable, match="not a multiple of 16 bytes"):
        scheduler.heuristics(group.plan, H200, [64, 12], "tma")
    with pytest.raises(NotSchedulable, match="sm_90"):
        scheduler.heuristics(group.plan, dataclasses.replace(H200, arch=80), [64, 16], "tma")
    with FusionDefinition() as rows_fd:
        x = rows_fd.define_tensor(["rows", 64])
        rows_fd.add_output(rows_fd.ops.sum(x, dims=[1]))
    (group,) = split_into_kernels(rows_fd.fusion.exprs, rows_fd.fusion)
    with pytest.raises(NotSchedulable, match="outer"):
        scheduler.heuristics(group.plan, H200, [16, 64], "tma")
    # through the executor: refused at the first run, before anything launches
    executor = MultiDeviceExecutor(odd, kernels="generated", kernel_params={"k0": "tma"})
    generator = torch.Generator().manual_seed(0)
    inputs = [_random([64, 12], "float16", generator) for _ in range(2)]
    inputs.append(_random([12], "float16", generator))
    with pytest.raises(NotSchedulable, match="not a multiple of 16 bytes"):
        executor.run(inputs)


@triton.jit
def _added_one(x):  # a device function: rewritten by the interpreter at its first call
    return x + 1


def test_concurrent_programs_rewrite_a_device_function_one_at_a_time(monkeypatch):
    """Under ``concurrent_programs`` the programs' first calls of a device function each
    rewrite it (parse, transform, compile); CPython's parser is not safe from several
    threads at once (a split row's program died of "AST constructor recursion depth
    mismatch"), so the rewrites run one at a time, and the plain rewrite is back after."""
    import threading

    inside, most, lock = [0], [0], threading.Lock()
    plain_ast = interpreter.FunctionRewriter.rewrite_ast

    def slow(self):  # a rewrite that takes long enough for the programs to overlap
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        try:
            return plain_ast(self)
        finally:
            with lock:
                inside[0] -= 1

    @triton.jit
    def calls_a_device_function(out):
        pid = tl.program_id(0)
        tl.store(out + pid, _added_one(pid))

    monkeypatch.setattr(interpreter.FunctionRewriter, "rewrite_ast", slow)
    interpreter.InterpretedFunction.rewritten_fn.pop(_added_one.fn, None)
    plain = interpreter.InterpretedFunction.rewrite
    out = torch.zeros(8, dtype=torch.int32)
    with concurrent_programs():
        assert interpreter.InterpretedFunction.rewrite is not plain
        calls_a_device_function[(8,)](out)
    assert interpreter.InterpretedFunction.rewrite is plain
    assert out.tolist() == list(range(1, 9)) and most[0] == 1, most


def test_a_failed_concurrent_program_raises_at_once():
    """Under ``concurrent_programs`` (a split row's programs, each in a thread) a program
    that fails leaves its partners waiting for it: its error is raised at once, not after
    ``CONCURRENT_TIMEOUT_S``. While it runs, the interpreter re-patches
    ``triton.language`` under a lock (a device function's call does so: unlocked, a program
    died of "dictionary changed size during iteration"), and the plain patching is back
    after it."""

    @triton.jit
    def waits_for_program_0(flag, out):
        pid = tl.program_id(0)
        if pid == 0:  # fails: a shape of 3 elements
            tl.store(out + tl.arange(0, 4), tl.reshape(tl.arange(0, 4), (3,)))
        while tl.load(flag, volatile=True) == 0:
            pass
        tl.store(out + pid, 1)

    plain = interpreter._patch_lang
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    start = time.monotonic()
    with pytest.raises(Exception, match="must be a power of 2"):
        with concurrent_programs():
            assert interpreter._patch_lang is not plain
            waits_for_program_0[(2,)](flag, out)
    assert time.monotonic() - start < CONCURRENT_TIMEOUT_S / 10
    assert interpreter._patch_lang is plain


def test_the_driver_is_asked_for_clusters_as_they_are_launched(monkeypatch):
    """``occupancy.max_active_clusters`` hands ``cuOccupancyMaxActiveClusters`` cuda.h's
    structures (their sizes and offsets), the launch's threads, dynamic shared memory,
    cluster size and spread policy, allowing sizes past 8 first; the driver's count comes
    back, a refusal as an error naming its CUresult."""
    import ctypes

    from schedulers import occupancy

    assert ctypes.sizeof(occupancy._Value) == 64 and ctypes.sizeof(occupancy._Attribute) == 72
    assert occupancy._Attribute.value.offset == 8 and ctypes.sizeof(occupancy._Config) == 56
    offsets = [getattr(occupancy._Config, f).offset for f in
               ("grid", "block", "shared", "stream", "attributes", "count")]  # fmt: skip
    assert offsets == [0, 12, 24, 32, 40, 48], offsets
    calls, answer = [], {"status": 0, "count": 21}

    class Driver:
        def cuFuncSetAttribute(self, handle, attribute, value):
            calls.append(("allow", handle.value, attribute, value))
            return 0

        def cuOccupancyMaxActiveClusters(self, count, handle, config):
            config = config._obj
            attributes = [config.attributes[i] for i in range(config.count)]
            calls.append(("ask", handle.value, list(config.grid), list(config.block),
                          config.shared, config.stream,
                          [(a.id, list(a.value.dims)) for a in attributes]))  # fmt: skip
            count._obj.value = answer["count"]
            return answer["status"]

    monkeypatch.setattr(occupancy, "_driver", Driver)
    assert occupancy.max_active_clusters(0x1234, 128, 32808, 16) == 21
    # the policy's value shares the union with the dims: SPREAD (1) is its first word
    assert calls == [("allow", 0x1234, 14, 1),
                     ("ask", 0x1234, [16, 1, 1], [128, 1, 1], 32808, None,
                      [(4, [16, 1, 1]), (5, [1, 0, 0])])], calls  # fmt: skip
    calls.clear()
    answer["count"] = 45
    assert occupancy.max_active_clusters(0x99, 64, 16520, 8) == 45
    assert [call[0] for call in calls] == ["ask"] and calls[0][3] == [64, 1, 1], calls
    answer["status"] = 1
    with pytest.raises(RuntimeError, match="CUresult 1"):
        occupancy.max_active_clusters(0x99, 64, 16520, 8)


def test_a_bound_kernel_asks_for_its_clusters_with_its_compiled_threads_and_memory(
    monkeypatch,
):
    """``BoundKernel.resident_clusters`` hands the driver the loaded kernel its launches
    use, the compiled kernel's threads (its warps of 32) and dynamic shared memory, and
    its cluster size; a kernel not bound to clusters is refused."""
    from types import SimpleNamespace

    from schedulers import occupancy
    from schedulers.runtime import BoundKernel

    asked = []

    class Driver:
        def cuOccupancyMaxActiveClusters(self, count, handle, config):
            config = config._obj
            asked.append((handle.value, config.block[0], config.shared,
                          list(config.attributes[0].value.dims)))  # fmt: skip
            count._obj.value = 45
            return 0

    monkeypatch.setattr(occupancy, "_driver", Driver)
    compiled = SimpleNamespace(metadata=SimpleNamespace(num_warps=4, shared=32816))
    warmed = []
    kernel = SimpleNamespace(warmup=lambda *arguments, grid, **keywords: warmed.append(arguments)
                             or compiled)  # fmt: skip
    bound = object.__new__(BoundKernel)  # as bound on a GPU: no interpreter, no compiler
    bound.kernel, bound.keywords, bound.cluster = kernel, {}, 8
    bound.compiled = {(0, "k"): (None, 0x5A, (), None)}  # loaded already
    monkeypatch.setattr(bound, "_key", lambda arguments: ((0, "k"), list(arguments)))
    tiles = tma_descriptor(torch.zeros(4, 16), 4, 16, (2, 16), "p")
    assert bound.resident_clusters((8,), 1, tiles) == 45
    assert asked == [(0x5A, 128, 32816, [8, 1, 1])], asked
    assert type(warmed[0][1]) is TensorDescriptor  # compiled as Triton's descriptor
    bound.cluster = 1
    with pytest.raises(ValueError, match="not launched in clusters here"):
        bound.resident_clusters((8,), 1, 2)
