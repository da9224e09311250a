"""When the ranks exchange their inputs' shapes: at the first run and when inputs change.

A run whose inputs are as at the last checked run asks no one (no host collective); a
change on every rank is exchanged and checked on every rank, with the same verdict. A
change on one rank alone (its peers already in the program's collectives) is the
fail-fast benchmark's case (``test_benchmarks``): it needs processes that exit.
"""

from __future__ import annotations

import pytest
import torch
from distributed import RankError

from fusion import FusionDefinition
from fusion.errors import InputError
from overlap.executor import MultiDeviceExecutor
from overlap.inputs import InputChangeError, check_mode, check_own_inputs
from sharding import DeviceMesh, Replicate, Shard, shard


def _tokens_split_linear(world: int) -> FusionDefinition:
    """x [tokens, 6] split by rows (tokens symbolic) times a replicated weight [4, 6]."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(["tokens", 6])
        w = fd.define_tensor([4, 6])
        fd.add_output(fd.ops.linear(x, w))
    shard(x, DeviceMesh(world), [Shard(0)])
    shard(w, DeviceMesh(world), [Replicate()])
    return fd


def _counting_exchanges(communicator) -> list[str]:
    """The host exchanges ``communicator`` makes from now on, by group ("all", "check")."""
    made: list[str] = []
    everyone, checked = communicator.all_gather_object, communicator.input_check_exchange

    def all_gather_object(value):
        made.append("all")
        return everyone(value)

    def input_check_exchange(value):
        made.append("check")
        return checked(value)

    communicator.all_gather_object = all_gather_object
    communicator.input_check_exchange = input_check_exchange
    return made


def _good(executor, fd, tokens: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    full = [torch.randn(tokens, 6, generator=generator), torch.randn(4, 6, generator=generator)]
    return executor.shard_inputs(full), executor.shard_outputs(fd.execute(full))


def runs_with_and_without_exchanges(communicator) -> dict:
    """Twenty runs with unchanged shapes (new values), then every rank's tokens change,
    then they stay: by phase, the exchanges made and whether every output was right."""
    fd = _tokens_split_linear(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    made = _counting_exchanges(communicator)
    phases = {}
    for phase, tokens, runs in (("first", 8, 1), ("same", 8, 20), ("changed", 13, 1),
                                ("same again", 13, 5)):  # fmt: skip
        start, right = len(made), True
        for run in range(runs):
            local, expected = _good(executor, fd, tokens, seed=run)
            (out,) = executor.run(local)
            right &= torch.allclose(out, expected[0], atol=1e-5)
        phases[phase] = (made[start:], right)
    return phases


def test_unchanged_inputs_are_not_exchanged_and_changed_ones_are(rank_pools):
    for world in (2, 4):
        for rank, phases in enumerate(rank_pools(world).run(runs_with_and_without_exchanges)):
            assert phases == {
                # every rank's first run: the check on the usual group, then the ranks
                # agree that each built its program for these extents
                "first": (["all", "all"], True),
                "same": ([], True),
                "changed": (["check", "all"], True),  # the check on the short-timeout group
                "same again": ([], True),
            }, (world, rank, phases)


def always_and_never(communicator) -> tuple[list, list]:
    fd = _tokens_split_linear(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    made = _counting_exchanges(communicator)
    local, expected = _good(executor, fd, 8, seed=0)
    for _ in range(3):
        (out,) = executor.run(local, check_inputs="always")
        assert torch.allclose(out, expected[0], atol=1e-5)
    always, made[:] = list(made), []
    for _ in range(3):
        (out,) = executor.run(local, check_inputs=False)
        assert torch.allclose(out, expected[0], atol=1e-5)
    return always, list(made)


def test_always_exchanges_at_every_run_and_never_at_none(rank_pools):
    results = rank_pools(2).run(always_and_never)
    # one agreement on the program for these extents, at the first run
    assert results == [(["all"] * 4, [])] * 2


def bad_change_on_every_rank(communicator) -> None:
    """Good runs, then every rank's tokens change, the last rank's to a piece its peers'
    pieces cannot make (too long by two rows: only the exchange can tell)."""
    fd = _tokens_split_linear(communicator.world_size)
    executor = MultiDeviceExecutor(fd, communicator)
    for run in range(4):
        executor.run(_good(executor, fd, 8, seed=run)[0])
    local, _ = _good(executor, fd, 12, seed=9)
    if communicator.rank == communicator.world_size - 1:
        local[0] = torch.randn(local[0].shape[0] + 2, 6)
    executor.run(local)


def test_a_bad_change_on_every_rank_fails_on_every_rank_with_the_same_error(rank_pools):
    for world in (2, 4):
        pool = rank_pools(world)
        with pytest.raises(RankError) as failure:
            pool.run(bad_change_on_every_rank, timeout=60)
        assert sorted(failure.value.failures) == list(range(world))
        messages = failure.value.messages()
        for rank in range(world):
            assert failure.value.failures[rank][0] == "InputError", messages[rank]
            assert "input 0" in messages[rank], messages[rank]
            assert "expected the local shape" in messages[rank], messages[rank]
            assert messages[rank] == messages[0]  # the same verdict on every rank


def test_a_rank_checks_what_it_can_alone_before_asking_its_peers():
    fd = _tokens_split_linear(2)
    fusion = fd.fusion
    check_own_inputs(fusion, 1, [([5, 6], "torch.float32"), ([4, 6], "torch.float32")])
    with pytest.raises(InputError, match=r"^input 1 .*expected 4 along axis 0"):
        check_own_inputs(fusion, 1, [([5, 6], "torch.float32"), ([3, 6], "torch.float32")])
    with pytest.raises(InputError, match="^input 0 .*expected dtype torch.float32"):
        check_own_inputs(fusion, 0, [([5, 6], "torch.float64"), ([4, 6], "torch.float32")])
    with pytest.raises(InputError, match="^input 1 .*on this rank but got None"):
        check_own_inputs(fusion, 0, [([5, 6], "torch.float32"), None])
    with pytest.raises(InputError, match="expected rank 2, got shape"):
        check_own_inputs(fusion, 0, [([5], "torch.float32"), ([4, 6], "torch.float32")])


def test_check_inputs_takes_the_modes_and_booleans():
    assert [check_mode(m) for m in ("changes", "always", "never", True, False)] == [
        "changes", "always", "never", "always", "never"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="check_inputs must be one of"):
        check_mode("sometimes")
    assert issubclass(InputChangeError, InputError)
