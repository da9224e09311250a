"""Sharding rules: one small rule per op family, written for one mesh axis.

A rule describes how an expr carries a split from its inputs to its output
as a ``DimMap``: for each tensor input, which output axis each of its axes
becomes (or None when a split on that axis cannot pass through the op), and
which input axes make the output a partial result when split (a contraction
or a sum over a split axis). Shared code turns a ``DimMap`` into the two
directions propagation needs:

- ``forward``: the placement of the output given (some of) the inputs';
- ``backward``: the placements the inputs need for the expr to produce a
  given output placement locally, or None when it cannot.

Rules see one mesh axis at a time (``parts`` is the number of ranks along
it); ``mesh_rule`` expands an expr's rule over every axis of a mesh, and
propagation and resharding both go through it. Adding an op family touches
one place: a function registered in ``RULES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fusion.exprs import (
    AttentionGradOp,
    AttentionOp,
    BinaryOp,
    BroadcastOp,
    CastOp,
    CompareOp,
    ConcatOp,
    DetachOp,
    DropoutMaskOp,
    EmbeddingGradOp,
    EmbeddingOp,
    ExpandOp,
    Expr,
    IotaOp,
    LinearOp,
    MatmulOp,
    PadOp,
    PermuteOp,
    ReductionOp,
    ReshapeOp,
    SelectOp,
    SetOp,
    SliceOp,
    TorchOp,
    UnaryOp,
    VarMeanOp,
    WhereOp,
)
from fusion.ir import Extent, Symbol, TensorView
from sharding.layout import Layout, Partial, Placement, Replicate, Shard, valid_placements
from sharding.mesh import DeviceMesh
from sharding.torch_strategy import torch_strategy


@dataclass
class DimMap:
    """How one expr carries a split, per tensor input (in ``expr.inputs`` order).

    ``maps[i][d]`` is the output axis that axis ``d`` of input ``i`` becomes; an
    axis missing from ``maps[i]`` cannot carry a split through the op.
    ``partial[i]`` are the axes of input ``i`` whose split makes the output a
    partial result combined by ``partial_op``. ``order`` ranks the inputs when
    several are split (weights before activations). ``free_output_dims`` may be
    split with every input replicated (``expand`` computes its local piece).
    ``selectors`` are inputs that stay whole where the output is partial (an embedding's
    indices: they choose the rows each rank's piece of the table adds).
    """

    rule: str
    maps: list[dict[int, int]]
    partial: list[set[int]] = field(default_factory=list)
    partial_op: str = "sum"
    order: list[int] | None = None
    free_output_dims: set[int] = field(default_factory=set)
    selectors: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.partial:
            self.partial = [set() for _ in self.maps]
        if self.order is None:
            self.order = list(range(len(self.maps)))

    def forward(self, inputs: list[Placement | None]) -> Placement:
        """The output's placement when the inputs are placed as given (None: unknown)."""
        for index in self.order:
            placement = inputs[index]
            if isinstance(placement, Shard) and placement.dim in self.partial[index]:
                return Partial(self.partial_op)
        for index in self.order:
            placement = inputs[index]
            if isinstance(placement, Shard) and placement.dim in self.maps[index]:
                return Shard(self.maps[index][placement.dim])
        return Replicate()

    def backward(
        self, output: Placement, current: Sequence[Placement | None] | None = None
    ) -> list[Placement] | None:
        """Input placements that produce ``output`` locally, or None if the op cannot.
        ``current``: the inputs' placements now, where known: an input already split on
        an axis that serves is kept so (a sum over [batch, seq] of a sequence split is
        partial as it is, not after moving the split to the batch)."""
        if isinstance(output, Replicate):
            return [Replicate() for _ in self.maps]
        if isinstance(output, Partial):
            # every input must carry the reduction: one outside it (a linear's bias) would
            # be added whole on every rank
            summands = [p for i, p in enumerate(self.partial) if i not in self.selectors]
            if output.op != self.partial_op or not all(summands):
                return None
            now = list(current) if current is not None else [None] * len(self.maps)
            return [Replicate() if i in self.selectors
                    else now[i] if isinstance(now[i], Shard) and now[i].dim in dims
                    else Shard(min(dims))
                    for i, dims in enumerate(self.partial)]  # fmt: skip
        sources = [
            [d for d, o in sorted(mapping.items()) if o == output.dim] for mapping in self.maps
        ]
        if not any(sources) and output.dim not in self.free_output_dims:
            return None
        return [Shard(dims[0]) if dims else Replicate() for dims in sources]


RuleFunction = Callable[[Expr, int], DimMap]
RULES: dict[type[Expr], RuleFunction] = {}


def register(*expr_classes: type[Expr]) -> Callable[[RuleFunction], RuleFunction]:
    def decorate(function: RuleFunction) -> RuleFunction:
        for expr_class in expr_classes:
            RULES[expr_class] = function
        return function

    return decorate


def dim_map(expr: Expr, parts: int) -> DimMap:
    """The rule of ``expr``'s family (the nearest registered base class)."""
    for cls in type(expr).__mro__:
        if cls in RULES:
            return RULES[cls](expr, parts)
    raise NotImplementedError(f"no sharding rule for {type(expr).__name__}")


@dataclass(frozen=True)
class MeshRule:
    """An expr's rule expanded over a mesh: one ``DimMap`` per mesh axis.

    Example::

        rule = mesh_rule(expr, mesh)
        produced = rule.forward([layout_of(t) for t in expr.inputs])
        needed = rule.backward(produced)  # one layout per input, or None
    """

    mesh: DeviceMesh
    per_axis: tuple[DimMap, ...]

    @property
    def name(self) -> str:
        """The rule's name (its op family's, on every mesh axis)."""
        return self.per_axis[-1].rule

    def forward(self, inputs: Sequence[Layout | None]) -> Layout:
        """The output's layout when the inputs are laid out as given (None: unknown)."""
        placements = [
            rule.forward([None if layout is None else layout.placements[axis] for layout in inputs])
            for axis, rule in enumerate(self.per_axis)
        ]
        return Layout(self.mesh, valid_placements(placements))

    def backward(
        self,
        output: Layout,
        *,
        replicate_if_impossible: bool = False,
        current: Sequence[Layout | None] | None = None,
    ) -> list[Layout] | None:
        """The input layouts that produce ``output`` locally, or None when a mesh axis cannot
        (with ``replicate_if_impossible``, the inputs are replicated on that axis instead;
        ``current``: the inputs' layouts now, kept where they serve, ``DimMap.backward``)."""
        per_axis = []
        for axis, (rule, placement) in enumerate(zip(self.per_axis, output.placements,
                                                      strict=True)):  # fmt: skip
            now = None if current is None else [
                None if layout is None else layout.placements[axis] for layout in current
            ]  # fmt: skip
            needs = rule.backward(placement, now)
            if needs is None:
                if not replicate_if_impossible:
                    return None
                needs = [Replicate() for _ in rule.maps]
            per_axis.append(needs)
        return [Layout(self.mesh, valid_placements(p)) for p in zip(*per_axis, strict=True)]


def mesh_rule(expr: Expr, mesh: DeviceMesh) -> MeshRule:
    """``expr``'s rule on every axis of ``mesh`` (each told how many ranks it has)."""
    return MeshRule(mesh, tuple(dim_map(expr, parts) for parts in mesh.shape))


def _broadcasts(source: Extent, target: Extent) -> bool:
    return source == 1 and target != 1


def _same_rank_map(tensor: TensorView, out: TensorView) -> dict[int, int]:
    """Axis d to axis d, except axes the op broadcasts (extent 1 against a larger extent)."""
    return {
        d: d
        for d, (a, b) in enumerate(zip(tensor.shape, out.shape, strict=True))
        if not _broadcasts(a, b)
    }


@register(UnaryOp, BinaryOp, CompareOp, WhereOp, CastOp, SetOp, DetachOp)
def pointwise_rule(expr: Expr, parts: int) -> DimMap:
    """Elementwise ops (and copies, casts): a split passes axis for axis."""
    out = expr.outputs[0]
    return DimMap("pointwise", [_same_rank_map(t, out) for t in expr.inputs])


@register(BroadcastOp)
def broadcast_rule(expr: BroadcastOp, parts: int) -> DimMap:
    """Input axes keep their split at their new positions; new axes are not split."""
    kept = [o for o, flag in enumerate(expr.is_broadcast_dim) if not flag]
    return DimMap("broadcast", [dict(enumerate(kept))])


@register(ExpandOp)
def expand_rule(expr: ExpandOp, parts: int) -> DimMap:
    """Kept axes pass a split; an expanded axis can be split with the input replicated."""
    (x,), out = expr.inputs, expr.output
    expanded = {d for d, (a, b) in enumerate(zip(x.shape, out.shape, strict=True)) if a != b}
    return DimMap(
        "expand",
        [{d: d for d in range(x.ndim) if d not in expanded}],
        free_output_dims=expanded,
    )


@register(PermuteOp)
def permute_rule(expr: PermuteOp, parts: int) -> DimMap:
    """Input axis ``dims[o]`` becomes output axis ``o``."""
    return DimMap("permute", [{d: o for o, d in enumerate(expr.dims)}])


@register(SliceOp)
def slice_rule(expr: SliceOp, parts: int) -> DimMap:
    """Axes taken whole pass a split; a sliced axis must be whole on every rank."""
    (x,) = expr.inputs
    whole = {
        d
        for d, (axis, start, stop, step) in enumerate(
            zip(x.logical_axes, expr.starts, expr.stops, expr.steps, strict=True)
        )
        if start == 0 and step == 1 and stop == axis.extent
    }
    return DimMap("slice", [{d: d for d in whole}])


@register(PadOp)
def pad_rule(expr: PadOp, parts: int) -> DimMap:
    """Axes not padded pass a split; a padded axis must be whole on every rank."""
    (x,) = expr.inputs
    kept = {d for d in range(x.ndim) if expr.before[d] == expr.after[d] == 0}
    return DimMap("pad", [{d: d for d in kept}])


@register(ConcatOp)
def concat_rule(expr: ConcatOp, parts: int) -> DimMap:
    """The other axes pass a split; the joined axis must be whole on every rank."""
    return DimMap("cat", [{d: d for d in range(t.ndim) if d != expr.dim} for t in expr.inputs])


@register(SelectOp)
def select_rule(expr: SelectOp, parts: int) -> DimMap:
    """Other axes pass a split (shifted past the removed one); the selected axis cannot."""
    (x,) = expr.inputs
    return DimMap("select", [{d: d - (d > expr.dim) for d in range(x.ndim) if d != expr.dim}])


def reshape_groups(
    source: tuple[Extent, ...], target: tuple[Extent, ...]
) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of source and target axes with equal products; None if not decomposable.

    Extent-1 axes form groups of their own; a symbolic extent must face the same symbol.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(source) or j < len(target):
        if i < len(source) and source[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(target) and target[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(source) or j >= len(target):
            return None
        a, b = source[i], target[j]
        if isinstance(a, Symbol) or isinstance(b, Symbol):
            if a != b:
                return None
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        group = ([i], [j])
        product_a, product_b = a, b
        i, j = i + 1, j + 1
        while product_a != product_b:
            if product_a < product_b:
                if i >= len(source) or not isinstance(source[i], int) or source[i] == 0:
                    return None
                product_a *= source[i]
                group[0].append(i)
                i += 1
            else:
                if j >= len(target) or not isinstance(target[j], int) or target[j] == 0:
                    return None
                product_b *= target[j]
                group[1].append(j)
                j += 1
        groups.append(group)
    return groups


@register(ReshapeOp)
def reshape_rule(expr: ReshapeOp, parts: int) -> DimMap:
    """An axis kept as is passes its split; in a merge or split, the outermost axis does
    when both it and the outermost axis it becomes divide evenly over the ranks."""
    (x,), out = expr.inputs, expr.output
    groups = reshape_groups(x.shape, out.shape) or []
    mapping: dict[int, int] = {}
    for sources, targets in groups:
        if not sources or not targets:
            continue
        if len(sources) == 1 and len(targets) == 1:
            mapping[sources[0]] = targets[0]
            continue
        first, becomes = x.shape[sources[0]], out.shape[targets[0]]
        if isinstance(first, int) and isinstance(becomes, int):
            if first % parts == 0 and becomes % parts == 0:
                mapping[sources[0]] = targets[0]
    return DimMap("reshape", [mapping])


def _reduction_map(x: TensorView, dims: tuple[int, ...]) -> dict[int, int]:
    kept = [d for d in range(x.ndim) if d not in dims]
    return {d: o for o, d in enumerate(kept)}


@register(ReductionOp)
def reduction_rule(expr: ReductionOp, parts: int) -> DimMap:
    """Kept axes pass a split; a split reduced axis leaves a partial sum, max or min
    (a mean cannot be combined from partial means: its reduced axes must be whole)."""
    (x,) = expr.inputs
    mapping = _reduction_map(x, expr.dims)
    if expr.op_name == "mean":
        return DimMap("reduction", [mapping])
    return DimMap("reduction", [mapping], [set(expr.dims)], partial_op=expr.op_name)


@register(VarMeanOp)
def var_mean_rule(expr: VarMeanOp, parts: int) -> DimMap:
    """Kept axes pass a split; the reduced axes must be whole."""
    (x,) = expr.inputs
    return DimMap("var_mean", [_reduction_map(x, expr.dims)])


@register(MatmulOp)
def matmul_rule(expr: MatmulOp, parts: int) -> DimMap:
    """``a[..., M, K] @ b[..., K, N]``: M and N pass a split, batch axes too; a split K
    leaves a partial sum. ``b`` (usually the weight) decides first."""
    a, b = expr.inputs
    out = expr.output
    batch = out.ndim - 2

    def operand_map(tensor: TensorView, rows: int | None, cols: int | None) -> dict[int, int]:
        offset = batch - (tensor.ndim - 2)
        mapping = {
            d: offset + d
            for d in range(tensor.ndim - 2)
            if not _broadcasts(tensor.shape[d], out.shape[offset + d])
        }
        if rows is not None:
            mapping[tensor.ndim - 2] = rows
        if cols is not None:
            mapping[tensor.ndim - 1] = cols
        return mapping

    return DimMap(
        "matmul",
        [operand_map(a, batch, None), operand_map(b, None, batch + 1)],
        [{a.ndim - 1}, {b.ndim - 2}],
        order=[1, 0],
    )


@register(LinearOp)
def linear_rule(expr: LinearOp, parts: int) -> DimMap:
    """``x[..., K] @ weight[N, K].T + bias[N]``: a split N (column-parallel) or batch axis
    passes; a split K (row-parallel) leaves a partial sum. The weight decides first."""
    x, weight, *bias = expr.inputs
    n_dim = x.ndim - 1
    maps = [{d: d for d in range(x.ndim - 1)}, {0: n_dim}]
    partial = [{x.ndim - 1}, {1}]
    if bias:
        maps.append({0: n_dim})
        partial.append(set())
    order = [1, 2, 0] if bias else [1, 0]
    return DimMap("linear", maps, partial, order=order)


@register(IotaOp)
def iota_rule(expr: IotaOp, parts: int) -> DimMap:
    """No operands: the output may be split (each rank makes its own indices)."""
    return DimMap("iota", [], free_output_dims={0})


@register(DropoutMaskOp)
def dropout_mask_rule(expr: DropoutMaskOp, parts: int) -> DimMap:
    """The seed stays whole; any axis of the mask may be split (each rank draws its own
    piece's bits from their global indices)."""
    return DimMap("dropout_mask", [{}], free_output_dims=set(range(expr.output.ndim)))


@register(EmbeddingOp)
def embedding_rule(expr: EmbeddingOp, parts: int) -> DimMap:
    """Index axes pass a split to the output, the features axis the table's; a table split
    by rows (with its row numbers) leaves a partial sum, the indices whole (a
    vocabulary-parallel embedding: each rank adds the rows it holds)."""
    table, indices, _ = expr.inputs
    features = expr.output.ndim - 1
    return DimMap(
        "embedding",
        [{1: features}, {d: d for d in range(indices.ndim)}, {}],
        [{0}, set(), {0}],
        order=[0, 2, 1],
        selectors={1},
    )


@register(EmbeddingGradOp)
def embedding_grad_rule(expr: EmbeddingGradOp, parts: int) -> DimMap:
    """The table's rows split with their row numbers (each rank sums its rows), the
    features with the gradient's; split index axes leave a partial sum (the row numbers
    whole)."""
    grad, indices, _ = expr.inputs
    index_axes = set(range(indices.ndim))
    return DimMap(
        "embedding_grad",
        [{grad.ndim - 1: 1}, {}, {0: 0}],
        [set(index_axes), set(index_axes), set()],
        order=[2, 0, 1],
        selectors={2},
    )


@register(AttentionOp, AttentionGradOp)
def attention_rule(expr: Expr, parts: int) -> DimMap:
    """Leading axes (batch, heads) pass a split; the query, key and feature axes must be
    whole (attention over a split sequence is another algorithm)."""
    out = expr.outputs[0]
    leading = out.ndim - 2
    maps = [{d: o for d, o in _same_rank_map(t, out).items() if d < leading} for t in expr.inputs]
    return DimMap("attention", maps)


@register(TorchOp)
def torch_op_rule(expr: TorchOp, parts: int) -> DimMap:
    """An ATen op PyTorch runs for us (no translation into the IR): split as torch's own
    DTensor strategy splits it where torch has one (``sharding.torch_strategy``), else
    it sees what it sees on one device, every tensor whole on every rank (resharding
    gathers split inputs and cuts its outputs where their consumers want pieces)."""
    strategy = torch_strategy(expr, parts)
    if not strategy.splits:
        return DimMap("torch op fallback: replicated", [{} for _ in expr.inputs])
    maps: list[dict[int, int]] = [{} for _ in expr.inputs]
    for output_dim, input_dims in strategy.splits.items():
        for mapping, dim in zip(maps, input_dims, strict=True):
            if dim is not None:
                mapping[dim] = output_dim
    return DimMap("torch's strategy", maps)
