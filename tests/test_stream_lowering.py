"""Stream lowering, the overlap planner and the timeline, in one process."""

from __future__ import annotations

import json
import struct

import matplotlib.image
import numpy
import pytest
import torch

from fusion import FusionDefinition, ParallelType
from fusion.autodiff import backward
from fusion.reference import evaluate
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor, OverlapOptions, Timeline, compile_program
from overlap.compile.lowering import lower_to_host_program
from overlap.diag.timeline import (
    Span,
    axis_ticks,
    chrome_trace,
    render_png,
    render_text,
    timeline_figure,
)
from overlap.ir import LaunchKernel, walk
from overlap.plan.cost_model import predict
from overlap.plan.figures import CPU_FIGURES, H200_FIGURES, named_figures
from overlap.plan.planner import plan_overlap
from overlap.train.backward import placed_backward
from sharding import DeviceMesh, Replicate, Shard, shard, shard_fusion


def _sets(streamed: list[bool], chunks: int = 4) -> FusionDefinition:
    """A chain of copies; ``streamed[i]`` puts copy i on a Stream axis."""
    with FusionDefinition(f"{len(streamed)}_sets") as fd:
        tensor = fd.define_tensor([4, 8])
        copies = []
        for _ in streamed:
            tensor = fd.ops.set(tensor)
            copies.append(tensor)
        fd.add_output(tensor)
    for copy, on_stream in zip(copies, streamed, strict=True):
        if on_stream:
            copy.axis(0).parallelize(ParallelType.Stream, chunks)
    return fd


ONE_SET = """\
HostProgram 1_sets: 1 input, 1 output
inputs: T0
  Allocate T1_f32[iStream2{4}, iS3{8}]
  s0 = GetCurrentStream
  FOR i in range(4):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(4):  # 4 chunks
    SetCurrentStream(stream i)
    T2 = AliasSelect(T0, dim=0, chunk=i)
    T3 = AliasSelect(T1, dim=0, chunk=i)
    LaunchKernel k0 [reference] (T2) -> (T3)
      set
    SetCurrentStream(s0)
    Synchronize(stream i)
outputs: T1"""

TWO_SETS = """\
HostProgram 2_sets: 1 input, 1 output
inputs: T0
  Allocate T1_f32[iStream2{4}, iS3{8}]
  Allocate T2_f32[iStream4{4}, iS5{8}]
  s0 = GetCurrentStream
  FOR i in range(4):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(4):  # 4 chunks
    SetCurrentStream(stream i)
    T3 = AliasSelect(T0, dim=0, chunk=i)
    T4 = AliasSelect(T1, dim=0, chunk=i)
    T5 = AliasSelect(T2, dim=0, chunk=i)
    LaunchKernel k0 [reference] (T3) -> (T5)
      set, set
    SetCurrentStream(s0)
    Synchronize(stream i)
  Deallocate T1
outputs: T2"""

THREE_SETS = """\
HostProgram 3_sets: 1 input, 1 output
inputs: T0
  Allocate T1_f32[iStream2{4}, iS3{8}]
  s0 = GetCurrentStream
  FOR i in range(4):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(4):  # 4 chunks
    SetCurrentStream(stream i)
    T4 = AliasSelect(T0, dim=0, chunk=i)
    T5 = AliasSelect(T1, dim=0, chunk=i)
    LaunchKernel k0 [reference] (T4) -> (T5)
      set
    SetCurrentStream(s0)
    Synchronize(stream i)
  LaunchKernel k1 [reference] (T1) -> (T2)
    set
  Deallocate T1
  Allocate T3_f32[iStream6{4}, iS7{8}]
  FOR i in range(4):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(4):  # 4 chunks
    SetCurrentStream(stream i)
    T6 = AliasSelect(T2, dim=0, chunk=i)
    T7 = AliasSelect(T3, dim=0, chunk=i)
    LaunchKernel k2 [reference] (T6) -> (T7)
      set
    SetCurrentStream(s0)
    Synchronize(stream i)
  Deallocate T2
outputs: T3"""

