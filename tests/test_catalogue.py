"""The catalogue of transformer blocks (``examples/catalogue.py``), each parallelized with
PyTorch's own plan unchanged and trained on real gloo ranks: every rank's output piece,
input gradient piece and every parameter gradient piece equal the block's under torch
autograd on one device, cut to that rank, and a few optimizer steps keep the losses
together; the forward moves what torch's tensor parallelism moves, and no weight."""

from __future__ import annotations

import copy

import pytest
import torch

from fusion.testing import assert_close
from overlap import parallelize

STEPS = 3


def trained_block(communicator, name: str):
    """``name``'s block parallelized on this rank and checked (see the module); returns
    its forward's communications and the weights any of them moved."""
    from examples.catalogue import CATALOGUE

    entry = CATALOGUE[name]
    device, rank = communicator.device, communicator.rank
    torch.manual_seed(0)  # the same block on every rank
    module = entry.make().to(device)
    whole = copy.deepcopy(module)
    inputs = [x.to(device) for x in entry.inputs(torch.Generator().manual_seed(1))]
    block = parallelize(module, inputs, communicator, entry.plan, inputs=entry.placements,
                        outputs=entry.outputs)  # fmt: skip
    names = [n for n, _ in whole.named_parameters()]
    ours_optimizer = torch.optim.SGD(block.parameters(), lr=0.01)
    whole_optimizer = torch.optim.SGD(whole.parameters(), lr=0.01)
    extent = max(x.shape[-1] for x in inputs) * 4
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(10 + step)
        xs = [x.to(device) for x in entry.inputs(generator)]
        if len(inputs) > 1:
            xs[1:] = inputs[1:]  # masks stay as in the example
        seed = torch.randn(whole(*xs).shape, generator=generator).to(device)
        # one device: the block under torch autograd
        leaves = [x.clone().requires_grad_(x.is_floating_point() and i == 0)
                  for i, x in enumerate(xs)]  # fmt: skip
        y_whole = whole(*leaves)
        expected = torch.autograd.grad(y_whole, [*whole.parameters(), leaves[0]], seed)
        # every rank: its pieces
        pieces = block.input_pieces(*xs)
        pieces[0].requires_grad_()
        y_piece = block(*pieces)
        (wanted,) = block.output_pieces(y_whole.detach())
        what = f"{name} rank {rank} step {step}"
        assert y_piece.shape == wanted.shape, f"{what}: output {y_piece.shape} {wanted.shape}"
        assert_close(y_piece, wanted, reduction_extent=extent, message=f"{what} output")
        (seed_piece,) = block.output_pieces(seed)
        y_piece.backward(seed_piece)
        grads = block.full_state(dict(zip(names, expected[:-1], strict=True)))
        for parameter in names:
            ours = block.pieces[parameter.replace(".", "__")].grad
            ours = ours.to_local() if type(ours).__name__ == "DTensor" else ours
            assert_close(ours, grads[parameter], reduction_extent=extent * 16,
                         message=f"{what} {parameter} gradient")  # fmt: skip
        x_grad = block.input_pieces(expected[-1], *xs[1:])[0]
        assert_close(pieces[0].grad, x_grad, reduction_extent=extent,
                     message=f"{what} input gradient")  # fmt: skip
        ours_optimizer.step()
        ours_optimizer.zero_grad()
        for parameter, grad in zip(whole.parameters(), expected, strict=False):
            parameter.grad = grad
        whole_optimizer.step()
        # the step matches one device's; the next starts from our weights on both sides,
        # so that each step's check is as strict as the first (rounding differences of
        # the ranks' sums would otherwise compound over the steps)
        for parameter, kept in zip(names, whole.parameters(), strict=True):
            ours = block.pieces[parameter.replace(".", "__")].detach()
            ours = ours.full_tensor() if type(ours).__name__ == "DTensor" else ours
            assert_close(ours, kept, reduction_extent=extent * 16,
                         message=f"{what} {parameter} after the step")  # fmt: skip
            with torch.no_grad():
                kept.copy_(ours)
    kinds = [c.op_name for c in block.model.forward_executor.communications]
    return kinds


