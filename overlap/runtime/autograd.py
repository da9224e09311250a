"""Where a run meets autograd: until gradients are computed (the training issue), a
backward through a run's outputs raises a clear error instead of giving no gradient, or
one rank's partial gradient of a replicated input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch


class _NoBackward(torch.autograd.Function):
    """Stands between a run's outputs and its inputs in autograd: ``backward`` raises."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "MultiDeviceExecutor.run has no backward yet: gradients through a run (whose "
            "compute is split over ranks, and partly in generated kernels) are not "
            "computed, and one rank's partial gradient would be wrong. Differentiate the "
            "single-device fd.execute, or run the forward under torch.no_grad()"
        )


_DIFFERENTIABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


T = TypeVar("T")


def without_grad(function: Callable[..., T], *arguments) -> T:
    """``function(*arguments)`` with autograd off, as under ``torch.no_grad()``: its
    switch alone, without the context manager's 2-3 us of an H200 host's time."""
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return function(*arguments)
    finally:
        torch._C._set_grad_enabled(grad)


def refusing_backward(outputs: list, inputs: Sequence) -> list:
    """``outputs``, tied to the inputs that require a gradient so that a backward raises
    a clear error instead of giving no gradient or one rank's partial one."""
    if not torch.is_grad_enabled():
        return outputs
    wanting = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wanting:
        return outputs
    return [
        _NoBackward.apply(out, *wanting)
        if out is not None and out.dtype in _DIFFERENTIABLE
        else out
        for out in outputs
    ]
