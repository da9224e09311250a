"""``TrainableFusion``: a placed fusion as a differentiable PyTorch callable.

Local pieces in, local pieces out, as ``MultiDeviceExecutor.run``; the outputs carry
autograd history, and ``loss.backward()`` runs the fusion's backward program
(``overlap.backward.placed_backward``) on every rank: each input that requires a
gradient gets this rank's piece of it (a replicated input the whole, combined over the
ranks). Inputs that need no gradient get none computed: the backward is built for the
inputs that require one, once per such set, on first use. Every rank must call it and
its backward alike (SPMD), with the same inputs requiring gradients (else the ranks
build different programs and every rank raises ``ProgramMismatch``).

Example (on every rank)::

    mlp = TrainableFusion(fd, communicator)
    w1 = torch.nn.Parameter(local_w1)
    (y,) = mlp(x_local, w1, w2)
    y.square().sum().backward()  # w1.grad: this rank's piece of the gradient
"""

from __future__ import annotations

from typing import Any

import torch

from fusion.definition import FusionDefinition
from fusion.ir import Fusion
from overlap.backward import placed_backward
from overlap.communicator import Communicator
from overlap.executor import MultiDeviceExecutor


class TrainableFusion:
    """``fusion`` run forward by a ``MultiDeviceExecutor`` and backward by another (see
    the module); ``executor_options`` go to both (``kernels``, ``options``, ...)."""

    def __init__(
        self,
        fusion: Fusion | FusionDefinition,
        communicator: Communicator,
        **executor_options: Any,
    ) -> None:
        self.fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
        self.communicator = communicator
        self.executor_options = executor_options
        self.forward_executor = MultiDeviceExecutor(self.fusion, communicator, **executor_options)
        self._backward_executors: dict[tuple[int, ...], MultiDeviceExecutor] = {}

    def __call__(self, *local_inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
        return list(_Apply.apply(self, *local_inputs))

    def backward_executor(self, wrt: tuple[int, ...]) -> MultiDeviceExecutor:
        """The executor of the backward for the inputs at ``wrt`` (built on first use:
        collective, every rank alike)."""
        if wrt not in self._backward_executors:
            grads = placed_backward(self.fusion, list(wrt))
            self._backward_executors[wrt] = MultiDeviceExecutor(
                grads.fusion, self.communicator, **self.executor_options
            )
        return self._backward_executors[wrt]


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: TrainableFusion, *local_inputs):
        outputs = model.forward_executor.run(list(local_inputs))
        ctx.model = model
        ctx.inputs = local_inputs  # kept as given: some are None (off this rank's mesh)
        ctx.outputs = [None if o is None else (o.shape, o.dtype, o.device) for o in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *output_grads):
        wrt = tuple(i for i, needed in enumerate(ctx.needs_input_grad[1:]) if needed)
        if not wrt:
            return (None, *(None for _ in ctx.inputs))
        seeds = [
            grad
            if grad is not None or like is None
            else torch.zeros(like[0], dtype=like[1], device=like[2])
            for grad, like in zip(output_grads, ctx.outputs, strict=True)
        ]
        executor = ctx.model.backward_executor(wrt)
        local_grads = executor.run([*ctx.inputs, *seeds])
        grads: list[torch.Tensor | None] = [None] * len(ctx.inputs)
        for position, grad in zip(wrt, local_grads, strict=True):
            grads[position] = grad
        return (None, *grads)