SUM_IN_LOOP = """\
HostProgram sum_in_loop: 1 input, 1 output
inputs: T0
  Allocate T1_f32[iStream2{4}, rS3{8}]
  s0 = GetCurrentStream
  FOR i in range(4):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(4):  # 4 chunks
    SetCurrentStream(stream i)
    T2 = AliasSelect(T0, dim=0, chunk=i)
    T3 = AliasSelect(T1, dim=0, chunk=i)
    LaunchKernel k0 [reference] (T2) -> (T3)
      sum
    SetCurrentStream(s0)
    Synchronize(stream i)
outputs: T1"""


def _sum_in_loop() -> FusionDefinition:
    with FusionDefinition("sum_in_loop") as fd:
        x = fd.define_tensor([4, 8])
        y = fd.ops.sum(x, dims=[1])
        fd.add_output(y)
    y.axis(0).parallelize(ParallelType.Stream, 4)
    return fd


@pytest.mark.parametrize(
    ("build", "golden"),
    [
        (lambda: _sets([True]), ONE_SET),
        (lambda: _sets([True, True]), TWO_SETS),
        (lambda: _sets([True, False, True]), THREE_SETS),
        (_sum_in_loop, SUM_IN_LOOP),
    ],
    ids=["one-set", "two-sets-one-loop", "three-sets-two-loops", "sum-inside-the-loop"],
)
def test_single_device_stream_lowering_is_pinned_and_computes_the_reference(build, golden):
    fd = build()
    executor = MultiDeviceExecutor(fd)
    assert str(executor.program) == golden
    x = torch.randn(4, 8)
    (out,) = executor.run([x])
    assert torch.equal(out, fd.execute([x])[0])


@pytest.mark.parametrize("chunks", [1, 3, 4, 7])
def test_chunks_that_do_not_divide_the_rows_still_cover_every_row(chunks):
    fd = _sets([True], chunks)
    x = torch.randn(4, 8)
    (out,) = MultiDeviceExecutor(fd).run([x])
    assert torch.equal(out, x)


def test_a_stream_axis_marked_without_a_count_runs_in_the_default_chunks():
    """``parallelize(ParallelType.Stream)`` with no count: two chunks."""
    from overlap.compile.apply_plan import stream_axes

    fd = _sets([True], chunks=None)
    (copy,) = fd.fusion.outputs
    assert str(stream_axes(fd.fusion)) == f"{copy.name}: axis 0 in 2 chunks (marked)"
    assert "FOR i in range(2)" in str(lower_to_host_program(fd.fusion))


def test_the_users_fusion_keeps_its_stream_axes_and_is_not_changed_by_lowering():
    fd = _sets([True])
    before = str(fd)
    MultiDeviceExecutor(fd)
    assert str(fd) == before


def test_marking_a_split_axis_stream_by_hand_keeps_the_split_or_is_refused():
    """``parallelize(Stream)`` on an axis split over the mesh replaced the split, and the
    output came back whole instead of in the pieces asked for (found in review):
    refused, naming ``axis.stream(chunks)``, which keeps the split."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([16, 16])
        y = fd.ops.exp(x)
        fd.add_output(y)
    mesh = DeviceMesh(2)
    shard(x, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"split over the mesh \(DIDx\).*axis.stream"):
        y.axis(0).parallelize(ParallelType.Stream, 2)
    assert y.axis(0).parallel_type is ParallelType.DIDx
    y.axis(0).stream(2)
    assert y.axis(0).parallel_type is ParallelType.DIDx and y.axis(0).stream_chunks == 2


# ---------------------------------------------------------------------------
# Pipelined communications: what the lowering prints


def _ag_linear():
    mesh = DeviceMesh(2)
    with FusionDefinition("ag_linear") as fd:
        x = fd.define_tensor([8, 4])
        w = fd.define_tensor([6, 4])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])
    shard(w, mesh, [Replicate()])
    shard(y, mesh, [Replicate()])
    return fd


def _linear_rs():
    mesh = DeviceMesh(2)
    with FusionDefinition("linear_rs") as fd:
        # a contraction longer than the rows: reduce-scattering the result moves the fewest
        # bits (with 4 the weight would be gathered and the rows moved instead)
        x = fd.define_tensor([8, 16])
        w = fd.define_tensor([6, 16])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, mesh, [Shard(1)])
    shard(w, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    return fd


AG_LINEAR = """\
HostProgram ag_linear: 2 inputs, 1 output
meshes:
  M0 = mesh(x=2: [0, 1])
