"""Pipelined all-gather + linear and linear + reduce-scatter on real gloo processes.

Every chunk count and transport must give the reference's result on fresh random
inputs, uneven rows included; a chunk count that cannot work fails on every rank before
any communication.
"""

from __future__ import annotations

import pytest
import torch
from distributed import RankError

from fusion import FusionDefinition, ParallelType
from fusion.exprs import LinearOp
from fusion.testing import assert_close
from overlap import MultiDeviceExecutor, OverlapOptions
from overlap.comm.partials import PartialCombiner
from overlap.ir import Communicate, ForLoop, LaunchKernel
from schedulers.cache import KERNEL_CACHE
from schedulers.hardware import INTERPRETER
from sharding import DeviceMesh, Shard, ShardingError, shard, shard_fusion


def _ag_linear(world: int, rows: int, bias: bool) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("ag_linear") as fd:
        x = fd.define_tensor([rows, 12])
        w = fd.define_tensor([4 * world, 12])
        b = fd.define_tensor([4 * world]) if bias else None
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])  # sequence split, gathered for a column-parallel linear
    shard(w, mesh, [Shard(0)])
    return fd


def _linear_rs(world: int, rows: int, dtype: str = "float32") -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("linear_rs") as fd:
        # a contraction longer than the rows: reduce-scattering the result is the cheaper
        # plan (with 4 a rank, moving the rows and gathering the weight would be)
        x = fd.define_tensor([rows, 16 * world], dtype)
        w = fd.define_tensor([10, 16 * world], dtype)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, mesh, [Shard(1)])  # row-parallel linear, reduce-scattered back to rows
    shard(w, mesh, [Shard(1)])
    shard(y, mesh, [Shard(0)])
    return fd


def pipelined(communicator, pattern: str, rows: int, chunks: int, transport: str, seed: int):
    world = communicator.world_size
    fd = _ag_linear(world, rows, bias=True) if pattern == "ag" else _linear_rs(world, rows)
    options = OverlapOptions(overlap=True, num_chunks=chunks, transport=transport)
    executor = MultiDeviceExecutor(fd, communicator, options)
    generator = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(list(t.shape), generator=generator).to(communicator.device)
        for t in fd.fusion.inputs
    ]
    expected = executor.shard_outputs(fd.execute(full))
    for _ in range(2):  # a second run reuses buffers and streams
        (out,) = executor.run(executor.shard_inputs(full))
        assert_close(out, expected[0], reduction_extent=(4 if pattern == "ag" else 16) * world)
    (decision,) = executor.overlap
    return decision.overlapped, decision.chosen.num_chunks, decision.chosen.transport, str(decision)


ORDERS = {("ag", "collective"): "global", ("ag", "ring"): "ring_gather",
          ("rs", "collective"): "local_last", ("rs", "ring"): "ring_reduce"}  # fmt: skip


CASES = [
    # (pattern, rows, chunks as a multiple of the world, transport)
    ("ag", 16, 1, "collective"),
    ("ag", 16, 2, "collective"),
    ("ag", 13, 3, "collective"),  # rows split 7/6 (or 4/3/3/3), chunks uneven too
    ("ag", 13, 1, "ring"),
    ("ag", 16, 4, "ring"),  # OverlapOptions(num_chunks=8, transport="ring"), as in the guide
    ("rs", 16, 1, "collective"),
    ("rs", 16, 2, "collective"),
    ("rs", 13, 3, "collective"),
    ("rs", 13, 1, "ring"),
    ("ag", 13, 3, "ring"),  # several chunks a rank travel the ring one after another
    ("rs", 16, 4, "ring"),
    ("rs", 3, 1, "collective"),  # fewer rows than 4 ranks: empty partials sent too
]


