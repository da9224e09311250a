"""``examples/train_gpt.py`` on 2 gloo ranks: a GPT tensor-parallel (embedding and head
split by vocabulary, blocks by torch's plan), trained with AdamW, clipping and a
schedule on its Markov language. One run serves the 2-rank tests here (the job is the
example's own ``train``). On 4 ranks, data parallel x tensor parallel (2 x 2) with
checkpoints: one device's losses, and a resumed run's equal to an uninterrupted one's. And
the whole job under the local launcher: a rank dies, the job restarts from its last
checkpoint and ends with an uninterrupted run's losses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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


DP_STEPS, DP_CHECKED, DP_EVERY = 6, 3, 2


def data_parallel_run(communicator, directory: str) -> dict:
    """The example's tiny config, one layer, over 2 replicas of a 2-rank tensor-parallel
    team, ``DP_STEPS`` steps, checkpoints every ``DP_EVERY`` under ``directory`` (resumed
    from the last complete one there); one device beside it for the first ``DP_CHECKED``
    of a run from step 0."""
    from examples.train_gpt import Config, train

    config = replace(Config(), layers=1, steps=DP_STEPS, dp=2)
    return train(communicator, config, check_steps=DP_CHECKED, log=lambda line: None,
                 checkpoint_dir=directory, checkpoint_every=DP_EVERY)  # fmt: skip


def test_data_parallel_by_tensor_parallel_matches_one_device_and_resumes_bit_for_bit(
    rank_pools, tmp_path
):
    """dp 2 x tp 2 on 4 ranks: each replica its own batches, the first steps' losses and
    gradient norms those of one device trained on the union of the replicas' batches
    (``train`` fails a rank off by more than ``tolerance``). Then the checkpoint of 6
    steps is cut off (its ``.metadata`` gone), and a fresh run (new model, optimizer,
    schedule) resumes from the one of 4 steps: its steps 4 and 5 are the uninterrupted
    run's, bit for bit."""
    import torch

    from examples.train_gpt import tolerance
    from overlap.train.checkpoint import METADATA, checkpoint_path

    pool = rank_pools(4)
    straight = pool.run(data_parallel_run, str(tmp_path), timeout=240)
    for rank, result in enumerate(straight):
        assert result["start"] == 0
        # the replicas' mean loss, the same on every rank of both replicas
        assert result["losses"] == straight[0]["losses"], f"rank {rank}"
        assert len(result["one_device"]) == DP_CHECKED
        assert result["worst"] <= tolerance(torch.float32), f"rank {rank}: {result['worst']}"
    (checkpoint_path(tmp_path, DP_STEPS) / METADATA).unlink()
    resumed = pool.run(data_parallel_run, str(tmp_path), timeout=240)
    resumed_at = DP_STEPS - DP_EVERY
    for rank, result in enumerate(resumed):
        assert result["start"] == resumed_at, f"rank {rank}"
        assert result["losses"] == straight[rank]["losses"][resumed_at:], f"rank {rank}"
        assert result["norms"] == straight[rank]["norms"][resumed_at:], f"rank {rank}"
        assert result["one_device"] == [], "a resumed run compares nothing"


@pytest.mark.slow
def test_a_job_whose_rank_dies_restarts_from_its_checkpoint_with_the_same_losses(
    rank_pools, tmp_path
):
    """What ``overlap run --nproc 2 --max-restarts 1 examples/train_gpt.py ...`` runs
    (``launch.local.run_script``): the 2-rank job of the tests above, checkpoints every 2
    steps; rank 1 exits at step 5 in the first attempt (``--fail-at``, the save of 4
    steps complete or cut off by then). Every rank starts again, resumes from the last
    complete checkpoint (after step 2 or 4, never 0: that would be a job started over)
    and trains to the end with the losses of the pool's run, never stopped."""
    from launch.local import run_script

    losses_json = tmp_path / "losses.json"
    argv = ["--layers", "1", "--steps", str(STEPS), "--clip", str(CLIP), "--check-steps",
            "0", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every",
            "2", "--fail-at", "5", "--log-every", str(STEPS), "--losses-json",
            str(losses_json)]  # fmt: skip
    script = str(ROOT / "examples" / "train_gpt.py")
    assert run_script(script, argv, nproc=2, timeout_s=180, max_restarts=1) == 0
    uninterrupted = _run(rank_pools)[0]["losses"]
    last_attempt = json.loads(losses_json.read_text())
    start = last_attempt["start"]
    assert start in (2, 4), start
    assert last_attempt["losses"] == uninterrupted[start:]
