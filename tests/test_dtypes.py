"""Data types: sizes in bits against torch's storage, torch round trips, names, promotion."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusion import dtypes
from fusion.dtypes import ALL_DTYPES, DataType, as_dtype, promote_types

# Written out by hand: the sizes every bit computation of the project rests on.
EXPECTED_BITS = {
    "float64": 64,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "float4_e2m1": 4,
    "int64": 64,
    "int32": 32,
    "int8": 8,
    "uint8": 8,
    "bool": 8,
}

EXPECTED_TORCH = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float4_e2m1": torch.float4_e2m1fn_x2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

EXPECTED_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
    "float4_e2m1": "f4e2m1",
    "int64": "i64",
    "int32": "i32",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
}

COMPUTE_DTYPES = [d for d in ALL_DTYPES if not d.storage_only]
UNPACKED_DTYPES = [d for d in ALL_DTYPES if not d.is_packed]

# torch promotes int8 with uint8 to int16, a type the IR does not have: promote_types raises
# (tested below) and ops turn that into a DefinitionError (tests/test_errors.py).
_PROMOTES_TO_A_TYPE_OUTSIDE_THE_IR = {(dtypes.int8, dtypes.uint8), (dtypes.uint8, dtypes.int8)}


def _ids(values):
    return [str(v) for v in values]


def test_all_dtypes_lists_exactly_the_expected_types():
    assert [d.name for d in ALL_DTYPES] == list(EXPECTED_BITS)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids(ALL_DTYPES))
def test_bits_match_the_expected_table(dtype):
    assert dtype.bits == EXPECTED_BITS[dtype.name]


@pytest.mark.parametrize("dtype", UNPACKED_DTYPES, ids=_ids(UNPACKED_DTYPES))
def test_bits_of_an_unpacked_type_equal_torchs_element_size(dtype):
    assert dtype.bits == torch.empty(0, dtype=dtype.to_torch()).element_size() * 8
    assert dtype.bits == dtype.to_torch().itemsize * 8


def test_fp4_is_half_a_byte_of_torchs_packed_pair_type():
    assert dtypes.float4_e2m1.is_packed
    assert dtypes.float4_e2m1.values_per_storage_element == 2
    assert torch.float4_e2m1fn_x2.itemsize == 1
    assert dtypes.float4_e2m1.bits == torch.float4_e2m1fn_x2.itemsize * 8 // 2


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 1000, 1024])
@pytest.mark.parametrize("dtype", UNPACKED_DTYPES, ids=_ids(UNPACKED_DTYPES))
def test_size_bits_of_an_unpacked_type_equals_torchs_storage_size(dtype, numel):
    storage = torch.empty(numel, dtype=dtype.to_torch()).untyped_storage()
    assert dtype.size_bits(numel) == storage.nbytes() * 8


@pytest.mark.parametrize("numel", [0, 2, 8, 1000, 1024])
def test_size_bits_of_fp4_equals_the_packed_storage_size(numel):
    storage = torch.empty(numel // 2, dtype=torch.float4_e2m1fn_x2).untyped_storage()
    assert dtypes.float4_e2m1.size_bits(numel) == storage.nbytes() * 8 == 4 * numel


def test_size_bits_worked_examples():
    assert dtypes.float4_e2m1.size_bits(1024) == 4096
    assert dtypes.bfloat16.size_bits(7) == 112
    assert dtypes.bool_.size_bits(3) == 24
    assert dtypes.float64.size_bits(1000) == 64000


@pytest.mark.parametrize("extent", [0, 1, 7, 1000])
@pytest.mark.parametrize("dtype", UNPACKED_DTYPES, ids=_ids(UNPACKED_DTYPES))
def test_storage_extent_of_an_unpacked_type_is_the_logical_extent(dtype, extent):
    assert dtype.storage_extent(extent) == extent


@pytest.mark.parametrize(("values", "bytes_"), [(0, 0), (2, 1), (8, 4), (1000, 500)])
def test_storage_extent_of_fp4_counts_bytes(values, bytes_):
    assert dtypes.float4_e2m1.storage_extent(values) == bytes_


@pytest.mark.parametrize("extent", [1, 7, 999])
def test_storage_extent_of_fp4_refuses_an_odd_extent(extent):
    with pytest.raises(ValueError, match=rf"float4_e2m1 .*2 values.*extent {extent} is not"):
        dtypes.float4_e2m1.storage_extent(extent)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids(ALL_DTYPES))
def test_to_torch_is_the_expected_torch_dtype(dtype):
    assert dtype.to_torch() is EXPECTED_TORCH[dtype.name]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids(ALL_DTYPES))
def test_from_torch_of_to_torch_is_the_same_object(dtype):
    assert DataType.from_torch(dtype.to_torch()) is dtype


@pytest.mark.parametrize("torch_dtype", [torch.int16, torch.complex64, torch.float8_e4m3fnuz])
def test_from_torch_refuses_a_dtype_the_ir_lacks_and_lists_the_supported(torch_dtype):
    with pytest.raises(
        ValueError, match=rf"unsupported torch dtype {torch_dtype}.*torch\.bfloat16"
    ):
        DataType.from_torch(torch_dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids(ALL_DTYPES))
def test_as_dtype_accepts_the_name_the_short_name_the_torch_dtype_and_itself(dtype):
    assert dtype.short == EXPECTED_SHORT[dtype.name]
    assert as_dtype(dtype.name) is dtype
    assert as_dtype(EXPECTED_SHORT[dtype.name]) is dtype
    assert as_dtype(EXPECTED_TORCH[dtype.name]) is dtype
    assert as_dtype(dtype) is dtype
    assert getattr(DataType, dtype.name) is dtype


@pytest.mark.parametrize("value", ["float128", "fp32", "Float32", "", "int16"])
def test_as_dtype_refuses_an_unknown_name_and_lists_the_known_ones(value):
    with pytest.raises(ValueError, match=rf"unknown data type {value!r}; use one of: float64, "):
        as_dtype(value)


@pytest.mark.parametrize("value", [32, None, 1.5])
def test_as_dtype_refuses_a_value_that_is_not_a_type(value):
    with pytest.raises(ValueError, match=rf"unknown data type {value!r}"):
        as_dtype(value)


def test_as_dtype_refuses_a_torch_dtype_the_ir_lacks():
    with pytest.raises(ValueError, match="unsupported torch dtype torch.int16"):
        as_dtype(torch.int16)


@pytest.mark.parametrize(
    ("lhs", "rhs"),
    [
        (a, b)
        for a, b in itertools.product(COMPUTE_DTYPES, COMPUTE_DTYPES)
        if (a, b) not in _PROMOTES_TO_A_TYPE_OUTSIDE_THE_IR
    ],
    ids=lambda d: str(d),
)
def test_promote_types_agrees_with_torch(lhs, rhs):
    expected = torch.promote_types(lhs.to_torch(), rhs.to_torch())
    assert promote_types(lhs, rhs).to_torch() is expected


@pytest.mark.parametrize(("lhs", "rhs"), sorted(_PROMOTES_TO_A_TYPE_OUTSIDE_THE_IR, key=str))
def test_promote_types_refuses_a_result_outside_the_ir(lhs, rhs):
    with pytest.raises(ValueError, match="torch.int16"):
        promote_types(lhs, rhs)


@pytest.mark.parametrize(
    ("lhs", "rhs", "expected"),
    [
        ("bf16", "f16", "f32"),
        ("bf16", "f32", "f32"),
        ("f16", "f64", "f64"),
        ("i32", "f16", "f16"),
        ("i64", "bf16", "bf16"),
        ("u8", "i32", "i32"),
        ("bool", "i8", "i8"),
        ("bool", "bool", "bool"),
        ("i8", "i64", "i64"),
    ],
)
def test_promote_types_worked_examples(lhs, rhs, expected):
    assert promote_types(as_dtype(lhs), as_dtype(rhs)) is as_dtype(expected)
    assert promote_types(as_dtype(rhs), as_dtype(lhs)) is as_dtype(expected)
