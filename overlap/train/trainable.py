"""``TrainableFusion``: a placed fusion as a differentiable PyTorch callable.

Local pieces in, local pieces out, as ``MultiDeviceExecutor.run``; the outputs carry
autograd history, and ``loss.backward()`` runs the fusion's backward program
(``overlap.train.backward.placed_backward``) on every rank: each input that requires a
gradient gets this rank's piece of it (a replicated input the whole, combined over the
ranks). Inputs that need no gradient get none computed: the backward is built for the
inputs that require one, once per such set, on first use. ``saved``: which
intermediates of the fusion the forward hands to the backward instead of the backward
recomputing them (memory against time): a policy of ``overlap.train.backward.SAVE_POLICIES``
(default ``"matmuls"``: what matmuls compute is saved, the rest recomputed; chosen for
the gradients of every floating-point input but those at ``frozen`` positions;
``"nothing"``: everything recomputed) or a list of the fusion's intermediates.
``explain_backward()`` prints the rule and, per intermediate the gradients read, whether
it is saved or recomputed. Every rank must call it and
its backward alike (SPMD), with the same inputs requiring gradients (else the ranks
build different programs and every rank raises ``ProgramMismatch``).

On CUDA the forward and the backward replay CUDA graphs by default (``cuda_graph``, as
``MultiDeviceExecutor`` says): weights (the same tensors every step, updated in place by
optimizers) and what the forward saved (the forward graph's outputs) are read where
they are; data, activations and output gradients are copied into the graphs' buffers.
The outputs are the forward graph's memory (the next forward overwrites them, and
reading one after it raises); the gradients are copied out of the backward graph's, for
autograd to accumulate. A second forward before the first one's backward makes that
backward raise (the saved values were overwritten) instead of reading the new values.
With ``timeline`` set (an ``overlap.Timeline``), every forward and backward records its
steps into it on the lean path (``executor.explain_overlap(timeline)`` measures them);
``backward_listener(wrt, fusion)``, where set, gives each backward a listener of its gradients as
they are issued (``overlap.runtime.listeners``; ``parallelize``'s data-parallel reducer).

Example (on every rank)::

    mlp = TrainableFusion(fd, communicator)
    w1 = torch.nn.Parameter(local_w1)
    (y,) = mlp(x_local, w1, w2)
    y.square().sum().backward()  # w1.grad: this rank's piece of the gradient
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusion.autodiff import differentiable
from fusion.definition import FusionDefinition
from fusion.ir import Fusion, TensorView
from overlap.comm.communicator import Communicator
from overlap.diag.timeline import Timeline
from overlap.runtime.executor import MultiDeviceExecutor
from overlap.runtime.listeners import OutputListener
from overlap.runtime.pieces import rank_pieces
from overlap.train.backward import (
    SAVE_POLICIES,
    placed_backward,
    placed_forward_with_saved,
    saved_by_policy,
)


class TrainableFusion:
    """``fusion`` run forward by a ``MultiDeviceExecutor`` and backward by another (see
    the module); ``executor_options`` go to both (``kernels``, ``options``, ...)."""

    def __init__(
        self,
        fusion: Fusion | FusionDefinition,
        communicator: Communicator,
        saved: Sequence[TensorView] | str = "matmuls",
        frozen: Sequence[int] = (),
        **executor_options: Any,
    ) -> None:
        self.fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
        for position, tensor in enumerate(self.fusion.inputs):
            if tensor.mesh is not None and len(tensor.mesh.ranks) != communicator.world_size:
                # a rank without the input would decide alone that it wants no gradient
                # and skip the backward its peers wait for in their collectives
                raise NotImplementedError(
                    f"TrainableFusion: input {position} ({tensor}) is on {tensor.mesh}, not "
                    f"on all {communicator.world_size} ranks: inputs on some ranks only are "
                    "not supported yet"
                )
        self.communicator = communicator
        self.policy = saved if isinstance(saved, str) else None
        # the policy chooses for the gradients of every floating-point input but the
        # ``frozen`` ones (buffers: a backward asked for them recomputes what it misses)
        wrt = [i for i, t in enumerate(self.fusion.inputs)
               if differentiable(t) and i not in frozen]  # fmt: skip
        self.saved = saved_by_policy(self.fusion, saved, wrt) if self.policy else list(saved)
        self.executor_options = executor_options
        forward = placed_forward_with_saved(self.fusion, self.saved) if self.saved else self.fusion
        self.forward_executor = MultiDeviceExecutor(forward, communicator, **executor_options)
        self._backward_executors: dict[tuple[int, ...], MultiDeviceExecutor] = {}
        self._forwards = 0  # forwards run so far
        # the listener of the backward for the inputs at ``wrt`` (its outputs: their
        # gradients; its fusion given), asked when that backward is built (a
        # data-parallel reducer)
        self.backward_listener: Callable[[tuple[int, ...], Fusion], OutputListener] | None = None
        # where set, every forward and backward records into it (the lean path)
        self.timeline: Timeline | None = None

    def __call__(self, *local_inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
        return list(_Apply.apply(self, *local_inputs))

    def shard_inputs(self, full_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs (as ``MultiDeviceExecutor.shard_inputs``)."""
        return self.forward_executor.shard_inputs(full_inputs)

    def shard_outputs(self, full_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs of the fusion (not of what it saves)."""
        outputs = self.forward_executor.fusion.outputs[: len(self.fusion.outputs)]
        return rank_pieces(outputs, full_outputs, self.communicator.rank)

    def explain_backward(self, wrt: Sequence[int] | None = None) -> str:
        """The save rule, then which intermediates the gradients (of the inputs at
        ``wrt``, default every floating-point one) read and whether each is saved or
        recomputed."""
        rule = (
            f"saved by policy {self.policy!r}: {SAVE_POLICIES[self.policy]}"
            if self.policy
            else f"saved as asked: {len(self.saved)} intermediates"
        )
        return f"{rule}\n{placed_backward(self.fusion, wrt, self.saved).explain()}"

    @property
    def executors(self) -> list[MultiDeviceExecutor]:
        """The forward's executor, then each backward's built so far."""
        return [self.forward_executor, *self._backward_executors.values()]

    def backward_executor(self, wrt: tuple[int, ...]) -> MultiDeviceExecutor:
        """The executor of the backward for the inputs at ``wrt`` (built on first use:
        collective, every rank alike)."""
        if wrt not in self._backward_executors:
            grads = placed_backward(self.fusion, list(wrt), self.saved)
            listener = self.backward_listener(wrt, grads.fusion) if self.backward_listener else None
            self._backward_executors[wrt] = MultiDeviceExecutor(
                grads.fusion, self.communicator, output_listener=listener,
                **self.executor_options,
            )  # fmt: skip
        return self._backward_executors[wrt]

    def _forward(self, inputs: list) -> tuple[list, bool]:
        """The forward's outputs, and whether a graph's memory holds them."""
        self._forwards += 1
        replays = self.forward_executor.graphs.replays
        outputs = self.forward_executor.run(inputs, timeline=self.timeline)
        return outputs, self.forward_executor.graphs.replays > replays

    def _check_saved(self, forward: int, replayed: bool) -> None:
        if replayed and self.saved and forward != self._forwards:
            raise RuntimeError(
                "TrainableFusion: another forward ran before this one's backward and "
                "overwrote the CUDA graph's memory holding what this forward saved for it. "
                "Run each backward before the next forward (accumulate gradients "
                "micro-batch by micro-batch), or save nothing (saved='nothing'), or run "
                "with cuda_graph=False"
            )


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: TrainableFusion, *local_inputs):
        count = len(model.fusion.outputs)
        everything, replayed = model._forward(list(local_inputs))
        outputs, saved = everything[:count], everything[count:]
        ctx.model, ctx.forward = model, (model._forwards, replayed)
        ctx.counts = (len(local_inputs), len(saved))
        # saved for backward: an in-place change in between, or a second backward, raises
        ctx.save_for_backward(*local_inputs, *saved)
        ctx.outputs = [None if o is None else (o.shape, o.dtype, o.device) for o in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *output_grads):
        count, _ = ctx.counts
        ctx.model._check_saved(*ctx.forward)
        held = ctx.saved_tensors
        inputs, saved = held[:count], held[count:]
        wrt = tuple(i for i, needed in enumerate(ctx.needs_input_grad[1:]) if needed)
        if not wrt:
            return (None, *(None for _ in inputs))
        seeds = [
            grad
            if grad is not None or like is None
            else torch.zeros(like[0], dtype=like[1], device=like[2])
            for grad, like in zip(output_grads, ctx.outputs, strict=True)
        ]
        executor = ctx.model.backward_executor(wrt)
        # copied out of a graph's memory: autograd accumulates them
        local_grads = executor.run([*inputs, *saved, *seeds], ctx.model.timeline,
                                   keep_outputs=True)  # fmt: skip
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        for position, grad in zip(wrt, local_grads, strict=True):
            grads[position] = grad
        return (None, *grads)