# what torch's tensor parallelism moves in each block's forward
FORWARD_COMMUNICATIONS = {
    # sequence parallel: a gather before the attention and the MLP, a reduce-scatter after
    "gpt2": ["Allgather", "ReduceScatter", "Allgather", "ReduceScatter"],
    "llama_hf": ["Allgather", "ReduceScatter", "Allgather", "ReduceScatter"],
    # tensor parallel, activations whole: an all-reduce after each row-wise linear
    "bert": ["Allreduce", "Allreduce"],
    "vit": ["Allreduce"],
}


@pytest.mark.parametrize("name", sorted(FORWARD_COMMUNICATIONS))
def test_a_catalogue_block_under_torchs_plan_trains_as_the_block_on_2_ranks(rank_pools, name):
    results = rank_pools(2).run(trained_block, name, timeout=240)
    assert results == [FORWARD_COMMUNICATIONS[name]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FORWARD_COMMUNICATIONS))
def test_a_catalogue_block_under_torchs_plan_trains_as_the_block_on_4_ranks(rank_pools, name):
    results = rank_pools(4).run(trained_block, name, timeout=300)
    assert results == [FORWARD_COMMUNICATIONS[name]] * 4


def bert_with_dropout(communicator, seed: int):
    """The BERT layer with dropout on (p=0.1, training mode), parallelized by its plan: every
    rank's output and input gradient equal, bitwise where no sum crosses ranks and within
    rounding elsewhere, the same layer captured on one device and evaluated with the same
    seed (the same masks: ``fusion.random``, a function of the seed and each element's
    place in the whole tensor). Returns the forward's communications."""
    from examples.catalogue import BERT_PLAN, BertLayer, _bert_inputs
    from fusion.capture import capture
    from fusion.reference import evaluate

    device = communicator.device
    torch.manual_seed(0)
    module = BertLayer(dropout=0.1).train().to(device)
    x, mask = (t.to(device) for t in _bert_inputs(torch.Generator().manual_seed(1)))
    captured = capture(module, [x, mask])
    assert captured.seeded
    leaves = [t.clone().requires_grad_(i == len(captured.parameter_names))
              for i, t in enumerate(captured.inputs(module, x, mask, seed=seed))]  # fmt: skip
    (y_whole,) = evaluate(captured.fd.fusion, leaves)
    grad_seed = torch.randn(y_whole.shape, generator=torch.Generator().manual_seed(3))
    (x_grad,) = torch.autograd.grad(y_whole, [leaves[len(captured.parameter_names)]],
                                    grad_seed.to(device))  # fmt: skip
    block = parallelize(module, [x, mask], communicator, BERT_PLAN, seed=seed)
    x_piece, mask_piece = block.input_pieces(x, mask)
    x_piece.requires_grad_()
    y_piece = block(x_piece, mask_piece)
    what = f"bert with dropout, rank {communicator.rank}"
    assert_close(y_piece, y_whole.detach(), reduction_extent=256, message=f"{what} output")
    y_piece.backward(grad_seed.to(device))
    assert_close(x_piece.grad, x_grad, reduction_extent=256, message=f"{what} input gradient")
    # the masks were drawn: the output is not the layer's without dropout
    without = BertLayer().eval().to(device)
    without.load_state_dict(module.state_dict())
    assert not torch.allclose(y_piece.detach(), without(x, mask), atol=1e-3)
    return [c.op_name for c in block.model.forward_executor.communications]


def test_a_bert_layer_with_dropout_on_draws_the_same_masks_as_one_device(rank_pools):
    results = rank_pools(2).run(bert_with_dropout, 1234, timeout=240)
    assert results == [FORWARD_COMMUNICATIONS["bert"]] * 2
