"""Tensors of every dtype through pickle, inside the containers results come in."""

from __future__ import annotations

import pickle
from collections import namedtuple

import pytest
import torch

from fusion import to_fp4
from fusion.portable import PortableTensor, portable, restored

Pair = namedtuple("Pair", ["low", "other"])


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1, 1).view(torch.uint8),
            b.contiguous().reshape(-1, 1).view(torch.uint8),
        )
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: (3 * torch.randn(5, 7)).to(torch.float8_e4m3fn),
        lambda: (3 * torch.randn(5, 7)).to(torch.float8_e5m2),
        lambda: to_fp4(3 * torch.randn(4, 6)),
        lambda: torch.tensor(7, dtype=torch.uint16),  # 0-dim, two bytes
        lambda: torch.empty(0, 3, dtype=torch.float8_e4m3fn),
        lambda: (3 * torch.randn(6, 4)).to(torch.float8_e4m3fn).t(),  # not contiguous
    ],
    ids=["e4m3", "e5m2", "fp4", "uint16-scalar", "empty", "transposed"],
)
def test_a_tensor_torch_cannot_unpickle_comes_back_bit_exact(make):
    value = make()
    with pytest.raises(AttributeError):  # what torch does alone
        pickle.loads(pickle.dumps(value))
    assert isinstance(portable(value), PortableTensor)
    assert _bytes_equal(restored(pickle.loads(pickle.dumps(portable(value)))), value)


def test_containers_keep_their_types_and_common_tensors_travel_as_they_are():
    low = torch.randn(3).to(torch.float8_e4m3fn)
    plain = torch.randn(2, 2)
    value = {"pair": Pair(low, [plain, None, 3]), "tuple": (low,)}
    wrapped = portable(value)
    assert wrapped["pair"].other[0] is plain  # float32 pickles as it is
    back = restored(pickle.loads(pickle.dumps(wrapped)))
    assert isinstance(back["pair"], Pair) and isinstance(back["tuple"], tuple)
    assert _bytes_equal(back["pair"].low, low) and _bytes_equal(back["tuple"][0], low)
    assert torch.equal(back["pair"].other[0], plain) and back["pair"].other[1:] == [None, 3]
