"""The fusion IR: symbols, axes, tensors, expressions and the fusion container.

A ``TensorView`` is a list of ``Axis`` objects. Reduction axes stay in the
tensor's axes after a reduction (printed ``rS3{1024}``) so later passes can see
what was reduced, e.g. a partial sum over a sharded contraction; the tensor's
``shape`` lists only the non-reduction axes.

Axes print nvFuser-style: iteration type (``i`` iteration, ``r`` reduction,
``b`` broadcast), parallel type (``S`` serial, ``DIDx``/``DIDy``/``DIDz``,
``Stream``), the axis id and the extent: ``iS0{8}``, ``iDIDx1{1024}``,
``rS5{4096}``, ``bS2{1}``, ``iS3{batch}``.
"""

from __future__ import annotations

import contextlib
import copy
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusion.dtypes import DataType

if TYPE_CHECKING:
    from fusion.exprs import Expr


@dataclass(frozen=True)
class Symbol:
    """A symbolic extent (dynamic shape), bound from the inputs' shapes at execution."""

    name: str

    def __str__(self) -> str:
        return self.name


Extent = int | Symbol
Scalar = bool | int | float


class IterType(enum.Enum):
    """Whether an axis is iterated, reduced, or broadcast (extent 1, or stride-0 expanded)."""

    ITERATION = "i"
    REDUCTION = "r"
    BROADCAST = "b"


class ParallelType(enum.Enum):
    """How an axis is parallelized: serial, split over mesh devices, or into stream chunks."""

    Serial = "S"
    DIDx = "DIDx"
    DIDy = "DIDy"
    DIDz = "DIDz"
    Stream = "Stream"

    @property
    def is_device(self) -> bool:
        return self in (ParallelType.DIDx, ParallelType.DIDy, ParallelType.DIDz)


class Axis:
    """One axis of a tensor: extent, iteration type and parallel type.

    Axes have identity: every tensor owns its axes, and ``id`` is unique within
    the fusion (it is what the printer shows).
    """

    __slots__ = ("id", "extent", "iter_type", "parallel_type", "stream_chunks")

    def __init__(
        self,
        axis_id: int,
        extent: Extent,
        iter_type: IterType = IterType.ITERATION,
        parallel_type: ParallelType = ParallelType.Serial,
    ) -> None:
        self.id = axis_id
        self.extent = extent
        self.iter_type = iter_type
        self.parallel_type = parallel_type
        self.stream_chunks: int | None = None

    @property
    def is_reduction(self) -> bool:
        return self.iter_type is IterType.REDUCTION

    @property
    def is_broadcast(self) -> bool:
        return self.iter_type is IterType.BROADCAST

    @property
    def is_symbolic(self) -> bool:
        return isinstance(self.extent, Symbol)

    @property
    def is_stream(self) -> bool:
        """Whether the axis is cut into chunks run on different streams."""
        return self.parallel_type is ParallelType.Stream or self.stream_chunks is not None

    def stream(self, chunks: int) -> Axis:
        """Cut the axis into ``chunks`` chunks on streams.

        A device-split axis stays split: each rank's piece (or, through a pipelined
        communication, each owner's piece) is cut into chunks. Other axes become
        ``Stream`` axes.
        """
        if self.parallel_type.is_device:
            if not isinstance(chunks, int) or chunks < 1:
                raise ValueError(f"chunks must be a positive int, got {chunks!r}")
            self.stream_chunks = chunks
            return self
        return self.parallelize(ParallelType.Stream, chunks)

    def parallelize(self, parallel_type: ParallelType, chunks: int | None = None) -> Axis:
        """Set the parallel type; returns the axis for chaining.

        A ``Stream`` axis is cut into ``chunks`` pieces run on different streams
        (None leaves the count to the planner or the lowering's default).
        """
        if chunks is not None and parallel_type is not ParallelType.Stream:
            raise ValueError(f"chunks applies to Stream axes, not {parallel_type.name}")
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        if parallel_type is ParallelType.Stream and self.parallel_type.is_device:
            raise ValueError(
                f"axis {self} is split over the mesh ({self.parallel_type.name}): marking it "
                "Stream would drop that split; axis.stream(chunks) keeps it and cuts each "
                "rank's piece into chunks"
            )
        self.parallel_type = parallel_type
        self.stream_chunks = chunks
        return self

    def text(self, streamed: bool = False) -> str:
        """How the axis prints; ``streamed``: as cut into chunks on streams even where
        the axis itself is not marked (a host program's planned pipeline)."""
        parallel = self.parallel_type.value
        if self.parallel_type.is_device and (streamed or self.stream_chunks is not None):
            parallel += "|Stream"
        elif streamed:
            parallel = ParallelType.Stream.value
        return f"{self.iter_type.value}{parallel}{self.id}{{{self.extent}}}"

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__


