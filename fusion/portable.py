"""Tensors of every dtype through pickle (between processes, Ray actors and ranks).

torch pickles the common dtypes, but a tensor of fp8, packed fp4 or a wide unsigned type
pickles into something ``pickle.loads`` cannot rebuild ("UntypedStorage has no attribute
'dtype'"). ``portable`` wraps such a tensor as its bytes and its dtype; ``restored``
rebuilds it. Both walk lists, tuples and dicts, so a whole result can go through at once.

Example::

    blob = pickle.dumps(portable([fp8_tensor, None]))
    (again, nothing) = restored(pickle.loads(blob))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtypes torch's own pickling rebuilds (2.11 to 2.13)
_PICKLES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
}  # fmt: skip


@dataclass
class PortableTensor:
    """A tensor as bytes: ``data`` (uint8, one row of bytes per element), dtype, shape."""

    data: torch.Tensor
    dtype: str  # the attribute name in torch: "float8_e4m3fn"
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        return self.data.view(dtype).reshape(self.shape)


def portable(value: object) -> object:
    """``value`` with every tensor torch cannot unpickle wrapped as a ``PortableTensor``."""
    if isinstance(value, torch.Tensor):
        if value.dtype in _PICKLES:
            return value
        flat = value.detach().contiguous().reshape(-1, 1)
        return PortableTensor(
            flat.view(torch.uint8), str(value.dtype).removeprefix("torch."), tuple(value.shape)
        )
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [portable(item) for item in value])
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    return value


def _rebuilt(value: list | tuple, items: list) -> list | tuple:
    """A list or tuple of ``value``'s type (a named tuple's fields by position)."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def restored(value: object) -> object:
    """The inverse of ``portable``: every ``PortableTensor`` becomes its tensor again."""
    if isinstance(value, PortableTensor):
        return value.tensor()
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [restored(item) for item in value])
    if isinstance(value, dict):
        return {key: restored(item) for key, item in value.items()}
    return value
