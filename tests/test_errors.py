"""Bad input gets a clear error: the right class, and a message naming the op, the tensors and
the mismatch. Definition errors are raised when the op is added; input errors by
``execute`` before anything runs.
"""

from __future__ import annotations

import re

import pytest
import torch

import fusion.reference
from fusion import DataType, DefinitionError, FusionDefinition, FusionError, InputError
from fusion.dtypes import bfloat16, bool_, float4_e2m1, float8_e4m3fn, float32, int32


def _mentions(*pieces: str) -> str:
    """A regex matching a message that contains every piece, literally, in any order."""
    return "(?s)^" + "".join(f"(?=.*{re.escape(piece)})" for piece in pieces)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if the evaluator computes any expr."""

    def refuse(expr, values, shape_of):
        raise AssertionError(f"{expr} ran although the inputs are invalid")

    monkeypatch.setattr(fusion.reference, "evaluate_expr", refuse)


def test_error_classes_share_one_base():
    assert issubclass(DefinitionError, FusionError)
    assert issubclass(InputError, FusionError)
    assert issubclass(FusionError, ValueError)
    assert not issubclass(DefinitionError, InputError)


# ---------------------------------------------------------------------------
# Definition errors: (build the fusion up to the bad op, what the message must mention)

T0_7x1000 = "T0_f32[iS0{7}, iS1{1000}]"
T0_7x8 = "T0_f32[iS0{7}, iS1{8}]"

DEFINITION_ERRORS = {
    # wrong rank
    "add of rank 2 and rank 1": (
        lambda fd: fd.ops.add(fd.define_tensor([7, 1000]), fd.define_tensor([1000])),
        ["add:", "same rank", T0_7x1000, "has rank 2", "T1_f32[iS2{1000}] has rank 1"],
    ),
    "matmul of rank 1": (
        lambda fd: fd.ops.matmul(fd.define_tensor([8]), fd.define_tensor([8, 4])),
        ["matmul:", "T0_f32[iS0{8}] has rank 1", "rank >= 2"],
    ),
    "linear weight of rank 3": (
        lambda fd: fd.ops.linear(fd.define_tensor([7, 8]), fd.define_tensor([2, 4, 8])),
        ["linear:", "weight T1_f32[iS2{2}, iS3{4}, iS4{8}]", "rank 2", "not 3"],
    ),
    # wrong shape
    "add of [7, 1000] and [7, 999]": (
        lambda fd: fd.ops.add(fd.define_tensor([7, 1000]), fd.define_tensor([7, 999])),
        ["add:", "axis 1", f"{T0_7x1000} has 1000", "T1_f32[iS2{7}, iS3{999}] has 999"],
    ),
    "matmul with K 8 against 9": (
        lambda fd: fd.ops.matmul(fd.define_tensor([7, 8]), fd.define_tensor([9, 4])),
        ["matmul:", "contraction", f"{T0_7x8} has K=8", "T1_f32[iS2{9}, iS3{4}] has K=9"],
    ),
    "linear bias of the wrong N": (
        lambda fd: fd.ops.linear(
            fd.define_tensor([7, 8]), fd.define_tensor([4, 8]), fd.define_tensor([5])
        ),
        ["linear:", "output features", "T1_f32[iS2{4}, iS3{8}] has N=4", "T2_f32[iS4{5}] has N=5"],
    ),
    "reshape changing the element count": (
        lambda fd: fd.ops.reshape(fd.define_tensor([7, 8]), [5, 11]),
        ["reshape:", T0_7x8, "[7, 8]", "[5, 11]", "element counts differ"],
    ),
    "reshape with -1 that cannot divide": (
        lambda fd: fd.ops.reshape(fd.define_tensor([7, 8]), [3, -1]),
        ["reshape:", T0_7x8, "[3, -1]", "element counts differ"],
    ),
    "expand of an axis of extent 8": (
        lambda fd: fd.ops.expand(fd.define_tensor([7, 8]), [7, 16]),
        ["expand:", f"axis 1 of {T0_7x8}", "extent 8", "cannot expand to 16"],
    ),
    "expand with the wrong rank": (
        lambda fd: fd.ops.expand(fd.define_tensor([1, 8]), [4, 1, 8]),
        ["expand:", "[4, 1, 8]", "3 entries", "T0_f32[bS0{1}, iS1{8}]", "rank 2"],
    ),
    "slice stop past the end": (
        lambda fd: fd.ops.slice(fd.define_tensor([7, 8]), [0, 0], [7, 9]),
        ["slice:", "stop 9", "out of range", f"axis 1 of {T0_7x8}", "(extent 8)"],
    ),
    "slice start before the beginning": (
        lambda fd: fd.ops.slice(fd.define_tensor([7, 8]), [-8, 0], [7, 8]),
        ["slice:", "start -8", "out of range", f"axis 0 of {T0_7x8}", "(extent 7)"],
    ),
    "select past the end": (
        lambda fd: fd.ops.select(fd.define_tensor([7, 8]), 1, 8),
        ["select:", "index 8", "out of range", f"axis 1 of {T0_7x8}", "(extent 8)"],
    ),
    "select before the beginning": (
        lambda fd: fd.ops.select(fd.define_tensor([7, 8]), 0, -8),
        ["select:", "index -8", "out of range", f"axis 0 of {T0_7x8}", "(extent 7)"],
    ),
    "permute with a repeated axis": (
        lambda fd: fd.ops.permute(fd.define_tensor([7, 8, 3]), [0, 0, 1]),
        ["permute:", "[0, 0, 1]", "not a permutation", "T0_f32[iS0{7}, iS1{8}, iS2{3}]"],
    ),
    "permute with too few dims": (
        lambda fd: fd.ops.permute(fd.define_tensor([7, 8, 3]), [1, 0]),
        ["permute:", "[1, 0]", "3 entries", "T0_f32[iS0{7}, iS1{8}, iS2{3}]"],
    ),
    "sum over a repeated axis": (
        lambda fd: fd.ops.sum(fd.define_tensor([7, 8]), dims=[1, -1]),
        ["sum:", "[1, -1]", T0_7x8, "repeat an axis"],
    ),
    "max over an axis out of range": (
        lambda fd: fd.ops.max(fd.define_tensor([7, 8]), dims=[2]),
        ["max:", "dim 2", "out of range", T0_7x8, "rank 2"],
    ),
    "var_mean over a negative axis out of range": (
        lambda fd: fd.ops.var_mean(fd.define_tensor([7, 8]), dims=[-3]),
        ["var_mean:", "dim -3", "out of range", T0_7x8, "rank 2"],
    ),
    # wrong dtype
    "where with a float condition": (
        lambda fd: fd.ops.where(fd.define_tensor([7, 8]), fd.define_tensor([7, 8]), 0.0),
        ["where:", f"cond {T0_7x8}", "is float32", "must be bool"],
    ),
    "matmul of bfloat16 and float32": (
        lambda fd: fd.ops.matmul(fd.define_tensor([7, 8], bfloat16), fd.define_tensor([8, 4])),
        ["matmul:", "dtypes differ", "T0 is bfloat16", "T1 is float32"],
    ),
    "mean of an int32 tensor": (
        lambda fd: fd.ops.mean(fd.define_tensor([7, 8], int32)),
        ["mean:", "T0_i32[iS0{7}, iS1{8}] is int32", "floating-point"],
    ),
    "add of two fp8 tensors": (
        lambda fd: fd.ops.add(
            fd.define_tensor([7, 8], float8_e4m3fn), fd.define_tensor([7, 8], float8_e4m3fn)
        ),
        ["add:", "T0_f8e4m3[iS0{7}, iS1{8}] is float8_e4m3fn", "storage type", "cast it"],
    ),
    "mul of fp4 by a scalar": (
        lambda fd: fd.ops.mul(fd.define_tensor([7, 8], float4_e2m1), 2.0),
        ["mul:", "T0_f4e2m1[iS0{7}, iS1{8}] is float4_e2m1", "storage type", "cast it"],
    ),
    "exp of fp4": (
        lambda fd: fd.ops.exp(fd.define_tensor([7, 8], float4_e2m1)),
        ["exp:", "T0_f4e2m1[iS0{7}, iS1{8}] is float4_e2m1", "storage type"],
    ),
    "sum of fp8": (
        lambda fd: fd.ops.sum(fd.define_tensor([7, 8], float8_e4m3fn), dims=[1]),
        ["sum:", "T0_f8e4m3[iS0{7}, iS1{8}] is float8_e4m3fn", "storage type"],
    ),
    "add of two bools": (
        lambda fd: fd.ops.add(fd.define_tensor([7, 8], bool_), fd.define_tensor([7, 8], bool_)),
        ["add:", "bool operands", "T0_bool[iS0{7}, iS1{8}]", "T1_bool[iS2{7}, iS3{8}]"],
    ),
    "cast to an unknown dtype": (
        lambda fd: fd.ops.cast(fd.define_tensor([7, 8]), "float128"),
        ["cast:", "unknown data type 'float128'"],
    ),
    # fp4 packs two values per byte: the innermost extent must stay even
    "fp4 input of shape [7, 5]": (
        lambda fd: fd.define_tensor([7, 5], float4_e2m1),
        ["define_tensor:", "float4_e2m1", "shape [7, 5]", "odd innermost extent 5"],
    ),
    "cast to fp4 of an odd innermost extent": (
        lambda fd: fd.ops.cast(fd.define_tensor([4, 7]), float4_e2m1),
        [
            "cast:",
            "float4_e2m1",
            "shape [4, 7]",
            "T0_f32[iS0{4}, iS1{7}]",
            "odd innermost extent 7",
        ],
    ),
    "permute of fp4 making the innermost odd": (
        lambda fd: fd.ops.permute(fd.define_tensor([7, 4], float4_e2m1), [1, 0]),
        ["permute:", "float4_e2m1", "odd innermost extent 7"],
    ),
    "select of fp4 leaving an odd innermost": (
        lambda fd: fd.ops.select(fd.define_tensor([7, 4], float4_e2m1), 1, 0),
        ["select:", "float4_e2m1", "odd innermost extent 7"],
    ),
    "slice of fp4 to an odd innermost": (
        lambda fd: fd.ops.slice(fd.define_tensor([7, 4], float4_e2m1), [0, 0], [7, 3]),
        ["slice:", "float4_e2m1", "odd innermost extent 3"],
    ),
    "reshape of fp4 to an odd innermost": (
        lambda fd: fd.ops.reshape(fd.define_tensor([4, 6], float4_e2m1), [8, 3]),
        ["reshape:", "float4_e2m1", "odd innermost extent 3"],
    ),
    "int8 with uint8 promotes to int16, outside the IR": (
        lambda fd: fd.ops.add(fd.define_tensor([7], "int8"), fd.define_tensor([7], "uint8")),
        ["add:", "T0_i8[iS0{7}]", "T1_u8[iS1{7}]", "promote to a type the IR does not have"],
    ),
    "an integer scalar out of the int8 range": (
        lambda fd: fd.ops.add(fd.define_tensor([7], "int8"), 300),
        ["add:", "scalar 300", "int8", "[-128, 127]"],
    ),
    "a negative scalar with uint8 in where": (
        lambda fd: fd.ops.where(fd.define_tensor([7], bool_), fd.define_tensor([7], "uint8"), -1),
        ["where:", "scalar -1", "uint8"],
    ),
    "fp4 select down to 0 dims": (
        lambda fd: fd.ops.select(fd.define_tensor([2], float4_e2m1), 0, 1),
        ["select:", "float4_e2m1", "0-dim", "T0_f4e2m1[iS0{2}]"],
    ),
}


@pytest.mark.parametrize("case", list(DEFINITION_ERRORS))
def test_a_bad_op_raises_a_definition_error_naming_op_tensors_and_mismatch(case):
    build, pieces = DEFINITION_ERRORS[case]
    with pytest.raises(DefinitionError, match=_mentions(*pieces)):
        with FusionDefinition() as fd:
            build(fd)


def test_an_output_from_another_fusion_is_refused():
    with FusionDefinition() as other:
        foreign = other.define_tensor([3])
        other.add_output(foreign)
    with pytest.raises(
        DefinitionError,
        match=_mentions("add_output:", "T0_f32[iS0{3}]", "not defined in this fusion"),
    ):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.neg(fd.define_tensor([3])))
            fd.add_output(foreign)


def test_an_op_mixing_two_fusions_is_refused():
    with FusionDefinition() as other:
        foreign = other.define_tensor([3])
        other.add_output(foreign)
    with pytest.raises(
        DefinitionError, match=_mentions("add:", "different fusions", "T0_f32[iS0{3}]")
    ):
        with FusionDefinition() as fd:
            fd.ops.add(fd.define_tensor([3]), foreign)


def test_an_output_that_is_not_a_tensor_is_refused():
    with pytest.raises(DefinitionError, match=_mentions("add_output:", "TensorView", "float")):
        with FusionDefinition() as fd:
            fd.define_tensor([3])
            fd.add_output(1.5)


def test_the_same_output_twice_is_refused():
    with pytest.raises(
        DefinitionError, match=_mentions("add_output:", "T1_f32[iS1{3}]", "already an output")
    ):
        with FusionDefinition() as fd:
            y = fd.ops.neg(fd.define_tensor([3]))
            fd.add_output(y)
            fd.add_output(y)


def test_a_fusion_without_outputs_is_refused_when_the_definition_ends():
    with pytest.raises(DefinitionError, match=_mentions("no outputs", "fd.add_output")):
        with FusionDefinition() as fd:
            fd.ops.neg(fd.define_tensor([3]))


def _finished_fusion() -> tuple[FusionDefinition, object]:
    with FusionDefinition() as fd:
        x = fd.define_tensor([3])
        fd.add_output(fd.ops.neg(x))
    return fd, x


def test_an_op_after_the_definition_ended_is_refused():
    fd, x = _finished_fusion()
    with pytest.raises(DefinitionError, match=_mentions("exp:", "definition has ended")):
        fd.ops.exp(x)
    assert len(fd.fusion.exprs) == 1


def test_an_output_after_the_definition_ended_is_refused():
    fd, x = _finished_fusion()
    with pytest.raises(DefinitionError, match=_mentions("add_output:", "definition has ended")):
        fd.add_output(x)
    assert len(fd.fusion.outputs) == 1


def test_an_input_after_the_definition_ended_is_refused():
    fd, _ = _finished_fusion()
    with pytest.raises(DefinitionError, match=_mentions("define_tensor:", "definition has ended")):
        fd.define_tensor([3])
    assert len(fd.fusion.inputs) == 1


def test_entering_a_definition_twice_is_refused():
    fd, _ = _finished_fusion()
    with pytest.raises(DefinitionError, match="entered only once"):
        with fd:
            pass


def test_execute_before_the_definition_ended_is_refused():
    with pytest.raises(DefinitionError, match=_mentions("execute:", "leave the `with` block")):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.neg(fd.define_tensor([3])))
            fd.execute([torch.zeros(3)])


# ---------------------------------------------------------------------------
# Input errors, raised by execute before anything runs


def _bf16_and_fp4_fusion() -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor([7, 1000], bfloat16)
        w = fd.define_tensor([4, 6], float4_e2m1)
        fd.add_output(fd.ops.add(x, x))
        fd.add_output(fd.ops.cast(w, float32))
    return fd


T0_BF16 = "input 0 (T0_bf16[iS0{7}, iS1{1000}])"
T1_FP4 = "input 1 (T1_f4e2m1[iS2{4}, iS3{6}])"
GOOD_X = torch.zeros(7, 1000, dtype=torch.bfloat16)
GOOD_W = torch.zeros(4, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)

INPUT_ERRORS = {
    "wrong shape": (
        [torch.zeros(7, 999, dtype=torch.bfloat16), GOOD_W],
        [T0_BF16, "expected shape [7, 1000]", "got [7, 999]", "axis 1 is 999"],
    ),
    "wrong dtype": (
        [torch.zeros(7, 1000), GOOD_W],
        [T0_BF16, "expected dtype torch.bfloat16", "got torch.float32"],
    ),
    "wrong rank": (
        [torch.zeros(7000, dtype=torch.bfloat16), GOOD_W],
        [T0_BF16, "expected rank 2", "(7000,)"],
    ),
    "too few inputs": ([GOOD_X], ["takes 2 inputs", "T0_bf16", "T1_f4e2m1", "got 1"]),
    "too many inputs": ([GOOD_X, GOOD_W, GOOD_W], ["takes 2 inputs", "got 3"]),
    "a list instead of a tensor": ([GOOD_X, [1, 2]], [T1_FP4, "torch.Tensor", "got list"]),
    "fp4 passed as uint8": (
        [GOOD_X, torch.zeros(4, 3, dtype=torch.uint8)],
        [T1_FP4, "expected dtype torch.float4_e2m1fn_x2", "got torch.uint8", "to_fp4"],
    ),
    "fp4 passed as float32": (
        [GOOD_X, torch.zeros(4, 6)],
        [T1_FP4, "expected dtype torch.float4_e2m1fn_x2", "got torch.float32", "to_fp4"],
    ),
    "fp4 with one value per byte": (
        [GOOD_X, torch.zeros(4, 6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)],
        [T1_FP4, "expected shape [4, 6] (fp4 values)", "got [4, 12]"],
    ),
}


@pytest.mark.parametrize("case", list(INPUT_ERRORS))
def test_bad_inputs_raise_an_input_error_before_anything_runs(case, nothing_runs):
    inputs, pieces = INPUT_ERRORS[case]
    fd = _bf16_and_fp4_fusion()
    with pytest.raises(InputError, match=_mentions(*pieces)):
        fd.execute(inputs)


def test_a_tensor_instead_of_a_list_of_inputs_is_refused(nothing_runs):
    fd = _bf16_and_fp4_fusion()
    with pytest.raises(InputError, match=_mentions("list of tensors", "got Tensor")):
        fd.execute(GOOD_X)


def test_the_fusion_runs_on_the_good_inputs():
    # The fusion of the input-error cases is valid: only the bad inputs make it fail.
    x_out, w_out = _bf16_and_fp4_fusion().execute([GOOD_X, GOOD_W])
    assert x_out.shape == (7, 1000) and w_out.shape == (4, 6)


# ---------------------------------------------------------------------------
# Symbolic extents


def test_one_symbol_bound_to_two_sizes_by_two_inputs_is_refused(nothing_runs):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["n", 4])
        y = fd.define_tensor(["n", 4])
        fd.add_output(fd.ops.add(x, y))
    with pytest.raises(
        InputError,
        match=_mentions(
            "input 1 (T1_f32[iS2{n}, iS3{4}])",
            "axis 0 has extent 5",
            "symbol n is already 3",
            "input 0",
        ),
    ):
        fd.execute([torch.zeros(3, 4), torch.zeros(5, 4)])


def test_different_symbols_added_together_must_agree_when_run(nothing_runs):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["n", 4])
        y = fd.define_tensor(["m", 4])
        fd.add_output(fd.ops.add(x, y))
    with pytest.raises(
        InputError,
        match=_mentions(
            "extents disagree",
            "n=3",
            "m=5",
            "add:",
            "axis 0",
            "T0_f32[iS0{n}, iS1{4}]",
            "T1_f32[iS2{m}, iS3{4}]",
        ),
    ):
        fd.execute([torch.zeros(3, 4), torch.zeros(5, 4)])


def test_a_symbol_against_a_static_extent_must_agree_when_run(nothing_runs):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["k", 8])
        w = fd.define_tensor([8, 4])
        fd.add_output(fd.ops.matmul(w, fd.ops.cast(x, DataType.float32)))
    with pytest.raises(
        InputError,
        match=_mentions(
            "extents disagree",
            "k=6",
            "matmul: contraction",
            "T1_f32[iS2{8}, iS3{4}] has K=4",
            "T2_f32[iS4{k}, iS5{8}] has K=k",
        ),
    ):
        fd.execute([torch.zeros(6, 8), torch.zeros(8, 4)])


def test_different_symbols_that_agree_run():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["n", 4])
        y = fd.define_tensor(["m", 4])
        fd.add_output(fd.ops.add(x, y))
    (out,) = fd.execute([torch.ones(3, 4), torch.ones(3, 4)])
    assert torch.equal(out, torch.full((3, 4), 2.0))


def test_a_symbol_used_only_in_expand_is_refused_when_the_definition_ends():
    with pytest.raises(
        DefinitionError, match=_mentions("T1_f32[bS2{m}, iS3{8}]", "symbol m", "no input")
    ):
        with FusionDefinition() as fd:
            x = fd.define_tensor([1, 8])
            fd.add_output(fd.ops.expand(x, ["m", 8]))


def test_select_on_a_symbolic_axis_is_bounds_checked_before_running(nothing_runs):
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 4])
        fd.add_output(fd.ops.select(x, 0, 5))
    with pytest.raises(
        InputError,
        match=_mentions("out of bounds", "batch=2 > 5", "select: index 5 of axis 0", "T0_f32"),
    ):
        fd.execute([torch.zeros(2, 4)])


def test_select_on_a_symbolic_axis_runs_when_the_index_is_in_bounds():
    with FusionDefinition() as fd:
        x = fd.define_tensor(["batch", 4])
        fd.add_output(fd.ops.select(x, 0, 5))
    (row,) = fd.execute([torch.arange(24.0).reshape(6, 4)])
    assert row.tolist() == [20.0, 21.0, 22.0, 23.0]


def test_an_integer_to_a_negative_integer_power_is_refused():
    with pytest.raises(DefinitionError, match=_mentions("pow:", "T0_i32[iS0{3}] ** -1", "cast")):
        with FusionDefinition() as fd:
            fd.add_output(fd.ops.pow(fd.define_tensor([3], "int32"), -1))
