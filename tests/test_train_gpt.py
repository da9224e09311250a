"""``examples/train_gpt.py`` on gloo ranks: a GPT tensor-parallel (embedding and head split
by vocabulary, blocks by torch's plan), trained with AdamW, clipping and a schedule on its
Markov language. One 2-rank run serves the tests here (the job is the example's own
``train``): its first steps against one device, and its checkpoint, which 4 ranks (data
parallel x tensor parallel, 2 x 2) resume, as one device continues, and resume again bit
for bit. And the whole job under torchrun: a rank dies, the job restarts from its last
checkpoint and ends with the 2-rank run's losses."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STEPS, CHECKED, CLIP = 20, 3, 0.5
SAVED_AT = 16  # the 2-rank run's one checkpoint (every SAVED_AT steps), where 4 ranks start


def trained(communicator, directory: str) -> dict:
    """The example's tiny config, one layer, trained ``STEPS`` steps beside one device for
    the first ``CHECKED`` (``train`` fails on a rank whose loss or gradient norm is off
    by more than ``tolerance``), clipped at ``CLIP``: below the first steps' norms, so
    that the steps compared are clipped. A checkpoint after ``SAVED_AT`` steps under
    ``directory``."""
    from examples.train_gpt import Config, train

    config = replace(Config(), layers=1, steps=STEPS, clip=CLIP)
    return train(communicator, config, check_steps=CHECKED, log=lambda line: None,
                 checkpoint_dir=directory, checkpoint_every=SAVED_AT)  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(rank_pools, tmp_path_factory) -> tuple[list[dict], Path]:
    """The 2-rank run (``trained``), by rank, and its checkpoints' folder."""
    directory = tmp_path_factory.mktemp("two_ranks")
    return rank_pools(2).run(trained, str(directory), timeout=240), directory


def test_the_first_steps_match_one_device_and_the_loss_falls(two_ranks):
    import torch

    from examples.train_gpt import tolerance

    results, _ = two_ranks
    for rank, result in enumerate(results):
        assert result["start"] == 0
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


def test_the_backward_moves_no_tokens_by_vocabulary_tensor(two_ranks):
    # the cross-entropy's [tokens, vocab] gradient, split by vocabulary, is summed over the
    # vocabulary as it is split (a partial sum, an all-reduce of [tokens]); before
    # sharding.rules kept a serving split, it moved whole by an all-to-all
    assert [result["backward_moves"] for result in two_ranks[0]] == [[], []]


DP_CHECKED, DP_EVERY = 3, 2


def data_parallel_run(communicator, directory: str) -> dict:
    """The 2-rank run's config over 2 replicas of a 2-rank tensor-parallel team, resumed
    from the last complete checkpoint under ``directory`` and trained to ``STEPS``, saving
    every ``DP_EVERY`` steps; ``check_steps`` asked for, which a resumed run ignores."""
    from examples.train_gpt import Config, train

    config = replace(Config(), layers=1, steps=STEPS, clip=CLIP, dp=2)
    return train(communicator, config, check_steps=DP_CHECKED, log=lambda line: None,
                 checkpoint_dir=directory, checkpoint_every=DP_EVERY)  # fmt: skip


@pytest.fixture(scope="module")
def four_ranks(two_ranks, rank_pools, tmp_path_factory) -> tuple[list[dict], Path]:
    """``data_parallel_run`` on 4 ranks from the 2-rank run's checkpoint (alone in a
    folder of its own), by rank, and that folder."""
    from overlap.train.checkpoint import checkpoint_path

    directory = tmp_path_factory.mktemp("four_ranks")
    shutil.copytree(checkpoint_path(two_ranks[1], SAVED_AT), checkpoint_path(directory, SAVED_AT))
    return rank_pools(4).run(data_parallel_run, str(directory), timeout=240), directory


def one_device(stop: int) -> tuple[list[float], list[float]]:
    """The losses and gradient norms of steps ``SAVED_AT`` to ``stop`` of the example's
    model trained on one device from the same initial weights: on the 2-rank run's batches
    (one replica's) before ``SAVED_AT``, on the union of 2 replicas' batches from there."""
    import torch

    from examples.train_gpt import GPT, Config, MarkovLanguage, Trainer

    config = replace(Config(), layers=1, steps=STEPS, clip=CLIP)
    torch.manual_seed(config.seed)
    whole = Trainer(GPT(config), config)
    language = MarkovLanguage(config.vocab, config.seed)
    losses, norms = [], []
    for step in range(stop):
        replicas = 1 if step < SAVED_AT else 2
        loss, norm = whole.step(torch.cat([language.batch(step, replica, config.batch, config.seq)
                                           for replica in range(replicas)]))  # fmt: skip
        if step >= SAVED_AT:
            losses.append(loss)
            norms.append(norm)
    return losses, norms


