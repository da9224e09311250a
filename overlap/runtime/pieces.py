"""Whole tensors and this rank's pieces: cutting whole inputs, gathering whole outputs.

Meant for setting up and checking a run, not for its hot path: ``gather_outputs`` moves
every piece through host memory (``all_gather_object``).

Example (on every rank)::

    outputs = executor.run(shard_inputs(executor.fusion.inputs, full, communicator))
    whole = gather_outputs(executor.fusion, outputs, communicator, device)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.ir import Fusion, TensorView
from fusion.portable import portable, restored
from overlap.comm.communicator import Communicator
from overlap.runtime.inputs import check_same_on_every_rank
from sharding.pieces import assemble, local_piece


def rank_pieces(
    tensors: Sequence[TensorView], values: Sequence[torch.Tensor], rank: int
) -> list[torch.Tensor | None]:
    """``rank``'s piece of each whole value of ``tensors`` (None where it holds none)."""
    return [local_piece(value, tensor, rank) for value, tensor in zip(values, tensors, strict=True)]


def shard_inputs(
    tensors: Sequence[TensorView],
    full_inputs: Sequence[torch.Tensor],
    communicator: Communicator | None,
    check: bool = True,
    names: Sequence[str] | None = None,
    step: str = "shard_inputs",
) -> list[torch.Tensor | None]:
    """This rank's pieces of the whole values of ``tensors`` (a fusion's inputs). With
    several ranks, ``check`` makes sure every rank was given the same whole values
    (collective: one exchange of their fingerprints; ``InputError`` on every rank naming
    ``step`` and the first of ``names`` that differs), since a rank cuts its piece from
    what it is given."""
    rank = communicator.rank if communicator is not None else 0
    if check and communicator is not None and communicator.world_size > 1:
        names = names or [f"input {i} ({t.name})" for i, t in enumerate(tensors)]
        check_same_on_every_rank(names, full_inputs, communicator.input_check_exchange, step)
    return rank_pieces(tensors, full_inputs, rank)


def gather_outputs(
    fusion: Fusion,
    local_outputs: Sequence[torch.Tensor | None],
    communicator: Communicator,
    device: torch.device,
) -> list[torch.Tensor]:
    """The whole outputs of ``fusion``, assembled from every rank's pieces (collective:
    call on every rank), on ``device``."""
    cpu = [None if t is None else t.cpu() for t in local_outputs]
    everyone = restored(communicator.all_gather_object(portable(cpu)))
    return [
        assemble({rank: pieces[position] for rank, pieces in enumerate(everyone)}, tensor).to(
            device
        )
        for position, tensor in enumerate(fusion.outputs)
    ]
