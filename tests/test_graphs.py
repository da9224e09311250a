"""Graph replay as the default run path (``overlap.runtime.graphs``), its logic on CPU.

CUDA graphs need a GPU; here a stand-in graph replays the rank program on the inputs it
was captured with, writing into the outputs it was captured with, which is what a CUDA
graph does with addresses. What is checked is what the run path decides around it:
a key's first call runs lean, its second captures, later ones replay; inputs that move
are copied into the graph's buffers and never make a rank capture again; inputs read
in place that moved run lean; outputs of a replay are marked when the next overwrites
them; keys are extents, so a replay runs no host collective (a capture is agreed on
once, and a capture failing on one rank raises on every rank), on 2 and 4 ranks, every
rank's outputs checked. On GPUs ``benchmarks/check_gpu.py`` checks the same with
real graphs, and that a read of an overwritten output raises.
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_input_checks import _linear as _columns_split_linear
from test_pipelined import _ag_linear
from torch.multiprocessing.reductions import StorageWeakRef

from fusion import FusionDefinition
from overlap import Communicator, MultiDeviceExecutor, OverlapOptions
from overlap.runtime import graphs
from overlap.runtime.graphs import GraphReplays


class _Replayed:
    """A stand-in for a CUDA graph: replays ``program`` on the captured inputs, writing
    into the captured outputs."""

    def __init__(self, program, staged: list, outputs: list) -> None:
        self.program, self.staged, self.outputs = program, staged, outputs

    def replay(self) -> None:
        for mine, new in zip(self.outputs, self.program.run(self.staged, None), strict=True):
            if mine is not None and mine is not new:
                mine.copy_(new)


def capture_on_cpu(program, staged: list, pool) -> tuple:
    outputs = program.run(staged, None)
    return _Replayed(program, staged, outputs), outputs


def _linear(rows: int = 4) -> FusionDefinition:
    with FusionDefinition() as fd:
        x = fd.define_tensor(["rows", 8])
        w = fd.define_tensor([6, 8])
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)))
    return fd


def _replaying(executor: MultiDeviceExecutor, most: int = 8) -> MultiDeviceExecutor:
    executor.replaying = True
    executor.graphs = GraphReplays(capture_on_cpu, most)
    return executor


def _expected(fd: FusionDefinition, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return fd.execute([x, w])[0]


def test_a_key_runs_lean_first_then_captures_then_replays_copying_inputs_that_move():
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd))
    w = torch.randn(6, 8)
    seen = []
    for call in range(5):
        x = torch.randn(4, 8) + call  # a new tensor every call
        (y,) = executor.run([x, w])
        torch.testing.assert_close(y, _expected(fd, x, w))
        seen.append((executor.graphs.captures, executor.graphs.replays))
        del y
    assert seen == [(0, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert executor.graphs.fallbacks == 0
    (graph,) = executor.graphs._graphs.values()
    assert graph.copied == [0]  # x copied into the graph's buffer, w read in place


def test_a_parameter_is_read_in_place_and_one_that_moved_runs_lean_without_a_capture():
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd))
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(6, 8))
    for _ in range(3):
        (y,) = executor.run([x, w])
        torch.testing.assert_close(y, _expected(fd, x, w.detach()))
    # the same tensors at the first two calls: read in place, never copied
    (graph,) = executor.graphs._graphs.values()
    assert graph.copied == [] and executor.graphs.fallbacks == 0
    with torch.no_grad():
        w.mul_(2)  # updated in place, as optimizers do: the graph reads the new values
    (y,) = executor.run([x, w])
    torch.testing.assert_close(y, _expected(fd, x, w.detach()))
    moved = torch.nn.Parameter(torch.randn(6, 8))  # replaced: the graph cannot read it
    (y,) = executor.run([x, moved])
    torch.testing.assert_close(y, _expected(fd, x, moved.detach()))
    assert executor.graphs.fallbacks == 1 and executor.graphs.captures == 1


def test_a_new_tensor_in_the_memory_of_the_last_is_copied_and_a_view_of_the_same_is_not():
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd))
    w = torch.randn(6, 8)
    memory = torch.randn(4, 8)
    for _ in range(4):
        x = memory.clone()  # a new tensor: copied, even where it lands where the last did
        (y,) = executor.run([x, w[:, :]])  # a view of the same weight, in place
        torch.testing.assert_close(y, _expected(fd, x, w))
        del x, y
    (graph,) = executor.graphs._graphs.values()
    assert graph.copied == [0] and executor.graphs.fallbacks == 0


def test_outputs_of_a_replay_are_marked_overwritten_by_the_next_and_kept_ones_are_not(
    monkeypatch,
):
    """Outputs handed out as on CUDA builds (new tensors over the graph's memory, marked
    unreadable by the next replay: the marks recorded here). The stand-in's replay
    writes into the captured outputs, so a version bump would not tell a mark apart."""
    marked = []
    monkeypatch.setattr(graphs, "_set_unreadable", lambda tensor, message: marked.append(tensor))
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd))
    x, w = torch.randn(4, 8), torch.randn(6, 8)  # x a new tensor at every call: copied
    executor.run([x.clone(), w])
    (first,) = executor.run([x.clone(), w])  # captured and replayed: the graph's memory
    assert marked == [] and executor.graphs.replays == 1
    (kept,) = executor.run([x + 1, w], keep_outputs=True)
    assert [t is first for t in marked] == [True]  # overwritten by this replay
    (y,) = executor.run([x.clone(), w])
    assert not any(t is kept for t in marked) and len(marked) == 1
    torch.testing.assert_close(kept, _expected(fd, x + 1, w))
    torch.testing.assert_close(y, _expected(fd, x, w))
    executor.run([x + 2, w])
    assert executor.graphs.replays == 4 and executor.graphs.fallbacks == 0
    assert marked[-1] is y


def failing_capture(communicator: Communicator) -> str:
    """A capture that fails on the last rank alone: every rank raises at that call. (The
    others' capture runs nothing, as a CUDA graph's capture launches nothing: the CPU
    stand-in would run the program's collectives, which the failing rank never posts.)"""
    executor = _replaying(MultiDeviceExecutor(_sharded(communicator.world_size), communicator))

    def refuse(program, staged, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    def record(program, staged, pool):
        return None, [torch.empty(4, 4)]  # y's piece, as a capture hands it out unrun

    failing = communicator.rank == communicator.world_size - 1
    executor.graphs._capture = refuse if failing else record
    local = [torch.randn(4, 6), torch.randn(4, 6)]
    executor.run(local)
    try:
        executor.run(local)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ran"


def test_a_capture_that_fails_on_one_rank_raises_on_every_rank(rank_pools):
    said = rank_pools(2).run(failing_capture)
    assert said[1].startswith("CaptureError: capturing this rank's program in a CUDA graph "
                              "failed (RuntimeError: operation not permitted"), said  # fmt: skip
    assert "cuda_graph=False" in said[1], said
    assert said[0].startswith("PeerError: capturing the program in a CUDA graph failed on "
                              "rank 1"), said  # fmt: skip


def test_graphs_are_kept_by_extents_least_recently_used_first_within_the_bound():
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd), most=2)
    w = torch.randn(6, 8)
    for rows in (4, 4, 5, 5, 4, 6, 6, 4):
        x = torch.randn(rows, 8)
        (y,) = executor.run([x, w])
        torch.testing.assert_close(y, _expected(fd, x, w))
    graphs = executor.graphs
    # 4 and 5 captured; 4 used again, so 6's capture drops 5; 4 replays from its graph
    assert graphs.captures == 3
    assert [key[0] for key in graphs.memory()] == [(("rows", 6),), (("rows", 4),)]


