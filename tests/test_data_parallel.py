"""``parallelize(..., data_parallel=...)``: a 2-D mesh of data-parallel replicas of a
tensor-parallel team, on real gloo ranks. Each replica trains on its own batch; every
rank's gradient pieces equal the one-device gradient of the whole batch (the mean over
the replicas' batches), reduced bucket by bucket during the backward; AdamW steps keep
the replicas identical and equal to one device's. And the teams of ``Communicator.split``
run every kind of communication at once, each over its own ranks."""

from __future__ import annotations

import math

import pytest
import torch
from test_capture import SwiGLU
from test_multidevice import one_rank_and_a_mesh, pipeline_stages
from test_pipelined import pipelined

from fusion.testing import assert_close
from overlap import Timeline, parallelize
from overlap.diag.timeline import DATA_PARALLEL_LANE

PLAN = {"gate": "colwise", "up": "colwise", "down": "rowwise"}
TOKENS, HIDDEN, STEPS = 6, 16, 2


def replicas_train(
    communicator, data_parallel: int, steps: int = STEPS
) -> list[list[torch.Tensor]]:
    """``steps`` AdamW steps of a SwiGLU block over ``data_parallel`` replicas, each
    replica on its own batch, checked against the module on one device under torch
    autograd (the mean of the replicas' gradients); returns this rank's parameter pieces
    after them. The first two steps record timelines; on CUDA the third captures CUDA
    graphs (the all-reduces among them) and the later ones replay them (``check_gpu``)."""
    world, device = communicator.world_size, communicator.device
    tp = world // data_parallel
    torch.manual_seed(0)  # the same module and batches on every rank
    module = SwiGLU(HIDDEN, 8 * tp).to(device)
    batches = torch.randn(steps, data_parallel, TOKENS, HIDDEN).to(device)
    seeds = torch.randn(steps, data_parallel, TOKENS, HIDDEN).to(device)
    # a bucket holds one weight piece at most (16 x 8 floats on every rank)
    block = parallelize(module, [batches[0, 0]], communicator, PLAN, inputs=["sequence"],
                        outputs=["sequence"], data_parallel=data_parallel,
                        bucket_mb=HIDDEN * 8 * 4 / 2**20)  # fmt: skip
    team = communicator.split(tp)
    assert block.model.communicator is team and team.world_size == tp
    replica = team.replica
    assert replica == communicator.rank // tp
    reducer = block.gradient_reducer
    assert len(reducer.buckets) == 4, [len(b.parameters) for b in reducer.buckets]
    names = [name for name, _ in module.named_parameters()]
    ours = torch.optim.AdamW(block.parameters(), lr=0.05)
    theirs = torch.optim.AdamW(module.parameters(), lr=0.05)
    extent = TOKENS * data_parallel * 8 * tp  # the terms of a weight's gradient
    for step in range(steps):
        # one device: the mean of the replicas' losses
        outputs = [module(batches[step, r]) for r in range(data_parallel)]
        loss = sum((y * s).sum() for y, s in zip(outputs, seeds[step], strict=True))
        own = torch.autograd.grad(outputs[replica], list(module.parameters()),
                                  seeds[step, replica], retain_graph=True)  # fmt: skip
        theirs.zero_grad()
        (loss / data_parallel).backward()
        expected = block.full_state({n: p.grad for n, p in module.named_parameters()})
        # this replica: its own batch's pieces
        (x_piece,) = block.input_pieces(batches[step, replica])
        y_piece = block(x_piece)
        (wanted,) = block.output_pieces(outputs[replica].detach())
        assert_close(y_piece, wanted, reduction_extent=HIDDEN, partial_sums=tp)
        (seed_piece,) = block.output_pieces(seeds[step, replica])
        ours.zero_grad()
        # the first step on the reducer's timeline; the second on the backward program's,
        # which records its kernels beside the all-reduces; the later ones on none
        timeline = Timeline(device) if step < 2 else None
        reducer.timeline = timeline if step == 0 else None
        block.model.timeline = timeline if step == 1 else None
        y_piece.backward(seed_piece)
        if timeline is not None:
            # every bucket all-reduced once per backward, each a span of the timeline
            assert reducer.posted == len(reducer.buckets) * (step + 1)
            spans = timeline.spans()
            reduces = [s for s in spans if s.lane == DATA_PARALLEL_LANE]
            buckets = [f"bucket {i}" for i in range(len(reducer.buckets))]
            assert [s.name for s in reduces] == buckets
        if step == 1:
            # posted by the backward program as it went, not when it returned: the first
            # bucket (the last layer's gradient) before the backward's last kernel started
            kernels = [s for s in spans if s.lane.endswith("compute")]
            assert kernels and reduces[0].start_ms < max(s.start_ms for s in kernels), spans
            (backward,) = block.model.executors[1:]
            meter = backward.explain_overlap(timeline)
            assert f"data-parallel reduce: {len(reducer.buckets)} all-reduces" in meter, meter
        for name, mine in zip(names, own, strict=True):
            grad = block.pieces[name.replace(".", "__")].grad
            assert grad.device_mesh.mesh_dim_names == ("dp", "tp")
            assert type(grad.placements[0]).__name__ == "Replicate"
            where = f"rank {communicator.rank}, {name}"
            assert_close(grad.to_local(), expected[name], reduction_extent=extent,
                         partial_sums=world, message=where)  # fmt: skip
            # the batches differ: one replica's own gradient is not the mean
            assert not torch.allclose(grad.full_tensor(), mine, atol=1e-3), name
        # torch's clipping reads the 2-D DTensors: the whole gradient's norm, once
        norm = torch.nn.utils.clip_grad_norm_(block.parameters(), math.inf)
        whole = torch.nn.utils.clip_grad_norm_(module.parameters(), math.inf)
        assert_close(norm.full_tensor(), whole, reduction_extent=extent * len(names))
        ours.step()
        theirs.step()
    pieces = block.full_state(module)
    for name in names:
        assert_close(block.pieces[name.replace(".", "__")].to_local(), pieces[name],
                     reduction_extent=extent, message=f"{name} after AdamW")  # fmt: skip
    return [block.pieces[name.replace(".", "__")].to_local().detach().cpu() for name in names]


