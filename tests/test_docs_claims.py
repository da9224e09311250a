"""What docs/architecture.md says about the code, held against the code: the pass list,
each pass's module, the compile pipeline's docstring, the rooms of ``overlap``, the
scheduler protocol."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from overlap.compile import pipeline
from schedulers.base import Scheduler

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _pass_rows() -> list[tuple[str, str]]:
    """(pass name, its module's function) from the passes table."""
    section = ARCHITECTURE.split("## The passes", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| ([a-z ]+) \| `([\w.]+)`", section, re.M)


def test_the_passes_table_lists_every_pass_in_order_each_in_its_own_module():
    rows = _pass_rows()
    assert [name for name, _ in rows] == [name for name, _ in pipeline.PASSES]
    modules = []
    for _, dotted in rows:
        module_name, function = dotted.rsplit(".", 1)
        module = importlib.import_module(module_name)
        assert callable(getattr(module, function)), dotted
        modules.append(module_name)
    assert len(set(modules)) == len(modules), modules


def test_the_pipelines_docstring_names_every_pass_in_order():
    named = re.findall(r"^\d+\. ``([a-z ]+)``", pipeline.__doc__, re.M)
    assert named == [name for name, _ in pipeline.PASSES]


def test_the_picture_shows_overlaps_rooms_in_their_import_order():
    from tests.test_project import OVERLAP_ROOMS

    picture = ARCHITECTURE.split("## The packages", 1)[1].split("```")[1]
    shown = re.findall(r"^\s+\|\s+(\w+)\s{2,}", picture, re.M)
    assert shown == OVERLAP_ROOMS


def test_the_scheduler_protocol_is_named_with_its_steps():
    steps = [
        name
        for name, member in vars(Scheduler).items()
        if inspect.isfunction(member) and not name.startswith("_")
    ]
    listed = re.search(r"`Scheduler` protocol \(([^)]*)\)", ARCHITECTURE).group(1)
    assert re.findall(r"`(\w+)`", listed) == steps
