"""Training a GPT (token embedding, N GPT-2 blocks, final LayerNorm, a vocabulary-parallel
head) tensor-parallel, and data-parallel over replicas of that, on a synthetic language the
script generates; with checkpoints, and restarted from the last one after a failure.

    overlap run --nproc 2 examples/train_gpt.py                        # CPU, gloo: tiny
    overlap run --launcher torchrun --nproc 2 examples/train_gpt.py \\
        --layers 8 --hidden 2048 --heads 16 --seq 2048 --batch 4 --vocab 32768 --steps 200
    overlap run --nproc 4 --max-restarts 3 examples/train_gpt.py --dp 2 \\
        --checkpoint-dir checkpoints --checkpoint-every 5              # 2 x 2, restartable
    python examples/train_gpt.py --steps 50                            # alone: one rank

The model is plain PyTorch (``GPT``): ``nn.Embedding``, ``examples.gpt2_block.Block`` N
times, ``nn.LayerNorm``, an ``nn.Linear`` head without bias, and ``F.cross_entropy`` on the
logits in float32. ``overlap.parallelize`` captures all of it as one program and places it
by PyTorch's own tensor-parallel plan (``plan(layers)``, as a torch user writes it for
``parallelize_module``, torchtitan's layout): the embedding split by vocabulary, its partial
lookups reduce-scattered into the sequence split; each block sequence parallel between
its norms, heads and MLP features split in it; the head split by vocabulary, and the
cross-entropy computed on each rank's [tokens, vocab / ranks] logits, the ranks combining
only their per-token max and sum of exponentials: the script fails if the forward program
moves a [tokens, vocab] tensor, and prints any the backwards move.

Mixed precision (``--dtype bfloat16``, the default on GPUs): the model computes in bf16;
the optimizer, PyTorch's AdamW, steps float32 master copies of the parameters
(``MasterWeights``), whose bf16 images the model reads: AdamW's moments are float32 and
the updates are not lost to bf16 rounding. The gradients are clipped by their global
norm over every rank's pieces (``torch.nn.utils.clip_grad_norm_`` on the DTensor
gradients: a split gradient's squares are summed over the ranks, a replicated one's
counted once), and the learning rate follows a linear warmup and a cosine decay.

The data (``MarkovLanguage``): a first-order Markov chain over ``--vocab`` tokens, each
token followed by one of ``BRANCHES`` successors drawn once from a fixed seed, with fixed
probabilities: a uniform guess costs log(vocab) nats a token, the chain's entropy rate
(printed as the floor) is what a model that learned it pays. Every batch is a function of
its step and its data-parallel replica (``batch(step, replica)``): a resumed run needs no
more than the step to continue its data.

One ``parallelize`` call for the whole model, not one per block, the embedding and the
head: it is what a torch user writes (``parallelize_module`` on the model), the planner
and the layout chooser see across the blocks' boundaries, and a step is one forward and
one backward program (on GPUs one CUDA graph each, where separate modules replay 2N + 4
graphs with their own input copies). Its cost is the build: on 2 gloo ranks (hidden 32,
one thread a rank, a shared CPU) ``parallelize`` then the first step (which builds the
backward) took 4.8 + 2.2 s whole against 3.2 + 2.2 s per block at 1 layer, 11.5 + 9.7
against 4.6 + 6.9 at 4, 12.0 + 9.1 against 4.1 + 6.0 at 8, the steps after alike (0.26
against 0.29 s at 8 layers). ``benchmarks/train.py`` times both on GPUs
(``ours_per_block``, with the build and the first step): where the step is no faster
whole, separate blocks (or one block's program captured once for all N) are the better
structure.

Data parallel (``--dp D``): the world is D replicas of a tensor-parallel team of
world / D consecutive ranks, from the same ``parallelize`` call (``data_parallel=D``, a
("dp", "tp") mesh); replica r trains on ``MarkovLanguage.batch(step, r)``, ``--batch``
sequences of its own, and its gradients are averaged over the replicas during the
backward (``overlap.train.data_parallel``). The loss printed is the replicas' mean: the
mean over all their sequences, which one device training on the union of the replicas'
batches computes (``--check-steps`` does that).

Checkpoints (``--checkpoint-dir DIR --checkpoint-every K``): ``overlap.Checkpointer``
saves the model's DTensor parameters, the optimizer's state (the float32 masters' AdamW,
the masters too where the model is bf16), the schedule and the step every K steps,
asynchronously; at the start, whatever the attempt, the job resumes from the last
complete checkpoint under DIR (the step is the data position: ``batch(step, replica)``).
A job started with ``overlap run --max-restarts N`` (or torchrun's, or ``--launcher ray
--max-restarts N``) that loses a rank starts every rank again, and so continues from
there; the losses are those of a job never stopped, bit for bit on CPUs (on GPUs within
rounding: torch's ``index_add_`` and attention backward add in no fixed order).
``--fail-at STEP`` is a test hook: rank 1 exits (``os._exit(1)``, no exception, no
cleanup) at that step in the first attempt only (``rank_environment().restart_count ==
0``).

Rank 0 prints, every ``--log-every`` steps, the loss, the learning rate, the gradient
norm, tokens per second (all the replicas' tokens over the step's time: a replica's
ranks share its batch) and the peak memory of each rank. ``--check-steps K`` also trains
the same model on one device for the first K steps, from the same weights and batches,
and fails unless the losses and the gradient norms agree within ``tolerance(dtype)``; a
resumed run compares nothing (one device would have to start from the checkpoint too).
``--losses-json PATH``: rank 0 writes the step this attempt started from and its losses
(for tests and plots).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import gpt2_block  # noqa: E402
from fusion.definition import FusionDefinition  # noqa: E402
from launch import rank_environment  # noqa: E402
from overlap import Checkpointer, parallelize  # noqa: E402
from overlap.train.plans import place  # noqa: E402

BRANCHES = torch.tensor([0.5, 0.25, 0.15, 0.1])  # each token's successors' probabilities


@dataclass(frozen=True)
class Config:
    """The model's and the run's sizes (the command line's flags)."""

    layers: int = 2
    hidden: int = 32
    heads: int = 4
    vocab: int = 96  # an extent no other axis has: a move of the logits would show
    seq: int = 16
    batch: int = 4
    steps: int = 20
    lr: float = 1e-2  # the command line picks by width when not given (``parse``)
    warmup: int = 3
    weight_decay: float = 0.1
    clip: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    dp: int = 1  # data-parallel replicas, each ``batch`` sequences a step


def tolerance(dtype: torch.dtype) -> float:
    """How far our loss may be from one device's, relative: float32 sums the ranks'
    pieces in another order (1e-4, as the other examples); bf16 (eps 7.8e-3) rounds
    each block's activations where our kernels and one device's round them, the ranks'
    partial sums before combining them: 1e-2 (the mean over the tokens averages the
    roundings out; the tiny config on 2 gloo ranks measured 1.7e-4)."""
    return 1e-4 if dtype == torch.float32 else 1e-2


class GPT(torch.nn.Module):
    """A decoder-only language model: ``forward(tokens, targets)`` is the mean
    cross-entropy of predicting ``targets`` [batch, seq] from ``tokens`` [batch, seq]."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab, config.hidden)
        self.blocks = torch.nn.ModuleList(
            gpt2_block.Block(config.hidden, config.heads) for _ in range(config.layers)
        )
        self.norm = torch.nn.LayerNorm(config.hidden)
        self.head = torch.nn.Linear(config.hidden, config.vocab, bias=False)
        # positions: none learned; the causal attention of a Markov chain needs none
        for name, parameter in self.named_parameters():
            if name.endswith("weight") and parameter.ndim == 2:
                torch.nn.init.normal_(parameter, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def plan(layers: int) -> dict:
    """PyTorch's tensor-parallel plan for ``GPT`` (torchtitan's layout): the vocabulary
    split at both ends, the sequence split between the blocks and around the norms."""
    entries: dict = {
        # each rank looks up the rows of the vocabulary it holds; the partial lookups are
        # reduce-scattered into the sequence split the first block's norm reads
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # gathered from the sequence split; each rank its vocabulary's logits, handed on
        # as a DTensor (torch's loss_parallel computes the cross-entropy on those)
        "head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    for layer in range(layers):
        entries.update({f"blocks.{layer}.{name}": style
                        for name, style in gpt2_block.PLAN.items()})  # fmt: skip
    return entries


class MarkovLanguage:
    """A first-order Markov chain over ``vocab`` tokens with a fixed seed (see the module):
    ``batch(step, replica)`` is [batch, seq + 1] tokens, the same on every rank that asks
    for the same step and replica."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.stack(
            [torch.randperm(vocab, generator=generator)[: len(BRANCHES)] for _ in range(vocab)]
        )
        self.seed = seed

    def entropy_rate(self) -> float:
        """Nats a token of the chain carries: the loss of a model that learned it."""
        return float(-(BRANCHES * BRANCHES.log()).sum())

    def batch(self, step: int, replica: int, batch: int, seq: int) -> torch.Tensor:
        """Sequences [batch, seq + 1] for ``step`` of data-parallel ``replica``."""
        # one seed per (seed, step, replica), spelled out: Python's hash of a tuple may
        # change between versions, and a resumed run must draw the same batches
        mixed = (self.seed * 1_000_003 + step) * 1_000_003 + replica
        generator = torch.Generator().manual_seed(mixed % 2**63)
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=generator)
        branch = torch.multinomial(BRANCHES, batch * seq, replacement=True,
                                   generator=generator).view(batch, seq)  # fmt: skip
        for position in range(seq):
            tokens[:, position + 1] = self.successors[tokens[:, position], branch[:, position]]
        return tokens