@pytest.mark.parametrize(("world", "data_parallel"), [(4, 2), (2, 2)])
def test_replicas_on_their_own_batches_train_as_one_device_on_the_whole_batch(
    rank_pools, world, data_parallel
):
    pieces = rank_pools(world).run(replicas_train, data_parallel, timeout=180)
    tp = world // data_parallel
    for rank in range(tp, world):  # each replica's pieces are the first replica's, bitwise
        for ours, first in zip(pieces[rank], pieces[rank % tp], strict=True):
            assert torch.equal(ours, first), f"rank {rank} drifted from rank {rank % tp}"


def teams_communicate(communicator) -> list[object]:
    """Two teams of two ranks (``split(2)``) running, both at once, programs that send to
    a peer, move between one rank and the team, and pipeline an all-gather around a ring
    and a reduce-scatter by batched sends: each checked against the reference, so a peer
    or root named by its team rank instead of its global one fails (or hangs)."""
    team = communicator.split(2)
    assert (team.rank, team.replica) == divmod(communicator.rank, 2)[::-1]
    assert communicator.split(2) is team  # kept: its groups are made once
    kinds = [pipeline_stages(team, 14)]
    kinds += [one_rank_and_a_mesh(team, 20, kind)
              for kind in ("Broadcast", "Scatter", "Gather", "Reduce")]  # fmt: skip
    kinds += [pipelined(team, "ag", 13, 2, "ring", 21)[2], pipelined(team, "rs", 16, 4,
              "collective", 21)[2], pipelined(team, "ag", 16, 2, "collective", 21)[2]]  # fmt: skip
    return kinds


def test_the_teams_of_a_split_communicator_each_communicate_over_their_own_ranks(rank_pools):
    expected = [["SendRecv"], ["Broadcast"], ["Scatter"], ["Gather"], ["Reduce"],
                "ring", "collective", "collective"]  # fmt: skip
    assert rank_pools(4).run(teams_communicate, timeout=180) == [expected] * 4


class Reversed(torch.nn.Module):
    """Three linears registered in the reverse of the order the forward uses them: the
    backward makes the first registered one's gradient last."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.a = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def buckets_in_the_backwards_order(communicator) -> list[str]:
    """Two replicas of one rank each, a bucket a parameter: the buckets are cut in the
    order the backward program makes the gradients (``c`` first), and each posted before
    the backward's last kernel starts. Returns the parameters by bucket."""
    torch.manual_seed(0)
    module = Reversed()
    x = torch.randn(TOKENS, HIDDEN)
    block = parallelize(module, [x], communicator, {}, data_parallel=2,
                        bucket_mb=HIDDEN * HIDDEN * 4 / 2**20)  # fmt: skip
    block.model.timeline = timeline = Timeline(communicator.device)
    block(x + communicator.rank).square().sum().backward()
    reducer = block.gradient_reducer
    names = {id(p): n for n, p in block.pieces.items()}
    spans = timeline.spans()
    last_kernel = max(s.start_ms for s in spans if s.lane.endswith("compute"))
    posts = [s.start_ms for s in spans if s.lane == DATA_PARALLEL_LANE]
    assert len(posts) == len(reducer.buckets) == 6 and max(posts[:-1]) < last_kernel, spans
    return [names[id(p)] for bucket in reducer.buckets for p in bucket.parameters]


def test_buckets_follow_the_order_the_backward_makes_gradients_not_registration(rank_pools):
    first, second = rank_pools(2).run(buckets_in_the_backwards_order)
    assert first == second
    # weight and bias of c, then b, then a (registered c, b, a: a's gradient comes last)
    assert [name[0] for name in first] == ["c", "c", "b", "b", "a", "a"], first
