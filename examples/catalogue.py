"""Transformer blocks as their authors write them in PyTorch, each with the tensor-parallel
plan a torch user hands ``parallelize_module``: what ``overlap.train.parallelize`` must take
unchanged (``tests/test_catalogue.py`` trains each one on gloo ranks against one device;
``benchmarks/parallel_block.py`` times them).

- ``gpt2``: ``examples/gpt2_block.py``'s block (LayerNorm, biased linears, GELU tanh,
  causal ``scaled_dot_product_attention``), sequence parallel on axis 1;
- ``llama_hf``: a Hugging Face style Llama decoder layer on [batch, seq, hidden]: RMSNorm
  in float32, rotary embeddings in HF's layout (``rotate_half``), grouped-query attention
  (``repeat_kv``), a SwiGLU MLP, no biases; sequence parallel on axis 1;
- ``bert``: a BERT encoder layer: post-norm, biased linears, exact GELU, an additive
  attention mask from a [batch, seq] 0/1 mask, dropout (off by default; ``dropout=p``:
  on the attention's probabilities and each sublayer's output, seeded alike on every
  rank: ``fusion.random``); tensor parallel with the activations whole between layers
  (row-wise outputs all-reduced);
- ``vit``: a ViT (timm-style) block: pre-norm, one fused qkv linear split by ``unbind``,
  non-causal attention, exact GELU; the MLP tensor parallel, the attention whole.

Each entry is an ``Entry``: the module's constructor, example inputs, the plan and the
placements of the inputs and outputs between blocks (torch's placement objects).

    overlap dump examples/catalogue.py           # the HF Llama layer's forward program
    overlap dump examples/gpt2_block.py          # the GPT-2 block's (a script to run)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import gpt2_block  # noqa: E402
from fusion import FusionDefinition  # noqa: E402
from overlap.train.plans import place  # noqa: E402


@dataclass(frozen=True)
class Entry:
    """One block of the catalogue: ``make()`` builds it (seeded by the caller),
    ``inputs(generator)`` gives example inputs, ``plan`` is torch's, ``placements`` and
    ``outputs`` the inputs' and outputs' placements between blocks."""

    make: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], list[torch.Tensor]]
    plan: dict
    placements: list[Placement]
    outputs: list[Placement] = field(default_factory=list)


BATCH, SEQ = 2, 8


def _rows(generator: torch.Generator, hidden: int) -> list[torch.Tensor]:
    return [torch.randn(BATCH, SEQ, hidden, generator=generator)]


# -- a Hugging Face style Llama decoder layer -----------------------------------------


class LlamaRMSNorm(torch.nn.Module):
    """HF's ``LlamaRMSNorm``: normalized in float32, scaled in the input's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(dtype)


def rotate_half(x):
    """HF's rotary layout: the two halves of the head's features, swapped and negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(torch.nn.Module):
    """Grouped-query attention as HF writes it: ``num_heads`` query heads sharing
    ``num_key_value_heads`` key and value heads, rotary embeddings, causal."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, longest: int = 64) -> None:
        super().__init__()
        self.dim, self.groups = hidden // heads, heads // kv_heads
        self.q_proj = torch.nn.Linear(hidden, heads * self.dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * self.dim, hidden, bias=False)
        inverse = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        angles = torch.outer(torch.arange(longest).float(), inverse)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        shape = (batch, seq, -1, self.dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = self.cos[:seq], self.sin[:seq]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # repeat_kv: each key and value head serves ``groups`` query heads
        kv_heads = k.shape[1]
        k = k[:, :, None].expand(batch, kv_heads, self.groups, seq, self.dim)
        v = v[:, :, None].expand(batch, kv_heads, self.groups, seq, self.dim)
        k = k.reshape(batch, kv_heads * self.groups, seq, self.dim)
        v = v.reshape(batch, kv_heads * self.groups, seq, self.dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class LlamaMLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(torch.nn.Module):
    """HF's decoder layer: pre-norm attention and MLP, each with a residual."""

    def __init__(self, hidden: int = 64, heads: int = 8, kv_heads: int = 4, ffn: int = 128,
                 longest: int = 64) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads, longest)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)
        self.mlp = LlamaMLP(hidden, ffn)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


