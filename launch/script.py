"""User scripts for ``overlap run`` and ``overlap dump``.

A script is a Python file with, at module level:

- ``main(communicator)``: what every rank runs (``overlap run``);
- ``fusion(world_size)``: the ``FusionDefinition`` it runs, so ``overlap dump`` can
  print its host programs without running anything.

Module-level code other than definitions runs on import in every rank: keep it light
(``if __name__ == "__main__":`` for what runs the script directly). ``docs/guide.md``,
section "Scripts", says the same for users; ``overlap.compile.dump.SCRIPT`` is the one
sentence every error about a script ends with.
"""

from __future__ import annotations

from types import ModuleType

from launch.env import LaunchError
from overlap.compile.dump import ScriptError
from overlap.compile.dump import load_script as _load


def load_script(path: str, need: str = "main") -> ModuleType:
    """Import the script at ``path`` as a module; ``LaunchError`` if it is missing, raises
    on import, or has no ``need`` taking the arguments it is called with."""
    try:
        return _load(path, need)
    except ScriptError as error:
        raise LaunchError(str(error)) from None
