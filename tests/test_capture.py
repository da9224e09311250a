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


def _check(module: torch.nn.Module, x, extent: int) -> None:
    """The captured fusion computes the module's outputs and their gradients (``x``: the
    input, or a tuple of them; the floating-point ones get gradients)."""
    args = list(x) if isinstance(x, tuple) else [x]
    captured = capture(module, args)
    inputs = captured.inputs(module, *args)
    ours = captured.fd.execute(inputs)
    theirs = module(*args)
    theirs = list(theirs) if isinstance(theirs, tuple) else [theirs]
    for index, (mine, wanted) in enumerate(zip(ours, theirs, strict=True)):
        assert_close(mine, wanted.detach(), reduction_extent=extent, message=f"output {index}")
    generator = torch.Generator().manual_seed(1)
    seeds = [torch.randn(t.shape, generator=generator).to(t.dtype) for t in theirs]
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    wanting = [leaf for leaf in leaves if leaf.requires_grad]
    through_ours = torch.autograd.grad(evaluate(captured.fd.fusion, leaves), wanting, seeds)
    positions = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    expected = dict(zip(positions, through_ours, strict=True))
    named = dict(module.named_parameters())
    arg_leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    arg_names = [f"input {i}" for i, a in enumerate(args) if a.is_floating_point()]
    outputs = module(*arg_leaves)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    floats = [a for a in arg_leaves if a.requires_grad]
    through_torch = torch.autograd.grad(outputs, [*named.values(), *floats], seeds)
    by_name = dict(zip([*named, *arg_names], through_torch, strict=True))
    grads = backward(captured.fd.fusion)
    actual = evaluate(grads.fusion, [*inputs, *seeds])
    names = [*captured.parameter_names, *[f"input {i}" for i in range(len(args))]]
    for position, ours_grad in zip(grads.wrt, actual, strict=True):
        name = names[position]
        # our backward against autograd through our fusion, and through the module
        assert_close(ours_grad, expected[position], reduction_extent=extent, message=name)
        if name in by_name:  # a parameter or an input (buffers have no grad in torch)
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


class _TwiceScaledPlus(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + b


def test_one_example_tensor_passed_as_two_arguments_captures_two_inputs():
    # torch.export alone makes the two arguments one input read twice: a call's second
    # argument was then ignored (a loss's targets silently its tokens)
    x = torch.randn(3)
    for examples in ([x, x], [x, x[:]]):
        captured = capture(_TwiceScaledPlus(), examples)
        a, b = torch.ones(3), torch.zeros(3)
        (out,) = captured.fd.execute(captured.inputs(_TwiceScaledPlus(), a, b))
        assert torch.equal(out, a * 2 + b)


def test_every_aten_op_without_a_translation_falls_back_to_torch():
    """Ops the table does not translate run as torch ops, each named in the printout, in
    the submodule that uses it (where the capture refused them before)."""

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

    torch.manual_seed(5)
    module, x = Model(), torch.randn(3, 4)
    captured = capture(module, [x])
    text = str(captured.fd)
    fell_back = "aten.sort.default, aten.cumsum.default, aten.topk.default"
    placed = "placed by torch's DTensor strategy where it has one, else replicated"
    assert text.splitlines()[-1] == f"fell back to torch: {fell_back} ({placed})", text
    in_ranker = [e.op_name for e in captured.boundaries["ranker"].exprs]
    assert in_ranker == ["torch_op[aten.sort.default]", "torch_op[aten.cumsum.default]"]
    _check(module, x, extent=4)


def test_an_op_that_is_neither_aten_nor_translated_is_named_with_where_it_is_used():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: x.cos(), lambda x: x.sin(), (x,))

    with pytest.raises(CaptureError) as failure:
        capture(Branchy(), [torch.randn(3)])
    message = str(failure.value)
    assert message.startswith("1 op(s) are neither ATen ops nor translated"), message
    assert "cond: in the module itself" in message, message


def test_a_fused_projection_split_in_three_and_its_gradient():
    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return q * torch.sigmoid(k) + v

    _check(Fused(), torch.randn(3, 8), extent=8)  # the split's gradient: its slices padded


def test_flatten_is_a_reshape_not_a_torch_op():
    """``flatten`` (torchtitan's loss flattens [batch, seq, vocab] logits) is translated: a
    torch op there would be placed by DTensor's rule, which gathers a split vocabulary."""

    class Flattens(torch.nn.Module):
        def forward(self, x):
            return x.flatten(0, 1) * 2, x.flatten(1) + 1, x.flatten(-1, -1) - 1, x.flatten()

    captured = capture(Flattens(), [torch.randn(2, 3, 5)])
    assert not [e for e in captured.fd.fusion.exprs if "torch_op" in str(e)]
    _check(Flattens(), torch.randn(2, 3, 5), extent=1)


def test_rotary_attention_with_a_causal_mask_buffer():
    torch.manual_seed(3)
    module = RotaryAttention(16, 2)  # examples/llama_block.py's
    captured = capture(module, [torch.randn(5, 16)])
    assert captured.parameter_names[-3:] == ["cos", "sin", "mask"]  # buffers after
    _check(module, torch.randn(5, 16), extent=16)


class LanguageModel(torch.nn.Module):
    """An embedding (a padding row), attention by ``scaled_dot_product_attention`` (causal,
    or with a mask), positions from ``arange``, a head, cross-entropy in several forms."""

    def __init__(self, vocab: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden, padding_idx=1)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("weights", torch.linspace(0.5, 1.5, vocab))

    def forward(self, tokens, targets, probabilities):
        count, hidden = tokens.shape[0], self.embed.embedding_dim
        h = self.embed(tokens) + torch.arange(count)[:, None] * 0.01
        q, k, v = (t.view(count, self.heads, -1).transpose(0, 1)
                   for t in self.qkv(h).split(hidden, -1))  # fmt: skip
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        keep = torch.arange(count)[None, :] <= torch.arange(count)[:, None] + 1
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)
        h = h + (causal + masked).transpose(0, 1).reshape(count, hidden)
        logits = self.head(h)
        return (
            F.cross_entropy(logits, targets),
            F.cross_entropy(logits, targets, ignore_index=2, label_smoothing=0.1),
            F.cross_entropy(logits, targets, weight=self.weights, reduction="sum"),
            F.cross_entropy(logits, targets, reduction="none"),
            F.cross_entropy(logits, probabilities),
            F.nll_loss(torch.log_softmax(logits, -1), targets),
        )


def test_embedding_attention_and_cross_entropy_forms_with_their_gradients():
    torch.manual_seed(4)
    module = LanguageModel(23, 16, 2)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.tensor([0, 1, 5, 22, 1, 7, 3])  # the padding row (1) twice
    targets = torch.tensor([2, 9, 2, 22, 0, 4, 2])  # the ignored class (2) three times
    probabilities = torch.softmax(torch.randn(7, 23, generator=generator), -1)
    _check(module, (tokens, targets, probabilities), extent=23)


def test_an_index_outside_the_embedding_table_fails():
    module = torch.nn.Embedding(5, 4)
    captured = capture(module, [torch.tensor([0, 1])])
    with pytest.raises(RuntimeError, match="outside the table's 5 rows"):
        captured.fd.execute(captured.inputs(module, torch.tensor([0, 5])))


def test_attention_dropout_is_refused_at_capture():
    class Dropping(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    with pytest.raises(CaptureError, match="dropout"):
        capture(Dropping(), [torch.randn(2, 3, 4)])
