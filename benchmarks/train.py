"""Training ``examples/train_gpt.py``'s GPT: tokens per second and model FLOPs utilization,
ours against the same model under PyTorch's own stack, same plan, same batch, same steps.

    torchrun --nproc-per-node 2 benchmarks/train.py                 # GPUs: NCCL, bf16
    torchrun --nproc-per-node 4 benchmarks/train.py --dp 2 \\
        --out benchmarks/results/train_dp2_tp2.json                 # 2 x 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/train.py --smoke         # CPU: gloo, tiny
    torchrun --nproc-per-node 4 benchmarks/train.py --smoke --dp 2

``--dp D``: the world is D data-parallel replicas of a tensor-parallel team of
world / D consecutive ranks, as the example's ``--dp``; replica r trains on
``MarkovLanguage.batch(step, r)``, ``--batch`` sequences of its own a step.

Variants, each a whole training step (forward, backward, gradients widened into float32
masters, ``clip_grad_norm_``, AdamW, the schedule: ``examples.train_gpt.Trainer``):

- ``ours``: ``examples.train_gpt.build``: the model as one ``overlap.parallelize`` program
  (defaults: CUDA graphs on GPUs), over ``--dp`` replicas (``data_parallel``: the
  gradients all-reduced over the replicas during the backward, DDP's way);
- ``ours_per_block``: the same modules as 2 + layers programs, one ``parallelize`` each
  (the embedding; each block, its sequence-split piece in and out; the final norm, head
  and loss), chained by autograd: what the example chose against (its docstring says
  why; this row says what it costs or saves on GPUs, ``build_s`` and ``first_step_s``
  with it); over ``--dp`` replicas each program reduces its own gradients (one
  ``Communicator.split`` of the world shared by all);
- ``torch_tp``: ``parallelize_module(GPT, mesh["tp"], plan(layers))``, eager DTensor, the
  cross-entropy on the vocabulary's pieces under ``loss_parallel``; with ``--dp`` above
  1, on ``init_device_mesh(type, (dp, tp), ("dp", "tp"))`` and then FSDP2 over
  ``mesh["dp"]`` (``fully_shard`` on each block, the last not resharded after the
  forward, then on the model: torchtitan's recipe, its default mixed precision: none,
  the reduce in the parameters' bf16 as ours'). FSDP2, not DDP: it takes the tensor
  parallel DTensors (the parameters become 2-D DTensors, sharded over "dp" too) and
  ``Trainer`` works on it unchanged (the masters, AdamW and ``clip_grad_norm_`` on the
  sharded DTensors; the norm summed over both axes), on gloo as on NCCL. It shards the
  parameters, gradients and AdamW's state over the replicas, where ours keeps them
  whole on each (DDP's layout): its memory per rank should be the lower, at the price
  of an all-gather of each block's parameters in the forward and the backward;
- ``torch_tp_compile``: that under ``torch.compile``, with inductor's async tensor
  parallelism (``_micro_pipeline_tp``, symmetric memory on the tensor-parallel group)
  on more than one tensor-parallel rank (CUDA; on CPU it runs only when ``--variants``
  names it, without async TP). At ``--dp 1`` the whole model is compiled. Above, the
  embedding and each block are compiled on their own before ``fully_shard`` (torchtitan's
  recipe: FSDP2's hooks stay outside the graphs), the final norm, the head and the loss
  eager: on torch 2.13 (CPU, inductor and ``aot_eager`` alike) the whole model compiled
  over FSDP2 fails in the vocabulary-parallel embedding ("Mixing fake modes", torchtitan
  issue 534), and blocks compiled after an eager embedding lose the gradient of their
  input (no embedding gradient under FSDP2; without it, an ``AttributeError`` in the
  embedding's redistribute backward), which compiling the embedding as well avoids.

Each variant starts from the same weights and trains on the same batches; its losses
(the replicas' mean, ``examples.train_gpt.mean_over_replicas``) and gradient norms for
the first ``CHECKED`` steps must match one device's (the plain module, on every rank,
trained on the union of the replicas' batches, as the example's ``train`` checks)
within ``examples.train_gpt.tolerance``, on every rank: ours fails the run before
anything is timed; a peer of PyTorch's that far off is left out of the timing, its row
saying by how much (``wrong``: torch's FSDP2 x TP on 4 H200s, its gradient norm 2 %
off). Then each is timed over ``--steps`` more steps (the slowest rank's
median; the build and the first step, where the compilers run, reported apart): tokens
per second (every replica's tokens: a team's ranks share its batch), MFU (the model's
FLOPs a step, 6 per parameter per token plus the attention's ``12 * layers * hidden *
seq`` per token, PaLM's count, over the step's time and all the ranks' bf16 peak), and
each rank's peak memory. Figures go to ``benchmarks/results/train.json`` (``--out``);
``--smoke`` runs the tiny config on gloo ranks (no compiled variant unless named): a
check of this script, no figures worth keeping.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ag_matmul import torchrun_communicator  # noqa: E402
from benchmarks.kernels import write_results  # noqa: E402
from examples.train_gpt import (  # noqa: E402
    GPT,
    Config,
    MarkovLanguage,
    Trainer,
    build,
    mean_over_replicas,
    peak_memory_mib,
    plan,
    tolerance,
)

VARIANTS = ("ours", "ours_per_block", "torch_tp", "torch_tp_compile")
CHECKED = 3  # steps whose losses are compared with one device's
# dense bf16 peak per GPU, TFLOP/s, by a substring of torch.cuda.get_device_name
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "B200": 2250.0}
GPU_CONFIG = Config(layers=8, hidden=2048, heads=16, vocab=32768, seq=2048, batch=4,
                    lr=3e-4, warmup=10, dtype="bfloat16")  # fmt: skip


def model_flops_per_token(config: Config) -> float:
    """A training step's FLOPs per token (forward and backward): 6 per matmul parameter
    (the blocks' and the head's; a lookup costs none) and the attention's scores and
    weighted sums, ``12 * layers * hidden * seq`` (PaLM's appendix B; causal masking not
    discounted, as there)."""
    hidden, layers = config.hidden, config.layers
    block = 12 * hidden * hidden  # q, k, v, proj (4 h^2) and the 4x MLP (8 h^2)
    matmul_parameters = layers * block + hidden * config.vocab
    return 6 * matmul_parameters + 12 * layers * hidden * config.seq


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak (None on CPU or an unlisted GPU: no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


class PerBlock(torch.nn.Module):
    """``module``'s embedding, blocks and head each parallelized on its own by the
    example's plan (see ``ours_per_block``): ``forward(tokens, targets)`` is the loss."""

    def __init__(self, module: GPT, config: Config, communicator) -> None:
        super().__init__()
        from examples import gpt2_block
        from overlap import parallelize

        device = communicator.device
        dtype = getattr(torch, config.dtype)
        tokens = torch.zeros(config.batch, config.seq, dtype=torch.long, device=device)
        hidden = torch.zeros(config.batch, config.seq, config.hidden, dtype=dtype, device=device)
        whole = plan(0)
        # every piece over config.dp replicas, each its own gradients' reducer; the world's
        # split into teams made once (Communicator.split keeps it) for all of them
        dp = config.dp
        self.embed = parallelize(_Embedding(module.embed), [tokens], communicator,
                                 {"embed": whole["embed"]}, inputs=[Replicate()],
                                 data_parallel=dp)  # fmt: skip
        self.blocks = torch.nn.ModuleList(
            parallelize(block, [hidden], communicator, gpt2_block.PLAN, inputs=[Shard(1)],
                        outputs=[Shard(1)], data_parallel=dp)
            for block in module.blocks
        )  # fmt: skip
        self.head = parallelize(_Head(module.norm, module.head), [hidden, tokens.clone()],
                                communicator, {"norm": whole["norm"], "head": whole["head"]},
                                inputs=[Shard(1), Replicate()], data_parallel=dp)  # fmt: skip

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)


