"""Inputs of a multi-device run, checked with the same verdict on every rank.

A rank describes its local inputs (shape, dtype; ``describe_inputs``), the ranks
exchange the descriptions, and every rank checks all of them (``check_local_inputs``):
symbolic extents are bound from the pieces (a split symbolic extent is the sum of the
pieces along its mesh axis) and every piece must have the local shape its layout gives;
once per set of extents, packed pieces must fill whole bytes and a max/min may not
reduce an axis empty everywhere (``check_bound_extents``). A bad input on one rank thus
raises the same ``InputError`` on every rank, before any collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.binding import Bindings, InputAt, check_constraints, resolve
from fusion.errors import InputError
from fusion.exprs import ReductionOp
from fusion.ir import Fusion, Symbol, TensorView
from sharding.layout import Layout, layout_of, local_shape, split_sizes


def addresses(local_inputs: Sequence[torch.Tensor | None]) -> tuple[int, ...]:
    return tuple(t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in local_inputs)


def describe_inputs(
    local_inputs: Sequence[torch.Tensor | None], count: int, device: torch.device
) -> list[tuple[list[int], str] | None]:
    if not isinstance(local_inputs, (list, tuple)):
        raise InputError(f"local inputs must be a list, got {type(local_inputs).__name__}")
    if len(local_inputs) != count:
        raise InputError(f"the fusion takes {count} inputs, got {len(local_inputs)}")
    described = []
    for position, value in enumerate(local_inputs):
        if value is None:
            described.append(None)
        elif isinstance(value, torch.Tensor):
            _check_device(position, value, device)
            described.append((list(value.shape), str(value.dtype)))
        else:
            raise InputError(
                f"input {position}: expected a torch.Tensor or None, got {type(value).__name__}"
            )
    return described


def _check_device(position: int, value: torch.Tensor, device: torch.device) -> None:
    if value.device.type != device.type or (
        device.index is not None and value.device.index != device.index
    ):
        raise InputError(
            f"input {position}: on {value.device}, but this rank runs on {device}"
            + (" (meta tensors hold no values to run on)" if value.is_meta else "")
        )


def check_devices(local_inputs: Sequence[torch.Tensor], device: torch.device) -> None:
    """Every input is on ``device`` (a tensor on another device, or on ``meta``, is refused)."""
    for position, value in enumerate(local_inputs):
        _check_device(position, value, device)


def check_local_inputs(fusion: Fusion, everyone: list[list]) -> Bindings:
    """Check every rank's described inputs (shape, dtype per input) and bind the symbols.

    A symbolic extent split over a mesh axis is the sum of the pieces along that axis.
    Raises ``InputError`` naming the rank, the input and the mismatch.
    """
    bindings: Bindings = {}
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        where = InputAt(position, tensor)
        expected_dtype = str(tensor.dtype.torch_dtype)
        shapes: dict[int, list[int]] = {}
        for rank in tensor.mesh.ranks:
            entry = everyone[rank][position]
            if entry is None:
                raise InputError(f"rank {rank}: {where} is on this rank but got None")
            shape, dtype = entry
            if dtype != expected_dtype:
                raise InputError(
                    f"rank {rank}: {where}: expected dtype {expected_dtype}, got {dtype}"
                )
            if len(shape) != tensor.ndim:
                raise InputError(
                    f"rank {rank}: {where}: expected rank {tensor.ndim}, got shape {shape}"
                )
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            shapes[rank] = shape
        _bind_symbols(tensor, layout, shapes, bindings, where)
    check_constraints(fusion, bindings)
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        whole = [resolve(e, bindings) for e in tensor.shape]
        for rank in tensor.mesh.ranks:
            shape, _ = everyone[rank][position]
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            expected = local_shape(layout, rank, whole)
            if list(shape) != expected:
                raise InputError(
                    f"rank {rank}: input {position} ({tensor}) placed {layout}: expected the "
                    f"local shape {expected} (of the whole {whole}), got {list(shape)}"
                )
    return bindings


def check_bound_extents(fusion: Fusion, bindings: Bindings) -> None:
    """What only the bound extents tell, checked once per set of extents: packed pieces
    fill whole bytes, and no max/min reduces an axis empty everywhere."""
    check_packed_pieces(fusion, bindings, InputError)
    check_extremes_have_values(fusion, bindings)


def check_packed_pieces(fusion: Fusion, bindings: Bindings, error: type[Exception]) -> None:
    """Every rank's piece of a packed tensor (fp4, two values a byte) split along its
    innermost axis must fill whole bytes; else ``error``, the same verdict on every rank.
    Extents still unbound (symbols before the inputs come) are checked when they are."""
    for tensor in fusion.tensors:
        layout = layout_of(tensor)
        if not tensor.dtype.is_packed or layout is None:
            continue
        innermost = tensor.ndim - 1
        mesh_axis = layout.mesh_axis_of(innermost)
        extent = tensor.shape[innermost]
        if mesh_axis is None or (isinstance(extent, Symbol) and extent not in bindings):
            continue
        extent = resolve(extent, bindings)
        pieces = split_sizes(extent, layout.mesh.shape[mesh_axis])
        per_byte = tensor.dtype.values_per_storage_element
        if any(piece % per_byte for piece in pieces):
            raise error(
                f"{tensor} holds {tensor.dtype} packed {per_byte} values a byte, and its "
                f"innermost axis ({extent} values) is split over mesh axis "
                f"{layout.mesh.axis_names[mesh_axis]!r} into pieces of {pieces} values: a piece "
                f"must fill whole bytes. Make the extent split into multiples of {per_byte} "
                "or split another axis"
            )


def check_extremes_have_values(fusion: Fusion, bindings: Bindings) -> None:
    """A max or min over an axis that is empty on every rank has no value (the reference
    refuses it too); a piece empty on some ranks only is fine (the identity there)."""
    for expr in fusion.exprs:
        if not isinstance(expr, ReductionOp) or expr.op_name not in ("max", "min"):
            continue
        source = expr.inputs[0]
        empty = [d for d in expr.dims if resolve(source.shape[d], bindings) == 0]
        if empty:
            raise InputError(
                f"{expr.op_name} over axis {empty[0]} of {source}, which is empty (extent 0 "
                f"with these inputs): a {expr.op_name} of no values has none"
            )


def _bind_symbols(
    tensor: TensorView,
    layout: Layout,
    shapes: dict[int, list[int]],
    bindings: Bindings,
    where: InputAt,
) -> None:
    for dim, extent in enumerate(tensor.shape):
        if not isinstance(extent, Symbol):
            continue
        mesh_axis = layout.mesh_axis_of(dim)
        first = tensor.mesh.ranks[0]
        if mesh_axis is None:
            value = shapes[first][dim]
        else:
            value = sum(shapes[r][dim] for r in tensor.mesh.team(first, mesh_axis))
        if extent in bindings and bindings[extent] != value:
            raise InputError(
                f"{where}: axis {dim} is {value} in all, but symbol {extent} is already "
                f"{bindings[extent]}"
            )
        bindings[extent] = value
