"""User scripts for ``overlap run`` and ``overlap dump``.

A script is a Python file with, at module level:

- ``main(communicator)``: what every rank runs (``overlap run``);
- ``fusion(world_size)`` (optional): the ``FusionDefinition`` it runs, so
  ``overlap dump`` can print its host program without running anything.

Module-level code other than definitions runs on import in every rank: keep it light.
"""

from __future__ import annotations

from types import ModuleType

from launch.env import LaunchError
from overlap.compile.dump import ScriptError
from overlap.compile.dump import load_script as _load


def load_script(path: str, need: str = "main") -> ModuleType:
    """Import the script at ``path`` as a module; ``LaunchError`` if it is missing or has
    no callable ``need``."""
    try:
        return _load(path, need)
    except ScriptError as error:
        raise LaunchError(str(error)) from None
