"""The README's quickstart runs as written: docs/quickstart.md's make_tiny.py builds a tiny Llama base, two
experts and text data, and then the README's commands, its YAML run file and its Python snippet each merge and
calibrate them, to the same weights (same inputs and seed, three entry points)."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from featcal.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def fenced(page: Path, section: str, language: str) -> str:
    """The first ```language block after the heading `## section` of `page`."""
    text = page.read_text().split(f"\n## {section}\n", 1)[1]
    return re.search(rf"```{language}\n(.*?)```", text, re.S).group(1)


def readme_commands() -> list[list[str]]:
    block = re.sub(r"\\\n\s*", " ", fenced(REPO / "README.md", "Quickstart on your own models", "bash"))
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """base/, experts/{code,chat}/ and data/ as docs/quickstart.md's make_tiny.py writes them."""
    root = tmp_path_factory.mktemp("quickstart")
    script = fenced(REPO / "docs" / "quickstart.md", "A tiny model to try it on", "python")
    assert script.startswith("# make_tiny.py")
    (root / "make_tiny.py").write_text(script)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        runpy.run_path(str(root / "make_tiny.py"), run_name="__main__")
    (root / "make_tiny.py").unlink()
    return root


def workspace(tiny: Path, where: Path, monkeypatch) -> Path:
    shutil.copytree(tiny, where)
    monkeypatch.chdir(where)
    return where


@pytest.mark.slow  # three merges and calibrations of a 2-block model, through the CLI, a run file and Python
def test_the_readme_quickstart_runs_as_written(tiny, tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["featcal", "merge"], ["featcal", "plan"], ["featcal", "calibrate"],
                                         ["featcal", "eval"]]
    cli = workspace(tiny, tmp_path / "cli", monkeypatch)
    for argv in commands:
        capsys.readouterr()
        rc = main([*argv[1:], "--no-progress"])
        out, err = capsys.readouterr()
        assert rc == 0, (argv, err)
        if argv[1] == "plan":
            assert "estimated peak memory per process" in out and "estimated time" in out
    assert (cli / "calibrated" / "drift.png").is_file()
    report = json.loads((cli / "calibrated" / "featcal.json").read_text())
    assert [row["block"] for row in report["drift"]] == [0, 1]
    assert all({"before", "after"} <= set(row) for row in report["drift"])
    assert set(report["end_to_end_drift"]) >= {"merged", "calibrated"}
    evaluation = json.loads((cli / "eval" / "eval.json").read_text())
    assert {r["model"] for r in evaluation["results"]} == {"base", "merged", "calibrated", "experts"}
    assert {r["task"] for r in evaluation["results"]} == {"code", "chat"}

    # the YAML run file, in a fresh copy of the same inputs: the same calibrated weights
    yaml_dir = workspace(tiny, tmp_path / "yaml", monkeypatch)
    (yaml_dir / "run.yaml").write_text(fenced(REPO / "README.md", "Quickstart on your own models", "yaml"))
    assert main(["run", "run.yaml", "--no-progress"]) == 0

    # the Python snippet, likewise
    py_dir = workspace(tiny, tmp_path / "python", monkeypatch)
    exec(compile(fenced(REPO / "README.md", "Quickstart on your own models", "python"), "README.md", "exec"), {})

    want = load_file(cli / "calibrated" / "model.safetensors")
    merged = load_file(cli / "merged" / "model.safetensors")
    assert any(not want[k].equal(merged[k]) for k in want)  # calibration changed the merge
    for other in (yaml_dir, py_dir):
        got = load_file(other / "calibrated" / "model.safetensors")
        assert got.keys() == want.keys()
        assert all(got[k].equal(want[k]) for k in want), other.name
