"""Sharding in one process: meshes, layouts, rules, propagation, resharding, printing."""

from __future__ import annotations

import pytest
import torch

from fusion import FusionDefinition
from fusion.ir import ParallelType
from fusion.reference import evaluate
from overlap.compile.deallocate import insert_deallocations
from overlap.compile.lowering import lower_to_host_program
from sharding import (
    DeviceMesh,
    Layout,
    Partial,
    Replicate,
    Shard,
    ShardingError,
    explain,
    layout_of,
    local_shape,
    pin,
    segment_fusion,
    shard,
    shard_fusion,
    split_sizes,
)
from sharding.propagation import moved_inputs
from sharding.rules import reshape_groups

# ---------------------------------------------------------------------------
# Meshes and layouts


def test_mesh_teams_coordinates_and_axis_names():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.size == 4
    assert mesh.coords(2) == (1, 0)
    assert mesh.team(3, "tp") == (2, 3)
    assert mesh.team(3, "dp") == (1, 3)
    assert mesh.teams("dp") == [(0, 2), (1, 3)]
    assert mesh.parallel_type("tp") is ParallelType.DIDy
    assert str(mesh) == "mesh(dp=2, tp=2: [0, 1, 2, 3])"


def test_a_mesh_may_list_its_ranks_in_any_order():
    mesh = DeviceMesh([3, 1, 2])
    assert mesh.coords(1) == (1,)
    assert mesh.team(2, 0) == (3, 1, 2)


@pytest.mark.parametrize(
    ("ranks", "names", "message"),
    [
        ([0, 0], None, "repeat"),
        ([[0, 1], [2]], None, "ragged"),
        ([-1], None, "non-negative"),
        ([0, 1], ("a", "b"), "need 1 distinct axis names"),
        ([[[[0]]]], None, "at most 3 axes"),
    ],
)
def test_bad_meshes_are_refused(ranks, names, message):
    with pytest.raises(ValueError, match=message):
        DeviceMesh(ranks, names)


@pytest.mark.parametrize(
    ("extent", "parts", "sizes"),
    [(8, 2, [4, 4]), (7, 2, [4, 3]), (7, 4, [2, 2, 2, 1]), (1, 2, [1, 0]), (0, 3, [0, 0, 0])],
)
def test_uneven_extents_split_in_balance(extent, parts, sizes):
    assert split_sizes(extent, parts) == sizes


def test_local_shape_of_a_two_axis_layout():
    mesh = DeviceMesh([[0, 1, 2], [3, 4, 5]])
    layout = Layout(mesh, (Shard(1), Shard(0)))
    # rank 4 sits at (1, 1): rows 7 over 3 ranks -> 3, 2, 2; columns 5 over 2 -> 3, 2
    assert local_shape(layout, 4, [7, 5]) == [2, 2]
    assert local_shape(layout, 0, [7, 5]) == [3, 3]


def test_a_layout_splits_a_tensor_axis_over_at_most_one_mesh_axis():
    with pytest.raises(ValueError, match="split axis 0 twice"):
        Layout(DeviceMesh([[0, 1], [2, 3]]), (Shard(0), Shard(0)))


# ---------------------------------------------------------------------------
# Annotations


def _linear_fusion():
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 4])
        w = fd.define_tensor([6, 4])
        y = fd.ops.linear(x, w)
        fd.add_output(fd.ops.relu(y))
    return fd, x, w, y


def test_annotations_write_parallel_types_and_read_back():
    fd, x, w, y = _linear_fusion()
    mesh = DeviceMesh(2)
    shard(x, mesh, [Shard(1)])
    assert x.axis(1).parallel_type is ParallelType.DIDx
    assert layout_of(x) == Layout(mesh, (Shard(1),))
    shard(y, mesh, [Partial()])
    assert [a.parallel_type for a in y.axes][-1] is ParallelType.DIDx
    assert layout_of(y) == Layout(mesh, (Partial("sum"),))


