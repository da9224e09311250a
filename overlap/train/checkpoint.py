"""Checkpoints of a training job with ``torch.distributed.checkpoint`` (DCP), and its
restart from the last complete one.

A checkpoint is a folder ``step_<steps done>`` under the job's checkpoint folder, holding:

- the model's parameters (``state_dict``) and the optimizer's state (``state_dict``'s,
  by parameter position), with the optimizer's parameters that are not the model's
  (float32 master weights of a bf16 model), as the DTensor pieces they are: each rank
  writes its own, DCP writes a replicated tensor once. A checkpoint saved at one mesh
  loads at another (2 ranks to 4, the tensor-parallel split changed): DCP reads each
  rank's new piece out of the saved ones by the DTensor placements;
- the training position: the steps done, a dict of the caller's (its data loader's
  position, say), the optimizer's parameter groups (learning rates, ...), a
  learning-rate scheduler's state, and each ``ParallelModule``'s dropout seed and call
  count;
- every rank's random generators (torch's CPU generator, and its GPU's where it has
  one), restored only at the world size that saved them: another world has other ranks.

A ``ParallelModule``'s buffers are left out: ``parallelize`` makes them from the module
(rotary tables, masks), and each rank's piece of one is a plain tensor DCP would write once.

Complete means every rank wrote its part: DCP's coordinator (rank 0) writes the folder's
``.metadata`` last, once it has every rank's write results, by a rename (never half a
file). ``latest_checkpoint`` returns only folders that have it, so a checkpoint cut off
mid-write (a rank died, the job was stopped) is never loaded; a save into a folder that
holds one removes its ``.metadata`` first, so the folder is never complete while written.

``Checkpointer`` saves asynchronously (``dcp.async_save``): the state is copied to host
memory before the step returns, written by a thread while training goes on, the previous
save waited for before the next. Its collectives run on a gloo group of its own, so that
they never interleave with the training's on the default group. Restart: a job started
again (``overlap run --max-restarts N``, torchrun ``--max-restarts``) runs the same
script, whose ``Checkpointer.resume()`` loads the last complete checkpoint.

Example (on every rank)::

    model = parallelize(module, [x], communicator, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Checkpointer("checkpoints", model, optimizer, every=100) as checkpoints:
        start = checkpoints.resume()  # step 0, or where the last complete checkpoint was
        for step in range(start.step, steps):
            train_step(model, optimizer, batch(step))
            checkpoints.after_step(step + 1)  # saves at 100, 200, ...
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overlap.train.parallelize import ParallelModule

METADATA = ".metadata"  # DCP's: written last, by the coordinator, once every rank wrote
_STEP_FOLDER = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class TrainingPosition:
    """Where training continues: ``step`` steps done (the loop's next index), the caller's
    ``data`` as saved, and the checkpoint it came from (None: a fresh start)."""

    step: int
    data: dict = field(default_factory=dict)
    path: Path | None = None


@dataclass(frozen=True)
class _Progress:
    """The training position as saved: one object, the same on every rank."""

    step: int
    data: dict
    world_size: int
    parameter_groups: list[dict]  # the optimizer's, as its state_dict gives them
    scheduler: dict | None
    dropout: dict[str, tuple[int | None, int]]  # ParallelModule's name -> (seed, calls)


@dataclass(frozen=True)
class _RandomState:
    """One rank's random generators."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """The folder of the checkpoint after ``step`` steps under ``directory``."""
    return Path(directory) / f"step_{step:09d}"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint of the most steps under ``directory`` (one whose
    ``.metadata`` DCP wrote), or None; folders without it (cut off mid-write) are skipped."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in folder.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name)) and (path / METADATA).is_file()
    ]
    return max(complete)[1] if complete else None


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data: Mapping[str, Any] | None = None,
    scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save the checkpoint of ``step`` steps done into ``path`` (on every rank, a
    collective), waiting until it is complete; ``Checkpointer`` saves asynchronously."""
    import torch.distributed.checkpoint as dcp

    state = _state_to_save(model, optimizer, step, data, scheduler, process_group)
    path = _fresh_folder(path, process_group)
    dcp.save(state, checkpoint_id=path, process_group=process_group)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> TrainingPosition:
    """Load the checkpoint in ``path`` into ``model``, ``optimizer`` (and ``scheduler``),
    on every rank (a collective), resharded to their placements where the mesh changed;
    the dropout counters and, at the world size that saved it, the random generators
    restored. Returns the position saved with it."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {METADATA})")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if not optimizer.state and any(key.startswith("optimizer.state.") for key in saved):
        _make_optimizer_state(optimizer)  # the tensors to load into
    optimizer_state = _optimizer_state(model, optimizer)
    state = {"model": _model_state(model), "optimizer": optimizer_state, "progress": None}
    random_key = _random_key(_rank(process_group))
    if random_key in saved:
        state[random_key] = None
    # the tensors are loaded in place: the model's parameters, the optimizer's state
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    progress: _Progress = state["progress"]
    optimizer.load_state_dict({  # the state as loaded, and the parameter groups
        "state": {int(i): value for i, value in optimizer_state["state"].items()},
        "param_groups": progress.parameter_groups,
    })  # fmt: skip
    if scheduler is not None and progress.scheduler is not None:
        scheduler.load_state_dict(progress.scheduler)
    for name, module in _parallel_modules(model):
        if name in progress.dropout:
            module.seed, module.calls = progress.dropout[name]
    if progress.world_size == _world_size(process_group) and random_key in state:
        _restore_random(state[random_key])
    return TrainingPosition(progress.step, dict(progress.data), path)


