"""The ``overlap`` command line.

overlap demo     build, print, run and check the example fusion
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlap", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="build, print, run and check the example fusion")
    demo.add_argument("--tokens", type=int, default=256)
    demo.add_argument("--hidden", type=int, default=1024)
    demo.add_argument("--ffn", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from launch.demo import run_demo

        return 0 if run_demo(args.tokens, args.hidden, args.ffn) else 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
