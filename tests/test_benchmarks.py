"""The benchmark scripts still run: a smoke run on CPU processes (gloo), with a timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(
    script: str, world: int, *arguments: str, timeout: int = 240, check: bool = True, **env
) -> subprocess.CompletedProcess:
    """``benchmarks/<script> [arguments]`` on ``world`` local ranks under torchrun (one
    thread each, ``env`` added); with ``check``, fails with the run's output unless it
    exits 0."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), str(ROOT / "benchmarks" / script),
               *arguments]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment
    )
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_ag_matmul_benchmark_smoke_run(tmp_path, world):
    """Every rank's output checked against float64 before timing (the script stops
    otherwise); at 2 ranks every variant is bitwise equal to the sequential run; at
    any size a reduce-scatter's fixed chunk counts give the same bits (``c*_same``)."""
    result = _torchrun("ag_matmul.py", world, "--smoke", "--rounds", "1", "--iterations", "1",
                       "--timeline-dir", str(tmp_path))  # fmt: skip
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("pattern "))
    rows = [line for line in lines if line.startswith(("ag_", "matmul_"))]
    assert len(rows) == 4, result.stdout
    columns = header.split()
    for row in rows:
        fields = dict(zip(columns[: columns.index("plan;")], row.split(), strict=False))
        # a reduce-scatter's fixed chunk counts (one transport) give the same bits
        assert fields["c*_same"] == ("True" if row.startswith("matmul_rs") else "-"), row
        if world == 2:
            assert fields["bitwise"] == "True", row  # bitwise equal to sequential
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json"] * 4 + [".png"] * 4


def test_host_figures_benchmark_measures_every_kind_a_cpu_rank_issues(tmp_path):
    """``benchmarks/host_figures.py --cpu`` on 2 gloo ranks: the host model's steps are the
    rank programs' (the script stops otherwise), every kind a CPU rank issues gets a
    cost, a call its fixed cost, and the figures to record print as ``HostFigures``."""
    from overlap.plan.host_steps import HostStep

    out = tmp_path / "host.json"
    result = _torchrun("host_figures.py", 2, "--cpu", "--runs", "10", "--out", str(out))
    rows = {row["kind"]: row for row in json.loads(out.read_text())["rows"]}
    on_cpu = set(HostStep) - {
        HostStep.STREAM_SWITCH, HostStep.STREAM_WAIT, HostStep.GENERATED_KERNEL,
        HostStep.POST_CHUNK_COPY_ENGINE, HostStep.WAIT_CHUNK_COPY_ENGINE,
        HostStep.STAGE_FOR_PEERS, HostStep.COMBINE_STAGED,
    }  # fmt: skip
    assert set(rows) == {*on_cpu, "fixed_us", "host probe"}, sorted(rows)
    assert all(rows[kind]["us"] >= 0 and rows[kind]["steps"] > 0 for kind in on_cpu)
    assert "HostFigures(\n    step_us={" in result.stdout
    assert re.search(r"HostStep.STAGE_FOR_PEERS: [\d.]+,  # not run here: the fallback",
                     result.stdout), result.stdout  # fmt: skip


