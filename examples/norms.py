"""Softmax, RMSNorm and LayerNorm, forward and backward, written as fusions.

Normalizations are compositions of the fusion's ops: reductions over the hidden axis
whose results are broadcast back along the rows. The executor gives the row part of
each to the normalization scheduler (one kernel, the row in registers) and the column
sums of a backward (dweight, dbias) to the reduction scheduler.

    python examples/norms.py                      # each on a few rows, checked
    overlap dump --kernels examples/norms.py      # LayerNorm's forward, its kernel

Every builder takes the hidden size ``n`` and the dtype of the activations; rows are
symbolic (``"rows"``), so one kernel serves every batch size. Saved statistics (mean,
rstd) and weight gradients are float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusion import FusionDefinition  # noqa: E402

HIDDEN = 1000  # the hidden size main runs each normalization at
ROW = [False, True]  # broadcast a per-row value along the hidden axis
COLUMN = [True, False]  # broadcast a per-column value (a weight) along the rows


def softmax_forward(n: int, dtype: str) -> FusionDefinition:
    with FusionDefinition("softmax_fwd") as fd:
        x = fd.define_tensor(["rows", n], dtype)
        xf = fd.ops.cast(x, "float32")
        shifted = xf - fd.ops.max(xf, dims=[1], keepdim=True)
        e = fd.ops.exp(shifted)
        fd.add_output(fd.ops.cast(e / fd.ops.sum(e, dims=[1], keepdim=True), dtype))
    return fd


def softmax_backward(n: int, dtype: str) -> FusionDefinition:
    """dx = y * (dy - sum(dy * y))."""
    with FusionDefinition("softmax_bwd") as fd:
        y = fd.define_tensor(["rows", n], dtype)
        dy = fd.define_tensor(["rows", n], dtype)
        yf, dyf = fd.ops.cast(y, "float32"), fd.ops.cast(dy, "float32")
        dot = fd.ops.sum(dyf * yf, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(yf * (dyf - dot), dtype))
    return fd


def rmsnorm_forward(n: int, dtype: str, eps: float = 1e-6) -> FusionDefinition:
    """y = x * rstd * w with rstd = 1 / sqrt(mean(x * x) + eps); outputs y and rstd."""
    with FusionDefinition("rmsnorm_fwd") as fd:
        x = fd.define_tensor(["rows", n], dtype)
        w = fd.define_tensor([n], dtype)
        xf = fd.ops.cast(x, "float32")
        rstd = fd.ops.rsqrt(fd.ops.mean(xf * xf, dims=[1]) + eps)
        wf = fd.ops.broadcast(fd.ops.cast(w, "float32"), COLUMN)
        y = xf * fd.ops.broadcast(rstd, ROW) * wf
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(rstd)
    return fd


def rmsnorm_backward(n: int, dtype: str) -> FusionDefinition:
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rstd;
    dw = sum over rows of dy * xhat."""
    with FusionDefinition("rmsnorm_bwd") as fd:
        x = fd.define_tensor(["rows", n], dtype)
        dy = fd.define_tensor(["rows", n], dtype)
        w = fd.define_tensor([n], dtype)
        rstd = fd.define_tensor(["rows"], "float32")
        xf, dyf = fd.ops.cast(x, "float32"), fd.ops.cast(dy, "float32")
        r = fd.ops.broadcast(rstd, ROW)
        xhat = xf * r
        g = dyf * fd.ops.broadcast(fd.ops.cast(w, "float32"), COLUMN)
        projection = fd.ops.mean(g * xhat, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(r * (g - xhat * projection), dtype))
        fd.add_output(fd.ops.sum(dyf * xhat, dims=[0]))
    return fd


