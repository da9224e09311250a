"""DTensors in and out of ``MultiDeviceExecutor.run``.

A DTensor passed as an input is taken as this rank's piece (``to_local()``) once its
mesh (torch's ``DeviceMesh``: the same ranks in the same shape) and placements (torch's
``Shard``, ``Replicate``, ``Partial``) are those the fusion gives that input, and its
global shape the input's; anything else raises ``InputError`` naming the input and both
layouts, before any collective (never reinterpreted). When the inputs came as DTensors,
each output placed on the mesh of one of them comes back as a DTensor on that mesh
(its pieces, the fusion's placements, the global shape), the others as pieces.

An uneven split is cut by balanced sizes here (9 rows over 4 ranks: 3, 2, 2, 2) and by
``torch.chunk`` in DTensor (3, 3, 3, 0). Where the two differ, a DTensor could not stand
for the pieces: such an input or output raises ``InputError`` (``torch_split_differs``
names it), never a DTensor torch would read differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.errors import InputError
from fusion.ir import Fusion, TensorView
from schedulers.runtime import contiguous_strides
from sharding.annotate import as_mesh, as_placement, torch_class
from sharding.layout import Layout, Partial, Replicate, Shard, layout_of, split_sizes

_PLAIN = {torch.Tensor, type(None)}


def is_dtensor(value: object) -> bool:
    return type(value) is not torch.Tensor and torch_class(value) == "DTensor"


def local_pieces(fusion: Fusion, inputs: Sequence) -> tuple[list, dict]:
    """The inputs with each DTensor checked against the fusion and replaced by its local
    piece; and the torch meshes seen, by our mesh (for ``as_dtensors``). Anything but a
    list or tuple is handed back as it is, for the input checks to refuse."""
    if (
        not isinstance(inputs, (list, tuple))
        or set(map(type, inputs)) <= _PLAIN  # the common case, told at C speed
        or not any(map(is_dtensor, inputs))
    ):
        return inputs, {}
    pieces, meshes = [], {}
    for position, (value, tensor) in enumerate(zip(inputs, fusion.inputs, strict=False)):
        if not is_dtensor(value):
            pieces.append(value)
            continue
        given = Layout(
            as_mesh(value.device_mesh),
            tuple(as_placement(p, value.ndim) for p in value.placements),
        )
        expected = layout_of(tensor)
        if expected is None or not _alike(given, expected):
            raise InputError(
                f"input {position} ({tensor}): a DTensor placed {_describe(given)}, but the "
                f"fusion places this input {_describe(expected)}: redistribute it first "
                "(DTensor.redistribute) or annotate the fusion as it is"
            )
        if len(value.shape) != tensor.ndim or any(
            isinstance(e, int) and e != g for e, g in zip(tensor.shape, value.shape, strict=True)
        ):
            raise InputError(
                f"input {position} ({tensor}): a DTensor of global shape "
                f"{list(value.shape)}, expected {tensor}"
            )
        differs = torch_split_differs(expected, [int(e) for e in value.shape])
        if differs:
            raise InputError(f"input {position} ({tensor}): {differs}")
        meshes[expected.mesh] = value.device_mesh
        pieces.append(value.to_local())
    for tensor in fusion.outputs:  # those to come back as DTensors, before anything runs
        layout = layout_of(tensor)
        if layout is not None and layout.mesh in meshes:
            static = [e if isinstance(e, int) else 0 for e in tensor.shape]
            differs = torch_split_differs(layout, static)
            if differs:
                raise InputError(f"output {tensor} would come back as a DTensor, but {differs}")
    return pieces, meshes


def as_dtensors(outputs: list, fusion: Fusion, meshes: dict) -> list:
    """Each output on a mesh the inputs' DTensors came on, as a DTensor there."""
    if not meshes:
        return outputs
    from torch.distributed.tensor import DTensor

    wrapped = []
    for piece, tensor in zip(outputs, fusion.outputs, strict=True):
        layout = layout_of(tensor)
        torch_mesh = meshes.get(layout.mesh) if layout is not None else None
        if piece is None or torch_mesh is None:
            wrapped.append(piece)
            continue
        shape = torch.Size(int(e) for e in _global_shape(tensor, piece, layout))
        differs = torch_split_differs(layout, list(shape))
        if differs:
            raise InputError(f"output {tensor}: {differs}")
        wrapped.append(
            DTensor.from_local(
                piece,
                torch_mesh,
                [torch_placement(p) for p in layout.placements],
                run_check=False,
                shape=shape,
                stride=contiguous_strides(shape),
            )  # fmt: skip
        )
    return wrapped


def torch_split_differs(layout: Layout, shape: Sequence[int]) -> str | None:
    """Why DTensor would cut a tensor of global ``shape`` placed ``layout`` into other
    pieces than ours (an uneven split that ``torch.chunk`` sizes differently), or None."""
    for mesh_axis, placement in enumerate(layout.placements):
        if not isinstance(placement, Shard):
            continue
        extent, parts = shape[placement.dim], layout.mesh.shape[mesh_axis]
        ours = split_sizes(extent, parts)
        step = -(-extent // parts)
        theirs = [max(0, min(step, extent - index * step)) for index in range(parts)]
        if ours != theirs:
            return (f"axis {placement.dim} ({extent}) split over {parts} ranks is cut "
                    f"{ours} here but {theirs} by DTensor (torch.chunk), so no DTensor "
                    "can hold these pieces; use an extent that splits alike")  # fmt: skip
    return None


def _alike(given: Layout, expected: Layout) -> bool:
    """The same ranks in the same shape (axis names aside), the same placements."""
    return (
        given.mesh.shape == expected.mesh.shape
        and given.mesh.ranks == expected.mesh.ranks
        and given.placements == expected.placements
    )


def _describe(layout: Layout | None) -> str:
    if layout is None:
        return "nowhere (it is not annotated)"
    placements = ", ".join(str(p) for p in layout.placements)
    return f"[{placements}] on ranks {list(layout.mesh.ranks)} of shape {list(layout.mesh.shape)}"


def _global_shape(tensor: TensorView, piece: torch.Tensor, layout: Layout) -> list[int]:
    shape = []
    for dim, extent in enumerate(tensor.shape):
        if isinstance(extent, int):
            shape.append(extent)
            continue
        split = [p for p in layout.placements if isinstance(p, Shard) and p.dim == dim]
        if split:  # a symbolic extent split over ranks: its whole is not known here
            raise InputError(f"output {tensor}: a symbolic split extent has no DTensor shape")
        shape.append(piece.shape[dim])
    return shape


def torch_placement(placement):
    """torch's placement for one of ours."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(placement, Shard):
        return TorchShard(placement.dim)
    if isinstance(placement, Partial):
        return TorchPartial(placement.op)
    assert isinstance(placement, Replicate)
    return TorchReplicate()
