"""Whole tensor-parallel blocks: what a user gets by default, against the limit and PyTorch.

Run on every GPU of one host (one process each):

    torchrun --nproc-per-node 2 benchmarks/blocks.py

Two sequence-parallel blocks (tokens split over the ranks, bf16), built with the public
API as a user writes them:

- ``mlp``: RMSNorm, all-gather, gate and up projections (column-parallel),
  silu(gate) * up, down projection (row-parallel), back to token pieces, + the residual;
- ``attention``: RMSNorm, all-gather, Q, K and V projections (column-parallel; 8 KV
  heads), the output projection (row-parallel) of Q standing in for the attention's
  output (the attention kernel itself is not ours to time here), back to token pieces,
  + the residual; K and V are outputs too (column pieces, as a KV cache keeps them).

Variants, timed side by side (interleaved rounds, each the median of its rounds, every
figure the slowest rank's; the ranks brought together by a barrier before each timed
batch, as otherwise the first variant of a round counts the time a rank waits in its
collectives for a peer still finishing the last round: the default, first, read 2-23x
``no_check`` on the same executor on 4x H200):

- ``default``: ``MultiDeviceExecutor(fd, communicator)`` and ``run(local)``, nothing set:
  what a user gets (on GPUs, replayed from CUDA graphs);
- ``no_check``: the same executor run with ``check_inputs="never"`` (the default must
  cost within 3 % of it: it exchanges nothing on a run whose inputs are as before);
- ``lean``: the same with ``cuda_graph=False``, the host issuing every step (CUDA only:
  on CPUs that is the default);
- ``forced``: the fastest of the planner's forced choices (each transport, one and two
  chunks a rank), named in the row;
- ``sequential``: ours with ``OverlapOptions(overlap=False)``;
- ``eager``: PyTorch eager, NCCL collectives and cuBLAS one after the other;
- ``symm_mem``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (every projection of the
  gathered rows at once) and ``fused_matmul_reduce_scatter`` (CUDA only);
- ``compile_async_tp``: the eager block under ``torch.compile`` with inductor's
  ``_micro_pipeline_tp`` over functional collectives (CUDA only).

The limit T* = max(t_compute, t_comm + t_compute / P): t_compute the block's kernels
(norm, matmuls, pointwise) alone on a rank's shapes, the faster of PyTorch's eager ones
and our program on one device (all the tokens, a rank's share of the columns); t_comm
the all-gather and the reduce-scatter alone. Every variant's output on every rank is
checked before anything is timed, against the block computed on one device in float32
from the whole inputs (no bf16 rounding between its steps; cut to the rank's piece):
every element within ``ULPS`` bf16 epsilons of the element's magnitude plus the output's
root mean square (each implementation rounds its bf16 intermediates at its own places,
so none is bitwise anyone's reference); each variant's largest error over the output's
RMS goes in the row (``max_error``). ``host_us``: the host's time to issue one call of
the default (and of the lean path and eager PyTorch), measured while the GPU is busy
(``benchmarks.timing.host_ms``). Figures go to ``benchmarks/results/blocks.json``.

Training rows (``mlp_train``, in ``--blocks`` by default): the MLP block's forward and
backward, from the same leaves and output gradient, as ``TrainableFusion`` gives it by
default (the matmuls' outputs saved: gate and up), with everything recomputed
(``saved="nothing"``) and, on GPUs, without CUDA graphs (``cuda_graph=False``),
against PyTorch eager autograd over functional collectives and that under
torch.compile with async TP. Every rank's gradients are checked against float32 autograd
of the whole block first (``GRAD_ULPS`` bf16 epsilons). The limit T* counts the
forward's and the backward's compute (PyTorch's, communications left out) and twice the
all-gather and reduce-scatter (the backward moves as much as the forward). Each
variant's saved-activation memory per rank is reported (intermediates kept from the
forward for the backward, inputs excluded).

``--smoke`` runs tiny shapes on CPU processes with gloo (the reference evaluator, no
CUDA-only variant): a check of this script, no figures worth keeping.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.ag_matmul import torchrun_communicator  # noqa: E402
from benchmarks.kernels import compiled_alone  # noqa: E402
from benchmarks.timing import host_ms, profile_steps, slowest, time_rounds  # noqa: E402
from fusion import FusionDefinition  # noqa: E402
from overlap import (  # noqa: E402
    MultiDeviceExecutor,
    OverlapOptions,
    Timeline,
    TrainableFusion,
)
from overlap.comm.measure import measure_hardware_figures  # noqa: E402
from sharding import DeviceMesh, Shard, shard  # noqa: E402

# (tokens, hidden, ffn); the attention block takes tokens and hidden, 8 KV heads of 128
SHAPES = [(8192, 8192, 28672), (16384, 4096, 14336), (2048, 4096, 14336)]
SMOKE_SHAPES = [(64, 32, 64), (36, 16, 24)]
KV_HEADS, HEAD_DIM, SMOKE_HEAD_DIM = 8, 128, 2
EPS = 1e-6


# -- the blocks, as fusions ------------------------------------------------------------


def _rmsnorm(fd, x, gamma):
    x32 = fd.ops.cast(x, "float32")
    mean_square = fd.ops.mean(x32 * x32, dims=[1], keepdim=True)
    scale = fd.ops.broadcast(fd.ops.cast(gamma, "float32"), [True, False])
    return x32, fd.ops.cast(x32 * fd.ops.rsqrt(mean_square + EPS) * scale, "bfloat16")


def _residual(fd, projected, x32):
    return fd.ops.cast(fd.ops.cast(projected, "float32") + x32, "bfloat16")


def build_mlp(tokens: int, hidden: int, ffn: int, world: int, placed: bool = True):
    """The SwiGLU MLP block; ``placed=False`` leaves it on one device (no annotations)."""
    mesh = DeviceMesh(world)
    with FusionDefinition("sp_swiglu_mlp") as fd:
        x = fd.define_tensor([tokens, hidden], "bfloat16")
        gamma = fd.define_tensor([hidden], "bfloat16")
        w_gate = fd.define_tensor([ffn, hidden], "bfloat16")
        w_up = fd.define_tensor([ffn, hidden], "bfloat16")
        w_down = fd.define_tensor([hidden, ffn], "bfloat16")
        x32, normed = _rmsnorm(fd, x, gamma)
        gate = fd.ops.cast(fd.ops.linear(normed, w_gate), "float32")
        up = fd.ops.cast(fd.ops.linear(normed, w_up), "float32")
        down = fd.ops.linear(fd.ops.cast(fd.ops.silu(gate) * up, "bfloat16"), w_down)
        out = _residual(fd, down, x32)
        fd.add_output(out)
    if not placed:
        return fd
    shard(x, mesh, [Shard(0)])
    shard(w_gate, mesh, [Shard(0)])
    shard(w_up, mesh, [Shard(0)])
    shard(w_down, mesh, [Shard(1)])
    shard(out, mesh, [Shard(0)])
    return fd


def build_attention(tokens: int, hidden: int, kv: int, world: int, placed: bool = True,
                    heads_width: int | None = None):  # fmt: skip
    """The attention projections block; ``placed=False`` leaves it on one device, with
    Q ``heads_width`` wide (default ``hidden``)."""
    mesh = DeviceMesh(world)
    width = heads_width or hidden
    with FusionDefinition("sp_attention_projections") as fd:
        x = fd.define_tensor([tokens, hidden], "bfloat16")
        gamma = fd.define_tensor([hidden], "bfloat16")
        w_q = fd.define_tensor([width, hidden], "bfloat16")
        w_k = fd.define_tensor([kv, hidden], "bfloat16")
        w_v = fd.define_tensor([kv, hidden], "bfloat16")
        w_o = fd.define_tensor([hidden, width], "bfloat16")
        x32, normed = _rmsnorm(fd, x, gamma)
        q = fd.ops.linear(normed, w_q)
        k = fd.ops.linear(normed, w_k)
        v = fd.ops.linear(normed, w_v)
        out = _residual(fd, fd.ops.linear(q, w_o), x32)
        for output in (out, k, v):
            fd.add_output(output)
    if not placed:
        return fd
    shard(x, mesh, [Shard(0)])
    for weight in (w_q, w_k, w_v):
        shard(weight, mesh, [Shard(0)])
    shard(w_o, mesh, [Shard(1)])
    shard(out, mesh, [Shard(0)])
    shard(k, mesh, [Shard(1)])
    shard(v, mesh, [Shard(1)])
    return fd


def whole_inputs(fd: FusionDefinition, device: torch.device) -> list[torch.Tensor]:
    """The same whole inputs on every rank; weights scaled as a model initializes them."""
    generator = torch.Generator().manual_seed(0)
    values = []
    for tensor in fd.fusion.inputs:
        value = torch.randn([int(e) for e in tensor.shape], generator=generator)
        if tensor.ndim == 2 and values:  # a weight [out, in]
            value = value / value.shape[1] ** 0.5
        values.append(value.to(device, torch.bfloat16))
    return values


# -- PyTorch's versions of the blocks ----------------------------------------------------


def _eager_norm(x: torch.Tensor, gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    normed = x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + EPS) * gamma.float()
    return x32, normed.bfloat16()


def torch_block(block: str, project_gathered, project_scattered):
    """The block in PyTorch, from its communication and matmul steps:
    ``project_gathered(normed, weights)`` gathers and applies the column-parallel
    weights, ``project_scattered(h, w)`` applies the row-parallel one and scatters."""

    def mlp(x, gamma, w_gate, w_up, w_down):
        x32, normed = _eager_norm(x, gamma)
        gate, up = project_gathered(normed, [w_gate, w_up])
        h = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
        return [(project_scattered(h, w_down).float() + x32).bfloat16()]

    def attention(x, gamma, w_q, w_k, w_v, w_o):
        x32, normed = _eager_norm(x, gamma)
        q, k, v = project_gathered(normed, [w_q, w_k, w_v])
        return [(project_scattered(q, w_o).float() + x32).bfloat16(), k, v]

    return mlp if block == "mlp" else attention


# torch 2.13 renames the tensor collectives; 2.11 (the GPU machines) has the old names only
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def eager_block(block: str, world: int):
    """NCCL (or gloo) collectives and matmuls one after the other."""

    def project_gathered(normed, weights):
        gathered = normed.new_empty((normed.shape[0] * world, normed.shape[1]))
        _all_gather(gathered, normed)
        return [gathered @ w.t() for w in weights]

    def project_scattered(h, w):
        partial = h @ w.t()
        out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        _reduce_scatter(out, partial)
        return out

    return torch_block(block, project_gathered, project_scattered)


def symm_mem_block(block: str):
    """``torch.ops.symm_mem``'s fused all-gather+matmul and matmul+reduce-scatter."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group_name = dist.group.WORLD.group_name
    enable_symm_mem_for_group(group_name)

    def project_gathered(normed, weights):
        _, outputs = torch.ops.symm_mem.fused_all_gather_matmul(
            normed, [w.t() for w in weights], gather_dim=0, group_name=group_name
        )
        return outputs

    def project_scattered(h, w):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            h, w.t(), "sum", scatter_dim=0, group_name=group_name
        )

    return torch_block(block, project_gathered, project_scattered)