GATHER = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
LLAMA_PLAN = {
    "input_layernorm": SequenceParallel(),
    "self_attn": GATHER,
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(),
    "mlp": GATHER,
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}  # fmt: skip


# -- a BERT encoder layer -----------------------------------------------------------------


class BertLayer(torch.nn.Module):
    """BERT's encoder layer: self-attention with an additive mask, post-norm residuals,
    an exact-GELU MLP; every linear biased. ``forward(x, mask)``, mask [batch, seq] of
    1 (attend) and 0 (padding)."""

    def __init__(self, hidden: int = 32, heads: int = 4, ffn: int = 64, dropout: float = 0.0):
        super().__init__()
        self.dim = hidden // heads
        # BERT's dropouts: on the attention's probabilities and on each sublayer's output
        self.attention_dropout = torch.nn.Dropout(dropout)
        self.hidden_dropout = torch.nn.Dropout(dropout)
        self.query, self.key, self.value = (torch.nn.Linear(hidden, hidden) for _ in "qkv")
        self.attention_output = torch.nn.Linear(hidden, hidden)
        self.attention_norm = torch.nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = torch.nn.Linear(hidden, ffn)
        self.output = torch.nn.Linear(ffn, hidden)
        self.output_norm = torch.nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x, mask):
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, self.dim).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        additive = (1.0 - mask[:, None, None, :]) * -10000.0
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim) + additive
        probabilities = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = (probabilities @ v).transpose(1, 2).reshape(batch, seq, -1)
        h = self.attention_norm(x + self.hidden_dropout(self.attention_output(context)))
        return self.output_norm(h + self.hidden_dropout(self.output(F.gelu(self.intermediate(h)))))


def _bert_inputs(generator: torch.Generator) -> list[torch.Tensor]:
    mask = torch.ones(BATCH, SEQ)
    mask[1, SEQ - 3 :] = 0.0  # the second sequence padded
    return [*_rows(generator, 32), mask]


BERT_PLAN = {
    "query": ColwiseParallel(), "key": ColwiseParallel(), "value": ColwiseParallel(),
    "attention_output": RowwiseParallel(),
    "intermediate": ColwiseParallel(),
    "output": RowwiseParallel(),
}  # fmt: skip


# -- a ViT block ----------------------------------------------------------------------------


class ViTBlock(torch.nn.Module):
    """timm's ViT block: pre-norm, a fused qkv projection split by ``unbind``, attention
    over every patch, an exact-GELU MLP."""

    def __init__(self, hidden: int = 32, heads: int = 4, ffn: int = 128) -> None:
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.norm1 = torch.nn.LayerNorm(hidden, eps=1e-6)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden, eps=1e-6)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def attention(self, x):
        batch, patches, hidden = x.shape
        qkv = self.qkv(x).reshape(batch, patches, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, patches, hidden))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


# the fused qkv cannot be split column-wise as torch's plan splits it (its q, k and v
# would fall to different ranks): the attention stays whole, the MLP is tensor parallel
VIT_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


CATALOGUE = {
    "gpt2": Entry(
        gpt2_block.Block,
        lambda g: _rows(g, gpt2_block.HIDDEN),
        gpt2_block.PLAN,
        [Shard(1)],
        [Shard(1)],
    ),  # fmt: skip
    "llama_hf": Entry(
        LlamaDecoderLayer, lambda g: _rows(g, 64), LLAMA_PLAN, [Shard(1)], [Shard(1)]
    ),  # fmt: skip
    "bert": Entry(
        BertLayer, _bert_inputs, BERT_PLAN, [Replicate(), Replicate()], [Replicate()]
    ),  # fmt: skip
    "vit": Entry(ViTBlock, lambda g: _rows(g, 32), VIT_PLAN, [Replicate()], [Replicate()]),
}


def fusion(world_size: int, name: str = "llama_hf") -> FusionDefinition:
    """Block ``name``'s forward as ``parallelize`` captures and places it by its plan, for
    ``overlap dump`` (the HF Llama layer by default)."""
    entry = CATALOGUE[name]
    torch.manual_seed(0)
    inputs = entry.inputs(torch.Generator().manual_seed(1))
    return place(entry.make(), inputs, world_size, entry.plan, entry.placements,
                 entry.outputs).fd  # fmt: skip
