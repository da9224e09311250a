"""Data types with their size in bits.

Every size computation in the project is done in bits, so sub-byte types work
everywhere: ``float4_e2m1`` is 4 bits wide and is stored packed, two values per
byte (low nibble first, as ``torch.float4_e2m1fn_x2`` does). A tensor's shape
in the IR counts logical elements; its torch storage counts packed bytes.

Example::

    >>> from fusion.dtypes import float4_e2m1, bfloat16
    >>> float4_e2m1.bits, bfloat16.bits
    (4, 16)
    >>> float4_e2m1.size_bits(1024)
    4096
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class TypeKind(enum.Enum):
    """What family a data type belongs to."""

    FLOAT = "float"
    INT = "int"
    BOOL = "bool"


@dataclass(frozen=True)
class DataType:
    """A scalar type of the IR.

    ``bits`` is the logical size of one element. ``torch_dtype`` is the torch
    dtype a tensor of this type is stored as; for packed sub-byte types one
    torch element holds ``values_per_storage_element`` logical elements.
    ``storage_only`` types (fp8, fp4) carry data but take no arithmetic: cast
    them to a compute type first.
    """

    name: str
    short: str
    bits: int
    kind: TypeKind
    torch_dtype: torch.dtype
    values_per_storage_element: int = 1
    storage_only: bool = False

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DataType.{self.name}"

    @property
    def is_floating(self) -> bool:
        return self.kind is TypeKind.FLOAT

    @property
    def is_integer(self) -> bool:
        return self.kind is TypeKind.INT

    @property
    def is_bool(self) -> bool:
        return self.kind is TypeKind.BOOL

    @property
    def is_packed(self) -> bool:
        """True when several logical elements share one storage element."""
        return self.values_per_storage_element > 1

    def size_bits(self, numel: int) -> int:
        """Storage size in bits of ``numel`` logical elements."""
        return self.bits * numel

    def storage_extent(self, innermost_extent: int) -> int:
        """Extent of the innermost storage axis that holds ``innermost_extent`` values."""
        if innermost_extent % self.values_per_storage_element:
            raise ValueError(
                f"{self.name} stores {self.values_per_storage_element} values per "
                f"{self.torch_dtype}; innermost extent {innermost_extent} is not a multiple"
            )
        return innermost_extent // self.values_per_storage_element

    @staticmethod
    def from_torch(dtype: torch.dtype) -> DataType:
        """The IR type stored as ``dtype`` (``torch.float4_e2m1fn_x2`` maps to ``float4_e2m1``)."""
        try:
            return _BY_TORCH[dtype]
        except KeyError:
            supported = ", ".join(str(t) for t in _BY_TORCH)
            raise ValueError(f"unsupported torch dtype {dtype}; supported: {supported}") from None

    def to_torch(self) -> torch.dtype:
        return self.torch_dtype

    # Data types are singletons compared with ``is``: copies and unpickled values are the
    # same objects (fusions are deep-copied by passes and pickled to Ray actors).
    def __reduce__(self) -> tuple:
        return as_dtype, (self.name,)

    def __copy__(self) -> DataType:
        return self

    def __deepcopy__(self, memo: dict) -> DataType:
        return self


float64 = DataType("float64", "f64", 64, TypeKind.FLOAT, torch.float64)
float32 = DataType("float32", "f32", 32, TypeKind.FLOAT, torch.float32)
bfloat16 = DataType("bfloat16", "bf16", 16, TypeKind.FLOAT, torch.bfloat16)
float16 = DataType("float16", "f16", 16, TypeKind.FLOAT, torch.float16)
float8_e4m3fn = DataType(
    "float8_e4m3fn", "f8e4m3", 8, TypeKind.FLOAT, torch.float8_e4m3fn, storage_only=True
)
float8_e5m2 = DataType(
    "float8_e5m2", "f8e5m2", 8, TypeKind.FLOAT, torch.float8_e5m2, storage_only=True
)
float4_e2m1 = DataType(
    "float4_e2m1",
    "f4e2m1",
    4,
    TypeKind.FLOAT,
    torch.float4_e2m1fn_x2,
    values_per_storage_element=2,
    storage_only=True,
)
int64 = DataType("int64", "i64", 64, TypeKind.INT, torch.int64)
int32 = DataType("int32", "i32", 32, TypeKind.INT, torch.int32)
int8 = DataType("int8", "i8", 8, TypeKind.INT, torch.int8)
uint8 = DataType("uint8", "u8", 8, TypeKind.INT, torch.uint8)
# A bool occupies one byte in torch storage; its size is counted as 8 bits.
bool_ = DataType("bool", "bool", 8, TypeKind.BOOL, torch.bool)

ALL_DTYPES: tuple[DataType, ...] = (
    float64,
    float32,
    bfloat16,
    float16,
    float8_e4m3fn,
    float8_e5m2,
    float4_e2m1,
    int64,
    int32,
    int8,
    uint8,
    bool_,
)
FLOAT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_floating)
COMPUTE_FLOAT_DTYPES = tuple(d for d in FLOAT_DTYPES if not d.storage_only)
INT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_integer)

_BY_TORCH = {d.torch_dtype: d for d in ALL_DTYPES}
_BY_NAME = {d.name: d for d in ALL_DTYPES} | {d.short: d for d in ALL_DTYPES}

for _dtype in ALL_DTYPES:
    setattr(DataType, _dtype.name, _dtype)
DataType.bool_ = bool_  # the module-level spelling, so both DataType.bool and DataType.bool_ work


def as_dtype(value: DataType | torch.dtype | str) -> DataType:
    """Accept a ``DataType``, a torch dtype or a name (``"bf16"``, ``"bfloat16"``)."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, torch.dtype):
        return DataType.from_torch(value)
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    raise ValueError(
        f"unknown data type {value!r}; use one of: {', '.join(d.name for d in ALL_DTYPES)}"
    )


def compute_dtype(dtype: DataType) -> DataType:
    """The type an op computes in before rounding to ``dtype``.

    Low-precision floats compute in float32 and round once at the output;
    float64 and integers compute in their own type.
    """
    if dtype.is_floating and dtype is not float64:
        return float32
    return dtype


def promote_types(a: DataType, b: DataType) -> DataType:
    """The result type of a binary op on tensors of types ``a`` and ``b`` (torch's rules)."""
    return DataType.from_torch(torch.promote_types(a.torch_dtype, b.torch_dtype))


def promote_with_scalar(a: DataType, scalar: bool | int | float) -> DataType:
    """The result type of a binary op on a tensor of type ``a`` and a Python scalar."""
    probe = torch.empty(1, dtype=a.torch_dtype)
    return DataType.from_torch(torch.result_type(probe, scalar))


def machine_epsilon(dtype: DataType) -> float:
    """Distance from 1.0 to the next representable value (floating types only)."""
    if dtype is float4_e2m1:
        return 0.5
    return torch.finfo(dtype.torch_dtype).eps
