"""The README's main job: build an example fusion, print it, run it and check it.

At this stage it runs on one device with the reference evaluator; later the
demo becomes the overlapped multi-device run.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from fusion import DataType, FusionDefinition, from_fp4, to_fp4
from fusion.testing import assert_close, tolerance


def build_mlp_quantize(hidden: int, ffn: int) -> FusionDefinition:
    """RMSNorm, linear, GELU, then quantize the activation to fp4 (and keep it in bf16)."""
    with FusionDefinition("rmsnorm_linear_gelu_fp4") as fd:
        x = fd.define_tensor(["tokens", hidden], DataType.bfloat16)
        norm_weight = fd.define_tensor([hidden], DataType.bfloat16)
        weight = fd.define_tensor([ffn, hidden], DataType.bfloat16)
        x32 = fd.ops.cast(x, DataType.float32)
        mean_square = fd.ops.mean(x32 * x32, dims=[1], keepdim=True)
        normed = x32 * fd.ops.rsqrt(mean_square + 1e-6)
        scale = fd.ops.broadcast(fd.ops.cast(norm_weight, DataType.float32), [True, False])
        h = fd.ops.cast(normed * scale, DataType.bfloat16)
        y = fd.ops.gelu(fd.ops.linear(h, weight), approximate="tanh")
        fd.add_output(y)
        fd.add_output(fd.ops.cast(y, DataType.float4_e2m1))
    return fd


def _by_hand(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    h = x32 * torch.rsqrt((x32 * x32).mean(dim=1, keepdim=True) + 1e-6) * norm_weight.float()
    return F.gelu(F.linear(h.bfloat16(), weight), approximate="tanh")


def run_demo(tokens: int = 256, hidden: int = 1024, ffn: int = 4096) -> bool:
    """Build, print, run and check the example; returns True when the checks pass."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fd = build_mlp_quantize(hidden, ffn)
    print(fd)
    print()
    generator = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(tokens, hidden, generator=generator, dtype=torch.bfloat16),
        torch.rand(hidden, generator=generator, dtype=torch.bfloat16) + 0.5,
        torch.randn(ffn, hidden, generator=generator, dtype=torch.bfloat16) / hidden**0.5,
    ]
    inputs = [t.to(device) for t in inputs]
    start = time.perf_counter()
    y, y_fp4 = fd.execute(inputs)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    expected = _by_hand(*inputs)
    max_error = (y.float() - expected.float()).abs().max().item()
    try:
        assert_close(y, expected, reduction_extent=hidden)
        close = True
    except AssertionError:
        close = False
    fp4_consistent = torch.equal(to_fp4(y).view(torch.uint8), y_fp4.view(torch.uint8))
    fp4_error = (from_fp4(y_fp4) - y.float()).abs().max().item()
    print(f"device: {device}; tokens={tokens} hidden={hidden} ffn={ffn}")
    print(
        f"outputs: y {tuple(y.shape)} {y.dtype}, y_fp4 {tuple(y_fp4.shape)} {y_fp4.dtype} "
        f"({y_fp4.numel()} bytes hold {y.numel()} fp4 values)"
    )
    print(f"reference evaluator: {elapsed_ms:.1f} ms")
    rtol, atol = tolerance(DataType.bfloat16, hidden)
    print(
        f"y vs hand-written torch: max |diff| = {max_error:.3g} "
        f"(within rtol={rtol:.3g}, atol={atol:.3g}: {close})"
    )
    print(
        f"fp4 output equals quantizing y by hand: {fp4_consistent}; "
        f"max fp4 quantization error = {fp4_error:.3g}"
    )
    passed = close and fp4_consistent
    print("demo: " + ("PASS" if passed else "FAIL"))
    return passed
