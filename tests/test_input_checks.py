"""When the ranks exchange their inputs' shapes: at the first run and when inputs change.

A run whose inputs are as at the last checked run asks no one (no host collective),
where every rank would see any change of the extents in its own pieces; a change on
every rank is exchanged and checked on every rank, with the same verdict. Where a change
may leave some rank's pieces as they were (a symbolic extent only on split axes), every
run exchanges. A change on one rank alone (its peers already in the program's
collectives) is the fail-fast benchmark's case (``test_benchmarks``): it needs processes
that exit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from distributed import RankError

from fusion import FusionDefinition
from fusion.errors import InputError
from overlap import MultiDeviceExecutor
from overlap.runtime.inputs import (
    InputChangeError,
    LocalBinding,
    changes_seen_everywhere,
    check_mode,
    check_own_inputs,
)
from sharding import DeviceMesh, Replicate, Shard, shard
from sharding.layout import split_sizes


def _linear(world: int, split: str) -> FusionDefinition:
    """x [tokens, 6 * world] (tokens symbolic) times w [4, 6 * world]: with ``split``
    "tokens" the rows of x are split (every rank a piece of them), with "columns" the
    contraction is (every rank holds all the tokens; the partial sums all-reduced)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(["tokens", 6 * world])
        w = fd.define_tensor([4, 6 * world])
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    mesh = DeviceMesh(world)
    if split == "tokens":
        shard(x, mesh, [Shard(0)])
        shard(w, mesh, [Replicate()])
    else:
        shard(x, mesh, [Shard(1)])
        shard(w, mesh, [Shard(1)])
        shard(y, mesh, [Replicate()])
    return fd


@contextlib.contextmanager
def _counting_exchanges(communicator):
    """The host exchanges ``communicator`` makes inside, by group ("all", "check")."""
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
    try:
        yield made
    finally:
        del communicator.all_gather_object, communicator.input_check_exchange


def _good(executor, fd, tokens: int, seed: int) -> tuple[list, list]:
    """This rank's pieces of fresh whole inputs with ``tokens`` rows, and of the outputs."""
    generator = torch.Generator().manual_seed(seed)
    x, w = fd.fusion.inputs
    full = [torch.randn(tokens, x.shape[1], generator=generator),
            torch.randn(list(w.shape), generator=generator)]  # fmt: skip
    # the ranks' whole inputs may differ on purpose here (a rank's tokens changing alone)
    return executor.shard_inputs(full, check=False), executor.shard_outputs(fd.execute(full))


def runs_with_and_without_exchanges(communicator, split: str, tokens: list[int]) -> dict:
    """A first run, twenty with unchanged shapes (new values), then every rank's tokens
    change, then they stay: by phase, the exchanges made and whether every output was
    right."""
    fd = _linear(communicator.world_size, split)
    executor = MultiDeviceExecutor(fd, communicator)
    phases = {}
    with _counting_exchanges(communicator) as made:
        for phase, count, runs in (("first", tokens[0], 1), ("same", tokens[0], 20),
                                   ("changed", tokens[1], 1),
                                   ("same again", tokens[1], 5)):  # fmt: skip
            start, right = len(made), True
            for run in range(runs):
                local, expected = _good(executor, fd, count, seed=run)
                (out,) = executor.run(local)
                right &= torch.allclose(out, expected[0], atol=1e-5)
            phases[phase] = (made[start:], right)
    return phases


@pytest.mark.parametrize("world", [2, 4])
def test_unchanged_inputs_are_not_exchanged_and_changed_ones_are(rank_pools, world):
    results = rank_pools(world).run(runs_with_and_without_exchanges, "columns", [8, 13])
    for rank, phases in enumerate(results):
        assert phases == {
            # every rank's first run: the check on the usual group, then the ranks
            # agree that each built its program for these extents
            "first": (["all", "all"], True),
            "same": ([], True),
            "changed": (["check", "all"], True),  # the check on the input-check group
            "same again": ([], True),
        }, (world, rank, phases)


@pytest.mark.parametrize("world", [2, 4])
def test_tokens_split_over_the_ranks_are_exchanged_at_every_run(rank_pools, world):
    """8 -> 9 tokens over 2 ranks leave rank 1's piece at 4 rows (10 over 4: ranks 2 and
    3): asking only when its own piece changes, a rank would run the old extents. Every
    run exchanges instead, and every rank computes the new extents."""
    changed = 9 if world == 2 else 10
    results = rank_pools(world).run(runs_with_and_without_exchanges, "tokens", [8, changed])
    for rank, phases in enumerate(results):
        assert phases == {
            "first": (["all", "all"], True),
            "same": (["all"] * 20, True),
            "changed": (["all", "all"], True),
            "same again": (["all"] * 5, True),
        }, (world, rank, phases)


