"""Figures for a GPU with none recorded: measured at first use, kept on disk, planned with.

A made-up GPU stands in for one (torch's device properties and the measuring functions
replaced by fakes that count their calls; the cache folder a test's own), so that these
run on a CPU. The cost model refuses figures a cost would divide by 0 with.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types

import pytest
import torch

from fusion import FusionDefinition
from overlap import compile_program
from overlap.comm import measure
from overlap.comm.measure import device_figures
from overlap.plan import figures as figures_module
from overlap.plan.cost_model import predict
from overlap.plan.figures import (
    H200_FIGURES,
    H200_X4_FIGURES,
    LinkFigures,
    measured_figures,
    recorded_figures,
)
from overlap.plan.planner import plan_overlap
from schedulers import device_cache, hardware
from schedulers.hardware import H100, H200, current_hardware
from sharding import DeviceMesh, Shard, shard, shard_fusion

MADE_UP = "NVIDIA Made-Up GPU"
MEASURED_MEMORY_GBPS = 1234.5
MEASURED_LINKS = LinkFigures(collective_gbps=90.0, copy_engine_gbps=45.0)
MEASURED_PROBE_US = 30.0  # the host probe of the made-up GPU's host
GPU = torch.device("cuda", 0)


def _properties(name: str) -> types.SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` says of a GPU named ``name``."""
    return types.SimpleNamespace(
        name=name, major=8, minor=9, multi_processor_count=100, L2_cache_size=64 * 2**20,
        shared_memory_per_block_optin=99 * 1024, regs_per_multiprocessor=65536, warp_size=32,
        max_threads_per_multi_processor=1536, uuid=f"GPU-{name}",
    )  # fmt: skip


