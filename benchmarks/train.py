"""Training ``examples/train_gpt.py``'s GPT: tokens per second and model FLOPs utilization,
ours against the same model under PyTorch's own stack, same plan, same batch, same steps.

    torchrun --nproc-per-node 2 benchmarks/train.py                 # GPUs: NCCL, bf16
    torchrun --nproc-per-node 2 benchmarks/train.py --smoke         # CPU: gloo, tiny

Variants, each a whole training step (forward, backward, gradients widened into float32
masters, ``clip_grad_norm_``, AdamW, the schedule: ``examples.train_gpt.Trainer``):

- ``ours``: ``examples.train_gpt.build``: the model as one ``overlap.parallelize`` program
  (defaults: CUDA graphs on GPUs);
- ``ours_per_block``: the same modules as 2 + layers programs, one ``parallelize`` each
  (the embedding; each block, its sequence-split piece in and out; the final norm, head
  and loss), chained by autograd: what the example chose against (its docstring says
  why; this row says what it costs or saves on GPUs, ``build_s`` and ``first_step_s``
  with it);
- ``torch_tp``: ``parallelize_module(GPT, mesh, plan(layers))``, eager DTensor, the
  cross-entropy on the vocabulary's pieces under ``loss_parallel``;
- ``torch_tp_compile``: that under ``torch.compile``, with inductor's async tensor
  parallelism (``_micro_pipeline_tp``) on more than one rank (CUDA only).

Each variant starts from the same weights and trains on the same batches; its losses
for the first ``CHECKED`` steps must match one device's (the plain module, on every
rank) within ``examples.train_gpt.tolerance``, on every rank, or the run fails before
anything is timed. Then each is timed over ``--steps`` more steps (the slowest rank's
median; the build and the first step, where the compilers run, reported apart): tokens
per second (all ranks' tokens: the batch is the whole model's), MFU (the model's FLOPs
a step, 6 per parameter per token plus the attention's ``12 * layers * hidden * seq``
per token, PaLM's count, over the step's time and the ranks' bf16 peak), and each
rank's peak memory. Figures go to
``benchmarks/results/train.json``; ``--smoke`` runs the tiny config on gloo ranks (no
compiled variant): a check of this script, no figures worth keeping.
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
    peak_memory_mib,
    plan,
    tolerance,
)

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
        self.embed = parallelize(_Embedding(module.embed), [tokens], communicator,
                                 {"embed": whole["embed"]}, inputs=[Replicate()])  # fmt: skip
        self.blocks = torch.nn.ModuleList(
            parallelize(block, [hidden], communicator, gpt2_block.PLAN, inputs=[Shard(1)],
                        outputs=[Shard(1)])
            for block in module.blocks
        )  # fmt: skip
        self.head = parallelize(_Head(module.norm, module.head), [hidden, tokens.clone()],
                                communicator, {"norm": whole["norm"], "head": whole["head"]},
                                inputs=[Shard(1), Replicate()])  # fmt: skip

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


def torch_stack(module: GPT, config: Config, device: torch.device, compiled: bool):
    """``module`` (a copy) under torch's tensor parallelism by the same plan; its loss
    computed on the vocabulary's pieces (``loss_parallel``, entered by ``step``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = parallelize_module(copy.deepcopy(module), mesh, plan(config.layers))
    return torch.compile(model) if compiled else model


def step_function(trainer: Trainer, torch_loss: bool):
    """``trainer.step`` on a batch, inside torch's ``loss_parallel`` for its stack."""
    from torch.distributed.tensor.parallel import loss_parallel

    def step(tokens: torch.Tensor) -> float:
        with loss_parallel() if torch_loss else contextlib.nullcontext():
            loss, _ = trainer.step(tokens)
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (gloo)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--variants", default="ours,ours_per_block,torch_tp,torch_tp_compile")
    for field in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        parser.add_argument(f"--{field}", type=int, default=getattr(GPU_CONFIG, field))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/train.json"))
    args = parser.parse_args()
    communicator = torchrun_communicator(args.smoke)
    device, world, rank = communicator.device, communicator.world_size, communicator.rank
    sizes = {f: getattr(args, f) for f in ("layers", "hidden", "heads", "vocab", "seq", "batch")}
    config = Config(steps=CHECKED + args.steps + 1) if args.smoke else replace(
        GPU_CONFIG, steps=CHECKED + args.steps + 1, **sizes)  # fmt: skip
    language = MarkovLanguage(config.vocab, config.seed)
    batches = [language.batch(step, 0, config.batch, config.seq).to(device)
               for step in range(config.steps)]  # fmt: skip
    torch.manual_seed(config.seed)  # the module as build makes it, alike on every rank
    module = GPT(config).to(device=device, dtype=getattr(torch, config.dtype))
    names = args.variants.split(",")
    if device.type != "cuda" or world == 1:
        names = [n for n in names if n != "torch_tp_compile" or device.type == "cuda"]
    if "torch_tp_compile" in names and world > 1:
        from torch._inductor import config as inductor
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor._micro_pipeline_tp = True
        enable_symm_mem_for_group(dist.group.WORLD.group_name)
    # one device: the plain module's first losses, the yardstick of every variant
    whole = Trainer(copy.deepcopy(module), config)
    expected = [whole.step(tokens)[0] for tokens in batches[:CHECKED]]
    del whole
    rows = []
    for name in names:
        start = time.perf_counter()
        if name == "ours":
            _, model, _ = build(config, communicator)
        elif name == "ours_per_block":
            model = PerBlock(copy.deepcopy(module), config, communicator)
        else:
            model = torch_stack(module, config, device, compiled=name == "torch_tp_compile")
        build_s = time.perf_counter() - start
        step = step_function(Trainer(model, config), torch_loss=name.startswith("torch"))
        start = time.perf_counter()
        losses = [step(batches[0])]  # the first: our backward's build, torch.compile's
        first_step_s = time.perf_counter() - start
        losses += [step(tokens) for tokens in batches[1:CHECKED]]
        gaps = [abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)]
        if max(gaps) > tolerance(getattr(torch, config.dtype)):
            raise AssertionError(f"rank {rank}: {name}'s first losses {losses} are off one "
                                 f"device's {expected} by up to {max(gaps):.1e}")  # fmt: skip
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
        tokens_per_s = config.batch * config.seq / median.item()
        peak = peak_tflops(device)
        mfu = (tokens_per_s * model_flops_per_token(config) / (peak * 1e12 * world)
               if peak else None)  # fmt: skip
        rows.append({"variant": name, **sizes, "world": world, "ms": round(median.item() * 1e3, 3),
                     "tokens_per_s": round(tokens_per_s), "mfu": mfu and round(mfu, 4),
                     "peak_mib_per_rank": memories, "largest_loss_gap": max(gaps),
                     "build_s": round(build_s, 2),
                     "first_step_s": round(first_step_s, 2)})  # fmt: skip
        del model, step  # its memory back before the next variant's
    if rank == 0:
        print(f"{'variant':18s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>6s} {'build s':>8s} "
              f"{'1st step s':>10s}  peak MiB per rank")  # fmt: skip
        for row in rows:
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            print(f"{row['variant']:18s} {row['ms']:9.1f} {row['tokens_per_s']:10,d} {mfu:>6s} "
                  f"{row['build_s']:8.1f} {row['first_step_s']:10.1f}  "
                  f"{row['peak_mib_per_rank']}", flush=True)  # fmt: skip
        if not args.smoke:
            write_results(args.out, device, 0.0, rows, world)
    dist.barrier()  # the ranks leave together (see benchmarks/parallel_block.py)
    if args.smoke:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