def test_a_call_that_runs_lean_keeps_its_graph_recently_used_as_a_replay_does():
    """Which graph the bound drops must be every rank's alike: a rank whose weight moved
    runs a call lean while its peers replay, and if that call did not count as a use it
    would drop another graph than they do, then capture (and agree on) that key again
    while they replay it: a host exchange on one rank alone."""
    fd = _linear()
    w = torch.randn(6, 8)

    def kept_after(weight_at_the_fourth_call: torch.Tensor) -> list:
        executor = _replaying(MultiDeviceExecutor(fd), most=2)
        for call, rows in enumerate((4, 4, 5, 5, 4, 6, 6)):
            x = torch.randn(rows, 8)
            weight = weight_at_the_fourth_call if call == 4 else w
            (y,) = executor.run([x, weight])
            torch.testing.assert_close(y, _expected(fd, x, weight))
        return [key[0] for key in executor.graphs.memory()]

    replayed, ran_lean = kept_after(w), kept_after(w.clone())
    assert replayed == [(("rows", 4),), (("rows", 6),)]
    assert ran_lean == replayed


def test_the_last_outputs_are_marked_when_the_executor_and_its_graphs_are_dropped():
    """A replay's outputs do not own the graph's memory (CUDA): dropping the executor
    frees it, so reading the last outputs must raise, not read what comes there next."""
    fd = _linear()
    executor = _replaying(MultiDeviceExecutor(fd))
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    executor.run([x, w])
    (last,) = executor.run([x, w])  # captured and replayed: the graph's memory
    version = last._version
    del executor
    gc.collect()
    # on CPU the version is bumped (see the test above); CUDA builds raise on any read
    assert last._version > version


