"""The interface every scheduler implements, and what its launches are.

A scheduler (pointwise, reduction, normalization) turns a group of exprs into
generated kernels in four steps, each a method of the ``Scheduler`` protocol:

1. ``plan(exprs, inputs, outputs)``: analyse the group, independent of extents, or
   raise ``NotSchedulable`` with the reason (the registry then tries the next one);
2. ``heuristics(plan, hardware, shape, strategy)``: the params (a frozen, printable
   dataclass) for the shape of the plan's iteration space (``plan.space``);
   ``configure`` is the same for the local shapes an executor knows;
3. ``kernels(plan, params, shape, aligned)``: the sources of the kernels a launch
   runs, to read or compile without a device (``schedulers.ptx``);
4. ``launcher(plan, params, hardware, local_shape)``: a ``Launcher`` that runs them.

Example (on a CPU, with ``TRITON_INTERPRET=1``)::

    scheduler, plan = group.scheduler, group.plan      # from split_into_kernels
    params = scheduler.configure(plan, INTERPRETER, local_shape)
    launch = scheduler.launcher(plan, params, INTERPRETER, local_shape)
    launch(inputs, outputs, shapes)
    launch.forms()                                      # ["general"]
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from fusion.exprs import Expr
from fusion.ir import TensorView
from schedulers.hardware import HardwareProfile

if TYPE_CHECKING:
    import torch

# The shape of a tensor on this rank (its local piece), as the executor knows it.
LocalShape = Callable[[TensorView], list[int]]
# The logical shape of each tensor of a launch.
Shapes = Mapping[TensorView, list[int]]
# A launch bound to its shapes (``Launcher.bind``): ``launch(inputs, targets)``.
BoundLaunch = Callable[[list["torch.Tensor"], list["torch.Tensor"]], None]


class Plan(Protocol):
    """What a scheduler's analysis says of a group, independent of extents."""

    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]

    @property
    def space(self) -> TensorView:
        """A tensor whose shape is the iteration space: the shape heuristics take."""
        ...


PlanT = TypeVar("PlanT", bound=Plan)
ParamsT = TypeVar("ParamsT")


@dataclass(frozen=True)
class KernelSource:
    """One kernel a launch runs, as text: enough to compile it without a device."""

    name: str  # the jitted function in ``source``
    source: str
    constants: dict[str, int]  # its ``tl.constexpr`` arguments
    num_warps: int
    pointers: dict[str, str]  # pointer argument -> the Triton type of its elements
    options: dict = field(default_factory=dict)  # compile options beyond COMPILE_OPTIONS


class Launcher(ABC):
    """Runs the generated kernels of one scheduled group:
    ``launch(inputs, targets, shapes)`` reads ``inputs`` and writes ``targets`` (both
    contiguous, in the plan's order), ``shapes`` giving each tensor's logical shape."""

    @abstractmethod
    def __call__(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], shapes: Shapes
    ) -> None: ...

    def bind(self, shapes: Shapes) -> BoundLaunch:
        """The launch for these ``shapes``: ``bind(shapes)(inputs, targets)`` is
        ``launch(inputs, targets, shapes)``, with what depends on the shapes alone (grids,
        constants) worked out once, for a caller launching the same shapes again and
        again. By default nothing is: the launcher itself is called."""
        return functools.partial(self.__call__, shapes=shapes)

    @abstractmethod
    def forms(self) -> list[str]:
        """The forms of its kernels that have run: ``"aligned"``, ``"general"``
        (``schedulers.cache.AlignedVariants``); none for kernels with one form."""


def launch_nothing(*_) -> None:
    """The bound launch of kernels over no element (``Launcher.bind``): nothing runs."""


class Scheduler(Protocol[PlanT, ParamsT]):
    """A scheduler: ``name`` (as host programs print it), the ``strategies`` a user
    may force by name (``kernel_params={"k0": "tma"}``; empty when it has one way to
    build its kernels), and the four steps of the module's docstring."""

    name: str
    strategies: tuple[str, ...]

    def plan(self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]) -> PlanT:
        """The analysis of ``exprs``; raises ``NotSchedulable`` saying why it does not
        take them."""
        ...

    def heuristics(
        self, plan: PlanT, hardware: HardwareProfile, shape: list[int], strategy: str | None = None
    ) -> ParamsT:
        """The params for ``plan.space`` of ``shape`` on ``hardware``. ``strategy`` (one
        of ``strategies``) forces one and raises ``NotSchedulable`` where it cannot be
        built; None (or ``"auto"``) lets the heuristics choose."""
        ...

    def configure(
        self,
        plan: PlanT,
        hardware: HardwareProfile,
        local_shape: LocalShape,
        strategy: str | None = None,
    ) -> ParamsT:
        """``heuristics`` for the local shapes ``local_shape(tensor)`` gives."""
        return self.heuristics(plan, hardware, local_shape(plan.space), strategy)

    def kernels(
        self, plan: PlanT, params: ParamsT, shape: list[int], aligned: bool = False
    ) -> list[KernelSource]:
        """The kernels a launch for ``plan.space`` of ``shape`` runs, in order;
        ``aligned``: their form for pitches that are multiples of ``ALIGN_ELEMENTS``."""
        ...

    def launcher(
        self, plan: PlanT, params: ParamsT, hardware: HardwareProfile, local_shape: LocalShape
    ) -> Launcher:
        """A launcher of ``plan``'s kernels with ``params``."""
        ...


def check_strategy(scheduler: Scheduler, strategy: str | None) -> str | None:
    """``strategy`` if ``scheduler`` has it, None for the heuristics' choice (None or
    ``"auto"``); ``ValueError`` naming the strategies otherwise."""
    if strategy in (None, "auto"):
        return None
    if strategy not in scheduler.strategies:
        names = ", ".join(repr(name) for name in ("auto", *scheduler.strategies))
        raise ValueError(f"strategy {strategy!r}: one of {names}")
    return strategy