def compiled_async_tp_block(block: str):
    """The block over functional collectives, compiled with inductor's micro-pipelined
    tensor parallelism (its all-gather+matmul and matmul+reduce-scatter fusions)."""
    import torch._inductor.config as inductor_config
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group = dist.group.WORLD
    enable_symm_mem_for_group(group.group_name)
    inductor_config._micro_pipeline_tp = True

    def project_gathered(normed, weights):
        gathered = funcol.all_gather_tensor(normed, 0, group)
        return [torch.mm(gathered, w.t()) for w in weights]

    def project_scattered(h, w):
        return funcol.reduce_scatter_tensor(torch.mm(h, w.t()), "sum", 0, group)

    return compiled_alone(torch_block(block, project_gathered, project_scattered))


def ours_alone(block: str, shape, kv: int, world: int, device: torch.device):
    """Our program of the block on one device at one rank's shapes (all the tokens,
    a rank's share of the columns): our kernels' compute, with no communication."""
    tokens, hidden, ffn = shape
    if block == "mlp":
        fd = build_mlp(tokens, hidden, ffn // world, 1, placed=False)
    else:
        fd = build_attention(tokens, hidden, kv // world, 1, placed=False,
                             heads_width=hidden // world)  # fmt: skip
    executor = MultiDeviceExecutor(fd, None)
    inputs = whole_inputs(fd, device)
    return lambda: executor.run(inputs)


def parts_alone(block: str, local: list[torch.Tensor], world: int) -> dict:
    """The block's compute in PyTorch (no communication) and its two communications,
    alone, on this rank's shapes: for the limit T*."""
    x, gamma, weights = local[0], local[1], local[2:]
    gathered_normed = x.new_empty((x.shape[0] * world, x.shape[1])).normal_()

    def compute():
        x32, _ = _eager_norm(x, gamma)
        outs = [gathered_normed @ w.t() for w in weights[:-1]]
        if block == "mlp":
            h = (torch.nn.functional.silu(outs[0].float()) * outs[1].float()).bfloat16()
        else:
            h = outs[0]
        partial = h @ weights[-1].t()
        return (partial[: x.shape[0]].float() + x32).bfloat16()

    normed_piece = x.clone()
    partial_sum = x.new_empty((x.shape[0] * world, x.shape[1])).normal_()
    scattered = x.new_empty(x.shape)

    def communication():
        _all_gather(gathered_normed, normed_piece)
        _reduce_scatter(scattered, partial_sum)

    return {"t_compute_eager": compute, "t_comm": communication}


# -- the check ------------------------------------------------------------------------

ULPS = 4
HOST_CALLS = 10  # calls issued in a row to time the host (the median taken)
HOST_BUSY_MS = 200.0  # the device's wait first: longer than any block's 20 calls take to issue
# Gradients: a bf16 backward rounds every bf16 gradient it passes (casts, each matmul's
# result) and sums with cancellation; PyTorch eager's come 8 epsilons of the RMS off
GRAD_ULPS = 16
BF16_EPS = torch.finfo(torch.bfloat16).eps


def exact_outputs(block: str, full: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole block in float32 on this device: no rounding between its steps."""
    x, gamma, *weights = (t.float() for t in full)
    normed = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * gamma
    if block == "mlp":
        w_gate, w_up, w_down = weights
        h = torch.nn.functional.silu(normed @ w_gate.t()) * (normed @ w_up.t())
        return [h @ w_down.t() + x]
    w_q, w_k, w_v, w_o = weights
    return [(normed @ w_q.t()) @ w_o.t() + x, normed @ w_k.t(), normed @ w_v.t()]


def checked_error(outputs, exact, what: str, ulps: int = ULPS) -> float:
    """The largest error over the output's RMS; raises past the stated tolerance."""
    worst = 0.0
    for position, (actual, wanted) in enumerate(zip(outputs, exact, strict=True)):
        if actual.shape != wanted.shape:
            raise AssertionError(f"{what} output {position}: shape {tuple(actual.shape)}, "
                                 f"expected {tuple(wanted.shape)}")  # fmt: skip
        error = (actual.float() - wanted).abs()
        rms = wanted.square().mean().sqrt().clamp_min(1e-30)
        allowed = ulps * BF16_EPS * (wanted.abs() + rms)
        bad = ~(error <= allowed)  # NaN counts as bad
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(
                f"{what} output {position}: {int(bad.sum())} of {bad.numel()} elements off, "
                f"first at {index}: {actual[index].item()} against {wanted[index].item()} "
                f"(allowed {allowed[index].item():.4g})"
            )
        worst = max(worst, (error.max() / rms).item())
    return worst


def _failed_anywhere(failure: str | None, world: int) -> str | None:
    """Every rank's verdict on a variant, before the next one runs: a variant that failed
    on any rank is left out on all (its collectives would find no peer)."""
    verdicts = [None] * world
    dist.all_gather_object(verdicts, failure)
    return next((verdict for verdict in verdicts if verdict is not None), None)


# -- training rows ------------------------------------------------------------------


def _funcol_block(world: int, gather_op, scatter_op):
    """The MLP block in PyTorch over ``gather_op``/``scatter_op`` (autograd-aware)."""

    def project_gathered(normed, weights):
        gathered = gather_op(normed)
        return [gathered @ w.t() for w in weights]

    def project_scattered(h, w):
        return scatter_op(h @ w.t())

    return torch_block("mlp", project_gathered, project_scattered)


def _saved_bytes(call, leaves) -> int:
    """Bytes autograd saves for the backward during ``call()``, the leaves excluded."""
    mine = {leaf.data_ptr() for leaf in leaves}
    seen: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in mine:
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return sum(seen.values())


def run_training(communicator, shape, args) -> dict:
    import torch.distributed._functional_collectives as funcol

    world, device = communicator.world_size, communicator.device
    tokens, hidden, ffn = shape
    fd = build_mlp(tokens, hidden, ffn, world)
    full = whole_inputs(fd, device)
    seed = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    seed = (seed / tokens).to(device, torch.bfloat16)
    wide = [t.float().requires_grad_() for t in full]
    (whole_out,) = exact_outputs("mlp", wide)
    exact = torch.autograd.grad(whole_out, wide, seed.float())
    models = {"ours": TrainableFusion(fd, communicator),
              "ours_recompute": TrainableFusion(fd, communicator, saved="nothing")}  # fmt: skip
    if device.type == "cuda":  # the host issuing every step instead of graph replays
        models["ours_lean"] = TrainableFusion(fd, communicator, cuda_graph=False)
    exact_pieces = models["ours"].shard_inputs(list(exact))
    (seed_piece,) = models["ours"].shard_outputs([seed])
    leaves = [t.clone().requires_grad_() for t in models["ours"].shard_inputs(full)]
    group = dist.group.WORLD
    eager = _funcol_block(
        world,
        lambda t: funcol.all_gather_tensor_autograd(t, 0, group),
        lambda t: funcol.reduce_scatter_tensor_autograd(t, "sum", 0, group),
    )
    forwards = {name: (lambda m=model: m(*leaves)) for name, model in models.items()}
    forwards["eager"] = lambda: eager(*leaves)
    if device.type == "cuda":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
        import torch._inductor.config as inductor_config

        inductor_config._micro_pipeline_tp = True
        compiled = compiled_alone(eager)
        forwards["compile_async_tp"] = lambda: compiled(*leaves)
    # the compute alone: the gather and the scatter replaced by copies of their sizes
    rows_here = leaves[0].shape[0]
    compute_only = _funcol_block(world, lambda t: t.repeat(world, 1),
                                 lambda t: t[:rows_here] * 1.0)  # fmt: skip
    forwards["t_compute"] = lambda: compute_only(*leaves)

    def step(forward, combine_gamma: bool = False):
        for leaf in leaves:
            leaf.grad = None
        (out, *_) = forward()
        out.backward(seed_piece)
        if combine_gamma:  # PyTorch leaves a replicated weight's gradient partial per
            dist.all_reduce(leaves[1].grad)  # rank: Megatron all-reduces it, as here
        return [leaf.grad for leaf in leaves]

    errors, failed, memory = {}, {}, {}
    for name, forward in list(forwards.items()):
        failure = None
        try:
            for _ in range(2):
                grads = step(forward, name not in models and name != "t_compute")
            if name in models:  # what ours saves: its pieces of the saved intermediates
                memory[name] = sum(p.numel() * p.element_size()
                                   for p in _saved_pieces(models[name], leaves))  # fmt: skip
            elif name != "t_compute":
                memory[name] = _saved_bytes(forward, leaves)
            if name != "t_compute":
                what = f"mlp_train {name} rank {communicator.rank}"
                errors[name] = checked_error(grads, exact_pieces, what, GRAD_ULPS)
        except Exception as error:  # a peer PyTorch cannot build here: reported
            if name.startswith("ours"):
                raise
            failure = f"{type(error).__name__}: {str(error)[:300]}"
        failed_somewhere = _failed_anywhere(failure, world)
        if failed_somewhere is not None:
            failed[name] = failed_somewhere
            del forwards[name]
    comm = parts_alone("mlp", [leaves[0].detach(), *[t.detach() for t in leaves[1:]]], world)
    calls = {name: (lambda f=forward, n=name: step(f, n not in models and n != "t_compute"))
             for name, forward in forwards.items()}  # fmt: skip
    calls["t_comm"] = comm["t_comm"]
    times = slowest(time_rounds(calls, device, args.rounds, args.iterations,
                                before=dist.barrier if args.barrier else None), device)  # fmt: skip
    t_comm = 2 * times["t_comm"]
    t_star = max(times["t_compute"], t_comm + times["t_compute"] / world)
    host = issue_times({n: calls[n] for n in ("ours", "ours_lean", "eager") if n in calls},
                       device)  # fmt: skip
    if args.profile:
        label = f"mlp_train_{'x'.join(map(str, shape))}"
        profile_steps(calls, ("ours", "ours_lean", "compile_async_tp"), label, args.profile,
                      communicator)  # fmt: skip
    return {
        "block": "mlp_train", "tokens": tokens, "hidden": hidden, "ffn": ffn, "world": world,
        "t_compute_ms": times["t_compute"], "t_comm_ms": t_comm, "t_star_ms": t_star,
        **{f"{name}_ms": times[name] for name in forwards if name != "t_compute"},
        "default_ms": times["ours"], "default_over_t_star": times["ours"] / t_star,
        "host_us": host, "saved_bytes_per_rank": memory, "max_error": errors,
        "peers_left_out": failed,
        "checked_every_rank": True,
        "backward_reads": models["ours"].explain_backward(),
    }  # fmt: skip


def _saved_pieces(model: TrainableFusion, leaves) -> list[torch.Tensor]:
    """This rank's pieces of what ``model``'s forward hands to its backward."""
    everything = model.forward_executor.run(list(leaves))
    return everything[len(model.fusion.outputs) :]


def print_training_table(rows: list[dict]) -> None:
    columns = ["ours", "ours_recompute", "ours_lean", "eager", "compile_async_tp", "t_star"]
    names = " ".join(f"{c[:12]:>12}" for c in columns)
    print(f"\n{'forward+backward':<20} {'tokens,hidden,ffn':<20} {names} {'ours/T*':>8}  "
          "host us (ours)  saved MB a rank (ours, recompute, eager)")  # fmt: skip
    for row in rows:
        shape = f"{row['tokens']},{row['hidden']},{row['ffn']}"
        cells = [f"{row[f'{c}_ms']:12.3f}" if row.get(f"{c}_ms") is not None else f"{'-':>12}"
                 for c in columns]  # fmt: skip
        memory = row["saved_bytes_per_rank"]
        megabytes = ", ".join(f"{memory.get(n, 0) / 2**20:.1f}"
                              for n in ("ours", "ours_recompute", "eager"))  # fmt: skip
        print(f"{row['block']:<20} {shape:<20} " + " ".join(cells)
              + f" {row['default_over_t_star']:8.2f}  {row['host_us']['ours']:14.1f}  "
              + megabytes)  # fmt: skip


# -- the run -------------------------------------------------------------------------


def run_block(communicator, figures, block: str, shape, args) -> dict:
    world, device = communicator.world_size, communicator.device
    cuda = device.type == "cuda"
    tokens, hidden, ffn = shape
    kv = KV_HEADS * (SMOKE_HEAD_DIM if args.smoke else HEAD_DIM)
    if block == "mlp":
        fd = build_mlp(tokens, hidden, ffn, world)
    else:
        fd = build_attention(tokens, hidden, kv, world)
    full = whole_inputs(fd, device)
    default = MultiDeviceExecutor(fd, communicator)
    exact = default.shard_outputs(exact_outputs(block, full))
    local = default.shard_inputs(full)
    del full
    ours = {"default": default,
            "sequential": MultiDeviceExecutor(fd, communicator, OverlapOptions(overlap=False),
                                              figures)}  # fmt: skip
    if cuda:
        ours["lean"] = MultiDeviceExecutor(fd, communicator, cuda_graph=False)
    transports = ("copy_engine", "collective", "ring") if cuda else ("collective", "ring")
    for transport in transports:
        for per_rank in (1, 2):
            if transport == "ring" and per_rank > 1:
                continue
            options = OverlapOptions(num_chunks=per_rank * world, transport=transport)
            name = f"forced[{transport},{per_rank * world}]"
            ours[name] = MultiDeviceExecutor(fd, communicator, options, figures)
    peers = {"eager": eager_block(block, world)}
    if cuda:
        peers["symm_mem"] = symm_mem_block(block)
        peers["compile_async_tp"] = compiled_async_tp_block(block)
    calls = {name: (lambda e=executor: e.run(local)) for name, executor in ours.items()}
    calls["no_check"] = lambda: default.run(local, check_inputs="never")
    failed = {}
    for name, peer in peers.items():
        calls[name] = lambda p=peer: p(*local)
    errors = {}
    for name, call in list(calls.items()):
        failure = None
        try:
            for _ in range(3):  # warm-up (and graph capture) before the check
                outputs = call()
            what = f"{block} {name} rank {communicator.rank}"
            errors[name] = checked_error(outputs, exact, what)
        except Exception as error:  # a peer PyTorch cannot build here is reported, not timed
            if name in ours:
                raise
            failure = f"{type(error).__name__}: {str(error)[:300]}"
        failed_somewhere = _failed_anywhere(failure, world)
        if failed_somewhere is not None:
            failed[name] = failed_somewhere
            errors.pop(name, None)
            del calls[name]
    worst = [None] * world
    dist.all_gather_object(worst, errors)
    errors = {name: max(e.get(name, 0.0) for e in worst) for name in errors}
    calls.update(parts_alone(block, local, world))
    calls["t_compute_ours"] = ours_alone(block, shape, kv, world, device)
    each_round: dict[str, list[float]] = {}
    times = slowest(time_rounds(calls, device, args.rounds, args.iterations,
                                before=dist.barrier if args.barrier else None,
                                each_round=each_round), device)  # fmt: skip
    graphs = [None] * world
    dist.all_gather_object(graphs, {"captures": default.graphs.captures,
                                    "replays": default.graphs.replays,
                                    "fallbacks": default.graphs.fallbacks})  # fmt: skip
    rounds_by_rank = [None] * world
    dist.all_gather_object(rounds_by_rank, {n: each_round[n] for n in ("default", "no_check")})
    # the block's compute: the faster of PyTorch's kernels and ours, alone
    times["t_compute"] = min(times["t_compute_eager"], times["t_compute_ours"])
    t_star = max(times["t_compute"], times["t_comm"] + times["t_compute"] / world)
    forced = min((n for n in times if n.startswith("forced")), key=times.get)
    host = issue_times({n: calls[n] for n in ("default", "lean", "eager") if n in calls},
                       device)  # fmt: skip
    timeline = Timeline(device)
    default.run(local, timeline=timeline)
    row = {
        "block": block, "tokens": tokens, "hidden": hidden,
        "ffn": ffn if block == "mlp" else None, "world": world,
        "t_compute_ms": times["t_compute"], "t_compute_eager_ms": times["t_compute_eager"],
        "t_compute_ours_ms": times["t_compute_ours"], "t_comm_ms": times["t_comm"],
        "t_star_ms": t_star,
        "default_ms": times["default"], "no_check_ms": times["no_check"],
        "lean_ms": times.get("lean"), "host_us": host,
        "forced_best_ms": times[forced], "forced_best": forced,
        "sequential_ms": times["sequential"], "eager_ms": times["eager"],
        "symm_mem_ms": times.get("symm_mem"), "compile_async_tp_ms": times.get("compile_async_tp"),
        "default_over_t_star": times["default"] / t_star,
        "forced_ms": {n: times[n] for n in times if n.startswith("forced")},
        "peers_left_out": failed,
        "max_error": errors,  # over the output's RMS, the worst rank, against float32
        "communications": [str(c) for c in default.communications],
        "plan_and_roof_meter_rank": default.explain_overlap(timeline),
        "checked_every_rank": True,
        "default_graphs_by_rank": graphs,  # the default executor's captures, replays...
        "rounds_ms_by_rank": rounds_by_rank,  # each round's ms a call, by rank
    }  # fmt: skip
    if communicator.rank == 0:
        print(f"[{block}] default graphs by rank: {graphs}", flush=True)
        print(f"[{block}] default and no_check rounds by rank: {rounds_by_rank}", flush=True)
    return row


def issue_times(calls: dict, device: torch.device) -> dict[str, float]:
    """Each call's host time to issue it (us, the slowest rank's), the device kept busy
    (every rank calls it, with the same names)."""
    return {name: ms * 1e3 for name, ms in slowest(
        {name: host_ms(call, HOST_CALLS, device, busy_ms=HOST_BUSY_MS)
         for name, call in calls.items()}, device).items()}  # fmt: skip


def print_table(rows: list[dict]) -> None:
    columns = ["default", "no_check", "lean", "forced_best", "sequential", "eager", "symm_mem",
               "compile_async_tp", "t_star"]  # fmt: skip
    names = " ".join(f"{c[:12]:>12}" for c in columns)
    print(f"\n{'block':<10} {'tokens,hidden,ffn':<20} {names} {'default/T*':>10} "
          f"{'host us':>8}  best forced")  # fmt: skip
    for row in rows:
        shape = f"{row['tokens']},{row['hidden']},{row['ffn'] or '-'}"
        cells = []
        for column in columns:
            value = row.get(f"{column}_ms")
            cells.append(f"{value:12.3f}" if value is not None else f"{'-':>12}")
        print(f"{row['block']:<10} {shape:<20} " + " ".join(cells)
              + f" {row['default_over_t_star']:10.2f} {row['host_us']['default']:8.1f}  "
              + row["forced_best"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo)")
    parser.add_argument("--blocks", default="mlp,attention,mlp_train")
    parser.add_argument("--shapes", help="tokens,hidden,ffn;... (default: the issue's three)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--no-barrier", dest="barrier", action="store_false",
                        help="time each batch without first bringing the ranks together "
                        "(the first collective variant of a round then counts the ranks' "
                        "drift: 2-23x on 4x H200)")  # fmt: skip
    parser.add_argument("--profile", metavar="FOLDER",
                        help="mlp_train: profile steps of the default, the lean path and "
                        "compile's into FOLDER (rank 0's tables and traces)")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "blocks.json"))
    args = parser.parse_args()
    communicator = torchrun_communicator(args.smoke)
    figures = measure_hardware_figures(communicator)
    rows = []
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split(",")) for shape in args.shapes.split(";")]
    for shape in shapes:
        for block in args.blocks.split(","):
            if block == "mlp_train":
                rows.append(run_training(communicator, shape, args))
            else:
                rows.append(run_block(communicator, figures, block, shape, args))
            if communicator.rank == 0:
                print(f"[{block} {shape}] default {rows[-1]['default_ms']:.3f} ms, "
                      f"T* {rows[-1]['t_star_ms']:.3f} ms", flush=True)  # fmt: skip
    if communicator.rank == 0:
        print_table([row for row in rows if row["block"] != "mlp_train"])
        print_training_table([row for row in rows if row["block"] == "mlp_train"])
        write_results(args.out, rows, communicator)
    dist.barrier()
    if not args.smoke:
        # Tearing down symmetric memory and captured graphs at exit has hung torch 2.11
        # (benchmarks/ag_matmul.py): the results are written, so leave without it.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


def write_results(path: str, rows: list[dict], communicator) -> None:
    from benchmarks.kernels import commit_id

    cuda = communicator.device.type == "cuda"
    result = {
        "device": f"{communicator.world_size}x "
        + (torch.cuda.get_device_name() if cuda else "cpu (gloo)"),
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "command": " ".join(
            ["torchrun --nproc-per-node", str(communicator.world_size), *sys.argv]
        ),  # fmt: skip
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
