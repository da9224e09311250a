"""``overlap.train.parallelize``: a PyTorch module captured, placed by a tensor-parallel plan and
trained on real gloo ranks; every rank's output piece and gradient pieces equal the
unparallelized module's under torch autograd, cut to that rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from distributed import RankError
from test_capture import RMSNorm, RotaryAttention, SwiGLU, _check

from fusion.testing import assert_close
from overlap import parallelize

PLAN = {"gate": "colwise", "up": "colwise", "down": "rowwise"}
HEADS_PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}


def trained_pieces(communicator, module, plan, tokens: int, placement: str, extent: int,
                   hidden: int = 16, batch: tuple[int, ...] = (), **options):  # fmt: skip
    """One forward and backward of ``module`` parallelized by ``plan`` on this rank
    (``options`` to ``parallelize``), its input [*batch, tokens, hidden], its output and
    every gradient piece checked against the module under torch autograd; then the
    block's pieces stepped, the module left as it was. Returns each parameter piece's
    shape and the forward's communications."""
    world, device = communicator.world_size, communicator.device
    module = module.to(device)
    shape = (*batch, tokens, hidden)
    rows = math.prod(shape[:-1])  # the terms a parameter's gradient sums over the rows
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    seed = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device)
    block = parallelize(module, [x], communicator, plan, inputs=[placement],
                        outputs=[placement], **options)  # fmt: skip
    # one device: the module itself under torch autograd
    x_whole = x.clone().requires_grad_()
    y_whole = module(x_whole)
    names = [name for name, _ in module.named_parameters()]
    expected = torch.autograd.grad(y_whole, [*module.parameters(), x_whole], seed)
    # every rank: its pieces
    (x_piece,) = block.input_pieces(x)
    x_piece.requires_grad_()
    y_piece = block(x_piece)
    (wanted,) = block.output_pieces(y_whole.detach())
    assert_close(y_piece, wanted, reduction_extent=extent, partial_sums=world,
                 message=f"rank {communicator.rank} output")  # fmt: skip
    (seed_piece,) = block.output_pieces(seed)
    y_piece.backward(seed_piece)
    grads = block.full_state(dict(zip(names, expected[:-1], strict=True)))
    shapes = []
    for name, whole in zip(names, expected, strict=False):
        # a DTensor parameter: its gradient a DTensor placed alike, whole as torch sees it
        grad = block.pieces[name.replace(".", "__")].grad
        assert type(grad).__name__ == "DTensor", type(grad)
        ours = grad.to_local()
        assert_close(ours, grads[name], reduction_extent=extent * rows, partial_sums=world,
                     message=f"rank {communicator.rank}, {name}")  # fmt: skip
        assert_close(grad.full_tensor(), whole, reduction_extent=extent * rows,
                     partial_sums=world, message=f"{name} whole")  # fmt: skip
        shapes.append(f"{name} {list(ours.shape)}")
    (x_grad,) = block.input_pieces(expected[-1])
    assert_close(x_piece.grad, x_grad, reduction_extent=extent, partial_sums=world)
    # the pieces are the block's own: stepping them leaves the module as it was
    before = [p.detach().clone() for p in module.parameters()]
    torch.optim.SGD(block.parameters(), lr=1.0).step()
    for name, kept, now in zip(names, before, module.parameters(), strict=True):
        assert torch.equal(kept, now), f"{name} changed with the block's step"
    return shapes, [c.op_name for c in block.model.forward_executor.communications]


def parallel_swiglu(communicator, tokens: int, style_objects: bool):
    world = communicator.world_size
    torch.manual_seed(0)  # the same module on every rank
    module = SwiGLU(16, 8 * world)
    plan = PLAN
    if style_objects:  # torch's own styles, read as torch means them
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"gate": ColwiseParallel(), "up": ColwiseParallel(),
                "down": RowwiseParallel(output_layouts=Shard(0))}  # fmt: skip
    return trained_pieces(communicator, module, plan, tokens, "sequence", 8 * world)


def parallel_attention(communicator, tokens: int, placement: str):
    """Llama attention (rotary tables and a causal mask as buffers) with its heads split:
    q, k and v column-wise, the output projection row-wise."""
    torch.manual_seed(0)
    module = RotaryAttention(16, 2 * communicator.world_size)
    return trained_pieces(communicator, module, HEADS_PLAN, tokens, placement, 64)


