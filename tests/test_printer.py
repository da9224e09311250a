"""Golden tests of the printed fusion: a change in the IR's text shows up as a readable diff."""

from fusion import DataType, FusionDefinition, ParallelType

GOLDEN = """\
Fusion golden: 3 inputs, 9 exprs, 3 outputs
inputs:
  T0_bf16[iS0{batch}, iDIDx1{8}]
  T1_bf16[iS2{8}]
  T2_bf16[iS3{s0}, iS4{8}]
exprs:
  T3_f32[iS5{batch}, iS6{8}] = cast(T0, dtype=float32)
  T4_f32[iS7{batch}, iS8{8}] = mul(T3, 0.5)
  T5_f32[iS9{8}] = cast(T1, dtype=float32)
  T6_f32[bS10{1}, iS11{8}] = broadcast(T5, dims=[0])
  T7_f32[iS12{batch}, iS13{8}] = mul(T4, T6)
  T8_f32[iS14{batch}, rS15{8}] = sum(T7, dims=[1])
  T9_f32[iS16{batch}, rS17{8}], T10_f32[iS18{batch}, rS19{8}] = var_mean(T4, dims=[1], correction=0)
  T11_bf16[iS20{batch}, iS21{8}] = add(T0, T2)
  T12_f4e2m1[iStream22{batch}, iS23{8}] = cast(T11, dtype=float4_e2m1)
outputs:
  T8_f32[iS14{batch}, rS15{8}]
  T9_f32[iS16{batch}, rS17{8}]
  T12_f4e2m1[iStream22{batch}, iS23{8}]
constraints:
  batch == s0  (add: axis 0: T0_bf16[iS0{batch}, iDIDx1{8}] has batch, T2_bf16[iS3{s0}, iS4{8}] has s0)"""


def test_fusion_dump_is_pinned():
    with FusionDefinition("golden") as fd:
        x = fd.define_tensor(["batch", 8], DataType.bfloat16)
        w = fd.define_tensor([8], DataType.bfloat16)
        y = fd.define_tensor([-1, 8], DataType.bfloat16)
        x.axis(1).parallelize(ParallelType.DIDx)
        h = fd.ops.cast(x, DataType.float32) * 0.5
        wb = fd.ops.broadcast(fd.ops.cast(w, DataType.float32), [True, False])
        fd.add_output(fd.ops.sum(h * wb, dims=[1]))
        var, _mean = fd.ops.var_mean(h, dims=1, correction=0)
        fd.add_output(var)
        z = fd.ops.cast(x + y, DataType.float4_e2m1)
        z.axis(0).parallelize(ParallelType.Stream)
        fd.add_output(z)
    assert str(fd) == GOLDEN


def test_matmul_and_linear_keep_the_contraction_as_a_reduction_axis():
    with FusionDefinition() as fd:
        a = fd.define_tensor([4, 6], DataType.float16)
        b = fd.define_tensor([6, 2], DataType.float16)
        w = fd.define_tensor([3, 6], DataType.float16)
        bias = fd.define_tensor([3], DataType.float16)
        fd.add_output(a @ b)
        fd.add_output(fd.ops.linear(a, w, bias))
    lines = str(fd).splitlines()
    assert "  T4_f16[iS7{4}, iS8{2}, rS9{6}] = matmul(T0, T1)" in lines
    assert "  T5_f16[iS10{4}, iS11{3}, rS12{6}] = linear(T0, T2, T3)" in lines


def test_scalar_operands_and_attributes_print_as_literals():
    with FusionDefinition() as fd:
        x = fd.define_tensor([7], DataType.int32)
        fd.add_output(fd.ops.where(fd.ops.cast(x, DataType.bool_), 2.5, x))
        fd.add_output(fd.ops.gelu(fd.ops.cast(x, DataType.float32), approximate="tanh"))
        fd.add_output(fd.ops.slice(x, [1], [None], [2]))
    text = str(fd)
    assert "= where(T1, 2.5, T0)" in text
    assert "= gelu(T3, approximate='tanh')" in text
    assert "= slice(T0, starts=[1], stops=[7], steps=[2])" in text


def test_the_legend_names_every_code_the_printer_writes():
    """``fusion.printer.LEGEND`` (the demo prints it, docs/guide.md carries it) explains
    each iteration and parallel type, the axis grammar, dtypes and meshes: a code the
    printer may write and the legend does not name fails here."""
    import re

    from fusion.ir import IterType, ParallelType
    from fusion.printer import LEGEND

    for iter_type in IterType:
        assert re.search(rf"\b{iter_type.value} (iterated|reduced|broadcast)\b", LEGEND), iter_type
    for parallel_type in ParallelType:
        assert re.search(rf"\b{parallel_type.value}\b", LEGEND), parallel_type
    assert "DIDx|Stream" in LEGEND and "@M0" in LEGEND and "rDIDx" in LEGEND
    # its examples read as the printer writes them: an axis, and a tensor with its dtype
    (axis,) = re.findall(r"an axis such as (\S+) reads", LEGEND, re.I)
    assert re.fullmatch(r"[irb](S|DID[xyz](\|Stream)?|Stream)\d+\{\w+\}", axis), axis
    with FusionDefinition() as fd:
        x = fd.define_tensor([512, 4], DataType.bfloat16)
        x.axis(0).parallelize(ParallelType.DIDx)
        fd.add_output(fd.ops.neg(x))
    assert str(x.axes[0]) == axis and f"{x.name}_{x.dtype.short}[" in str(fd)
    assert re.search(r"T\d+_bf16\[\.\.\.\] is tensor T\d+, of dtype bf16", LEGEND)
