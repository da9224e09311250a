"""A GPT-2 block as people write it in PyTorch, parallelized with PyTorch's own
tensor-parallel plan unchanged and trained with AdamW on every rank, beside the same
module on one device.

    overlap run --launcher local --nproc 2 examples/gpt2_block.py [--steps 10]
    overlap run --launcher torchrun --nproc 2 examples/gpt2_block.py   # on 2 GPUs: NCCL
    python examples/gpt2_block.py                                      # alone: one rank
    overlap dump examples/gpt2_block.py                                # its forward program

The block, on inputs [batch, seq, hidden]: ``nn.LayerNorm``, attention (biased ``nn.Linear``
q, k, v and output projections, ``F.scaled_dot_product_attention(is_causal=True)`` on
[batch, heads, seq, head_dim]), a residual, ``nn.LayerNorm``, an MLP (biased ``nn.Linear``,
``F.gelu(approximate="tanh")``, biased ``nn.Linear``), a residual. The plan is what a torch
user hands ``parallelize_module``: the norms ``SequenceParallel()`` (the sequence, axis 1,
split between the blocks), the attention's and the MLP's inputs gathered whole
(``PrepareModuleInput``), q, k, v and the first MLP linear column-wise (heads and features
split), the output projections row-wise with their outputs reduce-scattered back into
the sequence split (``output_layouts=Shard(1)``): a forward moves the activations twice
each way and never a weight. ``overlap.train.parallelize`` reads the plan as torch does:
the block's output comes back as each rank's ``Shard(1)`` piece, as ``parallelize_module``
returns it. Rank 0 prints both losses per step; the job fails unless they agree within
``TOLERANCE`` at every step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusion import FusionDefinition  # noqa: E402
from overlap import parallelize  # noqa: E402
from overlap.train.plans import place  # noqa: E402

BATCH, SEQ, HIDDEN, HEADS = 2, 8, 32, 4
TOLERANCE = 1e-4  # relative, per step's loss (float32; the ranks sum in another order)
# PyTorch's plan for the block, as written for ``parallelize_module``
PLAN = {
    "ln_1": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
    "ln_2": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
}  # fmt: skip


class Attention(torch.nn.Module):
    """Causal self-attention with biased projections; heads split by the plan."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(hidden, hidden) for _ in "qkvp")

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, self.dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(torch.nn.Module):
    """GPT-2's MLP: 4x wider, GELU (tanh), biased."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, 4 * hidden)
        self.proj = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    """A GPT-2 block: pre-norm attention and MLP, each with a residual."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn, self.mlp = Attention(hidden, heads), MLP(hidden)

    def forward(self, x):
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


def fusion(world_size: int) -> FusionDefinition:
    """The block's forward as ``parallelize`` captures and places it, for ``overlap dump``."""
    torch.manual_seed(0)
    example = torch.zeros(BATCH, SEQ, HIDDEN)
    return place(Block(), [example], world_size, PLAN, inputs=[Shard(1)]).fd


def batches(steps: int, device: torch.device):
    """The same (input, target) batches on every rank."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
        yield x.to(device), (torch.tanh(x.flip(2)) * 0.5).to(device)


def main(communicator) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(sys.argv[1:])
    device, world, rank = communicator.device, communicator.world_size, communicator.rank
    torch.manual_seed(0)  # the same module on every rank
    whole = Block().to(device)
    example = torch.zeros(BATCH, SEQ, HIDDEN, device=device)
    block = parallelize(whole, [example], communicator, PLAN, inputs=[Shard(1)])
    if rank == 0:
        kinds = [c.op_name for e in block.model.executors for c in e.communications]
        print(f"forward communications: {kinds}", flush=True)
    ours_optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.01)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.01)
    worst = 0.0
    piece = slice(rank * SEQ // world, (rank + 1) * SEQ // world)  # this rank's Shard(1)
    for step, (x, target) in enumerate(batches(args.steps, device)):
        out = block(x[:, piece])
        wanted = list(target[:, piece].shape)
        if list(out.shape) != wanted:
            raise AssertionError(f"rank {rank}: the output's piece is {list(out.shape)}, "
                                 f"torch's Shard(1) piece {wanted}")  # fmt: skip
        # the mean squared error over the whole batch: each rank sums its piece's
        loss_piece = (out - target[:, piece]).square().sum() / target.numel()
        ours_optimizer.zero_grad()
        loss_piece.backward()
        ours_optimizer.step()
        loss = loss_piece.detach().clone()
        dist.all_reduce(loss)
        whole_loss = (whole(x) - target).square().mean()
        whole_optimizer.zero_grad()
        whole_loss.backward()
        whole_optimizer.step()
        gap = abs(loss.item() - whole_loss.item()) / abs(whole_loss.item())
        worst = max(worst, gap)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}  one device {whole_loss.item():.6f}  "
                  f"relative gap {gap:.1e}", flush=True)  # fmt: skip
    if worst > TOLERANCE:
        raise AssertionError(f"rank {rank}: the losses differ by up to {worst:.1e}")
    if rank == 0:
        print(f"gpt2_block: {args.steps} steps on {world} rank{'s' if world > 1 else ''} match "
              f"one device (largest relative gap {worst:.1e})", flush=True)  # fmt: skip


if __name__ == "__main__":  # run directly: under torchrun, or alone
    from launch import init

    main(init())
