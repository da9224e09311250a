"""``python -m launch.entry script.py [args]``: one rank of a launched script.

What ``overlap run`` starts in every process (directly for ``--launcher local``, through
``torch.distributed.run`` for ``--launcher torchrun``): join the process group, then call
the script's ``main(communicator)`` with ``sys.argv`` set to the script and its args.
A rank whose ``main`` raises prints its traceback, aborts its communicators and exits 1
at once (``launch.failfast``); the launcher then stops the others.

A rank whose ``main`` returns exits 0 as any Python program does (its ``atexit``
handlers run); the ``Communicator`` destroys the process groups at exit, before the
interpreter finalizes (``overlap.comm.communicator``).
"""

from __future__ import annotations

import sys

from launch import failfast
from launch.env import init
from launch.script import load_script


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m launch.entry script.py [args]", file=sys.stderr)
        return 2
    script, *argv = sys.argv[1:]
    module = load_script(script)  # before the process group: a bad script fails alone
    sys.argv = [script, *argv]
    communicator = init()
    try:
        module.main(communicator)
    except SystemExit as done:
        if done.code not in (0, None):
            failfast.fail(done.code if isinstance(done.code, int) else 1)
    except BaseException:
        # never a graceful teardown here: on NCCL it waits for the peers, which wait in
        # their next collective for this rank
        failfast.fail(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
