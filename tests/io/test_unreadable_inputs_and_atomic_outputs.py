"""Guarantees, files: unreadable inputs are named, outputs are never half-written or silently replaced.

Covers docs/guarantees.md "Outputs" and "Interrupts": truncated / garbage / empty safetensors and
broken JSON through the CLI, an existing output directory, a full disk (ENOSPC while saving, at
fsync, while swapping an old output out), Ctrl-C and SIGTERM midway through merge, calibrate and run.
Every failure leaves the target absent or exactly as it was, and no temporary directory behind.
"""

from __future__ import annotations

import errno
import os
import re
import signal

import pytest
import transformers as T
import yaml

import featcal.merging.api as merge_api
import featcal.merging.writer as writer
from featcal import merge
from featcal.calibration.engine.driver import FeatCalEngine
from featcal.calibration.resume.store import default_resume_dir
from featcal.io.process import interrupts
from featcal.io.write import atomic
from featcal.io.write.atomic import OutputWriteError, atomic_output_dir
from featcal.merging.mergers import TaskArithmetic
from tests.builders.guarantees import (
    calibrate_argv,
    cli,
    copy_family,
    leftovers,
    merge_argv,
    one_line_error,
    snapshot,
)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture
def old_output(tmp_path):
    """An existing output directory with content that must survive any failed --overwrite."""
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"the previous, good checkpoint")
    (out / "featcal.json").write_text("{}")
    return out


def _run_file(fam, tmp_path, out, **top):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(fam["base"]), "experts": {t: str(p) for t, p in fam["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in fam["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
        "out": str(out), **top,
    }))
    return run


# --- unreadable inputs --------------------------------------------------------------------------------


def _truncate(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _garbage(d):
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


def _empty(d):
    (d / "model.safetensors").write_bytes(b"")


def _broken_config(d):
    (d / "config.json").write_text('{"model_type": "clip_vision_model", ')


def _index_to_a_missing_shard(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )


UNREADABLE = {
    "truncated": (_truncate, r"cannot read .*model.safetensors: .*incomplete metadata, file not fully covered "
                             r"\(truncated or not a safetensors file\?\)"),
    "garbage": (_garbage, r"cannot read .*model.safetensors: .*\(truncated or not a safetensors file\?\)"),
    "empty file": (_empty, r"cannot read .*model.safetensors: .*\(truncated or not a safetensors file\?\)"),
    "broken config.json": (_broken_config, r"cannot read .*config.json: "),
    "index names a missing shard": (_index_to_a_missing_shard,
                                    r"shard model-00002-of-00002.safetensors named in the index is missing"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
@pytest.mark.parametrize("command", ["merge", "calibrate"])
def test_unreadable_checkpoints_are_named(clip, tmp_path, capsys, command, case):
    damage, message = UNREADABLE[case]
    fam = copy_family(clip, tmp_path / "fam")
    damage(fam["experts"]["task1"])
    out = tmp_path / "out"
    argv = merge_argv(fam["base"], fam["experts"], out) if command == "merge" else calibrate_argv(fam, out)
    rc, _, err = cli(argv, capsys)
    assert rc == 2
    line = one_line_error(err)
    assert re.search(message, line) and "expert1" in line, line
    assert not out.exists() and leftovers(tmp_path) == []


def test_truncated_merged_model_is_named(clip, tmp_path, capsys):
    fam = copy_family(clip, tmp_path / "fam")
    _truncate(fam["merged"])
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 2 and one_line_error(err).startswith("featcal: error: merged model: cannot read ")


# --- an output directory that exists --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["merge", "calibrate", "run"])
def test_existing_output_is_never_replaced_silently(clip, tmp_path, capsys, old_output, command):
    before = snapshot(old_output)
    argv = {
        "merge": merge_argv(clip["base"], clip["experts"], old_output),
        "calibrate": calibrate_argv(clip, old_output),
        "run": ["run", _run_file(clip, tmp_path, old_output), "--no-progress"],
    }[command]
    rc, _, err = cli(argv, capsys)
    assert rc == 2
    assert f"output directory {old_output} exists and is not empty; pass --overwrite" in one_line_error(err)
    assert snapshot(old_output) == before and leftovers(tmp_path) == []
    rc, _, err = cli(argv + ["--overwrite"] if command != "run" else ["run", _run_file(
        clip, tmp_path, old_output, overwrite=True), "--no-progress"], capsys)
    assert rc == 0, err
    assert (old_output / "model.safetensors").read_bytes() != b"the previous, good checkpoint"
    assert leftovers(tmp_path) == []


def test_output_path_that_is_a_file(clip, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a directory")
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], out, "--overwrite"), capsys)
    assert rc == 2 and f"output path {out} exists and is not a directory" in one_line_error(err)
    assert out.read_text() == "not a directory"


# --- a full disk -------------------------------------------------------------------------------------------


def _half_then_enospc(state, filename, metadata=None):
    with open(filename, "wb") as fh:
        fh.write(b"\x00" * 100)  # the first bytes made it to disk, then the disk filled up
    raise ENOSPC


def test_merge_on_a_full_disk_leaves_nothing(clip, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(writer, "save_file", _half_then_enospc)
    out = tmp_path / "new" / "nested" / "out"
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], out), capsys)
    assert rc == 2
    assert one_line_error(err) == (
        f"featcal: error: could not write {out}: No space left on device; nothing was written there "
        "(the temporary directory was removed)"
    )
    assert list(tmp_path.iterdir()) == []  # not even the parent directories it created