def always_and_never(communicator) -> tuple[list, list]:
    fd = _linear(communicator.world_size, "columns")
    executor = MultiDeviceExecutor(fd, communicator)
    local, expected = _good(executor, fd, 8, seed=0)
    with _counting_exchanges(communicator) as made:
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
    """Good runs, then every rank's tokens change, the last rank's to more rows than its
    peers hold (each rank's piece is fine alone: only the exchange can tell)."""
    fd = _linear(communicator.world_size, "columns")
    executor = MultiDeviceExecutor(fd, communicator)
    for run in range(4):
        executor.run(_good(executor, fd, 8, seed=run)[0])
    local, _ = _good(executor, fd, 12, seed=9)
    if communicator.rank == communicator.world_size - 1:
        local[0] = torch.randn(14, local[0].shape[1])
    executor.run(local)


@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_change_on_every_rank_fails_on_every_rank_with_the_same_error(rank_pools, world):
    pool = rank_pools(world)
    with pytest.raises(RankError) as failure:
        pool.run(bad_change_on_every_rank, timeout=60)
    assert sorted(failure.value.failures) == list(range(world))
    messages = failure.value.messages()
    for rank in range(world):
        assert failure.value.failures[rank][0] == "InputError", messages[rank]
        wanted = f"rank {world - 1}: input 0 (T0_f32[iS0{{tokens}}, iDIDx1{{{6 * world}}}])"
        assert wanted in messages[rank], messages[rank]
        assert "expected the local shape [12, 6] (of the whole [12, " in messages[rank]
        assert messages[rank] == messages[0]  # the same verdict on every rank


def test_a_rank_checks_what_it_can_alone_before_asking_its_peers():
    fusion = _linear(2, "tokens").fusion
    check_own_inputs(fusion, 1, [([5, 12], "torch.float32"), ([4, 12], "torch.float32")])
    with pytest.raises(InputError, match=r"rank 1: input 1 .*expected the local shape \[4, 12\]"):
        check_own_inputs(fusion, 1, [([5, 12], "torch.float32"), ([3, 12], "torch.float32")])
    with pytest.raises(InputError, match=r"rank 0: input 0 .*expected 12 along axis 1"):
        check_own_inputs(fusion, 0, [([5, 11], "torch.float32"), ([4, 12], "torch.float32")])
    with pytest.raises(InputError, match="rank 0: input 0 .*expected dtype torch.float32"):
        check_own_inputs(fusion, 0, [([5, 12], "torch.float64"), ([4, 12], "torch.float32")])
    with pytest.raises(InputError, match="rank 0: input 1 .*on this rank but got None"):
        check_own_inputs(fusion, 0, [([5, 12], "torch.float32"), None])
    with pytest.raises(InputError, match="expected rank 2, got shape"):
        check_own_inputs(fusion, 0, [([5], "torch.float32"), ([4, 12], "torch.float32")])


def test_which_fusions_may_skip_the_exchange():
    assert changes_seen_everywhere(_linear(2, "columns").fusion)  # tokens whole everywhere
    assert not changes_seen_everywhere(_linear(2, "tokens").fusion)  # only split
    with FusionDefinition() as fd:  # static extents: any change is an error a rank sees
        x = fd.define_tensor([8, 6])
        fd.add_output(fd.ops.exp(x))
    shard(x, DeviceMesh(2), [Shard(0)])
    assert changes_seen_everywhere(fd.fusion)
    with FusionDefinition() as fd:  # a symbol on rank 1's input only
        x = fd.define_tensor([8, 6])
        n = fd.define_tensor(["n", 6])
        y = fd.ops.sum(n, [0])
        fd.add_output(fd.ops.exp(x))
        fd.add_output(y)
    shard(x, DeviceMesh(2), [Shard(0)])
    shard(n, DeviceMesh([1]), [Replicate()])
    assert not changes_seen_everywhere(fd.fusion)


def test_check_inputs_takes_the_modes_and_booleans():
    assert [check_mode(m) for m in ("changes", "always", "never", True, False)] == [
        "changes", "always", "never", "always", "never"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="check_inputs must be one of"):
        check_mode("sometimes")
    assert issubclass(InputChangeError, InputError)


