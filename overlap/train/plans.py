"""A tensor-parallel plan read as torch's ``parallelize_module`` reads it, and a captured
module's tensors placed by it (``place``): what ``overlap.train.parallelize`` runs, and
``overlap dump`` compiles for a module without a process group.

A plan maps submodule names to a style, ours (``"colwise"``, ``"rowwise"``,
``"sequence"``) or torch's objects (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``, ``PrepareModuleOutput``,
``PrepareModuleInputOutput``); ``overlap.train.parallelize``'s docstring says what each
places.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusion import ops
from fusion.capture import Boundary, Captured, capture
from sharding import DeviceMesh, Replicate, Shard, pin, shard
from sharding.annotate import as_placement

STYLES = ("colwise", "rowwise", "sequence")
PLACEMENTS = ("replicate", "sequence")


def place(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    world_size: int,
    plan: Mapping[str, Any],
    inputs: Sequence[object] = (),
    outputs: Sequence[object] = (),
) -> Captured:
    """``module`` captured and its fusion's tensors placed over ``world_size`` ranks by
    ``plan``, as ``parallelize`` places them (no process group needed: what ``overlap
    dump`` compiles for a module)."""
    styles = {name: _read_style(name, style) for name, style in plan.items()}
    captured = capture(module, example_inputs)
    fusion = captured.fd.fusion
    mesh = DeviceMesh(world_size)
    owners = {name.rsplit(".", 1)[0] if "." in name else "" for name in captured.parameter_names}
    unknown = sorted(
        name for name, style in styles.items()
        if name not in (owners if style.parameters else {*owners, *captured.boundaries})
    )  # fmt: skip
    if unknown:
        raise ValueError(f"parallelize: the plan names {unknown}, which hold no parameters "
                         f"of the module; submodules with parameters: {sorted(owners)}"
                         )  # fmt: skip
    count = len(captured.parameter_names)
    for name, tensor in zip(captured.parameter_names, fusion.inputs[:count], strict=True):
        owner, kind = name.rsplit(".", 1) if "." in name else ("", name)
        owner_module = module.get_submodule(owner) if owner else module
        style = styles[owner].parameters if owner in styles else None
        # pinned: computed with where the plan puts them, never gathered to save moving
        # an activation (torch's styles move activations only)
        pin(tensor, mesh, [_parameter_placement(style, kind, tensor.ndim, owner_module)])
    # the placements asked for, tensor -> (placement, who asked): first as given (the
    # inputs) or produced (submodules' outputs), then as consumed (a submodule's inputs:
    # a tensor produced otherwise is copied for it, the copy placed as it needs)
    placed: dict = {}
    module_inputs = fusion.inputs[count:]
    for position, (tensor, placement) in enumerate(zip(module_inputs, inputs, strict=False)):
        _place(placed, tensor, _placement(placement), f"parallelize's inputs[{position}]")
    # the module's own inputs as the outermost style reading each reads the caller's
    # piece (torch's from_local: a submodule inside it is handed a DTensor already)
    read_by: dict = {}
    for name in sorted(styles, key=lambda name: name.count(".")):
        for position, tensor in enumerate(_boundary(captured, name).reads):
            given = _nth(styles[name].given, position)
            outer = any(name.startswith(f"{other}.") for other in read_by.get(tensor, ()))
            if tensor in module_inputs and given is not None and not outer:
                _place(placed, tensor, given, f"{name}'s input_layouts")
                read_by.setdefault(tensor, []).append(name)
    for name, style in styles.items():
        for position, tensor in enumerate(_boundary(captured, name).hands):
            _place(placed, tensor, _nth(style.outputs, position), f"{name}'s output {position}")
    for position, (tensor, placement) in enumerate(zip(fusion.outputs, outputs, strict=False)):
        _place(placed, tensor, _placement(placement), f"parallelize's outputs[{position}]")
    for name, style in styles.items():
        boundary = _boundary(captured, name)
        for position, tensor in enumerate(boundary.reads):
            wanted = _nth(style.inputs, position)
            if wanted is None:
                continue
            ours = as_placement(wanted, tensor.ndim)
            if tensor in placed and placed[tensor][0] != ours:
                tensor = _copy_for(fusion, tensor, boundary.exprs)
                if tensor is None:  # no op of the submodule reads it: nothing to place
                    continue
            _place(placed, tensor, ours, f"{name}'s input {position}")
    # an input nobody places is whole; an output the plan leaves free takes the layout
    # propagation gives it (a partial sum all-reduced): what torch's parallelize_module
    # returns is that layout's local piece, never a gather it did not ask for
    for tensor in module_inputs:
        placed.setdefault(tensor, (Replicate(), "the default"))
    for tensor, (placement, _) in placed.items():
        shard(tensor, mesh, [as_placement(placement, tensor.ndim)])
    return captured


@dataclass(frozen=True)
class _Style:
    """A plan entry: how its parameters split (None: whole), the placements its inputs
    must take as it consumes them, its outputs as it hands them out, and its inputs as
    they arrive (torch's ``input_layouts``: how a piece the caller passes is read, so
    only the module's own inputs take it). None: free; a placement alone: every one."""

    parameters: str | None = None
    inputs: object = None
    outputs: object = None
    given: object = None


def _read_style(name: str, style: Any) -> _Style:
    """A plan entry read as torch's ``parallelize_module`` reads it. torch's
    ``use_local_output`` changes no placement: a DTensor handed on is placed as its
    local piece is, and our ops compute on the whole tensors either way."""
    kind = style if isinstance(style, str) else type(style).__name__
    if kind in ("colwise", "rowwise"):
        return _Style(kind)
    if kind == "sequence":
        return _Style(None, Shard(0), Shard(0))
    if kind in ("ColwiseParallel", "RowwiseParallel"):
        return _Style(kind[:3].lower() + "wise", None, list(style.output_layouts),
                      list(style.input_layouts))  # fmt: skip
    if kind == "SequenceParallel":
        (placement,) = style.sequence_sharding
        return _Style(None, placement, placement, placement)
    if kind == "PrepareModuleInput":
        return _prepared_inputs(name, style)
    if kind == "PrepareModuleOutput":
        # output_layouts says what the submodule computes: propagation knows that
        return _Style(None, None, list(style.desired_output_layouts))
    if kind == "PrepareModuleInputOutput":
        inputs = _prepared_inputs(name, style.prepare_module_input)
        outputs = list(style.prepare_module_output.desired_output_layouts)
        return _Style(None, inputs.inputs, outputs, inputs.given)
    raise ValueError(
        f"parallelize: {name}: style {style!r} is not one of {STYLES} (or torch's "
        "ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, "
        "PrepareModuleOutput, PrepareModuleInputOutput)"
    )


def _prepared_inputs(name: str, style: Any) -> _Style:
    if style.input_kwarg_layouts or style.desired_input_kwarg_layouts:
        # a submodule's reads are positional here: a keyword's tensor has no position
        raise ValueError(f"parallelize: {name}: PrepareModuleInput's input_kwarg_layouts "
                         "are not read yet; give the inputs' layouts by position")  # fmt: skip
    if style.input_layouts is None:  # torch leaves the inputs as they come
        return _Style()
    return _Style(None, list(style.desired_input_layouts), None, list(style.input_layouts))


def _boundary(captured, name: str):
    return captured.boundaries.get(name) or Boundary([], [], [])


def _copy_for(fusion, tensor, exprs: list) -> object:
    """A copy of ``tensor`` that ``exprs`` (a submodule's) read instead of it (None when
    none of them reads it)."""
    mine = set(exprs)
    consumers = [e for e in fusion.exprs if e in mine and tensor in e.inputs]
    if not consumers:
        return None
    with fusion.editing():
        copy = ops.set(tensor)
    for consumer in consumers:
        for index, read in enumerate(list(consumer.inputs)):
            if read is tensor:
                fusion.replace_input_at(consumer, index, copy)
    fusion.move_before([copy.definition], consumers[0])
    return copy


def _nth(wanted: object, position: int) -> object:
    if wanted is None or not isinstance(wanted, list):
        return wanted  # free, or one placement for all
    return wanted[position] if position < len(wanted) else None


def _place(placed: dict, tensor, placement: object, who: str) -> None:
    """Record that ``who`` wants ``tensor`` placed so; two different wishes are refused."""
    if placement is None:
        return
    try:
        ours = as_placement(placement, tensor.ndim)
    except ValueError as error:
        raise ValueError(f"parallelize: {who}: {error}") from None
    if isinstance(ours, Shard) and not 0 <= ours.dim < tensor.ndim:
        raise ValueError(f"parallelize: {who} places {tensor} {placement}, but it has "
                         f"{tensor.ndim} axes")  # fmt: skip
    if tensor in placed and placed[tensor][0] != ours:
        raise ValueError(f"parallelize: {who} places {tensor} {ours}, but "
                         f"{placed[tensor][1]} places it {placed[tensor][0]}")  # fmt: skip
    placed.setdefault(tensor, (ours, who))


def _parameter_placement(style: str | None, kind: str, ndim: int, owner: torch.nn.Module):
    if isinstance(owner, torch.nn.Embedding) and style is not None:
        # torch's styles for an embedding: row-wise splits the vocabulary (a partial
        # lookup, summed across ranks), column-wise the features
        return Shard(0) if style == "rowwise" else Shard(1)
    if style == "colwise":
        return Shard(0)  # a weight's rows (output features) and a bias alike
    if style == "rowwise" and kind == "weight" and ndim == 2:
        return Shard(1)
    return Replicate()


def _placement(given: object) -> object:
    """An ``inputs``/``outputs`` entry as a placement: ``"replicate"``, ``"sequence"``
    (the first axis, as it always meant here: [tokens, hidden] activations), torch's or
    our ``Shard(dim)`` and ``Replicate()`` (checked against the tensor by ``_place``), or
    a ``SequenceParallel`` style (its ``sequence_dim``, as torch reads it)."""
    if isinstance(given, str):
        if given not in PLACEMENTS:
            raise ValueError(f"parallelize: placement {given!r} is not one of {PLACEMENTS} "
                             "(or a Shard(dim) or Replicate(), torch's or ours)")  # fmt: skip
        return Shard(0) if given == "sequence" else Replicate()
    if type(given).__name__ == "SequenceParallel":
        (placement,) = given.sequence_sharding
        return placement
    return given
