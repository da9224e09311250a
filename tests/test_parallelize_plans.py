"""``parallelize`` reads torch's tensor-parallel plans as torch's ``parallelize_module``
does: a GPT-2 block on [batch, seq, hidden] under torch's own plan objects (norms
``SequenceParallel`` on the sequence, axis 1 by torch's default; the attention's and
the MLP's inputs gathered by ``PrepareModuleInput``; row-wise projections into
``Shard(1)``) returns on every rank the piece torch returns, checked against torch's
``parallelize_module`` of the same block on the same gloo ranks and against the block
on one device; ``inputs``/``outputs`` take torch's and our placements and the strings;
an input error names ``forward``'s argument."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import RankError

from fusion.exprs import SetOp
from fusion.testing import assert_close
from overlap import compile_program, parallelize
from overlap.train.plans import place
from sharding import Replicate, Shard
from sharding.layout import layout_of

BATCH, SEQ, HIDDEN = 2, 8, 16


class LayerNorm(torch.nn.Module):
    """LayerNorm in elementwise ops and means (what torch's ``SequenceParallel``
    replicates the parameters of and runs on the sequence's pieces)."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        centered = x - x.mean(-1, keepdim=True)
        variance = (centered * centered).mean(-1, keepdim=True)
        return centered * torch.rsqrt(variance + self.eps) * self.weight + self.bias


class Attention(torch.nn.Module):
    """Heads written for tensor parallelism as torch needs it (``view(..., -1, head)``:
    the local heads under torch, all of them here)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head = hidden // heads
        self.q, self.k, self.v, self.o = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in "qkvo"
        )

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))  # fmt: skip
        weights = torch.softmax(q @ k.transpose(-2, -1) / self.head**0.5, dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


class MLP(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.proj = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class GPT2Block(torch.nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.attn = LayerNorm(hidden), Attention(hidden, heads)
        self.ln_2, self.mlp = LayerNorm(hidden), MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def torch_plan() -> dict:
    """torch's sequence-parallel plan for the block, torch's defaults left as they are."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gathered():
        return PrepareModuleInput(input_layouts=TorchShard(1),
                                  desired_input_layouts=TorchReplicate())  # fmt: skip

    return {
        "ln_1": SequenceParallel(), "attn": gathered(),
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=TorchShard(1)),
        "ln_2": SequenceParallel(), "mlp": gathered(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=TorchShard(1)),
    }  # fmt: skip


