"""Nothing lost: featcal deletes only what it created (resume state), and never an input under --out."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from featcal.calibration.resume.store import CREATED, KILL_ENV, default_resume_dir
from featcal.cli.main import main
from featcal.io.write import atomic
from featcal.io.write.atomic import OutputWriteError, _host_tag, atomic_output_dir
from tests.builders.guarantees import calibrate_argv, cli, copy_family, merge_argv, one_line_error
from tests.builders.pipeline_family import clip_family
from tests.builders.tiny import make_family

ROOT = Path(__file__).resolve().parents[2]


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
    argv = calibrate_argv(fam, work / "out", "--resume-dir", str(work))
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
    argv = calibrate_argv(fam, tmp_path / "out", "--resume-dir", str(state))
    _kill_after_block0(argv)
    assert (state / CREATED).is_file() and (state.parent / CREATED).is_file()
    assert main(argv) == 0, capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # both levels were featcal's and are empty: removed
    # the default (hidden sibling of --out) as before
    assert main(calibrate_argv(fam, tmp_path / "out2")) == 0
    assert not default_resume_dir(tmp_path / "out2").exists()


def test_resume_dir_files_of_the_user_named_like_state_survive_a_fresh_run(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    work = tmp_path / "w"
    work.mkdir()
    (work / "chains-notes.txt").write_text("mine")  # looks like featcal's, is not
    (work / "block-12.txt").write_text("mine")
    assert main(calibrate_argv(fam, tmp_path / "out", "--resume-dir", str(work))) == 0, capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["block-12.txt", "chains-notes.txt"]


@pytest.mark.parametrize("where", ["base", "merged", "expert", "out"])
def test_resume_dir_in_an_input_or_the_output_is_refused_before_work(tmp_path, capsys, where):
    fam = clip_family(tmp_path / "fam")
    target = {"base": fam["base"], "merged": fam["merged"], "expert": next(iter(fam["experts"].values())),
              "out": tmp_path / "out" / "state"}[where]
    before = _tree(tmp_path / "fam")
    capsys.readouterr()
    assert main(calibrate_argv(fam, tmp_path / "out", "--resume-dir", str(target))) == 2
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
    assert main(calibrate_argv(fam, tmp_path / "fam", "--overwrite")) == 2
    assert "contains an input" in capsys.readouterr().err
    data = next(iter(fam["data"].values()))
    assert main(calibrate_argv(fam, data, "--overwrite")) == 2
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


# --- item 4: one rule for which weights a folder holds ------------------------------------------------------


def test_a_folder_with_both_a_single_file_and_a_shard_index_is_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    fam = copy_family(clip_family(tmp_path / "src"), tmp_path / "fam")
    expert = fam["experts"]["task1"]
    tensors = load_file(str(expert / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names}, str(expert / "model-00001-of-00001.safetensors"))
    (expert / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    for argv in (merge_argv(fam["base"], fam["experts"], tmp_path / "m"), calibrate_argv(fam, tmp_path / "c")):
        rc, _, err = cli(argv, capsys)
        assert rc == 2
        line = one_line_error(err)
        assert "holds both model.safetensors and a shard index" in line and "expert1" in line, line
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


# --- item 11: a real full disk ------------------------------------------------------------------------------


def _in_a_small_filesystem(size: str, argv: list[str], mount_point: Path, options: str = "") -> tuple[int, str, list[str]]:
    """Run `featcal ARGV` with a fresh tmpfs of `size` mounted at `mount_point`, in a private mount namespace
    (gone with the process: nothing to unmount, nothing seen by the rest of the machine).
    Returns (exit code, stderr, what the filesystem held afterwards)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    script = (f'mount -t tmpfs -o size={size}{options} tmpfs "{mount_point}" || exit 99; '
              f'"{sys.executable}" -c "import sys; from featcal.cli.main import main; sys.exit(main(sys.argv[1:]))" "$@"; '
              f'rc=$?; find "{mount_point}" -mindepth 1; exit $rc')
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([*unshare, "sh", "-c", script, "featcal", *[str(a) for a in argv]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 99, f"could not mount a tmpfs for this test: {proc.stderr}"
    return proc.returncode, proc.stderr, proc.stdout.split()


def test_a_real_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    fam = clip_family(tmp_path / "fam")
    disk = tmp_path / "disk"
    out = disk / "nested" / "out"
    rc, err, left = _in_a_small_filesystem("48k", merge_argv(fam["base"], fam["experts"], out), disk)  # needs ~150 KB
    assert rc == 2, err[-3000:]
    assert one_line_error(err.strip().splitlines()[-1]) == (
        f"featcal: error: could not write {out}: No space left on device; nothing was written there "
        "(the temporary directory was removed)")
    assert "Traceback" not in err and left == []

    # calibrate: its resume checkpoint (beside the output) is the first thing to fill the disk
    rc, err, left = _in_a_small_filesystem("48k", calibrate_argv(fam, out), disk)
    assert rc == 2, err[-3000:]
    line = one_line_error(err.strip().splitlines()[-1])
    assert "could not write the resume checkpoint in" in line and "No space left on device" in line, line
    assert "Traceback" not in err and left == []
    rc, err, left = _in_a_small_filesystem("48k", calibrate_argv(fam, out, "--no-resume"), disk)
    assert rc == 2, err[-3000:]
    assert one_line_error(err.strip().splitlines()[-1]).startswith(f"featcal: error: could not write {out}: No space left")
    assert "Traceback" not in err and left == []


# --- item 15: leftovers and late failures ---------------------------------------------------------------------


def test_an_output_on_a_read_only_or_impossible_path_is_refused_before_work(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    ro = tmp_path / "ro"
    rc, err, _ = _in_a_small_filesystem("1m", calibrate_argv(fam, ro / "out", "--no-resume"), ro, options=",ro")
    assert rc == 2, err[-3000:]
    line = one_line_error(err.strip().splitlines()[-1])
    assert f"cannot write the output {ro / 'out'}: {ro} is not writable (Read-only file system)" in line, line

    (tmp_path / "a-file").write_text("x")
    for argv in (merge_argv(fam["base"], fam["experts"], tmp_path / "a-file" / "out"),
                 calibrate_argv(fam, tmp_path / "a-file" / "sub" / "out")):
        rc, _, err = cli(argv, capsys)
        assert rc == 2 and "is a file, not a directory" in one_line_error(err)


def test_a_sigkilled_run_leaves_a_scratch_merge_that_the_next_run_removes(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    out = tmp_path / "runs" / "out"
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(fam["base"]), "experts": {t: str(p) for t, p in fam["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in fam["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
        "out": str(out),
    }))
    _kill_after_block0(["run", str(run), "--no-progress"])
    stale = [p.name for p in out.parent.iterdir() if p.name.startswith(".featcal-")]
    assert any(n.startswith(".featcal-merge-out-") for n in stale), stale  # a whole merged checkpoint
    busy = out.parent / f".featcal-merge-out-{os.getpid()}_{_host_tag()}-live"  # a live process's: kept
    busy.mkdir()
    rc, _, err = cli(["run", str(run), "--no-progress"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([busy.name, "out"])


def test_a_killed_writes_temporary_output_is_removed_by_the_next_write(tmp_path):
    parent = tmp_path / "p"
    parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited: its temp dirs are leftovers
    for prefix in (".featcal-tmp-out-", ".featcal-tmp-old-out-"):
        (parent / f"{prefix}{pid}_{_host_tag()}-abc123").mkdir()
        (parent / f"{prefix}{pid}_{_host_tag()}-abc123" / "model.safetensors").write_bytes(b"half")
    other_host = parent / f".featcal-tmp-out-{pid}_00000000-abc123"  # another machine's (shared disk): kept
    other_host.mkdir()
    other_out = parent / f".featcal-tmp-other-{pid}_{_host_tag()}-abc123"  # another output's: kept
    other_out.mkdir()
    with atomic_output_dir(parent / "out") as d:
        (d / "x").write_text("new")
    assert sorted(p.name for p in parent.iterdir()) == sorted(["out", other_host.name, other_out.name])


def test_a_swap_that_cannot_move_the_old_output_aside_leaves_no_temp_dir(tmp_path, monkeypatch):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"old")
    real = os.replace

    def first_fails(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", first_fails)
    with pytest.raises(OutputWriteError, match="previous content is intact"), atomic_output_dir(out, overwrite=True) as d:
        (d / "model.safetensors").write_bytes(b"new")
    assert (out / "model.safetensors").read_bytes() == b"old"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_a_spill_dir_featcal_created_is_removed_and_a_users_is_kept(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    spill = tmp_path / "new" / "spill"
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "o1", "--spill-dir", str(spill)), capsys)
    assert rc == 0, err
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "o2", "--spill-dir", str(mine)), capsys)
    assert rc == 0, err
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"]


def test_outputs_follow_the_umask(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    old = os.umask(0o022)
    try:
        rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
        assert rc == 0, err
        rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "m"), capsys)
        assert rc == 0, err
    finally:
        os.umask(old)
    for d in (tmp_path / "out", tmp_path / "m"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, oct(d.stat().st_mode)
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, (f, oct(f.stat().st_mode))


@pytest.mark.parametrize("command", ["plan", "dry-run"])
def test_plan_and_dry_run_check_the_data_and_the_output(tmp_path, capsys, command):
    fam = copy_family(clip_family(tmp_path / "src"), tmp_path / "fam")
    extra = ("--dry-run",) if command == "dry-run" else ()
    argv = calibrate_argv(fam, tmp_path / "out", *extra)
    if command == "plan":
        argv[0] = "plan"
    rc, out, err = cli(argv, capsys)
    assert rc == 0 and "estimated peak memory" in out, err
    for f in Path(fam["data"]["task1"]).rglob("*.png"):
        f.unlink()  # task1 now has no images
    rc, out, err = cli(argv, capsys)
    assert rc == 2 and "task1" in one_line_error(err) and "estimated" not in out, err


# --- beyond the list: --overwrite of a folder featcal did not write; a run file under its own out ------------


@pytest.mark.parametrize("command", ["merge", "calibrate"])
def test_overwrite_replaces_only_an_output_featcal_wrote(tmp_path, capsys, command):
    fam = clip_family(tmp_path / "fam")
    home = tmp_path / "home"  # `--out ~ --overwrite`, a typo away
    (home / "thesis").mkdir(parents=True)
    (home / "thesis" / "draft.tex").write_text("years of work")
    before = _tree(home)
    argv = (merge_argv(fam["base"], fam["experts"], home, "--overwrite") if command == "merge"
            else calibrate_argv(fam, home, "--overwrite"))
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and "replaces only an output featcal wrote" in one_line_error(err)
    assert _tree(home) == before
    # an output featcal wrote is replaced as before
    out = tmp_path / "out"
    first = merge_argv(fam["base"], fam["experts"], out) if command == "merge" else calibrate_argv(fam, out)
    assert cli(first, capsys)[0] == 0
    assert cli([*first, "--overwrite"], capsys)[0] == 0 and (out / "featcal.json").is_file()


def test_a_run_file_inside_its_own_out_is_refused(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    work = tmp_path / "work"
    work.mkdir()
    (work / "featcal.json").write_text("{}")  # looks like an earlier output, so --overwrite would replace it
    run = work / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(fam["base"]), "experts": {t: str(p) for t, p in fam["experts"].items()}},
        "out": ".", "overwrite": True,
    }))
    rc, _, err = cli(["run", str(run), "--no-progress"], capsys)
    assert rc == 2 and "run file" in one_line_error(err)
    assert run.is_file()


@pytest.mark.parametrize("command", [["zoo", "build", "--preset", "tiny"], ["bench", "--preset", "tiny"]])
def test_zoo_build_and_bench_overwrite_only_what_they_wrote(tmp_path, capsys, command):
    home = tmp_path / "home"
    home.mkdir()
    (home / "file.txt").write_text("keep")
    rc, _, err = cli([*command, "--out", str(home), "--overwrite", "--no-progress"], capsys)
    assert rc == 2 and "replaces only an output featcal wrote" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"] and (home / "file.txt").read_text() == "keep"
