"""``python -m overlap dump``: the program a script's fusion compiles to, without running.

    python -m overlap dump --device h200 --world 8 script.py [--kernels] [--passes] [--cuda-graph]

The script defines ``fusion(world_size)`` returning its ``FusionDefinition`` (see
``launch/script.py``). The fusion is compiled for the named device's figures
(``overlap.plan.figures.NAMED_FIGURES``: h200, h100, b200, cpu) by ``compile_program``
directly: no process group, no GPU needed. It prints the planner's choices with their
reasons, then each distinct rank program once (with the ranks that run it); ``--passes``
prints the fusion or program after every pass, ``--kernels`` lowers compute to
generated kernels as a GPU run would, ``--cuda-graph`` plans for runs replayed from a
CUDA graph (``MultiDeviceExecutor(cuda_graph=True)``: the host's cost does not count).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TextIO

from overlap.compile.pipeline import compile_program
from overlap.plan.figures import NAMED_FIGURES


class ScriptError(ValueError):
    """A user script that cannot be used: missing, or without what is asked of it."""


def load_script(path: str, need: str = "main") -> ModuleType:
    """Import the script at ``path`` as a module; ``ScriptError`` if it is missing or has
    no callable ``need``."""
    file = Path(path)
    if not file.is_file():
        raise ScriptError(f"{path}: no such script")
    name = f"overlap_script_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ScriptError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickled functions of the script resolve through it
    spec.loader.exec_module(module)
    if not callable(getattr(module, need, None)):
        raise ScriptError(f"{path} defines no {need}(): see launch/script.py for what it needs")
    return module


def dump(
    script: str,
    world: int,
    device: str,
    kernels: bool = False,
    passes: bool = False,
    cuda_graph: bool = False,
    out: TextIO = sys.stdout,
) -> None:
    """Print what ``script``'s ``fusion(world)`` compiles to on ``device`` (see above)."""
    if device not in NAMED_FIGURES:
        raise ScriptError(f"--device {device!r}: one of {sorted(NAMED_FIGURES)}")
    figures = NAMED_FIGURES[device]
    module = load_script(script, need="fusion")
    compiled = compile_program(module.fusion(world), world, None, figures, schedule=kernels,
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dump command's arguments (shared with the ``overlap`` command line)."""
    parser.add_argument("--world", type=count, default=2, help="ranks to plan for (default 2)")
    parser.add_argument("--device", default="h200", choices=sorted(NAMED_FIGURES),
                        help="whose figures the planner uses (default h200)")  # fmt: skip
    parser.add_argument("--kernels", action="store_true", help="lower to generated kernels")
    parser.add_argument("--passes", action="store_true", help="print after every pass")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="plan for runs replayed from a CUDA graph (no host cost)")  # fmt: skip
    parser.add_argument("script")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlap", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_arguments(commands.add_parser("dump", help="print a script's programs, without running"))
    args = parser.parse_args(argv)
    try:
        dump(args.script, args.world, args.device, args.kernels, args.passes, args.cuda_graph)
    except ScriptError as error:
        print(f"overlap dump: {error}", file=sys.stderr)
        return 2
    return 0