def test_blocks_benchmark_smoke_run(tmp_path):
    """``benchmarks/blocks.py`` at tiny shapes on 2 gloo ranks: every variant's output on
    every rank is checked against the reference before it is timed (a wrong one fails
    the run), the SwiGLU block gathers once and reduce-scatters once, and each row holds
    the plan with the roof meter of a recorded run."""
    out = tmp_path / "blocks.json"
    _torchrun("blocks.py", 2, "--smoke", "--rounds", "1", "--iterations", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [row["block"] for row in rows] == ["mlp", "attention", "mlp_train"] * 2
    forward = [row for row in rows if row["block"] != "mlp_train"]
    for row in forward:
        assert row["checked_every_rank"] and row["default_ms"] > 0 and row["t_star_ms"] > 0
        assert row["eager_ms"] > 0 and row["peers_left_out"] == {}, row
        assert "roof meter (this rank, the recorded run):" in row["plan_and_roof_meter_rank"]
    for row in forward[::2]:  # the MLP: one all-gather (gate and up together), one reduce-scatter
        kinds = [text.split(" = ")[1].split("(")[0] for text in row["communications"]]
        assert kinds == ["Allgather", "ReduceScatter"], row["communications"]
        assert " + linear " in row["plan_and_roof_meter_rank"]
    for row in rows[2::3]:  # forward and backward: every rank's gradients checked first
        assert row["checked_every_rank"] and row["peers_left_out"] == {}, row
        assert row["ours_ms"] > 0 and row["ours_recompute_ms"] > 0 and row["eager_ms"] > 0
        memory = row["saved_bytes_per_rank"]  # recomputing saves nothing; eager keeps most
        assert memory["ours_recompute"] == 0 < memory["ours"] < memory["eager"], memory
        reads = row["backward_reads"]  # by default gate and up saved, the norm recomputed
        assert reads.startswith("saved by policy 'matmuls'"), reads
        assert reads.count(": saved") == 2 and ": recomputed" in reads, reads


def _smoke(script: str, timeout: int, *extra: str) -> str:
    """``benchmarks/<script> --smoke --sweep [extra]`` in Triton's interpreter, one call
    a provider; fails with the run's output unless it exits 0. Returns its stdout."""
    command = [
        sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--sweep",
        "--rounds", "1", "--iterations", "1", *extra,
    ]  # fmt: skip
    environment = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_kernels_benchmark_smoke_run_with_a_sweep():
    """Tiny shapes in Triton's interpreter; every provider's output is checked first."""
    stdout = _smoke("kernels.py", timeout=300)
    rows = [line for line in stdout.splitlines() if " ms " in line]
    providers = {row.split("]", 1)[1].split()[0] for row in rows}  # after the shape
    wanted = {"ours", "eager", "ours[k0.warps=8,unroll=1]", "ours[k0.atomics]"}
    assert wanted <= providers, providers
    assert "form: aligned" in stdout


def test_norms_benchmark_smoke_run():
    """RMSNorm and LayerNorm forward and backward at tiny shapes in the interpreter, with
    the sweep's variants: every output is checked against the reference before it is
    timed; explicit params (``--params``) are timed beside them, checked the same way."""
    explicit = "block_rows=1,block_columns=1024,num_warps=2,persistent=1,programs=2"
    stdout = _smoke("norms.py", 400, "--params", explicit)
    ops = {line.split()[0] for line in stdout.splitlines() if " ours_auto " in line}
    assert ops == {"rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd"}, ops
    assert "[normalization]" in stdout
    assert "ours[stages=3]" in stdout and "ours[warps=" in stdout
    timed = [line for line in stdout.splitlines() if f"ours[params:{explicit}]" in line]
    assert len(timed) == 8 and all(" ms " in line for line in timed), stdout


def test_norms_benchmark_times_a_captured_backward_against_the_hand_written(monkeypatch, capsys):
    """``--op layernorm_captured_bwd`` in-process on CPU: both backwards (captured and
    hand-written) checked against torch autograd before they are timed (the run stops
    otherwise), in bf16 and float32, the captured one a single normalization kernel.
    (``rmsnorm_captured_bwd`` runs the same code: left out for the suite's time.)"""
    from benchmarks import norms

    op = "layernorm_captured_bwd"
    monkeypatch.setattr(sys, "argv", ["norms.py", "--smoke", "--op", op, "--shape", "3x40",
                                      "--rounds", "1", "--iterations", "1"])  # fmt: skip
    norms.main()
    stdout = capsys.readouterr().out
    timed = {tuple(line.split()[i] for i in (0, 2, 3)) for line in stdout.splitlines()
             if " ms " in line}  # fmt: skip
    assert timed == {(op, dtype, provider) for dtype in ("bfloat16", "float32")
                     for provider in ("ours_captured", "ours_hand", "eager")}, stdout  # fmt: skip
    captured = [line for line in stdout.splitlines() if line.startswith("  captured: ")]
    assert len(captured) == 2, stdout
    assert all(line.startswith("  captured: k0 [normalization]") for line in captured), stdout


def test_norms_benchmark_params_are_fields_of_normalization_params():
    from benchmarks.norms import parse_params

    params = parse_params("block_rows=2,block_columns=512,num_warps=4,persistent=1,"
                          "programs=8,strategy=warp_specialized,tile_sums=0")  # fmt: skip
    assert (params.block_rows, params.block_columns, params.num_warps) == (2, 512, 4)
    assert params.persistent and not params.tile_sums and params.programs == 8
    assert params.strategy == "warp_specialized"
    spaced = parse_params("block_rows = 1, block_columns=64,num_warps=1,persistent=0")
    assert spaced.block_rows == 1 and not spaced.persistent
    refused = {
        "block_rows=1,warps=4": "'warps' is not a NormalizationParams field",
        "block_rows=1": "missing 3 required",
        "block_rows=1,block_columns=64,num_warps=1,persistent=1,strategy=splt": (
            "strategy 'splt' is not one of"
        ),
        "block_rows=1,block_columns=64,num_warps=1,persistent=true": "a flag is 0 or 1",
        "block_rows=1,block_columns=64,num_warps=x,persistent=1": "not an integer",
        "block_rows=1,block_rows=2,block_columns=64,num_warps=1,persistent=1": "given twice",
    }
    for text, why in refused.items():
        with pytest.raises(SystemExit, match=why):
            parse_params(text)


def test_parallel_block_benchmark_smoke_run():
    """``benchmarks/parallel_block.py`` at tiny shapes on 2 gloo ranks: ours and PyTorch's
    tensor parallelism, each variant's output and gradients checked on every rank first
    (a wrong one fails the run), for BERT (a mask input): the script's machinery. Every
    catalogue block trains under torch's plan in tests/test_catalogue.py at 2 and 4 ranks
    (three blocks here took 29 s of CI's 15 minutes; all five 48 s)."""
    result = _torchrun("parallel_block.py", 2, "--smoke", "--blocks", "bert",
                       "--rounds", "1", "--iterations", "1")  # fmt: skip
    tables = result.stdout.strip().split("\n\n")
    assert [table.split()[0] for table in tables] == ["bert"]
    for table in tables:
        variants = [line.split()[0] for line in table.splitlines()[2:]]
        assert variants == ["ours", "ours_save_everything", "torch_tp"], result.stdout


def test_profile_host_benchmark_smoke_run(tmp_path):
    """``benchmarks/profile_host.py --device cpu`` on 2 gloo ranks: every variant's output
    checked on every rank first (a wrong one fails the run), one row a case with every
    variant's host time, written with the command that made it."""
    out = tmp_path / "profile_host.json"
    _torchrun("profile_host.py", 2, "--device", "cpu", "--samples", "1", "--out", str(out))
    record = json.loads(out.read_text())
    assert record["device"] == "2x cpu (gloo)" and "--device cpu" in record["command"]
    rows = record["rows"]
    assert [row["case"] for row in rows] == ["sp_mlp", "mlp_block", "attention_block"]
    for row in rows:
        assert row["checked_every_rank"], row
        for variant in ("ours", "ours_no_check", "ours_sequential", "ours_pipelined", "torch"):
            assert 0 < row[f"{variant}_min_us"] <= row[f"{variant}_us"], row


def test_check_gpu_runs_on_gloo_ranks_and_reports_every_rank(tmp_path):
    """``benchmarks/check_gpu.py --quick`` on 2 CPU ranks (kernels in the interpreter): the
    first check of every scenario and kernels passes on every rank, and the JSON holds each
    rank's verdict. (Every check of the script, 143 on 2 ranks, took 130 s of CI's 15
    minutes; the scenarios are the tests' own functions, which run whole there.)"""
    out = tmp_path / "check.json"
    result = _torchrun("check_gpu.py", 2, "--out", str(out), "--quick", timeout=300,
                       check=False, TRITON_INTERPRET="1")  # fmt: skip
    # the first failing check's report first: a failure can leave the ranks a collective
    # apart, and every later check fails for it (the tail alone hid the first once)
    # (and each rank's own report of what it raised, on stderr, first)
    lines = result.stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if "FAIL" in line), len(lines))
    raised = result.stderr.find(" raised\n")
    own = result.stderr[max(0, raised - 80) : raised + 3000] if raised >= 0 else ""
    assert result.returncode == 0, own + "\n...\n" + "\n".join(lines[first : first + 40]) + (
        "\n...\n" + result.stdout[-2000:] + result.stderr[-3000:])  # fmt: skip
    record = json.loads(out.read_text())
    # one row a scenario and kernels: the multi-device scenarios, gradients, pipelines,
    # graph replays, parallelized modules, dropout, ...
    assert record["failed"] == 0 and len(record["rows"]) > 25
    assert len({(row["check"].split(" ")[0], row["kernels"]) for row in record["rows"]}) > 10
    assert {row["kernels"] for row in record["rows"]} == {"reference", "generated", "-"}
    assert all(row["ranks"] == ["ok", "ok"] for row in record["rows"])