class Counted:
    """A fake measurement: returns ``value`` and counts its calls."""

    def __init__(self, value: object) -> None:
        self.value = value
        self.calls = 0

    def __call__(self, *args: object) -> object:
        self.calls += 1
        return self.value


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A made-up GPU (its name settable: ``gpu.name``) whose copy, links and host probe
    measure as ``MEASURED_*``; the cache in ``tmp_path``. Yields the fake measurements."""
    state = types.SimpleNamespace(name=MADE_UP, copy=Counted(MEASURED_MEMORY_GBPS),
                                  links=Counted(MEASURED_LINKS),
                                  probe=Counted(MEASURED_PROBE_US))  # fmt: skip
    monkeypatch.setenv(device_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _properties(state.name))
    monkeypatch.setattr(hardware, "measure_copy_gbps", state.copy)
    monkeypatch.setattr(measure, "measure_links", state.links)
    monkeypatch.setattr(measure, "host_probe_us", state.probe)
    return state


class FakeCommunicator:
    """Two ranks, this one rank 0: the peer says what ``peer_says`` makes of what this
    rank says (the same, by default)."""

    world_size = 2
    rank = 0
    device = GPU

    def __init__(self, peer_says=lambda value: value) -> None:
        self.peer_says = peer_says

    def all_gather_object(self, value: object) -> list[object]:
        return [value, self.peer_says(value)]


def _cache_files(folder, kind: str) -> list:
    return sorted(folder.glob(f"{kind}_*.json"))


# --- the copy bandwidth the heuristics read (schedulers.hardware) --------------------


def test_a_gpu_with_no_recorded_profile_has_its_copy_bandwidth_measured_once(gpu, tmp_path):
    profile = current_hardware(GPU)
    assert profile.name == MADE_UP and profile.sm_count == 100
    assert profile.memory_gbps == MEASURED_MEMORY_GBPS
    (kept,) = _cache_files(tmp_path, "memory")
    content = json.loads(kept.read_text())
    assert content["key"] == {"device": MADE_UP, "torch": torch.__version__}
    assert content["figures"] == {"memory_gbps": MEASURED_MEMORY_GBPS}
    assert current_hardware(GPU).memory_gbps == MEASURED_MEMORY_GBPS  # read back
    assert gpu.copy.calls == 1
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]  # no temporary file left


@pytest.mark.parametrize(
    "corrupt",
    [
        "{not json",
        "",
        json.dumps(
            {
                "key": {"device": "another GPU", "torch": torch.__version__},
                "figures": {"memory_gbps": 99.0},
            }
        ),  # fmt: skip
        json.dumps(
            {
                "key": {"device": MADE_UP, "torch": torch.__version__},
                "figures": {"memory_gbps": 0.0},
            }
        ),  # fmt: skip
        json.dumps(
            {
                "key": {"device": MADE_UP, "torch": torch.__version__},
                "figures": {"memory_gbps": "fast"},
            }
        ),  # fmt: skip
        json.dumps([1, 2]),
    ],
    ids=["not-json", "empty", "another-key", "zero", "not-a-number", "not-an-object"],
)
def test_a_cache_file_that_cannot_be_trusted_is_measured_again(gpu, tmp_path, corrupt):
    current_hardware(GPU)
    (kept,) = _cache_files(tmp_path, "memory")
    kept.write_text(corrupt)
    gpu.copy.value = 2000.0
    assert current_hardware(GPU).memory_gbps == 2000.0
    assert gpu.copy.calls == 2
    assert json.loads(kept.read_text())["figures"] == {"memory_gbps": 2000.0}  # rewritten


def test_a_recorded_gpu_is_not_measured(gpu, tmp_path):
    gpu.name = H100.name
    assert current_hardware(GPU).memory_gbps == H100.memory_gbps
    assert gpu.copy.calls == 0 and not list(tmp_path.iterdir())


def test_an_unwritable_cache_warns_and_the_run_goes_on(gpu, tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv(device_cache.CACHE_DIR_ENV, str(blocked / "overlap"))
    with pytest.warns(UserWarning, match="could not keep the measured memory figures"):
        assert current_hardware(GPU).memory_gbps == MEASURED_MEMORY_GBPS


def test_the_cache_folder_follows_xdg_cache_home_without_overlap_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(device_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert device_cache.cache_dir() == tmp_path / "overlap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert device_cache.cache_dir() == tmp_path / "home" / ".cache" / "overlap"


# --- the figures the planner plans with (overlap.comm.measure.device_figures) ---------


def test_one_rank_on_a_made_up_gpu_gets_its_measured_copy_bandwidth_and_no_links(gpu):
    figures = device_figures(GPU)
    assert figures.device.name == MADE_UP
    assert figures.memory_gbps == MEASURED_MEMORY_GBPS
    assert figures.ranks == 1 and not figures.has_copy_engine
    assert gpu.links.calls == 0  # one rank: no link to measure
    with FusionDefinition("matmul_relu") as fd:  # the planner plans with them
        a = fd.define_tensor([64, 32])
        b = fd.define_tensor([32, 16])
        fd.add_output(fd.ops.relu(fd.ops.matmul(a, b)))
    compiled = compile_program(fd.fusion, 1, None, figures)
    assert compiled.figures is figures and not list(compiled.plan)


def test_two_ranks_on_a_made_up_gpu_measure_their_links_once_and_keep_them(gpu, tmp_path):
    figures = device_figures(GPU, FakeCommunicator())
    assert (figures.memory_gbps, figures.collective_gbps, figures.p2p_gbps) == (
        MEASURED_MEMORY_GBPS, MEASURED_LINKS.collective_gbps, MEASURED_LINKS.collective_gbps,
    )  # fmt: skip
    assert figures.copy_engine_gbps == MEASURED_LINKS.copy_engine_gbps and figures.ranks == 2
    assert gpu.links.calls == 1
    (kept,) = _cache_files(tmp_path, "links")
    content = json.loads(kept.read_text())
    assert content["key"] == {"device": MADE_UP, "ranks": 2, "hosts": 1, "torch": torch.__version__}
    assert content["figures"] == dataclasses.asdict(MEASURED_LINKS)
    assert device_figures(GPU, FakeCommunicator()) == figures  # read back, not measured
    assert gpu.links.calls == 1 and gpu.copy.calls == 1
    kept.write_text('{"key": ')  # corrupt: measured again
    assert device_figures(GPU, FakeCommunicator()) == figures
    assert gpu.links.calls == 2


def test_every_rank_measures_when_a_peer_has_no_links_kept(gpu):
    device_figures(GPU, FakeCommunicator())
    assert gpu.links.calls == 1

    def peer_without_cache(value):
        return None if isinstance(value, LinkFigures) else value

    device_figures(GPU, FakeCommunicator(peer_without_cache))
    assert gpu.links.calls == 2  # this rank had them kept, and measured with its peer


def test_the_ranks_plan_with_the_slowest_ranks_figures(gpu):
    def slower_peer(value):
        if isinstance(value, LinkFigures):
            return LinkFigures(collective_gbps=30.0, copy_engine_gbps=0.0)
        if isinstance(value, tuple):  # (device, copy bandwidth, host, GPU)
            return (value[0], 1000.0, value[2], "GPU-peer")
        return value

    device_figures(GPU, FakeCommunicator())  # kept here; the peer has slower ones kept
    figures = device_figures(GPU, FakeCommunicator(slower_peer))
    assert (figures.memory_gbps, figures.collective_gbps) == (1000.0, 30.0)
    assert not figures.has_copy_engine


def test_ranks_on_gpus_of_different_kinds_are_refused_before_measuring(gpu):
    def other_kind(value):
        return ("NVIDIA Other GPU", *value[1:]) if isinstance(value, tuple) else value

    with pytest.raises(RuntimeError, match="GPUs of different kinds.*NVIDIA Made-Up GPU"):
        device_figures(GPU, FakeCommunicator(other_kind))
    assert gpu.links.calls == 0


def test_recorded_gpus_plan_with_their_recorded_figures_unmeasured(gpu):
    gpu.name = H100.name
    figures = device_figures(GPU, FakeCommunicator())
    assert figures == recorded_figures(current_hardware(GPU))
    assert figures.collective_gbps == H200_FIGURES.collective_gbps
    assert figures.memory_gbps == H100.memory_gbps
    assert gpu.links.calls == 0 and gpu.copy.calls == 0


class FourRanks(FakeCommunicator):
    world_size = 4

    def all_gather_object(self, value: object) -> list[object]:
        return [value] + [self.peer_says(value)] * 3


def test_a_team_of_four_h200s_plans_with_the_figures_measured_at_four_ranks(gpu):
    gpu.name = H200.name
    pair = device_figures(GPU, FakeCommunicator())
    four = device_figures(GPU, FourRanks())
    assert pair.ranks == 2 and pair.p2p_gbps == H200_FIGURES.p2p_gbps
    assert four.ranks == 4 and four.p2p_gbps == H200_X4_FIGURES.p2p_gbps
    assert four.collective_gbps == H200_X4_FIGURES.collective_gbps != pair.collective_gbps
    assert four.device == current_hardware(GPU)  # this device's profile, as for a pair
    assert gpu.links.calls == 0


def _ag_matmul(world: int = 2):
    """An all-gather of a matmul's rows over ``world`` ranks, at a size worth overlapping."""
    mesh = DeviceMesh(world)
    with FusionDefinition("ag_matmul") as fd:
        a = fd.define_tensor([8192, 8192], "bf16")
        b = fd.define_tensor([8192, 4096 * world], "bf16")
        fd.add_output(fd.ops.matmul(a, b))
    shard(a, mesh, [Shard(0)])
    shard(b, mesh, [Shard(1)])
    return fd