@pytest.mark.parametrize(
    ("annotate", "message"),
    [
        (lambda x, w, y, m: (shard(x, m, [Shard(0)]), shard(x, m, [Shard(1)])), "conflicting"),
        (lambda x, w, y, m: shard(x, m, [Shard(2)]), "no axis 2"),
        (lambda x, w, y, m: shard(x, m, [Partial()]), "cannot be partial"),
        (lambda x, w, y, m: shard(x, m, [Shard(0), Shard(1)]), "1 axes but got 2"),
        (
            lambda x, w, y, m: shard(x, DeviceMesh([[0, 1], [2, 3]]), [Shard(0), Shard(0)]),
            "split axis 0 twice",
        ),
    ],
    ids=["twice-differently", "axis-out-of-range", "partial-input", "too-many", "same-axis-twice"],
)
def test_conflicting_or_invalid_annotations_are_refused(annotate, message):
    fd, x, w, y = _linear_fusion()
    with pytest.raises(ShardingError, match=message):
        annotate(x, w, y, DeviceMesh(2))


def test_a_partial_annotation_must_combine_as_its_producer_does():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        total, largest = fd.ops.sum(x, dims=[1]), fd.ops.max(x, dims=[1])
        fd.add_output(total)
        fd.add_output(largest)
    mesh = DeviceMesh(2)
    shard(x, mesh, [Shard(1)])
    with pytest.raises(
        ShardingError, match="computed by sum, whose partial results combine by 'sum', not 'max'"
    ):
        shard(total, mesh, [Partial("max")])
    with pytest.raises(ShardingError, match="combine by 'max', not 'sum'"):
        shard(largest, mesh, [Partial()])
    shard(largest, mesh, [Partial("max")])
    assert layout_of(largest) == Layout(mesh, (Partial("max"),))


@pytest.mark.parametrize("op", ["avg", "prod", "SUM"])
def test_a_partial_combines_only_by_sum_max_or_min(op):
    with pytest.raises(ValueError, match="one of \\('sum', 'max', 'min'\\)"):
        Partial(op)


def test_torch_placements_and_mesh_are_read_as_ours_never_as_replicated():
    from torch.distributed import tensor as dtensor
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    fd, x, w, y = _linear_fusion()
    shard(x, DeviceMesh(2), [dtensor.Shard(0)])
    assert layout_of(x) == Layout(DeviceMesh(2), (Shard(0),))
    shard(w, DeviceMesh(2), [dtensor.Replicate()])
    assert layout_of(w) == Layout(DeviceMesh(2), (Replicate(),))
    shard(y, DeviceMesh(2), [dtensor.Partial()])
    assert layout_of(y) == Layout(DeviceMesh(2), (Partial("sum"),))
    fd, x, w, y = _linear_fusion()
    shard(x, DeviceMesh(2), [dtensor.Shard(-1)])  # from the last axis, as in DTensor
    shard(w, DeviceMesh(2), [Shard(-1)])
    assert layout_of(x) == layout_of(w) == Layout(DeviceMesh(2), (Shard(1),))
    # built without a process group (torch's private switches): its ranks and names are read
    torch_mesh = TorchMesh(
        "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=0
    )
    fd, x, w, y = _linear_fusion()
    shard(x, torch_mesh, [dtensor.Shard(0), dtensor.Replicate()])
    assert layout_of(x) == Layout(
        DeviceMesh([[0, 1], [2, 3]], ("dp", "tp")), (Shard(0), Replicate())
    )


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (lambda t: t.Partial("avg"), "got 'avg'"),
        (
            lambda t: "S(0)",
            "placements are Shard\\(dim\\), Replicate\\(\\) or Partial\\(op\\); got builtins.str",
        ),
        (lambda t: 0, "got builtins.int"),
    ],
    ids=["torch-partial-avg", "a-string", "an-int"],
)
def test_placements_that_are_not_ours_nor_torchs_are_refused(placement, message):
    from torch.distributed import tensor as dtensor

    fd, x, w, y = _linear_fusion()
    with pytest.raises(ShardingError, match=message):
        shard(y if "avg" in str(placement(dtensor)) else x, DeviceMesh(2), [placement(dtensor)])
    assert layout_of(x) is None and layout_of(y) is None


def test_annotating_the_same_layout_twice_is_fine():
    fd, x, w, y = _linear_fusion()
    mesh = DeviceMesh(2)
    shard(x, mesh, [Shard(0)])
    shard(x, DeviceMesh([0, 1]), [Shard(0)])
    assert layout_of(x) == Layout(mesh, (Shard(0),))


def test_an_op_on_tensors_of_two_meshes_is_refused():
    with FusionDefinition() as fd:
        a = fd.define_tensor([4])
        b = fd.define_tensor([4])
        fd.add_output(a + b)
    shard(a, DeviceMesh([0]), [Replicate()])
    shard(b, DeviceMesh([1]), [Replicate()])
    with pytest.raises(ShardingError, match=r"add: .*different meshes"):
        shard_fusion(fd.fusion)


