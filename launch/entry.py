"""``python -m launch.entry [--records DIR] (script.py [args] | --call)``: one rank.

What ``overlap run`` starts in every process (through torchelastic: ``--launcher local``
by ``launch.local``, ``--launcher torchrun`` by ``torch.distributed.run``): join the
process group, then call the script's ``main(communicator)`` with ``sys.argv`` set to the
script and its args. A rank whose ``main`` raises prints its traceback, aborts its
communicators and exits 1 at once (``launch.failfast``); the launcher then stops the others.

The local launcher adds ``--records DIR``: a rank that finishes writes what it returned
there (``attempt<restart>/rank<rank>``), which tells the launcher it finished;
``--call`` runs the function ``launch.local.run_function`` left in ``DIR/call`` instead
of a script.

A rank whose ``main`` returns exits 0 as any Python program does (its threads joined,
its ``atexit`` handlers run, its files flushed); the ``Communicator`` destroys the
process groups at exit, before the interpreter finalizes (``overlap.comm.communicator``).
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing import spawn

from fusion.portable import portable, restored
from launch import failfast
from launch.env import init
from launch.local import CALL
from launch.script import load_script


def main() -> int:
    args = sys.argv[1:]
    records = None
    if args[:1] == ["--records"]:
        records, args = args[1], args[2:]
        os.environ["OVERLAP_LAUNCHER"] = "local"
    if not args or (args == ["--call"] and records is None):
        print("usage: python -m launch.entry [--records DIR] (script.py [args] | --call)",
              file=sys.stderr)  # fmt: skip
        return 2
    value = None  # a script's main returns nothing to record
    try:
        if args == ["--call"]:
            with open(os.path.join(records, CALL), "rb") as payload:
                spawn.prepare(pickle.load(payload))  # the caller's sys.path, __main__, folder
                function, function_args, timeout_s = pickle.load(payload)
            communicator = init(timeout_s=timeout_s)
            value = function(communicator, *restored(function_args))
        else:
            script, *argv = args
            module = load_script(script)  # before the process group: a bad script fails alone
            sys.argv = [script, *argv]
            communicator = init()
            module.main(communicator)
    except SystemExit as done:
        if done.code not in (0, None):
            failfast.fail(done.code if isinstance(done.code, int) else 1)
    except BaseException:
        # never a graceful teardown here: on NCCL it waits for the peers, which wait in
        # their next collective for this rank
        failfast.fail(1)
    if records is not None:  # the launcher's rank (a script may exit 0 before joining)
        _record(records, int(os.environ["RANK"]), value)
    return 0


def _record(records: str, rank: int, value: object) -> None:
    """Write ``value`` where the local launcher reads a finished rank's result; whole or
    not at all (a launcher past its time limit looks for the file)."""
    folder = os.path.join(records, f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}")
    with open(path + ".part", "wb") as record:
        pickle.dump(portable(value), record)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    sys.exit(main())
