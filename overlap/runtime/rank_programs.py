"""This rank's programs, one per set of extents, and the buffers they share.

``RankPrograms.get(bindings)`` returns the ``RankProgram`` for these extents, building it
the first time: in a sharded run every rank builds at the same run (the bindings are the
same everywhere, the input check saw to it), and the ranks agree on the outcome before
any of them goes on, so a rank whose build failed (a heuristic refusing its local shape,
say) fails with its peers instead of leaving them waiting in a collective. A program
with copy-engine pipelines gets the symmetric-memory buffers (``overlap.comm.symmetric``):
created once, allocated collectively once every rank's program is built, alternated run
by run (``next_run``).

Example::

    programs = RankPrograms(compiled, setup)
    programs.next_run()
    outputs = programs.get(bindings).run(local_inputs, None)
"""

from __future__ import annotations

from fusion.binding import Bindings
from overlap.comm.symmetric import SymmetricBuffers
from overlap.compile.pipeline import CompiledProgram
from overlap.ir import Transport
from overlap.runtime.inputs import check_bound_extents
from overlap.runtime.rank_program import RankProgram, RankSetup


class RankPrograms:
    """The rank programs of one compiled program on this rank, by extents."""

    def __init__(self, compiled: CompiledProgram, setup: RankSetup) -> None:
        self.compiled, self.setup = compiled, setup
        self._built: dict[tuple, RankProgram] = {}
        self._last: tuple = (None, ())  # the last bindings asked for, and their key
        self._copy_engine = Transport.COPY_ENGINE in compiled.host.transports()

    @property
    def parity(self) -> int:
        """Which half of the symmetric buffers this run uses (0 without them)."""
        return self.setup.symmetric.parity if self.setup.symmetric is not None else 0

    def next_run(self) -> None:
        """Before each run: the copy-engine buffers' other half (made at the first run)."""
        if self._copy_engine and self.setup.symmetric is None:
            self.setup.symmetric = SymmetricBuffers(self.setup.communicator)
        if self.setup.symmetric is not None:
            self.setup.symmetric.next_run()

    def key(self, bindings: Bindings) -> tuple:
        """The extents ``bindings`` give, as a key (worked out again only for new ones)."""
        if bindings is not self._last[0]:
            self._last = (bindings, tuple(sorted((s.name, v) for s, v in bindings.items())))
        return self._last[1]

    def get(self, bindings: Bindings) -> RankProgram:
        """The rank program for ``bindings``' extents (built, with the peers, if new)."""
        key = self.key(bindings)
        if key not in self._built:
            self._built[key] = self._build(bindings)
        return self._built[key]

    def _build(self, bindings: Bindings) -> RankProgram:
        sharded = self.compiled.sharded
        if sharded:  # the same verdict on every rank: the bindings are the same
            check_bound_extents(self.compiled.fusion, bindings)
        try:
            program, failure = RankProgram(self.compiled, self.setup, bindings), None
        except Exception as error:  # reported to the peers, then raised here
            program, failure = None, error
        if sharded:
            self.setup.communicator.agree(failure, "preparing the run")
        elif failure is not None:
            raise failure
        if self.setup.symmetric is not None:  # collective: only once every rank is ready
            program.allocate_symmetric()
        return program

    def kernel_report(self) -> str:
        """Each generated kernel's scheduler, launch configuration (as last chosen, over
        every rank program built) and forms."""
        chosen = self.chosen_params()
        lines = []
        for name, kernel in self.compiled.host.generated_kernels().items():
            line = f"{name} [{kernel.backend}] {chosen.get(name, '(not run yet)')}"
            forms = {
                form
                for program in self._built.values()
                for forms_of in program.kernel_forms.get(name, [])
                for form in forms_of()
            }
            if forms:
                line += f" form: {', '.join(sorted(forms))}"
            lines.append(line)
        return "\n".join(lines) or "no generated kernels"

    def chosen_params(self) -> dict[str, object]:
        """Each generated kernel's launch configuration, as last chosen."""
        chosen: dict[str, object] = {}
        for program in self._built.values():
            chosen.update(program.chosen_params)
        return chosen
