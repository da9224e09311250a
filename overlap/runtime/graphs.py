"""CUDA-graph replay of rank programs: the default run path on CUDA.

A graph is keyed by what every rank computes alike, never by buffer addresses: the rank
program's extents and the half of the copy-engine buffers the run uses (``key``). The
ranks run the same calls in step (the input check sees to it), so every rank reaches a
key's first, second, ... call at the same run, and NCCL's rule that a captured
collective be captured on every rank of its group holds without asking anyone: no replay
runs a host collective (a capture runs one, below).

At a key's first call the program runs on the lean path (``RankProgram.run``: the warm-up
that creates communication handles, compiles kernels, allocates buffers). At its second
the graph is captured (on its own pool, with garbage collection off: freeing an
unreachable executor's symmetric memory during a capture would be a CUDA call the
capture forbids) and replayed; every later call replays it.

Inputs: at the capture each input position is read in place or copied.
- In place: the same tensor at the key's first and second calls (or a view of the
  same tensor, at the same address: a DTensor parameter's local piece), as parameters,
  weights and buffers are, or a graph's output (the previous layer's, the forward's
  saved values read by the backward). A new tensor at the same address is not: the
  caching allocator hands a freed activation's memory to the next one, which moves
  at the next call that allocates otherwise.
  A replay reads it where it is when the address and strides are the captured ones.
- Copied: any other input goes into a buffer of the graph's own, all in one batched copy
  on the stream; skipped where the input is that buffer.
An in-place input that moved later (a parameter replaced, a weight swapped) cannot be
read where the graph reads, and a graph captured again on one rank alone would break
the ranks' agreement: that call runs on the lean path instead (correct, slower; counted
in ``fallbacks`` and logged once).

Outputs are the graph's memory, handed out without copies as new tensors over it. The
next replay of any graph of the same executor overwrites that memory, so the outputs of
the replay before become unreadable: reading one raises a clear error naming what to do
(``expire``; copy what you keep, or ``run(..., keep_outputs=True)``). On CUDA only
the handed-out tensor is marked, not a view taken of it before the next replay: such a
view shows the next replay's values (copy, never view, what you keep). Where this torch
cannot make a tensor unreadable (a build without CUDA), their autograd version is bumped,
so a backward that saved them refuses to read the new values.

Memory: the graphs of one executor share one pool (they run one after another on the
same stream, and the outputs of all but the last replay are unreadable, so one graph's
intermediates may reuse another's); at most ``MOST_GRAPHS`` graphs are kept, the least
recently used dropped (its outputs made unreadable); ``memory()`` says what each holds.
Graphs are destroyed at exit before the process groups they captured collectives on.

Example::

    graphs = GraphReplays()
    outputs = graphs.run(key, rank_program, local_inputs)  # None: run the lean path
"""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from overlap.runtime.rank_program import RankProgram

MOST_GRAPHS = 8

log = logging.getLogger("overlap.graphs")

# Addresses of graph outputs (every executor's): an input found here is read in place.
_GRAPH_OUTPUTS: dict[int, int] = {}
_EVERY: weakref.WeakSet[GraphReplays] = weakref.WeakSet()
_AT_EXIT = []  # registered once, at the first capture: after the communicator's teardown


class CaptureError(RuntimeError):
    """This rank's program could not be captured in a CUDA graph (every rank raises: this
    one this error, its peers a ``PeerError`` naming it)."""


def _release_all() -> None:
    for graphs in list(_EVERY):
        graphs.release()


def _expire_message(where: str) -> str:
    return (
        f"this output of a run replayed from a CUDA graph ({where}) was overwritten by a "
        "later replay of the same program: a replay's outputs are the graph's own memory. "
        "Copy (clone) an output you keep before the next run, or run with "
        "keep_outputs=True"
    )


_set_unreadable = getattr(torch._C, "_set_storage_access_error_msg", None)


def expire(tensors: Sequence[torch.Tensor], where: str) -> None:
    """Make ``tensors`` (outputs of an earlier replay) raise a clear error when read; where
    this torch cannot, bump their autograd version (a backward that saved them raises)."""
    if _set_unreadable is None:
        torch.autograd.graph.increment_version(list(tensors))
        return
    for tensor in tensors:
        _set_unreadable(tensor, _expire_message(where))


