"""Deallocation: each intermediate is released after the top-level instruction that uses
it last (a chunk's use counts as a use of its whole tensor).

A pass over a host program, after lowering: ``insert_deallocations(program)`` returns it
with the releases.
"""

from __future__ import annotations

from fusion.ir import TensorView
from overlap.ir import (
    AliasSelect,
    Communicate,
    Deallocate,
    HostProgram,
    Instruction,
    LaunchKernel,
    Wait,
    walk,
)


def _reads(instruction: Instruction) -> list[TensorView]:
    if isinstance(instruction, LaunchKernel):
        return instruction.inputs
    if isinstance(instruction, Communicate):
        return [instruction.source]
    if isinstance(instruction, AliasSelect):
        return [instruction.source]
    return []


def insert_deallocations(program: HostProgram) -> HostProgram:
    """``program`` with each intermediate released after the top-level instruction that
    uses it last."""
    kept = set(program.fusion.inputs) | set(program.fusion.outputs)
    last_use: dict[TensorView, int] = {}
    source_of: dict[TensorView, TensorView] = {}  # a chunk's use is a use of its tensor
    for position, instruction in enumerate(program.instructions):
        for inner in walk([instruction]):
            if isinstance(inner, AliasSelect):
                source_of[inner.result] = inner.source
            reads = _reads(inner)
            if isinstance(inner, Wait):
                reads = [inner.communicate.source, inner.communicate.target]
            for tensor in reads:
                last_use[source_of.get(tensor, tensor)] = position
    releases: dict[int, list[TensorView]] = {}
    for tensor, position in last_use.items():
        if tensor not in kept and tensor.fusion is program.fusion:
            releases.setdefault(position, []).append(tensor)
    instructions: list[Instruction] = []
    for position, instruction in enumerate(program.instructions):
        instructions.append(instruction)
        instructions.extend(Deallocate(t) for t in releases.get(position, []))
    return HostProgram(program.fusion, tuple(instructions))