def test_check_gpu_stops_where_the_ranks_are_a_collective_apart():
    """A rank that raised between two of its collectives leaves the ranks a collective
    apart: its verdict reached a peer's collective, and the peer's next payload comes to
    the verdicts (on a GPU run, after a kernel raised on one rank, 19 later checks failed
    for it, or NCCL waited). Each verdict is tagged with its check: a payload that is
    not this check's verdict stops the checks, saying so; in step, the verdicts as
    sent."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import check_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Stub:
        rank = 0

        def __init__(self, received):
            self.received, self.sent = received, []

        def all_gather_object(self, item):
            self.sent.append(item)
            return [item, *self.received]

    in_step = Stub([(3, "FAILED\nboom")])
    verdicts, apart = check_gpu.exchange_verdicts(in_step, 3, "a check", "ok")
    assert verdicts == ["ok", "FAILED\nboom"] and apart == "" and in_step.sent == [(3, "ok")]
    for payload in ((4, "ok"), "ok", [b"a piece"], (3,)):  # the next check's, or another
        verdicts, apart = check_gpu.exchange_verdicts(Stub([payload]), 3, "a check", "ok")
        assert verdicts == [] and "rank(s) [1]" in apart and "check 3 (a check)" in apart


def test_check_gpu_leaves_triton_interpret_as_the_user_set_it():
    """A test module ``check_gpu.py`` imports once set TRITON_INTERPRET=1 for its CPU
    runs: on GPUs every generated kernel then ran in the interpreter (47 checks failed on 2
    H100s, 2026-11-25; tests/conftest.py sets it now). Imported without it, the script
    leaves it unset and Triton unimported."""
    code = (
        "import os, sys\n"
        "sys.argv = ['check_gpu']\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import check_gpu\n"
        "assert 'TRITON_INTERPRET' not in os.environ, os.environ['TRITON_INTERPRET']\n"
        "assert 'triton' not in sys.modules\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=environment)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def test_faults_benchmark_ends_a_job_whose_rank_fails(tmp_path):
    """``benchmarks/faults_gpu.py`` on gloo: rank 1 raises mid-job under the local
    launcher, or passes a bad input after five good runs (found alone: it raises at
    once), or an input changed on it alone (symbolic tokens every rank holds whole: rank
    0 is already in the program's collectives, rank 1 gives up on the exchange after the
    10 s the benchmark sets). Each job ends, with rank 1's traceback, the launcher names
    rank 1 as the cause (torchrun's "root cause" is whichever rank it saw exit first: the
    benchmark records it, it is no assertion here), and the JSON says so."""
    out = tmp_path / "faults.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "faults_gpu.py"), "--launchers", "local",
        "--faults", "raise,bad_input,changed_alone", "--limit", "90", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["fault"] for row in rows] == ["raise", "bad_input", "changed_alone"]
    for row in rows:
        assert row["failing_rank_reached_its_fault"] and not row["hung"], row
        assert row["exit_code"] != 0 and row["traceback_shown"] and row["failed_rank_named"], row
    raised, bad, alone = (row["seconds_to_end"] for row in rows)
    assert raised < 30 and bad < 30, rows
    assert 10 <= alone < 40, rows  # the exchange's timeout, then the launcher's stop


def test_compiled_alone_compiles_each_shape_static():
    """The peers' ``torch.compile``: the eager functions of a table share one code
    object, so without the reset the second shape is compiled with dynamic shapes (the
    handicap ``compiled_alone`` removes: 0.32 against 0.95 of copy on H200)."""
    import torch

    from benchmarks.kernels import compiled_alone

    def eager_function(scale):  # as the benchmarks build theirs: one closure per shape
        return lambda x: (x * scale).sum(dim=1)

    def shapes_seen(compile_one):
        seen = []

        def backend(graph, example_inputs):
            sizes = [s for t in example_inputs for s in getattr(t, "shape", [t])]
            seen.append([type(s).__name__ for s in sizes])  # a dynamic size: a SymInt
            return graph.forward

        for rows in (4, 6, 8):
            compile_one(eager_function(2.0), backend)(torch.ones(rows, 3))
        return seen

    static = [["int", "int"]] * 3
    assert shapes_seen(compiled_alone) == static
    torch._dynamo.reset()
    shared = shapes_seen(lambda f, backend: torch.compile(f, backend=backend))
    assert shared[0] == ["int", "int"] and shared[1:] != static[1:], shared  # the handicap


def test_a_result_names_a_tree_that_is_not_its_commit(monkeypatch):
    """``commit_id``: ``BENCH_COMMIT`` where given, else git's HEAD, marked ``+modified``
    where tracked files differ from it (a GPU machine's copy of a working tree reported
    an older checkout's HEAD as the commit measured)."""
    from types import SimpleNamespace

    from benchmarks import kernels

    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    answers = {"rev-parse": "abc123\n", "status": " M schedulers/runtime.py\n"}

    def run(command, **_):
        return SimpleNamespace(stdout=answers[command[1]], returncode=0)

    monkeypatch.setattr(kernels.subprocess, "run", run)
    assert kernels.commit_id() == "abc123+modified"
    answers["status"] = ""
    assert kernels.commit_id() == "abc123"
    answers["rev-parse"] = ""
    assert kernels.commit_id() == "unknown"
    monkeypatch.setenv("BENCH_COMMIT", "given")
    assert kernels.commit_id() == "given"


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_fwd", "rmsnorm_bwd", "layernorm_bwd"])
@pytest.mark.parametrize("n", [12288, 16384, 24576, 32768, 65536])
def test_norms_sweep_variants_of_the_h200_split_are_kernels(name, n):
    """``--sweep``'s neighbours of the H200's split choice (clusters among them, with
    column sums or not) are configurations the generator takes: none raises where a real
    sweep would stop; the cluster's exchange through global memory takes the grid the
    heuristics give that exchange."""
    from types import SimpleNamespace

    from benchmarks.norms import alternatives
    from examples.norms import BUILDERS
    from schedulers.hardware import H200
    from schedulers.normalization.exchange import CLUSTER_SIZES
    from schedulers.normalization.heuristics import SPLIT
    from schedulers.registry import split_into_kernels

    fd = BUILDERS[name](n, "bfloat16")
    group = split_into_kernels(fd.fusion.exprs, fd.fusion)[0]
    params = group.scheduler.heuristics(group.plan, H200, [8192, n], SPLIT)
    variants = alternatives(SimpleNamespace(chosen_params={"k0": params}), H200.sm_count)
    assert variants and all(set(v) == {"k0"} for v in variants.values()), variants
    for label, overrides in variants.items():
        for kernel in group.scheduler.kernels(group.plan, overrides["k0"], [8192, n], True):
            assert "def " in kernel.source, label
    if params.cluster and params.rewiden:  # 12 warps an SM (SPLIT_SUMS_WARPS_PER_SM)
        through_memory = variants["split,global exchange"]["k0"]
        assert through_memory.programs == H200.sm_count * 12 // params.num_warps, through_memory
    if not params.cluster and params.rewiden and params.parts in CLUSTER_SIZES:
        # a cluster with column sums: the launch counts its grid
        assert variants["split,cluster"]["k0"].programs == 0, variants["split,cluster"]


def test_the_timing_helper_interleaves_rounds_of_calls_back_to_back_in_ms():
    """``benchmarks.timing``: every round times each callable once, as ``iterations``
    calls in a row (``settle``'s untimed calls are for GPUs only); ``before`` runs
    untimed before each batch; figures are ms per call, the upper middle of the rounds."""
    import time

    import torch

    from benchmarks.timing import Timer, median, time_rounds

    cpu = torch.device("cpu")
    calls = []
    times = time_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, cpu,
                        rounds=3, iterations=2, settle=True)  # fmt: skip
    assert calls == ["a", "a", "b", "b"] * 3 and sorted(times) == ["a", "b"]
    seen = []
    timer = Timer(cpu, before=lambda: seen.append("barrier"), on_host=True)
    timer.rounds({"sleep": lambda: (seen.append("sleep"), time.sleep(0.02))}, 3)
    assert seen == ["barrier", "sleep"] * 3
    assert 20 <= timer.medians()["sleep"] < 200  # ms per call
    assert median([3.0, 1.0, 2.0, 4.0]) == 3.0  # of an even count, a value measured
