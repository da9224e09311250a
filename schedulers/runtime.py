"""Helpers every scheduler shares at plan and launch time: sizes rounded to powers of
two, grid sizes, and how tensors are handed to a kernel (fp8 and fp4 as bytes, TMA
tensor descriptors).

Nothing here imports Triton at module level: importing Triton before
``TRITON_INTERPRET`` is set (the tests set it at collection) would leave the
interpreter unable to run Triton's own jit functions.
"""

from __future__ import annotations

import torch


def next_power_of_two(value: int) -> int:
    """The smallest power of two at least ``value`` (1 for ``value`` <= 1)."""
    return 1 << max(0, (value - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up: programs of ``b`` elements that cover ``a``."""
    return -(-a // b)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 and fp4 tensors are read and written as their byte codes."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2):
        return tensor.view(torch.uint8)
    return tensor


def tma_descriptor(tensor: torch.Tensor, rows: int, columns: int, box: list[int], params):
    """A TMA tensor descriptor of contiguous ``tensor`` seen as (rows, columns), read in
    ``box`` tiles. TMA needs rows of a multiple of 16 bytes (``ValueError`` naming
    ``params`` otherwise) and a 16-byte aligned base (a misaligned tensor is copied)."""
    # imported here: see the module's docstring
    from triton.tools.tensor_descriptor import TensorDescriptor

    if columns * tensor.element_size() % 16:
        raise ValueError(
            f"{params}: rows of {columns} {tensor.dtype} are not a multiple of 16 bytes, "
            "which TMA descriptors need"
        )
    if tensor.data_ptr() % 16:
        tensor = tensor.clone()
    return TensorDescriptor(tensor, [rows, columns], [columns, 1], box)