def test_a_two_rank_checkpoint_trains_on_over_four_ranks_as_one_device(four_ranks):
    """DCP reshards the 2-rank run's checkpoint (tensor parallel over 2) onto dp 2 x tp 2
    on 4 ranks, each replica its own batches: the first ``DP_CHECKED`` steps' losses and
    gradient norms are those of one device that trained as the 2-rank run did, then on
    the union of the replicas' batches (3e-7 apart at most, measured). The first step
    reads the weights as saved; the second, the weights AdamW moved with its moments as
    saved (fresh ones: 4e-3 apart); the third, the learning rate the loaded schedule set
    (the schedule from its start: 1.5e-2 apart; the second step's rate is the saved
    optimizer's)."""
    import torch

    from examples.train_gpt import tolerance

    results, _ = four_ranks
    losses, norms = one_device(SAVED_AT + DP_CHECKED)
    for rank, result in enumerate(results):
        assert result["start"] == SAVED_AT, f"rank {rank}"
        # the replicas' mean loss, the same on every rank of both replicas
        assert result["losses"] == results[0]["losses"], f"rank {rank}"
        assert result["one_device"] == [], "a resumed run compares nothing"
    for ours, whole in [*zip(results[0]["losses"], losses, strict=False),
                        *zip(results[0]["norms"], norms, strict=False)]:  # fmt: skip
        assert abs(ours - whole) <= tolerance(torch.float32) * abs(whole), (ours, whole)


def test_a_four_rank_run_resumes_bit_for_bit(four_ranks, rank_pools):
    """The 4-rank run's checkpoint of ``STEPS`` steps cut off (its ``.metadata`` gone): a
    fresh run (new model, optimizer, schedule) resumes from the one before, and its steps
    are the uninterrupted run's, bit for bit."""
    from overlap.train.checkpoint import METADATA, checkpoint_path

    straight, directory = four_ranks
    (checkpoint_path(directory, STEPS) / METADATA).unlink()
    resumed = rank_pools(4).run(data_parallel_run, str(directory), timeout=240)
    resumed_at = STEPS - DP_EVERY
    done = resumed_at - SAVED_AT  # the steps of the uninterrupted run before it
    for rank, result in enumerate(resumed):
        assert result["start"] == resumed_at, f"rank {rank}"
        assert result["losses"] == straight[rank]["losses"][done:], f"rank {rank}"
        assert result["norms"] == straight[rank]["norms"][done:], f"rank {rank}"


FAILS_AT = SAVED_AT + 3  # rank 1's exit in the first attempt of a restartable job


@pytest.mark.slow
def test_a_job_whose_rank_dies_restarts_from_its_checkpoint_with_the_same_losses(
    two_ranks, tmp_path
):
    """What ``overlap run --launcher torchrun --nproc 2 --max-restarts 1
    examples/train_gpt.py ...`` runs (``launch.cli``: torchrun's elastic agent; the local
    launcher starts every rank again alike, tested on a script of its own in
    tests/test_launch.py, ``test_overlap_run_max_restarts_starts_every_rank_again``: the
    example under it too took 34 s of CI's 15 minutes): the
    2-rank job of the tests above, from its checkpoint of ``SAVED_AT`` steps, saving after
    every step; rank 1 exits at step ``FAILS_AT`` in the first attempt (``--fail-at``: the
    save of ``SAVED_AT + 1`` steps complete by then, the next one waited for it; that of
    ``SAVED_AT + 2`` complete or cut off). Every rank starts again, resumes from the last
    complete checkpoint (one the failed attempt saved, never the one it started from) and
    trains to the end with the losses of the pool's run, never stopped."""
    from launch.cli import _run
    from overlap.train.checkpoint import checkpoint_path

    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(checkpoint_path(two_ranks[1], SAVED_AT), checkpoint_path(checkpoints, SAVED_AT))
    losses_json = tmp_path / "losses.json"
    argv = ["--layers", "1", "--steps", str(STEPS), "--clip", str(CLIP), "--check-steps",
            "0", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1",
            "--fail-at", str(FAILS_AT), "--log-every", str(STEPS), "--losses-json",
            str(losses_json)]  # fmt: skip
    script = str(ROOT / "examples" / "train_gpt.py")
    command = argparse.Namespace(launcher="torchrun", script=script, args=argv, nproc=2,
                                 timeout=180.0, max_restarts=1)  # fmt: skip
    assert _run(command) == 0
    uninterrupted = two_ranks[0][0]["losses"]
    last_attempt = json.loads(losses_json.read_text())
    start = last_attempt["start"]
    assert start in (SAVED_AT + 1, SAVED_AT + 2), start
    assert last_attempt["losses"] == uninterrupted[start:]