def test_a_tensor_used_on_a_mesh_it_is_not_placed_on_is_refused():
    with FusionDefinition() as fd:
        a = fd.define_tensor([4])
        h = fd.ops.exp(a)
        fd.add_output(h)
    shard(a, DeviceMesh([0]), [Replicate()])
    shard(h, DeviceMesh([1]), [Replicate()])
    with pytest.raises(ShardingError, match=r"exp: a tensor is used on a mesh it is not placed on"):
        shard_fusion(fd.fusion)


def test_a_fusion_with_no_placed_tensor_is_refused():
    fd, *_ = _linear_fusion()
    with pytest.raises(ShardingError, match="no tensor of the fusion is placed"):
        shard_fusion(fd.fusion)


def test_sharding_works_on_a_copy_and_leaves_the_users_fusion_alone():
    fd, x, w, y = _linear_fusion()
    shard(w, DeviceMesh(2), [Shard(1)])
    before = str(fd)
    sharded, _ = shard_fusion(fd.fusion)
    assert str(fd) == before
    assert len(sharded.exprs) > len(fd.fusion.exprs)


# ---------------------------------------------------------------------------
# Rules


@pytest.mark.parametrize(
    ("source", "target", "groups"),
    [
        ((8, 6), (48,), [([0, 1], [0])]),
        ((48,), (8, 6), [([0], [0, 1])]),
        ((4, 1, 6), (4, 6), [([0], [0]), ([1], []), ([2], [1])]),
        ((2, 3, 4), (6, 4), [([0, 1], [0]), ([2], [1])]),
        ((6, 4), (4, 6), [([0, 1], [0, 1])]),
        ((5, 3), (3, 5), [([0, 1], [0, 1])]),
    ],
)
def test_reshape_groups_pair_runs_of_axes(source, target, groups):
    assert reshape_groups(source, target) == groups


def _sharded(build, annotations):
    """Shard a fusion built by ``build(fd)`` and return its communications' kinds."""
    with FusionDefinition() as fd:
        tensors = build(fd)
    for name, mesh, placements in annotations:
        shard(tensors[name], mesh, placements)
    sharded, decisions = shard_fusion(fd.fusion)
    kinds = [getattr(e, "kind", None) for e in sharded.exprs]
    return sharded, decisions, [k.value for k in kinds if k is not None], tensors


def test_a_mean_or_variance_over_a_split_axis_reduces_pieces_then_combines_sums():
    mesh = DeviceMesh(2)

    def build(fd):
        x = fd.define_tensor([8, 6])
        fd.add_output(fd.ops.mean(x, dims=[0]))
        fd.add_output(fd.ops.sum(x, dims=[0]))
        for output in fd.ops.var_mean(x, dims=[0]):
            fd.add_output(output)
        return {"x": x}

    sharded, _, kinds, _ = _sharded(build, [("x", mesh, [Shard(0)])])
    # the mean a sum over each piece, all-reduced, then divided; the variance in two
    # passes (its mean's sum, then the squares about it); never the input gathered
    assert kinds == ["Allreduce"] * 4
    assert _moves(sharded) == [("Allreduce", (6,))] * 4
    ops = [expr.op_name for expr in sharded.exprs]
    assert "mean" not in ops and "var_mean" not in ops
    assert ops.count("div") == 3 and ops.count("sum") == 4


def test_a_sum_over_several_axes_of_an_inner_split_combines_partial_sums_where_it_is():
    """[batch, seq, hidden] split along seq (sequence parallel), summed over batch and seq
    (a LayerNorm weight's gradient, a loss over tokens): each rank sums its piece and the
    partial sums are all-reduced; the input is not first moved to a split of the batch,
    the first reduced axis (an all-to-all of the whole activation before)."""
    mesh = DeviceMesh(2)

    def build(fd):
        x = fd.define_tensor([4, 8, 6])
        fd.add_output(fd.ops.sum(x, dims=[0, 1]))
        fd.add_output(fd.ops.max(x, dims=[0, 1]))
        return {"x": x}

    sharded, _, _, _ = _sharded(build, [("x", mesh, [Shard(1)])])
    assert _moves(sharded) == [("Allreduce", (6,))] * 2
    # the placed program computes what the module does (every rank's pieces: the
    # multi-rank tests of sequence-parallel norms, tests/test_capture_norms.py)
    x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(0))
    total, largest = evaluate(sharded, [x])
    torch.testing.assert_close(total, x.sum((0, 1)))
    assert torch.equal(largest, x.amax((0, 1)))


