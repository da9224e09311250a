"""The Ray pool on an existing cluster given its address (a head node started here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")
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