class MasterWeights:
    """Float32 master copies of ``parameters`` that ``optimizer_class`` steps; after each
    step the model's (bf16) parameters take their rounded values. The gradients, computed
    in the model's dtype, are widened into the masters' ``grad`` first, so that clipping
    and AdamW's moments run in float32. For float32 parameters the masters are the
    parameters themselves (no copy)."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], optimizer_class=None,
                 **options) -> None:  # fmt: skip
        self.parameters = list(parameters)
        self.copies = any(p.dtype != torch.float32 for p in self.parameters)
        self.masters = [
            torch.nn.Parameter(p.detach().float()) if self.copies else p for p in self.parameters
        ]
        self.optimizer = (optimizer_class or torch.optim.AdamW)(self.masters, **options)

    def gradients_to_masters(self) -> None:
        """The model's gradients widened into the masters' (nothing to do in float32)."""
        if self.copies:
            for parameter, master in zip(self.parameters, self.masters, strict=True):
                master.grad = None if parameter.grad is None else parameter.grad.float()
                parameter.grad = None

    def step(self) -> None:
        """AdamW on the masters, then the model's parameters rounded from them."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.copies:
            with torch.no_grad():
                for parameter, master in zip(self.parameters, self.masters, strict=True):
                    parameter.copy_(master)