# ---------------------------------------------------------------------------
# Whole inputs that differ between ranks: each rank would cut its piece from its own


def unseeded_whole_inputs(communicator, check: bool):
    """Every rank makes its whole inputs from its own unseeded (here: rank-seeded)
    generator, as ``torch.randn`` without a seed would."""
    world = communicator.world_size
    fd = _linear(world, "tokens")
    executor = MultiDeviceExecutor(fd, communicator)
    generator = torch.Generator().manual_seed(100 + communicator.rank)
    whole = [torch.randn(5, 6 * world, generator=generator), torch.randn(4, 6 * world)]
    pieces = executor.shard_inputs(whole, check=check)
    return [list(p.shape) for p in pieces]


def seeded_whole_inputs(communicator):
    fd = _linear(communicator.world_size, "tokens")
    executor = MultiDeviceExecutor(fd, communicator)
    generator = torch.Generator().manual_seed(7)
    world = communicator.world_size
    whole = [torch.randn(5, 6 * world, generator=generator),
             torch.randn(4, 6 * world, generator=generator)]  # fmt: skip
    (out,) = executor.run(executor.shard_inputs(whole))
    expected = executor.shard_outputs(fd.execute(whole))
    torch.testing.assert_close(out, expected[0])
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_shard_inputs_refuses_whole_inputs_that_differ_between_ranks_on_every_rank(
    rank_pools, world
):
    pool = rank_pools(world)
    with pytest.raises(RankError) as failure:
        pool.run(unseeded_whole_inputs, True, timeout=60)
    assert sorted(failure.value.failures) == list(range(world)), "every rank must raise"
    for rank, message in failure.value.messages().items():
        assert failure.value.failures[rank][0] == "InputError", message
        assert "input 0 (T0) differs between rank 0 and rank 1" in message, message
        assert "one seeded generator" in message, message
    # the same whole inputs everywhere pass, and the run matches one device
    assert pool.run(seeded_whole_inputs, timeout=60) == [True] * world
    # check=False cuts without asking (the caller vouches for its inputs)
    shapes = pool.run(unseeded_whole_inputs, False, timeout=60)
    assert [s[0] for s in shapes] == [[rows, 6 * world] for rows in split_sizes(5, world)]


def test_an_unplaced_fusion_binds_again_only_when_an_input_changes(monkeypatch):
    """One device: inputs of the last run's dtypes, shapes and devices reuse its bindings
    (binding cost more host time than a small kernel); any change is checked again."""
    import overlap.runtime.inputs as inputs_module

    calls = []
    real = inputs_module.bind_inputs
    monkeypatch.setattr(inputs_module, "bind_inputs", lambda *a: calls.append(1) or real(*a))
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.linear(fd.define_tensor(["tokens", 6]), fd.define_tensor([4, 6])))
    executor = MultiDeviceExecutor(fd, kernels="reference")
    x, w = torch.randn(5, 6), torch.randn(4, 6)
    torch.testing.assert_close(executor.run([x, w])[0], x @ w.T)
    y = torch.randn(5, 6)  # other values and buffers, the same shapes
    torch.testing.assert_close(executor.run([y, w])[0], y @ w.T)
    assert len(calls) == 1
    z = torch.randn(7, 6)  # another token count: bound again
    torch.testing.assert_close(executor.run([z, w])[0], z @ w.T)
    assert len(calls) == 2
    for bad, message in ((torch.randn(5, 5), "axis 1 is 5, not 6"),
                         (x.double(), "expected dtype"),
                         (x.to("meta"), "meta")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            executor.run([bad, w])
    with pytest.raises(InputError, match="axis 1 is 5, not 6"):  # a failed run binds nothing
        executor.run([torch.randn(5, 5), w])
    with pytest.raises(InputError, match="meta"):  # bound, then refused for its device
        executor.run([torch.randn(7, 6, device="meta"), w.to("meta")])
    with pytest.raises(InputError, match="must be a list"):  # a tensor is not a list of them
        executor.run(torch.stack([x, x]))
    torch.testing.assert_close(executor.run([x, w])[0], x @ w.T)
    # check_inputs="never" reuses the bindings of the last inputs that passed: inputs
    # bound, then refused for their device, leave them as they were (5 tokens, not 7)
    binding = LocalBinding(fd.fusion, torch.device("cpu"))
    assert list(binding([x, w]).values()) == [5]
    with pytest.raises(InputError, match="meta"):
        binding([torch.randn(7, 6, device="meta"), w.to("meta")])
    assert list(binding.bindings.values()) == [5]
