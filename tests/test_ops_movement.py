"""Data movement of ``fusion.ops`` (set, broadcast, expand, broadcast_in_dim, reshape, permute,
slice, select) against the same movement done by hand in torch.

Movement copies values, so results must match bit for bit: every comparison is on the
bytes (``.view(torch.uint8)``) through ``fusion.testing.assert_close``, which is exact for
integers. Every dtype is accepted, the storage-only ones included: fp8 tensors are moved
and compared like any other; fp4 tensors go in packed (``fusion.fp4.to_fp4``) and come out
packed, and the test compares their unpacked codes (``fusion.fp4.unpack_fp4``) with the
movement done by hand on the input's codes. fp4 cases keep every innermost extent even,
since two fp4 values share a byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from fusion import FusionDefinition, ops
from fusion.dtypes import (
    ALL_DTYPES,
    DataType,
    bfloat16,
    float4_e2m1,
    float8_e4m3fn,
    float8_e5m2,
    float32,
    int32,
    uint8,
)
from fusion.errors import DefinitionError
from fusion.fp4 import unpack_fp4
from fusion.ir import Symbol
from fusion.testing import assert_close

# Every dtype but fp4, whose cases need even innermost extents and have a grid of their own.
BYTE_DTYPES = [d for d in ALL_DTYPES if d is not float4_e2m1]


@dataclass(frozen=True)
class Movement:
    """One movement: the input's logical shape, the op, the same movement by hand in torch,
    and the exprs the fusion prints for it (``broadcast_in_dim`` is broadcast then expand)."""

    shape: tuple[int, ...]
    fusion_op: Callable
    torch_op: Callable[[torch.Tensor], torch.Tensor]
    printed: tuple[str, ...]


def cases(op_name: str, movements: dict[str, Movement]) -> list:
    return [pytest.param(m, id=f"{op_name}-{case_id}") for case_id, m in movements.items()]


SET = {
    "1": Movement((1,), ops.set, lambda x: x, ("set(T0)",)),
    "7": Movement((7,), ops.set, lambda x: x, ("set(T0)",)),
    "1000": Movement((1000,), ops.set, lambda x: x, ("set(T0)",)),
    "7x1000": Movement((7, 1000), ops.set, lambda x: x, ("set(T0)",)),
    "1000x7": Movement((1000, 7), ops.set, lambda x: x, ("set(T0)",)),
    "1x1": Movement((1, 1), ops.set, lambda x: x, ("set(T0)",)),
    "0-dim": Movement((), ops.set, lambda x: x, ("set(T0)",)),
}
BROADCAST = {
    "7-front": Movement(
        (7,),
        lambda x: ops.broadcast(x, [True, False]),
        lambda x: x[None],
        ("broadcast(T0, dims=[0])",),
    ),
    "7-back": Movement(
        (7,),
        lambda x: ops.broadcast(x, [False, True]),
        lambda x: x[:, None],
        ("broadcast(T0, dims=[1])",),
    ),
    "1000-two-front": Movement(
        (1000,),
        lambda x: ops.broadcast(x, [True, True, False]),
        lambda x: x[None, None],
        ("broadcast(T0, dims=[0, 1])",),
    ),
    "7x1000-middle": Movement(
        (7, 1000),
        lambda x: ops.broadcast(x, [False, True, False]),
        lambda x: x[:, None, :],
        ("broadcast(T0, dims=[1])",),
    ),
    "1000x7-both-ends": Movement(
        (1000, 7),
        lambda x: ops.broadcast(x, [True, False, False, True]),
        lambda x: x[None, :, :, None],
        ("broadcast(T0, dims=[0, 3])",),
    ),
    "1x1-none": Movement(
        (1, 1), lambda x: ops.broadcast(x, [False, False]), lambda x: x, ("broadcast(T0, dims=[])",)
    ),
    "0-dim": Movement(
        (), lambda x: ops.broadcast(x, [True]), lambda x: x[None], ("broadcast(T0, dims=[0])",)
    ),
}
EXPAND = {
    "1x1000-to-7x1000": Movement(
        (1, 1000),
        lambda x: ops.expand(x, [7, 1000]),
        lambda x: x.expand(7, 1000),
        ("expand(T0, shape=[7, 1000])",),
    ),
    "1x1000-keep-last": Movement(
        (1, 1000),
        lambda x: ops.expand(x, [7, -1]),
        lambda x: x.expand(7, -1),
        ("expand(T0, shape=[7, 1000])",),
    ),
    "7x1-keep-first": Movement(
        (7, 1),
        lambda x: ops.expand(x, [-1, 1000]),
        lambda x: x.expand(-1, 1000),
        ("expand(T0, shape=[7, 1000])",),
    ),
    "1x1-to-1000x7": Movement(
        (1, 1),
        lambda x: ops.expand(x, [1000, 7]),
        lambda x: x.expand(1000, 7),
        ("expand(T0, shape=[1000, 7])",),
    ),
    "1-to-7": Movement(
        (1,), lambda x: ops.expand(x, [7]), lambda x: x.expand(7), ("expand(T0, shape=[7])",)
    ),
    "1x1-keep-all": Movement(
        (1, 1),
        lambda x: ops.expand(x, [-1, -1]),
        lambda x: x.expand(-1, -1),
        ("expand(T0, shape=[1, 1])",),
    ),
    "1x7x1-outer": Movement(
        (1, 7, 1),
        lambda x: ops.expand(x, [1000, -1, 1]),
        lambda x: x.expand(1000, -1, 1),
        ("expand(T0, shape=[1000, 7, 1])",),
    ),
}
BROADCAST_IN_DIM = {
    "1000-rows": Movement(
        (1000,),
        lambda x: ops.broadcast_in_dim(x, [7, 1000], [1]),
        lambda x: x[None, :].expand(7, 1000),
        ("broadcast(T0, dims=[0])", "expand(T1, shape=[7, 1000])"),
    ),
    "7-columns": Movement(
        (7,),
        lambda x: ops.broadcast_in_dim(x, [7, 1000], [0]),
        lambda x: x[:, None].expand(7, 1000),
        ("broadcast(T0, dims=[1])", "expand(T1, shape=[7, 1000])"),
    ),
    "1-to-1000x7": Movement(
        (1,),
        lambda x: ops.broadcast_in_dim(x, [1000, 7], [1]),
        lambda x: x[None, :].expand(1000, 7),
        ("broadcast(T0, dims=[0])", "expand(T1, shape=[1000, 7])"),
    ),
    "7x1-same-rank": Movement(
        (7, 1),
        lambda x: ops.broadcast_in_dim(x, [7, 1000], [0, 1]),
        lambda x: x.expand(7, 1000),
        ("expand(T0, shape=[7, 1000])",),
    ),
    "1000-to-7x1x1000": Movement(
        (1000,),
        lambda x: ops.broadcast_in_dim(x, [7, 1, 1000], [2]),
        lambda x: x[None, None, :].expand(7, 1, 1000),
        ("broadcast(T0, dims=[0, 1])", "expand(T1, shape=[7, 1, 1000])"),
    ),
    "0-dim": Movement(
        (),
        lambda x: ops.broadcast_in_dim(x, [7, 1000], []),
        lambda x: x.expand(7, 1000),
        ("broadcast(T0, dims=[0, 1])", "expand(T1, shape=[7, 1000])"),
    ),
}
RESHAPE = {
    "7x1000-to-1000x7": Movement(
        (7, 1000),
        lambda x: ops.reshape(x, [1000, 7]),
        lambda x: x.reshape(1000, 7),
        ("reshape(T0, shape=[1000, 7])",),
    ),
    "7x1000-flat": Movement(
        (7, 1000),
        lambda x: ops.reshape(x, [-1]),
        lambda x: x.reshape(-1),
        ("reshape(T0, shape=[7000])",),
    ),
    "1000-split-inferred": Movement(
        (1000,),
        lambda x: ops.reshape(x, [10, -1, 4]),
        lambda x: x.reshape(10, -1, 4),
        ("reshape(T0, shape=[10, 25, 4])",),
    ),
    "1000x7-inferred-last": Movement(
        (1000, 7),
        lambda x: ops.reshape(x, [7, -1]),
        lambda x: x.reshape(7, -1),
        ("reshape(T0, shape=[7, 1000])",),
    ),
    "7x1000-split-inner": Movement(
        (7, 1000),
        lambda x: ops.reshape(x, [7, 10, 100]),
        lambda x: x.reshape(7, 10, 100),
        ("reshape(T0, shape=[7, 10, 100])",),
    ),
    "1x1-to-1": Movement(
        (1, 1), lambda x: ops.reshape(x, [1]), lambda x: x.reshape(1), ("reshape(T0, shape=[1])",)
    ),
    "7-to-7x1": Movement(
        (7,),
        lambda x: ops.reshape(x, [7, 1]),
        lambda x: x.reshape(7, 1),
        ("reshape(T0, shape=[7, 1])",),
    ),
    "1-to-0-dim": Movement(
        (1,), lambda x: ops.reshape(x, []), lambda x: x.reshape(()), ("reshape(T0, shape=[])",)
    ),
}
PERMUTE = {
    "7x1000-transpose": Movement(
        (7, 1000),
        lambda x: ops.permute(x, [1, 0]),
        lambda x: x.permute(1, 0),
        ("permute(T0, dims=[1, 0])",),
    ),
    "7x1000-negative": Movement(
        (7, 1000),
        lambda x: ops.permute(x, [-1, -2]),
        lambda x: x.permute(-1, -2),
        ("permute(T0, dims=[1, 0])",),
    ),
    "1x7x1000-rotate": Movement(
        (1, 7, 1000),
        lambda x: ops.permute(x, [2, 0, 1]),
        lambda x: x.permute(2, 0, 1),
        ("permute(T0, dims=[2, 0, 1])",),
    ),
    "1000x7x1-mixed-signs": Movement(
        (1000, 7, 1),
        lambda x: ops.permute(x, [-1, 0, -2]),
        lambda x: x.permute(-1, 0, -2),
        ("permute(T0, dims=[2, 0, 1])",),
    ),
    "7x1x1000-inner-swap": Movement(
        (7, 1, 1000),
        lambda x: ops.permute(x, [0, 2, 1]),
        lambda x: x.permute(0, 2, 1),
        ("permute(T0, dims=[0, 2, 1])",),
    ),
    "1x1": Movement(
        (1, 1),
        lambda x: ops.permute(x, [1, 0]),
        lambda x: x.permute(1, 0),
        ("permute(T0, dims=[1, 0])",),
    ),
    "7-identity": Movement(
        (7,), lambda x: ops.permute(x, [0]), lambda x: x.permute(0), ("permute(T0, dims=[0])",)
    ),
}
SLICE = {
    "1000-whole": Movement(
        (1000,),
        lambda x: ops.slice(x, [0], [None]),
        lambda x: x[0:],
        ("slice(T0, starts=[0], stops=[1000], steps=[1])",),
    ),
    "1000-last-7": Movement(
        (1000,),
        lambda x: ops.slice(x, [-7], [None]),
        lambda x: x[-7:],
        ("slice(T0, starts=[993], stops=[1000], steps=[1])",),
    ),
    "1000-step-7": Movement(
        (1000,),
        lambda x: ops.slice(x, [3], [-3], [7]),
        lambda x: x[3:-3:7],
        ("slice(T0, starts=[3], stops=[997], steps=[7])",),
    ),
    "7x1000-steps": Movement(
        (7, 1000),
        lambda x: ops.slice(x, [1, -999], [None, 1000], [2, 3]),
        lambda x: x[1::2, -999:1000:3],
        ("slice(T0, starts=[1, 1], stops=[7, 1000], steps=[2, 3])",),
    ),
    "1000x7-big-step": Movement(
        (1000, 7),
        lambda x: ops.slice(x, [-1000, 2], [1000, -1], [333, 2]),
        lambda x: x[-1000:1000:333, 2:-1:2],
        ("slice(T0, starts=[0, 2], stops=[1000, 6], steps=[333, 2])",),
    ),
    "1x1-whole": Movement(
        (1, 1),
        lambda x: ops.slice(x, [0, 0], [1, None]),
        lambda x: x[0:1, 0:],
        ("slice(T0, starts=[0, 0], stops=[1, 1], steps=[1, 1])",),
    ),
    "7-first-negative": Movement(
        (7,),
        lambda x: ops.slice(x, [-7], [-6]),
        lambda x: x[-7:-6],
        ("slice(T0, starts=[0], stops=[1], steps=[1])",),
    ),
    "7-empty": Movement(
        (7,),
        lambda x: ops.slice(x, [7], [None]),
        lambda x: x[7:],
        ("slice(T0, starts=[7], stops=[7], steps=[1])",),
    ),
}
SELECT = {
    "7x1000-row": Movement(
        (7, 1000), lambda x: ops.select(x, 0, 3), lambda x: x[3], ("select(T0, dim=0, index=3)",)
    ),
    "7x1000-last-column": Movement(
        (7, 1000),
        lambda x: ops.select(x, 1, -1),
        lambda x: x[:, -1],
        ("select(T0, dim=1, index=999)",),
    ),
    "1000x7-negative-dim": Movement(
        (1000, 7),
        lambda x: ops.select(x, -2, -1000),
        lambda x: x.select(-2, -1000),
        ("select(T0, dim=0, index=0)",),
    ),
    "1000-to-0-dim": Movement(
        (1000,), lambda x: ops.select(x, 0, -1), lambda x: x[-1], ("select(T0, dim=0, index=999)",)
    ),
    "1x1": Movement(
        (1, 1), lambda x: ops.select(x, 1, 0), lambda x: x[:, 0], ("select(T0, dim=1, index=0)",)
    ),
    "7x1x1000-inner": Movement(
        (7, 1, 1000),
        lambda x: ops.select(x, -1, 500),
        lambda x: x[..., 500],
        ("select(T0, dim=2, index=500)",),
    ),
}
MOVEMENTS = (
    cases("set", SET)
    + cases("broadcast", BROADCAST)
    + cases("expand", EXPAND)
    + cases("broadcast_in_dim", BROADCAST_IN_DIM)
    + cases("reshape", RESHAPE)
    + cases("permute", PERMUTE)
    + cases("slice", SLICE)
    + cases("select", SELECT)
)

# fp4: every input and output keeps an even innermost extent.
FP4_MOVEMENTS = (
    cases(
        "set",
        {
            "2": Movement((2,), ops.set, lambda x: x, ("set(T0)",)),
            "1000": Movement((1000,), ops.set, lambda x: x, ("set(T0)",)),
            "7x1000": Movement((7, 1000), ops.set, lambda x: x, ("set(T0)",)),
            "1x2": Movement((1, 2), ops.set, lambda x: x, ("set(T0)",)),
        },
    )
    + cases(
        "broadcast",
        {
            "1000-front": Movement(
                (1000,),
                lambda x: ops.broadcast(x, [True, False]),
                lambda x: x[None],
                ("broadcast(T0, dims=[0])",),
            ),
            "7x1000-middle": Movement(
                (7, 1000),
                lambda x: ops.broadcast(x, [False, True, False]),
                lambda x: x[:, None, :],
                ("broadcast(T0, dims=[1])",),
            ),
        },
    )
    + cases(
        "expand",
        {
            "1x1000-to-7x1000": Movement(
                (1, 1000),
                lambda x: ops.expand(x, [7, 1000]),
                lambda x: x.expand(7, 1000),
                ("expand(T0, shape=[7, 1000])",),
            ),
            "1x2-keep-last": Movement(
                (1, 2),
                lambda x: ops.expand(x, [1000, -1]),
                lambda x: x.expand(1000, -1),
                ("expand(T0, shape=[1000, 2])",),
            ),
            "7x1x2-middle": Movement(
                (7, 1, 2),
                lambda x: ops.expand(x, [-1, 1000, -1]),
                lambda x: x.expand(-1, 1000, -1),
                ("expand(T0, shape=[7, 1000, 2])",),
            ),
        },
    )
    + cases(
        "broadcast_in_dim",
        {
            "1000-rows": Movement(
                (1000,),
                lambda x: ops.broadcast_in_dim(x, [7, 1000], [1]),
                lambda x: x[None, :].expand(7, 1000),
                ("broadcast(T0, dims=[0])", "expand(T1, shape=[7, 1000])"),
            ),
            "2-to-7x1x2": Movement(
                (2,),
                lambda x: ops.broadcast_in_dim(x, [7, 1, 2], [2]),
                lambda x: x[None, None, :].expand(7, 1, 2),
                ("broadcast(T0, dims=[0, 1])", "expand(T1, shape=[7, 1, 2])"),
            ),
        },
    )
    + cases(
        "reshape",
        {
            "7x1000-to-14x500": Movement(
                (7, 1000),
                lambda x: ops.reshape(x, [14, 500]),
                lambda x: x.reshape(14, 500),
                ("reshape(T0, shape=[14, 500])",),
            ),
            "1000-inferred-rows": Movement(
                (1000,),
                lambda x: ops.reshape(x, [-1, 10]),
                lambda x: x.reshape(-1, 10),
                ("reshape(T0, shape=[100, 10])",),
            ),
            "2-to-1x2": Movement(
                (2,),
                lambda x: ops.reshape(x, [1, 2]),
                lambda x: x.reshape(1, 2),
                ("reshape(T0, shape=[1, 2])",),
            ),
            "4x6-flat": Movement(
                (4, 6),
                lambda x: ops.reshape(x, [-1]),
                lambda x: x.reshape(-1),
                ("reshape(T0, shape=[24])",),
            ),
        },
    )
    + cases(
        "permute",
        {
            "8x1000-transpose": Movement(
                (8, 1000),
                lambda x: ops.permute(x, [1, 0]),
                lambda x: x.permute(1, 0),
                ("permute(T0, dims=[1, 0])",),
            ),
            "2x7x4-rotate": Movement(
                (2, 7, 4),
                lambda x: ops.permute(x, [1, 2, 0]),
                lambda x: x.permute(1, 2, 0),
                ("permute(T0, dims=[1, 2, 0])",),
            ),
            "6x4-negative": Movement(
                (6, 4),
                lambda x: ops.permute(x, [-1, -2]),
                lambda x: x.permute(-1, -2),
                ("permute(T0, dims=[1, 0])",),
            ),
        },
    )
    + cases(
        "slice",
        {
            "7x1000-steps": Movement(
                (7, 1000),
                lambda x: ops.slice(x, [1, 0], [None, None], [3, 2]),
                lambda x: x[1::3, 0::2],
                ("slice(T0, starts=[1, 0], stops=[7, 1000], steps=[3, 2])",),
            ),
            "8-middle": Movement(
                (8,),
                lambda x: ops.slice(x, [2], [-2]),
                lambda x: x[2:-2],
                ("slice(T0, starts=[2], stops=[6], steps=[1])",),
            ),
            "1000-last-8": Movement(
                (1000,),
                lambda x: ops.slice(x, [-8], [None]),
                lambda x: x[-8:],
                ("slice(T0, starts=[992], stops=[1000], steps=[1])",),
            ),
            "1000x8-big-step": Movement(
                (1000, 8),
                lambda x: ops.slice(x, [-1000, 2], [1000, -2], [333, 1]),
                lambda x: x[-1000:1000:333, 2:-2],
                ("slice(T0, starts=[0, 2], stops=[1000, 6], steps=[333, 1])",),
            ),
        },
    )
    + cases(
        "select",
        {
            "7x1000-last-row": Movement(
                (7, 1000),
                lambda x: ops.select(x, 0, -1),
                lambda x: x[-1],
                ("select(T0, dim=0, index=6)",),
            ),
            "3x4x6-middle": Movement(
                (3, 4, 6),
                lambda x: ops.select(x, 1, -2),
                lambda x: x[:, -2],
                ("select(T0, dim=1, index=2)",),
            ),
            "2x8-row": Movement(
                (2, 8),
                lambda x: ops.select(x, 0, 1),
                lambda x: x[1],
                ("select(T0, dim=0, index=1)",),
            ),
        },
    )
)


def logical(value: torch.Tensor, dtype: DataType) -> torch.Tensor:
    """The values of a boundary tensor, one element each: fp4 codes unpacked, others as is."""
    return unpack_fp4(value) if dtype is float4_e2m1 else value


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, message: str) -> None:
    """Movement copies values: same dtype, same shape, the same bytes everywhere."""
    assert actual.dtype == expected.dtype, f"{message}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{message}: shape {actual.shape} != {expected.shape}"
    assert_close(
        actual.contiguous().reshape(-1).view(torch.uint8),
        expected.contiguous().reshape(-1).view(torch.uint8),
        message=message,
    )


def check_movement(make_input, movement: Movement, dtype: DataType) -> None:
    x = make_input(movement.shape, dtype)
    with FusionDefinition() as fd:
        out = movement.fusion_op(fd.define_tensor(list(movement.shape), dtype))
        fd.add_output(out)
    (result,) = fd.execute([x])

    assert out.dtype is dtype, f"movement changed the dtype to {out.dtype}"
    assert result.dtype == dtype.torch_dtype
    printed = [str(expr).split(" = ", 1)[1] for expr in fd.fusion.exprs]
    assert printed == list(movement.printed)
    expected = movement.torch_op(logical(x, dtype))
    assert out.shape == tuple(expected.shape), f"IR shape {out.shape} != {tuple(expected.shape)}"
    assert_same_bytes(logical(result, dtype), expected, f"{printed[-1]} on {dtype}")


@pytest.mark.parametrize("dtype", BYTE_DTYPES, ids=str)
@pytest.mark.parametrize("movement", MOVEMENTS)
def test_movement_matches_torch(make_input, movement, dtype):
    check_movement(make_input, movement, dtype)


@pytest.mark.parametrize("movement", FP4_MOVEMENTS)
def test_movement_of_packed_fp4_matches_torch_on_codes(make_input, movement):
    check_movement(make_input, movement, float4_e2m1)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_set_returns_a_copy(make_input, dtype):
    x = make_input((7, 1000), dtype)
    before = x.clone()
    with FusionDefinition() as fd:
        fd.add_output(ops.set(fd.define_tensor([7, 1000], dtype)))
    (result,) = fd.execute([x])
    assert result.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x.view(torch.uint8).bitwise_not_()  # overwrite the input: the copy must not change
    assert_same_bytes(logical(result, dtype), logical(before, dtype), f"set on {dtype}")


# ---------------------------------------------------------------------------
# Symbolic extents: one definition, run at several batch sizes


@pytest.mark.parametrize(
    "dtype", [float32, bfloat16, int32, uint8, float8_e4m3fn, float8_e5m2], ids=str
)
def test_movement_with_symbolic_batch(make_input, dtype):
    batch = Symbol("batch")
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 1000], dtype)
        row = fd.define_tensor([1, 1000], dtype)
        split = ops.reshape(x, ["batch", 10, 100])
        moved = ops.slice(ops.permute(split, [0, -1, 1]), [0, 1, 0], [None, None, -1], [1, 2, 3])
        expanded = ops.expand(row, ["batch", -1])
        first = ops.select(x, 0, 0)
        merged = ops.reshape(ops.set(split), [-1, 1000])
        for tensor in (moved, expanded, first, merged):
            fd.add_output(tensor)
    assert moved.shape == (batch, 50, 3)
    assert expanded.shape == (batch, 1000)
    assert merged.shape == (batch, 1000)
    for batch_size in (1, 7, 1000):
        xs, rows = make_input((batch_size, 1000), dtype), make_input((1, 1000), dtype)
        results = fd.execute([xs, rows])
        expected = [
            xs.reshape(batch_size, 10, 100).permute(0, 2, 1)[:, 1::2, 0:-1:3],
            rows.expand(batch_size, -1),
            xs[0],
            xs.reshape(batch_size, 10, 100).reshape(-1, 1000),
        ]
        for index, (result, want) in enumerate(zip(results, expected, strict=True)):
            assert_same_bytes(result, want, f"output {index} at batch {batch_size}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_pad_puts_zeros_around_each_axis(dtype):
    with FusionDefinition() as fd:
        x = fd.define_tensor([3, 4], DataType.from_torch(dtype))
        fd.add_output(fd.ops.pad(x, [1, 0], [2, 3]))
    value = (torch.randn(3, 4) * 4).to(dtype)
    (out,) = fd.execute([value])
    assert out.shape == (6, 7) and out.dtype == dtype
    assert torch.equal(out, torch.nn.functional.pad(value, [0, 3, 1, 2]))


def test_pad_refuses_negative_amounts_and_symbolic_axes():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 4])
        with pytest.raises(DefinitionError, match="must be an int >= 0"):
            fd.ops.pad(x, [0, -1], [0, 0])
        with pytest.raises(DefinitionError, match="symbolic extent"):
            fd.ops.pad(x, [1, 0], [0, 0])
        fd.add_output(fd.ops.pad(x, [0, 1], [0, 1]))  # the symbolic axis left alone
