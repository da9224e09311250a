"""A Llama-style decoder block written as ordinary PyTorch modules, parallelized with a
tensor-parallel plan and trained with AdamW on every rank, beside the same module on one
device.

    overlap run --launcher local --nproc 2 examples/llama_block.py [--steps 10]
    overlap run --launcher ray --nproc 2 examples/llama_block.py
    overlap run --launcher torchrun --nproc 2 examples/llama_block.py   # on 2 GPUs: NCCL
    python examples/llama_block.py                                      # alone: one rank
    overlap dump examples/llama_block.py                                # its forward program

The block: RMSNorm, attention (rotary embeddings, a causal mask, heads split over the
ranks: q, k and v column-wise, the output projection row-wise), a residual, RMSNorm, a
SwiGLU MLP (gate and up column-wise, down row-wise), a residual; the tokens split over
the ranks between the blocks (sequence parallel). The plan is PyTorch's own, in its
``torch.distributed.tensor.parallel`` styles. ``overlap.train.parallelize`` captures the block
(``torch.export``), places it by the plan and runs its forward and backward as
overlapped programs on every rank; its parameters are DTensors, stepped by AdamW.
Every rank also trains the module whole, on its own device, from the same weights and
data; rank 0 prints both losses per step, and the job fails unless they agree within
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

TOKENS, HIDDEN, FFN, HEADS = 24, 32, 64, 4
TOLERANCE = 1e-4  # relative, per step's loss (float32; the ranks sum in another order)
# PyTorch's tensor-parallel plan for the block, as a torch user writes it for
# ``parallelize_module`` (the tokens are axis 0 here): the norms sequence-parallel, the
# attention's and the MLP's inputs gathered whole, q, k, v, gate and up column-wise, the
# output projections row-wise with their outputs reduce-scattered back into the split
PLAN = {
    "attention_norm": SequenceParallel(sequence_dim=0),
    "attention": PrepareModuleInput(input_layouts=(Shard(0),),
                                    desired_input_layouts=(Replicate(),)),
    "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
    "attention.v": ColwiseParallel(), "attention.o": RowwiseParallel(output_layouts=Shard(0)),
    "mlp_norm": SequenceParallel(sequence_dim=0),
    "mlp": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
    "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(output_layouts=Shard(0)),
}  # fmt: skip


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary_tables(dim: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings' cos and sin tables, [longest, dim] (each half alike)."""
    frequencies = 10000 ** -(torch.arange(0, dim, 2) / dim)
    angles = torch.arange(longest)[:, None] * frequencies
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, longest: int = 64) -> None:
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.q, self.k, self.v, self.o = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in "qkvo"
        )
        cos, sin = rotary_tables(self.dim, longest)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.register_buffer("mask", torch.ones(longest, longest).triu(1).bool())

    def rotate(self, t, tokens):
        half = self.dim // 2
        turned = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * self.cos[:tokens] + turned * self.sin[:tokens]

    def forward(self, x):
        tokens, hidden = x.shape
        q, k, v = (
            proj(x).view(tokens, self.heads, self.dim).transpose(0, 1)
            for proj in (self.q, self.k, self.v)
        )
        q, k = self.rotate(q, tokens), self.rotate(k, tokens)
        scores = (q @ k.transpose(-2, -1) / self.dim**0.5).masked_fill(
            self.mask[:tokens, :tokens], float("-inf")
        )
        out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(0, 1).reshape(tokens, hidden))


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.attention, self.mlp = Attention(HIDDEN, HEADS), MLP(HIDDEN, FFN)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def fusion(world_size: int) -> FusionDefinition:
    """The block's forward as ``parallelize`` captures and places it, for ``overlap dump``."""
    torch.manual_seed(0)
    example = torch.zeros(TOKENS, HIDDEN)
    return place(Block(), [example], world_size, PLAN, outputs=["sequence"]).fd


def batches(steps: int, device: torch.device):
    """The same (input, target) batches on every rank."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        yield x.to(device), (torch.tanh(x.flip(1)) * 0.5).to(device)


def main(communicator) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(sys.argv[1:])
    device, world = communicator.device, communicator.world_size
    torch.manual_seed(0)  # the same module on every rank
    whole = Block().to(device)
    example = torch.zeros(TOKENS, HIDDEN, device=device)
    block = parallelize(whole, [example], communicator, PLAN, outputs=["sequence"])
    if communicator.rank == 0:
        kinds = [c.op_name for e in block.model.executors for c in e.communications]
        print(f"forward communications: {kinds}", flush=True)
    ours_optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.01)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.01)
    worst = 0.0
    for step, (x, target) in enumerate(batches(args.steps, device)):
        (x_piece,) = block.input_pieces(x)
        (target_piece,) = block.output_pieces(target)
        # the mean squared error over the whole batch: each rank sums its piece's
        loss_piece = (block(x_piece) - target_piece).square().sum() / target.numel()
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
        if communicator.rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}  one device {whole_loss.item():.6f}  "
                  f"relative gap {gap:.1e}", flush=True)  # fmt: skip
    if worst > TOLERANCE:
        raise AssertionError(f"rank {communicator.rank}: the losses differ by up to {worst:.1e}")
    if communicator.rank == 0:
        print(f"llama_block: {args.steps} steps on {world} rank{'s' if world > 1 else ''} match "
              f"one device "
              f"(largest relative gap {worst:.1e})", flush=True)  # fmt: skip


if __name__ == "__main__":  # run directly: under torchrun, or alone
    from launch import init

    main(init())