@dataclass(frozen=True)
class _Output:
    """How a replay hands out one output: an input passed through (its position; with
    ``view``, a view of it: bytes from its start, then size, stride, dtype), or a view of
    the graph's memory (``storage`` address and bytes, and the tensor's place)."""

    input_position: int | None
    storage: tuple[int, int] | None = None
    offset: int = 0
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    view: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype] | None = None


def _describe_output(output, staged: list, in_place: list) -> _Output | None:
    if output is None:
        return None
    for position, value in enumerate(staged):
        if output is value:
            return _Output(position)
    storage = output.untyped_storage()
    for position, place in enumerate(in_place):
        value = staged[position]
        if place is not None and value.untyped_storage().data_ptr() == storage.data_ptr():
            # a view of an input read in place (a reshaped weight): the input's memory,
            # not the graph's; handed out as a view of the input, as the lean path does
            # (a tensor over its address would not keep it alive, nor stay readable)
            view = (output.data_ptr() - value.data_ptr(), tuple(output.shape),
                    tuple(output.stride()), output.dtype)  # fmt: skip
            return _Output(position, view=view)
    return _Output(None, (storage.data_ptr(), storage.nbytes()), output.storage_offset(),
                   tuple(output.shape), tuple(output.stride()), output.dtype)  # fmt: skip


def _view_of(value: torch.Tensor, view: tuple) -> torch.Tensor:
    """The view ``view`` (see ``_Output``) of input ``value``, sharing its storage."""
    start, size, stride, dtype = view
    storage = value.untyped_storage()
    offset = (value.data_ptr() + start - storage.data_ptr()) // dtype.itemsize
    if dtype == value.dtype:  # a view proper: its version and base are the input's
        return value.as_strided(size, stride, offset)
    return torch.empty(0, dtype=dtype, device=value.device).set_(storage, offset, size, stride)


class Graph:
    """One captured graph: how it reads each input, the buffers it owns, its outputs."""

    def __init__(self, program: RankProgram, local_inputs: Sequence, first: Sequence,
                 pool, capture: Callable) -> None:  # fmt: skip
        device = program.setup.device
        # per position: the address and strides read in place, or a buffer of its own
        self.in_place: list[tuple[int, tuple[int, ...]] | None] = []
        self.buffers: list[torch.Tensor | None] = []
        staged = []
        for value, before in zip(local_inputs, first, strict=True):
            if value is None or _stays(value, before):
                self.in_place.append(None if value is None else _address(value))
                self.buffers.append(None)
                staged.append(value)
            else:
                buffer = torch.empty(value.shape, dtype=value.dtype, device=device)
                self.in_place.append(None)
                self.buffers.append(buffer)
                staged.append(buffer)
        self.copied = [p for p, b in enumerate(self.buffers) if b is not None]
        self.stage(local_inputs)
        before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        self.graph, captured = capture(program, staged, pool)
        self.memory = (torch.cuda.memory_reserved(device) - before if device.type == "cuda"
                       else 0) + sum(b.nbytes for b in self.buffers if b is not None)  # fmt: skip
        self.captured = captured  # held: the graph writes there
        self.outputs = [_describe_output(o, staged, self.in_place) for o in captured]
        # what a replay checks and hands out, worked out once
        self.read_at = [(p, place) for p, place in enumerate(self.in_place) if place is not None]
        self.owned = [i for i, o in enumerate(self.outputs) if o is not None and o.storage]
        addresses = [o.storage[0] for o in self.outputs if o is not None and o.storage]
        for address in addresses:
            _GRAPH_OUTPUTS[address] = _GRAPH_OUTPUTS.get(address, 0) + 1
        # forgotten when released, or when the graph is dropped with its executor
        self._forget = weakref.finalize(self, _forget, addresses)

    def reads(self, local_inputs: Sequence) -> bool:
        """Whether every in-place input is where the graph reads it."""
        for position, (address, strides) in self.read_at:
            value = local_inputs[position]
            if value is None or value.data_ptr() != address or value.stride() != strides:
                return False
        return True

    def stage(self, local_inputs: Sequence) -> None:
        """Copy the inputs that move into the graph's buffers (one batched copy; none for
        an input that is its buffer)."""
        pairs = [(self.buffers[p], local_inputs[p]) for p in self.copied
                 if self.buffers[p] is not local_inputs[p]]  # fmt: skip
        if pairs:
            torch._foreach_copy_([b for b, _ in pairs], [v for _, v in pairs])

    def replay(self, local_inputs: Sequence) -> list:
        """Replay (the inputs staged), and hand out the outputs: new tensors over the
        graph's memory, or the inputs passed through."""
        self.graph.replay()
        outputs = []
        for output, captured in zip(self.outputs, self.captured, strict=True):
            if output is None:
                outputs.append(None)
            elif output.view is not None:
                outputs.append(_view_of(local_inputs[output.input_position], output.view))
            elif output.input_position is not None:
                outputs.append(local_inputs[output.input_position])
            else:
                outputs.append(_over(output, captured))
        return outputs

    def release(self) -> None:
        self._forget()
        self.outputs, self.captured, self.buffers, self.graph = [], [], [], None