def test_the_planner_plans_with_a_made_up_gpus_measured_figures(gpu):
    figures = device_figures(GPU, FakeCommunicator())
    compiled = compile_program(_ag_matmul(), 2, None, figures)
    (decision,) = compiled.plan
    transports = {candidate.transport for candidate in decision.candidates}
    assert "copy_engine" in transports  # the copy-engine path was found, and priced
    assert all(candidate.predicted_ms > 0 for candidate in decision.candidates)
    assert MADE_UP in decision.reason


@pytest.fixture
def h200_host_probe(monkeypatch: pytest.MonkeyPatch):
    """The H200's host figures as if measured beside a host probe of 10 us."""
    host = dataclasses.replace(H200_FIGURES.host, probe_us=10.0, run_us=20.0)
    probed = dataclasses.replace(H200_FIGURES, host=host)
    monkeypatch.setattr(figures_module, "H200_FIGURES", probed)
    return host


def test_a_made_up_gpus_host_figures_are_the_h200s_scaled_by_its_probe_kept(
    gpu, tmp_path, h200_host_probe
):
    """Its host probe took 3 times the H200 host's: every host cost is 3 times the H200's.
    The probe is kept on disk for this device and host, and read back, not measured."""
    for communicator in (None, FakeCommunicator()):
        host = device_figures(GPU, communicator).host
        factor = MEASURED_PROBE_US / h200_host_probe.probe_us
        for kind, us in h200_host_probe.step_us.items():
            assert host.step_us[kind] == pytest.approx(us * factor), kind
        assert host.run_us == pytest.approx(h200_host_probe.run_us * factor)
        assert host.graph_replay_us == pytest.approx(h200_host_probe.graph_replay_us * factor)
        assert host.probe_us == pytest.approx(MEASURED_PROBE_US)
        assert "scaled by this host's probe" in host.source
    assert gpu.probe.calls == 1
    (kept,) = _cache_files(tmp_path, "host")
    assert json.loads(kept.read_text())["figures"] == {"probe_us": MEASURED_PROBE_US}


