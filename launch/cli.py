"""The ``overlap`` command line.

overlap demo                      the README's main job: a tensor-parallel MLP block,
                                  sequential against overlapped, on the local devices
overlap run [--launcher L] [--nproc N] script.py [args]
                                  run script.py's main(communicator) on N ranks
                                  (L: local, torchrun or ray)
overlap dump [--world N] [--device D] [--kernels] [--passes] [--no-cuda-graph] script.py
                                  print what script.py's fusion(world) compiles to on
                                  device D (h200, h100, b200, cpu): the overlap plan and
                                  each distinct rank program, without running anything
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = (
    "Run one fusion over many devices with its communication overlapped with compute: "
    "the demo, your own scripts, or the programs a script compiles to."
)


def main(argv: list[str] | None = None) -> int:
    """The ``overlap`` command: 0 on success; 2 (and one message, no traceback) for a
    launch or script that cannot start."""
    from launch.demo import CPU_SIZES, GPU_SIZES, OUT
    from launch.ray_pool import PLACEMENTS
    from overlap.compile.dump import DESCRIPTION as DUMP_DESCRIPTION
    from overlap.compile.dump import SCRIPT, add_arguments, count

    parser = argparse.ArgumentParser(prog="overlap", description=DESCRIPTION, epilog=SCRIPT)
    parser.add_argument("--version", action="version", version=f"overlap {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="the tensor-parallel MLP demo on this machine's devices",
        description="Run a tensor-parallel MLP block on this machine's devices (every GPU, "
        "or 2 CPU processes), sequentially and overlapped: print its fusion, communications, "
        "host programs and the planner's choice, check every run against one device, time "
        "them, and chart the overlapped run's timeline.",
    )  # fmt: skip
    for index, (name, what) in enumerate(
        [("tokens", "rows of the input, split over the ranks"), ("hidden", "model width"),
         ("ffn", "the MLP's inner width, split over the ranks")]
    ):  # fmt: skip
        demo.add_argument(f"--{name}", type=count, default=None,
                          help=f"{what} (default {GPU_SIZES[index]} on GPUs, "
                          f"{CPU_SIZES[index]} on CPUs)")  # fmt: skip
    demo.add_argument("--nproc", type=count, default=None, help=NPROC_HELP)
    demo.add_argument("--out", default=OUT,
                      help=f"folder for the timeline chart and trace (default {OUT})")  # fmt: skip
    run = commands.add_parser(
        "run", help="run a script's main(communicator) on N ranks",
        description="Run a script's main(communicator) on every rank: local processes, "
        "torchrun, or a Ray pool.", epilog=SCRIPT,
    )  # fmt: skip
    run.add_argument("--launcher", choices=["local", "torchrun", "ray"], default="local",
                     help="local processes, torchrun or a Ray pool (default local)")  # fmt: skip
    run.add_argument("--nproc", type=count, default=None, help=NPROC_HELP)
    run.add_argument("--address", default=None,
                     help="ray: a running cluster's address (default: start one here)")  # fmt: skip
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds before giving up (default: none; Ray 600)")  # fmt: skip
    run.add_argument("--max-restarts", type=int, default=0,
                     help="start every rank again this many times after one fails (default "
                     "0; ray: the pool built again)")  # fmt: skip
    run.add_argument("--placement", choices=PLACEMENTS, default="SPREAD",
                     help="ray: the ranks over as many nodes as have room (SPREAD, "
                     "default), as few (PACK), one a node (STRICT_SPREAD) or one node "
                     "(STRICT_PACK)")  # fmt: skip
    run.add_argument("script", help="a Python file defining main(communicator)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    add_arguments(commands.add_parser("dump", help="print a script's programs, without running",
                                      description=DUMP_DESCRIPTION, epilog=SCRIPT))  # fmt: skip
    args = parser.parse_args(argv)
    from launch.env import LaunchError
    from launch.local import fits_the_devices
    from overlap.diag import progress

    progress.enable()  # long steps (compiling kernels) say so, in every rank started

    try:
        if args.command in ("demo", "run"):
            fits_the_devices(args.nproc, getattr(args, "launcher", "local"))
        if args.command == "demo":
            from launch.demo import run_demo

            return 0 if run_demo(args.tokens, args.hidden, args.ffn, args.nproc, args.out) else 1
        if args.command == "run":
            return _run(args)
        return _dump(args)
    except LaunchError as error:
        print(f"overlap {args.command}: {error}", file=sys.stderr)
        return 2


NPROC_HELP = "ranks, at least 1 (default: the GPUs, or 2 processes on CPUs)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("overlap")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _run(args) -> int:
    from launch.local import default_nproc, run_script
    from launch.script import load_script

    load_script(args.script)  # a missing script or main() fails here, before any rank starts
    nproc = args.nproc or default_nproc()
    if args.launcher == "local":
        return run_script(args.script, args.args, nproc, args.timeout, args.max_restarts)
    if args.launcher == "torchrun":
        import os
        import subprocess

        from launch.local import UNSHARED_STORE

        # a rendezvous on a free port, whose store the ranks do not share, as the local
        # launcher's: a shared one breaks restarts (launch.local says how)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), "--max-restarts", str(args.max_restarts),
                   "-m", "launch.entry", args.script, *args.args]  # fmt: skip
        environment = {**os.environ, UNSHARED_STORE: "1"}
        try:
            return subprocess.run(command, timeout=args.timeout, env=environment).returncode
        except subprocess.TimeoutExpired:
            print(f"overlap run: torchrun still running after {args.timeout} s", file=sys.stderr)
            return 124
    from launch.ray_pool import call_with_restarts

    call_with_restarts(nproc, _script_main, args.script, args.args,
                       max_restarts=args.max_restarts, address=args.address,
                       timeout_s=args.timeout or 600.0, placement=args.placement)  # fmt: skip
    return 0


def _script_main(communicator, script: str, argv: list[str]) -> None:
    """A Ray actor's part of ``overlap run --launcher ray``."""
    from launch.script import load_script

    sys.argv = [script, *argv]
    load_script(script).main(communicator)


def _dump(args) -> int:
    from launch.env import LaunchError
    from overlap.compile.dump import ScriptError, dump

    try:
        dump(args.script, args.world, args.device, args.kernels, args.passes, args.cuda_graph)
    except ScriptError as error:
        raise LaunchError(str(error)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