inputs: T0, T1
  Allocate T3_f32[iStream7{8}, iS8{4}]  @M0
  Allocate T2_f32[iStream4{8}, iS5{6}, rS6{4}]  @M0
  s0 = GetCurrentStream
  FOR i in range(2):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(2):  # post every transfer first
    SetCurrentStream(stream i)
    T4 = AliasSelect(T0, dim=0, chunk=i)
    T5 = AliasSelect(T3, dim=0, chunk=i)
    c0 = Allgather(T4 -> T5, axis='x', in_dim=0) [collective]  @M0
  FOR i in range(2):  # 2 chunks, 1 per rank of x, order global
    SetCurrentStream(stream i)
    Wait c0
    T6 = AliasSelect(T2, dim=0, chunk=i)
    LaunchKernel k0 [torch] (T5, T1) -> (T6)  @M0
      linear
    SetCurrentStream(s0)
    Synchronize(stream i)
  Deallocate T3
outputs: T2"""

LINEAR_RS = """\
HostProgram linear_rs: 2 inputs, 1 output
meshes:
  M0 = mesh(x=2: [0, 1])
inputs: T0, T1
  Allocate T3_f32[iStream7{8}, iS8{6}, rDIDx9{16}]  @M0
  Allocate T2_f32[iDIDx|Stream4{8}, iS5{6}, rS6{16}]  @M0
  s0 = GetCurrentStream
  FOR i in range(2):
    SetCurrentStream(stream i)
    Synchronize(s0)
  FOR i in range(2):  # 2 chunks, 1 per rank of x, order local_last
    SetCurrentStream(stream i)
    T4 = AliasSelect(T0, dim=0, chunk=i)
    T5 = AliasSelect(T3, dim=0, chunk=i)
    T6 = AliasSelect(T2, dim=0, chunk=i)
    LaunchKernel k0 [torch] (T4, T1) -> (T5)  @M0
      linear
    c0 = ReduceScatter(T5 -> T6, axis='x', out_dim=0, op='sum') [collective]  @M0
    Wait c0
    SetCurrentStream(s0)
    Synchronize(stream i)
  Deallocate T3
outputs: T2"""


@pytest.mark.parametrize(
    ("build", "golden"), [(_ag_linear, AG_LINEAR), (_linear_rs, LINEAR_RS)], ids=["ag", "rs"]
)
def test_pipelined_patterns_lower_to_one_loop_with_the_hoisted_sync_loop(build, golden):
    options = OverlapOptions(overlap=True, num_chunks=2, transport="collective")
    compiled = compile_program(build(), 2, options, H200_FIGURES)
    (decision,) = compiled.plan
    assert decision.overlapped
    assert str(compiled.host) == golden


def test_a_copy_engine_all_gather_stages_its_piece_before_the_loop():
    options = OverlapOptions(overlap=True, transport="copy_engine", num_chunks=4)
    text = str(compile_program(_ag_linear(), 2, options, H200_FIGURES).host)
    assert text.index("StageForPeers(T0)") < text.index("FOR i in range(4):  # 4 chunks")
    assert "order local_first" in text and "[copy_engine]" in text


def test_a_copy_engine_reduce_scatter_combines_after_the_loop():
    options = OverlapOptions(overlap=True, transport="copy_engine", num_chunks=2)
    text = str(compile_program(_linear_rs(), 2, options, H200_FIGURES).host)
    assert text.index("Synchronize(stream i)") < text.index("CombineStaged(T2)")
    assert "order local_last" in text


# ---------------------------------------------------------------------------
# The planner


def _ag_matmul_shape(m: int, k: int, n: int, world: int = 2):
    """The benchmark's all-gather + matmul: rows split, weight columns split."""
    mesh = DeviceMesh(world)
    with FusionDefinition("ag_matmul") as fd:
        a = fd.define_tensor([m, k], "bf16")
        b = fd.define_tensor([k, n * world], "bf16")
        fd.add_output(fd.ops.matmul(a, b))
    shard(a, mesh, [Shard(0)])
    shard(b, mesh, [Shard(1)])
    return shard_fusion(fd.fusion)[0]