def schedule(optimizer: torch.optim.Optimizer, warmup: int, steps: int,
             floor: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    """The learning rate: a linear warmup over ``warmup`` steps, then a cosine decay to
    ``floor`` times the peak at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """One model (ours parallelized, or the plain module on one device) with its master
    weights, optimizer and schedule; ``step(tokens)`` trains on one batch and returns
    the loss and the gradients' global norm before clipping."""

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        self.model, self.config = model, config
        self.masters = MasterWeights(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                     weight_decay=config.weight_decay)  # fmt: skip
        self.scheduler = schedule(self.masters.optimizer, config.warmup, config.steps)

    def step(self, tokens: torch.Tensor) -> tuple[float, float]:
        """One training step on ``tokens`` [batch, seq + 1]: (loss, gradient norm)."""
        loss = self.model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        self.masters.gradients_to_masters()
        norm = torch.nn.utils.clip_grad_norm_(self.masters.masters, self.config.clip)
        self.masters.step()
        self.scheduler.step()
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return loss.item(), norm.item()


def vocabulary_moves(model, config: Config) -> tuple[list[str], list[str]]:
    """The communications of ``model``'s forward program, and of its backwards built so
    far, that move a [tokens, vocab]-sized tensor (the logits, or their gradient): none
    in the forward, when the loss is computed on the vocabulary's pieces."""

    def moves(executor) -> list[str]:
        return [f"{c.op_name} {list(c.output.shape)}" for c in executor.communications
                if config.vocab in c.output.shape and math.prod(c.output.shape)
                == config.batch * config.seq * config.vocab]  # fmt: skip

    forward, *backwards = model.model.executors
    return moves(forward), [move for executor in backwards for move in moves(executor)]


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory: the GPU's allocations on CUDA, the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


@dataclass(frozen=True)
class Options:
    """The command line's flags other than the config's: what the run checks, logs and
    saves (see the module)."""

    check_steps: int = 3
    log_every: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    fail_at: int | None = None
    losses_json: str | None = None


def parse(argv: Sequence[str], device: torch.device) -> tuple[Config, Options]:
    """The command line: the config and the options."""
    defaults = Config(dtype="bfloat16" if device.type == "cuda" else "float32")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, value in vars(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--check-steps", type=int, default=Options.check_steps,
                        help="train one device beside ours for this many steps")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=Options.log_every)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resume from its last complete checkpoint; save there")  # fmt: skip
    parser.add_argument("--checkpoint-every", type=int, default=Options.checkpoint_every,
                        help="steps between checkpoints")  # fmt: skip
    parser.add_argument("--fail-at", type=int, default=None,
                        help="test hook: rank 1 exits at this step, first attempt")  # fmt: skip
    parser.add_argument("--losses-json", default=None,
                        help="rank 0 writes this attempt's start and losses there")  # fmt: skip
    parser.set_defaults(lr=None)
    args = vars(parser.parse_args(argv))
    options = {field: args.pop(field) for field in vars(Options())}
    if args["lr"] is None:  # by width, as GPT-3's table: 2e-4 at 2048 (1e-2 diverges there)
        args["lr"] = min(Config.lr, 0.5 / args["hidden"])
    return Config(**args), Options(**options)


