"""Outputs told to a listener as a run issues them, before the run ends.

A data-parallel reducer (``overlap.train.data_parallel``) posts a gradient's all-reduce
over the replicas as soon as the backward program has issued the work that makes that
gradient, so that it runs while the rest of the backward computes, as PyTorch's DDP
posts a bucket from autograd's hooks. A program's outputs all come back when the run
returns; a listener hears of each one earlier.

``OutputListener`` is what a listener implements: ``ready(position, value, timeline)``
after the top-level step that last names output ``position`` (its kernel, the wait for
the communication that fills it, or the loop that writes its chunks) and the stream
bookkeeping right after it (a loop's streams joined back into the program's own): on
CUDA the work that makes the output is then ordered before whatever the current stream
is given next, so a listener reading it on a stream of its own makes that stream wait
for the current one (and for no other: during a CUDA graph's capture, a stream the
capture never forked may not be waited on). ``finish(timeline)`` after the last step,
before the outputs are handed back (a listener that changed an output in place is done
by then). ``timeline``: the run's recorder, or None. A run replayed from a CUDA graph
replays what the listener queued at the capture (the all-reduces, the copies) and calls
nothing.

``listened_steps`` builds a rank program's steps with those calls between them (only
for a program given a listener: the others pay nothing). ``production_order`` says in
which order a fusion makes its outputs, the same on every rank (a reducer cuts its
buckets by it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from fusion.ir import Fusion, TensorView
from overlap.diag.timeline import SpanRecorder
from overlap.ir import Deallocate, GetCurrentStream, Instruction, SetCurrentStream, Synchronize

# instructions that make nothing: a stream switched, joined or saved, a buffer let go
_BOOKKEEPING = (SetCurrentStream, Synchronize, GetCurrentStream, Deallocate)


class OutputListener(Protocol):
    """Told as a run issues each of its program's outputs (see the module)."""

    def ready(self, position: int, value: torch.Tensor, timeline: SpanRecorder | None) -> None:
        """Output ``position`` is issued: ``value`` holds it once the work queued on the
        current stream so far is done."""

    def finish(self, timeline: SpanRecorder | None) -> None:
        """The run's last step is issued; its outputs are handed back next."""


def mentions(instruction: Instruction) -> Iterator[TensorView]:
    """The tensors ``instruction`` names, in its fields and its nested instructions (a
    loop's body, a wait's communication); not inside kernels' expressions."""
    for field in dataclasses.fields(instruction):
        yield from _tensors_in(getattr(instruction, field.name))


def _tensors_in(value: object) -> Iterator[TensorView]:
    if isinstance(value, TensorView):
        yield value
    elif isinstance(value, Instruction):
        yield from mentions(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(key)
            yield from _tensors_in(item)


def ready_after(
    instructions: Sequence[Instruction], outputs: Sequence[TensorView]
) -> dict[int, list[int]]:
    """Output positions by the index of the top-level instruction after which each is
    final: the last that names it, or the stream bookkeeping right after that (-1, before
    the first, for an output none names: an input handed back)."""
    last: dict[TensorView, int] = {}
    for index, instruction in enumerate(instructions):
        for tensor in mentions(instruction):
            last[tensor] = index
    ready: dict[int, list[int]] = {}
    for position, tensor in enumerate(outputs):
        index = last.get(tensor, -1)
        while index + 1 < len(instructions) and isinstance(instructions[index + 1], _BOOKKEEPING):
            index += 1
        ready.setdefault(index, []).append(position)
    return ready


def production_order(fusion: Fusion) -> list[int]:
    """``fusion``'s output positions in the order its expressions make them (topological,
    as a program issues them before the planner moves work; an output no expression
    makes, an input handed back, first): the same on every rank that has the fusion."""
    made_at = {t: i for i, expr in enumerate(fusion.live_exprs()) for t in expr.outputs}
    return sorted(range(len(fusion.outputs)), key=lambda j: made_at.get(fusion.outputs[j], -1))


def listened_steps(program, listener: OutputListener) -> None:
    """``program``'s (a ``RankProgram``) steps, its top-level instructions compiled one
    by one, each output's ``listener.ready`` after the step that last names it (outputs
    this rank does not hold are not told), ``listener.finish`` last."""
    instructions = program.compiled.host.instructions
    outputs = program.fusion.outputs
    ready = ready_after(instructions, outputs)

    def tell(position: int):
        tensor = outputs[position]

        def step() -> None:
            listener.ready(position, program.values[tensor], program.timeline)

        return step

    def told(index: int) -> None:
        program.steps.extend(
            tell(position)
            for position in ready.get(index, ())
            if program.holds(outputs[position].mesh)
        )

    told(-1)
    for index, instruction in enumerate(instructions):
        program._compile([instruction], None)
        told(index)
    program.steps.append(lambda: listener.finish(program.timeline))
