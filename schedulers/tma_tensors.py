"""TMA tensor descriptors as launches hand them over: ``tma_descriptor`` describes a
contiguous tensor read in tiles (a ``TmaTensor``), ``triton_arguments`` turns those into
the ``TensorDescriptor`` Triton's ``JITFunction`` takes, ``Descriptors`` encodes them for
a compiled launcher's entry once an address.

A ``TmaTensor`` holds the fields of Triton's ``TensorDescriptor`` (what its launcher's
encoding reads) without its constructor's checks, which took 1.2 us of a CPU's host
time a tensor (about 3 on an H200's host), its layout in tuples that a compiled
kernel's key (``schedulers.runtime.specialization``) holds as they are. The first
launch of each key goes through the ``JITFunction`` as a ``TensorDescriptor``, whose
checks then pass on that layout; later launches of the key have the same layout.

Nothing here imports Triton at module level (see ``schedulers.runtime``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class TmaTensor(NamedTuple):
    """A contiguous tensor read through TMA: its base (16-byte aligned), shape, strides
    (in elements), tile (``block_shape``) and padding, as Triton's ``TensorDescriptor``
    names them."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_shape: tuple[int, ...]
    padding: str = "zero"

    def triton(self):
        """The ``TensorDescriptor`` Triton's ``JITFunction`` takes (its checks run)."""
        from triton.tools.tensor_descriptor import TensorDescriptor  # see the docstring

        return TensorDescriptor(self.base, list(self.shape), list(self.strides),
                                list(self.block_shape), self.padding)  # fmt: skip


def tma_descriptor(
    tensor: torch.Tensor, rows: int, columns: int, box: Sequence[int], params: object
) -> TmaTensor:
    """Contiguous ``tensor`` seen as (rows, columns), read in ``box`` tiles. TMA needs
    rows of a multiple of 16 bytes (``ValueError`` naming ``params`` otherwise) and a
    16-byte aligned base (a misaligned tensor is copied)."""
    if columns * tensor.element_size() % 16:
        raise ValueError(
            f"{params}: rows of {columns} {tensor.dtype} are not a multiple of 16 bytes, "
            "which TMA descriptors need"
        )
    if tensor.data_ptr() % 16:
        tensor = tensor.clone()
    return TmaTensor(tensor, (rows, columns), (columns, 1), tuple(box))


def triton_arguments(arguments: Sequence) -> tuple:
    """``arguments`` as Triton's ``JITFunction`` takes them: each ``TmaTensor`` as a
    ``TensorDescriptor``."""
    return tuple(a.triton() if type(a) is TmaTensor else a for a in arguments)


class Descriptors:
    """A compiled kernel's tensor-descriptor arguments (at ``positions``, encoded as its
    ``metas`` say) as its launcher's entry takes them: encoded once an address and
    layout (Triton's wrapper encoded each at every launch, cuTensorMapEncodeTiled: 25
    us of a LayerNorm backward's host time with two). An encoded descriptor holds the
    address, not the tensor. The arguments are ``TmaTensor``s or ``TensorDescriptor``s
    (the encoding reads the fields they share)."""

    def __init__(self, positions: list[int], metas: list) -> None:
        from triton.backends.nvidia.driver import make_tensordesc_arg  # see the docstring

        self.encode = make_tensordesc_arg
        self.places = sorted(zip(positions, metas, strict=True), reverse=True)
        self.encoded: dict[tuple, list] = {}

    def __call__(self, passed: list) -> list:
        passed = list(passed)
        for position, meta in self.places:  # the last first: the earlier stay in place
            descriptor = passed[position]
            if meta is None:  # decomposed on the host, the tensor itself among them
                passed[position : position + 1] = self.encode(descriptor, None)
                continue
            # its layout is the same at every launch: part of the compiled kernel's key
            at = (position, descriptor.base.data_ptr())
            encoded = self.encoded.get(at)
            if encoded is None:
                if len(self.encoded) >= ENCODED_DESCRIPTORS:  # addresses keep changing
                    self.encoded.clear()
                encoded = self.encoded[at] = self.encode(descriptor, meta)
            passed[position : position + 1] = encoded
        return passed


ENCODED_DESCRIPTORS = 64  # a kernel's encoded tensor descriptors kept, at most