def _forget(addresses: list[int]) -> None:
    for address in addresses:
        _GRAPH_OUTPUTS[address] -= 1
        if not _GRAPH_OUTPUTS[address]:
            del _GRAPH_OUTPUTS[address]


def _expire_refs(handed: list) -> None:
    """Expire the outputs still alive among the weak references ``handed`` (emptied)."""
    outputs = [t for t in (ref() for ref in handed) if t is not None]
    if outputs:
        expire(outputs, "its memory is reused by the next replay, or freed with the graph")
    handed.clear()


def _over(output: _Output, captured: torch.Tensor) -> torch.Tensor:
    """A new tensor (with a storage object of its own) over ``captured``'s memory."""
    if _set_unreadable is None:  # no way to make it unreadable: hand out the captured one
        return captured
    address, nbytes = output.storage
    storage = torch._C._construct_storage_from_data_pointer(address, captured.device, nbytes)
    tensor = torch.empty(0, dtype=output.dtype, device=captured.device)
    return tensor.set_(storage, output.offset, output.size, output.stride)


def _address(value: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return value.data_ptr(), tuple(value.stride())


@dataclass(frozen=True)
class _Seen:
    """An input at a key's first call: the tensor (weakly: it may be dropped), the tensor
    it views, and where it lay."""

    tensor: weakref.ref
    base: weakref.ref | None
    place: tuple[int, tuple[int, ...]]

    @classmethod
    def of(cls, value) -> _Seen | None:
        if not isinstance(value, torch.Tensor):
            return None
        base = value._base
        return cls(weakref.ref(value), None if base is None else weakref.ref(base),
                   _address(value))  # fmt: skip

    def same(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is the tensor seen, or a view of the same tensor in the same
        place (not merely a tensor that took over its memory)."""
        if self.tensor() is value:
            return True
        base = value._base
        return (base is not None and self.base is not None and self.base() is base
                and _address(value) == self.place)  # fmt: skip


def _stays(value: torch.Tensor, first: _Seen | None) -> bool:
    """Whether an input is read in place (see the module): a graph's output, or the
    tensor (or a view of the tensor, in the same place) of the key's first call."""
    return value.data_ptr() in _GRAPH_OUTPUTS or (first is not None and first.same(value))


def capture_cuda_graph(program: RankProgram, staged: list, pool) -> tuple:
    """``(graph, outputs)``: ``program`` captured reading ``staged``, on ``pool``."""
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = program.run(staged, None)
    finally:
        gc.enable()
    return graph, outputs


class GraphReplays:
    """The graphs one executor captured, by key, least recently used first (see the
    module). ``capture`` makes a graph (``capture_cuda_graph``; tests give another)."""

    def __init__(self, capture: Callable = capture_cuda_graph, most: int = MOST_GRAPHS) -> None:
        self._capture = capture
        self.most = most
        self._graphs: OrderedDict[Hashable, Graph] = OrderedDict()
        self._first: dict[Hashable, list] = {}  # a key's first call's inputs
        self._handed: list = []  # weak references to the last replay's outputs
        # dropped with this object (its executor collected), the graphs' memory is freed:
        # the last replay's outputs, which do not own it, must not read what comes there
        weakref.finalize(self, _expire_refs, self._handed)
        self._pool = None
        self.captures = 0
        self.replays = 0
        self.fallbacks = 0  # calls run on the lean path because an in-place input moved
        _EVERY.add(self)

    def run(
        self,
        key: Hashable,
        program: RankProgram,
        local_inputs: Sequence,
        keep_outputs: bool = False,
    ) -> list | None:
        """The outputs of ``program`` on ``local_inputs`` from the graph for ``key``
        (captured now at the key's second call, which is the same run on every rank;
        ``keep_outputs``: those in the graph's memory copied out), or None where this call
        runs on the lean path: the key's first call, or an in-place input that moved."""
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._first:
                self._first[key] = [_Seen.of(v) for v in local_inputs]
                while len(self._first) > self.most:  # extents that keep changing
                    self._first.pop(next(iter(self._first)))
                return None
            graph = self._capture_for(key, program, local_inputs)  # inputs staged
        else:
            # used at this call on every rank, replayed or run lean: the eviction order
            # must be every rank's alike (a rank evicting another graph than its peers
            # would later capture, and agree on it, while they replay)
            self._graphs.move_to_end(key)
            if not graph.reads(local_inputs):
                self.fallbacks += 1
                if self.fallbacks == 1:
                    log.warning(
                        "an input read in place by a CUDA graph (a parameter or weight "
                        "passed again at its first calls, or a graph's output) moved: this "
                        "call and any other such run without the graph. Keep such inputs "
                        "where they are (update weights in place)"
                    )
                return None
            graph.stage(local_inputs)  # before the last outputs expire: one may be an input
        self._expire_handed()
        outputs = graph.replay(local_inputs)
        self.replays += 1
        if keep_outputs:  # copied out: nothing of the graph's memory is handed out
            for i in graph.owned:
                outputs[i] = outputs[i].clone()
        else:
            self._handed[:] = [weakref.ref(outputs[i]) for i in graph.owned]
        return outputs

    def _capture_for(self, key: Hashable, program: RankProgram, local_inputs: Sequence) -> Graph:
        if not _AT_EXIT:
            _AT_EXIT.append(atexit.register(_release_all))
        if self._pool is None and torch.cuda.is_available():
            self._pool = torch.cuda.graph_pool_handle()
        first = self._first.pop(key)
        graph, failure = None, None
        try:
            graph = Graph(program, local_inputs, first, self._pool, self._capture)
        except Exception as error:  # told to the peers first, then raised
            said = f"{type(error).__name__}: {error}"
            failure = CaptureError(
                f"capturing this rank's program in a CUDA graph failed ({said}); run with "
                "cuda_graph=False to issue it step by step instead"
            )
            failure.__cause__ = error
        if program.compiled.sharded:
            # one exchange, once per key: a rank whose capture failed must not leave its
            # peers replaying collectives it never posts
            program.setup.communicator.agree(failure, "capturing the program in a CUDA graph")
        elif failure is not None:
            raise failure
        self.captures += 1
        self._graphs[key] = graph
        while len(self._graphs) > self.most:
            _, oldest = self._graphs.popitem(last=False)
            self._expire_handed()
            oldest.release()
        return graph

    def _expire_handed(self) -> None:
        _expire_refs(self._handed)

    def memory(self) -> dict[Hashable, int]:
        """Bytes each kept graph holds (its pool's growth at capture, and its input
        buffers), by key."""
        return {key: graph.memory for key, graph in self._graphs.items()}

    def release(self) -> None:
        """Drop every graph (their outputs made unreadable): before the process groups
        they captured collectives on are destroyed."""
        self._expire_handed()
        for graph in self._graphs.values():
            graph.release()
        self._graphs.clear()
        self._first.clear()
