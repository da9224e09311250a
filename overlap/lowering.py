"""Lowering: segments of a resharded fusion become a host program.

A compute segment becomes a ``LaunchKernel``; a communication becomes
``Allocate`` (its output buffer), ``Communicate`` and ``Wait``. A tensor that
is neither a fusion input nor an output is released (``Deallocate``) right
after the instruction that uses it last.
"""

from __future__ import annotations

from fusion.ir import Fusion, TensorView
from overlap.host_ir import (
    Allocate,
    Communicate,
    Deallocate,
    HostProgram,
    Instruction,
    LaunchKernel,
    Wait,
)
from sharding.segmentation import Segment


def lower_to_host_program(fusion: Fusion, segments: list[Segment]) -> HostProgram:
    """The host program that runs ``segments`` in order."""
    program = HostProgram(fusion)
    kernels = communications = 0
    for segment in segments:
        if segment.is_communication:
            communicate = Communicate(f"c{communications}", segment.communication)
            communications += 1
            program.instructions += [
                Allocate(segment.communication.output),
                communicate,
                Wait(communicate),
            ]
        else:
            program.instructions.append(LaunchKernel(f"k{kernels}", segment))
            kernels += 1
    _insert_deallocations(program)
    return program


def _reads(instruction: Instruction) -> list[TensorView]:
    if isinstance(instruction, LaunchKernel):
        return instruction.segment.inputs
    if isinstance(instruction, Communicate):
        return instruction.communication.inputs
    return []


def _insert_deallocations(program: HostProgram) -> None:
    kept = set(program.fusion.inputs) | set(program.fusion.outputs)
    last_use: dict[TensorView, int] = {}
    for position, instruction in enumerate(program.instructions):
        for tensor in _reads(instruction):
            last_use[tensor] = position
    # A communication's input is in use until its Wait.
    for position, instruction in enumerate(program.instructions):
        if isinstance(instruction, Wait):
            for tensor in instruction.communicate.communication.inputs:
                if last_use.get(tensor) == program.instructions.index(instruction.communicate):
                    last_use[tensor] = position
    releases: dict[int, list[TensorView]] = {}
    for tensor, position in last_use.items():
        if tensor not in kept:
            releases.setdefault(position, []).append(tensor)
    instructions: list[Instruction] = []
    for position, instruction in enumerate(program.instructions):
        instructions.append(instruction)
        instructions.extend(Deallocate(t) for t in releases.get(position, []))
    program.instructions = instructions
