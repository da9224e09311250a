"""Transformer blocks parallelized from PyTorch: ``overlap.train.parallelize`` against
PyTorch's own tensor parallelism, eager and compiled, one training step each.

    torchrun --nproc-per-node 2 benchmarks/parallel_block.py [--smoke] [--blocks llama,gpt2]

The blocks (``--blocks``; each a table and rows with ``block`` set): ``llama``, below,
and the catalogue's (``examples/catalogue.py``: ``gpt2``, ``llama_hf``, ``bert``, ``vit``,
at ``CATALOGUE_SIZES``: GPT-2 medium's width, a Llama-3 8B layer, BERT-large's, ViT-L's),
each under its own torch plan, unchanged, for both frameworks; inputs and output placed
between blocks as the catalogue says.

The ``llama`` block is ordinary PyTorch modules in bf16: RMSNorm, attention (q, k, v, rotary
embeddings, ``scaled_dot_product_attention``, causal; the output projection), residual,
RMSNorm, a SwiGLU MLP, residual; the tokens split over the ranks between blocks. One
plan in torch's styles places it for both frameworks: the norms ``SequenceParallel``,
the attention's and the MLP's inputs gathered (``PrepareModuleInput``), q, k, v, gate
and up column-wise, o and down row-wise into ``Shard(0)``. A step is the forward and
the backward from a fixed output gradient. Variants, timed side by side (interleaved
rounds, the median of each, the slowest rank's):

- ``ours``: ``parallelize(block, [x], communicator, PLAN, outputs=["sequence"])`` with
  nothing else set: what a user gets (parameters as DTensors); ``ours_save_everything``
  with ``saved="everything"`` (the forward keeps what the backward reads, as eager
  autograd does), ``ours_lean`` with ``cuda_graph=False`` (CUDA only: the host issues
  every step instead of replaying CUDA graphs, the default on GPUs);
- ``torch_tp``: ``torch.distributed.tensor.parallel.parallelize_module(block, mesh,
  PLAN)``, eager (DTensor);
- ``torch_tp_compile``: that under ``torch.compile``, with inductor's async tensor
  parallelism (``_micro_pipeline_tp``) on more than one rank (CUDA only);
- ``eager`` and ``compile``: the whole block unparallelized (one rank only, where these
  are the peers).

Before anything is timed, every variant's output piece and every gradient (parameters
as whole tensors, through ``DTensor.full_tensor``, and the input's piece) is checked on
every rank against float32 autograd of the whole block: the largest error over the
expected tensor's root mean square. The yardstick is the same block unparallelized in
eager bf16 (its worst error, ``eager_error`` in every row): a variant more than
``TOLERANCE`` times as far off (plus ``SLACK`` epsilons) fails the run where it is ours
(each implementation rounds its bf16 steps at its own places, so none is bitwise anyone's
reference); a peer of PyTorch's that far off is left out of the timing, its row saying by
how much (``wrong``: torch's eager TP of the GPT-2 block on 2x H200 at ``f8c9bee``). Each
variant's worst goes in its row. The check reads the third step (after the warm-up and
the graphs' capture: a replayed step is what is checked). ``host_us``: the host's time to
issue one step, the device kept busy (``benchmarks.timing.host_ms``).
Figures go to ``benchmarks/results/parallel_block.json``. ``--smoke`` runs tiny shapes
on gloo ranks (no compiled variant): a check of this script, no figures worth keeping.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ag_matmul import torchrun_communicator  # noqa: E402
from benchmarks.kernels import write_results  # noqa: E402
from benchmarks.timing import host_ms, profile_steps, slowest, time_rounds  # noqa: E402
from examples.llama_block import MLP, rotary_tables  # noqa: E402  (the example's)
from overlap import parallelize  # noqa: E402

TOLERANCE = 2.0  # a variant's worst error over eager bf16's
# epsilons allowed beside it: in bf16, 16; in float32 (the smoke run, where the yardstick
# is the reference itself and errs by 0), the sums of a block in another order: a
# Llama layer's MLP weight gradient read 3.4e-6 of its RMS (29 epsilons) on 2 gloo ranks
SLACK = {torch.bfloat16: 16, torch.float32: 256}
HOST_CALLS = 10  # steps issued in a row to time the host
HOST_BUSY_MS = 300.0  # the device's wait first: longer than 10 steps take to issue
SHAPE = (4096, 4096, 32, 14336)  # tokens (whole), hidden, heads, ffn: a Llama-3 8B block
SMOKE_SHAPE = (16, 32, 4, 64)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * (
            self.weight
        )


class Attention(torch.nn.Module):
    """A batch of one, heads by a view with -1 (whole heads on one device, a rank's under
    torch's column-wise projections): [batch, heads, tokens, dim] for the attention."""

    def __init__(self, hidden: int, heads: int, longest: int) -> None:
        super().__init__()
        self.dim = hidden // heads
        self.q, self.k, self.v, self.o = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in "qkvo"
        )
        cos, sin = rotary_tables(self.dim, longest)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def rotate(self, t, tokens):
        half = self.dim // 2
        turned = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return (t * self.cos[:tokens] + turned * self.sin[:tokens]).to(t.dtype)

    def forward(self, x):
        tokens = x.shape[0]
        q, k, v = (
            proj(x).view(1, tokens, -1, self.dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        q, k = self.rotate(q, tokens), self.rotate(k, tokens)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(tokens, -1))


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, longest: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attention, self.mlp = Attention(hidden, heads, longest), MLP(hidden, ffn)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def plan():
    """torch's tensor-parallel plan for the block (the tokens are axis 0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gathered():
        return PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))

    return {
        "attention_norm": SequenceParallel(sequence_dim=0), "attention": gathered(),
        "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(), "attention.o": RowwiseParallel(output_layouts=Shard(0)),
        "mlp_norm": SequenceParallel(sequence_dim=0), "mlp": gathered(),
        "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(0)),
    }  # fmt: skip


def parameter(module: torch.nn.Module, variant: str, name: str) -> torch.Tensor:
    """The variant's parameter for the block's parameter ``name``."""
    if variant.startswith("ours"):
        return module.pieces[name.replace(".", "__")]
    named = {key.removeprefix("_orig_mod."): p for key, p in module.named_parameters()}
    return named[name]


def rms(tensor: torch.Tensor) -> float:
    return tensor.float().square().mean().sqrt().item()


def error_over_rms(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """The largest error over the expected tensor's root mean square, or over ``floor``
    where that is larger (a gradient that is zero but for rounding, as a key projection's
    bias's: softmax ignores what the bias adds alike to every key)."""
    expected = expected.float()
    scale = max(rms(expected), floor, 1e-30)
    return (actual.float() - expected).abs().max().item() / scale


# the catalogue's blocks at benchmark sizes (``examples/catalogue.py``): their
# constructors' sizes, and (batch, sequence); the smoke run's in the second dict
CATALOGUE_SIZES = {
    "gpt2": ({"hidden": 1024, "heads": 16}, (4, 1024)),
    "llama_hf": (
        {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "longest": 4096},
        (1, 4096),
    ),
    "bert": ({"hidden": 1024, "heads": 16, "ffn": 4096}, (8, 512)),
    "vit": ({"hidden": 1024, "heads": 16, "ffn": 4096}, (16, 192)),
}
CATALOGUE_SMOKE = {
    "gpt2": ({"hidden": 32, "heads": 4}, (2, 8)),
    "llama_hf": ({"hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64}, (2, 8)),
    "bert": ({"hidden": 32, "heads": 4, "ffn": 64}, (2, 8)),
    "vit": ({"hidden": 32, "heads": 4, "ffn": 64}, (2, 8)),
}


@dataclass
class BenchBlock:
    """One block to time: the module in float32 (the ground truth), whole example inputs,
    torch's plan, and the inputs' and output's placements between blocks."""

    module: torch.nn.Module
    inputs: list[torch.Tensor]
    plan: dict
    placements: list
    output: object
    shape: dict


def llama_block(smoke: bool, device: torch.device) -> BenchBlock:
    """The Llama-3 8B block above, the tokens split along axis 0."""
    from torch.distributed.tensor import Shard

    tokens, hidden, heads, ffn = SMOKE_SHAPE if smoke else SHAPE
    torch.manual_seed(0)
    module = Block(hidden, heads, ffn, tokens).to(device)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(device)
    shape = {"tokens": tokens, "hidden": hidden, "heads": heads, "ffn": ffn}
    return BenchBlock(module, [x], plan(), [Shard(0)], Shard(0), shape)


def catalogue_block(name: str, smoke: bool, device: torch.device) -> BenchBlock:
    """``examples/catalogue.py``'s block ``name`` at ``CATALOGUE_SIZES``' sizes."""
    from examples.catalogue import CATALOGUE

    entry = CATALOGUE[name]
    sizes, (batch, seq) = (CATALOGUE_SMOKE if smoke else CATALOGUE_SIZES)[name]
    torch.manual_seed(0)
    module = entry.make(**sizes).to(device)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(batch, seq, sizes["hidden"], generator=generator)]
    if name == "bert":  # the attention mask: the last quarter of the second row padded
        mask = torch.ones(batch, seq)
        mask[1, seq - seq // 4 :] = 0.0
        inputs.append(mask)
    shape = {"batch": batch, "seq": seq, **sizes}
    return BenchBlock(module, [x.to(device) for x in inputs], entry.plan, entry.placements,
                      entry.outputs[0], shape)  # fmt: skip


def cut(tensor: torch.Tensor, placement, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of ``tensor`` under a torch placement (``Shard(d)``: torch's
    even chunks; ``Replicate()``: whole)."""
    dim = getattr(placement, "dim", None)
    if dim is None:
        return tensor
    return tensor.tensor_split(world, dim=dim)[rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo)")
    parser.add_argument("--blocks", default="llama," + ",".join(CATALOGUE_SIZES),
                        help="llama (the block above) and the catalogue's")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--profile", metavar="FOLDER",
                        help="profile steps of ours and torch.compile TP's into FOLDER "
                        "(rank 0's tables and traces: benchmarks.timing)")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/parallel_block.json"))
    args = parser.parse_args()
    communicator = torchrun_communicator(args.smoke)
    device, world, rank = communicator.device, communicator.world_size, communicator.rank
    rows = []
    for name in args.blocks.split(","):
        if name == "llama":
            block = llama_block(args.smoke, device)
        else:
            block = catalogue_block(name, args.smoke, device)
        block_rows = run_block(communicator, block, args, name)
        for row in block_rows:
            row["block"] = name
        rows += block_rows
        if rank == 0:
            print(f"\n{name} {block.shape}")
            print(f"{'variant':22s} {'step ms':>9s} {'x ours':>7s} {'max error/RMS':>14s} "
                  f"{'host us':>8s}")  # fmt: skip
            for row in block_rows:
                if "wrong" in row:
                    print(f"{row['variant']:22s} {'wrong':>9s} (left out: see above)")
                    continue
                print(f"{row['variant']:22s} {row['ms']:9.3f} {row['vs_ours']:7.2f} "
                      f"{row['max_error']:14.4f} {row['host_us']:8.1f}", flush=True)  # fmt: skip
    if rank == 0 and not args.smoke:
        write_results(args.out, device, 0.0, rows, world)
    # the ranks leave together, as blocks.py's do: a rank tearing its gloo groups down
    # while rank 0 still prints aborted at exit now and then ("terminate called without
    # an active exception", the smoke run under a loaded CPU). On GPUs the teardown stays
    # at exit, after the CUDA graphs are released (overlap.runtime.graphs)
    dist.barrier()
    if args.smoke:
        dist.destroy_process_group()


def run_block(communicator, block: BenchBlock, args, block_name: str) -> list[dict]:
    """Every variant of one block checked on every rank, then timed (see the module)."""
    device, world, rank = communicator.device, communicator.world_size, communicator.rank
    dtype = torch.float32 if args.smoke else torch.bfloat16
    reference = block.module  # float32: the ground truth
    generator = torch.Generator().manual_seed(2)
    x, *rest = block.inputs
    x_leaf = x.clone().requires_grad_()
    y_whole = reference(x_leaf, *rest)
    seed = torch.randn(y_whole.shape, generator=generator).to(device)
    names = [name for name, _ in reference.named_parameters()]
    expected = torch.autograd.grad(y_whole, [*reference.parameters(), x_leaf], seed)
    # a bias's gradient measured against its weight's where its own is near zero (see
    # error_over_rms): they sum the same output gradients, the weight's times unit inputs
    scales = dict(zip(names, (rms(grad) for grad in expected), strict=False))
    floors = {name: scales.get(name.removesuffix("bias") + "weight", 0.0)
              if name.endswith(".bias") else 0.0 for name in names}  # fmt: skip

    def pieces(tensors, whole: bool) -> list[torch.Tensor]:
        return [t if whole else cut(t, p, rank, world)
                for t, p in zip(tensors, block.placements, strict=True)]  # fmt: skip

    def torch_tp():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (world,))
        return parallelize_module(copy.deepcopy(reference).to(dtype), mesh, block.plan)

    def ours(**options):
        examples = [t.to(dtype) if t.is_floating_point() else t for t in block.inputs]
        return lambda: parallelize(copy.deepcopy(reference).to(dtype), examples, communicator,
                                   block.plan, inputs=block.placements,
                                   outputs=[block.output], **options)  # fmt: skip

    variants = {"ours": ours(), "ours_save_everything": ours(saved="everything")}
    if device.type == "cuda":
        variants["ours_lean"] = ours(cuda_graph=False)
    variants["torch_tp"] = torch_tp
    if device.type == "cuda":
        variants["torch_tp_compile"] = lambda: torch.compile(torch_tp())
        if world > 1:
            from torch._inductor import config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            config._micro_pipeline_tp = True
            enable_symm_mem_for_group(dist.group.WORLD.group_name)
    if world == 1:
        variants["eager"] = lambda: copy.deepcopy(reference).to(dtype)
        if device.type == "cuda":
            variants["compile"] = lambda: torch.compile(copy.deepcopy(reference).to(dtype))
    rows, steps, checked = [], {}, {}
    # the yardstick: the block unparallelized in bf16, on every rank (timed on one rank)
    yardstick = {"eager_bf16": lambda: copy.deepcopy(reference).to(dtype)}
    for name, build in {**yardstick, **variants}.items():
        module = build()
        whole = name == "eager_bf16"
        inputs = [t.to(dtype) if t.is_floating_point() else t
                  for t in pieces(block.inputs, whole)]  # fmt: skip
        x_piece = inputs[0].clone().requires_grad_()
        inputs[0] = x_piece
        seed_piece = (seed if whole else cut(seed, block.output, rank, world)).to(dtype)

        def step(module=module, inputs=inputs, x_piece=x_piece, seed_piece=seed_piece):
            module.zero_grad(set_to_none=True)
            x_piece.grad = None
            module(*inputs).backward(seed_piece)

        for _ in range(2):  # the warm-up and the graphs' capture: the third step is checked
            step()
        module.zero_grad(set_to_none=True)
        x_piece.grad = None
        out = module(*inputs)
        out.backward(seed_piece)
        wanted = y_whole.detach() if whole else cut(y_whole.detach(), block.output, rank, world)
        x_grad = expected[-1] if whole else cut(expected[-1], block.placements[0], rank, world)
        errors = {"output": error_over_rms(out.detach(), wanted),
                  "x": error_over_rms(x_piece.grad, x_grad)}  # fmt: skip
        for whole_name, grad_wanted in zip(names, expected, strict=False):
            grad = parameter(module, name, whole_name).grad
            grad = grad.full_tensor() if type(grad).__name__ == "DTensor" else grad
            errors[whole_name] = error_over_rms(grad, grad_wanted, floors[whole_name])
        worst = torch.tensor([max(errors.values())], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank's
        checked[name] = (worst.item(), errors)
        if name in variants:
            steps[name] = step
    eager_error = checked["eager_bf16"][0]
    wrong = {}  # a peer PyTorch computes wrong here: shown, not timed (ours: raised)
    for name, (worst, errors) in checked.items():
        if worst > TOLERANCE * eager_error + SLACK[dtype] * torch.finfo(dtype).eps:
            message = (f"{name}: an output or gradient is off by {worst:.3g} of its RMS on "
                       f"some rank, eager bf16 by {eager_error:.3g} (rank {rank}: "
                       f"{ {k: round(v, 4) for k, v in errors.items()} })")  # fmt: skip
            if name.startswith("ours") or name == "eager_bf16":
                raise AssertionError(message)
            wrong[name] = message
            if rank == 0:
                print(f"left out, wrong: {message}", flush=True)
            steps.pop(name, None)
        if name in steps:
            rows.append({"variant": name, "max_error": round(worst, 5),
                         "eager_error": round(eager_error, 5)})  # fmt: skip
    rows += [{"variant": name, "wrong": message, **block.shape, "world": world}
             for name, message in wrong.items()]  # fmt: skip
    for function in steps.values():
        function()  # warm-up (compilations)
    if args.profile:
        profile_steps(steps, ("ours", "torch_tp_compile"), block_name, args.profile,
                      communicator)  # fmt: skip
    times = slowest(time_rounds(steps, device, args.rounds, args.iterations), device)
    host = slowest({name: host_ms(step, HOST_CALLS, device, busy_ms=HOST_BUSY_MS)
                    for name, step in steps.items()}, device)  # fmt: skip
    for row in rows:
        if "wrong" in row:
            continue
        row.update(**block.shape, world=world, ms=round(times[row["variant"]], 4),
                   vs_ours=round(times[row["variant"]] / times["ours"], 3),
                   host_us=round(host[row["variant"]] * 1e3, 1))  # fmt: skip
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