def test_a_max_over_a_split_axis_all_reduces_with_max():
    def build(fd):
        x = fd.define_tensor([8, 6])
        fd.add_output(fd.ops.max(x, dims=[0]))
        return {"x": x}

    sharded, _, kinds, _ = _sharded(build, [("x", DeviceMesh(2), [Shard(0)])])
    assert kinds == ["Allreduce"]
    (comm,) = [e for e in sharded.exprs if getattr(e, "kind", None)]
    assert comm.reduce_op == "max"


def test_replicated_to_split_is_local_and_needs_no_communication():
    def build(fd):
        x = fd.define_tensor([8, 6])
        y = fd.ops.exp(x)
        fd.add_output(y)
        return {"x": x, "y": y}

    mesh = DeviceMesh(2)
    sharded, _, kinds, _ = _sharded(build, [("x", mesh, [Replicate()]), ("y", mesh, [Shard(1)])])
    assert kinds == []
    assert "shard_locally" in [e.op_name for e in sharded.exprs]


def test_a_reshape_passes_a_split_of_the_outermost_axis_when_it_divides():
    def build(fd):
        x = fd.define_tensor([8, 12])
        fd.add_output(fd.ops.exp(fd.ops.reshape(x, [4, 2, 12])))
        return {"x": x}

    sharded, _, kinds, _ = _sharded(build, [("x", DeviceMesh(2), [Shard(0)])])
    assert kinds == []
    assert layout_of(sharded.outputs[0]).placements == (Shard(0),)


def test_a_reshape_that_cannot_pass_a_split_gathers_it():
    def build(fd):
        x = fd.define_tensor([6, 12])
        fd.add_output(fd.ops.exp(fd.ops.reshape(x, [6 * 12])))
        return {"x": x}

    # 6 rows over 4 ranks do not divide evenly: the merged axis cannot stay split.
    _, _, kinds, _ = _sharded(build, [("x", DeviceMesh(4), [Shard(0)])])
    assert kinds == ["Allgather"]


def test_a_row_parallel_linear_with_bias_adds_the_bias_once_after_the_reduction():
    def build(fd):
        x = fd.define_tensor([4, 8])
        w = fd.define_tensor([6, 8])
        b = fd.define_tensor([6])
        fd.add_output(fd.ops.linear(x, w, b))
        return {"x": x, "w": w}

    mesh = DeviceMesh(2)
    sharded, _, kinds, _ = _sharded(build, [("x", mesh, [Shard(1)]), ("w", mesh, [Shard(1)])])
    assert kinds == ["Allreduce"]
    ops = [e.op_name for e in sharded.exprs]
    assert ops.index("linear") < ops.index("Allreduce") < ops.index("add")


@pytest.mark.parametrize(
    ("output", "communication"),
    [(Replicate(), "Allreduce"), (Shard(0), "ReduceScatter")],
    ids=["replicate", "sequence"],
)
def test_a_biased_row_parallel_linear_placed_whole_or_by_rows_adds_its_bias_after(
    output, communication
):
    """RowwiseParallel's output placed (``Replicate()`` by default, or the tokens' split):
    the partial sums are combined into that placement, then the whole bias is added to
    what each rank holds; neither the weight nor the activation is gathered, and the
    bias is never added to a partial sum (it would count once per rank)."""

    def build(fd):
        x = fd.define_tensor([4, 8])
        w = fd.define_tensor([6, 8])
        b = fd.define_tensor([6])
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
        return {"x": x, "w": w, "y": y}

    mesh = DeviceMesh(2)
    sharded, decisions, kinds, tensors = _sharded(
        build, [("x", mesh, [Shard(1)]), ("w", mesh, [Shard(1)]), ("y", mesh, [output])]
    )
    assert kinds == [communication]
    ops = [e.op_name for e in sharded.exprs]
    assert ops.index("linear") < ops.index(communication) < ops.index("add")
    (linear,) = [e for e in sharded.exprs if e.op_name == "linear"]
    assert len(linear.inputs) == 2 and layout_of(linear.output).placements == (Partial(),)
    (add,) = [e for e in sharded.exprs if e.op_name == "add"]
    assert all(not layout_of(t).is_partial for t in add.inputs)
    assert not moved_inputs(sharded)
    assert "by annotation" not in explain(sharded, decisions)