@pytest.mark.parametrize(("world", "tokens", "style_objects"),
                         [(2, 8, False), (2, 7, True), (4, 9, False)])  # fmt: skip
def test_a_sequence_parallel_swiglu_module_trains_as_the_module(
    rank_pools, world, tokens, style_objects
):
    results = rank_pools(world).run(parallel_swiglu, tokens, style_objects, timeout=120)
    width = 8 * world // world
    # gate and up by rows, down by columns: each rank a world-th of each; the norm whole
    shapes = ["norm.weight [16]", f"gate.weight [{width}, 16]", f"up.weight [{width}, 16]",
              f"down.weight [16, {width}]"]  # fmt: skip
    assert results == [(shapes, ["Allgather", "ReduceScatter"])] * world


@pytest.mark.parametrize("placement", ["replicate", "sequence"])
@pytest.mark.parametrize("world", [2, 4])
def test_heads_parallel_rotary_attention_trains_as_the_module(rank_pools, world, placement):
    results = rank_pools(world).run(parallel_attention, 2 * world + 1, placement, timeout=120)
    width = 16 // world
    shapes = [f"{name}.weight [{width}, 16]" for name in "qkv"] + [f"o.weight [16, {width}]"]
    # Megatron's communications: one all-reduce of the output projection's partial sums,
    # or with the tokens split, an all-gather before q, k and v and a reduce-scatter after
    kinds = ["Allreduce"] if placement == "replicate" else ["Allgather", "ReduceScatter"]
    assert results == [(shapes, kinds)] * world


class VocabularyHead(torch.nn.Module):
    """A language model's ends: an embedding, RMSNorm, the head's logits, cross-entropy."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norm = RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.head(self.norm(self.embed(tokens))), targets)


VOCABULARY = 37  # an extent no other axis has: a communication of the logits would show


def vocabulary_parallel(communicator, tokens: int, placement: str, kernels: str,
                        embedding: str = "rowwise"):  # fmt: skip
    """The head split by vocabulary (column-wise), the embedding by vocabulary (torch's
    row-wise) or by features (column-wise): loss and every gradient piece against the
    module's; returns the shapes of every communication, forward and backward."""
    torch.manual_seed(0)
    module = VocabularyHead(VOCABULARY, 16).to(communicator.device)
    generator = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, VOCABULARY, (tokens,), generator=generator)
                    .to(communicator.device) for _ in "it")  # fmt: skip
    # 37 rows over 4 ranks: 10, 9, 9, 9 here, 10, 10, 10, 7 by DTensor: plain pieces
    dtensors = communicator.world_size == 2
    model = parallelize(module, [ids, targets], communicator, {"embed": embedding, "head":
                        "colwise"}, inputs=[placement, placement], kernels=kernels,
                        dtensors=dtensors)  # fmt: skip
    loss = module(ids, targets)
    names = [name for name, _ in module.named_parameters()]
    expected = torch.autograd.grad(loss, list(module.parameters()))
    ours = model(*model.input_pieces(ids, targets))
    rank = communicator.rank
    assert_close(ours, loss.detach(), reduction_extent=VOCABULARY, message=f"rank {rank} loss")
    ours.backward()
    grads = model.full_state(dict(zip(names, expected, strict=True)))
    for name in names:
        ours = model.pieces[name.replace(".", "__")].grad
        ours = ours.to_local() if dtensors else ours
        assert_close(ours, grads[name], reduction_extent=VOCABULARY * tokens,
                     message=f"rank {rank}, {name}")  # fmt: skip
    executors = model.model.executors
    return sorted({str(c.output.shape) for e in executors for c in e.communications})


@pytest.mark.parametrize(("world", "placement", "kernels", "embedding"),
                         [(2, "replicate", "reference", "rowwise"),
                          (2, "sequence", "generated", "rowwise"),
                          (2, "sequence", "reference", "colwise"),
                          (4, "sequence", "reference", "rowwise")])  # fmt: skip
def test_a_vocabulary_parallel_embedding_and_cross_entropy_never_gather_the_logits(
    rank_pools, world, placement, kernels, embedding
):
    results = rank_pools(world).run(vocabulary_parallel, 9, placement, kernels, embedding,
                                    timeout=180)  # fmt: skip
    assert results[0] and all(result == results[0] for result in results)
    gathered = [shape for shape in results[0] if str(VOCABULARY) in shape]
    # the lookups' partial sums, the max and sums over the vocabulary: never [tokens, vocab]
    assert not gathered, results[0]


