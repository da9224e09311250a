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
"""

from __future__ import annotations

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