def test_explain_says_why_a_placed_weight_is_moved():
    """A weight split by rows that an op needs whole (a slice of the split axis): the
    all-gather of it, and explain says which op needs it placed so."""

    def build(fd):
        x = fd.define_tensor([4, 8])
        w = fd.define_tensor([6, 8])
        y = fd.ops.linear(x, fd.ops.slice(w, [0, 0], [4, 8]))
        fd.add_output(y)
        return {"x": x, "w": w}

    mesh = DeviceMesh(2)
    sharded, decisions, kinds, tensors = _sharded(
        build, [("x", mesh, [Replicate()]), ("w", mesh, [Shard(0)])]
    )
    (moved,) = moved_inputs(sharded)
    assert moved.inputs[0] is sharded.inputs[1] and moved.kind.value == "Allgather"
    (line,) = [line for line in explain(sharded, decisions).splitlines() if "Allgather of" in line]
    w = sharded.inputs[1].name
    assert f"Allgather of {w} for slice; {w} is placed [S(0)] by annotation: slice makes" in line
    assert line.endswith("only from it [R] (slice rule, forward through slice from input "
                         f"{w})")  # fmt: skip


def test_pipeline_meshes_of_several_ranks_send_rank_to_rank():
    def build(fd):
        x = fd.define_tensor([4, 8])
        h = fd.ops.exp(x)
        moved = fd.ops.set(h)
        fd.add_output(fd.ops.relu(moved))
        return {"x": x, "moved": moved}

    first, second = DeviceMesh([0, 1]), DeviceMesh([2, 3])
    sharded, _, kinds, _ = _sharded(
        build, [("x", first, [Shard(0)]), ("moved", second, [Shard(0)])]
    )
    assert kinds == ["SendRecv"]
    (comm,) = [e for e in sharded.exprs if getattr(e, "kind", None)]
    assert comm.pairs == [(0, 2), (1, 3)]


@pytest.mark.parametrize(
    ("source", "target", "kind"),
    [
        (([0], [Replicate()]), ([0, 1], [Replicate()]), "Broadcast"),
        (([0], [Replicate()]), ([0, 1], [Shard(0)]), "Scatter"),
        (([0, 1], [Shard(0)]), ([1], [Replicate()]), "Gather"),
        (([0], [Replicate()]), ([1], [Replicate()]), "SendRecv"),
    ],
)
def test_moving_between_a_single_rank_and_a_mesh(source, target, kind):
    def build(fd):
        x = fd.define_tensor([4, 8])
        moved = fd.ops.set(fd.ops.exp(x))
        fd.add_output(moved)
        return {"x": x, "moved": moved}

    annotations = [
        ("x", DeviceMesh(source[0]), source[1]),
        ("moved", DeviceMesh(target[0]), target[1]),
    ]
    sharded, _, kinds, _ = _sharded(build, annotations)
    assert kinds == [kind]


def test_a_partial_sum_moved_to_one_rank_is_reduced_there():
    def build(fd):
        x = fd.define_tensor([8, 6])
        total = fd.ops.sum(x, dims=[0])
        moved = fd.ops.set(total)
        fd.add_output(moved)
        return {"x": x, "total": total, "moved": moved}

    mesh = DeviceMesh([0, 1])
    sharded, _, kinds, _ = _sharded(
        build,
        [("x", mesh, [Shard(0)]), ("total", mesh, [Partial()]),
         ("moved", DeviceMesh([1]), [Replicate()])],
    )  # fmt: skip
    assert kinds == ["Reduce"]


# ---------------------------------------------------------------------------
# Golden texts for the sequence-parallel block (scenario 2)