def test_an_output_that_views_an_input_read_in_place_is_handed_out_as_its_view(monkeypatch):
    """An output that is a view of an input read in place (a reshaped weight) lies in the
    input's memory, not the graph's: as on the lean path it is a view of the input,
    keeping it alive and readable after the next replay. Here outputs are handed out
    as on CUDA builds (over the graph's memory, marked unreadable by the next replay)."""
    marked = []
    monkeypatch.setattr(graphs, "_set_unreadable", lambda tensor, message: marked.append(tensor))
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8])
        w = fd.define_tensor([4, 8])
        fd.add_output(fd.ops.relu(x))
        fd.add_output(fd.ops.reshape(w, [32]))
    executor = _replaying(MultiDeviceExecutor(fd))
    x, w = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(3):
        relu, flat = executor.run([x, w])
    assert executor.graphs.replays == 2
    storage = StorageWeakRef(w.untyped_storage())
    expected = w.reshape(32).clone()
    del w
    gc.collect()
    assert not storage.expired()  # the output holds the input's memory, as a view does
    executor.run([x, flat.view(4, 8)])  # the next replay (the weight's view is in place)
    assert not any(t is flat for t in marked) and any(t is relu for t in marked)
    torch.testing.assert_close(flat, expected)


# ---------------------------------------------------------------------------
# On several ranks: no host collective on a replay


def _sharded(world: int) -> FusionDefinition:
    """A row-parallel linear whose partial sums are all-reduced (every replay runs a
    collective): x [rows, 6 * world] and w [4, 6 * world], their columns split."""
    return _columns_split_linear(world, "columns")


def replays_with_moving_inputs(communicator: Communicator, rows: list[int]) -> dict:
    world = communicator.world_size
    fd = _sharded(world)
    executor = _replaying(MultiDeviceExecutor(fd, communicator))
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6 * world, generator=generator)
    exchanges, right = [], True
    for count in rows:
        x = torch.randn(count, 6 * world, generator=generator)  # moves every call
        before = communicator.host_exchanges
        local = executor.shard_inputs([x, w], check=False)
        (y,) = executor.run(local)
        right &= torch.allclose(y, fd.execute([x, w])[0], atol=1e-5)
        exchanges.append(communicator.host_exchanges - before)
    graphs = executor.graphs
    return {"exchanges": exchanges, "right": right, "captures": graphs.captures,
            "replays": graphs.replays, "fallbacks": graphs.fallbacks}  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
def test_an_unchanged_call_exchanges_nothing_and_a_moved_input_is_copied(rank_pools, world):
    results = rank_pools(world).run(replays_with_moving_inputs, [4, 4, 4, 4, 5, 5, 5])
    for rank, result in enumerate(results):
        assert result == {
            # the first call checks the inputs and agrees the build (two exchanges);
            # new extents are checked once more; a capture is agreed on (one); every
            # other call asks no one
            "exchanges": [2, 1, 0, 0, 2, 1, 0],
            "right": True,
            "captures": 2,  # one per extents, at their second call; never again
            "replays": 5,
            "fallbacks": 0,
        }, (world, rank)