def build(config: Config, communicator) -> tuple[GPT, torch.nn.Module, float]:
    """The module (seeded alike on every rank) and ours parallelized from it over
    ``config.dp`` replicas, with the seconds ``parallelize`` took (capture, placing,
    compiling the forward)."""
    device, dtype = communicator.device, getattr(torch, config.dtype)
    torch.manual_seed(config.seed)
    module = GPT(config).to(device=device, dtype=dtype)
    # two tensors: one passed twice would be captured as one input read twice
    examples = [torch.zeros(config.batch, config.seq, dtype=torch.long, device=device)
                for _ in ("tokens", "targets")]  # fmt: skip
    start = time.perf_counter()
    model = parallelize(module, examples, communicator, plan(config.layers),
                        inputs=[Replicate(), Replicate()],
                        data_parallel=config.dp)  # fmt: skip
    return module, model, time.perf_counter() - start


def fusion(world_size: int) -> FusionDefinition:
    """The default config's model as ``parallelize`` captures and places it by ``plan``,
    for ``overlap dump`` (the program the forward runs, the loss included)."""
    config = Config()
    torch.manual_seed(config.seed)
    examples = [torch.zeros(config.batch, config.seq, dtype=torch.long)
                for _ in ("tokens", "targets")]  # fmt: skip
    return place(GPT(config), examples, world_size, plan(config.layers),
                 inputs=[Replicate(), Replicate()]).fd  # fmt: skip


def mean_over_replicas(value: float, team) -> float:
    """The mean of ``value`` over ``team``'s data-parallel replicas (a collective)."""
    if team.replicas == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=team.device)
    dist.all_reduce(total, group=team.replica_group)
    return total.item() / team.replicas


