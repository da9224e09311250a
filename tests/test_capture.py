"""``fusion.capture``: PyTorch modules captured as fusions, against the modules themselves.

Each module runs as a fusion (the reference evaluator) and as itself; outputs must
agree, and the fusion's backward (``fusion.autodiff``) must give the gradients torch
autograd gives the module's parameters and inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.llama_block import Attention as RotaryAttention
from fusion.autodiff import backward
from fusion.capture import CaptureError, capture
from fusion.reference import evaluate
from fusion.testing import assert_close


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SwiGLU(torch.nn.Module):
    """A Llama MLP block: RMSNorm, gate and up, silu(gate) * up, down, residual."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.gate = torch.nn.Linear(hidden, ffn, bias=False)
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        normed = self.norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


class Attention(torch.nn.Module):
    """Projections, heads split by a view and a transpose, softmax(q k^T / sqrt(d)) v,
    heads merged back, the output projection (with a bias)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden, bias=False) for _ in "qkv")
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        tokens, hidden = x.shape
        q, k, v = (
            proj(x).view(tokens, self.heads, hidden // self.heads).transpose(0, 1)
            for proj in (self.q, self.k, self.v)
        )
        scores = torch.softmax(q @ k.transpose(-2, -1) / (hidden // self.heads) ** 0.5, dim=-1)
        return self.out((scores @ v).transpose(0, 1).reshape(tokens, hidden))


def _check(module: torch.nn.Module, x: torch.Tensor, extent: int) -> None:
    """The captured fusion computes the module's output and its gradients."""
    captured = capture(module, [x])
    inputs = captured.inputs(module, x)
    (ours,) = captured.fd.execute(inputs)
    theirs = module(x)
    assert_close(ours, theirs.detach(), reduction_extent=extent)
    seed = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))
    seed = seed.to(theirs.dtype)
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    wanting = [leaf for leaf in leaves if leaf.requires_grad]
    through_ours = torch.autograd.grad(evaluate(captured.fd.fusion, leaves), wanting, [seed])
    positions = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    expected = dict(zip(positions, through_ours, strict=True))
    named = dict(module.named_parameters())
    x_leaf = x.clone().requires_grad_()
    through_torch = torch.autograd.grad(module(x_leaf), [*named.values(), x_leaf], seed)
    by_name = dict(zip([*named, "x"], through_torch, strict=True))
    grads = backward(captured.fd.fusion)
    actual = evaluate(grads.fusion, [*inputs, seed])
    for position, ours_grad in zip(grads.wrt, actual, strict=True):
        name = ([*captured.parameter_names, "x"])[position]
        # our backward against autograd through our fusion, and through the module
        assert_close(ours_grad, expected[position], reduction_extent=extent, message=name)
        if name in by_name:  # a parameter or the input (buffers have no grad in torch)
            assert_close(ours_grad, by_name[name], reduction_extent=4 * extent, message=name)


def test_a_llama_mlp_block_is_captured_with_its_parameters_and_gradients():
    torch.manual_seed(0)
    block = SwiGLU(16, 40)
    captured = capture(block, [torch.randn(6, 16)])
    assert captured.parameter_names == ["norm.weight", "gate.weight", "up.weight",
                                        "down.weight"]  # fmt: skip
    _check(block, torch.randn(7, 16), extent=40)


def test_attention_with_heads_softmax_and_batched_matmuls():
    torch.manual_seed(1)
    _check(Attention(16, 4), torch.randn(5, 16), extent=16)


def test_a_bf16_block_and_its_dtype_changes():
    torch.manual_seed(2)

    class Widened(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)

        def forward(self, x):
            wide = x.float()
            return (self.proj(x).float() * torch.sigmoid(wide)).to(torch.bfloat16)

    x = torch.randn(4, 8).to(torch.bfloat16)
    module = Widened()
    captured = capture(module, [x])
    (ours,) = captured.fd.execute(captured.inputs(module, x))
    assert ours.dtype is torch.bfloat16
    assert_close(ours, module(x).detach(), reduction_extent=8)


def test_every_op_without_a_translation_is_named_with_where_it_is_used():
    class Ranker(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x, -1).values.cumsum(-1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.ranker = Ranker()

        def forward(self, x):
            return self.ranker(self.proj(x)) + torch.topk(x, 2).values.sum()

    with pytest.raises(CaptureError) as failure:
        capture(Model(), [torch.randn(3, 4)])
    message = str(failure.value)
    assert message.startswith("3 ATen op(s) have no translation"), message
    assert "aten.sort.default: in ranker" in message, message
    assert "aten.cumsum.default: in ranker" in message, message
    assert "aten.topk.default: in the module itself" in message, message


def test_a_fused_projection_split_in_three_and_its_gradient():
    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return q * torch.sigmoid(k) + v

    _check(Fused(), torch.randn(3, 8), extent=8)  # the split's gradient: its slices padded


def test_rotary_attention_with_a_causal_mask_buffer():
    torch.manual_seed(3)
    module = RotaryAttention(16, 2)  # examples/llama_block.py's
    captured = capture(module, [torch.randn(5, 16)])
    assert captured.parameter_names[-3:] == ["cos", "sin", "mask"]  # buffers after
    _check(module, torch.randn(5, 16), extent=16)
