"""Nothing lost: featcal deletes only what it created (resume state), and never an input under --out."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from featcal.calibration.resume import CREATED, KILL_ENV, default_resume_dir
from featcal.cli.main import main
from test_pipeline_support import clip_family
from test_resume import _argv
from tiny import make_family

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its content hash (what a user would miss)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _kill_after_block0(argv: list[str]) -> None:
    code = "import sys; from featcal.cli.main import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, KILL_ENV: "0", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]


def test_resume_dir_of_the_user_keeps_everything_but_featcal_state(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    work = tmp_path / "w"
    work.mkdir()
    (work / "other.txt").write_text("keep")
    (work / "notes").mkdir()
    (work / "notes" / "n.txt").write_text("keep too")
    argv = _argv(fam, work / "out", "--resume-dir", str(work))
    _kill_after_block0(argv)  # leaves state in the user's directory
    assert (work / "state.json").is_file() and (work / "block-0000.safetensors").is_file()
    assert main(argv) == 0, capsys.readouterr().err
    assert (work / "other.txt").read_text() == "keep"
    assert (work / "notes" / "n.txt").read_text() == "keep too"
    assert (work / "out" / "model.safetensors").is_file()  # the output inside the resume dir survives
    left = sorted(p.name for p in work.iterdir())
    assert left == ["notes", "other.txt", "out"], left  # state.json, blocks and chains gone, nothing else


def test_resume_dir_featcal_created_is_removed_whole(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    state = tmp_path / "new" / "state"
    argv = _argv(fam, tmp_path / "out", "--resume-dir", str(state))
    _kill_after_block0(argv)
    assert (state / CREATED).is_file() and (state.parent / CREATED).is_file()
    assert main(argv) == 0, capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # both levels were featcal's and are empty: removed
    # the default (hidden sibling of --out) as before
    assert main(_argv(fam, tmp_path / "out2")) == 0
    assert not default_resume_dir(tmp_path / "out2").exists()


def test_resume_dir_files_of_the_user_named_like_state_survive_a_fresh_run(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    work = tmp_path / "w"
    work.mkdir()
    (work / "chains-notes.txt").write_text("mine")  # looks like featcal's, is not
    (work / "block-12.txt").write_text("mine")
    assert main(_argv(fam, tmp_path / "out", "--resume-dir", str(work))) == 0, capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["block-12.txt", "chains-notes.txt"]


@pytest.mark.parametrize("where", ["base", "merged", "expert", "out"])
def test_resume_dir_in_an_input_or_the_output_is_refused_before_work(tmp_path, capsys, where):
    fam = clip_family(tmp_path / "fam")
    target = {"base": fam["base"], "merged": fam["merged"], "expert": next(iter(fam["experts"].values())),
              "out": tmp_path / "out" / "state"}[where]
    before = _tree(tmp_path / "fam")
    capsys.readouterr()
    assert main(_argv(fam, tmp_path / "out", "--resume-dir", str(target))) == 2
    err = capsys.readouterr().err
    assert "resume directory" in err and "--resume-dir" in err and err.count("\n") == 1, err
    assert _tree(tmp_path / "fam") == before
    assert not (tmp_path / "out").exists()


def test_merge_out_holding_an_input_is_refused_even_with_overwrite(tmp_path, capsys):
    base, experts = make_family("bert", tmp_path / "fam", n_experts=2)
    before = _tree(tmp_path / "fam")
    argv = ["merge", "--base", str(base), *sum((["--expert", f"{t}={d}"] for t, d in experts.items()), []),
            "--out", str(tmp_path / "fam"), "--overwrite", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "contains an input" in err and "base" in err, err
    assert _tree(tmp_path / "fam") == before
    # through a symlink and `..` as well
    (tmp_path / "link").symlink_to(tmp_path / "fam")
    argv[argv.index("--out") + 1] = str(tmp_path / "link" / "expert0" / "..")
    assert main(argv) == 2
    assert _tree(tmp_path / "fam") == before


def test_calibrate_out_holding_an_input_or_its_data_is_refused(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    before = _tree(tmp_path / "fam")
    assert main(_argv(fam, tmp_path / "fam", "--overwrite")) == 2
    assert "contains an input" in capsys.readouterr().err
    data = next(iter(fam["data"].values()))
    assert main(_argv(fam, data, "--overwrite")) == 2
    assert "is an input (calibration data" in capsys.readouterr().err
    assert _tree(tmp_path / "fam") == before


def test_run_file_out_holding_an_input_is_refused(tmp_path, capsys):
    base, experts = make_family("bert", tmp_path / "fam", n_experts=2)
    before = _tree(tmp_path / "fam")
    run = tmp_path / "fam" / "run.yaml"
    lines = ["merge:", "  method: task_arithmetic", "  base: base", "  experts:"]
    lines += [f"    {t}: {Path(d).name}" for t, d in experts.items()]
    lines += ["out: .", "overwrite: true"]
    run.write_text("\n".join(lines) + "\n")
    before = _tree(tmp_path / "fam")
    assert main(["run", str(run), "--no-progress"]) == 2
    assert "contains an input" in capsys.readouterr().err
    assert _tree(tmp_path / "fam") == before
