"""A plan's weights stay where the plan puts them: a biased row-parallel linear (GPT-2's
``nn.Linear``s) combines its partial sums first, then adds its bias, as torch's
``RowwiseParallel`` does; the weights are never gathered. Where a plan does force a
weight to move, ``parallelize`` warns naming it."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_parallelize import trained_pieces

from overlap import compile_program, parallelize
from overlap.train.plans import place
from sharding.propagation import moved_inputs

MOVED = "the forward moves parameters the plan placed"


class GPT2MLP(torch.nn.Module):
    """GPT-2's MLP as people write it: biased linears, GELU (tanh)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, ffn)
        self.proj = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def torch_mlp_plan(placement: str) -> dict:
    """torch's plan for the MLP: ``RowwiseParallel()``'s default output ``Replicate()``,
    or the tokens' split (``Shard(0)``: sequence parallel, the input read as split too, as
    torch reads ``ColwiseParallel(input_layouts=Shard(0))``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if placement == "replicate":
        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    return {"fc": ColwiseParallel(input_layouts=Shard(0)),
            "proj": RowwiseParallel(output_layouts=Shard(0))}  # fmt: skip


def parallel_gpt2_mlp(communicator, tokens: int, placement: str):
    """The MLP trained one step by torch's plan: every rank's output and gradient pieces
    checked against the module's (``trained_pieces``); returns the parameter pieces'
    shapes, the forward's communications and the warnings ``parallelize`` gave."""
    world = communicator.world_size
    torch.manual_seed(0)  # the same module on every rank
    module = GPT2MLP(16, 8 * world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shapes, kinds = trained_pieces(
            communicator, module, torch_mlp_plan(placement), tokens, placement, 8 * world
        )
    return shapes, kinds, [str(w.message) for w in caught if MOVED in str(w.message)]


@pytest.mark.parametrize("placement", ["replicate", "sequence"])
def test_a_biased_gpt2_mlp_trains_as_the_module_with_torchs_communications(rank_pools, placement):
    results = rank_pools(2).run(parallel_gpt2_mlp, 7, placement, timeout=180)
    shapes = ["fc.weight [8, 16]", "fc.bias [8]", "proj.weight [16, 8]", "proj.bias [16]"]
    # torch's: one all-reduce of proj's partial sums (its bias added after), or with the
    # tokens split, an all-gather before fc and a reduce-scatter after proj; no weight
    # moved, so no warning
    kinds = ["Allreduce"] if placement == "replicate" else ["Allgather", "ReduceScatter"]
    assert results == [(shapes, kinds, [])] * 2


def test_a_biased_gpt2_mlp_moves_no_weight():
    """Compiled for 2 ranks by torch's plan (no process group): exactly one all-reduce,
    or one reduce-scatter, and no communication reads a parameter."""
    for placement, kinds in (("replicate", ["Allreduce"]), ("sequence", ["ReduceScatter"])):
        torch.manual_seed(0)
        inputs = ["sequence"] if placement == "sequence" else []
        captured = place(GPT2MLP(16, 64), [torch.zeros(32, 16)], 2, torch_mlp_plan(placement),
                         inputs=inputs)  # fmt: skip
        compiled = compile_program(captured.fd, 2)
        communications = [c.op_name for c in compiled.host.communications]
        if placement == "sequence":
            # the tokens gathered before fc: an activation, not a weight
            assert communications[0] == "Allgather"
            communications = communications[1:]
        assert communications == kinds, placement
        parameters = set(compiled.fusion.inputs[: len(captured.parameter_names)])
        assert [c for c in moved_inputs(compiled.fusion) if c.inputs[0] in parameters] == []


class LayerNorm(torch.nn.Module):
    """LayerNorm in elementwise ops (what the capture translates whatever its version)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.bias = torch.nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5) * self.weight + self.bias


class GPT2Attention(torch.nn.Module):
    """Causal attention on [batch, heads, seq, head_dim], biased projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden) for _ in "qkvo")

    def forward(self, x):
        batch, seq, hidden = x.shape

        def heads(t):
            return t.view(batch, seq, -1, hidden // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(batch, seq, hidden))


class GPT2Block(torch.nn.Module):
    """A GPT-2 block on [batch, seq, hidden] inputs (pre-norm, residuals)."""

    def __init__(self, hidden: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.attn = LayerNorm(hidden), GPT2Attention(hidden, heads)
        self.ln_2, self.mlp = LayerNorm(hidden), GPT2MLP(hidden, 4 * hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def test_a_biased_gpt2_block_forward_all_reduces_twice_by_torchs_plan():
    """torch's tensor-parallel plan for the block (q/k/v/fc column-wise, o/proj row-wise
    into ``Replicate()``): two all-reduces, as torch's TP does, and no weight moved
    (before: four all-gathers, of the attention's and GELU's outputs and of o's and
    proj's weights)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    plan |= {"attn.o": RowwiseParallel(), "mlp.proj": RowwiseParallel()}
    torch.manual_seed(0)
    captured = place(GPT2Block(), [torch.zeros(2, 8, 16)], 2, plan)
    compiled = compile_program(captured.fd, 2)
    assert [c.op_name for c in compiled.host.communications] == ["Allreduce", "Allreduce"]
    assert moved_inputs(compiled.fusion) == []  # the input replicated: nothing moves it


class SlicedWeight(torch.nn.Module):
    """Reads the first rows of its linear's weight: a split of those rows cannot stay."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, ffn, bias=False)

    def forward(self, x):
        return F.linear(x, self.fc.weight[: x.shape[-1]])


def parallel_sliced_weight(communicator):
    """``SlicedWeight`` with its weight split by rows (column-wise): the warnings given,
    and the forward's explanation of the moved weight."""
    torch.manual_seed(0)
    module = SlicedWeight(16, 16 * communicator.world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = parallelize(module, [torch.randn(4, 16)], communicator, {"fc": "colwise"},
                            dtensors=False)  # fmt: skip
    explained = block.model.forward_executor.explain()
    return [str(w.message) for w in caught if MOVED in str(w.message)], explained


def test_a_plan_that_forces_a_weight_to_move_is_warned_naming_it(rank_pools):
    results = rank_pools(2).run(parallel_sliced_weight, timeout=120)
    for caught, explained in results:
        # the weight's rows are moved (gathered, or turned to a split by columns)
        (warning,) = caught
        moved = re.fullmatch(
            r"parallelize: the forward moves parameters the plan placed, every step: "
            r"fc\.weight \((Allgather|AllToAll) to \[(R|S\(1\))\]\); the module's "
            r"model\.forward_executor\.explain\(\) says which op needs each placed otherwise",
            warning,
        )
        assert moved, warning
        (line,) = [line for line in explained.splitlines() if f"{moved[1]} of T0" in line]
        assert f"T0 is placed [S(0)] by annotation: slice makes T2 [{moved[2]}]" in line, line


def test_the_gpt_by_torchs_plan_moves_no_weight_where_gathering_one_moves_fewer_bits():
    """``examples/train_gpt.py``'s GPT placed by its plan, at shapes where gathering
    weights moves fewer bits than torch's communications (4 x 8 = 32 tokens: more than
    twice the width 8, so an all-to-all of the attention's output and an all-gather of
    ``attn.proj``'s weight undercut the reduce-scatter of its partial result; more than
    the vocabulary 16, so gathering the embedding's undercuts reduce-scattering the
    lookups): the plan's weights are pinned, no communication reads one, and every
    row-parallel result is reduce-scattered into the sequence split, as torch's
    ``RowwiseParallel(output_layouts=Shard(1))`` does (before: both weights gathered)."""
    from dataclasses import replace

    from torch.distributed.tensor import Replicate

    from examples.train_gpt import GPT, Config, plan
    from sharding import explain
    from sharding.resharding import shard_fusion

    config = replace(Config(), layers=1, hidden=8, heads=2, seq=8, batch=4, vocab=16)
    torch.manual_seed(0)
    tokens = torch.zeros(config.batch, config.seq, dtype=torch.long)
    captured = place(GPT(config), [tokens, tokens], 2, plan(1), [Replicate(), Replicate()])
    placed, decisions = shard_fusion(captured.fd.fusion)
    assert moved_inputs(placed) == []
    activation = (config.batch, config.seq, config.hidden)
    scattered = [
        e.inputs[0]
        for e in placed.exprs
        if getattr(e, "kind", None) is not None and e.kind.value == "ReduceScatter"
        and tuple(e.inputs[0].shape) == activation
    ]  # fmt: skip
    # the embedding's lookups, attn.proj's and mlp.proj's partial sums
    assert [e.definition.op_name for e in scattered] == ["embedding", "linear", "linear"]
    # explain says what keeping attn.proj's weight in place cost
    proj = placed.inputs[captured.parameter_names.index("blocks.0.attn.proj.weight")]
    assert f"moving {proj.name}, pinned: kept" in explain(placed, decisions)
