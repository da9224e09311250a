"""User scripts for ``overlap run`` and ``overlap dump``.

A script is a Python file with, at module level:

- ``main(communicator)``: what every rank runs (``overlap run``);
- ``fusion(world_size)`` (optional): the ``FusionDefinition`` it runs, so
  ``overlap dump`` can print its host program without running anything.

Module-level code other than definitions runs on import in every rank: keep it light.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from launch.env import LaunchError


def load_script(path: str, need: str = "main") -> ModuleType:
    """Import the script at ``path`` as a module; ``LaunchError`` if it is missing or has
    no callable ``need``."""
    file = Path(path)
    if not file.is_file():
        raise LaunchError(f"{path}: no such script")
    name = f"overlap_script_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise LaunchError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickled functions of the script resolve through it
    spec.loader.exec_module(module)
    if not callable(getattr(module, need, None)):
        raise LaunchError(f"{path} defines no {need}(): see launch/script.py for what it needs")
    return module
