"""``overlap.train.checkpoint``: DCP checkpoints of a parallelized module and its AdamW on
real gloo ranks. A resumed run equals an uninterrupted one bit for bit (weights,
optimizer, learning-rate schedule, dropout's counter, the CPU generator the data comes
from); a checkpoint cut off mid-write is never loaded; one saved on 2 ranks loads on 4;
a job whose rank dies restarts from the last complete checkpoint by itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap import Checkpointer, latest_checkpoint, load_checkpoint, parallelize, save_checkpoint
from overlap.train.checkpoint import METADATA, checkpoint_path

# DCP without a process group says it saves as one process: the single-process tests here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKENS, HIDDEN, FFN = 4, 8, 16  # FFN splits over 2 and 4 ranks
STEPS, EVERY = 6, 2


class TinyMLP(torch.nn.Module):
    """A column-parallel ``up``, dropout, a row-parallel ``down`` (its bias whole on
    every rank): split and replicated parameters, and a dropout counter to restore."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.drop = torch.nn.Dropout(0.25)
        self.down = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(self.drop(F.gelu(self.up(x))))


def tiny_job(communicator, init_seed: int = 0, data_parallel: int = 1):
    """The module (weights drawn from ``init_seed``, the same on every rank), AdamW and a
    step schedule; the data's generator (torch's CPU one) seeded for a fresh run."""
    torch.manual_seed(init_seed)
    module = TinyMLP().train()
    model = parallelize(module, [torch.zeros(TOKENS, HIDDEN)], communicator,
                        {"up": "colwise", "down": "rowwise"}, inputs=["replicate"],
                        outputs=["replicate"], seed=7, kernels="reference",
                        data_parallel=data_parallel)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    torch.manual_seed(100)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, start: int, stop: int, checkpoints=None) -> list[float]:
    """Steps ``start`` to ``stop``: a batch from the CPU generator, the loss, AdamW, the
    schedule; each step's loss."""
    losses = []
    for step in range(start, stop):
        x = torch.randn(TOKENS, HIDDEN)
        loss = (model(x) - x.flip(1).tanh()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if checkpoints is not None:
            checkpoints.after_step(step + 1, {"batches": step + 1})
    return losses


def local_state(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's pieces of the parameters and of AdamW's state, by name."""
    state = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            state[f"{name}.{key}"] = value.to_local() if key != "step" else value
    return state


def resumed_equals_uninterrupted(communicator, directory: str):
    """Uninterrupted: ``STEPS`` steps. Interrupted: checkpoints every ``EVERY`` steps,
    stopped after 5; a checkpoint of 6 steps left cut off; fresh weights, optimizer and
    generator resumed from the last complete one and trained to ``STEPS``."""
    model, optimizer, scheduler = tiny_job(communicator)
    straight = train(model, optimizer, scheduler, 0, STEPS)
    expected = local_state(model, optimizer)

    model, optimizer, scheduler = tiny_job(communicator)
    with Checkpointer(directory, model, optimizer, EVERY, scheduler) as checkpoints:
        first = train(model, optimizer, scheduler, 0, 5, checkpoints)
    assert first == straight[:5], "checkpointing changed the training"
    if communicator.rank == 0:  # a save of 6 steps cut off before DCP's coordinator finished
        shutil.copytree(checkpoint_path(directory, 4), checkpoint_path(directory, 6))
        (checkpoint_path(directory, 6) / METADATA).unlink()
    dist.barrier()
    assert latest_checkpoint(directory) == checkpoint_path(directory, 4)

    model, optimizer, scheduler = tiny_job(communicator, init_seed=1)
    torch.manual_seed(999)  # the generator elsewhere: restored from the checkpoint
    with Checkpointer(directory, model, optimizer, EVERY, scheduler) as checkpoints:
        position = checkpoints.resume()
        assert (position.step, position.data) == (4, {"batches": 4}), position
        assert model.calls == 4, "dropout's counter not restored"
        resumed = train(model, optimizer, scheduler, position.step, STEPS, checkpoints)
    assert resumed == straight[4:], (resumed, straight)
    for name, tensor in local_state(model, optimizer).items():
        assert torch.equal(tensor, expected[name]), f"rank {communicator.rank}: {name}"
    return straight


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(rank_pools, tmp_path):
    losses = rank_pools(2).run(resumed_equals_uninterrupted, str(tmp_path), timeout=120)
    assert losses[0] == losses[1]  # every rank computed the same whole loss
    assert losses[0][-1] < losses[0][0]  # and it trained
    # the save of 6 steps (complete this time) overwrote the cut-off folder
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 6)


def saved_then_trained(communicator, directory: str):
    """Two steps, a checkpoint; the whole parameters and AdamW state (gathered)."""
    model, optimizer, scheduler = tiny_job(communicator)
    train(model, optimizer, scheduler, 0, 2)
    save_checkpoint(checkpoint_path(directory, 2), model, optimizer, 2, {"batches": 2},
                    scheduler)  # fmt: skip
    return whole_state(model, optimizer)


def loaded_elsewhere(communicator, directory: str, data_parallel: int):
    """Fresh weights on this world (``data_parallel`` replicas), the checkpoint loaded:
    the whole state, and this rank's piece of ``up``'s weight."""
    model, optimizer, scheduler = tiny_job(communicator, 1, data_parallel)
    position = load_checkpoint(latest_checkpoint(directory), model, optimizer, scheduler)
    assert (position.step, position.data, model.calls) == (2, {"batches": 2}, 2)
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == 1e-2 * 0.5
    return whole_state(model, optimizer), list(model.pieces["up__weight"].to_local().shape)


def whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    state = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            state[f"{name}.{key}"] = value.full_tensor() if key != "step" else value
    return state


def test_a_checkpoint_saved_on_two_ranks_loads_on_four(rank_pools, tmp_path):
    """DCP reshards by the DTensor placements: ``up``'s rows split 2 ways, then 4 (tensor
    parallel over 4), then 2 again on each of 2 data-parallel replicas (a 2-D mesh)."""
    saved = rank_pools(2).run(saved_then_trained, str(tmp_path), timeout=120)[0]
    loaded = [(split, result)
              for data_parallel, split in [(1, 4), (2, 2)]
              for result in rank_pools(4).run(loaded_elsewhere, str(tmp_path), data_parallel,
                                              timeout=120)]  # fmt: skip
    for split, (state, piece_shape) in loaded:
        assert piece_shape == [FFN // split, HIDDEN]
        assert state.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), name


def test_latest_checkpoint_skips_folders_without_dcps_metadata(tmp_path):
    assert latest_checkpoint(tmp_path / "none yet") is None
    for step, complete in [(2, True), (10, True), (12, False)]:
        checkpoint_path(tmp_path, step).mkdir()
        if complete:
            (checkpoint_path(tmp_path, step) / METADATA).write_bytes(b"")
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)  # 10 > 2 as numbers


@pytest.mark.parametrize("keep", [1, 2])
def test_checkpointer_keeps_the_newest_complete_checkpoints(tmp_path, keep):
    """One rank (no process group): every ``EVERY`` steps a save; after each, all but the
    ``keep`` newest complete ones removed, and a cut-off one older than them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint_path(tmp_path, 1).mkdir()  # cut off: no metadata
    with Checkpointer(tmp_path, model, optimizer, EVERY, keep=keep) as checkpoints:
        for step in range(1, 7):
            model(torch.ones(3)).sum().backward()
            optimizer.step()
            checkpoints.after_step(step)
    left = sorted(path.name for path in Path(tmp_path).iterdir())
    assert left == [checkpoint_path(tmp_path, s).name for s in (2, 4, 6)[-keep:]]


def test_master_weights_beside_the_model_are_saved_with_their_optimizer(tmp_path):
    """A bf16 model whose AdamW steps float32 masters (not the model's parameters): the
    masters and their moments come back; a checkpoint from before the first step loads
    into a fresh optimizer without state."""

    def bf16_with_masters(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2).bfloat16()
        masters = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
        return model, masters, torch.optim.AdamW(masters, lr=0.1)

    model, masters, optimizer = bf16_with_masters(0)
    save_checkpoint(checkpoint_path(tmp_path, 0), model, optimizer, 0)
    for master in masters:
        master.grad = torch.randn(master.shape)
    optimizer.step()
    save_checkpoint(checkpoint_path(tmp_path, 1), model, optimizer, 1)
    _, fresh_masters, fresh = bf16_with_masters(1)
    assert load_checkpoint(checkpoint_path(tmp_path, 0), model, fresh).step == 0
    assert not fresh.state
    load_checkpoint(checkpoint_path(tmp_path, 1), model, fresh)
    for master, loaded in zip(masters, fresh_masters, strict=True):
        assert torch.equal(master, loaded)
        assert all(torch.equal(optimizer.state[master][k], fresh.state[loaded][k])
                   for k in ("step", "exp_avg", "exp_avg_sq"))  # fmt: skip
