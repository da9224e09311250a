"""Every Python code block of README.md and docs/*.md runs: the docs cannot drift.

The blocks of one file run in order in one namespace, as a reader reads them. HTML
comments (invisible on the rendered page) say what a block needs:

- ``<!-- doc-test: ranks 2 -->`` anywhere in a file: its blocks run on 2 gloo ranks
  under torchrun (each rank runs every block; ``launch.init()`` and
  ``init_process_group`` work as the docs show);
- ``<!-- doc-test: setup`` ... ``-->`` just before a block: code run first (the
  inputs, a module, a fusion that the surrounding prose describes);
- ``<!-- doc-test: alone`` ... ``-->`` just before a block: it runs by itself in a
  process of its own after the comment's code (a Ray pool); ``alone, needs ray``
  skips it where Ray is not installed.

Each run prints a line per block it finished, so a run that skipped blocks fails.
Those runs start processes (``slow``); the quick checks here (``-m "not slow"``) read the
docs without running them: every block compiles, every name of the project they mention
(``overlap.plan.roof``, ``from overlap import ...``) imports, every path they name
exists, and the guide's printed fusion and its legends are what the code prints.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (setup|alone[^\n]*)\n(.*?)-->\n)?```python\n(.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    where: str  # "docs/guide.md:47"
    setup: str
    code: str
    alone: str  # "" or the alone marker's options ("needs ray")


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in BLOCK.finditer(text):
        kind, setup, code = match.group(1) or "", match.group(2) or "", match.group(3)
        line = text[: match.start(3)].count("\n")
        where = f"{path.relative_to(ROOT)}:{line}"
        alone = (
            (kind.removeprefix("alone").strip(" ,") or "alone") if kind.startswith("alone") else ""
        )
        found.append(Block(where, setup, code, alone))
    return found


def runs() -> list[tuple[str, list[Block], int]]:
    """(name, blocks, ranks): a file's blocks in one run, each block alone in its own."""
    cases = []
    for path in DOCS:
        found = blocks(path)
        ranks = 2 if "<!-- doc-test: ranks 2 -->" in path.read_text() else 1
        together = [b for b in found if not b.alone]
        if together:
            cases.append((str(path.relative_to(ROOT)), together, ranks))
        cases += [(b.where, [b], 1) for b in found if b.alone]
    return cases


def script(run: list[Block]) -> str:
    lines = ["import sys", "namespace = {'__name__': '__doc_test__'}"]
    for block in run:
        source = block.setup + block.code
        lines.append(f"exec(compile({source!r}, {block.where!r}, 'exec'), namespace)")
        # one write: the ranks' lines do not interleave within it
        lines.append(f"sys.stdout.write('doc-test ran {block.where}\\n'); sys.stdout.flush()")
    return "\n".join(lines) + "\n"


CASES = runs()


def test_every_python_block_of_the_docs_is_in_some_run():
    every = {b.where for path in DOCS for b in blocks(path)}
    counted = sum(text.count("```python") for text in (p.read_text() for p in DOCS))
    assert len(every) == counted >= 15, (len(every), counted)
    assert {b.where for _, run, _ in CASES for b in run} == every


PACKAGES = ("fusion", "sharding", "schedulers", "overlap", "launch")
# a dotted name of the project in prose or code: overlap.plan.roof, fusion.testing.assert_close
PROJECT_NAME = re.compile(rf"(?<![\w.])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?![\w/])")
# a path with a folder, in backticks (`examples/tp_mlp.py`), or a Markdown link's target
NAMED_PATH = re.compile(r"`([\w.-]+/[\w./-]+)`|\]\(([^)\s]+)\)")


def resolve(name: str) -> object:
    """The module or object a dotted name of the project names (an import, then
    attributes); raises where it names nothing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if not f"{module}.".startswith(f"{error.name}."):
                raise  # the module exists but needs something missing
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_python_block_of_the_docs_compiles(path):
    for block in blocks(path):
        compile(block.setup + block.code, block.where, "exec")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_name_of_the_project_the_docs_mention_imports(path):
    text = path.read_text()
    names = {m.group(1) for m in PROJECT_NAME.finditer(text)
             if not m.group(1).endswith((".md", ".py", ".json", ".png"))}  # fmt: skip
    for block in blocks(path):
        for node in ast.walk(ast.parse(block.setup + block.code)):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in PACKAGES:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert names, f"{path} names nothing of the project: is PROJECT_NAME still right?"
    missing = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, f"{path.relative_to(ROOT)} names what does not import: {missing}"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_path_the_docs_name_exists(path):
    """Paths with a folder, from the repository's root or the document's folder (a bare
    file name is read in its context: ``pointwise.py`` in schedulers.md)."""
    named = [m.group(1) or m.group(2) for m in NAMED_PATH.finditer(path.read_text())]
    named = [p.split("#")[0] for p in named if "://" not in p and not p.startswith("#")]
    missing = [p for p in named if not ((ROOT / p).exists() or (path.parent / p).exists())]
    assert not missing, f"{path.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_guides_printed_fusion_and_legends_are_what_the_code_prints():
    from fusion.printer import LEGEND
    from launch.demo import HOST_LEGEND, build_tp_mlp

    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("### Reading the printed IR", 1)[1].split("\n#", 1)[0]
    (printed,) = re.findall(r"```\n(Fusion .*?)```", section, re.S)
    assert printed.rstrip() == str(build_tp_mlp(64, 32, 128, world=2))
    prose = " ".join(section.replace("`", "").split())
    for legend in (LEGEND, HOST_LEGEND):
        assert " ".join(legend.split()) in prose, legend


@pytest.mark.slow  # processes: a Python per file's blocks, torchrun for 2 ranks
@pytest.mark.parametrize(
    ("name", "run", "ranks"),
    [pytest.param(*case, marks=[pytest.mark.ray] if any("needs ray" in b.alone for b in case[1])
                  else []) for case in CASES],
    ids=[c[0] for c in CASES],
)  # fmt: skip
def test_the_docs_code_runs(name, run, ranks, tmp_path):
    if any("needs ray" in b.alone for b in run):
        pytest.importorskip("ray")
    path = tmp_path / "doc_blocks.py"
    path.write_text(script(run))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OVERLAP_LAUNCHER"):
        env.pop(variable, None)
    command = [sys.executable, str(path)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), str(path)]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-4000:]
    for block in run:
        assert result.stdout.count(f"doc-test ran {block.where}\n") == ranks, said[-4000:]