def _annotated_block() -> FusionDefinition:
    mesh = DeviceMesh(2)
    with FusionDefinition("sp_block") as fd:
        x = fd.define_tensor([8, 16])
        gamma = fd.define_tensor([16])
        w1 = fd.define_tensor([32, 16])
        w2 = fd.define_tensor([16, 32])
        var, mean = fd.ops.var_mean(x, dims=[1], correction=0, keepdim=True)
        normed = (x - mean) * fd.ops.rsqrt(var + 1e-5) * fd.ops.broadcast(gamma, [True, False])
        y = fd.ops.linear(fd.ops.gelu(fd.ops.linear(normed, w1)), w2)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])
    shard(w1, mesh, [Shard(0)])
    shard(w2, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    return fd


def _sequence_parallel_block():
    return shard_fusion(_annotated_block().fusion)


EXPLAIN_GOLDEN = """\
M0 = mesh(x=2: [0, 1])
T0_f32[iDIDx0{8}, iS1{16}]               [S(0)] @M0  user annotation
T1_f32[iS2{16}]                          [R] @M0  broadcast rule, backward through broadcast from output T12
T2_f32[iDIDx3{32}, iS4{16}]              [S(0)] @M0  user annotation
T3_f32[iS5{16}, iDIDx6{32}]              [S(1)] @M0  user annotation
T4_f32[iDIDx7{8}, rS8{16}]               [S(0)] @M0  var_mean rule, forward through var_mean from input T0
T5_f32[iDIDx9{8}, rS10{16}]              [S(0)] @M0  var_mean rule, forward through var_mean from input T0
T6_f32[iDIDx11{8}, bS12{1}]              [S(0)] @M0  broadcast rule, forward through broadcast from input T4
T7_f32[iDIDx13{8}, bS14{1}]              [S(0)] @M0  broadcast rule, forward through broadcast from input T5
T8_f32[iDIDx15{8}, iS16{16}]             [S(0)] @M0  pointwise rule, forward through sub from inputs T0, T7
T9_f32[iDIDx17{8}, bS18{1}]              [S(0)] @M0  pointwise rule, forward through add from input T6
T10_f32[iDIDx19{8}, bS20{1}]             [S(0)] @M0  pointwise rule, forward through rsqrt from input T9
T11_f32[iDIDx21{8}, iS22{16}]            [S(0)] @M0  pointwise rule, forward through mul from inputs T8, T10
T12_f32[bS23{1}, iS24{16}]               [R] @M0  pointwise rule, backward through mul from output T13
T13_f32[iDIDx25{8}, iS26{16}]            [S(0)] @M0  pointwise rule, forward through mul from input T11
T14_f32[iS27{8}, iDIDx28{32}, rS29{16}]  [S(1)] @M0  linear rule, forward through linear from inputs T13, T2
T15_f32[iS30{8}, iDIDx31{32}]            [S(1)] @M0  pointwise rule, forward through gelu from input T14
T16_f32[iDIDx32{8}, iS33{16}, rS34{32}]  [S(0)] @M0  user annotation
inserted by resharding:
T17_f32[iS35{8}, iS36{16}]               [R] @M0  Allgather of T13 for linear
T18_f32[iS37{8}, iS38{16}, rDIDx39{32}]  [P] @M0  linear of T15, T3 for ReduceScatter"""

HOST_PROGRAM_GOLDEN = """\
HostProgram sp_block: 4 inputs, 1 output
meshes:
  M0 = mesh(x=2: [0, 1])
inputs: T0, T1, T2, T3
  LaunchKernel k0 [reference] (T0, T1) -> (T13)  @M0
    var_mean, broadcast, broadcast, sub, add, rsqrt, mul, broadcast, mul
  Allocate T17_f32[iS35{8}, iS36{16}]  @M0
  c0 = Allgather(T13 -> T17, axis='x', in_dim=0)  @M0
  Wait c0
  Deallocate T13
  LaunchKernel k1 [torch] (T17, T2) -> (T14)  @M0
    linear
  Deallocate T17
  LaunchKernel k2 [reference] (T14) -> (T15)  @M0
    gelu
  Deallocate T14
  LaunchKernel k3 [torch] (T15, T3) -> (T18)  @M0
    linear
  Deallocate T15
  Allocate T16_f32[iDIDx32{8}, iS33{16}, rS34{32}]  @M0
  c1 = ReduceScatter(T18 -> T16, axis='x', out_dim=0, op='sum')  @M0
  Wait c1
  Deallocate T18
outputs: T16"""


def test_explain_of_the_sequence_parallel_block_is_pinned():
    sharded, decisions = _sequence_parallel_block()
    assert explain(sharded, decisions) == EXPLAIN_GOLDEN


def test_host_program_of_the_sequence_parallel_block_is_pinned():
    sharded, _ = _sequence_parallel_block()
    segments = segment_fusion(sharded)
    assert [s.is_communication for s in segments] == [False, True, False, True]
    program = insert_deallocations(lower_to_host_program(sharded))
    assert str(program) == HOST_PROGRAM_GOLDEN


def test_the_resharded_fusion_still_computes_the_same_on_one_device():
    # Communications are copies: evaluated on one device, the resharded fusion must give
    # exactly what the user's fusion gives.
    fd = _annotated_block()
    sharded, _ = shard_fusion(fd.fusion)
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    assert torch.equal(evaluate(sharded, inputs)[0], fd.execute(inputs)[0])


# ---------------------------------------------------------------------------
# Layouts chosen by cost (sharding.choose_layouts, sharding.layout_cost)


def _moves(sharded) -> list[tuple[str, tuple]]:
    """Each inserted communication with the whole shape it moves."""
    return [(e.kind.value, tuple(e.inputs[0].shape)) for e in sharded.exprs if hasattr(e, "kind")]


def test_a_second_matmul_gathers_the_activation_rows_not_its_weight():
    mesh = DeviceMesh(2)

    def build(fd):
        x = fd.define_tensor([4, 32])
        w1 = fd.define_tensor([32, 64])
        w2 = fd.define_tensor([64, 128])
        y = fd.ops.matmul(fd.ops.matmul(x, w1), w2)
        fd.add_output(y)
        return {"w1": w1, "w2": w2, "y": y}

    annotations = [("w1", mesh, [Shard(1)]), ("w2", mesh, [Shard(1)]), ("y", mesh, [Replicate()])]
    sharded, _, _, _ = _sharded(build, annotations)
    # 4x64 activation rows gathered, the 4x128 result computed split and gathered: never
    # the 64x128 weight (first-come propagation gathered it, 16x the bits)
    assert _moves(sharded) == [("Allgather", (4, 64)), ("Allgather", (4, 128))]


def test_a_partial_sum_before_a_residual_is_reduce_scattered_and_explain_says_why():
    mesh = DeviceMesh(2)

    def build(fd):
        x = fd.define_tensor([8, 16], "bfloat16")
        w1 = fd.define_tensor([32, 16], "bfloat16")
        w2 = fd.define_tensor([16, 32], "bfloat16")
        x32 = fd.ops.cast(x, "float32")
        h = fd.ops.linear(fd.ops.cast(fd.ops.relu(fd.ops.linear(x, w1)), "bfloat16"), w2)
        out = fd.ops.cast(fd.ops.cast(h, "float32") + x32, "bfloat16")
        fd.add_output(out)
        return {"x": x, "w1": w1, "w2": w2, "out": out}

    annotations = [
        ("x", mesh, [Shard(0)]), ("w1", mesh, [Shard(0)]), ("w2", mesh, [Shard(1)]),
        ("out", mesh, [Shard(0)]),
    ]  # fmt: skip
    sharded, decisions, _, _ = _sharded(build, annotations)
    # a reduce-scatter (8x16 bits over 2 ranks: half the all-reduce's) instead of an
    # all-reduce and a local split
    assert _moves(sharded) == [("Allgather", (8, 16)), ("ReduceScatter", (8, 16))]
    lines = {line.split()[0]: line for line in explain(sharded, decisions).splitlines()}
    # the down projection's result: split rows cost least around it (the reduce-scatter's
    # 128 B and 8 B for being one collective, and the matmul's 8x16x32 multiply-adds on
    # one rank at 250 a bit: 2.048 B); the cast after it (its follower) turned with it
    down = lines["T7_bf16[iDIDx15{8},"]
    assert "by cost" in down and "[R] 266.048 B; [S(0)] 138.048 B" in down, down
    assert "turned with a neighbour that changed" in lines["T8_f32[iDIDx18{8},"]


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "shard"])
def test_a_pinned_row_parallel_weight_stays_where_gathering_it_moves_fewer_bits(pinned):
    """A row-parallel linear (its weight split by input features) whose result is added
    to a residual split by rows: with many rows, an all-to-all of the activation to rows
    and an all-gather of the weight (8x8) move fewer bits than reduce-scattering the
    64x8 partial result; a pinned weight (a plan's, ``sharding.pin``) is kept in place,
    as torch's ``RowwiseParallel`` keeps it, and explain says what that cost."""

    def build(fd):
        x = fd.ops.relu(fd.define_tensor([64, 8]))  # an activation, split by features
        w = fd.define_tensor([8, 8])
        r = fd.define_tensor([64, 8])
        fd.add_output(fd.ops.linear(x, w) + r)
        return {"x": x, "w": w, "r": r}

    with FusionDefinition() as fd:
        tensors = build(fd)
    mesh = DeviceMesh(2)
    shard(tensors["x"].definition.inputs[0], mesh, [Shard(1)])
    (pin if pinned else shard)(tensors["w"], mesh, [Shard(1)])
    shard(tensors["r"], mesh, [Shard(0)])
    sharded, decisions = shard_fusion(fd.fusion)
    w = sharded.inputs[1]
    if not pinned:  # by bits alone: the weight moved (what the rule changes)
        assert _moves(sharded) == [("AllToAll", (64, 8)), ("Allgather", (8, 8))]
        assert w in [c.inputs[0] for c in moved_inputs(sharded)]
        return
    assert _moves(sharded) == [("ReduceScatter", (64, 8))]
    assert not moved_inputs(sharded)
    (line,) = [line for line in explain(sharded, decisions).splitlines() if "linear rule" in line]
    # the partial result kept; the split by rows moves fewer bits only with w gathered:
    # per rank, the all-to-all's 2048 B / 4 and the all-gather's 256 B / 2, 8 B for each
    # collective, and the matmul's 64x8x8 multiply-adds on one rank at 250 a bit
    # (2.048 B): 658.048 B, against the reduce-scatter's 2048 B / 2 + 8 + 2.048
    assert "[P] @M0  linear rule" in line and "kept: layouts that move fewer bits" in line, line
    assert f"[S(0)] 1.0 KiB (658.048 B moving {w.name}, pinned: kept)" in line, line