def train(communicator, config: Config, check_steps: int = 0, log_every: int = 1,
          log=print, checkpoint_dir: str | None = None, checkpoint_every: int = 10,
          fail_at: int | None = None) -> dict:  # fmt: skip
    """Train ``config`` on ``communicator``'s ranks (``config.dp`` replicas); with
    ``checkpoint_dir``, resumed from its last complete checkpoint and saved to it every
    ``checkpoint_every`` steps; ``fail_at``: the test hook (see the module). Returns the
    step this run started from, its per-step losses (the replicas' mean) and gradient
    norms; one device's for the first ``check_steps`` of a run from step 0 (the job fails
    unless they agree within ``tolerance``), the largest relative gap, and the
    communications that moved [tokens, vocab] tensors (``vocabulary_moves``)."""
    device, rank, world = communicator.device, communicator.rank, communicator.world_size
    module, model, build_s = build(config, communicator)
    team = model.model.communicator  # this rank's tensor-parallel team, and its replica
    language = MarkovLanguage(config.vocab, config.seed)
    ours = Trainer(model, config)
    with contextlib.ExitStack() as stack:
        checkpoints = None
        if checkpoint_dir is not None:
            checkpoints = stack.enter_context(Checkpointer(
                checkpoint_dir, model, ours.masters.optimizer, checkpoint_every,
                scheduler=ours.scheduler))  # fmt: skip
        start = checkpoints.resume().step if checkpoints is not None else 0
        first_attempt = rank_environment().restart_count == 0
        # one device: the same module, whole, on every replica's batch; it trains only
        # for the steps compared
        whole = Trainer(module, config) if check_steps and start == 0 else None
        if rank == 0:
            parameters = sum(p.numel() for p in module.parameters())
            resumed = f"; resumed after step {start}" if start else ""
            log(f"train_gpt: {parameters / 1e6:.2f} M parameters, {config.layers} layers, "
                f"hidden {config.hidden}, vocab {config.vocab}, {config.dtype}, {world} rank"
                f"{'s' if world > 1 else ''} ({config.dp} data-parallel x {team.world_size} "
                f"tensor-parallel); parallelize {build_s:.1f} s; a uniform guess "
                f"{math.log(config.vocab):.3f}, the language's floor "
                f"{language.entropy_rate():.3f} nats a token{resumed}")  # fmt: skip
        losses, norms, whole_losses, whole_norms = [], [], [], []
        worst = 0.0
        for step in range(start, config.steps):
            if step == fail_at and rank == 1 and first_attempt:
                os._exit(1)  # the test hook: a rank dies, no exception, no cleanup
            batches = [language.batch(step, replica, config.batch, config.seq)
                       for replica in range(config.dp)]  # fmt: skip
            tokens = batches[team.replica].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            loss, norm = ours.step(tokens)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - began
            loss = mean_over_replicas(loss, team)
            losses.append(loss)
            norms.append(norm)
            if checkpoints is not None:
                checkpoints.after_step(step + 1)
            if whole is not None and step < check_steps:
                # the replicas' mean loss: the mean over the union of their batches
                whole_loss, whole_norm = whole.step(torch.cat(batches).to(device))
                whole_losses.append(whole_loss)
                whole_norms.append(whole_norm)
                # the norm clipped by: every rank's pieces counted once, as one device's whole
                worst = max(worst, abs(loss - whole_loss) / abs(whole_loss),
                            abs(norm - whole_norm) / whole_norm)  # fmt: skip
                if step + 1 == check_steps:
                    whole = None  # its memory back
            if step % log_every == 0 or step == config.steps - 1:
                memories = [None] * world
                dist.all_gather_object(memories, round(peak_memory_mib(device)))
                if rank == 0:
                    done = step - start
                    compared = (f"  one device {whole_losses[done]:.4f}"
                                if done < len(whole_losses) else "")  # fmt: skip
                    tokens_per_s = config.dp * config.batch * config.seq / seconds
                    log(f"step {step:4d}  loss {loss:.4f}{compared}  lr "
                        f"{ours.scheduler.get_last_lr()[0]:.2e}  grad norm {norm:.3f}  "
                        f"{tokens_per_s:,.0f} tokens/s  peak MiB per rank "
                        f"{memories}")  # fmt: skip
    forward_moves, backward_moves = vocabulary_moves(model, config)
    if forward_moves:
        raise AssertionError(f"rank {rank}: the forward moved the logits: {forward_moves}")
    if backward_moves and rank == 0:
        log(f"train_gpt: the backward moves [tokens, vocab] tensors: {backward_moves}")
    if worst > tolerance(getattr(torch, config.dtype)):
        raise AssertionError(f"rank {rank}: the losses or gradient norms differ from one "
                             f"device's by up to {worst:.1e} in the first {check_steps} "
                             "steps")  # fmt: skip
    return {"start": start, "losses": losses, "norms": norms, "one_device": whole_losses,
            "one_device_norms": whole_norms, "worst": worst,
            "forward_moves": forward_moves, "backward_moves": backward_moves}  # fmt: skip


def main(communicator) -> None:
    config, options = parse(sys.argv[1:], communicator.device)
    result = train(communicator, config, options.check_steps, options.log_every,
                   lambda line: print(line, flush=True), options.checkpoint_dir,
                   options.checkpoint_every, options.fail_at)  # fmt: skip
    if communicator.rank != 0:
        return
    start, losses, checked = result["start"], result["losses"], len(result["one_device"])
    if options.losses_json is not None:
        Path(options.losses_json).write_text(json.dumps({"start": start, "losses": losses}))
    if not losses:
        print(f"train_gpt: nothing to train: the checkpoint is of step {start}", flush=True)
        return
    compared = (f"; the first {checked} match one device (largest relative gap "
                f"{result['worst']:.1e})" if checked else "")  # fmt: skip
    last = losses[-5:]  # each step's batch differs: the last few steps' mean
    print(f"train_gpt: loss {losses[0]:.3f} -> {sum(last) / len(last):.3f} (the last "
          f"{len(last)} steps' mean) in steps {start} to {config.steps - 1}{compared}",
          flush=True)  # fmt: skip


if __name__ == "__main__":  # run directly: under torchrun, or alone
    from launch import init

    main(init())
