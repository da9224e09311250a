"""Dropout's mask as a pure function of (seed, element): the same on every rank.

A random op run by PyTorch would draw other numbers on each rank and again where the
backward recomputes it. Dropout's mask here is instead counter-based: each element's bit
is a hash of the seed and of the element's global linear index in the whole tensor
(row-major: index = sum of index[d] * stride[d], contiguous strides of the whole shape),
so every rank holding an element, the reference evaluator, the executor and the
backward's recomputation all compute the same bit.

The scheme (integers taken modulo 2^32, computed in int64 and masked):

- ``fmix32(h)``: murmur3's finalizer, ``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13;
  h *= 0xC2B2AE35; h ^= h >> 16``.
- ``key = fmix32(seed_lo ^ fmix32(seed_hi ^ 0x9E3779B9))`` where ``seed_lo``,
  ``seed_hi`` are the seed's (an int64's two's complement) low and high 32 bits.
- ``hash = fmix32(fmix32(index_lo ^ key) ^ index_hi)``, ``index_lo``, ``index_hi`` the
  index's low and high 32 bits.
- keep iff ``hash >= ceil(p * 2^32)`` (``uniform = hash / 2^32 >= p``); the mask is
  ``keep / (1 - p)`` in float32, and ``dropout(x) = x * mask``.

The mask is an IR op, ``dropout_mask(seed, shape, p)`` (``fusion.nn_ops``,
``DropoutMaskOp``), that capture multiplies ``x`` by. Split over ranks, each rank draws
its own piece's bits from the piece's global indices (``dropout_mask`` here with
``origin`` and ``extents``; generated kernels compute the same hash in registers from
the element's global index, ``schedulers.triton_random``), without communication and
without a mask held in memory. Its gradient is none (the seed is an integer), so
``d dropout(x) / dx = grad * mask`` follows from the multiply, the backward drawing the
mask again from the same seed.

Example::

    mask = dropout_mask(torch.tensor([7]), [4, 5], 0.25)  # float32, values 0 or 4/3
    piece = dropout_mask(torch.tensor([7]), [4, 5], 0.25, origin=[0, 2], extents=[4, 3])
    assert torch.equal(piece, mask[:, 2:])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_LOW32 = 0xFFFFFFFF
# the scheme's constants, which generated kernels write in too (``schedulers.codegen``)
FMIX_MULTIPLIERS = (0x85EBCA6B, 0xC2B2AE35)
SEED_SALT = 0x9E3779B9


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer of ``h`` (int64 holding values in [0, 2^32)): int64
    products wrap modulo 2^64, so their low 32 bits are the 32-bit products'."""
    h = h ^ (h >> 16)
    h = (h * FMIX_MULTIPLIERS[0]) & _LOW32
    h = h ^ (h >> 13)
    h = (h * FMIX_MULTIPLIERS[1]) & _LOW32
    return h ^ (h >> 16)


def element_hash(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash (int64 in [0, 2^32)) of each global linear ``index`` (int64) under
    ``seed`` (a one-element int64 tensor), as the module says."""
    seed = seed.reshape(()).to(torch.int64)
    key = fmix32((seed & _LOW32) ^ fmix32(((seed >> 32) & _LOW32) ^ SEED_SALT))
    return fmix32(fmix32((index & _LOW32) ^ key) ^ ((index >> 32) & _LOW32))


def keep_threshold(p: float) -> int:
    """The least hash kept at drop probability ``p``: ``ceil(p * 2^32)``."""
    return math.ceil(p * 2**32)


def global_index(
    shape: Sequence[int], origin: Sequence[int], extents: Sequence[int], device: torch.device
) -> torch.Tensor:
    """The global row-major index (int64) of each element of the piece of a tensor of
    whole ``shape`` that starts at ``origin`` and spans ``extents``, in the piece's shape."""
    index = torch.zeros(list(extents), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        along = torch.arange(origin[dim], origin[dim] + extents[dim], device=device) * stride
        index += along.reshape([-1 if d == dim else 1 for d in range(len(shape))])
        stride *= shape[dim]
    return index


def dropout_mask(
    seed: torch.Tensor,
    shape: Sequence[int],
    p: float,
    origin: Sequence[int] | None = None,
    extents: Sequence[int] | None = None,
) -> torch.Tensor:
    """Dropout's float32 mask of the whole ``shape`` (or of its piece at ``origin`` of
    ``extents``): ``1 / (1 - p)`` where an element is kept, 0 where dropped, on
    ``seed``'s device (see the module)."""
    origin = [0] * len(shape) if origin is None else origin
    extents = list(shape) if extents is None else extents
    index = global_index(shape, origin, extents, seed.device)
    kept = element_hash(seed, index) >= keep_threshold(p)
    # a Python scale, no tensor made from the host (a CUDA graph may be capturing this);
    # p = 1 keeps nothing, so its scale never applies
    return kept.to(torch.float32) * keep_scale(p)


def keep_scale(p: float) -> float:
    """A kept element's value in the mask: ``1 / (1 - p)`` (rounded to float32 where the
    mask is made); 0 for ``p = 1``, which keeps nothing."""
    return 1.0 / (1.0 - p) if p < 1 else 0.0