class TorchAttention(torch.nn.Module):
    """Heads by ``scaled_dot_product_attention`` (PyTorch's kernels), causal."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in "qkvo"
        )

    def forward(self, x):
        tokens, hidden = x.shape
        q, k, v = (proj(x).view(tokens, self.heads, -1).transpose(0, 1)
                   for proj in (self.q, self.k, self.v))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(0, 1).reshape(tokens, hidden))


def parallel_torch_attention(communicator, tokens: int):
    torch.manual_seed(0)
    module = TorchAttention(16, 2 * communicator.world_size)
    return trained_pieces(communicator, module, HEADS_PLAN, tokens, "sequence", 64)


@pytest.mark.parametrize("world", [2, 4])
def test_scaled_dot_product_attention_splits_by_heads(rank_pools, world):
    results = rank_pools(world).run(parallel_torch_attention, 2 * world + 1, timeout=120)
    width = 16 // world
    shapes = [f"{name}.weight [{width}, 16]" for name in "qkv"] + [f"o.weight [16, {width}]"]
    assert results == [(shapes, ["Allgather", "ReduceScatter"])] * world


class GroupedQueryAttention(torch.nn.Module):
    """``scaled_dot_product_attention``'s own grouped-query attention (``enable_gqa``):
    ``heads`` query heads over ``kv_heads`` key and value heads, causal."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.dim = hidden // heads
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.k = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = torch.nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        tokens, hidden = x.shape
        q, k, v = (proj(x).view(tokens, -1, self.dim).transpose(0, 1)
                   for proj in (self.q, self.k, self.v))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(0, 1).reshape(tokens, hidden))


def test_grouped_query_attention_by_enable_gqa_captures_as_the_module():
    torch.manual_seed(0)
    _check(GroupedQueryAttention(32, 8, 2), torch.randn(5, 32), extent=32)


def parallel_grouped_query_attention(communicator, tokens: int):
    world = communicator.world_size
    torch.manual_seed(0)
    module = GroupedQueryAttention(32, 4 * world, world)  # a key and value head a rank
    return trained_pieces(communicator, module, HEADS_PLAN, tokens, "sequence", 64, hidden=32)


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_query_attention_splits_its_key_and_value_heads_with_their_groups(
    rank_pools, world
):
    """Each rank holds a world-th of the query heads and the key and value heads their
    groups read (torch's column-wise split of k and v): no head moved between ranks."""
    results = rank_pools(world).run(parallel_grouped_query_attention, 2 * world + 1,
                                    timeout=120)  # fmt: skip
    kv_width = 8 // world  # k and v: 8 features, a head of 8 // world a rank
    shapes = [f"q.weight [{32 // world}, 32]", f"k.weight [{kv_width}, 32]",
              f"v.weight [{kv_width}, 32]", f"o.weight [32, {32 // world}]"]  # fmt: skip
    assert results == [(shapes, ["Allgather", "ReduceScatter"])] * world


def llama_block_by_torch_plan(communicator, tokens: int):
    """examples/llama_block.py's block under its plan, written in torch's styles
    (SequenceParallel norms, PrepareModuleInput, row-wise outputs into Shard(0))."""
    from examples.llama_block import PLAN, Block

    torch.manual_seed(0)
    return trained_pieces(communicator, Block(), PLAN, tokens, "sequence", 64, hidden=32)


@pytest.mark.parametrize("world", [2, 4])
def test_a_llama_block_under_torchs_own_plan_trains_as_the_block(rank_pools, world):
    results = rank_pools(world).run(llama_block_by_torch_plan, 2 * world + 1, timeout=180)
    shapes, kinds = results[0]
    assert all(result == results[0] for result in results)
    width = 32 // world
    assert f"attention.q.weight [{width}, 32]" in shapes and "mlp_norm.weight [32]" in shapes
    # Megatron's sequence parallelism, as torch's plan asks: a gather before the
    # attention and the MLP, a reduce-scatter after each
    assert kinds == ["Allgather", "ReduceScatter", "Allgather", "ReduceScatter"]