def replays_on_every_rank(communicator: Communicator, pattern: str = "allreduce") -> dict:
    """The default run path on several ranks (real CUDA graphs on GPUs, the stand-in on
    CPUs; ``benchmarks/check_gpu.py`` runs it on GPUs): new activations every call (copied,
    never captured again, no host collective but the capture's agreement), an output
    overwritten by the next replay (reading it raises where torch can say so: CUDA builds),
    and a weight moved on the last rank alone (that rank runs the call lean while its peers
    replay, every rank's output right). ``pattern``: ``"allreduce"`` (a row-parallel linear,
    its partial sums all-reduced) or ``"copy_engine"`` (an all-gather pipelined into a
    linear over the copy engines, CUDA only: symmetric memory, two graphs for the buffers'
    two halves)."""
    world, rank = communicator.world_size, communicator.rank
    device = communicator.device
    if pattern == "allreduce":
        fd, options = _sharded(world), None
        x_shape, w_shape = (4, 6 * world), (4, 6 * world)
    else:
        fd = _ag_linear(world, 4 * world, bias=False)
        options = OverlapOptions(overlap=True, num_chunks=world, transport="copy_engine")
        x_shape, w_shape = (4 * world, 12), (4 * world, 12)
    executor = MultiDeviceExecutor(fd, communicator, options)
    if device.type != "cuda":
        _replaying(executor)
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(w_shape, generator=generator)
    x = torch.randn(x_shape, generator=generator)
    x_local, w_local = (t.to(device) for t in executor.shard_inputs([x, w], check=False))
    exchanges, right = [], True

    def check(y, x, w) -> bool:
        expected = executor.shard_outputs(fd.execute([x, w]))[0]
        return torch.allclose(y.cpu(), expected, atol=1e-4, rtol=1e-4)

    for _ in range(5):
        x = torch.randn(x_shape, generator=generator)
        x_local = executor.shard_inputs([x, w], check=False)[0].to(device)
        before = communicator.host_exchanges
        (y,) = executor.run([x_local, w_local])
        right &= check(y, x, w)
        exchanges.append(communicator.host_exchanges - before)
    (first,) = executor.run([x_local, w_local])
    executor.run([x_local, w_local])
    try:
        first.sum().item()
        read_after = "read"
    except RuntimeError as error:
        read_after = "raised" if "overwritten by a later replay" in str(error) else str(error)
    moved = w_local.clone() if rank == world - 1 else w_local
    for weight in (moved, w_local, moved):  # both halves of the copy-engine buffers
        (y,) = executor.run([x_local, weight])
        right &= check(y, x, w)
    graphs = executor.graphs
    return {"exchanges": exchanges, "right": right, "captures": graphs.captures,
            "fallbacks": graphs.fallbacks, "read_after": read_after}  # fmt: skip


def check_replays_on_every_rank(communicator: Communicator, pattern: str = "allreduce") -> None:
    """``replays_on_every_rank`` with every figure asserted (for ``check_gpu.py``): the
    first call checks the inputs with every rank (and the copy engine's buffers are made
    then), each capture is agreed on (one exchange), no other call exchanges anything;
    one graph per half of the buffers (captured at the third and fourth calls)."""
    result = replays_on_every_rank(communicator, pattern)
    last = communicator.rank == communicator.world_size - 1
    captured_at = [1, 0, 0, 0] if pattern == "allreduce" else [0, 1, 1, 0]
    assert result["exchanges"][0] > 0 and result["exchanges"][1:] == captured_at, result
    assert result == {
        "exchanges": result["exchanges"],
        "right": True,
        "captures": 1 if pattern == "allreduce" else 2,
        "fallbacks": 2 if last else 0,
        "read_after": "raised" if communicator.device.type == "cuda" else "read",
    }, result


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_replays_and_a_rank_whose_weight_moved_runs_lean(rank_pools, world):
    rank_pools(world).run(check_replays_on_every_rank)
