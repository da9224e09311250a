"""``MultiDeviceExecutor``: runs a fusion's compiled program on this rank.

Its one job: bind a run's inputs, pick this rank's program for their extents, run it.
Around that, at construction (the same on every rank): the program is compiled
(``overlap.compile``: placed, planned, lowered, kernel params checked), every rank says
whether it could build it and what it will post (``Communicator.agree``), and the
process groups it needs are made (collectively).

A run: the inputs are checked against the fusion on every rank alike
(``overlap.runtime.inputs``: at the first run and whenever a rank's inputs change, one
small host all-gather of their shapes, so a bad input on any rank raises the same
``InputError`` on every rank before any communication starts); this rank's program for
their extents (``overlap.runtime.rank_programs``) runs: kernels, communications,
streams; or is replayed from a CUDA graph (``overlap.runtime.graphs``).

Example (on every rank)::

    executor = MultiDeviceExecutor(fd, Communicator())
    outputs = executor.run(executor.shard_inputs(full_inputs))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fusion.definition import FusionDefinition
from fusion.ir import Fusion, TensorView
from overlap.comm.communicator import Communicator
from overlap.compile.pipeline import CompiledProgram
from overlap.diag.timeline import Timeline
from overlap.ir import HostProgram
from overlap.plan.figures import HardwareFigures
from overlap.plan.planner import OverlapOptions, OverlapPlan
from overlap.runtime import pieces
from overlap.runtime.autograd import refusing_backward, without_grad
from overlap.runtime.build import compile_for_device, is_sharded, planning_figures, rank_device
from overlap.runtime.dtensors import as_dtensors, local_pieces
from overlap.runtime.graphs import GraphReplays
from overlap.runtime.inputs import InputCheck, LocalBinding, check_mode
from overlap.runtime.listeners import OutputListener
from overlap.runtime.rank_program import RankSetup, rank_shape
from overlap.runtime.rank_programs import RankPrograms
from overlap.runtime.streams import StreamPool
from schedulers.hardware import current_hardware


class MultiDeviceExecutor:
    """Runs ``fusion`` (or a ``CompiledProgram``) on this rank as part of every rank
    running it.

    A fusion with no tensor placed on a mesh runs whole on one device (the
    communicator may then be None). ``options`` override the overlap planner and
    ``figures`` feed its cost model (by default this device's: recorded for H100 and
    H200, measured once and kept for another GPU, ``overlap.comm.measure``).

    ``kernels`` chooses how compute segments run: ``"generated"`` (Triton kernels from
    the schedulers wherever one takes the segment; on CPU this needs Triton's
    interpreter, ``TRITON_INTERPRET=1``), ``"reference"`` (the reference evaluator) or
    ``"auto"`` (generated on CUDA, reference elsewhere). ``kernel_params`` overrides the
    heuristics' launch configuration of a kernel by its name (``{"k0": params}``), or
    forces one of its scheduler's strategies, the rest still chosen by the heuristics
    (``{"k0": "warp_specialized"}``; the normalization scheduler has ``"multiwave"`` and
    ``"warp_specialized"``; no fallback: a strategy that cannot run raises);
    ``kernel_report()`` says what each kernel got.

    ``cuda_graph`` (default: on CUDA) replays the program from CUDA graphs
    (``overlap.runtime.graphs``): keyed by the extents (never by buffer addresses, so a
    replay whose inputs' shapes did not change runs no host collective), captured at the
    second call at new extents on every rank at once, replayed after that. A replay's
    outputs are the graph's own memory: the next run overwrites them, and reading one
    then raises a clear error (clone what you keep, or ``run(..., keep_outputs=True)``).
    Parameters, weights kept where they are and other graphs' outputs are read in place;
    other inputs are copied into the graph's buffers. ``cuda_graph=False`` runs every
    call on the lean path (the host issues each step), as runs with a timeline and runs
    on CPU do. Every rank must use the same setting.

    ``output_listener`` (``overlap.runtime.listeners``) hears of each output as a run
    issues the work that makes it, before the run ends (a data-parallel reducer posting a
    gradient's all-reduce while the rest of the backward runs); a graph replays what it
    queued at the capture.
    """

    def __init__(
        self,
        fusion: Fusion | FusionDefinition | CompiledProgram,
        communicator: Communicator | None = None,
        options: OverlapOptions | None = None,
        figures: HardwareFigures | None = None,
        cuda_graph: bool | None = None,
        kernels: str = "auto",
        kernel_params: Mapping[str, object] | None = None,
        output_listener: OutputListener | None = None,
    ) -> None:
        self.communicator = communicator
        self.rank = communicator.rank if communicator else 0
        self.device = rank_device(communicator)
        self.sharded = is_sharded(fusion)
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        figures = planning_figures(fusion, self.device, communicator, figures)  # collective
        try:
            self.compiled = compile_for_device(
                fusion, self.device, communicator, options, figures, kernels, self.cuda_graph,
                kernel_params,
            )  # fmt: skip
            failure = None
        except Exception as error:  # told to the peers first, then raised
            failure = error
        posted = None if failure else self.program.posting_order()
        if self.sharded and communicator is not None:
            # One exchange before any group is created: a rank that could not build its
            # program, or built another one, fails with its peers instead of leaving
            # them waiting in a collective it never posts.
            communicator.agree(failure, "building the program", posted)
        elif failure is not None:
            raise failure
        if communicator is not None:
            communicator.prepare(team for c in self.program.communications for team in c.teams())
        self.fingerprint = self.program.fingerprint(posted)
        setup = RankSetup(self.rank, communicator, self.device, StreamPool(self.device), None,
                          dict(kernel_params or {}), current_hardware(self.device),
                          output_listener)  # fmt: skip
        self._programs = RankPrograms(self.compiled, setup)
        self.graphs = GraphReplays()
        self.replaying = self.cuda_graph and self.device.type == "cuda"  # graphs serve runs
        self._inputs = None
        if self.sharded:
            self._inputs = InputCheck(self.fusion, communicator, self.fingerprint,
                                      self.program.posting_order, self.device)  # fmt: skip
        self._local = LocalBinding(self.fusion, self.device)  # an unplaced fusion's

    # -----------------------------------------------------------------------
    # What users and tests read

    @property
    def fusion(self) -> Fusion:
        """The placed fusion the program runs (communications inserted)."""
        return self.compiled.fusion

    @property
    def program(self) -> HostProgram:
        """The host program every rank runs."""
        return self.compiled.host

    @property
    def overlap(self) -> OverlapPlan:
        """The planner's decisions (iterable)."""
        return self.compiled.plan

    @property
    def figures(self) -> HardwareFigures:
        """The figures the planner planned with."""
        return self.compiled.figures

    @property
    def communications(self) -> list:
        return self.program.communications

    def explain(self) -> str:
        """Which rule placed each tensor (see ``sharding.explain``)."""
        return self.compiled.explain()

    def explain_overlap(self, timeline: Timeline | None = None) -> str:
        """The planner's choices, with reasons and predicted times; with the ``timeline``
        of a run, what each pattern measured on this rank against its limit, and loudly
        where a planned overlap did not happen (``overlap.plan.roof``)."""
        return self.compiled.explain_overlap(timeline.spans() if timeline else None)

    def kernel_report(self) -> str:
        """Each generated kernel's scheduler and launch configuration (after a first run)."""
        return self._programs.kernel_report()

    @property
    def chosen_params(self) -> dict[str, object]:
        """Each generated kernel's launch configuration, as last chosen (after a run)."""
        return self._programs.chosen_params()

    def local_shape(self, tensor: TensorView) -> list[int]:
        """This rank's shape of ``tensor`` when every extent is static."""
        return rank_shape(tensor, self.rank, {})

    # -----------------------------------------------------------------------
    # Whole tensors and pieces (``overlap.runtime.pieces``)

    def shard_inputs(
        self, full_inputs: Sequence[torch.Tensor], check: bool = True
    ) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs (see ``pieces.shard_inputs``; collective
        with ``check``)."""
        return pieces.shard_inputs(self.fusion.inputs, full_inputs, self.communicator, check)

    def shard_outputs(self, full_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs: what ``run`` should return here."""
        return pieces.rank_pieces(self.fusion.outputs, full_outputs, self.rank)

    def gather_outputs(self, local_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The whole outputs from every rank's pieces (see ``pieces.gather_outputs``;
        collective: call on every rank)."""
        if not self.sharded:
            return list(local_outputs)
        return pieces.gather_outputs(self.fusion, local_outputs, self.communicator, self.device)

    # -----------------------------------------------------------------------
    # Running

    def run(
        self,
        local_inputs: Sequence[torch.Tensor | None],
        timeline: Timeline | None = None,
        check_inputs: bool | str = "changes",
        keep_outputs: bool = False,
    ) -> list[torch.Tensor | None]:
        """Run the program on this rank; returns this rank's output pieces (None off-mesh).

        An input may be a DTensor placed as the fusion places that input (checked, then
        its local piece is used; ``overlap.runtime.dtensors``); outputs on a mesh such
        inputs came on are then DTensors too. With a ``timeline``, every kernel and
        communication is recorded per stream (on the lean path; every rank must pass one
        alike). ``check_inputs`` says when the ranks exchange their inputs' shapes so that
        a bad input fails everywhere before any collective: ``"changes"`` (default),
        ``"always"`` (or True) or ``"never"`` (or False), as
        ``overlap.runtime.inputs.check_mode`` says. Every rank must use the same setting.
        ``keep_outputs``: outputs replayed from a graph are copied out of its memory, so
        that later runs leave them be.
        """
        fusion = self.compiled.fusion
        local_inputs, torch_meshes = local_pieces(fusion, local_inputs)
        bindings = self._bind(local_inputs, check_mode(check_inputs))
        self._programs.next_run()
        rank_program = self._programs.get(bindings)
        outputs = None
        if self.replaying and timeline is None:
            # no autograd graph: its gradients would be one rank's
            key = (self._programs.key(bindings), self._programs.parity)
            outputs = without_grad(self.graphs.run, key, rank_program, local_inputs,
                                   keep_outputs)  # fmt: skip
        if outputs is None:
            outputs = without_grad(rank_program.run, local_inputs, timeline)
        return as_dtensors(refusing_backward(outputs, local_inputs), fusion, torch_meshes)

    def graph_memory(self) -> dict[tuple, int]:
        """Bytes each CUDA graph kept holds, by its key (extents, copy-engine half)."""
        return self.graphs.memory()

    def _bind(self, local_inputs, mode: str):
        """The run's extents (checked with every rank where sharded)."""
        if not self.sharded:
            if mode == "never" and self._local.bindings is not None:
                return self._local.bindings
            return self._local(local_inputs)
        return self._inputs.bindings(local_inputs, mode)