def test_only_a_fusions_inputs_are_pinned():
    with FusionDefinition() as fd:
        y = fd.ops.exp(fd.define_tensor([4]))
        fd.add_output(y)
    with pytest.raises(ShardingError, match="only a fusion's inputs are pinned"):
        pin(y, DeviceMesh(2), [Shard(0)])


def test_shard_fusion_takes_a_fusion_definition_as_its_fusion():
    with FusionDefinition() as fd:
        a = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.exp(a))
    shard(a, DeviceMesh(2), [Shard(0)])
    from_definition, _ = shard_fusion(fd)
    from_fusion, _ = shard_fusion(fd.fusion)
    assert str(from_definition) == str(from_fusion) and "iDIDx" in str(from_definition)


class _Reductions(torch.nn.Module):
    """The reductions a vocabulary- or sequence-split softmax or loss chains over its
    split axis: sums, max, mean, variances, the softmax's denominator against the max
    (and softmax and log-softmax themselves, whose outputs stay split)."""

    def forward(self, x):
        var, mean = torch.var_mean(x, 1)
        denominator = torch.exp(x - x.amax(1, keepdim=True)).sum(1)
        return (x.sum(1), x.amax(1), x.mean(1), torch.var(x, 1), var, mean, denominator,
                torch.softmax(x, 1), torch.log_softmax(x, 1))  # fmt: skip