def layernorm_forward(n: int, dtype: str, eps: float = 1e-5) -> FusionDefinition:
    """y = (x - mean) * rstd * w + b; outputs y, mean and rstd."""
    with FusionDefinition("layernorm_fwd") as fd:
        x = fd.define_tensor(["rows", n], dtype)
        w = fd.define_tensor([n], dtype)
        b = fd.define_tensor([n], dtype)
        xf = fd.ops.cast(x, "float32")
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0)
        rstd = fd.ops.rsqrt(var + eps)
        xhat = (xf - fd.ops.broadcast(mean, ROW)) * fd.ops.broadcast(rstd, ROW)
        wf = fd.ops.broadcast(fd.ops.cast(w, "float32"), COLUMN)
        bf = fd.ops.broadcast(fd.ops.cast(b, "float32"), COLUMN)
        fd.add_output(fd.ops.cast(xhat * wf + bf, dtype))
        fd.add_output(mean)
        fd.add_output(rstd)
    return fd


def layernorm_backward(n: int, dtype: str) -> FusionDefinition:
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w; dw = sum of
    dy * xhat and db = sum of dy over the rows."""
    with FusionDefinition("layernorm_bwd") as fd:
        x = fd.define_tensor(["rows", n], dtype)
        dy = fd.define_tensor(["rows", n], dtype)
        w = fd.define_tensor([n], dtype)
        mean = fd.define_tensor(["rows"], "float32")
        rstd = fd.define_tensor(["rows"], "float32")
        xf, dyf = fd.ops.cast(x, "float32"), fd.ops.cast(dy, "float32")
        r = fd.ops.broadcast(rstd, ROW)
        xhat = (xf - fd.ops.broadcast(mean, ROW)) * r
        g = dyf * fd.ops.broadcast(fd.ops.cast(w, "float32"), COLUMN)
        mean_g = fd.ops.mean(g, dims=[1], keepdim=True)
        projection = fd.ops.mean(g * xhat, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(r * (g - mean_g - xhat * projection), dtype))
        fd.add_output(fd.ops.sum(dyf * xhat, dims=[0]))
        fd.add_output(fd.ops.sum(dyf, dims=[0]))
    return fd


def make_inputs(name: str, rows: int, n: int, dtype, device, generator) -> list:
    """Random inputs for ``BUILDERS[name]`` (torch tensors); saved statistics are those
    of ``x``, as a forward would have saved them."""
    import torch

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    x = randn(rows, n).to(dtype)
    xf = x.float()
    if name == "softmax_fwd":
        return [x]
    if name == "softmax_bwd":
        return [torch.softmax(xf, dim=1).to(dtype), randn(rows, n).to(dtype)]
    w = (1 + 0.1 * randn(n)).to(dtype)
    if name == "rmsnorm_fwd":
        return [x, w]
    if name == "layernorm_fwd":
        return [x, w, (0.1 * randn(n)).to(dtype)]
    dy = randn(rows, n).to(dtype)
    if name == "rmsnorm_bwd":
        return [x, dy, w, torch.rsqrt(xf.pow(2).mean(dim=1) + 1e-6)]
    if name == "layernorm_bwd":
        var, mean = torch.var_mean(xf, dim=1, correction=0)
        return [x, dy, w, mean, torch.rsqrt(var + 1e-5)]
    raise KeyError(name)


def fusion(world_size: int) -> FusionDefinition:
    """LayerNorm's forward as ``main`` runs it, for ``overlap dump`` (one
    device's fusion: every rank runs it whole, whatever ``world_size``)."""
    return layernorm_forward(HIDDEN, "bfloat16")


BUILDERS = {
    "softmax_fwd": softmax_forward,
    "softmax_bwd": softmax_backward,
    "rmsnorm_fwd": rmsnorm_forward,
    "rmsnorm_bwd": rmsnorm_backward,
    "layernorm_fwd": layernorm_forward,
    "layernorm_bwd": layernorm_backward,
}


def main() -> None:
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusion.testing import assert_close
    from overlap import MultiDeviceExecutor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, build in BUILDERS.items():
        fd = build(HIDDEN, "bfloat16")
        generator = torch.Generator().manual_seed(0)
        inputs = make_inputs(name, 8, HIDDEN, torch.bfloat16, device, generator)
        executor = MultiDeviceExecutor(fd, kernels="generated")
        for actual, expected in zip(executor.run(inputs), fd.execute(inputs), strict=True):
            assert_close(actual, expected, reduction_extent=HIDDEN)
        print(f"{name}: matches the reference\n  {executor.kernel_report()}")


if __name__ == "__main__":
    main()
