"""``python -m overlap dump``: the program a script's fusion compiles to, without running.

    python -m overlap dump --device h200 --world 8 script.py [--kernels] [--passes]

The script defines ``fusion(world_size)`` returning its ``FusionDefinition`` (``SCRIPT``
says what a script is; ``docs/guide.md``, "Scripts", says more). The fusion is compiled
for the named device's figures (``overlap.plan.figures.named_figures``: h200, h100, b200,
cpu) by ``compile_program`` directly: no process group, no GPU needed. It prints the
planner's choices with their reasons, then each distinct rank program once (with the
ranks that run it); ``--passes`` prints the fusion or program after every pass,
``--kernels`` lowers compute to generated kernels as a GPU run would. On a GPU device the
plan is for runs replayed from CUDA graphs, as runs there are by default (the host's cost
is a replay's); ``--no-cuda-graph`` plans for runs the host issues step by step
(``cuda_graph=False``), as on ``--device cpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import TextIO

from fusion import Fusion, FusionDefinition
from overlap.compile.pipeline import compile_program
from overlap.plan.figures import NAMED_FIGURES, named_figures

# The script contract, in one sentence: every error about a script ends with it.
SCRIPT = (
    "A script is a Python file that defines main(communicator), what every rank runs "
    "(overlap run), and fusion(world_size), which returns the FusionDefinition it runs "
    "(overlap dump); see docs/guide.md, section 'Scripts'."
)
# What each use of a script calls, with the arguments it is called with.
CALLS = {"main": ("main(communicator)", (None,)), "fusion": ("fusion(world_size)", (1,))}


class ScriptError(ValueError):
    """A user script that cannot be used: missing, without what is asked of it, or raising
    while it loads; the message ends with ``SCRIPT``."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}\n{SCRIPT}")


def load_script(path: str, need: str = "main") -> ModuleType:
    """Import the script at ``path`` as a module; ``ScriptError`` if it is missing, raises
    on import, or has no ``need`` (``main`` or ``fusion``) taking the arguments it is
    called with."""
    file = Path(path)
    if not file.is_file():
        raise ScriptError(f"{path}: no such script")
    name = f"overlap_script_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ScriptError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickled functions of the script resolve through it
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        trace = _script_traceback(error, file)
        raise ScriptError(f"{path} raised while loading:\n{trace}") from None
    call, arguments = CALLS[need]
    function = getattr(module, need, None)
    if not callable(function):
        raise ScriptError(f"{path} defines no {need}() (it needs {call})")
    try:
        inspect.signature(function).bind(*arguments)
    except TypeError:
        raise ScriptError(f"{path}'s {need}() cannot be called as {call}") from None
    except ValueError:  # a callable without a signature (a builtin): let the call tell
        pass
    return module


def _script_traceback(error: BaseException, file: Path) -> str:
    """The traceback of ``error`` from its first frame in ``file`` on: the script's
    code and what it called, without the importer's frames above it."""
    tb = error.__traceback__
    script = str(file.resolve())
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()) != script:
        tb = tb.tb_next
    lines = traceback.format_exception(type(error), error, tb or error.__traceback__)
    return "".join(lines).rstrip()


def dump(
    script: str,
    world: int,
    device: str,
    kernels: bool = False,
    passes: bool = False,
    cuda_graph: bool | None = None,
    out: TextIO | None = None,
) -> None:
    """Print what ``script``'s ``fusion(world)`` compiles to on ``device`` (see above), to
    ``out`` (default: ``sys.stdout`` at the call, wherever it points then); planned for
    runs replayed from CUDA graphs where ``cuda_graph`` (default: on a GPU, as runs
    there are by default)."""
    out = out or sys.stdout
    if device not in NAMED_FIGURES:
        raise ScriptError(f"--device {device!r}: one of {sorted(NAMED_FIGURES)}")
    figures = named_figures(device, world)
    module = load_script(script, need="fusion")
    try:
        built = module.fusion(world)
    except Exception as error:
        raise ScriptError(f"{script}: fusion({world}) raised:\n"
                          f"{_script_traceback(error, Path(script))}") from None  # fmt: skip
    if not isinstance(built, FusionDefinition | Fusion):
        raise ScriptError(f"{script}: fusion({world}) returned {type(built).__name__}, "
                          "not a FusionDefinition")  # fmt: skip
    if cuda_graph is None:
        cuda_graph = device != "cpu"
    compiled = compile_program(built, world, None, figures, schedule=kernels,
                               replayed=cuda_graph, dump=out if passes else None)  # fmt: skip
    out.write(f"=== overlap plan on {figures.name}, {world} ranks ===\n")
    out.write(f"{compiled.explain_overlap()}\n\n")
    for ranks, text in compiled.rank_programs():
        named = ", ".join(map(str, ranks))
        out.write(f"=== rank{'s' if len(ranks) > 1 else ''} {named} of {world} ===\n{text}\n\n")


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (ranks, tokens, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: it must be at least 1")
    return value


DESCRIPTION = (
    "Print what a script's fusion(world_size) compiles to for a device's figures: the "
    "overlap planner's choices with their reasons, then each distinct rank program, "
    "without running anything (no GPU needed)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dump command's arguments (shared with the ``overlap`` command line)."""
    parser.add_argument("--world", type=count, default=2, help="ranks to plan for (default 2)")
    parser.add_argument("--device", default="h200", choices=sorted(NAMED_FIGURES),
                        help="whose figures the planner uses (default h200)")  # fmt: skip
    parser.add_argument("--kernels", action="store_true", help="lower to generated kernels")
    parser.add_argument("--passes", action="store_true", help="print after every pass")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="plan for runs replayed from CUDA graphs (the default on a GPU "
                        "device); --no-cuda-graph: for runs the host issues step by step "
                        "(cuda_graph=False, and CPUs)")  # fmt: skip
    parser.add_argument("script", help="a Python file defining fusion(world_size)")


def main(argv: list[str] | None = None) -> int:
    """``python -m overlap dump ...``; 2 (and one message, no traceback) for a script
    that cannot be used."""
    parser = argparse.ArgumentParser(
        prog="python -m overlap",
        description="Print the programs a script compiles to (the overlap command, installed "
        "with the package, also runs the demo and scripts).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_arguments(commands.add_parser("dump", help="print a script's programs, without running",
                                      description=DESCRIPTION, epilog=SCRIPT))  # fmt: skip
    args = parser.parse_args(argv)
    try:
        dump(args.script, args.world, args.device, args.kernels, args.passes, args.cuda_graph)
    except ScriptError as error:
        print(f"overlap dump: {error}", file=sys.stderr)
        return 2
    return 0
