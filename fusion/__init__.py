"""The fusion IR: bit-sized data types, tensors, ops, the builder and the reference evaluator.

Example::

    from fusion import FusionDefinition, DataType

    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 1000], DataType.float32)
        fd.add_output(fd.ops.cast(fd.ops.gelu(x), DataType.float4_e2m1))
    print(fd)
"""

from fusion import ops
from fusion.definition import FusionDefinition
from fusion.dtypes import (
    ALL_DTYPES,
    DataType,
    as_dtype,
    bfloat16,
    bool_,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    float64,
    int8,
    int32,
    int64,
    uint8,
)
from fusion.errors import DefinitionError, FusionError, InputError
from fusion.exprs import Expr
from fusion.fp4 import from_fp4, to_fp4
from fusion.ir import Axis, Fusion, IterType, ParallelType, Symbol, TensorView
from fusion.reference import evaluate

__all__ = [
    "ALL_DTYPES", "Axis", "DataType", "DefinitionError", "Expr", "Fusion", "FusionDefinition",
    "FusionError", "InputError", "IterType", "ParallelType", "Symbol", "TensorView", "as_dtype",
    "bfloat16", "bool_", "evaluate", "float16", "float32", "float4_e2m1", "float64",
    "float8_e4m3fn", "float8_e5m2", "from_fp4", "int32", "int64", "int8", "ops", "to_fp4", "uint8",
]  # fmt: skip
