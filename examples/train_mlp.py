"""Training a sequence-parallel MLP with AdamW on every rank, beside the same model on one
device.

    overlap run --launcher local --nproc 2 examples/train_mlp.py [--steps 20]
    overlap run --launcher ray --nproc 2 examples/train_mlp.py
    overlap run --launcher torchrun --nproc 2 examples/train_mlp.py   # on 2 GPUs: NCCL
    python examples/train_mlp.py                                      # alone: one rank
    overlap dump examples/train_mlp.py                                # its forward program

The model: tokens split over the ranks (sequence parallel), gathered for a
column-parallel linear, gelu, a row-parallel linear whose partial sums are
reduce-scattered back to the tokens' pieces. Each rank holds its pieces of the two
weights as ``torch.nn.Parameter``s and an AdamW over them; the forward and the backward
run as overlapped programs on every rank (``overlap.train.trainable.TrainableFusion``). Every
rank also trains the same model whole, on its own device, with plain PyTorch from the
same initial weights and data; rank 0 prints both losses per step, and the job fails
unless they agree within ``TOLERANCE`` at every step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusion import FusionDefinition  # noqa: E402
from overlap import TrainableFusion  # noqa: E402
from sharding import DeviceMesh, Shard, shard  # noqa: E402

TOKENS, HIDDEN, FFN = 64, 32, 64
TOLERANCE = 1e-4  # relative, per step's loss (float32; the ranks sum in another order)


def build(world: int) -> FusionDefinition:
    mesh = DeviceMesh(world)
    with FusionDefinition("sp_mlp") as fd:
        x = fd.define_tensor([TOKENS, HIDDEN])
        w1 = fd.define_tensor([FFN, HIDDEN])
        w2 = fd.define_tensor([HIDDEN, FFN])
        y = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh"), w2)
        fd.add_output(y)
    shard(x, mesh, [Shard(0)])  # tokens split: gathered for the first linear
    shard(w1, mesh, [Shard(0)])  # column-parallel: each rank its part of the ffn
    shard(w2, mesh, [Shard(1)])  # row-parallel: partial sums ...
    shard(y, mesh, [Shard(0)])  # ... reduce-scattered back to the tokens' pieces
    return fd


def fusion(world_size: int) -> FusionDefinition:
    """The forward fusion, for ``overlap dump``."""
    return build(world_size)


def batches(steps: int, device: torch.device):
    """The same (input, target) batches on every rank."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        target = torch.tanh(x.flip(1)) * 0.5
        yield x.to(device), target.to(device)


def main(communicator) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(sys.argv[1:])
    device, world = communicator.device, communicator.world_size
    fd = build(world)
    model = TrainableFusion(fd, communicator)
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(FFN, HIDDEN, generator=generator) / HIDDEN**0.5
    w2 = torch.randn(HIDDEN, FFN, generator=generator) / FFN**0.5
    # ours: this rank's pieces of the weights; one device: the whole weights
    _, w1_piece, w2_piece = model.shard_inputs([torch.zeros(TOKENS, HIDDEN), w1, w2])
    # copies: a piece is a view of the whole tensor, which the optimizer would change
    pieces = [torch.nn.Parameter(w.to(device, copy=True)) for w in (w1_piece, w2_piece)]
    whole = [torch.nn.Parameter(w.clone().to(device)) for w in (w1, w2)]
    ours_optimizer = torch.optim.AdamW(pieces, lr=1e-2, weight_decay=0.01)
    whole_optimizer = torch.optim.AdamW(whole, lr=1e-2, weight_decay=0.01)
    worst = 0.0
    for step, (x, target) in enumerate(batches(args.steps, device)):
        x_piece, _, _ = model.shard_inputs([x, w1, w2])
        (target_piece,) = model.shard_outputs([target])
        (y_piece,) = model(x_piece, *pieces)
        # the mean squared error over the whole batch: each rank sums its piece's
        loss_piece = (y_piece - target_piece).square().sum() / target.numel()
        ours_optimizer.zero_grad()
        loss_piece.backward()
        ours_optimizer.step()
        loss = loss_piece.detach().clone()
        dist.all_reduce(loss)
        hidden = torch.nn.functional.gelu(x @ whole[0].t(), approximate="tanh")
        whole_loss = (hidden @ whole[1].t() - target).square().mean()
        whole_optimizer.zero_grad()
        whole_loss.backward()
        whole_optimizer.step()
        gap = abs(loss.item() - whole_loss.item()) / abs(whole_loss.item())
        worst = max(worst, gap)
        if communicator.rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}  one device {whole_loss.item():.6f}  "
                  f"relative gap {gap:.1e}", flush=True)  # fmt: skip
    if worst > TOLERANCE:
        raise AssertionError(f"rank {communicator.rank}: the losses differ by up to {worst:.1e}")
    if communicator.rank == 0:
        print(f"train_mlp: {args.steps} steps on {world} rank{'s' if world > 1 else ''} match "
              f"one device "
              f"(largest relative gap {worst:.1e})", flush=True)  # fmt: skip


if __name__ == "__main__":  # run directly: under torchrun, or alone
    from launch import init

    main(init())