class _Embedding(torch.nn.Module):
    def __init__(self, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class _Head(torch.nn.Module):
    """``GPT``'s end: the final norm, the head and the loss, as ``GPT.forward`` has them."""

    def __init__(self, norm: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def torch_mesh(device: torch.device, dp: int):
    """torch's mesh of the ranks: 1-D ("tp",) over them all, or 2-D ("dp", "tp"), ``dp``
    replicas of ``world / dp`` consecutive ranks (ours' teams: ``Communicator.split``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    return init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "tp"))


def torch_stack(module: GPT, config: Config, mesh, compiled: bool) -> torch.nn.Module:
    """``module`` (a copy) under torch's tensor parallelism by the same plan over
    ``mesh["tp"]``, compiled if ``compiled``; its loss computed on the vocabulary's pieces
    (``loss_parallel``, entered by ``step``). On a 2-D mesh, FSDP2 over ``mesh["dp"]``
    (each block, then the model: torchtitan's recipe), the embedding and the blocks
    compiled one by one before that (see the module)."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = parallelize_module(copy.deepcopy(module), mesh["tp"], plan(config.layers))
    if mesh.ndim == 1:
        return torch.compile(model) if compiled else model
    from torch.distributed.fsdp import fully_shard

    if compiled:  # the embedding too: a block's input gradient is lost otherwise (module)
        model.embed = torch.compile(model.embed)
    for index, block in enumerate(model.blocks):
        if compiled:
            block = model.blocks[index] = torch.compile(block)
        # the last block not resharded after the forward: the backward needs it first
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=index < len(model.blocks) - 1)
    return fully_shard(model, mesh=mesh["dp"])


def data_parallel_reduce(model, step, tokens: torch.Tensor, device, trace: str | None) -> str:
    """One more step of ours recorded on a timeline (the lean path): the roof meter's line
    for the gradients' all-reduces over the replicas beside the backward (this rank's);
    the step's spans written as a Chrome trace to ``trace`` where given."""
    from overlap import Timeline

    model.model.timeline = timeline = Timeline(device)
    step(tokens)
    model.model.timeline = None
    if trace:
        timeline.write_chrome_trace(trace)
    (backward,) = model.model.executors[1:]
    return backward.explain_overlap(timeline).splitlines()[-1]


def largest_gap(values: list[float], references: list[float]) -> float:
    """The largest relative gap of ``values`` from ``references``, pair by pair."""
    return max(abs(v - r) / abs(r) for v, r in zip(values, references, strict=True))


def step_function(trainer: Trainer, torch_loss: bool):
    """``trainer.step`` on a batch, inside torch's ``loss_parallel`` for its stack."""
    from torch.distributed.tensor.parallel import loss_parallel

    def step(tokens: torch.Tensor) -> tuple[float, float]:
        with loss_parallel() if torch_loss else contextlib.nullcontext():
            return trainer.step(tokens)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (gloo)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas, each a team of world / dp ranks")  # fmt: skip
    parser.add_argument("--variants", help="comma-separated (default: all; on CPU all but "
                        "torch_tp_compile, which runs there when named, no async TP)")  # fmt: skip
    for field in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        parser.add_argument(f"--{field}", type=int, default=getattr(GPU_CONFIG, field))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/train.json"))
    args = parser.parse_args()
    communicator = torchrun_communicator(args.smoke)
    device, world, rank = communicator.device, communicator.world_size, communicator.rank
    if args.dp < 1 or world % args.dp:
        parser.error(f"{world} ranks do not make {args.dp} data-parallel replicas")
    dp, tp = args.dp, world // args.dp
    sizes = {f: getattr(args, f) for f in ("layers", "hidden", "heads", "vocab", "seq", "batch")}
    config = replace(Config() if args.smoke else replace(GPU_CONFIG, **sizes),
                     steps=CHECKED + args.steps + 1, dp=dp)  # fmt: skip
    # this rank's tensor-parallel team and its replica: the groups build's parallelize
    # splits (Communicator.split keeps them), torch's mesh the same ranks
    team = communicator.split(tp) if dp > 1 else communicator
    language = MarkovLanguage(config.vocab, config.seed)
    batches = [language.batch(step, team.replica, config.batch, config.seq).to(device)
               for step in range(config.steps)]  # fmt: skip
    torch.manual_seed(config.seed)  # the module as build makes it, alike on every rank
    module = GPT(config).to(device=device, dtype=getattr(torch, config.dtype))
    names = (args.variants.split(",") if args.variants else
             [n for n in VARIANTS if device.type == "cuda" or n != "torch_tp_compile"])  # fmt: skip
    if set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(names) - set(VARIANTS))}; {VARIANTS}")
    mesh = torch_mesh(device, dp) if any(n.startswith("torch") for n in names) else None
    if "torch_tp_compile" in names and tp > 1 and device.type == "cuda":
        from torch._inductor import config as inductor
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh["tp"].get_group().group_name)
    # one device: the plain module's first losses on the union of the replicas' batches
    # (their mean loss is the mean over it), the yardstick of every variant
    whole = Trainer(copy.deepcopy(module), config)
    unions = [torch.cat([language.batch(step, replica, config.batch, config.seq)
                         for replica in range(dp)]).to(device)
              for step in range(CHECKED)]  # fmt: skip
    expected = [whole.step(tokens) for tokens in unions]  # (loss, gradient norm) a step
    del whole, unions
    if rank == 0:  # each row printed when done: a variant that fails leaves the others'
        print(f"{world} ranks: {dp} data-parallel x {tp} tensor-parallel, {config.batch} "
              f"sequences of {config.seq} tokens a replica", flush=True)  # fmt: skip
        print(f"{'variant':18s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>6s} {'build s':>8s} "
              f"{'1st step s':>10s} {'loss gap':>8s} {'norm gap':>8s}  "
              "peak MiB per rank", flush=True)  # fmt: skip
    rows = []
    for name in names:
        start = time.perf_counter()
        if name == "ours":
            _, model, _ = build(config, communicator)
        elif name == "ours_per_block":
            model = PerBlock(copy.deepcopy(module), config, communicator)
        else:
            model = torch_stack(module, config, mesh, compiled=name == "torch_tp_compile")
        build_s = time.perf_counter() - start
        step = step_function(Trainer(model, config), torch_loss=name.startswith("torch"))
        start = time.perf_counter()
        first = step(batches[0])  # the first: our backward's build, torch.compile's
        first_step_s = time.perf_counter() - start
        checked = [first, *(step(tokens) for tokens in batches[1:CHECKED])]
        # the replicas' mean loss; the norm clipped by: every rank's pieces counted once
        checked = [(mean_over_replicas(loss, team), norm) for loss, norm in checked]
        loss_gap, norm_gap = (largest_gap([c[i] for c in checked], [e[i] for e in expected])
                              for i in (0, 1))  # fmt: skip
        # the worst rank's gap: every rank leaves a wrong peer out alike
        gap = torch.tensor([max(loss_gap, norm_gap)], dtype=torch.float64, device=device)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        if gap.item() > tolerance(getattr(torch, config.dtype)):
            message = (f"{name}'s first (loss, gradient norm) pairs {checked} are off one "
                       f"device's {expected} by up to {gap.item():.1e} on some rank")  # fmt: skip
            if name.startswith("ours"):
                raise AssertionError(f"rank {rank}: {message}")
            # a peer PyTorch computes wrong here: shown, not timed (as parallel_block.py)
            rows.append({"variant": name, **sizes, "world": world, "dp": dp, "tp": tp,
                         "wrong": message})  # fmt: skip
            if rank == 0:
                print(f"{name:18s} wrong, left out: {message}", flush=True)
            del model, step
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for tokens in batches[CHECKED:]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step(tokens)  # .item() inside: the step is done when it returns
            seconds.append(time.perf_counter() - start)
        median = torch.tensor([statistics.median(seconds[1:])], dtype=torch.float64, device=device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slowest rank's
        memories = [None] * world
        dist.all_gather_object(memories, round(peak_memory_mib(device)))
        tokens_per_s = dp * config.batch * config.seq / median.item()  # every replica's
        peak = peak_tflops(device)
        mfu = (tokens_per_s * model_flops_per_token(config) / (peak * 1e12 * world)
               if peak else None)  # fmt: skip
        rows.append({"variant": name, **sizes, "world": world, "dp": dp, "tp": tp,
                     "ms": round(median.item() * 1e3, 3),
                     "tokens_per_s": round(tokens_per_s), "mfu": mfu and round(mfu, 4),
                     "peak_mib_per_rank": memories, "largest_loss_gap": loss_gap,
                     "largest_norm_gap": norm_gap,
                     "build_s": round(build_s, 2),
                     "first_step_s": round(first_step_s, 2)})  # fmt: skip
        if rank == 0:
            row = rows[-1]
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            print(f"{name:18s} {row['ms']:9.1f} {row['tokens_per_s']:10,d} {mfu:>6s} "
                  f"{row['build_s']:8.1f} {row['first_step_s']:10.1f} "
                  f"{row['largest_loss_gap']:8.1e} {row['largest_norm_gap']:8.1e}  "
                  f"{row['peak_mib_per_rank']}", flush=True)  # fmt: skip
        if name == "ours" and dp > 1:  # the reduce beside the backward, on a timeline
            trace = None if args.smoke or rank else str(Path(args.out).with_suffix(".trace.json"))
            rows[-1]["dp_reduce"] = data_parallel_reduce(model, step, batches[-1], device, trace)
            if rank == 0:
                print(f"  ours, rank 0: {rows[-1]['dp_reduce']}", flush=True)
        del model, step  # its memory back before the next variant's
    if rank == 0 and not args.smoke:
        write_results(args.out, device, 0.0, rows, world)
    dist.barrier()  # the ranks leave together (see benchmarks/parallel_block.py)
    if args.smoke:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
