"""Correctness of the multi-device scenarios on GPUs with NCCL, on every rank.

    torchrun --nproc-per-node 2 benchmarks/check_gpu.py [--out results/check_gpu.json]

Runs every scenario of ``tests/test_multidevice.py`` (the examples' normalizations and the
demo's MLP among them, each with its backward) and the gradients of
``tests/test_backward_multidevice.py`` with the reference evaluator and with generated
(compiled Triton) kernels, and the pipelines of ``tests/test_pipelined.py`` and the
pipelined SwiGLU backward over every transport, and modules parallelized from
PyTorch (``tests/test_parallelize.py``: a vocabulary-parallel head, the Llama block under
torch's plan, attention by ``scaled_dot_product_attention``, dropout's mask: the third step
replayed from CUDA graphs reads its new seed), and on GPUs data-parallel replicas of a
tensor-parallel team (``tests/test_data_parallel.py``: gradients averaged during the
backward, AdamW, the teams of a split communicator), with NCCL and CUDA tensors. Each
scenario checks **every rank's** output piece against the
single-device reference (and the communications the framework inserted); every rank
reports its verdict, and the table shows them side by side. Run it whenever a change
touches kernels, the executor or the launchers. Exits 1 if any rank failed any check.

Without GPUs it runs the same on gloo ranks, the kernels in Triton's interpreter (the
copy-engine pipelines, which need CUDA, left out): CI runs it so, to keep it working.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_backward_multidevice as backward  # noqa: E402
import test_data_parallel as data_parallel  # noqa: E402
import test_dropout as dropout  # noqa: E402
import test_graphs as graphs  # noqa: E402
import test_multidevice as scenarios  # noqa: E402
import test_parallelize as parallel  # noqa: E402
import test_pipelined as pipelined  # noqa: E402
import test_trainable as trainable  # noqa: E402

from launch import failfast  # noqa: E402
from overlap import Communicator  # noqa: E402


def checks(world: int, cuda: bool):
    """``(name, function, args)``: each function takes ``(communicator, *args)``."""
    for k in ("reference", "generated"):
        yield "tensor-parallel MLP", scenarios.tensor_parallel_mlp, (11, True, k)
        yield "sequence-parallel block", scenarios.sequence_parallel_block, (12, 4 * world, k)
        yield "uneven sequence (7 rows)", scenarios.sequence_parallel_block, (13, 7, k)
        yield "pipeline stages", scenarios.pipeline_stages, (14, k)
        if world % 2 == 0:
            mesh = [2, world // 2]
            yield f"dp x tp {mesh}", scenarios.data_and_tensor_parallel, (15, mesh, k)
        yield "sequence to heads (all-to-all)", scenarios.sequence_to_heads, (16, k)
        for tokens in (world, 7, 50):
            yield f"symbolic sequence {tokens}", scenarios.symbolic_sequence, (17, tokens, k)
        yield "fp8/fp4/bool/bf16 gathers", scenarios.gather_storage_types, (18, k)
        yield "bf16 row-parallel", scenarios.bf16_row_parallel, (19, k)
        for kind in ("Broadcast", "Scatter", "Gather", "Reduce"):
            yield f"one rank and a mesh: {kind}", scenarios.one_rank_and_a_mesh, (20, kind, k)
        for tokens in (4 * world, 7):
            name = f"SwiGLU block + residual ({tokens} tokens)"
            yield name, scenarios.swiglu_residual_block, (22, tokens, k)
        for symbolic in (False, True):
            name = f"empty pieces ({'symbolic' if symbolic else 'static'})"
            yield name, scenarios.empty_pieces, (23, symbolic, k)
        for op in ("max", "min", "sum"):
            for dtype in ("float32", "bfloat16"):
                for target in ("replicated", "split", "one rank"):
                    name = f"NaN/inf {op} {dtype} -> {target}"
                    yield name, scenarios.special_values, (24, op, dtype, target, k)
        for norm in scenarios.NORMALIZATIONS:
            yield f"example {norm}, rows split", scenarios.row_split_normalization, (norm, 25, k)
            if k == "generated":  # each row split over programs too
                name = f"example {norm}, rows split, split-row kernel"
                yield name, scenarios.row_split_normalization, (norm, 25, k, "split")
            if k == "generated" and norm in ("rmsnorm_bwd", "layernorm_bwd"):
                name = f"example {norm}, rows split, column walk"
                yield name, scenarios.row_split_normalization, (norm, 25, k, "column_walk")
                # thread-block clusters: sm_90 (or the interpreter's programs on CPUs)
                if not cuda or torch.cuda.get_device_capability()[0] == 9:
                    name = f"example {norm}, rows split, split-row kernel in clusters"
                    yield name, scenarios.row_split_normalization, (norm, 25, k, "clusters")
        if k == "generated":
            for norm in ("rmsnorm_fwd", "layernorm_bwd"):
                name = f"example {norm}, new and misaligned buffers"
                yield name, scenarios.repeated_runs_over_buffers, (norm, 27, k)
        yield "demo MLP", scenarios.demo_mlp, (26, k)
        two_by_two = world >= 4 and world % 2 == 0  # the data x tensor parallel mesh
        for block in [b for b in backward.BLOCKS if b != "dp_tp_mlp" or two_by_two]:
            yield f"gradients: {block}", backward.gradients_on_every_rank, (block, k)
        if cuda:
            yield "training steps from CUDA graphs", trainable.trained_from_cuda_graphs, (k,)
        for split_dim in (0, 1):  # on CUDA the third step replays graphs: a new seed read
            name = f"parallelize: dropout's mask, split on axis {split_dim}"
            yield name, dropout.parallel_dropout, (split_dim, k)
        for placement in ("replicate", "sequence"):
            name = f"parallelize: vocabulary-parallel head ({placement})"
            yield name, parallel.vocabulary_parallel, (9, placement, k)
    if cuda and world % 2 == 0:  # on gloo ranks: tests/test_data_parallel.py
        name = f"parallelize: 2 data-parallel replicas x {world // 2} ranks, AdamW"
        yield name, data_parallel.replicas_train, (2, 4)  # steps 3 and 4 from CUDA graphs
        if world >= 4:
            name = "split teams: send, broadcast, scatter, gather, reduce, rings"
            yield name, data_parallel.teams_communicate, ()
    for pattern in ("allreduce", "copy_engine") if cuda else ("allreduce",):
        name = f"graph replays ({pattern}): moved inputs, overwritten outputs"
        yield name, graphs.check_replays_on_every_rank, (pattern,)
    # parallelized modules with the default kernels (generated on CUDA)
    yield "parallelize: Llama block, torch's plan", parallel.llama_block_by_torch_plan, (9,)
    yield "parallelize: sdpa heads", parallel.parallel_torch_attention, (2 * world + 1,)
    for pattern in ("ag", "rs") if world > 1 else ():  # one rank has nothing to pipeline
        for transport, per_rank in (
            ("collective", 2), ("ring", 1), ("ring", 2), ("copy_engine", 1), ("copy_engine", 3)
        ):  # fmt: skip
            if transport == "copy_engine" and not cuda:
                continue
            chunks = per_rank * world
            name = f"pipelined {pattern} {transport} {chunks} chunks"
            yield name, pipelined.pipelined, (pattern, 13, chunks, transport, 21)
            if pattern == "ag":  # the SwiGLU backward: both patterns, twice each
                name = f"pipelined backward {transport} {chunks} chunks"
                yield name, backward.pipelined_backward, (13, chunks, transport, "generated")


def _kernels_of(args: tuple) -> str:
    return next((a for a in args if a in ("reference", "generated")), "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the per-rank verdicts as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="the first check of each scenario and kernels only (CI's run "
                        "of this script on gloo: the scenarios run whole in tests/)")  # fmt: skip
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        communicator = Communicator.initialize("nccl", 120.0, device)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
        communicator = Communicator.initialize("gloo", 120.0, "cpu")
    world, rank = communicator.world_size, communicator.rank
    rows, failures, apart = [], 0, ""
    chosen, seen = [], set()
    for check in checks(world, cuda):
        scenario = (check[1], _kernels_of(check[2]))
        if not args.quick or scenario not in seen:
            chosen.append(check)
            seen.add(scenario)
    for index, (name, function, check_args) in enumerate(chosen):
        start = time.perf_counter()
        try:
            function(communicator, *check_args)
            verdict = "ok"
        except Exception:  # report and go on: every rank runs every check
            verdict = "FAILED\n" + traceback.format_exc()
            # and at once, from this rank: a rank that raised between collectives leaves
            # the ranks a collective apart, and its verdict may reach a peer's collective
            # instead of the verdicts (where it is lost)
            print(f"rank {rank}: {name} raised\n{verdict}", file=sys.stderr, flush=True)
        seconds = time.perf_counter() - start
        verdicts, apart = exchange_verdicts(communicator, index, name, verdict)
        if apart:  # the checks after this one cannot run in step: stop
            print(apart, file=sys.stderr, flush=True)
            failures += 1
            break
        failed = [r for r, v in enumerate(verdicts) if v != "ok"]
        failures += bool(failed)
        kernels = _kernels_of(check_args)
        if rank == 0:
            said = " ".join(f"r{r}:{'ok' if v == 'ok' else 'FAIL'}" for r, v in enumerate(verdicts))
            print(f"{name:44s} {kernels:9s} {said}  {seconds:6.2f} s", flush=True)
            for r in failed:
                print(f"--- rank {r} ---\n{verdicts[r]}", flush=True)
            rows.append({"check": name, "kernels": kernels, "seconds": round(seconds, 3),
                         "ranks": ["ok" if v == "ok" else v for v in verdicts]})  # fmt: skip
    if rank == 0:
        print(f"\n{len(rows)} checks on {world} ranks: {failures} failed on some rank")
        if args.out:
            from benchmarks.kernels import commit_id

            commit = commit_id()
            record = {
                "device": torch.cuda.get_device_name() if cuda else "cpu (gloo)",
                "world": world,
                "date": datetime.date.today().isoformat(),
                "commit": commit,
                "command": "torchrun --nproc-per-node "
                f"{world} benchmarks/check_gpu.py --out {args.out}"
                + (" --quick" if args.quick else ""),
                "torch": torch.__version__,
                "failed": failures,
                "out_of_step": apart,
                "rows": rows,
            }
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    failfast.finish(1 if failures else 0)  # no interpreter teardown: see finish


def exchange_verdicts(communicator, index: int, name: str, verdict: str) -> tuple[list, str]:
    """Every rank's verdict on check ``index`` (``name``), and "" ; or, where some rank's
    payload is not its verdict on this check (a rank raised between two of its
    collectives: the ranks are a collective apart, and every later check would fail for
    it, or wait), this rank's verdicts so far and why the checks stop."""
    received = communicator.all_gather_object((index, verdict))
    apart = [rank for rank, item in enumerate(received)
             if not (isinstance(item, tuple) and len(item) == 2 and item[0] == index)]  # fmt: skip
    if apart:
        return [], (
            f"rank {communicator.rank}: after check {index} ({name}), rank(s) {apart} sent "
            "something other than their verdict on it: a rank raised between two of its "
            "collectives and the ranks are a collective apart; the checks stop here (the "
            "first rank that raised printed its traceback above)"
        )
    return [verdict for _, verdict in received], ""


if __name__ == "__main__":
    main()
