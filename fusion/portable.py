"""Tensors of every dtype through pickle (between processes, Ray actors and ranks).

torch pickles the common dtypes, but a tensor of fp8, packed fp4 or a wide unsigned type
pickles into something ``pickle.loads`` cannot rebuild ("UntypedStorage has no attribute
'dtype'"). ``portable`` wraps such a tensor as its bytes and its dtype; ``restored``
rebuilds it. Both walk lists, tuples and dicts (``torch.utils._pytree``), so a whole
result can go through at once.

Example::

    blob = pickle.dumps(portable([fp8_tensor, None]))
    (again, nothing) = restored(pickle.loads(blob))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

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
    """``value`` with every tensor torch cannot unpickle wrapped as a ``PortableTensor``;
    lists, tuples (named ones too) and dicts walked by ``torch.utils._pytree``."""
    return tree_map(_portable_tensor, value)


def _portable_tensor(leaf: object) -> object:
    if not isinstance(leaf, torch.Tensor) or leaf.dtype in _PICKLES:
        return leaf
    flat = leaf.detach().contiguous().reshape(-1, 1)
    return PortableTensor(
        flat.view(torch.uint8), str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape)
    )


def restored(value: object) -> object:
    """The inverse of ``portable``: every ``PortableTensor`` becomes its tensor again
    (a leaf to pytree: a dataclass it does not know)."""
    return tree_map(lambda leaf: leaf.tensor() if isinstance(leaf, PortableTensor) else leaf, value)