def test_the_ranks_plan_with_the_slowest_hosts_figures(gpu, h200_host_probe):
    def slower_host(value):
        return 2 * value if isinstance(value, float) else value

    host = device_figures(GPU, FakeCommunicator(slower_host)).host
    assert host.probe_us == pytest.approx(2 * MEASURED_PROBE_US)
    assert host.run_us == pytest.approx(h200_host_probe.run_us * 2 * MEASURED_PROBE_US / 10.0)


def test_without_a_probe_beside_the_h200s_host_figures_they_are_used_as_they_are(gpu):
    """The H200's host figures not measured beside a probe (the fallback): a made-up GPU's
    host cannot be scaled from them, and plans with them as they are."""
    unprobed = dataclasses.replace(H200_FIGURES.host, probe_us=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures_module, "H200_FIGURES",
                      dataclasses.replace(H200_FIGURES, host=unprobed))  # fmt: skip
        assert device_figures(GPU, FakeCommunicator()).host == unprobed


# --- the cost model's guard -----------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "transport", "missing"),
    [
        ({"device": dataclasses.replace(H100, memory_gbps=0.0)}, "copy_engine", "memory_gbps"),
        ({"collective_gbps": 0.0}, None, "collective_gbps"),
        ({"p2p_gbps": 0.0}, "ring", "p2p_gbps"),
        ({"copy_engine_gbps": 0.0}, "copy_engine", "copy_engine_gbps"),
        ({"matmul_tflops": float("nan")}, "collective", "matmul_tflops"),
    ],
)
def test_the_cost_model_names_the_device_and_the_figure_it_lacks(change, transport, missing):
    figures = dataclasses.replace(H200_FIGURES, **change)
    named = re.escape(f"on {figures.name} (device {figures.device.name}): no ")
    with pytest.raises(ValueError, match=rf"{named}.*{missing}"):
        predict("allgather+matmul", figures, (8192, 8192, 4096), 2, 16, transport, 4)


def test_a_gpu_without_a_profile_no_longer_reaches_a_zero_division():
    """The reported bug: an unknown GPU's figures had a copy bandwidth of 0 and a
    copy-engine figure, and planning a copy-engine pipeline divided by the 0."""
    unmeasured = dataclasses.replace(H100, name=MADE_UP, memory_gbps=0.0)
    figures = dataclasses.replace(H200_FIGURES, name=MADE_UP, device=unmeasured)
    fusion = shard_fusion(_ag_matmul().fusion)[0]
    with pytest.raises(ValueError, match="no copy bandwidth"):
        plan_overlap(fusion, figures)


def test_one_ranks_figures_priced_for_two_ranks_say_what_is_missing():
    one_rank = measured_figures(dataclasses.replace(H100, name=MADE_UP), 1, None)
    with pytest.raises(ValueError, match="collective_gbps.*p2p_gbps"):
        plan_overlap(shard_fusion(_ag_matmul().fusion)[0], one_rank)
