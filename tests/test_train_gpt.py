"""``examples/train_gpt.py`` on 2 gloo ranks: a GPT tensor-parallel (embedding and head
split by vocabulary, blocks by torch's plan), trained with AdamW, clipping and a
schedule on its Markov language. One run serves every test here (the job is the
example's own ``train``)."""

from __future__ import annotations

from dataclasses import replace

STEPS, CHECKED, CLIP = 20, 3, 0.5
_RUNS: dict = {}  # one run for the tests of this module


def trained(communicator) -> dict:
    """The example's tiny config, one layer, trained ``STEPS`` steps beside one device for
    the first ``CHECKED`` (``train`` fails on a rank whose loss or gradient norm is off
    by more than ``tolerance``), clipped at ``CLIP``: below the first steps' norms, so
    that the steps compared are clipped."""
    from examples.train_gpt import Config, train

    config = replace(Config(), layers=1, steps=STEPS, clip=CLIP)
    return train(communicator, config, check_steps=CHECKED, log=lambda line: None)


def _run(rank_pools) -> list[dict]:
    if "results" not in _RUNS:
        _RUNS["results"] = rank_pools(2).run(trained, timeout=240)
    return _RUNS["results"]


def test_the_first_steps_match_one_device_and_the_loss_falls(rank_pools):
    import torch

    from examples.train_gpt import tolerance

    results = _run(rank_pools)
    for rank, result in enumerate(results):
        # every rank holds the whole loss and the global gradient norm (float32: the
        # ranks sum their pieces in another order than one device, 1e-4 relative)
        assert result["losses"] == results[0]["losses"], f"rank {rank}"
        assert result["worst"] <= tolerance(torch.float32), f"rank {rank}: {result['worst']}"
        assert len(result["one_device"]) == CHECKED
        # clip_grad_norm_ on the DTensor gradients: one device's norm of the whole
        # gradients, each rank's pieces counted once; above CLIP, so the steps compared
        # (their losses after) were scaled by it
        for ours, whole in zip(result["norms"], result["one_device_norms"], strict=False):
            assert abs(ours - whole) <= tolerance(torch.float32) * whole
            assert ours > CLIP
        # the forward computes the loss on the vocabulary's pieces: no [tokens, vocab] moved
        assert result["forward_moves"] == [], f"rank {rank}"
    losses = results[0]["losses"]
    # from log(96) = 4.56 nats; each batch differs, so the last five steps' mean, not one
    last = sum(losses[-5:]) / 5
    assert last < losses[0] - 0.15, losses


def test_the_backward_moves_no_tokens_by_vocabulary_tensor(rank_pools):
    # the cross-entropy's [tokens, vocab] gradient, split by vocabulary, is summed over the
    # vocabulary as it is split (a partial sum, an all-reduce of [tokens]); before
    # sharding.rules kept a serving split, it moved whole by an all-to-all
    assert [result["backward_moves"] for result in _run(rank_pools)] == [[], []]