def test_the_planner_overlaps_large_shapes_on_h200_and_says_why():
    (decision,) = plan_overlap(_ag_matmul_shape(8192, 8192, 4096), H200_FIGURES)
    assert decision.pattern == "allgather+matmul"
    assert decision.shape == (8192, 8192, 4096)
    assert decision.overlapped
    assert decision.chosen.transport == "copy_engine"
    assert decision.chosen.order == "local_first"
    text = str(decision)
    assert "reason: fastest predicted on H200" in text
    assert "sequential (no overlap)" in text  # the alternatives are listed


def test_the_planner_chooses_no_overlap_when_it_cannot_pay():
    (decision,) = plan_overlap(_ag_matmul_shape(64, 64, 64), CPU_FIGURES)
    assert not decision.overlapped
    assert "cannot pay" in decision.reason or "no pipeline" in decision.reason


def test_overrides_win_and_are_reported():
    fusion = _ag_matmul_shape(8192, 8192, 4096)
    options = OverlapOptions(num_chunks=4, transport="collective")
    (decision,) = plan_overlap(fusion, H200_FIGURES, options)
    assert (decision.chosen.num_chunks, decision.chosen.transport) == (4, "collective")
    assert "forced: num_chunks, transport" in decision.reason


def test_overlap_off_keeps_the_communication_whole():
    fusion = _ag_matmul_shape(8192, 8192, 4096)
    (decision,) = plan_overlap(fusion, H200_FIGURES, OverlapOptions(overlap=False))
    assert not decision.overlapped
    assert "FOR" not in str(lower_to_host_program(fusion))


def test_the_cost_model_sees_the_limit_and_wave_quantization():
    args = ("allgather+matmul", H200_FIGURES, (8192, 8192, 4096), 2, 16)
    sequential = predict(*args, None, 1)
    overlapped = predict(*args, "copy_engine", 2)
    assert overlapped < sequential
    # Thin chunks lose matmul efficiency: very many chunks stop paying.
    assert predict(*args, "collective", 64) > predict(*args, "collective", 4)


def _matmul_rs_shape(m: int, k: int, n: int, world: int):
    """The benchmark's matmul + reduce-scatter: contraction split, rows scattered."""
    mesh = DeviceMesh(world)
    with FusionDefinition("matmul_rs") as fd:
        a = fd.define_tensor([m, k * world], "bf16")
        b = fd.define_tensor([k * world, n], "bf16")
        c = fd.ops.matmul(a, b)
        fd.add_output(c)
    shard(a, mesh, [Shard(1)])
    shard(b, mesh, [Shard(0)])
    shard(c, mesh, [Shard(0)])
    return shard_fusion(fd.fusion)[0]