@pytest.mark.parametrize("columns", [16, 262144])
def test_chained_reductions_over_a_split_axis_all_reduce_their_small_results_only(columns):
    """Captured from PyTorch, each reduction over the split axis combines its pieces'
    partial results (a max, then the sum of exponentials against it; a mean and a
    variance from partial sums): every communication an all-reduce of 5 values, none
    of the input, however wide it is."""
    from fusion.capture import capture

    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(columns))
    fusion = capture(_Reductions(), [x]).fd.fusion
    for ours, torch_s in zip(evaluate(fusion, [x]), _Reductions()(x), strict=True):
        torch.testing.assert_close(ours, torch_s)  # var_mean's translation among them
    shard(fusion.inputs[0], DeviceMesh(2), [Shard(1)])
    sharded, _ = shard_fusion(fusion)
    moved = []
    for expr in sharded.exprs:
        if hasattr(expr, "kind"):
            kept = [a.extent for a in expr.inputs[0].axes if not a.is_reduction]
            moved.append((expr.kind.value, kept, expr.inputs[0].dtype.bits // 8))
    # sum, max, mean, var (2 passes), var_mean (2), the denominator's max and sum, the
    # softmax's and the log-softmax's max and sum
    assert len(moved) == 13
    assert all(kind == "Allreduce" and kept == [5] for kind, kept, _ in moved), moved
    assert sum(5 * width for _, _, width in moved) == 13 * 5 * 4  # 260 bytes, float32
