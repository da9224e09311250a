"""``parallelize``: a PyTorch module run over the ranks as an overlapped, trainable program.

The module is captured (``fusion.capture``), its parameters placed by a plan in the
vocabulary of PyTorch's tensor parallelism, and run by a ``TrainableFusion``: forward
and backward are the framework's host programs on every rank. The plan maps submodule
names to a style:

- ``"colwise"`` (``ColwiseParallel``): the weight's rows (output features) split, a bias
  split alike;
- ``"rowwise"`` (``RowwiseParallel``): the weight's columns (input features) split, a
  bias whole;
- an ``nn.Embedding``, as torch's styles place it: ``"rowwise"`` splits the vocabulary
  (each rank looks up the rows it holds; the lookups are summed), ``"colwise"`` the
  features;
- ``"sequence"``: parameters whole, the submodule's inputs and outputs split along the
  first axis (the tokens of [tokens, hidden] activations);
- unnamed parameters (norm weights, ...) whole on every rank.

torch's style objects are read as torch's ``parallelize_module`` reads them:
``ColwiseParallel`` and ``RowwiseParallel`` place their outputs as ``output_layouts``
says (a row-wise projection's ``Shard(1)``: a reduce-scatter into the sequence split,
its default ``Replicate()``: an all-reduce); ``SequenceParallel`` splits its inputs and
outputs along ``sequence_dim`` (torch's default 1: [batch, seq, hidden]);
``PrepareModuleInput``/``PrepareModuleOutput``/``PrepareModuleInputOutput`` place a
submodule's inputs/outputs as their ``desired_*_layouts`` say. A style's
``input_layouts`` (``SequenceParallel``'s sequence split alike) say how the caller's
piece of a module input it reads is cut, as torch's ``from_local`` reads it: the
outermost style reading that input decides (a submodule inside it is handed a DTensor
in torch). ``use_local_output`` changes no placement: the ops here compute on whole
tensors, so a DTensor handed on and its local piece are placed alike.

``inputs`` and ``outputs`` give each example input's and output's placement:
``"replicate"``, ``"sequence"`` (split along the first axis, as above), or torch's or our
``Shard(dim)`` (any axis, negative ones from the last) and ``Replicate()``; None leaves
one unplaced. An input neither they nor the plan place is whole. An output no one places
comes back as torch's ``parallelize_module`` returns it: this rank's piece of the layout
the plan gives it (propagated through the ops after the last placed tensor; a partial
sum is all-reduced), never gathered unasked: a [batch, seq, hidden] block under torch's
sequence-parallel plan returns its ``Shard(1)`` piece. Two different placements asked
for one tensor are refused. Sharding propagates the rest and inserts the communications
(a sequence-parallel block's all-gather and reduce-scatter, pipelined with its matmuls
where the planner finds it pays).

The result is an ``nn.Module``: ``forward`` takes this rank's pieces of the inputs and
returns its pieces of the outputs, for the example inputs' shapes only (torch.export's
static shapes); an input error names the argument as ``forward``'s signature does. Its
parameters are DTensors on a torch ``DeviceMesh`` of the ranks (``dtensors=True``, the
default where torch.distributed is initialized): their local pieces are this rank's,
their placements the plan's, so optimizers, gradient clipping and
``torch.distributed.checkpoint`` treat them as tensor-parallel parameters; with
``dtensors=False`` they are the plain pieces. An uneven split that DTensor would cut
otherwise (``overlap.runtime.dtensors.torch_split_differs``) is refused, naming the
parameter. ``full_state(module)`` hands this rank's pieces of an unparallelized module's
state, to load or compare.

Size: the module, its plan in torch's vocabulary (every style torch has, read as
``parallelize_module`` reads it) and its errors in the module's words are one reading
of one call; splitting the plan's reading off waits for the branches of #47 that edit
this file to merge.

Example (on every rank)::

    block = parallelize(SwiGLU(4096, 14336), [x], communicator,
                        plan={"gate": "colwise", "up": "colwise", "down": "rowwise"},
                        inputs=["sequence"], outputs=["sequence"])
    y_piece = block(x_piece)
    y_piece.square().sum().backward()
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fusion import ops
from fusion.capture import Boundary, Captured, capture
from fusion.errors import InputError
from overlap.comm.communicator import Communicator
from overlap.runtime.dtensors import is_dtensor, torch_placement, torch_split_differs
from overlap.runtime.inputs import check_same_on_every_rank
from overlap.runtime.pieces import shard_inputs
from overlap.train.trainable import TrainableFusion
from schedulers.runtime import contiguous_strides
from sharding import DeviceMesh, Replicate, Shard, shard
from sharding.annotate import as_placement
from sharding.layout import layout_of
from sharding.pieces import local_piece
from sharding.propagation import moved_inputs

STYLES = ("colwise", "rowwise", "sequence")
PLACEMENTS = ("replicate", "sequence")


class ParallelModule(torch.nn.Module):
    """A captured module run by a ``TrainableFusion`` (see the module)."""

    def __init__(
        self,
        model: TrainableFusion,
        names: list[str],
        pieces: list[torch.Tensor],
        buffers: frozenset[str] = frozenset(),
        torch_mesh: object | None = None,
        input_names: Sequence[str] = (),
        captured_from: str = "the module",
    ) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.torch_mesh = torch_mesh  # where the parameters are DTensors (None: pieces)
        # forward's inputs as its signature names them, for errors in the module's words
        count = len(model.fusion.inputs) - len(names)
        self.input_names = [*input_names, *(f"input {i}" for i in range(len(input_names),
                                                                         count))]  # fmt: skip
        self.captured_from = captured_from
        tensors = model.fusion.inputs
        self.pieces = torch.nn.ParameterDict(
            {_key(name): torch.nn.Parameter(self._as_dtensor(piece, tensor))
             for name, piece, tensor in zip(names, pieces, tensors, strict=False)
             if name not in buffers}
        )  # fmt: skip
        self.buffer_pieces = {
            _key(n): p for n, p in zip(names, pieces, strict=True) if n in buffers
        }
        for key, piece in self.buffer_pieces.items():
            self.register_buffer(key, piece)

    def _as_dtensor(self, piece: torch.Tensor, tensor) -> torch.Tensor:
        if self.torch_mesh is None:
            return piece
        from torch.distributed.tensor import DTensor

        placements = [torch_placement(p) for p in layout_of(tensor).placements]
        shape = torch.Size(int(e) for e in tensor.shape)
        return DTensor.from_local(piece, self.torch_mesh, placements, run_check=False,
                                  shape=shape, stride=contiguous_strides(shape))  # fmt: skip

    def forward(self, *local_inputs: torch.Tensor):
        parameters = [
            _local(self.pieces[_key(n)]) if _key(n) in self.pieces else getattr(self, _key(n))
            for n in self.names
        ]
        try:
            outputs = self.model(*parameters, *local_inputs)
        except InputError as error:
            raise type(error)(self._in_module_terms(str(error))) from error
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _in_module_terms(self, message: str) -> str:
        """An input error of the fusion told in ``forward``'s terms: its inputs by their
        names in its signature (the fusion counts the module's parameters first), and
        the shapes it was captured for (torch.export's: those only)."""
        count, named = len(self.names), []

        def name(match: re.Match) -> str:
            position = int(match.group(1))
            if position < count:
                return f"parameter {self.names[position]}"
            named.append(position - count)
            return self._describe_input(position - count)

        message = re.sub(r"\binput (\d+)( \([^()]*\))?", name, message)
        message = re.sub(r"the fusion takes (\d+) inputs, got (\d+)",
                         lambda m: f"forward takes {int(m.group(1)) - count} inputs "
                                   f"({', '.join(self.input_names)}), got "
                                   f"{int(m.group(2)) - count}", message)  # fmt: skip
        tensors = self.model.fusion.inputs[count:]
        if not named or not all(isinstance(e, int) for t in tensors for e in t.shape):
            return message  # not about an input, or shapes that may change
        shapes = ", ".join(f"{n} {list(t.shape)}"
                           for n, t in zip(self.input_names, tensors, strict=True))  # fmt: skip
        return (f"{message}. parallelize captured {self.captured_from} for its example "
                f"inputs' whole shapes only ({shapes}): parallelize it again with examples "
                "of other shapes")  # fmt: skip

    def _describe_input(self, index: int) -> str:
        return f"{self.input_names[index]} (forward's argument {index})"

    def full_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's pieces of ``module``'s parameters and buffers (or of tensors of
        their shapes, ``{name: tensor}``: their gradients, say), by name."""
        state = module if isinstance(module, Mapping) else {
            **dict(module.named_parameters()), **dict(module.named_buffers())
        }  # fmt: skip
        rank, tensors = self.model.communicator.rank, self.model.fusion.inputs
        return {name: local_piece(state[name].detach(), tensor, rank)
                for name, tensor in zip(self.names, tensors, strict=False)
                if name in state}  # fmt: skip

    def input_pieces(self, *whole: torch.Tensor) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs of ``forward`` (collective with several ranks:
        every rank must be given the same whole inputs, see ``shard_inputs``)."""
        tensors = self.model.fusion.inputs[len(self.names) :]
        names = [self._describe_input(i) for i in range(min(len(whole), len(tensors)))]
        return shard_inputs(tensors, whole, self.model.communicator, names=names,
                            step="input_pieces")  # fmt: skip

    def output_pieces(self, *whole: torch.Tensor) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs of ``forward``."""
        return self.model.shard_outputs(list(whole))


def parallelize(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    communicator: Communicator,
    plan: Mapping[str, Any],
    inputs: Sequence[object] = (),
    outputs: Sequence[object] = (),
    dtensors: bool | None = None,
    **trainable_options: Any,
) -> ParallelModule:
    """``module`` over ``communicator``'s ranks by ``plan`` (see the module); parameters as
    DTensors unless ``dtensors`` is False (None: where torch.distributed is initialized);
    the other options go to ``TrainableFusion`` (``saved``, ``kernels``, ``cuda_graph``,
    ...)."""
    captured = place(module, example_inputs, communicator.world_size, plan, inputs, outputs)
    fusion = captured.fd.fusion
    if dtensors is None:
        dtensors = dist.is_available() and dist.is_initialized()
    if dtensors:
        for name, tensor in zip(captured.parameter_names, fusion.inputs, strict=False):
            differs = torch_split_differs(layout_of(tensor), [int(e) for e in tensor.shape])
            if differs and name not in captured.buffers:
                raise ValueError(f"parallelize: parameter {name}: {differs} (or pass "
                                 "dtensors=False for plain pieces)")  # fmt: skip
    buffers = [i for i, n in enumerate(captured.parameter_names) if n in captured.buffers]
    trainable_options.setdefault("frozen", buffers)  # buffers get no gradient
    model = TrainableFusion(captured.fd, communicator, **trainable_options)
    _warn_moved_parameters(model, captured.parameter_names)
    # copies: a whole replicated weight's piece is the tensor itself, which an optimizer
    # stepping the pieces would change under the module it came from
    rank, device, state = communicator.rank, communicator.device, captured.inputs(module)
    if communicator.world_size > 1:  # every rank cuts its pieces from its own module
        check_same_on_every_rank(captured.parameter_names, state[: len(captured.parameter_names)],
                                 communicator.input_check_exchange, "parallelize")  # fmt: skip
    pieces = [local_piece(value, tensor, rank).to(device).clone()
              for value, tensor in zip(state, fusion.inputs, strict=False)]  # fmt: skip
    torch_mesh = None
    if dtensors:
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        torch_mesh = TorchMesh(communicator.device.type, list(range(communicator.world_size)))
    return ParallelModule(model, captured.parameter_names, pieces, captured.buffers, torch_mesh,
                          _argument_names(module, len(example_inputs)),
                          type(module).__name__)  # fmt: skip


def _warn_moved_parameters(model: TrainableFusion, names: Sequence[str]) -> None:
    """Warn, once for the module, where the forward moves a parameter the plan split (a
    rule that cannot use it where it is placed): each step then pays to move a weight,
    which tensor parallelism is meant to leave in place."""
    executor = model.forward_executor
    position = {tensor: index for index, tensor in enumerate(executor.fusion.inputs)}
    moved = [
        f"{names[position[c.inputs[0]]]} ({c.kind.value} to "
        f"[{', '.join(str(p) for p in c.out_layout.placements)}])"
        for c in moved_inputs(executor.fusion)
        if position[c.inputs[0]] < len(names)
    ]
    if moved:
        warnings.warn(
            f"parallelize: the forward moves parameters the plan placed, every step: "
            f"{', '.join(moved)}; the module's model.forward_executor.explain() says which op "
            "needs each placed otherwise",
            stacklevel=3,
        )


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
        shard(tensor, mesh, [_parameter_placement(style, kind, tensor.ndim, owner_module)])
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


def _argument_names(module: torch.nn.Module, count: int) -> list[str]:
    """The names ``module.forward``'s signature gives its first ``count`` positional
    arguments (``args[i]`` past a ``*args``)."""
    names = []
    for parameter in inspect.signature(module.forward).parameters.values():
        if parameter.kind == parameter.VAR_POSITIONAL:
            names += [f"{parameter.name}[{i}]" for i in range(count - len(names))]
        elif parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return names[:count]


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local piece (differentiable: its gradient comes back as a
    DTensor placed alike), a plain one as it is."""
    return _LocalPiece.apply(parameter) if is_dtensor(parameter) else parameter


class _LocalPiece(torch.autograd.Function):
    """A DTensor parameter's local piece, as ``DTensor.to_local``, its gradient placed as
    the parameter, from the parameter's own spec. ``to_local``'s backward derives and
    checks a spec again at every step (``DTensor.from_local``): about 0.45 ms of host time
    a parameter a step on a CPU host, most of a replayed training step's host time. The
    pieces and their gradients are contiguous, so the parameter's spec (its global
    strides) holds for the gradient."""

    @staticmethod
    def forward(ctx, parameter):
        ctx.spec = parameter._spec
        local = parameter._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        # a copy of the spec, as torch's own backward makes: sharding propagation may
        # change a spec in place
        return DTensor(grad.contiguous(), copy.copy(ctx.spec), requires_grad=False)


def _key(name: str) -> str:
    return name.replace(".", "__")