def output_placement(kind: str):
    """An ``outputs`` entry by name (the ranks get names: placements are made there)."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    return {"torch Shard(1)": TorchShard(1), "our Shard(1)": Shard(1),
            "torch Shard(-2)": TorchShard(-2), "torch Replicate()": TorchReplicate(),
            "our Replicate()": Replicate(), "replicate": "replicate",
            "sequence": "sequence"}[kind]  # fmt: skip


def block_against_torch(communicator, output: str | None):
    """The block parallelized by ``parallelize`` and by torch's ``parallelize_module``
    under the same plan, on this rank; ours checked against the block on one device
    (output and the input's gradient), torch's too where it places the output as ours.
    Returns our output's shape and torch's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    world, rank = communicator.world_size, communicator.rank
    torch.manual_seed(0)  # the same block on every rank
    block = GPT2Block(HIDDEN, 2 * world)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    seed = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    outputs = [] if output is None else [output_placement(output)]
    ours = parallelize(copy.deepcopy(block), [x], communicator, torch_plan(), outputs=outputs)
    # one device: the block itself
    x_whole = x.clone().requires_grad_()
    y_whole = block(x_whole)
    (x_grad_whole,) = torch.autograd.grad(y_whole, [x_whole], seed)
    # ours: the input's piece as the plan reads it (the first norm's Shard(1))
    (x_piece,) = ours.input_pieces(x)
    x_piece.requires_grad_()
    y = ours(x_piece)
    (wanted,) = ours.output_pieces(y_whole.detach())
    assert_close(y, wanted, reduction_extent=4 * HIDDEN, message=f"rank {rank} output")
    (seed_piece,) = ours.output_pieces(seed)
    y.backward(seed_piece)
    (x_grad,) = ours.input_pieces(x_grad_whole)
    assert_close(x_piece.grad, x_grad, reduction_extent=4 * HIDDEN * SEQ,
                 message=f"rank {rank} input gradient")  # fmt: skip
    # torch: the caller hands each rank its Shard(1) piece (torch.chunk's)
    mesh = init_device_mesh("cpu", (world,))
    theirs = parallelize_module(copy.deepcopy(block), mesh, torch_plan())
    y_torch = theirs(x.chunk(world, dim=1)[rank])
    assert type(y_torch) is torch.Tensor, type(y_torch)  # a local piece, as ours
    if y.shape == y_torch.shape:
        assert_close(y, y_torch, reduction_extent=4 * HIDDEN, message=f"rank {rank} vs torch")
    return list(y.shape), list(y_torch.shape)


@pytest.mark.parametrize("output", [None, "torch Shard(1)", "our Shard(1)", "torch Shard(-2)"])
def test_torchs_plan_returns_torchs_sequence_piece_of_a_batch_seq_hidden_block(rank_pools, output):
    """No placement given for the output, or the sequence split torch's plan ends in:
    every rank returns the Shard(1) piece torch's ``parallelize_module`` returns."""
    world = 2
    results = rank_pools(world).run(block_against_torch, output, timeout=180)
    piece = [BATCH, SEQ // world, HIDDEN]
    assert results == [(piece, piece)] * world


@pytest.mark.parametrize(
    ("output", "shape"),
    [("torch Replicate()", [BATCH, SEQ, HIDDEN]), ("our Replicate()", [BATCH, SEQ, HIDDEN]),
     ("replicate", [BATCH, SEQ, HIDDEN]), ("sequence", [BATCH // 2, SEQ, HIDDEN])],
)  # fmt: skip
def test_an_output_placement_asked_for_is_what_every_rank_returns(rank_pools, output, shape):
    """Replicated: the whole output on every rank; "sequence": split along the first
    axis (the batch here), as the string always meant. torch's plan alone returns the
    Shard(1) piece."""
    results = rank_pools(2).run(block_against_torch, output, timeout=180)
    assert results == [(shape, [BATCH, SEQ // 2, HIDDEN])] * 2


def whole_input_given(communicator):
    """The whole input handed where the block takes this rank's Shard(1) piece."""
    torch.manual_seed(0)
    block = GPT2Block(HIDDEN, 2 * communicator.world_size)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    parallelize(block, [x], communicator, torch_plan(), dtensors=False)(x)


def test_a_wrong_input_is_named_by_forwards_argument_on_every_rank(rank_pools):
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(whole_input_given, timeout=120)
    assert sorted(failure.value.failures) == [0, 1], "every rank must raise"
    parameters = len(list(GPT2Block().parameters()))  # counted before the input by the fusion
    for rank, message in failure.value.messages().items():
        assert failure.value.failures[rank][0] == "InputError", message
        assert "x (forward's argument 0) placed" in message, message
        assert f"input {parameters}" not in message, message
        assert f"expected the local shape [{BATCH}, {SEQ // 2}, {HIDDEN}]" in message, message
        assert (f"parallelize captured GPT2Block for its example inputs' whole shapes only "
                f"(x [{BATCH}, {SEQ}, {HIDDEN}])") in message, message  # fmt: skip


def placed_block(outputs=(), inputs=()):
    torch.manual_seed(0)
    x = torch.zeros(BATCH, SEQ, HIDDEN)
    return place(GPT2Block(), [x], 2, torch_plan(), inputs=inputs, outputs=outputs)


def test_torchs_plan_keeps_the_sequence_split_to_the_blocks_end():
    """Megatron's sequence parallelism and no more: the block's output stays split
    along the sequence (no all-gather after the last reduce-scatter) unless asked whole."""
    split = compile_program(placed_block().fd, 2).host
    kinds = ["Allgather", "ReduceScatter", "Allgather", "ReduceScatter"]
    assert [c.op_name for c in split.communications] == kinds
    whole = compile_program(placed_block(outputs=["replicate"]).fd, 2).host
    assert [c.op_name for c in whole.communications] == [*kinds, "Allgather"]


def test_the_blocks_input_is_read_as_its_first_norms_sequence_dim():
    """torch's ``SequenceParallel()`` (``sequence_dim=1``) takes the caller's tensor as
    its Shard(1) piece: so does the fusion's input, and a placement asked otherwise for
    it is refused naming both."""
    from torch.distributed.tensor import Shard as TorchShard

    captured = placed_block(inputs=[TorchShard(1)])
    x = captured.fd.fusion.inputs[len(captured.parameter_names)]
    assert layout_of(x).placements == (Shard(1),)
    assert layout_of(placed_block().fd.fusion.inputs[-1]).placements == (Shard(1),)
    with pytest.raises(ValueError, match=r"ln_1's input_layouts places T\d+_f32\[.*\] S\(1\), "
                       r"but parallelize's inputs\[0\] places it R"):  # fmt: skip
        placed_block(inputs=["replicate"])


class Residual(torch.nn.Module):
    """An MLP reading the module's input itself, its result added to it."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(HIDDEN)

    def forward(self, hidden_states):
        return hidden_states + self.mlp(hidden_states)


def test_prepare_module_input_reads_the_callers_piece_by_its_input_layouts():
    """The caller's tensor is the Shard(1) piece ``input_layouts`` says (torch's
    ``from_local``); the MLP reads a copy gathered as ``desired_input_layouts`` says."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan = {"mlp": PrepareModuleInput(input_layouts=(TorchShard(1),),
                                      desired_input_layouts=(TorchReplicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=TorchShard(1))}  # fmt: skip
    torch.manual_seed(0)
    captured = place(Residual(), [torch.zeros(BATCH, SEQ, HIDDEN)], 2, plan)
    fusion = captured.fd.fusion
    x = fusion.inputs[-1]
    assert layout_of(x).placements == (Shard(1),)
    (copy_of_x,) = [e.outputs[0] for e in fusion.exprs if isinstance(e, SetOp) and e.inputs[0] is x]
    assert layout_of(copy_of_x).placements == (Replicate(),)
    assert not any(x in e.inputs for e in captured.boundaries["mlp"].exprs)  # the copy only
    assert layout_of(fusion.outputs[0]) is None  # free: propagation's S(1), as torch's
    kinds = [c.op_name for c in compile_program(captured.fd, 2).host.communications]
    assert kinds == ["Allgather", "ReduceScatter"]


class Heads(torch.nn.Module):
    """A norm over [batch, heads, seq, head_dim] activations."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = LayerNorm(4)

    def forward(self, states):
        return self.norm(states) * 2


@pytest.mark.parametrize(
    ("sequence_dim", "outputs", "placed"),
    [(2, (), Shard(2)), (-2, ["torch Shard(-1)"], Shard(3)), (1, [Shard(-4)], Shard(0))],
)  # fmt: skip
def test_shard_placements_of_any_axis_on_4d_tensors(sequence_dim, outputs, placed):
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.parallel import SequenceParallel

    outputs = [TorchShard(-1) if o == "torch Shard(-1)" else o for o in outputs]
    plan = {"norm": SequenceParallel(sequence_dim=sequence_dim)}
    captured = place(Heads(), [torch.zeros(2, 4, 6, 4)], 2, plan, outputs=outputs)
    fusion = captured.fd.fusion
    assert layout_of(fusion.inputs[-1]).placements == (Shard(sequence_dim % 4),)
    program = compile_program(captured.fd, 2)
    (output,) = program.fusion.outputs
    assert layout_of(output).placements == (placed,)


def test_a_placement_outside_the_tensor_or_unknown_is_refused():
    with pytest.raises(ValueError, match=r"parallelize's outputs\[0\] places .* S\(3\), "
                       r"but it has 3 axes"):  # fmt: skip
        placed_block(outputs=[Shard(3)])
    with pytest.raises(ValueError, match=r"placement 'diagonal' is not one of"):
        placed_block(outputs=["diagonal"])
    with pytest.raises(ValueError, match=r"parallelize's inputs\[0\]: placements are Shard"):
        placed_block(inputs=[3])
