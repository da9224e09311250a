"""The Ray pool on an existing cluster: one given by its address (a head node started
here), and one of two nodes on this machine (``ray.cluster_utils.Cluster``) that the pool
spreads its ranks over, and restarts on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fusion.testing import assert_close

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import sys

from fusion.testing import assert_close
from launch.demo import build_tp_mlp, whole_inputs
from launch.ray_pool import RayPool

fd = build_tp_mlp(64, 32, 128, 2)
whole = whole_inputs(64, 32, 128)
with RayPool(2, address=sys.argv[1]) as pool:
    (y,) = pool.run(fd, whole)
assert_close(y, fd.execute(whole)[0], reduction_extent=128, partial_sums=2)
print("matches the reference on", sys.argv[1])
"""


def test_a_pool_joins_an_existing_cluster_by_its_address(tmp_path):
    from launch.env import free_port

    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray_cli, "the ray command comes with the ray package"
    # a throwaway local cluster: without Ray 2.60's token authentication, which a driver
    # joining by address would otherwise need the cluster's token for
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    port = free_port()
    # a short temp dir: Ray's socket paths must fit a unix socket's 107 characters
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # --block: the head stays this process's child, and stopping it stops that cluster
    # alone (`ray stop` would stop every Ray process of the machine)
    command = [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
               "--include-dashboard=false", f"--temp-dir={temp}"]  # fmt: skip
    head = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        address = f"{_node_ip()}:{port}"
        _wait_for(address, head)
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        result = subprocess.run([sys.executable, str(script), address], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=180)  # fmt: skip
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert f"matches the reference on {address}" in result.stdout
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _wait_for(address: str, head: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """Until the head's port takes connections (or the head died)."""
    import socket
    import time

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, f"the Ray head exited with {head.returncode}"
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) == 0:
                time.sleep(2.0)  # the rest of the head (raylet) comes up after the GCS
                return
        time.sleep(0.5)
    raise AssertionError(f"no Ray head at {address} within {timeout_s} s")


# -- two nodes on this machine ---------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes of 2 CPUs each; its address. The first pool connects
    this process to it (``RayPool(address=...)``, which reads ``RAY_AUTH_MODE`` again
    where a plain ``ray.init`` keeps the token of ``test_launch.py``'s instance:
    ``launch.ray_pool`` says why). Without token authentication: a driver in another
    process joins it by address."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setenv("RAY_AUTH_MODE", "disabled")
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 2, "include_dashboard": False})  # fmt: skip
        try:
            cluster.add_node(num_cpus=2)
            # the actors cannot import this test module: its functions travel by value
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            yield cluster.address
        finally:
            ray.shutdown()
            cluster.shutdown()


def _where_and_a_sum(communicator):
    """This rank's launch environment, node and node IP, and an all-reduced sum."""
    import torch.distributed as dist

    from launch import rank_environment

    total = torch.full((3,), float(communicator.rank + 1))
    dist.all_reduce(total)
    node = ray.get_runtime_context().get_node_id()
    return rank_environment(), node, ray.util.get_node_ip_address(), total


def test_the_pool_spreads_its_ranks_over_two_nodes_and_runs_across_them(two_nodes):
    from launch.demo import build_tp_mlp, whole_inputs
    from launch.ray_pool import RayPool

    sizes = (64, 32, 128)
    fd = build_tp_mlp(*sizes, 2)
    whole = whole_inputs(*sizes)
    # SPREAD (the default) puts one rank on each node, where PACK would put both on one
    with RayPool(2, address=two_nodes, init_options={"log_to_driver": False}) as pool:
        assert len(set(pool.nodes)) == 2, pool.nodes
        answers = pool.call(_where_and_a_sum)
        (y,) = pool.run(fd, whole)
    master_ip = answers[0][2]  # the rendezvous: rank 0's node
    for rank, (env, node, _, total) in enumerate(answers):
        assert node == pool.nodes[rank]
        assert (env.launcher, env.rank, env.local_rank, env.world_size, env.restart_count) == (
            "ray", rank, 0, 2, 0)  # fmt: skip
        assert env.master_addr == master_ip
        assert torch.equal(total, torch.full((3,), 1.0 + 2.0))
    assert_close(y, fd.execute(whole)[0], reduction_extent=sizes[2], partial_sums=2)


_RANK_1_DIES_ONCE = """
import os
import sys

import ray
import torch
import torch.distributed as dist

from launch import rank_environment


def main(communicator):
    attempt = rank_environment().restart_count
    if attempt == 0 and communicator.rank == 1:
        os._exit(3)  # dies (no exception) while rank 0 waits for it
    total = torch.full((2,), float(attempt + communicator.rank))
    dist.all_reduce(total)
    node = ray.get_runtime_context().get_node_id()
    with open(os.path.join(sys.argv[1], f"rank{communicator.rank}"), "w") as done:
        done.write(f"{attempt} {node} {total.tolist()}")
"""


def test_overlap_run_restarts_a_job_whose_rank_died_on_a_rebuilt_pool(two_nodes, tmp_path):
    """``overlap run --launcher ray --address ... --max-restarts 1``: rank 1 dies in
    attempt 0; the pool is built again over both nodes and attempt 1 finishes, every
    rank's result its own."""
    script = tmp_path / "dies_once.py"
    script.write_text(_RANK_1_DIES_ONCE)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    command = [sys.executable, "-m", "launch.cli", "run", "--launcher", "ray", "--address",
               two_nodes, "--nproc", "2", "--max-restarts", "1", "--timeout", "120",
               str(script), str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "rank 1 failed" in result.stderr and "(restart 1 of 1)" in result.stderr
    finished = [(tmp_path / f"rank{rank}").read_text().split(" ", 2) for rank in range(2)]
    # attempt 1 on both ranks, each on its own node, the sum of both ranks' (1 + rank)
    assert [attempt for attempt, _, _ in finished] == ["1", "1"]
    assert finished[0][1] != finished[1][1]
    assert [total for _, _, total in finished] == ["[3.0, 3.0]", "[3.0, 3.0]"]
