"""``overlap run --launcher ray`` with an address where no Ray cluster runs. In a module of
its own: ``test_launch.py`` keeps a Ray instance up for its whole module, which an
``auto`` address would find."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import no_ray_processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # it starts the command line in a process of its own
@pytest.mark.ray  # it must find no cluster: never beside another Ray test
def test_a_ray_address_without_a_cluster_is_one_clear_line(tmp_path):
    no_ray_processes()
    script = tmp_path / "nothing.py"
    script.write_text("def main(communicator):\n    pass\n")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "run", "--launcher", "ray", "--address", "auto",
         str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("overlap run: Ray: no cluster at address 'auto'"), result.stderr
    assert "Traceback" not in result.stderr


def test_more_ranks_than_the_machines_gpus_are_refused(monkeypatch):
    import torch

    from launch.env import LaunchError
    from launch.local import fits_the_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fits_the_devices(2)
    fits_the_devices(None)
    fits_the_devices(8, "ray")  # a Ray pool asks its cluster
    with pytest.raises(LaunchError, match="--nproc 3: this machine has 2 GPUs, one per rank"):
        fits_the_devices(3, "torchrun")


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_defines_the_fusion_that_overlap_dump_prints(example, capsys):
    from launch.cli import main

    assert main(["dump", str(ROOT / "examples" / example)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("=== overlap plan on H200 (NVLink), 2 ranks ===\n"), out
    assert re.search(r"^=== ranks? [0-9, ]+ of 2 ===\nHostProgram ", out, re.M), out


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_that_says_each_thing_once(capsys):
    from launch.cli import DESCRIPTION, main
    from overlap.compile.dump import DESCRIPTION as DUMP_DESCRIPTION
    from overlap.compile.dump import SCRIPT
    from overlap.compile.dump import main as dump_main

    def flat(text: str) -> str:  # argparse wraps the prose to the terminal's width
        return " ".join(text.split())

    top = _help(main, ["--help"], capsys)
    assert flat(top).count(DESCRIPTION) == 1 and flat(top).count(SCRIPT) == 1, top
    # each command's help on one line of the list
    for command in ("demo", "run", "dump"):
        (line,) = [line for line in top.splitlines() if line.startswith(f"    {command} ")]
        assert len(line) <= 80, line
    helps = {
        command: _help(main, [command, "--help"], capsys) for command in ("demo", "run", "dump")
    }
    helps["python -m overlap"] = _help(dump_main, ["--help"], capsys)
    helps["python -m overlap dump"] = _help(dump_main, ["dump", "--help"], capsys)
    assert flat(helps["dump"]).count(DUMP_DESCRIPTION) == 1
    assert flat(helps["python -m overlap dump"]).count(DUMP_DESCRIPTION) == 1
    for name, text in {"overlap": top, **helps}.items():
        assert "``" not in text and "usage:" in text, (name, text)
        assert flat(text).count("usage:") == 1, (name, text)


def _dump_error(script: str, capsys) -> str:
    from launch.cli import main

    assert main(["dump", script]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    return captured.err


NOT_A_FUSION = ": fusion(2) returned int, not a FusionDefinition"


@pytest.mark.parametrize(
    ("source", "problem"),
    [(None, ": no such script"),
     ("def main(communicator):\n    pass\n", " defines no fusion() (it needs fusion(world_size))"),
     ("def fusion():\n    pass\n", "'s fusion() cannot be called as fusion(world_size)"),
     ("def fusion(world_size):\n    return 3\n", NOT_A_FUSION)],
    ids=["missing", "no fusion", "fusion without its argument", "not a fusion"],
)  # fmt: skip
def test_a_script_that_breaks_the_contract_is_told_the_contract_without_a_traceback(
    source, problem, tmp_path, capsys
):
    from overlap.compile.dump import SCRIPT

    script = tmp_path / "script.py"
    if source is not None:
        script.write_text(source)
    said = _dump_error(str(script), capsys)
    assert said == f"overlap dump: {script}{problem}\n{SCRIPT}\n", said
    assert "docs/guide.md" in said and "Traceback" not in said


@pytest.mark.parametrize("where", ["on import", "in fusion()"])
def test_a_script_that_raises_shows_its_own_frames_then_the_contract(where, tmp_path, capsys):
    from overlap.compile.dump import SCRIPT

    script = tmp_path / "script.py"
    boom = "    raise ValueError('boom')\n"
    script.write_text(f"def fail():\n{boom}\n\n" + (
        "fail()\n" if where == "on import" else "def fusion(world_size):\n    fail()\n"
    ))  # fmt: skip
    said = _dump_error(str(script), capsys)
    head = " raised while loading:" if where == "on import" else ": fusion(2) raised:"
    assert said.startswith(f"overlap dump: {script}{head}\nTraceback"), said
    assert said.endswith(f"ValueError: boom\n{SCRIPT}\n"), said
    # the script's frames, not the importer's nor the command line's
    assert f'File "{script}", line 2, in fail' in said, said
    assert "importlib" not in said and "launch/cli.py" not in said, said


def test_overlap_run_refuses_a_main_that_takes_no_communicator_before_any_rank(tmp_path):
    from launch.cli import _run
    from launch.env import LaunchError
    from overlap.compile.dump import SCRIPT

    script = tmp_path / "script.py"
    script.write_text("def main():\n    pass\n")

    class Args:
        script, args, nproc, launcher, timeout = str(tmp_path / "script.py"), [], 2, "local", 5

    with pytest.raises(LaunchError) as refused:
        _run(Args())
    assert str(refused.value) == (
        f"{script}'s main() cannot be called as main(communicator)\n{SCRIPT}"
    )


def test_the_guide_has_the_section_the_script_errors_point_to():
    from overlap.compile.dump import SCRIPT

    section = re.search(r"section '([^']+)'", SCRIPT).group(1)
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert re.search(rf"^#+ .*\b{section}\b", guide, re.M), section
