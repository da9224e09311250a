"""Binding inputs: a fusion's symbolic extents get their values from the input tensors.

``bind_inputs`` checks one device's inputs (count, type, dtype, rank, shape, device) and
binds every symbol; ``check_constraints`` checks the extent constraints ops recorded
(``a + b`` of two symbolic extents must agree). The multi-device executor binds from
every rank's pieces (``overlap.runtime.inputs``) with the same constraint check.

Example::

    bindings = bind_inputs(fd.fusion, [torch.randn(8, 1024)])   # {batch: 8}
    resolve(x.shape[0], bindings)                              # 8
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.errors import InputError
from fusion.ir import Extent, Fusion, Symbol, TensorView

Bindings = dict[Symbol, int]


def resolve(extent: Extent, bindings: Bindings) -> int:
    """The concrete value of ``extent`` under ``bindings``."""
    return bindings[extent] if isinstance(extent, Symbol) else extent


def bind_inputs(fusion: Fusion, inputs: Sequence[torch.Tensor]) -> Bindings:
    """Check ``inputs`` against the fusion's inputs and bind its symbolic extents.

    Raises ``InputError`` (before anything runs) on a wrong count, type, dtype, rank,
    shape or device, on a symbol bound to two different values, and on a violated
    extent constraint.
    """
    if not isinstance(inputs, (list, tuple)):
        raise InputError(f"inputs must be a list of tensors, got {type(inputs).__name__}")
    if len(inputs) != len(fusion.inputs):
        expected = ", ".join(str(t) for t in fusion.inputs)
        raise InputError(
            f"the fusion takes {len(fusion.inputs)} inputs ({expected}), got {len(inputs)}"
        )
    bindings: Bindings = {}
    bound_by: dict[Symbol, tuple[InputAt, int]] = {}  # the input and axis that bound it
    devices = set()
    for position, (tensor_view, value) in enumerate(zip(fusion.inputs, inputs, strict=True)):
        where = InputAt(position, tensor_view)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{where}: expected a torch.Tensor, got {type(value).__name__}")
        dtype = tensor_view.dtype
        if value.dtype != dtype.torch_dtype:
            hint = (
                "; pack fp4 values with fusion.fp4.to_fp4 (two per byte)" if dtype.is_packed else ""
            )
            raise InputError(
                f"{where}: expected dtype {dtype.torch_dtype} ({dtype}), got {value.dtype}{hint}"
            )
        if value.dim() != tensor_view.ndim:
            raise InputError(
                f"{where}: expected rank {tensor_view.ndim}, got shape {tuple(value.shape)}"
            )
        shape = list(value.shape)
        if dtype.is_packed:
            shape[-1] *= dtype.values_per_storage_element
        for axis_index, (extent, actual) in enumerate(zip(tensor_view.shape, shape, strict=True)):
            if isinstance(extent, Symbol):
                if extent in bindings and bindings[extent] != actual:
                    by_input, by_axis = bound_by[extent]
                    raise InputError(
                        f"{where}: axis {axis_index} has extent {actual}, but symbol {extent} "
                        f"is already {bindings[extent]} from {by_input} axis {by_axis}"
                    )
                bindings[extent] = actual
                bound_by[extent] = (where, axis_index)
            elif extent != actual:
                raise InputError(
                    f"{where}: expected shape {list(tensor_view.shape)}"
                    f"{' (fp4 values)' if dtype.is_packed else ''}, got {shape}: "
                    f"axis {axis_index} is {actual}, not {extent}"
                )
        devices.add(value.device)
    if len(devices) > 1:
        raise InputError(f"inputs are on different devices: {sorted(str(d) for d in devices)}")
    check_constraints(fusion, bindings)
    return bindings


class InputAt:
    """``input 3 (T3_f32[...])`` in an error message, formatted only when printed: the
    checks run on every call, the messages almost never."""

    def __init__(self, position: int, tensor: TensorView) -> None:
        self.position, self.tensor = position, tensor

    def __str__(self) -> str:
        return f"input {self.position} ({self.tensor})"


def check_constraints(fusion: Fusion, bindings: Bindings) -> None:
    """Every extent constraint of ``fusion`` holds under ``bindings``, or ``InputError``."""
    for constraint in fusion.constraints:
        lhs, rhs = resolve(constraint.lhs, bindings), resolve(constraint.rhs, bindings)
        if not constraint.holds(lhs, rhs):
            described = [
                f"{extent}={value}" if isinstance(extent, Symbol) else str(value)
                for extent, value in ((constraint.lhs, lhs), (constraint.rhs, rhs))
            ]
            verb = "disagree" if constraint.relation == "==" else "are out of bounds"
            raise InputError(
                f"extents {verb}: {described[0]} {constraint.relation} {described[1]} does not "
                f"hold, required by {constraint.reason}"
            )