def resume_or_start(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> TrainingPosition:
    """Load the last complete checkpoint under ``directory`` (on every rank, a
    collective) and return its position, or step 0 where there is none: what a training
    loop calls first, so that a restarted job continues where it left off. Rank 0 picks
    the checkpoint for every rank."""
    latest = [latest_checkpoint(directory)]
    if _world_size(process_group) > 1:
        dist.broadcast_object_list(latest, src=0, group=process_group)
    if latest[0] is None:
        return TrainingPosition(0)
    return load_checkpoint(latest[0], model, optimizer, scheduler, process_group)


class Checkpointer:
    """Asynchronous checkpoints of a training loop every ``every`` steps under
    ``directory``, and its resumption (see the module); ``keep``: the complete
    checkpoints left (the newest; None keeps every one). Made on every rank, in the same
    order (it makes a gloo group); ``close()`` (or leaving a ``with``) waits for the last
    save: a process that exits before loses it."""

    def __init__(
        self,
        directory: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int,
        scheduler: Any = None,
        keep: int | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"Checkpointer: every={every}, at least 1 step")
        if keep is not None and keep < 1:
            raise ValueError(f"Checkpointer: keep={keep}, at least 1 checkpoint (or None)")
        self.directory = Path(directory)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every, self.keep = every, keep
        # the saving thread's collectives on a group of their own: on the default one
        # they would interleave with the training's (and NCCL's cannot take host objects)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: Future | None = None

    def resume(self) -> TrainingPosition:
        """The last complete checkpoint loaded (``resume_or_start``), or step 0."""
        return resume_or_start(self.directory, self.model, self.optimizer, self.scheduler,
                               self.group)  # fmt: skip

    def after_step(self, step: int, data: Mapping[str, Any] | None = None) -> bool:
        """Call after each step, ``step`` the steps done: saves (asynchronously) when it is
        a multiple of ``every``, with ``data`` (the data loader's position, ...). Returns
        whether it saved."""
        if step == 0 or step % self.every:
            return False
        self.save(step, data)
        return True

    def save(self, step: int, data: Mapping[str, Any] | None = None) -> None:
        """Start saving the checkpoint of ``step`` steps done, once the previous one is
        complete; returns when the state is copied, the write goes on in a thread."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        state = _state_to_save(self.model, self.optimizer, step, data, self.scheduler,
                               self.group)  # fmt: skip
        path = _fresh_folder(checkpoint_path(self.directory, step), self.group)
        self._pending = dcp.async_save(state, checkpoint_id=path, process_group=self.group)

    def wait(self) -> None:
        """Wait for the save in flight (raising its error), then drop the checkpoints past
        ``keep``."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
        if self.keep is not None and _rank(self.group) == 0:
            _drop_older(self.directory, self.keep)

    def close(self) -> None:
        """Wait for the last save and release the group."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()


def _state_to_save(model, optimizer, step, data, scheduler, process_group) -> dict[str, Any]:
    progress = _Progress(
        step, dict(data or {}), _world_size(process_group),
        optimizer.state_dict()["param_groups"],
        None if scheduler is None else scheduler.state_dict(),
        {name: (m.seed, m.calls) for name, m in _parallel_modules(model)},
    )  # fmt: skip
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(torch.cuda.current_device())
    return {
        "model": _model_state(model),
        "optimizer": _optimizer_state(model, optimizer),
        "progress": progress,
        # a key of each rank's own: DCP writes one copy of values saved under one key
        _random_key(_rank(process_group)): _RandomState(torch.get_rng_state(), cuda),
    }


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's ``state_dict`` (DTensors stay DTensors) without the ParallelModules'
    buffers; refuses plain pieces (``dtensors=False``), which DCP would take for whole
    tensors."""
    buffers = set()
    for name, module in _parallel_modules(model):
        if module.torch_mesh is None and module.model.communicator.world_size > 1:
            raise ValueError(f"checkpoint: {name or 'the model'} was parallelized with "
                             "dtensors=False: its parameters are plain pieces, which DCP "
                             "cannot place; parallelize it with DTensors")  # fmt: skip
        prefix = f"{name}." if name else ""
        buffers |= {prefix + key for key in module.buffer_pieces}
    return {k: v for k, v in model.state_dict().items() if k not in buffers}


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state tensors by parameter position (its ``state_dict``'s, the
    tensors themselves), and its parameters that are not the model's (master weights)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    own = {id(p) for p in model.parameters()}
    return {
        "state": {str(i): state for i, state in optimizer.state_dict()["state"].items()},
        "parameters": {str(i): p.detach() for i, p in enumerate(parameters) if id(p) not in own},
    }


def _make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make a fresh optimizer's state, as DCP's ``get_state_dict`` does: one step with
    zero gradients at learning rate 0 (the parameters stay as they are); the gradients
    and rates put back."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    gradients = [p.grad for p in parameters]
    rates = [group["lr"] for group in optimizer.param_groups]
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * 0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient


def _parallel_modules(model: torch.nn.Module) -> list[tuple[str, ParallelModule]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelModule)]


def _fresh_folder(path: str | Path, process_group) -> Path:
    """``path`` made, and never complete while written: rank 0 removes a ``.metadata``
    left there before the save's first collective (no rank writes before it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if _rank(process_group) == 0:
        (path / METADATA).unlink(missing_ok=True)
    return path


def _drop_older(directory: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints, and the incomplete ones
    older than the newest complete one (cut off: never loaded)."""
    steps = sorted(
        (int(match.group(1)), path)
        for path in directory.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name))
    )
    complete = [step for step, path in steps if (path / METADATA).is_file()]
    if not complete:
        return
    kept = set(complete[-keep:])
    for step, path in steps:
        if step not in kept and step < complete[-1]:
            shutil.rmtree(path, ignore_errors=True)


def _random_key(rank: int) -> str:
    return f"random_state_rank{rank}"


def _restore_random(state: _RandomState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.cuda, torch.cuda.current_device())


def _rank(process_group) -> int:
    return dist.get_rank(process_group) if dist.is_initialized() else 0


def _world_size(process_group) -> int:
    return dist.get_world_size(process_group) if dist.is_initialized() else 1
