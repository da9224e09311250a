"""Launchers on CPU: local processes and torchrun (gloo), the Ray pool (a local Ray
instance), the ``overlap`` command (run, dump), and the launch environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fusion import to_fp4
from fusion.testing import assert_close
from launch.demo import build_tp_mlp, whole_inputs
from launch.env import LaunchError, free_port, launcher, rank_environment

ROOT = Path(__file__).resolve().parent.parent
SIZES = (64, 32, 128)  # tokens, hidden, ffn

SCRIPT = """
import sys

import torch

from fusion import to_fp4
from fusion.testing import assert_close
from launch.demo import build_tp_mlp, whole_inputs
from overlap import MultiDeviceExecutor


def fusion(world):
    return build_tp_mlp(64, 32, 128, world)


def main(communicator):
    if sys.argv[2:] == ["fail"] and communicator.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if sys.argv[2:] == ["die"] and communicator.rank == 1:
        import os

        os._exit(3)
    fd = fusion(communicator.world_size)
    whole = whole_inputs(64, 32, 128)
    executor = MultiDeviceExecutor(fd, communicator)
    (piece,) = executor.run(executor.shard_inputs(whole))
    (expected,) = executor.shard_outputs(fd.execute(whole))
    assert_close(piece, expected, reduction_extent=128, partial_sums=communicator.world_size)
    torch.save(piece, f"{sys.argv[1]}/rank{communicator.rank}.pt")
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "tp_mlp_script.py"
    path.write_text(SCRIPT)
    return path


def _overlap(*args, timeout=180) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OVERLAP_LAUNCHER", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "launch.cli", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _whole_output() -> torch.Tensor:
    fd = build_tp_mlp(*SIZES, 2)
    return fd.execute(whole_inputs(*SIZES))[0]


def _check_pieces(folder: Path) -> None:
    pieces = [torch.load(folder / f"rank{rank}.pt") for rank in range(2)]
    assert_close(torch.cat(pieces), _whole_output(), reduction_extent=SIZES[2], partial_sums=2)


