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
state, to load or compare. Dropout in training mode draws its masks from a seed
(``fusion.random``): ``seed=`` (default ``torch.initial_seed()``, checked the same on
every rank) at the first call, one more each call; the backward reads its forward's.

``data_parallel=dp`` makes a 2-D mesh: ``dp`` replicas, each over a tensor-parallel team of
``world_size // dp`` consecutive ranks (``Communicator.split``; ``team.replica`` says
which), each fed its own batch. The parameters are DTensors on a torch ``DeviceMesh``
("dp", "tp"), replicated over "dp"; their gradients are averaged over the replicas while
the backward runs (``overlap.train.data_parallel.GradientReducer``: buckets of
``bucket_mb`` MiB, each posted by the backward program as soon as it has issued the
bucket's last gradient, beside the rest of the backward, all waited before the program
returns), so an optimizer's step after ``backward()`` keeps the replicas equal.

The plan is read, and the captured module's tensors placed, by
``overlap.train.plans`` (``place``).

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
from typing import Any

import torch
import torch.distributed as dist

from fusion.capture import seed_tensor
from fusion.errors import InputError
from fusion.ir import Fusion
from overlap.comm.communicator import Communicator
from overlap.runtime.dtensors import is_dtensor, torch_placement, torch_split_differs
from overlap.runtime.inputs import check_same_on_every_rank
from overlap.runtime.listeners import production_order
from overlap.runtime.pieces import shard_inputs
from overlap.train.data_parallel import DEFAULT_BUCKET_MB, GradientReducer, ProgramReducer
from overlap.train.plans import place
from overlap.train.trainable import TrainableFusion
from schedulers.runtime import contiguous_strides
from sharding.layout import layout_of
from sharding.pieces import local_piece
from sharding.propagation import moved_inputs


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
        seed: int | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.torch_mesh = torch_mesh  # where the parameters are DTensors (None: pieces)
        # dropout's seed input (the fusion's last): ``seed`` at the first call, then one
        # more each call, the same on every rank; the backward reads the forward's
        self.seed, self.calls = seed, 0
        # forward's inputs as its signature names them, for errors in the module's words
        count = len(model.fusion.inputs) - len(names) - (seed is not None)
        self.input_names = [*input_names, *(f"input {i}" for i in range(len(input_names),
                                                                         count))]  # fmt: skip
        if seed is not None:
            self.input_names.append("dropout's seed")
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
        team = model.communicator
        # the gradients averaged over the data-parallel replicas during the backward,
        # each bucket posted by the backward program as it issues its last gradient
        self.gradient_reducer = (
            GradientReducer(list(self.pieces.values()), team.replica_group, team.replicas,
                            bucket_mb)
            if team.replicas > 1 else None
        )  # fmt: skip
        if self.gradient_reducer is not None:
            model.backward_listener = self._gradient_listener

    def _gradient_listener(self, wrt: tuple[int, ...], backward: Fusion) -> ProgramReducer:
        """The reducer's listener of the ``backward`` fusion for the inputs at ``wrt``: its
        outputs are their gradients, a parameter's (this module's first inputs) reduced,
        bucketed in the order the backward makes them."""
        parameters = [
            self.pieces[_key(self.names[i])]
            if i < len(self.names) and _key(self.names[i]) in self.pieces else None
            for i in wrt
        ]  # fmt: skip
        return self.gradient_reducer.listener(parameters, production_order(backward))

    def _as_dtensor(self, piece: torch.Tensor, tensor) -> torch.Tensor:
        if self.torch_mesh is None:
            return piece
        from torch.distributed.tensor import DTensor, Replicate

        placements = [torch_placement(p) for p in layout_of(tensor).placements]
        # replicated over the axes before the plan's (the data-parallel one)
        placements = [Replicate()] * (self.torch_mesh.ndim - len(placements)) + placements
        shape = torch.Size(int(e) for e in tensor.shape)
        return DTensor.from_local(piece, self.torch_mesh, placements, run_check=False,
                                  shape=shape, stride=contiguous_strides(shape))  # fmt: skip

    def forward(self, *local_inputs: torch.Tensor):
        parameters = [
            _local(self.pieces[_key(n)]) if _key(n) in self.pieces else getattr(self, _key(n))
            for n in self.names
        ]
        if self.seed is not None:
            seed = seed_tensor(self.seed + self.calls, self.model.communicator.device)
            local_inputs = (*local_inputs, seed)
            self.calls += 1
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
        if self.seed is not None:  # the seed: made by forward
            tensors = tensors[:-1]
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
    seed: int | None = None,
    data_parallel: int = 1,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    **trainable_options: Any,
) -> ParallelModule:
    """``module`` over ``communicator``'s ranks by ``plan`` (see the module); parameters as
    DTensors unless ``dtensors`` is False (None: where torch.distributed is initialized);
    ``seed``: dropout's at the first call, one more each call (None: ``torch.initial_seed()``,
    which must then be the same on every rank); ``data_parallel``: replicas of the
    tensor-parallel team, each ``world_size // data_parallel`` consecutive ranks
    (``communicator.split``), their gradients averaged during the backward in buckets of
    ``bucket_mb`` MiB; the other options go to ``TrainableFusion`` (``saved``,
    ``kernels``, ``cuda_graph``, ...)."""
    if data_parallel < 1 or communicator.world_size % data_parallel:
        raise ValueError(f"parallelize: {communicator.world_size} ranks do not make "
                         f"{data_parallel} data-parallel replicas")  # fmt: skip
    world = communicator
    if data_parallel > 1:
        communicator = world.split(world.world_size // data_parallel)
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
    if not captured.seeded:
        seed = None
    elif seed is None:
        seed = torch.initial_seed()
    if world.world_size > 1:  # every rank cuts its pieces from its own module
        names, values = captured.parameter_names, state[: len(captured.parameter_names)]
        if seed is not None:  # and draws dropout's masks from the same seed
            names = [*names, "dropout's seed (torch.initial_seed(), or parallelize's seed=)"]
            values = [*values, seed_tensor(seed)]
        check_same_on_every_rank(names, values, world.input_check_exchange,
                                 "parallelize")  # fmt: skip
    pieces = [local_piece(value, tensor, rank).to(device).clone()
              for value, tensor in zip(state, fusion.inputs, strict=False)]  # fmt: skip
    torch_mesh = _torch_mesh(communicator) if dtensors else None
    return ParallelModule(model, captured.parameter_names, pieces, captured.buffers, torch_mesh,
                          _argument_names(module, len(example_inputs)),
                          type(module).__name__, seed, bucket_mb)  # fmt: skip


def _torch_mesh(team: Communicator):
    """torch's ``DeviceMesh`` of the ranks: 1-D over the tensor-parallel team, or 2-D
    ("dp", "tp") over its replicas, on the communicator's own groups."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    if team.replicas == 1:
        return TorchMesh(team.device.type, list(range(team.world_size)))
    whole = team.group(tuple(range(team.world_size)))
    ranks = torch.arange(team.replicas * team.world_size).reshape(team.replicas, -1)
    return TorchMesh.from_group([team.replica_group, whole], team.device.type, ranks,
                                mesh_dim_names=("dp", "tp"))  # fmt: skip


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
