"""Fixtures shared by the tests: a seeded generator per test and random inputs of any dtype.

Tests that start processes (a pool of ranks, a launcher, a benchmark run) are marked
``slow``: ``python -m pytest -q -m "not slow"`` runs the rest, the quick subset.
"""

from __future__ import annotations

import os

# Generated kernels run in Triton's interpreter in the tests. Triton reads this when it
# is imported, so it is set here, before any test module imports it. (Set at a test
# module's import, it also reached scripts that import that module: benchmarks/check_gpu.py
# then ran every kernel interpreted on GPUs.)
os.environ.setdefault("TRITON_INTERPRET", "1")

import zlib  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fusion.dtypes import DataType, float4_e2m1  # noqa: E402
from fusion.fp4 import to_fp4  # noqa: E402

MakeInput = Callable[..., torch.Tensor]

# Modules whose every test starts processes: launchers, benchmark scripts, clusters
# (test_docs and test_launch_cli mark theirs one by one: their other tests read files or
# call the command line in-process)
_PROCESS_MODULES = {"test_benchmarks", "test_cluster_launch", "test_launch", "test_ucx"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        fixtures = getattr(item, "fixturenames", ())
        if "rank_pools" in fixtures or module in _PROCESS_MODULES:
            item.add_marker(pytest.mark.slow)
        # the README runs the others on two pytest-xdist workers, then these alone, one
        # at a time: a Ray cluster started without an address joins the last one started
        # on the machine, and an "auto" address finds any
        if "ray_instance" in fixtures and not item.get_closest_marker("ray"):
            raise pytest.UsageError(f"{item.nodeid} starts Ray: mark it pytest.mark.ray")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test's id: every test draws its own inputs, reproducibly."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def make_input(rng: torch.Generator) -> MakeInput:
    """``make_input(shape, dtype, low=None, high=None)``: a fresh random fusion input.

    ``shape`` is logical (fp4 counts values; the tensor comes back packed two per byte).

    - compute floats: N(0, 1), or uniform in ``[low, high)`` when both are given;
    - integers: uniform in ``[low, high)`` (default ``[-100, 100)``), clipped to the type;
    - bool: fair coin flips; all True when ``low >= 1`` (e.g. a divisor), all False when
      ``high <= 1``;
    - fp8: 2 * N(0, 1) rounded to the type; fp4: 3 * N(0, 1) rounded and packed, so that
      every code, saturated ones included, shows up.
    """

    def make(
        shape: Sequence[int],
        dtype: DataType,
        low: float | None = None,
        high: float | None = None,
    ) -> torch.Tensor:
        shape = tuple(shape)
        if dtype.is_bool:
            low = 0 if low is None else min(max(int(low), 0), 1)
            high = 2 if high is None else min(max(int(high), low + 1), 2)
            return torch.randint(low, high, shape, generator=rng).bool()
        if dtype.is_integer:
            info = torch.iinfo(dtype.torch_dtype)
            low = max(-100 if low is None else int(low), info.min)
            high = min(100 if high is None else int(high), info.max + 1)
            return torch.randint(low, high, shape, generator=rng, dtype=dtype.torch_dtype)
        if dtype is float4_e2m1:
            return to_fp4(3 * torch.randn(shape, generator=rng))
        if dtype.storage_only:
            return (2 * torch.randn(shape, generator=rng)).to(dtype.torch_dtype)
        wide = torch.float64 if dtype.bits == 64 else torch.float32
        if low is None:
            values = torch.randn(shape, generator=rng, dtype=wide)
        else:
            values = low + (high - low) * torch.rand(shape, generator=rng, dtype=wide)
        return values.to(dtype.torch_dtype)

    return make


@pytest.fixture(scope="session")
def rank_pools():
    """``rank_pools(n)``: a pool of n gloo ranks, started once and restarted after a hang."""
    from distributed import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