@pytest.mark.parametrize("kind", ["local", "torchrun"])
def test_overlap_run_matches_the_reference(kind, script, tmp_path):
    """Two gloo ranks run the tensor-parallel MLP; their pieces make the whole output."""
    result = _overlap("run", "--launcher", kind, "--nproc", 2, script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_pieces(tmp_path)


@pytest.mark.parametrize("fault", ["fail", "die"])
@pytest.mark.parametrize("kind", ["local", "torchrun"])
def test_a_failing_or_dying_rank_stops_the_run_promptly(script, tmp_path, kind, fault):
    start = time.monotonic()
    result = _overlap("run", "--launcher", kind, "--nproc", 2, script, tmp_path, fault,
                      timeout=120)  # fmt: skip
    assert result.returncode != 0
    if fault == "fail":  # the failing rank's own traceback, then its abort
        assert "rank 1 fails on purpose" in result.stderr
        assert "[overlap] rank 1 failed:\nTraceback" in result.stderr, result.stderr[-2000:]
    if kind == "local":
        assert "rank 1 exited with " + ("1" if fault == "fail" else "3") in result.stderr
    else:  # torchrun's summary names the failed rank
        assert "rank      : 1" in result.stderr or "local_rank: 1" in result.stderr, result.stderr[
            -2000:
        ]
    assert time.monotonic() - start < 60


def _die_or_wait(communicator):
    """Rank 1 dies; rank 0 waits for it in a collective, which then breaks."""
    import torch.distributed as dist

    if communicator.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    dist.barrier()


def _fp8_result(communicator):
    return torch.full((2, 3), communicator.rank + 0.5).to(torch.float8_e4m3fn)


def test_run_function_names_the_rank_that_died_not_the_peer_it_broke():
    from launch.local import RankFailure, run_function

    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_function(_die_or_wait, nproc=2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert failure.value.rank == 1, str(failure.value)
    assert "died with exit code 3" in failure.value.failures[1]
    assert str(failure.value).startswith("rank 1 failed first")
    # results of any dtype come back (fp8 does not unpickle as torch pickles it)
    results = run_function(_fp8_result, nproc=2, timeout_s=60)
    assert [r.dtype for r in results] == [torch.float8_e4m3fn] * 2
    assert [r.float()[0, 0].item() for r in results] == [0.5, 1.5]


def _fail_on_the_first_attempt(communicator):
    """Rank 1 raises in the first attempt; every rank returns the attempt it ran in."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and communicator.rank == 1:
        raise RuntimeError("rank 1 fails in the first attempt")
    return attempt


def _rank_1_sleeps(communicator):
    if communicator.rank == 1:
        time.sleep(120)
    return communicator.rank


def test_run_function_restarts_every_rank_up_to_max_restarts_and_stops_at_its_time_limit():
    import signal

    from launch.local import RankFailure, RunTimeout, run_function

    with pytest.raises(RankFailure) as failure:
        run_function(_fail_on_the_first_attempt, nproc=2, timeout_s=60)  # no restarts
    assert failure.value.rank == 1 and failure.value.exit_codes[1] == 1, str(failure.value)
    assert "rank 1 fails in the first attempt" in failure.value.failures[1]
    assert run_function(_fail_on_the_first_attempt, nproc=2, timeout_s=60, max_restarts=1) == [1, 1]
    start = time.monotonic()
    with pytest.raises(RunTimeout, match=r"ranks \[1\] did not finish within 20 s") as late:
        run_function(_rank_1_sleeps, nproc=2, timeout_s=20)
    assert late.value.waiting == [1]  # rank 0 had returned
    assert time.monotonic() - start < 50
    # elastic's handlers are gone: this process's own are back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


_FAILS_ONCE = """
import os
import sys

import torch.distributed as dist


def main(communicator):
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0" and communicator.rank == 1:
        raise RuntimeError("rank 1 fails in the first attempt")
    dist.barrier()  # the restarted ranks reach each other
    with open(os.path.join(sys.argv[1], f"rank{communicator.rank}"), "w") as done:
        done.write(attempt)
"""


@pytest.mark.parametrize("kind", ["local", "torchrun"])
def test_overlap_run_max_restarts_starts_every_rank_again(tmp_path, kind):
    """``--max-restarts 1``: after rank 1 fails, both ranks run again and finish (with
    the rendezvous' store shared, a restarted group hung or failed: pytorch#135712)."""
    script = tmp_path / "fails_once.py"
    script.write_text(_FAILS_ONCE)
    result = _overlap("run", "--launcher", kind, "--nproc", 2, "--max-restarts", 1,
                      "--timeout", 90, script, tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ["1", "1"]


_AT_EXIT = """
import atexit
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

LOG = None


def main(communicator):
    global LOG
    dist.all_reduce(torch.ones(1000))
    path = os.path.join(sys.argv[1], f"rank{communicator.rank}")
    atexit.register(lambda: open(path + ".atexit", "w").write("ran"))
    LOG = open(path + ".log", "w")  # never closed: flushed at exit
    LOG.write("written")

    def later():
        time.sleep(0.5)
        open(path + ".thread", "w").write("ran")

    threading.Thread(target=later).start()  # not a daemon: joined at exit
"""


@pytest.mark.parametrize("kind", ["local", "torchrun"])
def test_a_finished_rank_exits_zero_with_its_pending_work_done(tmp_path, kind):
    """A launched script's ``main`` returns: every rank exits 0 as a Python program does,
    its exit handlers run, its threads joined, its open files flushed."""
    script = tmp_path / "at_exit.py"
    script.write_text(_AT_EXIT)
    result = _overlap("run", "--launcher", kind, "--nproc", 2, script, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        done = {end: (tmp_path / f"rank{rank}.{end}").read_text() for end in ("atexit", "thread")}
        assert done == {"atexit": "ran", "thread": "ran"}
        assert (tmp_path / f"rank{rank}.log").read_text() == "written"


def test_a_script_that_exits_zero_while_loading_ends_its_ranks_cleanly(tmp_path):
    """``run_script`` on a script that ends (``sys.exit(0)``) before any ``main``: every
    rank exits 0, though none joined a process group."""
    from launch.local import run_script

    script = tmp_path / "skips.py"
    script.write_text("import sys\nsys.exit(0)\n")
    assert run_script(str(script), [], nproc=2, timeout_s=60) == 0


def test_run_refuses_a_script_without_main_before_starting_ranks(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    result = _overlap("run", "--nproc", 2, empty, timeout=60)
    assert result.returncode == 2
    assert "defines no main()" in result.stderr
    missing = _overlap("run", tmp_path / "nothing.py", timeout=60)
    assert missing.returncode == 2 and "no such script" in missing.stderr


def test_overlap_dump_prints_each_distinct_rank_program_once(script):
    result = _overlap("dump", "--world", 2, script, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "=== ranks 0, 1 of 2 ===" in result.stdout  # both ranks run the same program
    assert result.stdout.count("= Allgather(") == 1 and result.stdout.count("= ReduceScatter(") == 1
    assert "allgather+matmul" in result.stdout  # the planner's decision and its reasons
    assert "on H200 (NVLink)" in result.stdout  # planned for a GPU, without one


def test_python_m_overlap_dump_plans_for_a_named_device_without_a_process_group(tmp_path):
    script = tmp_path / "blocks.py"
    script.write_text(
        "from launch.demo import build_tp_mlp\n"
        "def fusion(world):\n"
        "    return build_tp_mlp(8192, 4096, 16384, world)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "overlap", "dump", "--device", "h200", "--world", "8",
               "--cuda-graph", "--passes", str(script)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "=== overlap plan on H200 (NVLink), 8 ranks ===" in out
    assert "8 chunks, copy_engine, local_first order" in out  # the GPU plan, chosen
    assert "[copy_engine]" in out and "StageForPeers" in out  # and lowered
    for name in ("shard", "plan overlap", "apply the plan", "lower", "deallocate"):
        assert f"=== after {name} ===" in out
    bad = subprocess.run([*command[:-1], str(tmp_path / "missing.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "no such script" in bad.stderr


# -- the environment -------------------------------------------------------------------


def test_torchrun_is_detected_by_torchelastic_not_by_rank(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "OVERLAP_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")  # Ray Train and others set RANK too
    assert launcher() == "none" and rank_environment().world_size == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert launcher() == "torchrun"
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = rank_environment()
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.run_id) == (
        "torchrun", 1, 1, 2, "abc")  # fmt: skip


def test_a_broken_launch_environment_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("OVERLAP_LAUNCHER", "local")
    for name, value in (("RANK", "3"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(LaunchError, match="MASTER_PORT not set"):
        rank_environment()
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(LaunchError, match="RANK=3 is outside WORLD_SIZE=2"):
        rank_environment()


def test_a_ray_pool_numbers_its_ranks_node_by_node_whatever_the_bundles_order():
    from launch.ray_pool import ranks_node_by_node

    # SPREAD alternates the nodes; the ranks of a node must still be consecutive, so that
    # a mesh's inner (tensor-parallel) axis stays inside a node
    spread = {0: "a", 1: "b", 2: "a", 3: "b", 4: "c"}
    ranks = ranks_node_by_node(spread)
    assert [spread[bundle] for bundle in ranks] == ["a", "a", "b", "b", "c"]
    assert ranks == [0, 2, 1, 3, 4]
    assert ranks_node_by_node({0: "b", 1: "a", 2: "b"}) == [0, 2, 1]  # rank 0 on bundle 0
    assert ranks_node_by_node({1: "a", 0: "a"}) == [0, 1]


# -- the Ray pool ----------------------------------------------------------------------

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_instance():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=150 * 2**20,
             log_to_driver=False)  # fmt: skip
    # the actors cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.mark.ray
def test_the_ray_pool_runs_a_fusion_like_the_reference(ray_instance):
    from launch.ray_pool import PoolError, RayPool

    fd = build_tp_mlp(*SIZES, 2)
    whole = whole_inputs(*SIZES)
    with RayPool(2) as pool:
        assert pool.devices == ["cpu", "cpu"]
        (y,) = pool.run(fd, whole)
        assert_close(y, fd.execute(whole)[0], reduction_extent=SIZES[2], partial_sums=2)
        # per-rank pieces instead of whole tensors
        tokens = SIZES[0] // 2
        x, w1, w2 = whole
        pieces = [[x[r * tokens:(r + 1) * tokens], w1[:, r * 64:(r + 1) * 64],
                   w2[r * 64:(r + 1) * 64]] for r in range(2)]  # fmt: skip
        (again,) = pool.run(fd, pieces, per_rank=True)
        assert torch.equal(again, y)
        # a bad input is refused on every rank before any collective: the pool stays
        with pytest.raises(PoolError, match="still usable") as refused:
            pool.run(fd, [x[:, :16], w1, w2])
        assert "InputError" in str(refused.value)
        assert "expected the local shape [32, 32] (of the whole [64, 32]), got [32, 16]" in str(
            refused.value
        )
        (after,) = pool.run(fd, whole)
        assert torch.equal(after, y)


def _fp8_and_fp4_pieces(world: int):
    from fusion import FusionDefinition
    from sharding import DeviceMesh, Shard, shard

    mesh = DeviceMesh(world)
    with FusionDefinition("storage") as fd:
        low = fd.define_tensor([6, 8], "float8_e4m3fn")
        packed = fd.define_tensor([6, 8], "float4_e2m1")
        fd.add_output(fd.ops.set(low))
        fd.add_output(fd.ops.set(packed))
    shard(low, mesh, [Shard(0)])
    shard(packed, mesh, [Shard(1)])  # split on the packed axis: 4 values (2 bytes) a rank
    values = 3 * torch.randn(6, 8, generator=torch.Generator().manual_seed(7))
    return fd, [values.to(torch.float8_e4m3fn), to_fp4(values)]


@pytest.mark.ray
def test_the_ray_pool_moves_and_assembles_fp8_and_fp4(ray_instance):
    from launch.ray_pool import RayPool

    fd, whole = _fp8_and_fp4_pieces(2)
    with RayPool(2) as pool:
        for per_rank in (False, True):
            low, packed = whole
            pieces = [[low[r * 3 : (r + 1) * 3], packed[:, r * 2 : (r + 1) * 2]] for r in range(2)]
            inputs = pieces if per_rank else whole
            outputs = pool.run(fd, inputs, per_rank=per_rank)
            for out, value in zip(outputs, whole, strict=True):
                assert out.dtype == value.dtype and out.shape == value.shape
                assert torch.equal(out.view(torch.uint8), value.view(torch.uint8))


def _wait_or_die(communicator):
    """Rank 1 dies mid-run; rank 0 waits for it in a collective."""
    import torch.distributed as dist

    if communicator.rank == 1:
        time.sleep(1.0)
        os._exit(3)
    dist.barrier()


@pytest.mark.ray
def test_a_dead_actor_fails_the_call_promptly_and_names_its_rank(ray_instance):
    from launch.ray_pool import PoolError, RayPool

    pool = RayPool(2, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(PoolError) as failure:
        pool.call(_wait_or_die)
    assert time.monotonic() - start < 60
    assert failure.value.rank == 1, str(failure.value)
    assert "rank 1" in str(failure.value)
    with pytest.raises(LaunchError, match="shut down"):
        pool.call(_wait_or_die)
    # the pool can be built again on the same Ray instance
    with RayPool(2) as fresh:
        assert fresh.call(lambda communicator: communicator.rank) == [0, 1]


_POOLS_ONE_AFTER_ANOTHER = """
import os

import ray

from launch.env import LaunchError
from launch.ray_pool import RayPool

SMALL = {"num_cpus": 1, "object_store_memory": 100 * 2**20, "log_to_driver": False}

# Ray's default, token authentication, for the instance the pool starts: not left in
# os.environ after it
RayPool(1, init_options=SMALL).shutdown()
assert "RAY_AUTH_MODE" not in os.environ, os.environ["RAY_AUTH_MODE"]
ray.shutdown()

# a cluster without it, the driver connected by a plain ray.init(), which keeps the
# token cached: the pool says why its actors were cancelled
os.environ["RAY_AUTH_MODE"] = "disabled"
ray.init(include_dashboard=False, **SMALL)
try:
    RayPool(1, timeout_s=60)
except LaunchError as error:
    assert "token authentication" in str(error), error
else:
    raise AssertionError("a pool on a driver that requires a token ran")
ray.shutdown()

# the pool that starts Ray reads RAY_AUTH_MODE again: its actors run
with RayPool(1, init_options=SMALL, timeout_s=60) as pool:
    assert pool.call(lambda communicator: communicator.world_size) == [1]
ray.shutdown()
print("three pools, one after another")
"""


@pytest.mark.ray
def test_a_pool_runs_after_ray_was_shut_down_and_its_authentication_changed(tmp_path):
    """Ray keeps the token authentication of a process's first instance (in os.environ
    and cached) after ``ray.shutdown()``; a cluster started next without it took the
    driver for dead and cancelled the pool's actors before they ran. In a process of its
    own: this one's Ray has its own history."""
    driver = tmp_path / "pools.py"
    driver.write_text(_POOLS_ONE_AFTER_ANOTHER)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_AUTH_MODE", None)
    result = subprocess.run([sys.executable, str(driver)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "three pools, one after another" in result.stdout


@pytest.mark.ray
def test_overlap_run_through_a_ray_pool(script, tmp_path):
    result = _overlap("run", "--launcher", "ray", "--nproc", 2, script, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_pieces(tmp_path)


def test_a_kernel_compile_says_how_long_it_took_once_and_a_cached_one_says_nothing():
    code = (
        "import os, sys\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from overlap.diag import progress\n"
        "from overlap.runtime import compute_steps\n"
        "progress.enable()\n"
        "import torch\n"
        "from examples.norms import BUILDERS, make_inputs\n"
        "from overlap.runtime.executor import MultiDeviceExecutor\n"
        "fd = BUILDERS['rmsnorm_fwd'](64, 'float32')\n"
        "inputs = make_inputs('rmsnorm_fwd', 3, 64, torch.float32, 'cpu', torch.Generator())\n"
        "compute_steps.COMPILED_S = 0.0  # any first launch counts as a compile\n"
        "executor = MultiDeviceExecutor(fd, kernels='generated')\n"
        "for _ in range(2):\n"
        "    executor.run(inputs)\n"
        "print('second executor', file=sys.stderr, flush=True)\n"
        "compute_steps.COMPILED_S = 30.0  # a compile takes a while, a cache hit does not\n"
        "MultiDeviceExecutor(fd, kernels='generated').run(inputs)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("[overlap]") or line == "second executor"]  # fmt: skip
    # once, when the kernel is first launched, not on the second run; a first launch
    # quicker than COMPILED_S (Triton found the kernel compiled) says nothing: the
    # interpreter compiles nothing, so the threshold stands in for Triton's cache here
    assert len(lines) == 2 and lines[1] == "second executor", lines
    assert re.fullmatch(r"\[overlap\] rank 0: compiled k0 \[normalization\]: [0-9.]+ s", lines[0])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run", "--nproc", "-1", "x.py"], "argument --nproc: -1: it must be at least 1"),
        (["run", "--nproc", "0", "x.py"], "argument --nproc: 0: it must be at least 1"),
        (["run", "--launcher", "torchrun", "--nproc", "-1", "x.py"], "it must be at least 1"),
        (["demo", "--tokens", "abc"], "argument --tokens: 'abc' is not a whole number"),
        (["demo", "--ffn", "0"], "argument --ffn: 0: it must be at least 1"),
        (["dump", "--world", "0", "x.py"], "argument --world: 0: it must be at least 1"),
    ],
)
def test_the_command_line_refuses_counts_below_one_before_anything_runs(args, says):
    result = _overlap(*args, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr, result.stderr


def test_the_command_line_says_its_version_and_the_demos_defaults():
    version = _overlap("--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("overlap 0."), version.stdout
    demo = _overlap("demo", "--help", timeout=60)
    assert "default 16384 on GPUs, 512 on CPUs" in " ".join(demo.stdout.split()), demo.stdout


@pytest.mark.parametrize("how", ["torchrun", pytest.param("ray", marks=pytest.mark.ray)])
def test_the_tensor_parallel_example_runs_under_plain_torchrun_and_on_a_ray_pool(how):
    """``examples/tp_mlp.py``: a complete multi-rank script (seeded inputs, every rank's
    output checked against one device, the timings) run directly under torchrun, and by
    ``overlap run`` on a Ray pool."""
    sizes = ["--tokens", "64", "--hidden", "32", "--ffn", "64", "--runs", "1"]
    script = str(ROOT / "examples" / "tp_mlp.py")
    if how == "torchrun":
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OVERLAP_LAUNCHER"):
            env.pop(name, None)
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", script, *sizes],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    else:
        pytest.importorskip("ray")
        result = _overlap("run", "--launcher", "ray", "--nproc", 2, script, *sizes)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    said = result.stdout + result.stderr
    assert "tp_mlp on 2 ranks (cpu): every rank's output matches one device; sequential" in said
    # plain text: no colour codes around Ray's rank lines, no notice of its default auth
    assert "\x1b[" not in said and "Token authentication is enabled" not in said, said


_MANY_COLLECTIVES = """
import torch
import torch.distributed as dist

from overlap import Communicator

Communicator.initialize("gloo")
for _ in range(50):  # finished collectives whose tensors gloo's threads release late
    dist.all_reduce(torch.ones(1000))
print("done", dist.get_rank())
"""


def test_an_uncaught_exception_in_a_launched_rank_prints_its_traceback(tmp_path):
    """A rank torchrun started, that joined its group with ``launch.init`` and then
    raised, exits 1 with its traceback on stderr: torch's own excepthook, set by
    ``init_process_group`` around the fail-fast one, holds stderr in a buffer that a
    process exiting at once would never print."""
    script = tmp_path / "raises.py"
    script.write_text("from launch.env import init\ninit()\nraise ValueError('boom')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[overlap] rank 0 failed:" in result.stderr, result.stderr
    assert "ValueError: boom" in result.stderr and "raises.py" in result.stderr


_FINISH = """
import atexit
import sys
import time

import torch
import torch.distributed as dist

from launch import failfast

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.all_reduce(torch.ones(10))
if sys.argv[2] == "returns":
    real = dist.destroy_process_group
    dist.destroy_process_group = lambda: (real(), sys.stderr.write("destroyed\\n"))
elif sys.argv[2] == "hangs":
    dist.destroy_process_group = lambda: time.sleep(120)
elif sys.argv[2] == "raises":
    def refuse():
        raise RuntimeError("cannot destroy")
    dist.destroy_process_group = refuse
atexit.register(lambda: print("interpreter teardown", flush=True))
print("done", end="")  # left in the buffer: finish flushes it
failfast.finish(3, timeout_s=2)
print("after finish")
"""


@pytest.mark.parametrize("destroy", ["returns", "hangs", "raises"])
def test_finish_flushes_and_exits_without_the_interpreter_teardown(tmp_path, destroy):
    """``failfast.finish(code)``: the output buffered so far is written, the process
    exits with ``code`` at once, and no exit handler of the interpreter runs; a destroy
    of the process groups that hangs is left behind after the time given, one that
    raises is printed. (Whether the SIGABRT it avoids would have happened cannot be
    shown on demand: it came once in 8 runs of check_gpu.py.)"""
    script = tmp_path / "finish.py"
    script.write_text(_FINISH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "store"), destroy],
                            env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout == "done", result.stdout + result.stderr
    said = {"returns": "destroyed", "hangs": "did not return in 2 s", "raises": "cannot destroy"}
    assert said[destroy] in result.stderr, result.stderr
    assert time.monotonic() - started < 30


def test_a_finished_rank_exits_zero_though_gloo_threads_release_tensors_late(tmp_path):
    """A process that built a ``Communicator`` and returns from its script exits 0. Left
    to the interpreter, gloo's worker threads released the last collectives' tensors
    during finalization and aborted the process (SIGABRT) in about half the runs of this
    script; the Communicator destroys the process groups at exit."""
    script = tmp_path / "many_collectives.py"
    script.write_text(_MANY_COLLECTIVES)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OVERLAP_LAUNCHER"):
        env.pop(name, None)
    for _ in range(4):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(script)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        assert result.stdout.count("done") == 2, result.stdout  # both ranks finished