def _operator(op_name: str, reflected: bool = False):
    """A binary operator method that adds ``op_name`` to the tensor's fusion."""

    def method(self: TensorView, other):
        from fusion import ops  # ops builds on this module

        op = getattr(ops, op_name)
        return op(other, self) if reflected else op(self, other)

    method.__name__ = f"__{'r' if reflected else ''}{op_name}__"
    return method


class TensorView:
    """A tensor of the fusion: a dtype and a list of axes.

    ``definition`` is the expr that produces it (None for inputs) and ``uses``
    the exprs that consume it. ``mesh`` is the device mesh the tensor is placed
    on (None until sharding places it; see ``sharding``); ``pinned``: an input placed
    to be computed with where it lies (a plan's weight, ``sharding.pin``), which
    sharding moves only where no layout avoids it. Arithmetic operators build ops in
    the tensor's fusion: ``a + b``, ``a * 2.0``, ``-a``.
    """

    def __init__(self, fusion: Fusion, tensor_id: int, dtype: DataType, axes: list[Axis]) -> None:
        self.fusion = fusion
        self.id = tensor_id
        self.dtype = dtype
        self.axes = axes
        self.definition: Expr | None = None
        self.uses: list[Expr] = []
        self.mesh: object | None = None
        self.pinned = False

    @property
    def name(self) -> str:
        return f"T{self.id}"

    @property
    def logical_axes(self) -> list[Axis]:
        """The axes that hold data: every axis but the reduction ones."""
        return [axis for axis in self.axes if not axis.is_reduction]

    @property
    def shape(self) -> tuple[Extent, ...]:
        """Logical extents (reduction axes excluded); fp4 counts values, not bytes."""
        return tuple(axis.extent for axis in self.logical_axes)

    @property
    def ndim(self) -> int:
        return len(self.logical_axes)

    def axis(self, index: int) -> Axis:
        """The logical axis at ``index`` (negative indices count from the end)."""
        return self.logical_axes[index]

    @property
    def is_input(self) -> bool:
        return self in self.fusion.inputs

    @property
    def is_output(self) -> bool:
        return self in self.fusion.outputs

    def text(self, stream_dim: int | None = None) -> str:
        """How the tensor prints; ``stream_dim``: its logical axis shown as cut into
        chunks on streams (see ``Axis.text``)."""
        streamed = None if stream_dim is None else self.logical_axes[stream_dim]
        axes = ", ".join(axis.text(axis is streamed) for axis in self.axes)
        return f"{self.name}_{self.dtype.short}[{axes}]"

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__

    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __truediv__ = _operator("div")
    __rtruediv__ = _operator("div", reflected=True)
    __pow__ = _operator("pow")
    __rpow__ = _operator("pow", reflected=True)
    __matmul__ = _operator("matmul")

    def __neg__(self) -> TensorView:
        from fusion import ops

        return ops.neg(self)


@dataclass(frozen=True)
class ExtentConstraint:
    """A relation (``==`` or ``>``) an op requires between two extents; checked once bound."""

    lhs: Extent
    rhs: Extent
    reason: str
    relation: str = "=="

    def holds(self, lhs: int, rhs: int) -> bool:
        return lhs == rhs if self.relation == "==" else lhs > rhs

    def __str__(self) -> str:
        return f"{self.lhs} {self.relation} {self.rhs}  ({self.reason})"


