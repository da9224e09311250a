"""Triton device helpers that draw dropout's bits in registers, as ``fusion.random`` does.

The scheme is ``fusion.random``'s (murmur3's ``fmix32`` over the seed and each element's
global row-major index), written on uint32 values, whose products wrap at 32 bits and
whose right shifts are logical: the same bits as the reference's int64 arithmetic masked
to 32 bits, at a fraction of its cost on a GPU (int64 products take several
instructions). A kernel computes the seed's key once and hashes each element's index::

    key = dropout_key(tl.load(seed_pointer))
    kept = element_hash(key, index) >= threshold   # index: int64 global indices
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusion.random import FMIX_MULTIPLIERS, SEED_SALT

_FMIX_FIRST: tl.constexpr = tl.constexpr(FMIX_MULTIPLIERS[0])
_FMIX_SECOND: tl.constexpr = tl.constexpr(FMIX_MULTIPLIERS[1])
_SALT: tl.constexpr = tl.constexpr(SEED_SALT)


@triton.jit
def fmix32(h):
    """murmur3's finalizer of ``h`` (uint32; the constants typed uint32 too, so no
    product or xor is widened)."""
    h ^= h >> 16
    h *= tl.full((), _FMIX_FIRST, tl.uint32)
    h ^= h >> 13
    h *= tl.full((), _FMIX_SECOND, tl.uint32)
    h ^= h >> 16
    return h


@triton.jit
def dropout_key(seed):
    """The key of ``seed`` (an int64 scalar): ``fmix32(seed_lo ^ fmix32(seed_hi ^ salt))``
    on its two's complement halves."""
    low = seed.to(tl.uint32)  # a narrowing conversion keeps the low 32 bits
    high = (seed >> 32).to(tl.uint32)
    return fmix32(low ^ fmix32(high ^ tl.full((), _SALT, tl.uint32)))


@triton.jit
def element_hash(key, index):
    """The 32-bit hash (uint32) of each global ``index`` (int64) under ``key``."""
    low = index.to(tl.uint32)
    high = (index >> 32).to(tl.uint32)
    return fmix32(fmix32(low ^ key) ^ high)
