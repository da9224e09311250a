"""``overlap run --launcher ray`` with an address where no Ray cluster runs. In a module of
its own: ``test_launch.py`` keeps a Ray instance up for its whole module, which an
``auto`` address would find."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _no_ray_processes(timeout_s: float = 60.0) -> None:
    """Until no Ray process on this machine names a GCS address, which ``auto`` finds by
    listing processes: after ``ray.shutdown()`` (``test_launch.py``'s Ray instance, the
    test before this one) its processes may outlive the call by seconds on a busy
    machine (seen under two pytest-xdist workers)."""
    from ray._private.services import find_gcs_addresses

    deadline = time.monotonic() + timeout_s
    while find_gcs_addresses() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = find_gcs_addresses()
    assert not left, f"Ray processes still serve {sorted(left)} after {timeout_s} s"


@pytest.mark.ray  # it must find no cluster: never beside another Ray test
def test_a_ray_address_without_a_cluster_is_one_clear_line(tmp_path):
    _no_ray_processes()
    script = tmp_path / "nothing.py"
    script.write_text("def main(communicator):\n    pass\n")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", "--launcher", "ray", "--address", "auto",
         str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("overlap run: Ray: no cluster at address 'auto'"), result.stderr
    assert "Traceback" not in result.stderr


def test_more_ranks_than_the_machines_gpus_are_refused(monkeypatch):
    import torch

    from launch.env import LaunchError
    from launch.local import fits_the_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fits_the_devices(2)
    fits_the_devices(None)
    fits_the_devices(8, "ray")  # a Ray pool asks its cluster
    with pytest.raises(LaunchError, match="--nproc 3: this machine has 2 GPUs, one per rank"):
        fits_the_devices(3, "torchrun")
