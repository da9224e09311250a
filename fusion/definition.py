"""``FusionDefinition``: the builder users write fusions with.

Example::

    import torch
    from fusion import FusionDefinition, DataType

    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 1024], DataType.bfloat16)
        w = fd.define_tensor([1024], DataType.bfloat16)
        y = fd.ops.mul(x, fd.ops.broadcast(w, [True, False]))
        fd.add_output(fd.ops.sum(fd.ops.cast(y, DataType.float32), dims=[1]))

    print(fd)
    (out,) = fd.execute([torch.randn(8, 1024, dtype=torch.bfloat16),
                         torch.randn(1024, dtype=torch.bfloat16)])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion import ops as _ops
from fusion.dtypes import DataType, as_dtype, float32
from fusion.errors import DefinitionError
from fusion.ir import Fusion, Symbol, TensorView
from fusion.ops import check_packing
from fusion.reference import evaluate


class FusionDefinition:
    """Builds one ``Fusion``: define inputs, apply ``fd.ops``, add outputs, execute.

    Ops may only be added inside the ``with`` block; leaving it checks the fusion
    (at least one output; every symbolic extent bound by an input) and freezes it.
    """

    ops = _ops

    def __init__(self, name: str | None = None) -> None:
        self.fusion = Fusion(name)
        self._entered = False

    def __enter__(self) -> FusionDefinition:
        if self._entered:
            raise DefinitionError("a FusionDefinition can be entered only once")
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.fusion.finalized = True
            return
        self._check_complete()
        self.fusion.finalized = True

    def _check_open(self, what: str) -> None:
        if self.fusion.finalized:
            raise DefinitionError(
                f"{what}: the fusion definition has ended (its `with` block was left)"
            )
        if not self._entered:
            raise DefinitionError(
                f"{what}: define the fusion inside `with FusionDefinition() as fd:`"
            )

    def _check_complete(self) -> None:
        if not self.fusion.outputs:
            raise DefinitionError("the fusion has no outputs; call fd.add_output(tensor)")
        bound = {e for t in self.fusion.inputs for e in t.shape if isinstance(e, Symbol)}
        for tensor in self.fusion.tensors:
            for axis in tensor.axes:
                if isinstance(axis.extent, Symbol) and axis.extent not in bound:
                    made_by = tensor.definition.op_name if tensor.definition else "define_tensor"
                    raise DefinitionError(
                        f"{made_by}: {tensor} uses symbol {axis.extent}, but no input has an "
                        "axis of that extent, so it cannot be bound at execution"
                    )

    def define_tensor(
        self,
        shape: Sequence[int | str | Symbol],
        dtype: DataType | torch.dtype | str = float32,
    ) -> TensorView:
        """A new fusion input of logical ``shape`` (fp4: values, not bytes).

        An extent is an int, a symbol name (inputs sharing a name share the extent) or
        -1 for a fresh anonymous symbol: ``fd.define_tensor(["batch", -1, 64], "bf16")``.
        """
        self._check_open("define_tensor")
        try:
            dtype = as_dtype(dtype)
        except ValueError as error:
            raise DefinitionError(f"define_tensor: {error}") from None
        fusion = self.fusion
        axes = []
        for extent in shape:
            if extent == -1:
                axes.append(fusion.new_axis(fusion.symbol()))
            elif isinstance(extent, (str, Symbol)):
                axes.append(fusion.new_axis(fusion.symbol(str(extent))))
            elif isinstance(extent, int) and not isinstance(extent, bool) and extent >= 0:
                axes.append(fusion.new_axis(extent))
            else:
                raise DefinitionError(
                    f"define_tensor: extent {extent!r} in shape {list(shape)} must be a "
                    "non-negative int, a symbol name or -1"
                )
        check_packing("define_tensor", dtype, axes)
        tensor = fusion.new_tensor(dtype, axes)
        fusion.inputs.append(tensor)
        return tensor

    def add_output(self, tensor: TensorView) -> None:
        """Mark ``tensor`` as an output of the fusion (outputs are returned in this order)."""
        self._check_open("add_output")
        if not isinstance(tensor, TensorView):
            raise DefinitionError(f"add_output: expected a TensorView, got {type(tensor).__name__}")
        if tensor.fusion is not self.fusion:
            raise DefinitionError(
                f"add_output: {tensor} is not defined in this fusion (it belongs to another one)"
            )
        if tensor in self.fusion.outputs:
            raise DefinitionError(f"add_output: {tensor} is already an output")
        self.fusion.outputs.append(tensor)

    def execute(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the fusion on one device with the reference evaluator."""
        if not self.fusion.finalized:
            raise DefinitionError("execute: finish the definition (leave the `with` block) first")
        return evaluate(self.fusion, inputs)

    def __str__(self) -> str:
        return str(self.fusion)

    __repr__ = __str__