def test_place_gives_parallelizes_placed_fusion_without_a_process_group():
    """What ``overlap dump`` compiles for a module (examples/llama_block.py's
    ``fusion``): the block placed by torch's plan over 2 ranks, no communicator; its
    program has the communications the run above finds, its q weight split by rows."""
    from examples.llama_block import HIDDEN, PLAN, TOKENS, Block
    from overlap import compile_program
    from overlap.train.plans import place
    from sharding import Shard
    from sharding.layout import layout_of

    torch.manual_seed(0)
    block = Block()
    captured = place(block, [torch.zeros(TOKENS, HIDDEN)], 2, PLAN, outputs=["sequence"])
    program = compile_program(captured.fd, 2).host
    assert [c.op_name for c in program.communications] == [
        "Allgather", "ReduceScatter", "Allgather", "ReduceScatter"
    ]  # fmt: skip
    q = captured.fd.fusion.inputs[captured.parameter_names.index("attention.q.weight")]
    assert layout_of(q).placements == (Shard(0),), layout_of(q)


def test_two_placements_asked_for_one_tensor_are_refused():
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from examples.llama_block import MLP

    class World:
        world_size, rank, device = 2, 0, torch.device("cpu")

    plan = {
        "gate": "colwise",
        "up": "colwise",
        "down": RowwiseParallel(output_layouts=TorchShard(0)),
    }
    with pytest.raises(ValueError, match=r"parallelize's outputs\[0\] places T\d+_f32\[.*\] R, "
                       r"but down's output 0 places it S\(0\)"):  # fmt: skip
        parallelize(MLP(16, 32), [torch.randn(4, 16)], World(), plan, outputs=["replicate"],
                    dtensors=False)  # fmt: skip


def test_a_plan_naming_no_submodule_with_parameters_is_refused():
    class World:
        world_size, rank, device = 2, 0, torch.device("cpu")

    with pytest.raises(ValueError, match=r"the plan names \['gate_proj'\]"):
        parallelize(SwiGLU(16, 32), [torch.randn(4, 16)], World(), {"gate_proj": "colwise"})
    with pytest.raises(ValueError, match="style 'diagonal'"):
        parallelize(SwiGLU(16, 32), [torch.randn(4, 16)], World(), {"gate": "diagonal"})


def test_a_split_dtensor_would_cut_otherwise_is_refused_naming_the_parameter():
    class World:
        world_size, rank, device = 4, 0, torch.device("cpu")

    # 18 rows over 4 ranks: 5, 5, 4, 4 here, but 5, 5, 5, 3 by DTensor (torch.chunk)
    with pytest.raises(ValueError, match=r"parameter gate.weight: axis 0 \(18\) split over 4 "
                       r"ranks is cut \[5, 5, 4, 4\] here but \[5, 5, 5, 3\]"):  # fmt: skip
        parallelize(SwiGLU(16, 18), [torch.randn(4, 16)], World(), {"gate": "colwise"},
                    dtensors=True)  # fmt: skip


def unseeded_module(communicator, same_weights: bool):
    """Every rank builds the module from its own seed (as without torch.manual_seed)."""
    torch.manual_seed(0 if same_weights else communicator.rank)
    module = SwiGLU(16, 8 * communicator.world_size)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1 + communicator.rank))
    block = parallelize(module, [x], communicator, PLAN, inputs=["sequence"],
                        outputs=["sequence"], dtensors=False)  # fmt: skip
    block.input_pieces(x)  # the inputs differ between ranks: refused there


@pytest.mark.parametrize("same_weights", [False, True])
def test_weights_or_inputs_that_differ_between_ranks_are_refused_on_every_rank(
    rank_pools, same_weights
):
    """Each rank cuts its parameters' pieces from its own module and its input's from
    its own tensor: where they differ the pieces would make a module no rank built."""
    with pytest.raises(RankError) as failure:
        rank_pools(2).run(unseeded_module, same_weights, timeout=120)
    assert sorted(failure.value.failures) == [0, 1], "every rank must raise"
    # with different weights, the module's first parameter (its norm's weight) differs
    # with the same weights, the input: named as forward's signature names it
    step, name = ("input_pieces", "x (forward's argument 0)") if same_weights else (
        "parallelize", "norm.weight")  # fmt: skip
    wanted = f"{step}: the ranks were given different whole tensors: {name} differs"
    for rank, message in failure.value.messages().items():
        assert failure.value.failures[rank][0] == "InputError", message
        assert wanted in message, message