@pytest.mark.parametrize(("pattern", "rows", "per_rank", "transport"), CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_pattern_matches_the_reference(rank_pools, world, pattern, rows, per_rank,
                                                 transport):  # fmt: skip
    """Every rank's piece against the reference, twice; the plan (printed, the same on
    every rank) names the team, the chunks, the transport and its chunk order."""
    chunks = per_rank * world
    results = rank_pools(world).run(pipelined, pattern, rows, chunks, transport, 21)
    assert [result[:3] for result in results] == [(True, chunks, transport)] * world
    plan = results[0][3]
    print(plan)
    assert all(result[3] == plan for result in results)
    wanted = f"{world} ranks): {chunks} chunks, {transport}, {ORDERS[pattern, transport]} order"
    assert wanted in plan, plan


def reduce_waits_in_order(communicator, chunks: int) -> list[str]:
    """The order in which the pipelined reduce-scatter's chunk transfers (each
    iteration's batch of sends and receives of partials) are posted and first waited
    for, on this CPU rank (the result checked too)."""
    import torch.distributed as dist

    from overlap.comm import pipelined as pipelines

    log = []
    post, wait = dist.batch_isend_irecv, pipelines._Batch.wait

    def logged_post(ops):
        log.append("post")
        return post(ops)

    def logged_wait(batch):
        if not batch.waited:
            log.append("wait")
        return wait(batch)

    dist.batch_isend_irecv, pipelines._Batch.wait = logged_post, logged_wait
    try:
        pipelined(communicator, "rs", 16, chunks, "collective", 5)
    finally:
        dist.batch_isend_irecv, pipelines._Batch.wait = post, wait
    return log


@pytest.mark.parametrize("world", [2, 4])
def test_on_cpus_a_chunk_reduction_is_waited_for_after_the_later_chunks_are_posted(
    rank_pools, world
):
    """On a GPU a Wait holds back a stream, not the host; on CPUs the host runs the
    streams' work in turn, so a wait for chunk i's transfer inside the loop would hold
    back chunk i+1's matmul: nothing overlaps. Nothing in the loop reads that result,
    so the waits are put off to the loop's end: every chunk's transfer is posted (its
    matmul done) before the first is waited for, and the result still matches. In the
    local_last order a rank's own 2 chunks come last and send nothing."""
    chunks = 2 * world
    sent = chunks - 2
    for log in rank_pools(world).run(reduce_waits_in_order, chunks):
        assert log == (["post"] * sent + ["wait"] * sent) * 2  # two runs


def ring_posts(communicator, pattern: str, per_rank: int) -> list[list[tuple[str, int]]]:
    """The point-to-point batches the ring transport posts on this CPU rank in one run
    (each batch as ``(op, peer)`` pairs), the result checked too."""
    import torch.distributed as dist

    posts, post = [], dist.batch_isend_irecv

    def logged_post(ops):
        posts.append([(op.op.__name__, op.peer) for op in ops])
        return post(ops)

    world = communicator.world_size
    dist.batch_isend_irecv = logged_post
    try:
        pipelined(communicator, pattern, 13, per_rank * world, "ring", 3)
    finally:
        dist.batch_isend_irecv = post
    return posts


@pytest.mark.parametrize("pattern", ["ag", "rs"])
def test_each_step_of_the_ring_is_one_batch_of_a_send_and_a_receive(rank_pools, pattern):
    """NCCL runs a process group's unbatched sends and receives one after another, so
    a ring whose ranks each send before receiving waits for ever once a send outgrows
    NCCL's buffers. Each step is one batch instead: a send to the successor and a
    receive from the predecessor, at every iteration after a rank's own chunk (4 ranks,
    one chunk a rank: 3 steps a run, two runs)."""
    world, per_rank = 4, 1
    for rank, posts in enumerate(rank_pools(world).run(ring_posts, pattern, per_rank)):
        step = [("isend", (rank + 1) % world), ("irecv", (rank - 1) % world)]
        assert posts == [step] * ((world - 1) * per_rank * 2), (rank, posts)


# ---------------------------------------------------------------------------
# The summation order of a pipelined reduce-scatter


def _partials(world: int, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's bf16 partial result, as each computes it (its columns of x and w)."""
    width = x.shape[1] // world
    columns = [slice(q * width, (q + 1) * width) for q in range(world)]
    return [torch.nn.functional.linear(x[:, c], w[:, c]) for c in columns]


def _in_coordinate_order(partials: list[torch.Tensor]) -> torch.Tensor:
    """The documented order of ``overlap.comm.partials``: float32, coordinate 0 first, one
    rounding."""
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    return total.to(partials[0].dtype)


def _along_the_ring(partials: list[torch.Tensor], owner: int) -> torch.Tensor:
    """The ring's order for rows owned by ``owner``: from its successor round to it, each
    hop's sum rounded to bf16."""
    world = len(partials)
    total = partials[(owner + 1) % world]
    for step in range(2, world + 1):
        total = (total.float() + partials[(owner + step) % world].float()).to(total.dtype)
    return total


def reduce_scatter_bits(
    communicator, rows: int, per_rank_counts: list, transport: str, kernels: str
):
    """This rank's bf16 output piece at each chunk count, and the piece in the
    transport's documented order, computed here from every rank's partial."""
    world, rank = communicator.world_size, communicator.rank
    fd = _linear_rs(world, rows, "bf16")
    generator = torch.Generator().manual_seed(7)
    x, w = (torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs)
    # ranks 0 and 1 compute large partials that cancel exactly: the order then shows
    first, second = slice(0, 16), slice(16, 32)
    x[:, first] *= 2.0**16
    x[:, second], w[:, second] = -x[:, first], w[:, first]
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    pieces = []
    for per_rank in per_rank_counts:
        options = OverlapOptions(overlap=True, num_chunks=per_rank * world, transport=transport)
        executor = MultiDeviceExecutor(fd, communicator, options, kernels=kernels)
        (piece,) = executor.run(executor.shard_inputs([x, w]))
        pieces.append(piece.clone())
    partials = _partials(world, x, w)
    in_order = _in_coordinate_order(partials)
    documented = _along_the_ring(partials, rank) if transport == "ring" else in_order
    other = in_order if transport == "ring" else _in_coordinate_order(partials[::-1])
    (expected,) = executor.shard_outputs([documented])
    (otherwise,) = executor.shard_outputs([other])
    return pieces, expected, otherwise


@pytest.mark.parametrize(
    ("transport", "per_rank_counts", "kernels"),
    [
        ("collective", [1, 2, 3], "reference"),
        ("collective", [1, 3], "generated"),  # the sums as the generated kernel
        ("ring", [1, 2, 4], "reference"),
    ],
)
def test_a_pipelined_reduce_scatter_sums_in_its_documented_order_at_every_chunk_count(
    rank_pools, transport, per_rank_counts, kernels
):
    """4 ranks, bf16, 13 rows (4/3/3/3): every chunk count gives the same bits on every
    rank, and they are the documented order's (overlap.comm.partials for the collective
    transport: coordinate order in float32, one rounding; the ring's hop order, rounded
    at each hop). Ranks 0 and 1 compute large partials that cancel, so another order
    (reversed; the ring's against the coordinate order) gives other bits: the check can
    fail."""
    results = rank_pools(4).run(reduce_scatter_bits, 13, per_rank_counts, transport, kernels)
    for rank, (pieces, expected, _) in enumerate(results):
        for per_rank, piece in zip(per_rank_counts, pieces, strict=True):
            assert torch.equal(piece, expected), (rank, per_rank, (piece - expected).abs().max())
    assert any(not torch.equal(expected, other) for _, expected, other in results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("parts", [2, 3, 4, 8])
def test_partials_are_combined_in_coordinate_order_by_torch_and_by_the_generated_kernel(
    parts, dtype
):
    """The generated kernel (Triton's interpreter here, compiled on CUDA) gives torch's
    bits (float32 additions in coordinate order, one rounding), over odd sizes and
    magnitudes ten orders apart, into a non-contiguous output too; its kernel is reused
    across sizes."""
    generator = torch.Generator().manual_seed(parts)
    KERNEL_CACHE.clear()
    by_torch = PartialCombiner(parts, "sum", dtype)
    generated = PartialCombiner(parts, "sum", dtype, INTERPRETER)
    for size in (1, 7, 1000):
        scale = 10.0 ** torch.randint(-5, 5, (parts, size, 3), generator=generator)
        partials = list((torch.randn(parts, size, 3, generator=generator) * scale).to(dtype))
        expected, actual = torch.empty(size, 3, dtype=dtype), torch.empty(3, size, dtype=dtype).t()
        by_torch(partials, expected)
        generated(partials, actual)
        assert torch.equal(actual, expected), (size, (actual - expected).abs().max())
    assert KERNEL_CACHE.compilations == 1  # one kernel, three sizes


@pytest.mark.parametrize("hardware", [None, INTERPRETER], ids=["torch", "generated"])
def test_the_combined_order_is_coordinate_order(hardware):
    """In float32, (((1e8 + 1) - 1e8) + 1) is 1 where the reverse order gives 0."""
    partials = [torch.tensor([value]) for value in (1e8, 1.0, -1e8, 1.0)]
    out = torch.empty(1)
    PartialCombiner(4, "sum", torch.float32, hardware)(partials, out)
    assert out.item() == 1.0
    nan = [torch.tensor([1.0, 2.0]), torch.tensor([float("nan"), 3.0]), torch.tensor([0.0, 5.0])]
    PartialCombiner(3, "max", torch.float32, hardware)(nan, maxima := torch.empty(2))
    assert torch.isnan(maxima[0]) and maxima[1] == 5.0


def hand_marked_reduce_scatter(communicator, chunks: int) -> str:
    """A stream axis marked by hand on the row-parallel linear's partial result (no
    plan): the reduce-scatter runs in the loop; checked twice; the program's text."""
    world = communicator.world_size
    fd = _linear_rs(world, 13)
    placed = shard_fusion(fd.fusion)[0]
    (linear,) = [expr for expr in placed.exprs if isinstance(expr, LinearOp)]
    linear.outputs[0].axis(0).parallelize(ParallelType.Stream, chunks)
    executor = MultiDeviceExecutor(placed, communicator, OverlapOptions(overlap=False))
    generator = torch.Generator().manual_seed(3)
    full = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    expected = executor.shard_outputs(fd.execute(full))
    for _ in range(2):
        (out,) = executor.run(executor.shard_inputs(full))
        assert_close(out, expected[0], reduction_extent=16 * world)
    return str(executor.compiled.host)


def test_a_reduce_scatter_in_a_loop_marked_by_hand_takes_its_own_chunks_last(rank_pools):
    """Without a plan, a loop whose pipelined communications are reduce-scatters visits
    a rank's own chunks last: every rank sends one partial and receives one a step,
    instead of all sending to one owner at a time (4 ranks, 13 rows, 8 chunks)."""
    for program in rank_pools(4).run(hand_marked_reduce_scatter, 8):
        assert "# 8 chunks, 2 per rank of x, order local_last" in program, program
        assert "ReduceScatter(" in program


def all_to_all_in_a_loop(communicator) -> None:
    mesh = DeviceMesh(communicator.world_size)
    with FusionDefinition() as fd:
        x = fd.define_tensor([16, 8 * communicator.world_size])
        y = fd.ops.exp(x)
        fd.add_output(y)
    shard(x, mesh, [Shard(1)])
    y.axis(0).parallelize(ParallelType.Stream, 2)
    shard(y, mesh, [Shard(0)])  # columns to rows: an all-to-all of the marked axis
    MultiDeviceExecutor(fd, communicator)


def test_a_communication_that_splits_the_stream_axis_is_refused_on_every_rank(rank_pools):
    """An all-to-all that re-splits the marked rows, run chunk by chunk, moved each
    chunk's rows as if they were the whole tensor's (wrong rows, silently): refused
    when the program is built, on every rank, naming it."""
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(all_to_all_in_a_loop, timeout=60)
    assert sorted(failure.value.failures) == [0, 1]
    for message in failure.value.messages().values():
        assert "AllToAll of T0" in message and "stream loop cuts into 2 chunks" in message


def chunks_not_a_multiple(communicator) -> None:
    fd = _ag_linear(communicator.world_size, 16, bias=False)
    options = OverlapOptions(overlap=True, num_chunks=communicator.world_size + 1)
    MultiDeviceExecutor(fd, communicator, options)


@pytest.mark.parametrize("world", [2, 4])
def test_a_chunk_count_that_is_not_a_multiple_of_the_team_fails_on_every_rank(rank_pools, world):
    pool = rank_pools(world)
    with pytest.raises(RankError) as failure:
        pool.run(chunks_not_a_multiple, timeout=60)
    assert sorted(failure.value.failures) == list(range(world))
    for rank, message in failure.value.messages().items():
        assert failure.value.failures[rank][0] == ShardingError.__name__
        assert "must be a multiple of" in message, message


def copy_engine_on_cpu(communicator) -> None:
    fd = _ag_linear(communicator.world_size, 16, bias=False)
    MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=True, transport="copy_engine"))


def test_the_copy_engine_transport_is_refused_on_cpu_before_any_communication(rank_pools):
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(copy_engine_on_cpu, timeout=60)
    assert all("needs CUDA" in m for m in failure.value.messages().values())


# ---------------------------------------------------------------------------
# A sequence-parallel SwiGLU block: one gathered tensor feeds two matmuls


def swiglu_block(world: int, tokens: int) -> FusionDefinition:
    """RMSNorm, all-gather, gate and up (column-parallel), silu(gate) * up, down
    (row-parallel), reduce-scatter, residual."""
    mesh = DeviceMesh(world)
    hidden, ffn = 12, 8 * world
    with FusionDefinition("swiglu_block") as fd:
        x = fd.define_tensor([tokens, hidden])
        gamma = fd.define_tensor([hidden])
        w_gate = fd.define_tensor([ffn, hidden])
        w_up = fd.define_tensor([ffn, hidden])
        w_down = fd.define_tensor([hidden, ffn])
        mean_square = fd.ops.mean(x * x, dims=[1], keepdim=True)
        normed = x * fd.ops.rsqrt(mean_square + 1e-6) * fd.ops.broadcast(gamma, [True, False])
        gate = fd.ops.linear(normed, w_gate)
        up = fd.ops.linear(normed, w_up)
        out = fd.ops.linear(fd.ops.silu(gate) * up, w_down) + x
        fd.add_output(out)
    shard(x, mesh, [Shard(0)])
    shard(w_gate, mesh, [Shard(0)])
    shard(w_up, mesh, [Shard(0)])
    shard(w_down, mesh, [Shard(1)])
    shard(out, mesh, [Shard(0)])
    return fd


def _attention_block(world: int, tokens: int) -> FusionDefinition:
    """RMSNorm, all-gather, Q, K and V (column-parallel), Q's output projection
    (row-parallel: right after the gathered rows' matmuls), reduce-scatter, residual;
    K and V are outputs too."""
    mesh = DeviceMesh(world)
    hidden, heads, kv = 12, 16 * world, 8 * world  # weights larger than the activations
    with FusionDefinition("attention_block") as fd:
        x = fd.define_tensor([tokens, hidden])
        gamma = fd.define_tensor([hidden])
        w_q, w_k, w_v = (fd.define_tensor([n, hidden]) for n in (heads, kv, kv))
        w_o = fd.define_tensor([hidden, heads])
        mean_square = fd.ops.mean(x * x, dims=[1], keepdim=True)
        normed = x * fd.ops.rsqrt(mean_square + 1e-6) * fd.ops.broadcast(gamma, [True, False])
        q, k, v = (fd.ops.linear(normed, w) for w in (w_q, w_k, w_v))
        out = fd.ops.linear(q, w_o) + x
        for output in (out, k, v):
            fd.add_output(output)
    for tensor, placement in ((x, Shard(0)), (w_q, Shard(0)), (w_k, Shard(0)),
                              (w_v, Shard(0)), (w_o, Shard(1)), (out, Shard(0)),
                              (k, Shard(1)), (v, Shard(1))):  # fmt: skip
        shard(tensor, mesh, [placement])
    return fd


def _loops(program) -> list[list[str]]:
    """Each work loop of ``program``: its communications and kernels, by kind."""
    return [
        [
            inst.communication.kind.name if isinstance(inst, Communicate) else inst.backend
            for inst in loop.body
            if isinstance(inst, (Communicate, LaunchKernel))
        ]
        for loop in program.instructions
        if isinstance(loop, ForLoop) and any(isinstance(i, LaunchKernel) for i in loop.body)
    ]


def pipelined_block(
    communicator, block: str, tokens: int, chunks: int, transport: str, kernels: str
):
    world = communicator.world_size
    fd = (swiglu_block if block == "swiglu" else _attention_block)(world, tokens)
    options = OverlapOptions(overlap=True, num_chunks=chunks, transport=transport)
    executor = MultiDeviceExecutor(fd, communicator, options, kernels=kernels)
    generator = torch.Generator().manual_seed(23)
    full = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    full[2:] = [w / w.shape[1] ** 0.5 for w in full[2:]]
    expected = executor.shard_outputs(fd.execute(full))
    for _ in range(2):
        outputs = executor.run(executor.shard_inputs(full))
        for position, (out, wanted) in enumerate(zip(outputs, expected, strict=True)):
            assert_close(out, wanted, reduction_extent=8 * world,
                         message=f"rank {communicator.rank} output {position}")  # fmt: skip
    gathered, scattered = executor.overlap
    readers = [gathered.contraction, *(expr for expr, _ in gathered.chunked)]
    return (
        [expr.op_name for expr in readers],
        gathered.shape[2],
        scattered.chunked,
        _loops(executor.program),
        str(gathered).splitlines()[0],
    )


# (tokens, chunks per rank, transport): even and uneven rows, one and two chunks a rank
SWIGLU_PIPELINES = [(16, 1, "collective"), (13, 2, "collective"), (13, 1, "ring")]


@pytest.mark.parametrize("kernels", ["reference", "generated"])
@pytest.mark.parametrize(("tokens", "per_rank", "transport"), SWIGLU_PIPELINES)
@pytest.mark.parametrize("world", [2, 4])
def test_the_gate_and_up_projections_share_each_gathered_chunk(
    rank_pools, world, tokens, per_rank, transport, kernels
):
    """Both matmuls of the gathered rows run in the all-gather's loop (each chunk feeds
    gate and up before the next is waited for), planned as one matmul of both widths;
    the down projection reduce-scatters in its own loop. Every rank's output is the
    reference's."""
    chunks = per_rank * world
    results = rank_pools(world).run(pipelined_block, "swiglu", tokens, chunks, transport,
                                    kernels)  # fmt: skip
    for readers, width, scattered, loops, line in results:
        assert readers == ["linear", "linear"]
        assert width == 2 * 8  # N: gate's and up's columns on a rank, 8 each
        assert scattered == ()
        assert loops == [
            ["Allgather", "torch", "torch"] if transport == "ring" else ["torch", "torch"],
            ["torch", "ReduceScatter"],
        ], loops
        assert "linear T" in line and " + linear T" in line, line


@pytest.mark.parametrize("kernels", ["reference", "generated"])
@pytest.mark.parametrize(("per_rank", "transport"), [(1, "collective"), (2, "collective"),
                                                     (1, "ring")])  # fmt: skip
@pytest.mark.parametrize("world", [2, 4])
def test_q_k_v_share_each_gathered_chunk_and_the_output_projection_keeps_its_own_loop(
    rank_pools, world, per_rank, transport, kernels
):
    """Q, K and V in the all-gather's loop; Q's output projection, right after them in
    the program, still pipelines its reduce-scatter in a loop of its own (the two
    patterns take their chunks in different orders: the ring's gather and reduce
    orders differ, and sharing a loop deadlocked)."""
    chunks = per_rank * world
    results = rank_pools(world).run(pipelined_block, "attention", 13, chunks, transport,
                                    kernels, timeout=120)  # fmt: skip
    for readers, width, _, loops, _ in results:
        assert readers == ["linear"] * 3 and width == 16 + 8 + 8
        assert loops == [
            ["Allgather"] * (transport == "ring") + ["torch"] * 3,
            ["torch", "ReduceScatter"],
        ], loops


def told_outputs(communicator, pattern: str, transport: str) -> None:
    """A pipelined program with an output listener (``overlap.runtime.listeners``): the
    output written chunk by chunk is told once, after the loop that writes it (its value
    then is what the run returns), and ``finish`` last, at every run."""
    world = communicator.world_size
    fd = _ag_linear(world, 16, bias=False) if pattern == "ag" else _linear_rs(world, 16)
    told: list[tuple] = []

    class Listener:
        def ready(self, position, value, timeline) -> None:
            told.append(("ready", position, value.clone()))

        def finish(self, timeline) -> None:
            told.append(("finish",))

    options = OverlapOptions(overlap=True, num_chunks=2 * world, transport=transport)
    executor = MultiDeviceExecutor(fd, communicator, options, output_listener=Listener())
    assert executor.overlap.decisions[0].overlapped
    generator = torch.Generator().manual_seed(5)  # the same inputs on every rank
    full = [torch.randn(list(t.shape), generator=generator) for t in fd.fusion.inputs]
    for _ in range(2):
        told.clear()
        (out,) = executor.run(executor.shard_inputs(full))
        assert [entry[:2] for entry in told] == [("ready", 0), ("finish",)]
        assert torch.equal(told[0][2], out), f"rank {communicator.rank}: told before it was made"


@pytest.mark.parametrize(("pattern", "transport"), [("ag", "collective"), ("rs", "ring")])
def test_an_output_listener_hears_of_a_pipelined_output_once_it_is_made(
    rank_pools, pattern, transport
):
    rank_pools(2).run(told_outputs, pattern, transport)