def test_merge_overwrite_on_a_full_disk_keeps_the_old_output(clip, tmp_path, capsys, monkeypatch, old_output):
    before = snapshot(old_output)
    monkeypatch.setattr(writer, "save_file", _half_then_enospc)
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], old_output, "--overwrite"), capsys)
    assert rc == 2 and "No space left on device" in one_line_error(err) and "previous content is intact" in err
    assert snapshot(old_output) == before and leftovers(tmp_path) == []


def test_calibrate_on_a_full_disk_leaves_nothing(clip, tmp_path, capsys, monkeypatch, old_output):
    def failing_save(self, directory, *args, **kwargs):
        (directory / "model.safetensors").write_bytes(b"half a checkpoint")
        raise ENOSPC

    monkeypatch.setattr(T.PreTrainedModel, "save_pretrained", failing_save)
    before = snapshot(old_output)
    rc, _, err = cli(calibrate_argv(clip, old_output, "--overwrite"), capsys)
    assert rc == 2 and "could not write" in one_line_error(err) and "No space left on device" in err
    assert snapshot(old_output) == before
    rc, _, err = cli(["run", _run_file(clip, tmp_path, tmp_path / "run-out"), "--no-progress"], capsys)
    assert rc == 2 and "No space left on device" in one_line_error(err)
    assert not (tmp_path / "run-out").exists()
    assert leftovers(tmp_path) == []  # the run's scratch merge is gone too


def test_enospc_at_fsync_leaves_nothing(tmp_path, monkeypatch):
    def full(fd):
        raise ENOSPC

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OutputWriteError, match="No space left on device") as info, atomic_output_dir(tmp_path / "o") as d:
        (d / "model.safetensors").write_bytes(b"x" * 10)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_failed_swap_puts_the_old_output_back(tmp_path, monkeypatch, old_output):
    before = snapshot(old_output)
    real = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old output moved aside; moving the new one in fails
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OutputWriteError, match="previous content is intact"), \
            atomic_output_dir(old_output, overwrite=True) as d:
        (d / "model.safetensors").write_bytes(b"new")
    assert snapshot(old_output) == before
    assert leftovers(tmp_path) == []


# --- interrupts ---------------------------------------------------------------------------------------------


def _interrupt_after(monkeypatch, cls, method, calls: int, exc=KeyboardInterrupt):
    """Make cls.method raise `exc` on its `calls`-th call (the earlier ones do their real work)."""
    real = getattr(cls, method)
    count = {"n": 0}

    def wrapped(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] == calls:
            raise exc()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapped)
    return count


def _assert_interrupted(rc, err, out):
    assert rc == 130
    assert f"featcal: interrupted; the output directory {out} was left untouched" in err
    assert "rerun" in err and "the same command" in err and "Traceback" not in err


def test_ctrl_c_while_merging(clip, tmp_path, capsys, monkeypatch, old_output):
    count = _interrupt_after(monkeypatch, TaskArithmetic, "merge_tensor", 5)
    out = tmp_path / "out"
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], out), capsys)
    _assert_interrupted(rc, err, out)
    assert "no temporary files remain. Nothing can be resumed" in err
    assert count["n"] == 5 and not out.exists()
    before = snapshot(old_output)
    count["n"] = 0
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], old_output, "--overwrite"), capsys)
    _assert_interrupted(rc, err, old_output)
    assert snapshot(old_output) == before and leftovers(tmp_path) == []


def test_ctrl_c_while_writing(clip, tmp_path, capsys, monkeypatch, old_output):
    def half_then_interrupt(state, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\x00" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "save_file", half_then_interrupt)
    before = snapshot(old_output)
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], old_output, "--overwrite"), capsys)
    _assert_interrupted(rc, err, old_output)
    assert snapshot(old_output) == before and leftovers(tmp_path) == []


def test_ctrl_c_while_calibrating(clip, tmp_path, capsys, monkeypatch, old_output):
    count = _interrupt_after(monkeypatch, FeatCalEngine, "_calibrate_block", 2)  # block 0 done, block 1 starts
    before = snapshot(old_output)
    rc, _, err = cli(calibrate_argv(clip, old_output, "--overwrite"), capsys)
    _assert_interrupted(rc, err, old_output)
    state = default_resume_dir(old_output)
    assert f"Calibration keeps a checkpoint after every block in {state}: rerunning the same command resumes" in err
    assert count["n"] == 2 and snapshot(old_output) == before and state.is_dir()
    rc, _, err = cli(calibrate_argv(clip, old_output, "--overwrite"), capsys)  # the rerun the message promises
    assert rc == 0, err
    assert snapshot(old_output) != before and not state.exists() and leftovers(tmp_path) == []

    out = tmp_path / "run-out"
    count["n"] = 0
    rc, _, err = cli(["run", _run_file(clip, tmp_path, out), "--no-progress"], capsys)
    assert rc == 130 and "left untouched" in err and "beside the output" in err
    assert not out.exists() and leftovers(tmp_path) == []  # the scratch merge is removed too


def test_sigterm_cleans_up_like_ctrl_c(clip, tmp_path, capsys, monkeypatch):
    real = merge_api.merge_family

    def terminated_midway(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the handler main() installed
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_api, "merge_family", terminated_midway)
    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], out), capsys)
    assert rc == 130 and "featcal: terminated (SIGTERM);" in err and "left untouched" in err
    assert not out.exists() and leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is handler  # main() restores the previous handler
    assert not interrupts.requested()  # and forgets the request: a later call in this process is not stopped


def test_python_api_lets_ctrl_c_through_untouched(clip, tmp_path, monkeypatch, old_output):
    _interrupt_after(monkeypatch, TaskArithmetic, "merge_tensor", 3)
    before = snapshot(old_output)
    with pytest.raises(KeyboardInterrupt):
        merge(clip["base"], clip["experts"], out=old_output, overwrite=True, progress=False)
    assert snapshot(old_output) == before and leftovers(tmp_path) == []