class Fusion:
    """A DAG of tensor ops: inputs, exprs in definition order, outputs.

    Build one with ``FusionDefinition``; ``str(fusion)`` prints it.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.inputs: list[TensorView] = []
        self.outputs: list[TensorView] = []
        self.exprs: list[Expr] = []
        self.tensors: list[TensorView] = []
        self.symbols: dict[str, Symbol] = {}
        self.constraints: list[ExtentConstraint] = []
        self.finalized = False
        self._next_axis_id = 0
        self._next_anonymous_symbol = 0

    def new_axis(
        self,
        extent: Extent,
        iter_type: IterType = IterType.ITERATION,
        parallel_type: ParallelType = ParallelType.Serial,
    ) -> Axis:
        """A fresh axis. A non-reduction axis of static extent 1 is a broadcast axis."""
        if iter_type is IterType.ITERATION and extent == 1:
            iter_type = IterType.BROADCAST
        axis = Axis(self._next_axis_id, extent, iter_type, parallel_type)
        self._next_axis_id += 1
        return axis

    def new_tensor(self, dtype: DataType, axes: list[Axis]) -> TensorView:
        # one past the largest id held: two tensors held at once never share a name
        tensor = TensorView(self, self.next_tensor_id(), dtype, axes)
        self.tensors.append(tensor)
        return tensor

    def next_tensor_id(self) -> int:
        """The id the next new tensor gets (names ``T<id>`` stay unique)."""
        return max((t.id for t in self.tensors), default=-1) + 1

    def symbol(self, name: str | None = None) -> Symbol:
        """The symbol ``name`` (created on first use); a fresh ``s<k>`` when ``name`` is None."""
        if name is None:
            while f"s{self._next_anonymous_symbol}" in self.symbols:
                self._next_anonymous_symbol += 1
            name = f"s{self._next_anonymous_symbol}"
        return self.symbols.setdefault(name, Symbol(name))

    def clone(self) -> Fusion:
        """A deep copy; passes rewrite a copy and leave the user's fusion as it was.

        Copied in two steps, so that a long chain of exprs (a big backward) does not
        recurse once per link as ``copy.deepcopy`` alone would: the fusion, its tensors
        and its exprs copied shallowly first, then each one's attributes deep-copied
        with those already in the memo."""
        graph: list[object] = [self, *self.tensors, *self.exprs]
        memo: dict[int, object] = {id(obj): copy.copy(obj) for obj in graph}
        for obj in graph:
            memo[id(obj)].__dict__ = copy.deepcopy(obj.__dict__, memo)
        return memo[id(self)]

    @contextlib.contextmanager
    def editing(self) -> Iterator[Fusion]:
        """Let a pass add ops to a finalized fusion."""
        finalized, self.finalized = self.finalized, False
        try:
            yield self
        finally:
            self.finalized = finalized

    def move_before(self, exprs: list[Expr], anchor: Expr) -> None:
        """Move ``exprs`` (in order) to just before ``anchor`` in the expr list."""
        for expr in exprs:
            self.exprs.remove(expr)
        index = self.exprs.index(anchor)
        self.exprs[index:index] = exprs

    def move_after(self, exprs: list[Expr], anchor: Expr) -> None:
        """Move ``exprs`` (in order) to just after ``anchor`` in the expr list."""
        for expr in exprs:
            self.exprs.remove(expr)
        index = self.exprs.index(anchor) + 1
        self.exprs[index:index] = exprs

    def replace_input(self, expr: Expr, old: TensorView, new: TensorView) -> None:
        """Make ``expr`` read ``new`` wherever it read ``old``."""
        expr.operands = tuple(new if o is old else o for o in expr.operands)
        expr.inputs = [new if t is old else t for t in expr.inputs]
        old.uses.remove(expr)
        if expr not in new.uses:
            new.uses.append(expr)

    def replace_input_at(self, expr: Expr, index: int, new: TensorView) -> None:
        """Make ``expr`` read ``new`` as its ``index``-th tensor input only (an expr that
        reads one tensor twice may need two copies of it placed differently)."""
        old = expr.inputs[index]
        seen = -1
        operands = list(expr.operands)
        for position, operand in enumerate(operands):
            if isinstance(operand, TensorView):
                seen += 1
                if seen == index:
                    operands[position] = new
        expr.operands = tuple(operands)
        expr.inputs = [new if i == index else t for i, t in enumerate(expr.inputs)]
        if old not in expr.inputs:
            old.uses.remove(expr)
        if expr not in new.uses:
            new.uses.append(expr)

    def redirect_output(self, expr: Expr, old: TensorView, new: TensorView) -> None:
        """Make ``expr`` define ``new`` instead of ``old`` (which is left without definition)."""
        expr.outputs = [new if t is old else t for t in expr.outputs]
        new.definition = expr
        old.definition = None

    def remove_expr(self, expr: Expr) -> None:
        """Drop ``expr``; its outputs are left without definition."""
        self.exprs.remove(expr)
        for tensor in dict.fromkeys(expr.inputs):
            tensor.uses.remove(expr)
        for tensor in expr.outputs:
            if tensor.definition is expr:
                tensor.definition = None

    def live_exprs(self) -> list[Expr]:
        """The exprs the outputs depend on, in definition order."""
        needed: set[int] = {id(t) for t in self.outputs}
        live: list[Expr] = []
        for expr in reversed(self.exprs):
            if any(id(out) in needed for out in expr.outputs):
                live.append(expr)
                needed.update(id(t) for t in expr.inputs)
        live.reverse()
        return live

    def boundary(self, exprs: list[Expr]) -> tuple[list[TensorView], list[TensorView]]:
        """What a group of ``exprs`` reads from outside it, and what it produces that the
        rest of the fusion (or its outputs) reads."""
        inside = set(exprs)
        produced = {t for e in exprs for t in e.outputs}
        inputs = list(dict.fromkeys(t for e in exprs for t in e.inputs if t not in produced))
        outputs = [
            t
            for e in exprs
            for t in e.outputs
            if t in self.outputs or any(use not in inside for use in t.uses)
        ]
        return inputs, outputs

    def __str__(self) -> str:
        from fusion.printer import fusion_to_text

        return fusion_to_text(self)

    __repr__ = __str__