@pytest.mark.parametrize("world", [4, 8])
def test_at_4_and_8_ranks_the_planner_says_its_link_figures_are_from_2(world):
    """H200's link figures were measured at 2 ranks: a plan for more says so."""
    for fusion in (
        _ag_matmul_shape(8192, 8192, 4096, world),
        _matmul_rs_shape(8192, 8192, 4096, world),
    ):
        (decision,) = plan_overlap(fusion, H200_FIGURES)
        assert decision.team_size == world
        assert f"link figures measured at 2 ranks, not {world}" in decision.reason
    (decision,) = plan_overlap(_ag_matmul_shape(8192, 8192, 4096, 2), H200_FIGURES)
    assert "link figures measured" not in decision.reason


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_named_h200_figures_at_4_ranks_are_those_measured_at_4(world):
    """``overlap dump --world 4`` and the demo's plan read the 4-rank H200 figures; at 8
    ranks, with none measured there, the 2-rank ones and a reason that says so."""
    figures = named_figures("h200", world)
    assert figures.ranks == (4 if world == 4 else 2)
    (decision,) = plan_overlap(_ag_matmul_shape(8192, 8192, 4096, world), figures)
    assert ("link figures measured" in decision.reason) == (world == 8)
    assert figures.name.endswith(" x4") == (world == 4)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_collective_reduce_scatter_pipeline_sends_while_computing_and_combines_its_own_last(
    world,
):
    """The collective transport's reduce-scatter visits a rank's own chunks last: the
    others' partials are sent one a link an iteration, beside the next matmuls, and only
    the owner's combine (a pass over its P partials) follows the last matmul. Where the
    matmul hides the sends, the pipeline costs the matmul, its slowdown beside NCCL and
    the combine, whatever the chunk count."""
    m, k, n = 8192, 8192, 14336
    fusion = _matmul_rs_shape(m, k, n, world)
    options = OverlapOptions(transport="collective", num_chunks=world)
    (decision,) = plan_overlap(fusion, H200_FIGURES, options)
    assert decision.chosen.order == "local_last"
    figures, pattern = H200_FIGURES, "matmul+reduce_scatter"
    one_chunk_ms = predict(pattern, figures, (m // world, k, n), 1, 16, None, 1)
    matmul_ms = one_chunk_ms - figures.launch_us / 1e3  # one rank alone: no transfer
    combine_ms = (m / world) * n * 2 * (world + 1) / (figures.memory_gbps * 1e6)
    expected = world * matmul_ms * figures.collective_slowdown + combine_ms
    predicted = predict(pattern, figures, (m, k, n), world, 16, "collective", world, True)
    assert predicted == pytest.approx(expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(transport="smoke"), "transport must be one of"),
        (dict(num_chunks=0), "num_chunks must be a positive int"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        OverlapOptions(**options)


# ---------------------------------------------------------------------------
# The timeline


def test_the_timeline_exports_a_chrome_trace_and_a_png(tmp_path):
    fd = _sets([True, True])
    executor = MultiDeviceExecutor(fd)
    timeline = Timeline("cpu")
    executor.run([torch.randn(4, 8)], timeline=timeline)
    spans = timeline.spans()
    assert len(spans) == 4 and all(s.end_ms >= s.start_ms >= 0 for s in spans)
    assert {s.lane for s in spans} == {f"stream {i} compute" for i in range(4)}
    timeline.write_chrome_trace(tmp_path / "trace.json", rank=3)
    trace = json.loads((tmp_path / "trace.json").read_text())
    work = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(work) == 4 and all(e["pid"] == 3 for e in work)
    timeline.write_png(tmp_path / "timeline.png", width_in=4.0)
    png = (tmp_path / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    # Decode the image: as wide as asked (4 inches at 120 dpi), and the bars drawn in the
    # legend's compute colour.
    image = matplotlib.image.imread(tmp_path / "timeline.png")[..., :3]
    assert image.shape[1] == 4 * 120
    legend = timeline_figure(spans).legends[0]
    compute = next(h for h, t in zip(legend.legend_handles, legend.get_texts(), strict=True)
                   if t.get_text() == "kernel (compute)")  # fmt: skip
    color = numpy.array(compute.get_facecolor()[:3], dtype=image.dtype)
    assert (numpy.abs(image - color) < 1.5 / 255).all(axis=-1).sum() > 100


def _two_ranks() -> dict[int, list[Span]]:
    """A pipelined all-gather + matmul on two ranks: chunk 1's transfer beside chunk 0's
    matmul."""
    return {
        rank: [Span("stream 0 comm", "c0", 0.0, 0.1 + rank * 0.05, "Allgather T6", 0),
               Span("stream 1 comm", "c0", 0.0, 0.4, "Allgather T6", 1),
               Span("stream 0 compute", "k1", 0.1 + rank * 0.05, 0.4, "matmul", 0),
               Span("stream 1 compute", "k1", 0.4, 0.7, "matmul", 1),
               Span("main compute", "k2", 0.7, 0.75, "gelu, mul")]
        for rank in (0, 1)
    }  # fmt: skip


def test_the_text_timeline_names_lanes_labels_bars_and_has_a_time_axis():
    text = render_text(_two_ranks(), width=60)
    lines = text.splitlines()
    names = [line.split("|")[0].strip() for line in lines[:10]]
    assert names == [f"rank {r} {lane}" for r in (0, 1) for lane in
                     ("main compute", "stream 0 compute", "stream 0 comm",
                      "stream 1 compute", "stream 1 comm")]  # fmt: skip
    row = dict(zip(names, (line.split("|")[1] for line in lines[:10]), strict=True))
    assert row["rank 0 stream 1 comm"].startswith("c0.1===")  # a transfer, labelled
    assert row["rank 0 stream 0 compute"].lstrip().startswith("k1.0###")  # a kernel
    # chunk 1's transfer is drawn in the columns where chunk 0's matmul runs
    start = row["rank 0 stream 0 compute"].index("k1.0")
    assert row["rank 0 stream 1 comm"][start] == "="
    assert lines[11].split()[-1] == "us" and lines[11].split()[0] == "0"  # under 1 ms: µs
    assert "c0 Allgather T6; k1 matmul; k2 gelu, mul" in text
    # a bar shorter than its label: the label runs on into the blank after it, if any
    short = [Span("main compute", "k5", 0.0, 0.01), Span("main compute", "k6", 0.5, 1.0)]
    row = render_text(short, width=40).splitlines()[0].split("|")[1]
    assert row.startswith("k5 ") and row[20:].startswith("k6##"), row


def test_the_time_axis_picks_a_readable_step_and_unit():
    ticks, unit, factor = axis_ticks(0.75)
    assert (
        unit == "us"
        and factor == 1e3
        and [round(t * 1e3) for t in ticks] == list(range(0, 701, 100))
    )
    ticks, unit, _ = axis_ticks(37.0)
    assert unit == "ms" and ticks == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0]


def test_the_chart_of_several_ranks_has_a_title_legend_lanes_and_an_axis():
    figure = timeline_figure(_two_ranks(), title="tp_mlp\n2 chunks")
    (axes,) = figure.axes
    assert figure.get_suptitle() == "tp_mlp\n2 chunks"
    (legend,) = figure.legends
    colors = {t.get_text(): h.get_facecolor()
              for h, t in zip(legend.legend_handles, legend.get_texts(), strict=True)}  # fmt: skip
    assert set(colors) == {"kernel (compute)", "communication, issue to wait"}
    assert "c0 Allgather T6; k1 matmul; k2 gelu, mul" in axes.get_title(loc="left")  # the key
    lanes = [t.get_text() for t in axes.get_yticklabels()]
    assert lanes == [f"rank {r} {lane}" for r in (0, 1) for lane in
                     ("main compute", "stream 0 compute", "stream 0 comm",
                      "stream 1 compute", "stream 1 comm")]  # fmt: skip

    # a bar per span, in its lane, coloured by what it is
    def where(bar) -> tuple[str, float, float]:  # its lane, start and end (µs)
        lane = lanes[round(bar.get_y() + bar.get_height() / 2)]
        return lane, round(bar.get_x(), 6), round(bar.get_x() + bar.get_width(), 6)

    bars = {where(bar): bar.get_facecolor() for bar in axes.patches}
    assert len(bars) == 10
    assert bars["rank 0 stream 1 comm", 0.0, 400.0] == colors["communication, issue to wait"]
    assert bars["rank 1 stream 0 compute", 150.0, 400.0] == colors["kernel (compute)"]
    assert axes.get_xlabel() == "time (µs) from each rank's first span"  # 0.75 ms: in µs
    ticks = [t.get_text() for t in axes.get_xticklabels()]
    assert ticks == [str(t) for t in range(0, 701, 100)]
    # every bar labelled with its instruction and chunk (each is wider than its label)
    assert sorted(t.get_text() for t in axes.texts) == sorted(["c0.0", "c0.1", "k1.0",
                                                               "k1.1", "k2"] * 2)  # fmt: skip
    # a bar narrower than its label goes unlabelled
    short = [Span("main compute", "k5", 0.0, 0.001), Span("main compute", "k6", 0.5, 1.0)]
    assert [t.get_text() for t in timeline_figure(short).axes[0].texts] == ["k6"]
    png = render_png(_two_ranks(), "tp_mlp\n2 chunks", width_in=5.0, dpi=100)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    one_rank = render_png(_two_ranks()[0], "tp_mlp\n2 chunks", width_in=5.0, dpi=100)
    assert width == 500 and height > struct.unpack(">II", one_rank[16:24])[1]  # more lanes


def test_a_trace_of_several_ranks_has_a_process_per_rank_and_names_each_span():
    trace = chrome_trace(_two_ranks())
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["name"] == "process_name"}  # fmt: skip
    assert processes == {0: "rank 0", 1: "rank 1"}
    work = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(work) == 10 and {e["cat"] for e in work} == {"comm", "compute"}
    first = next(e for e in work if e["pid"] == 1 and e["name"].startswith("c0.1"))
    assert first["name"] == "c0.1 Allgather T6" and first["args"] == {"what": "Allgather T6",
                                                                       "chunk": 1}  # fmt: skip
    assert first["dur"] == pytest.approx(400.0)  # µs


# ---------------------------------------------------------------------------
# A widened input used again after a matmul is recomputed there, not kept


def _norm_matmul_residual(world: int | None) -> FusionDefinition:
    with FusionDefinition("norm_matmul_residual") as fd:
        x = fd.define_tensor([8, 16], "bfloat16")
        w = fd.define_tensor([16, 16], "bfloat16")
        x32 = fd.ops.cast(x, "float32")
        normed = fd.ops.cast(x32 * fd.ops.rsqrt(fd.ops.mean(x32 * x32, [1], keepdim=True)),
                             "bfloat16")  # fmt: skip
        out = fd.ops.cast(fd.ops.cast(fd.ops.linear(normed, w), "float32") + x32, "bfloat16")
        fd.add_output(out)
    if world is not None:
        mesh = DeviceMesh(world)
        shard(x, mesh, [Shard(0)])
        shard(w, mesh, [Replicate()])
        shard(out, mesh, [Shard(0)])
    return fd


@pytest.mark.parametrize("world", [None, 2], ids=["one device", "two ranks"])
def test_a_widened_input_is_recomputed_by_the_kernel_that_uses_it_again(world):
    """The float32 copy of ``x`` feeds the norm and, after the matmul, the residual: the
    residual's kernel reads ``x`` (2 bytes an element) and widens it itself, instead of
    the norm's kernel writing the copy (4 bytes) for it to read back."""
    fd = _norm_matmul_residual(world)
    compiled = compile_program(fd.fusion, world or 1, None, H200_FIGURES, schedule=True)
    x = compiled.fusion.inputs[0]
    kernels = [i for i in compiled.host.instructions if hasattr(i, "exprs")]
    float32_outputs = [t for k in kernels for t in k.outputs if t.dtype.bits == 32]
    assert float32_outputs == [], [str(k) for k in kernels]
    residual = kernels[-1]
    assert x in residual.inputs and [e.op_name for e in residual.exprs][:2] == ["cast", "cast"]
    full = [torch.randn(8, 16).bfloat16(), (torch.randn(16, 16) / 4).bfloat16()]
    if world is None:
        (out,) = MultiDeviceExecutor(fd, None, kernels="reference").run(full)
        assert torch.equal(out, fd.execute(full)[0])


# ---------------------------------------------------------------------------
# A bf16 SwiGLU backward keeps no float32 value of the ffn's width between kernels


def _bf16_swiglu(world: int | None, tokens: int = 16, hidden: int = 32, ffn: int = 64):
    with FusionDefinition("bf16_swiglu") as fd:
        x = fd.define_tensor([tokens, hidden], "bfloat16")
        w_gate = fd.define_tensor([ffn, hidden], "bfloat16")
        w_up = fd.define_tensor([ffn, hidden], "bfloat16")
        w_down = fd.define_tensor([hidden, ffn], "bfloat16")
        gate = fd.ops.linear(x, w_gate)
        up = fd.ops.linear(x, w_up)
        hidden_act = fd.ops.silu(fd.ops.cast(gate, "float32")) * fd.ops.cast(up, "float32")
        out = fd.ops.linear(fd.ops.cast(hidden_act, "bfloat16"), w_down)
        fd.add_output(out)
    if world is not None:
        mesh = DeviceMesh(world)
        for tensor, placement in ((x, Replicate()), (w_gate, Shard(0)), (w_up, Shard(0)),
                                  (w_down, Shard(1)), (out, Replicate())):  # fmt: skip
            shard(tensor, mesh, [placement])
    return fd, [gate, up]


@pytest.mark.parametrize("world", [None, 2], ids=["one device", "two ranks"])
def test_a_swiglu_backward_writes_no_float32_value_of_the_ffn_width(world, monkeypatch):
    """Gate and up saved in bf16: silu(gate) in float32 is read by the recomputed forward
    and, after the matmuls, by silu's gradient. Each float32 [tokens, ffn] value stays
    inside the kernel that computes it (the chain recomputed where it is read again;
    ``gather_pointwise`` has a test of its own below), and the generated program
    computes what the reference evaluator does."""
    fd, saved = _bf16_swiglu(world)
    grads = placed_backward(fd.fusion, saved=saved) if world else backward(fd.fusion, saved=saved)
    compiled = compile_program(grads.fusion, world or 1, None, H200_FIGURES, schedule=True)
    kernels = [i for i in walk(compiled.host.instructions) if isinstance(i, LaunchKernel)]
    wide = [t for k in kernels for t in k.outputs if t.dtype.bits == 32 and 64 in t.shape]
    assert wide == [], [f"{k.name}: {k.outputs}" for k in kernels]
    if world is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # generated kernels on CPU
        generator = torch.Generator().manual_seed(5)
        values = [(torch.randn([int(e) for e in t.shape], generator=generator) / 4).bfloat16()
                  for t in grads.fusion.inputs]  # fmt: skip
        expected = evaluate(grads.fusion, values)
        actual = MultiDeviceExecutor(grads.fusion, None, kernels="generated").run(values)
        for ours, theirs in zip(actual, expected, strict=True):
            assert_close(ours, theirs, reduction_extent=64)


def test_a_pointwise_expr_after_a_matmul_joins_the_kernel_computing_its_inputs(monkeypatch):
    """The last output reads only ``a``, computed before the matmul (from two inputs:
    no chain to recompute), but comes after it: it moves up into ``a``'s kernel, so the
    float32 ``a`` is no kernel's output (written for a kernel of its own, read back)."""
    with FusionDefinition("late_pointwise") as fd:
        x = fd.define_tensor([8, 16], "bfloat16")
        y = fd.define_tensor([8, 16], "bfloat16")
        w = fd.define_tensor([4, 16], "bfloat16")
        a = fd.ops.exp(fd.ops.cast(x, "float32") * fd.ops.cast(y, "float32"))
        m = fd.ops.linear(y, w)
        fd.add_output(m)
        fd.add_output(fd.ops.cast(fd.ops.mul(a, 3.0), "bfloat16"))
    compiled = compile_program(fd.fusion, 1, None, H200_FIGURES, schedule=True)
    kernels = [i for i in walk(compiled.host.instructions) if isinstance(i, LaunchKernel)]
    assert [[e.op_name for e in k.exprs] for k in kernels] == [
        ["cast", "cast", "mul", "exp", "mul", "cast"],
        ["linear"],
    ], [str(k) for k in kernels]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # generated kernels on CPU
    generator = torch.Generator().manual_seed(3)
    full = [torch.randn(s, generator=generator).bfloat16() for s in ([8, 16], [8, 16], [4, 16])]
    outputs = MultiDeviceExecutor(fd, None, kernels="generated").run(full)
    for ours, theirs in zip(outputs, fd.execute(full), strict=True):
        assert_close(ours, theirs, reduction_extent=16)


def test_a_swiglu_forward_keeps_silu_of_its_gate_inside_one_kernel():
    """silu(float32(gate)) sits between the gate and up matmuls in program order; the
    widened matmul result is recomputed where it is read, so one kernel reads both bf16
    results and nothing writes a float32 value of the ffn's width."""
    fd, _ = _bf16_swiglu(None)
    compiled = compile_program(fd.fusion, 1, None, H200_FIGURES, schedule=True)
    kernels = [i for i in walk(compiled.host.instructions) if isinstance(i, LaunchKernel)]
    wide = [t for k in kernels for t in k.outputs if t.dtype.bits == 32]
    assert wide == [], [str(k) for k in kernels]
    assert [k.backend for k in kernels] == ["torch", "torch", "pointwise", "torch"]
