"""``MultiDeviceExecutor``: runs a fusion's compiled program on this rank.

Construction (the same on every rank): ``overlap.compile.pipeline.compile_program`` places every
tensor, inserts the communications, plans the overlap and lowers the fusion to a host
program; then one exchange in which every rank says whether it could build the program
and what it will post (``Communicator.agree``); then the process groups the program
needs (collectively).

``run(local_inputs)`` first checks every rank's inputs against the fusion: at the first
run, and whenever a rank's inputs change, the ranks exchange their inputs' shapes and
dtypes (one small host all-gather) and each rank checks all of them (``overlap.runtime.inputs``),
so a bad input on any rank raises the same ``InputError`` on every rank, before any
communication of the program starts; a run whose inputs are as before asks no one. Then
it runs this rank's
program (``overlap.runtime.rank_program.RankProgram``, built once per set of extents): compute
as generated kernels or with the evaluator on local pieces, communications through
torch.distributed, optionally replayed from a CUDA graph.

Example (on every rank)::

    executor = MultiDeviceExecutor(fd, Communicator())
    outputs = executor.run(executor.shard_inputs(full_inputs))
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from fusion.binding import Bindings
from fusion.definition import FusionDefinition
from fusion.errors import InputError
from fusion.ir import Fusion, TensorView
from fusion.portable import portable, restored
from overlap.comm.communicator import Communicator
from overlap.comm.measure import device_figures
from overlap.comm.symmetric import SymmetricBuffers
from overlap.compile.lowering import lower_to_host_program
from overlap.compile.pipeline import CompiledProgram, compile_program
from overlap.diag.timeline import Timeline
from overlap.ir import HostProgram, Transport
from overlap.plan import roof
from overlap.plan.figures import HardwareFigures
from overlap.plan.planner import OverlapOptions, OverlapPlan
from overlap.runtime.autograd import refusing_backward, without_grad
from overlap.runtime.dtensors import as_dtensors, local_pieces
from overlap.runtime.inputs import (
    InputCheck,
    LocalBinding,
    addresses,
    check_bound_extents,
    check_mode,
    check_same_on_every_rank,
)
from overlap.runtime.rank_program import RankProgram, RankSetup, rank_shape
from overlap.runtime.streams import StreamPool
from schedulers.hardware import current_hardware
from schedulers.runtime import interpreted
from sharding.errors import ShardingError
from sharding.layout import Layout, is_placed, layout_of
from sharding.pieces import assemble, local_piece


class MultiDeviceExecutor:
    """Runs ``fusion`` (or a ``CompiledProgram``) on this rank as part of every rank
    running it.

    A fusion with no tensor placed on a mesh runs whole on one device (the
    communicator may then be None). ``options`` override the overlap planner and
    ``hardware`` feeds its cost model (by default the recorded figures of this
    device kind).

    ``kernels`` chooses how compute segments run: ``"generated"`` (Triton kernels from
    the schedulers wherever one takes the segment; on CPU this needs Triton's
    interpreter, ``TRITON_INTERPRET=1``), ``"reference"`` (the reference evaluator) or
    ``"auto"`` (generated on CUDA, reference elsewhere). ``kernel_params`` overrides the
    heuristics' launch configuration of a kernel by its name (``{"k0": params}``), or
    forces one of its scheduler's strategies, the rest still chosen by the heuristics
    (``{"k0": "warp_specialized"}``; the normalization scheduler has ``"multiwave"`` and
    ``"warp_specialized"``; no fallback: a strategy that cannot run raises);
    ``kernel_report()`` says what each kernel got.

    ``cuda_graph=True`` (CUDA only) captures a run in a CUDA graph the first time it
    sees a set of input buffers and replays it after that, so the host no longer
    issues the program step by step. The outputs are then the graph's own buffers:
    the next run with the same inputs overwrites them (clone what you keep). Every
    rank must use the same setting. It is not the default: a graph holds its
    intermediates' memory for as long as it is kept (one per set of extents and input
    buffers), its outputs are overwritten, and since the ranks must capture together
    every rank's input buffers are exchanged at every run.
    """

    def __init__(
        self,
        fusion: Fusion | FusionDefinition | CompiledProgram,
        communicator: Communicator | None = None,
        options: OverlapOptions | None = None,
        hardware: HardwareFigures | None = None,
        cuda_graph: bool = False,
        kernels: str = "auto",
        kernel_params: dict[str, object] | None = None,
    ) -> None:
        self.communicator = communicator
        self.rank = communicator.rank if communicator else 0
        if communicator is not None:
            self.device = communicator.device
        else:  # one device: the GPU when there is one
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(fusion, CompiledProgram):
            self.sharded = fusion.sharded
        else:
            fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
            self.sharded = is_placed(fusion)
        self.cuda_graph = cuda_graph
        self.kernel_params = dict(kernel_params or {})
        try:
            self.compiled = self._compile(fusion, options, hardware, kernels)
            failure = None
        except Exception as error:  # told to the peers first, then raised
            failure = error
        plan = None if failure else self.program.communication_plan()
        if self.sharded and communicator is not None:
            # One exchange before any group is created: a rank that could not build its
            # program, or built another one, fails with its peers instead of leaving
            # them waiting in a collective it never posts.
            communicator.agree(failure, "building the program", plan)
        elif failure is not None:
            raise failure
        if communicator is not None:
            communicator.prepare(team for c in self.program.communications for team in c.teams())
        self.fingerprint = self.program.fingerprint(plan)
        self._copy_engine = Transport.COPY_ENGINE in self.program.transports()
        self._symmetric: SymmetricBuffers | None = None
        self._streams = StreamPool(self.device)
        self._hardware_profile = current_hardware(self.device)
        self._inputs = None
        if self.sharded:
            self._inputs = InputCheck(self.fusion, communicator, self.fingerprint,
                                      self.program.communication_plan, self.device)  # fmt: skip
        self._local = LocalBinding(self.fusion, self.device)  # an unplaced fusion's
        self._rank_programs: dict[tuple, RankProgram] = {}
        self._extents_key: tuple = (None, ())  # the last bindings run, and their key
        self._graphs: dict[tuple, tuple] = {}

    def _compile(self, fusion, options, hardware, kernels: str) -> CompiledProgram:
        """The compiled program, checked against what this rank runs on; alone."""
        if kernels not in ("auto", "generated", "reference"):
            raise ValueError(f"kernels must be auto, generated or reference, got {kernels!r}")
        if kernels == "generated" and self.device.type != "cuda":
            if not interpreted():
                raise ValueError(
                    "generated kernels on CPU run in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before starting Python"
                )
        if self.sharded and self.communicator is None:
            raise ShardingError("a fusion placed on device meshes needs a Communicator")
        world = self.communicator.world_size if self.communicator else 1
        generated = kernels == "generated" or (kernels == "auto" and self.device.type == "cuda")
        if generated and self.device.type == "cuda" and interpreted():
            raise ValueError("TRITON_INTERPRET=1 would run generated kernels in Triton's CPU "
                             "interpreter, not compiled: unset it on GPUs")  # fmt: skip
        if isinstance(fusion, CompiledProgram):
            compiled = fusion
            if options is not None or hardware is not None:
                raise ValueError(
                    "a CompiledProgram is already planned: give options and hardware to "
                    "compile_program"
                )
            if compiled.schedule != generated:
                raise ValueError(
                    f"kernels={kernels!r} {'generates' if generated else 'evaluates'} compute "
                    f"on {self.device.type}, but the program was compiled with "
                    f"schedule={compiled.schedule}: compile it as this rank runs it"
                )
        else:
            figures = hardware or device_figures(
                self.device, self.communicator if self.sharded else None
            )
            replayed = self.cuda_graph and self.device.type == "cuda"
            compiled = compile_program(fusion, world, options, figures, schedule=generated,
                                       replayed=replayed)  # fmt: skip
        if compiled.world_size > world:
            raise ShardingError(
                f"the program was compiled for {compiled.world_size} ranks; this world has {world}"
            )
        _check_transports(compiled.host, self.device)
        # kernels="auto" off CUDA evaluates instead of generating: the params a user tuned
        # for the generated kernels are checked against those, and left unused here
        for_kernels = compiled.host
        if self.kernel_params and kernels == "auto" and not generated:
            for_kernels = lower_to_host_program(compiled.fusion, compiled.plan, schedule=True)
        _check_kernel_params(self.kernel_params, for_kernels)
        return compiled

    # -----------------------------------------------------------------------
    # What users and tests need around a run

    @property
    def fusion(self) -> Fusion:
        """The placed fusion the program runs (communications inserted)."""
        return self.compiled.fusion

    @property
    def decisions(self) -> dict:
        """Which rule placed each tensor, by tensor (``explain()`` prints them)."""
        return self.compiled.decisions

    @property
    def program(self) -> HostProgram:
        """The host program every rank runs."""
        return self.compiled.host

    @property
    def overlap(self) -> OverlapPlan:
        """The planner's decisions (iterable)."""
        return self.compiled.plan

    @property
    def hardware(self) -> HardwareFigures:
        """The figures the planner planned with."""
        return self.compiled.figures

    @property
    def chosen_params(self) -> dict[str, object]:
        """Each generated kernel's launch configuration, as last chosen (after a run)."""
        chosen: dict[str, object] = {}
        for rank_program in self._rank_programs.values():
            chosen.update(rank_program.chosen_params)
        return chosen

    def explain(self) -> str:
        """Which rule placed each tensor (see ``sharding.explain``)."""
        return self.compiled.explain()

    def explain_overlap(self, timeline: Timeline | None = None) -> str:
        """The planner's choices, with reasons and predicted times; with the ``timeline``
        of a run, what each pattern measured on this rank against its limit, and loudly
        where a planned overlap did not happen (``overlap.plan.roof``)."""
        text = self.compiled.explain_overlap()
        if timeline is None:
            return text
        meters = roof.measure(self.overlap, self.program, timeline.spans())
        return f"{text}\n{roof.report(meters)}"

    def kernel_report(self) -> str:
        """Each generated kernel's scheduler and launch configuration (after a first run)."""
        lines = []
        chosen = self.chosen_params
        for name, kernel in self.program.generated_kernels().items():
            line = f"{name} [{kernel.backend}] {chosen.get(name, '(not run yet)')}"
            forms = {
                form
                for rank_program in self._rank_programs.values()
                for forms_of in rank_program.kernel_forms.get(name, [])
                for form in forms_of()
            }
            if forms:
                line += f" form: {', '.join(sorted(forms))}"
            lines.append(line)
        return "\n".join(lines) or "no generated kernels"

    @property
    def communications(self) -> list:
        return self.program.communications

    def input_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.inputs]

    def output_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.outputs]

    def shard_inputs(
        self, full_inputs: Sequence[torch.Tensor], check: bool = True
    ) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs (None where an input is not on this rank).
        With several ranks, ``check`` makes sure every rank was given the same whole
        inputs (collective: one exchange of their fingerprints; ``InputError`` on every
        rank otherwise), since a rank cuts its piece from what it is given."""
        if check and self.communicator is not None and self.communicator.world_size > 1:
            names = [f"input {i} ({t.name})" for i, t in enumerate(self.fusion.inputs)]
            exchange = self.communicator.input_check_exchange
            check_same_on_every_rank(names, full_inputs, exchange, "shard_inputs")
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_inputs, self.fusion.inputs, strict=True)
        ]

    def shard_outputs(self, full_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs: what ``run`` should return here."""
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_outputs, self.fusion.outputs, strict=True)
        ]

    def gather_outputs(self, local_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The whole outputs, assembled from every rank's pieces (collective: call on all ranks).

        Pieces travel through ``all_gather_object`` (host memory): meant for checking and
        small results, not for the hot path.
        """
        if not self.sharded:
            return list(local_outputs)
        cpu = [None if t is None else t.cpu() for t in local_outputs]
        everyone = restored(self.communicator.all_gather_object(portable(cpu)))
        return [
            assemble({rank: pieces[position] for rank, pieces in enumerate(everyone)}, tensor).to(
                self.device
            )
            for position, tensor in enumerate(self.fusion.outputs)
        ]

    # -----------------------------------------------------------------------
    # Running

    def run(
        self,
        local_inputs: Sequence[torch.Tensor | None],
        timeline: Timeline | None = None,
        check_inputs: bool | str = "changes",
    ) -> list[torch.Tensor | None]:
        """Run the program on this rank; returns this rank's output pieces (None off-mesh).

        An input may be a DTensor placed as the fusion places that input (checked, then
        its local piece is used; ``overlap.runtime.dtensors``); outputs on a mesh such inputs
        came on are then DTensors too. With a ``timeline``, every kernel and
        communication is recorded per stream.
        ``check_inputs`` says when the ranks exchange their inputs' shapes (a small host
        all-gather) so that a bad input fails everywhere before any collective:
        ``"changes"`` (default) at the first run and whenever this rank's inputs differ
        from its last checked run's (every rank's inputs must change at the same run: a
        rank whose input is wrong raises at once, one whose inputs changed alone raises
        ``InputChangeError`` after the communicator's ``input_check_timeout_s``), or at
        every run where a change of the extents may leave some rank's pieces as they
        were (a symbolic extent only on split axes, or only on some ranks' inputs);
        ``"always"`` (or True) at every run, for programs whose shapes may change on
        some ranks only; ``"never"`` (or False) only at the first run (then the shapes
        must stay). With ``cuda_graph=True``, ``"changes"`` exchanges at every run: the
        graphs are keyed by every rank's input buffers. Every rank must use the same
        setting.
        """
        local_inputs, torch_meshes = local_pieces(self.fusion, local_inputs)
        mode = check_mode(check_inputs)
        replay = self.cuda_graph and timeline is None and self.device.type == "cuda"
        # A graph is captured per set of input buffers, and capturing runs the program
        # once more: every rank must capture at the same runs, so the graphs are keyed by
        # every rank's buffers, learnt in the input check.
        buffers = addresses(local_inputs) if replay else None
        if self.sharded:
            if self.cuda_graph and mode == "changes":  # every rank alike, timeline or not
                mode = "always"
            bindings, every_buffers = self._inputs.bindings(local_inputs, mode, buffers)
            if buffers is not None and buffers != every_buffers[self.rank]:
                raise InputError(
                    "cuda_graph=True and check_inputs='never': this rank's inputs are not in "
                    "the buffers of the last checked run. A new graph must be captured on "
                    "every rank at once, which only the input check can arrange: run with "
                    "check_inputs='changes' when the inputs move"
                )
        elif mode == "never" and self._local.bindings is not None:
            bindings, every_buffers = self._local.bindings, [buffers]
        else:
            bindings, every_buffers = self._local(local_inputs), [buffers]
        if self._copy_engine and self._symmetric is None:
            self._symmetric = SymmetricBuffers(self.communicator)
        if self._symmetric is not None:
            self._symmetric.next_run()
        if bindings is not self._extents_key[0]:  # the key, worked out again for new bindings
            self._extents_key = (bindings, tuple(sorted((s.name, v) for s, v in bindings.items())))
        key = self._extents_key[1]
        if key not in self._rank_programs:
            if self.sharded:  # the same verdict on every rank: the bindings are the same
                check_bound_extents(self.fusion, bindings)
            self._rank_programs[key] = self._rank_program(bindings)
        compiled = self._rank_programs[key]
        if replay:  # no autograd graph: its gradients would be one rank's
            outputs = without_grad(self._replay, compiled, (key, tuple(every_buffers)),
                                   local_inputs)  # fmt: skip
        else:
            outputs = without_grad(compiled.run, local_inputs, timeline)
        return as_dtensors(refusing_backward(outputs, local_inputs), self.fusion, torch_meshes)

    def _replay(self, compiled: RankProgram, key: tuple, local_inputs) -> list:
        """Run through a CUDA graph captured for these extents and every rank's input
        buffers (``key``: the same on every rank), one per symmetric buffer half."""
        parity = self._symmetric.parity if self._symmetric is not None else 0
        graph_key = (key, parity)
        if graph_key not in self._graphs:
            compiled.run(local_inputs, None)  # warm up: handles, allocations
            graph = torch.cuda.CUDAGraph()
            # No garbage collection while capturing: freeing an unreachable executor's
            # symmetric memory then would be a CUDA call the capture forbids.
            gc.collect()
            gc.disable()
            try:
                with torch.cuda.graph(graph):
                    outputs = compiled.run(local_inputs, None)
            finally:
                gc.enable()
            if len(self._graphs) >= 8:  # inputs keep moving: drop the oldest graphs
                self._graphs.pop(next(iter(self._graphs)))
            # the graph's own buffers (an input passed through is the caller's)
            owned = [o for o in outputs if o is not None and all(o is not i for i in local_inputs)]
            self._graphs[graph_key] = (graph, outputs, owned)
        graph, outputs, owned = self._graphs[graph_key]
        graph.replay()
        # its buffers were written: autograd then refuses a backward that saved them
        # before this replay (their values are gone) instead of reading the new ones
        torch.autograd.graph.increment_version(owned)
        return list(outputs)

    def _rank_program(self, bindings: Bindings) -> RankProgram:
        """This rank's program for these extents; in a sharded run the ranks agree on the
        outcome first (a heuristic refusing one rank's local shapes, say), so that a rank
        that cannot build its program fails with its peers, not alone while they wait."""
        setup = RankSetup(self.rank, self.communicator, self.device, self._streams,
                          self._symmetric, self.kernel_params, self._hardware_profile)  # fmt: skip
        try:
            rank_program, failure = RankProgram(self.compiled, setup, bindings), None
        except Exception as error:  # reported to the peers, then raised here
            rank_program, failure = None, error
        if self.sharded:
            self.communicator.agree(failure, "preparing the run")
        elif failure is not None:
            raise failure
        if self._symmetric is not None:  # collective: only once every rank is ready
            rank_program.allocate_symmetric()
        return rank_program

    def ctx_local_shape(self, tensor: TensorView) -> list[int]:
        """This rank's shape of ``tensor`` when every extent is static."""
        return rank_shape(tensor, self.rank, {})


def _check_transports(program: HostProgram, device: torch.device) -> None:
    if Transport.COPY_ENGINE in program.transports() and device.type != "cuda":
        raise ShardingError(
            f"{program.fusion.name or 'the fusion'}: the copy_engine transport needs CUDA "
            f"devices with symmetric memory; this rank runs on {device}. Use collective or ring"
        )


def _check_kernel_params(kernel_params: dict[str, object], program: HostProgram) -> None:
    """Every kernel named in ``kernel_params`` is a generated kernel of ``program``,
    and a strategy named there is one its kernel's scheduler has."""
    kernels = program.generated_kernels()
    for name, override in kernel_params.items():
        kernel = kernels.get(name)
        if kernel is None:
            raise ValueError(
                f"kernel_params[{name!r}] = {override!r}: this program has no generated "
                f"kernel {name!r} (generated: {sorted(kernels) or 'none'}; see "
                "print(executor.program))"
            )
        if not isinstance(override, str):
            continue
        strategies = kernel.scheduler.strategies
        if override not in strategies and override != "auto":  # "auto": the heuristics'
            raise ValueError(
                f"kernel_params[{name!r}] = {override!r}: the {kernel.scheduler.name} "
                f"scheduler's strategies are {list(strategies)} (or 'auto')"
            )
