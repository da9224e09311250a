"""PyTorch's own DTensor op strategies for the ATen ops we leave to PyTorch (``TorchOp``).

An opaque torch op (``fusion.torch_ops``) is placed the way DTensor would place it:
``torch_strategy(expr, parts)`` asks torch's sharding propagator
(``DTensor._op_dispatcher.sharding_propagator``) which output placements the op gets
from inputs placed ``Shard(d)`` or ``Replicate()`` on a 1-D mesh of ``parts`` ranks,
built without a process group. The answer is the output axes torch can split, each
with the input axes that must be split for it (the rest whole), which
``sharding.rules.torch_op_rule`` turns into a ``DimMap``. A split is taken only when:

- torch keeps the split input as given (asked ``Shard(d)``, it does not gather it),
  and every output comes back ``Shard(o)`` on one axis ``o`` (never ``Partial``);
- asked again with exactly those input placements, torch moves nothing and does not
  rewrite the op's arguments for local pieces (a view's shape, a factory's size);
- the split is even (uneven pieces are cut otherwise by DTensor), and the op run on
  each rank's pieces of sample inputs gives that rank's pieces of its outputs on the
  whole (torch's strategy checked on values: torch 2.13's ``cumsum`` strategy, asked
  with ``dim=-1``, keeps a split of the last axis; we ask with ``dim`` made positive).

Anything else (an op torch has no strategy for, a ``Partial`` input, a failure to ask
torch, a torch release whose private API differs) leaves the op replicated: every tensor
whole on every rank, which is never wrong. The backward of an op (``TorchOp`` with
``vjp``) keeps the forward's split where every differentiated input is split on one
axis: each rank's output piece then depends on its input pieces alone, so the local
vector-Jacobian product is its piece of the gradient (a whole input's gradient would be
a partial sum: such a backward stays replicated).

Example::

    strategy = torch_strategy(cumsum_of_rows, parts=2)  # cumsum(x[4, 6], dim=1)
    strategy.splits  # {0: (0,)}: output axis 0 split, with x split on axis 0
    strategy.note  # "torch's strategy"
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

import torch

from fusion.exprs import TorchOp
from fusion.torch_ops import filled_arguments

# what ``note`` says where torch has no strategy for the op, and where it has one
NO_STRATEGY = "torch has no strategy"
STRATEGY = "torch's strategy"
# the most input elements a strategy is checked on (sample values on the CPU, once per
# op and shape; 256 MiB in float32): a larger op runs replicated
CHECKED_ELEMENTS = 1 << 26
# why an op torch has a strategy for runs replicated: none of its splits holds here
# (uneven, or off on sample values)
NO_SPLIT = "torch's strategy splits none of it here"


@dataclass(frozen=True)
class TorchStrategy:
    """What torch's DTensor strategy allows for one op on one mesh axis of ``parts`` ranks.

    ``splits[o]`` holds, per tensor input (in ``expr.inputs`` order), the axis that must
    be split for the outputs to come out split on axis ``o`` (None: whole on every rank);
    an output axis missing from it cannot be split. Empty: the op runs replicated.
    ``note`` says where the answer came from (torch's strategy, or why not).
    """

    splits: dict[int, tuple[int | None, ...]] = field(default_factory=dict)
    note: str = NO_STRATEGY


def torch_strategy(expr: TorchOp, parts: int) -> TorchStrategy:
    """The splits torch's DTensor strategy gives ``expr`` on ``parts`` ranks (see the
    module); asked once per op, arguments, shapes and ``parts``."""
    shapes = tuple(tuple(t.shape) for t in expr.inputs)
    if parts < 2:
        return TorchStrategy(note="one rank")
    if not all(isinstance(e, int) for shape in shapes for e in shape):
        return TorchStrategy(note="symbolic extents")
    dtypes = tuple(t.dtype.torch_dtype for t in expr.inputs)
    key = (str(expr.target), repr(expr.arguments), repr(expr.keywords), expr.vjp, shapes,
           dtypes, parts)  # fmt: skip
    if key not in _answers:
        _answers[key] = _answer(expr, shapes, dtypes, parts)
    return _answers[key]


# torch's answers so far: propagation asks for each op's rule many times
_answers: dict[tuple, TorchStrategy] = {}


def fallback_placement(expr: TorchOp, placements: Sequence[object], mesh_shape) -> str:
    """How ``explain()`` names where an opaque op runs, from its output's ``placements``
    on a mesh of ``mesh_shape``: ``torch's strategy: S(0)``, or ``replicated: torch has no
    strategy`` (or why else torch's strategy was not taken)."""
    strategies = [torch_strategy(expr, parts) for parts in mesh_shape]
    if any(strategy.splits for strategy in strategies):
        return f"torch's strategy: {', '.join(str(p) for p in placements)}"
    notes = [s.note for s in strategies if s.note not in (STRATEGY, "one rank")]
    return f"replicated: {notes[0] if notes else NO_SPLIT}"


def _answer(expr: TorchOp, shapes, dtypes, parts: int) -> TorchStrategy:
    try:
        return _strategy(expr, shapes, dtypes, parts)
    except NotImplementedError:
        return TorchStrategy(note=NO_STRATEGY)
    except Exception as error:  # noqa: BLE001 (any failure to ask torch: replicated)
        return TorchStrategy(note=f"asking torch failed: {type(error).__name__}")


def _strategy(expr: TorchOp, shapes, dtypes, parts: int) -> TorchStrategy:
    forward_count = expr.forward_count
    if not forward_count:
        return TorchStrategy(note="no tensor inputs (made whole on every rank)")
    if sum(math.prod(shape) for shape in shapes[:forward_count]) > CHECKED_ELEMENTS:
        return TorchStrategy(note=f"over {CHECKED_ELEMENTS} input elements to check on values")
    if not any(extent % parts == 0 for shape in shapes[:forward_count] for extent in shape):
        return TorchStrategy(note=f"no input axis splits evenly over {parts} ranks")
    forward = _forward_splits(expr, shapes[:forward_count], dtypes[:forward_count], parts)
    if expr.vjp is None:
        return TorchStrategy(forward, STRATEGY)
    return TorchStrategy(_vjp_splits(expr, forward, shapes), STRATEGY)


def _forward_splits(
    expr: TorchOp, shapes: Sequence[tuple[int, ...]], dtypes, parts: int
) -> dict[int, tuple[int | None, ...]]:
    """Per output axis, the input splits torch's strategy takes as they are (see the
    module), each input axis used for one output axis only."""
    mesh = _mesh(parts)
    outputs = _forward(expr, [_meta(s, d) for s, d in zip(shapes, dtypes, strict=True)])
    candidates: dict[int, tuple[int | None, ...]] = {}
    for index, shape in enumerate(shapes):
        for dim, extent in enumerate(shape):
            if extent % parts:
                continue
            asked = tuple(dim if i == index else None for i in range(len(shapes)))
            output_dim, wanted = _ask(expr, mesh, shapes, dtypes, asked)
            if output_dim is None or wanted[index] != dim or output_dim in candidates:
                continue
            candidates[output_dim] = wanted
    splits: dict[int, tuple[int | None, ...]] = {}
    used: set[tuple[int, int]] = set()
    for output_dim, wanted in sorted(candidates.items()):
        axes = {(i, d) for i, d in enumerate(wanted) if d is not None}
        if axes & used or not _even(shapes, wanted, outputs, output_dim, parts):
            continue
        if _ask(expr, mesh, shapes, dtypes, wanted) != (output_dim, wanted):
            continue  # torch moves something even as it asked: not a fixed point
        if not _pieces_match(expr, shapes, dtypes, wanted, output_dim, parts):
            continue
        used |= axes
        splits[output_dim] = wanted
    return splits


def _vjp_splits(
    expr: TorchOp,
    forward: dict[int, tuple[int | None, ...]],
    shapes: Sequence[tuple[int, ...]],
) -> dict[int, tuple[int | None, ...]]:
    """The backward's splits from the forward's: the gradients come out split on the
    axis every differentiated input is split on; the incoming gradients split as the
    forward's outputs."""
    grads = len(shapes) - expr.forward_count
    splits: dict[int, tuple[int | None, ...]] = {}
    for output_dim, wanted in sorted(forward.items()):
        differentiated = {wanted[i] for i in expr.vjp}
        if None in differentiated or len(differentiated) != 1:
            continue
        (grad_dim,) = differentiated
        if grad_dim not in splits:
            splits[grad_dim] = (*wanted, *([output_dim] * grads))
    return splits


def _ask(
    expr: TorchOp,
    mesh: object,
    shapes: Sequence[tuple[int, ...]],
    dtypes,
    split: Sequence[int | None],
) -> tuple[int | None, tuple[int | None, ...]]:
    """Torch's answer for inputs split as ``split`` (None: replicated): the axis every
    output is split on (None: not all on one axis) and the input splits it wants."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    for rewrites in ("op_to_shape_and_stride_idx", "op_to_scalar_shape_adjuster",
                     "squeeze_op_to_dims_variant"):  # fmt: skip
        if expr.target in getattr(propagator, rewrites, {}):
            return None, ()  # torch rewrites its arguments for local pieces: not ours
    tensors, meta = [], torch.device("meta")
    for shape, dtype, dim in zip(shapes, dtypes, split, strict=True):
        placement = Replicate() if dim is None else Shard(dim)
        whole = _meta(shape, dtype)
        local = _meta(_piece(shape, dim, mesh.size()), dtype)
        tensors.append(DTensor.from_local(local, mesh, [placement], run_check=False,
                                          shape=whole.shape, stride=whole.stride()))  # fmt: skip
    arguments, keywords = _dims_normalized(expr, *filled_arguments(expr, tensors, meta))
    op_info = dispatcher.unwrap_to_op_info(expr.target, arguments, keywords)
    propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if getattr(sharding, "use_val_from_redistribute_schema", False):
        return None, ()
    specs = sharding.output_spec
    specs = list(specs) if isinstance(specs, (tuple, list)) else [specs]
    output_dims = {_shard_dim(s) for s in specs if s is not None}
    wanted = split
    if sharding.needs_redistribute and sharding.redistribute_schema is not None:
        wanted_specs = sharding.redistribute_schema.args_spec
        if len(wanted_specs) != len(shapes):
            return None, ()
        wanted = tuple(_shard_dim(s) for s in wanted_specs)
    if len(output_dims) != 1 or "other" in wanted:
        return None, ()
    (output_dim,) = output_dims
    if output_dim in (None, "other"):
        return None, ()
    return output_dim, tuple(wanted)


def _dims_normalized(expr: TorchOp, arguments: tuple, keywords: dict) -> tuple[tuple, dict]:
    """The arguments with a negative ``dim`` (or ``dims``) made positive against the first
    tensor's rank: the same op, asked as torch's strategies read it (torch 2.13's
    ``cumsum`` strategy takes ``dim=-1`` for an axis other than the last)."""
    ndim = len(expr.inputs[0].shape)

    def positive(name: str, value: object) -> object:
        if name not in ("dim", "dims"):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value % ndim if ndim else value
        if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
            return type(value)(v % ndim if ndim else v for v in value)
        return value

    names = [argument.name for argument in expr.target._schema.arguments]
    arguments = tuple(positive(names[i] if i < len(names) else "", value)
                      for i, value in enumerate(arguments))  # fmt: skip
    return arguments, {key: positive(key, value) for key, value in keywords.items()}


def _shard_dim(spec: object) -> int | None | str:
    """The axis a one-mesh-axis spec is split on, None when replicated, "other" for
    anything else (partial, strided)."""
    from torch.distributed.tensor import Replicate, Shard

    (placement,) = spec.placements
    if type(placement) is Shard:
        return placement.dim % len(spec.tensor_meta.shape)
    return None if isinstance(placement, Replicate) else "other"


def _even(shapes, wanted, outputs, output_dim: int, parts: int) -> bool:
    inputs_even = all(d is None or s[d] % parts == 0 for s, d in zip(shapes, wanted, strict=True))
    return inputs_even and all(o.shape[output_dim] % parts == 0 for o in outputs)


def _pieces_match(expr, shapes, dtypes, wanted, output_dim: int, parts: int) -> bool:
    """The op run on each rank's pieces of sample inputs gives that rank's pieces of its
    outputs on the whole: torch's strategy checked on values before we rely on it.
    Floating inputs are drawn from a fixed seed (every rank plans alike), other inputs
    are zeros (valid indices). A wrong split is off by the size of the values, not by
    rounding: the tolerance only allows another summation order."""
    generator = torch.Generator().manual_seed(0)
    wholes = [torch.randn(shape, generator=generator).to(dtype) if dtype.is_floating_point
              else torch.zeros(shape, dtype=dtype)
              for shape, dtype in zip(shapes, dtypes, strict=True)]  # fmt: skip
    try:
        expected = _forward(expr, wholes)
        by_rank = [_forward(expr, [w if d is None else w.chunk(parts, d)[rank]
                                   for w, d in zip(wholes, wanted, strict=True)])
                   for rank in range(parts)]  # fmt: skip
    except Exception:  # noqa: BLE001 (the op refuses the samples or the pieces: not taken)
        return False
    for rank, results in enumerate(by_rank):
        for result, whole in zip(results, expected, strict=True):
            piece = whole.chunk(parts, output_dim)[rank]
            if result.shape != piece.shape or result.dtype != piece.dtype:
                return False
            if not (piece.is_floating_point() or piece.is_complex()):
                if not torch.equal(result, piece):
                    return False
                continue
            tolerance = 1e-2 if piece.element_size() <= 2 else 1e-4
            if not torch.allclose(result, piece, rtol=tolerance, atol=tolerance, equal_nan=True):
                return False
    return True


def _forward(expr: TorchOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op's forward (also for its backward's expr) on ``tensors``: its tensor results."""
    if expr.target._schema.is_mutable:  # writes its inputs: on copies
        tensors = [t.clone() for t in tensors]
    arguments, keywords = filled_arguments(expr, tensors, tensors[0].device)
    result = expr.target(*arguments, **keywords)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    return [r for r in results if isinstance(r, torch.Tensor)]


def _piece(shape: tuple[int, ...], dim: int | None, parts: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(shape)
    return tuple(e // parts if d == dim else e for d, e in enumerate(shape))


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@cache
def _mesh(parts: int) -> object:
    """A 1-D DeviceMesh of ``parts`` ranks that no process group backs (torch's
    propagator reads its shape only); seen from rank 0 where torch takes the rank."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        return DeviceMesh("cpu", list(range(parts)), _init_backend=False, _rank=0)
    except TypeError:  # a torch without ``_rank``: it asks the default process group
        return DeviceMesh("cpu", list(range(parts)), _init_backend=False)
