"""How tensors are stored: packed fp4 (two values a byte) against one value an element.

The IR counts logical values (an fp4 tensor of shape [6, 8] holds 48 values). Between
kernels, and at a fusion's boundary, packed types hold ``values_per_storage_element``
values in each byte; the reference evaluator computes on one code per byte. Every
conversion between the three is here, for the evaluator and the executor alike.

Example::

    held = torch.empty(storage_shape(t, [6, 8]), dtype=storage_dtype(t))   # [6, 4] bytes
    codes = unpacked(t, held)       # [6, 8], one fp4 code a byte
    assert logical_shape(t, packed(t, codes)) == [6, 8]
"""

from __future__ import annotations

import torch

from fusion.dtypes import DataType, float4_e2m1
from fusion.fp4 import pack_fp4, unpack_fp4
from fusion.ir import TensorView


def is_packed(tensor: TensorView) -> bool:
    """Whether ``tensor`` is stored packed (fp4, the one packed type: two values a byte)."""
    return tensor.dtype.is_packed


def storage_dtype(tensor: TensorView) -> torch.dtype:
    """The torch dtype a rank holds ``tensor`` in between kernels (fp4: bytes)."""
    return torch.uint8 if is_packed(tensor) else tensor.dtype.torch_dtype


def storage_shape(tensor: TensorView, shape: list[int]) -> list[int]:
    """The storage shape of a logical shape: packed fp4 halves the innermost extent."""
    return shape[:-1] + [shape[-1] // 2] if is_packed(tensor) else list(shape)


def logical_shape(tensor: TensorView, value: torch.Tensor) -> list[int]:
    """The logical shape of a held value (packed fp4 holds two values per byte)."""
    shape = list(value.shape)
    return shape[:-1] + [2 * shape[-1]] if is_packed(tensor) else shape


def unpacked(tensor: TensorView, value: torch.Tensor | None) -> torch.Tensor | None:
    """Held fp4 bytes as one code per value (what the reference evaluator computes on)."""
    return unpack_fp4(value) if value is not None and is_packed(tensor) else value


def packed(tensor: TensorView, value: torch.Tensor | None) -> torch.Tensor | None:
    """fp4 codes packed two per byte, as bytes (how kernels and buffers hold fp4)."""
    if value is None or not is_packed(tensor):
        return value
    return pack_fp4(value).view(torch.uint8)


def to_logical(dtype: DataType, value: torch.Tensor) -> torch.Tensor:
    """A boundary tensor in the evaluator's representation (fp4: unpacked codes)."""
    return unpack_fp4(value) if dtype is float4_e2m1 else value


def to_storage(dtype: DataType, value: torch.Tensor) -> torch.Tensor:
    """An evaluator value as a contiguous boundary tensor (fp4: packed two per byte)."""
    return pack_fp4(value) if dtype is float4_e2m1 else value.contiguous()
