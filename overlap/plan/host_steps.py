"""The steps a rank issues to run a host program, by kind: what the host model prices.

A rank program (``overlap.runtime.rank_program.RankProgram``) unrolls the host program's
loops into a flat list of steps, one per instruction this rank takes part in (stream
steps only where there are streams: on CUDA), and two after each loop (its deferred
waits finished, its transfers' buffers dropped). ``issued_steps`` lists them from a
lowered program, in that order, each with its ``HostStep`` kind; ``pattern_steps`` counts
those a pattern's candidate will issue before anything is lowered, as the lowering
would lay it out (``tests/test_host_model.py`` holds both against the rank programs the
runtime builds). ``overlap.plan.figures.HostFigures`` prices each kind.

Example::

    counts = step_counts(issued_steps(compiled.host, rank=0, streams=True))
    counts[HostStep.LIBRARY_KERNEL]  # the cuBLAS matmuls one run issues
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from overlap.ir import (
    AliasSelect,
    Allocate,
    CombineStaged,
    Communicate,
    Deallocate,
    ForLoop,
    GetCurrentStream,
    HostProgram,
    Instruction,
    LaunchKernel,
    SetCurrentStream,
    StageForPeers,
    Synchronize,
    Transport,
    Wait,
)


class HostStep(enum.StrEnum):
    """The kinds of step a rank issues, each with its own host cost."""

    ALLOCATE = "allocate"  # a buffer filled later (whole or chunk by chunk)
    DEALLOCATE = "deallocate"
    CHUNK_VIEW = "chunk view"  # a loop's view of one chunk of a tensor
    STREAM_SWITCH = "stream switch"  # the current stream saved or set
    STREAM_WAIT = "stream wait"  # the current stream made to wait for another
    GENERATED_KERNEL = "generated kernel"  # a scheduler's Triton kernel
    LIBRARY_KERNEL = "library kernel"  # PyTorch's own: a matmul through cuBLAS, attention
    EVALUATED_KERNEL = "evaluated kernel"  # the reference evaluator's ops
    POST = "post"  # a whole communication started
    WAIT = "wait"  # ... and waited for
    POST_CHUNK_COLLECTIVE = "post chunk (collective)"  # a pipelined chunk, by its transport
    WAIT_CHUNK_COLLECTIVE = "wait chunk (collective)"
    POST_CHUNK_RING = "post chunk (ring)"
    WAIT_CHUNK_RING = "wait chunk (ring)"
    POST_CHUNK_COPY_ENGINE = "post chunk (copy_engine)"
    WAIT_CHUNK_COPY_ENGINE = "wait chunk (copy_engine)"
    STAGE_FOR_PEERS = "stage for peers"  # a copy-engine all-gather's piece staged
    COMBINE_STAGED = "combine staged"  # a copy-engine reduce-scatter's partials summed
    LOOP_END = "loop end"  # after each loop: deferred waits, transfers' buffers dropped


_CHUNK_STEPS = {
    Transport.COLLECTIVE: (HostStep.POST_CHUNK_COLLECTIVE, HostStep.WAIT_CHUNK_COLLECTIVE),
    Transport.RING: (HostStep.POST_CHUNK_RING, HostStep.WAIT_CHUNK_RING),
    Transport.COPY_ENGINE: (HostStep.POST_CHUNK_COPY_ENGINE, HostStep.WAIT_CHUNK_COPY_ENGINE),
}
_KERNEL_STEPS = {"reference": HostStep.EVALUATED_KERNEL, "torch": HostStep.LIBRARY_KERNEL}
_PLAIN_STEPS = {
    Allocate: HostStep.ALLOCATE,
    Deallocate: HostStep.DEALLOCATE,
    AliasSelect: HostStep.CHUNK_VIEW,
    GetCurrentStream: HostStep.STREAM_SWITCH,
    SetCurrentStream: HostStep.STREAM_SWITCH,
    Synchronize: HostStep.STREAM_WAIT,
    StageForPeers: HostStep.STAGE_FOR_PEERS,
    CombineStaged: HostStep.COMBINE_STAGED,
}
_STREAM_INSTRUCTIONS = (GetCurrentStream, SetCurrentStream, Synchronize)
LOOP_END_STEPS = 2  # a rank program's steps after each loop


class IssuedStep(NamedTuple):
    """One step of a rank program: the instruction it issues (a loop for its end steps)
    and its kind."""

    instruction: Instruction
    kind: HostStep


def step_kind(instruction: Instruction, in_loop: bool) -> HostStep:
    """The kind of the step that issues ``instruction`` (not a loop); ``in_loop``: in a
    loop's body, where a pipelined communication moves one chunk by its transport."""
    if isinstance(instruction, LaunchKernel):
        return _KERNEL_STEPS.get(instruction.backend, HostStep.GENERATED_KERNEL)
    if isinstance(instruction, Communicate | Wait):
        posts = isinstance(instruction, Communicate)
        communicate = instruction if posts else instruction.communicate
        if in_loop and communicate.pipelined:
            post, wait = _CHUNK_STEPS[communicate.transport or Transport.COLLECTIVE]
        else:
            post, wait = HostStep.POST, HostStep.WAIT
        return post if posts else wait
    return _PLAIN_STEPS[type(instruction)]


