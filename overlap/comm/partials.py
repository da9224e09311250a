"""Partial results combined on their owner, in one documented order.

A pipelined reduce-scatter moved by the ``collective`` or the ``copy_engine``
transport delivers every rank's partial chunk, whole, to the chunk's owner, which
combines them here, always the same way:

- a sum adds the partials in team coordinate order (coordinate 0's partial, then 1's,
  ..., then P-1's) in float32 (float64 values in float64, integers in their own type)
  and rounds once to the output's type;
- a max or a min takes them in the same order, in the output's type (exact; NaN wins).

So, given the same partials, such a pipeline's result does not depend on how many
chunks the planner cut, nor on which of the two transports moved them, nor on the
device: on CUDA the sum is one generated kernel (one pass over the partials), elsewhere
the same float32 additions through torch, and both round the same. (The partials
themselves are each chunk's matmul: a GPU library may pick another algorithm for
another number of rows, and round a partial otherwise.) At two ranks it is exactly
what NCCL's reduce-scatter computes (one rounded addition). At more, NCCL's own
reduce-scatter (the sequential program's) rounds after each hop of its ring, in an
order of its own, so the sequential result may differ in the last bits, within
``fusion.testing``'s tolerance for partial sums. The ``ring`` transport accumulates
hop by hop instead (``overlap.comm.pipelined``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.definition import FusionDefinition
from fusion.dtypes import DataType, compute_dtype, float32

COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}  # two partials
_GENERATED = (torch.bfloat16, torch.float16, torch.float32)  # summed in float32


class PartialCombiner:
    """Combines ``parts`` partials of ``dtype`` by ``op`` (``sum``, ``max``, ``min``)
    in coordinate order into an output tensor.

    ``hardware`` (a ``schedulers.hardware.HardwareProfile``) makes the float sums a
    generated kernel for that device (Triton's interpreter on CPU); None adds them
    with torch. Both give the same bits::

        combine = PartialCombiner(4, "sum", torch.bfloat16)
        combine([p0, p1, p2, p3], out)     # out = round(((p0 + p1) + p2) + p3)
    """

    def __init__(self, parts: int, op: str, dtype: torch.dtype, hardware=None) -> None:
        if op not in COMBINE:
            raise ValueError(f"partials are combined by sum, max or min, not {op!r}")
        self.parts, self.op, self.dtype = parts, op, dtype
        # sums added in float32 (float64, integers: their own type), rounded once; max
        # and min are exact in the partials' own type
        wide = compute_dtype(DataType.from_torch(dtype)).torch_dtype
        self.accumulation = wide if op == "sum" else dtype
        generated = hardware is not None and op == "sum" and dtype in _GENERATED
        self.hardware = hardware if generated else None
        self._group = self._kernel_group() if generated else None
        self._launchers: dict[int, tuple] = {}  # elements -> (launcher, shapes)

    def __call__(self, partials: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """``out`` (any strides) = the partials (each of ``out``'s shape) combined."""
        if len(partials) != self.parts:
            raise ValueError(f"{len(partials)} partials given, {self.parts} expected")
        if out.numel() == 0:
            return
        if self._group is not None:
            self._generated(partials, out)
            return
        total = partials[0].to(self.accumulation)
        for partial in partials[1:]:
            total = COMBINE[self.op](total, partial)
        out.copy_(total)

    def warm_up(self, device: torch.device, elements: int) -> None:
        """Compile the generated kernel for ``elements`` at a time now (a launch on
        zeros), not in the first run."""
        if self._group is not None and elements and elements not in self._launchers:
            zeros = [torch.zeros(elements, dtype=self.dtype, device=device)
                     for _ in range(self.parts)]  # fmt: skip
            self(zeros, torch.empty_like(zeros[0]))

    def _kernel_group(self):
        from schedulers.registry import split_into_kernels

        dtype = DataType.from_torch(self.dtype)
        with FusionDefinition(f"combine_{self.parts}_partials") as fd:
            partials = [fd.define_tensor(["elements"], dtype) for _ in range(self.parts)]
            total = fd.ops.cast(partials[0], float32)
            for partial in partials[1:]:
                total = fd.ops.add(total, fd.ops.cast(partial, float32))
            fd.add_output(fd.ops.cast(total, dtype))
        (group,) = split_into_kernels(fd.fusion.exprs, fd.fusion)
        if group.scheduler is None:
            raise RuntimeError(f"no scheduler takes the sum of partials: {group.reason}")
        return group

    def _generated(self, partials: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        elements = out.numel()
        if elements not in self._launchers:
            scheduler, plan = self._group.scheduler, self._group.plan
            params = scheduler.heuristics(plan, self.hardware, [elements])
            launch = scheduler.launcher(plan, params, self.hardware, lambda tensor: [elements])
            group = self._group
            shapes = {tensor: [elements] for tensor in [*group.inputs, *group.outputs]}
            self._launchers[elements] = (launch, shapes)
        launch, shapes = self._launchers[elements]
        inputs = [partial.contiguous().view(-1) for partial in partials]
        in_place = out.is_contiguous()
        target = out.view(-1) if in_place else torch.empty_like(inputs[0])
        launch(inputs, [target], shapes)
        if not in_place:
            out.copy_(target.view(out.shape))