def issued_steps(program: HostProgram, rank: int, streams: bool) -> list[IssuedStep]:
    """The steps ``rank`` issues for one run of ``program``, in order: loops unrolled,
    only the instructions it takes part in, stream steps only with ``streams`` (on CUDA;
    on CPUs a rank program issues none)."""
    return list(_issued(program.instructions, rank, streams, in_loop=False))


def _issued(
    instructions: Iterable[Instruction], rank: int, streams: bool, in_loop: bool
) -> Iterator[IssuedStep]:
    for instruction in instructions:
        if isinstance(instruction, ForLoop):
            for _ in range(instruction.scheme.num_chunks):
                yield from _issued(instruction.body, rank, streams, in_loop=True)
            for _ in range(LOOP_END_STEPS):
                yield IssuedStep(instruction, HostStep.LOOP_END)
        elif isinstance(instruction, _STREAM_INSTRUCTIONS):
            if streams:
                yield IssuedStep(instruction, step_kind(instruction, in_loop))
        elif instruction.runs_on(rank):
            yield IssuedStep(instruction, step_kind(instruction, in_loop))


def step_counts(steps: Iterable[IssuedStep]) -> Counter[HostStep]:
    """How many steps of each kind ``steps`` hold."""
    return Counter(step.kind for step in steps)


def pattern_steps(
    gather: bool, transport: Transport | None, chunks: int, matmuls: int, streams: bool
) -> Counter[HostStep]:
    """The steps a rank issues for one overlap pattern, as the lowering lays it out:
    ``gather``: an all-gather feeding ``matmuls`` matmuls (each reading the gathered
    rows), else one matmul whose result is reduce-scattered; ``transport`` None: the
    communication whole (sequential), else a pipeline of ``chunks`` chunks; ``streams``:
    stream steps are issued (CUDA).

    Sequential: the all-gather's target allocated, posted, waited for, the matmuls, the
    target dropped (a reduce-scatter: the matmul, the target allocated, posted, waited
    for, the matmul's result dropped). A pipeline: the whole tensors the chunks fill
    allocated, the user's stream saved, one loop making every chunk's stream wait for
    it, then per chunk its stream set, its views, its transfer posted and waited for,
    its matmuls, and the user's stream made to wait for it; a collective or copy-engine
    all-gather posts every chunk in a loop of its own first; a copy-engine all-gather
    stages the rank's piece before, a copy-engine reduce-scatter combines the partials
    after. A program of several pipelines saves the user's stream once: each pattern
    is counted as if it were the program's only one."""
    counts: Counter[HostStep] = Counter()
    if transport is None:
        counts.update({HostStep.ALLOCATE: 1, HostStep.POST: 1, HostStep.WAIT: 1,
                       HostStep.LIBRARY_KERNEL: matmuls, HostStep.DEALLOCATE: 1})  # fmt: skip
        return counts
    if not gather:
        matmuls = 1
    post, wait = _CHUNK_STEPS[transport]
    posts_first = gather and transport is not Transport.RING
    loops = 3 if posts_first else 2
    # views per chunk: the gathered source and target, then each matmul's output; a
    # reduce-scatter's matmul input, its output and the scattered target
    views = 2 + matmuls if gather else 3
    per_chunk = {
        HostStep.CHUNK_VIEW: views,
        HostStep.LIBRARY_KERNEL: matmuls,
        post: 1,
        wait: 1,
    }
    counts.update({kind: chunks * count for kind, count in per_chunk.items()})
    counts[HostStep.ALLOCATE] += 1 + matmuls if gather else 2
    counts[HostStep.DEALLOCATE] += 1
    counts[HostStep.LOOP_END] += LOOP_END_STEPS * loops
    if streams:
        # saved once; per chunk: set and wait in the first loop, set (and set again in
        # a loop of its own when the posts come first) and hand back in the work loop
        switches_per_chunk = 1 + (2 if posts_first else 1) + 1
        counts[HostStep.STREAM_SWITCH] += 1 + chunks * switches_per_chunk
        counts[HostStep.STREAM_WAIT] += 2 * chunks
    if transport is Transport.COPY_ENGINE:
        counts[HostStep.STAGE_FOR_PEERS if gather else HostStep.COMBINE_STAGED] += 1
    return counts
