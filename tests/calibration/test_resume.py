"""Resumable calibration: a run killed after block k continues from there and ends bit-identical."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.calibration.resume import store as resume
from featcal.calibration.resume.store import KILL_ENV, ResumeStateError, ResumeStore, default_resume_dir
from featcal.cli.main import main
from featcal.errors import ConfigError
from tests.builders.data_fixtures import save_image_processor, write_png_folder
from tests.builders.guarantees import calibrate_argv
from tests.builders.pipeline_family import clip_family, task_arithmetic
from tests.builders.reference_featcal import Crash, family_data, killed_after, max_abs_diff, noisy_family

ROOT = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sigkilled_cli_run_resumes_bit_identical(tmp_path, caplog, capsys):
    fam = clip_family(tmp_path / "fam")
    main(calibrate_argv(fam, tmp_path / "straight"))
    assert not default_resume_dir(tmp_path / "straight").exists()  # deleted after a successful write

    out = tmp_path / "killed"
    code = (f"import sys, torch; torch.set_num_threads({torch.get_num_threads()}); "
            "from featcal.cli.main import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, KILL_ENV: "0", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code, *calibrate_argv(fam, out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = default_resume_dir(out)
    assert (state / "block-0000.safetensors").is_file() and not (state / "block-0001.safetensors").exists()
    assert not out.exists()

    # other options: refused, naming what differs, and the state is kept
    assert main(calibrate_argv(fam, out, "--lambda-ratio", "0.5")) == 2
    assert "config differ" in capsys.readouterr().err
    assert (state / "state.json").is_file()

    with caplog.at_level(logging.INFO, logger="featcal"):
        assert main(calibrate_argv(fam, out)) == 0
    assert "1 block(s) already calibrated, continuing at block 1" in caplog.text
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "straight" / "model.safetensors")
    assert not state.exists()


@pytest.mark.parametrize(("kind", "kill_after", "chain_dtype", "spill"), [
    ("t5", 1, "float32", False),  # last encoder block: the resumed run starts by capturing the decoder
    ("t5", 2, "bfloat16", False),  # inside the decoder: position biases come back from the checkpoint
    ("llama", 0, "float32", False),  # rotary (cos, sin) tuples in the context
    ("bert", 0, "float16", True),  # chains spilled to disk, masks in the context
    ("clip", 1, "float32", False),  # after the last block: the rerun only restores
])
def test_interrupted_api_run_resumes_bit_identical(kind, kill_after, chain_dtype, spill, tmp_path, monkeypatch):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    cfg = FeatCalConfig(chain_dtype=chain_dtype, resume_dir=tmp_path / "state",
                        spill_dir=tmp_path / "spill" if spill else None)
    straight = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg.model_copy(
        update={"resume_dir": None}), progress=False)
    with killed_after(monkeypatch, kill_after), pytest.raises(Crash):
        calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert (tmp_path / "state" / f"block-{kill_after:04d}.safetensors").is_file()

    other = {t: [{k: v.clone() for k, v in b.items()} for b in bs] for t, bs in data.items()}
    other["task0"][0][next(iter(other["task0"][0]))] = other["task1"][0][next(iter(other["task1"][0]))]
    with pytest.raises(ResumeStateError, match="data task0"):
        calibrate(merged, base=base, experts=experts, calibration=other, config=cfg, progress=False)

    resumed = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert max_abs_diff(resumed.model, straight.model)[0] == 0.0
    assert resumed.drift == straight.drift
    assert not (tmp_path / "state").exists()


def test_context_skeleton_round_trip_and_refusal():
    ctx = {"mask": torch.ones(2, 3), "pos": (torch.arange(3), torch.zeros(1)), "flag": False, "n": None,
           "lst": [1, "a"]}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = resume.encode_context(ctx, "c", tensors)
    back = resume.decode_context(skeleton, tensors, torch.device("cpu"))
    assert isinstance(back["pos"], tuple) and torch.equal(back["pos"][0], ctx["pos"][0])
    assert back["flag"] is False and back["n"] is None and back["lst"] == [1, "a"]
    with pytest.raises(Exception, match="cannot be checkpointed"):
        resume.encode_context({"cache": object()}, "c", {})


def test_common_position_picks_newest_shared_generation():
    assert resume.common_position([[(3, 0, 3), (4, 0, 4)], [(3, 0, 3)]]) == 3
    assert resume.common_position([[(4, 0, 4)], [(4, 0, 4), (5, 1, 0)]]) == 4
    assert resume.common_position([[], [(1, 0, 1)]]) is None


def test_interrupt_message_says_a_rerun_resumes():
    import argparse

    from featcal.cli.main import interrupted_message

    calibrate_args = argparse.Namespace(command="calibrate", out="o", cfg_resume=True)
    assert "rerunning the same command resumes" in interrupted_message(calibrate_args, KeyboardInterrupt())
    every = argparse.Namespace(command="calibrate", out="o", cfg_resume=True, cfg_checkpoint_every=4)
    assert "checkpoint after every 4 blocks" in interrupted_message(every, KeyboardInterrupt())
    off = argparse.Namespace(command="calibrate", out="o", cfg_resume=False)
    assert "Nothing can be resumed" in interrupted_message(off, KeyboardInterrupt())


# --- --checkpoint-every N ----------------------------------------------------------------------------


def _record_commits(monkeypatch) -> list[tuple[int, list[int]]]:
    """(blocks done, block files written) of every checkpoint committed from now on."""
    commits: list[tuple[int, list[int]]] = []
    original = ResumeStore.commit

    def commit(self, position, blocks, chains):
        commits.append((position.blocks_done, sorted(blocks)))
        return original(self, position, blocks, chains)
    monkeypatch.setattr(ResumeStore, "commit", commit)
    return commits


@pytest.mark.parametrize(("kind", "every", "kill_after", "first", "then", "offload"), [
    # T5: 4 blocks (2 encoder, 2 decoder). Killed after block 2, which had no checkpoint: resumes at block 2
    ("t5", 2, 2, [(2, [0, 1])], [(4, [2, 3])], False),
    # killed before the first checkpoint: nothing to resume, starts again; the last block always checkpoints
    ("t5", 3, 1, [], [(3, [0, 1, 2]), (4, [3])], True),
    ("llama", 5, 0, [], [(2, [0, 1])], False),  # N beyond the block count: one checkpoint, after the last
])
def test_checkpoint_every_n_resumes_from_the_last_checkpoint(kind, every, kill_after, first, then, offload,
                                                            tmp_path, monkeypatch, caplog):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    cfg = FeatCalConfig(resume_dir=tmp_path / "state", checkpoint_every=every, offload_blocks=offload)
    straight = calibrate(merged, base=base, experts=experts, calibration=data,
                         config=FeatCalConfig(), progress=False)

    commits = _record_commits(monkeypatch)
    with killed_after(monkeypatch, kill_after), pytest.raises(Crash):
        calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert commits == first
    done = first[-1][0] if first else 0
    written = sorted(p.name for p in (tmp_path / "state").glob("block-*")) if first else []
    assert written == [f"block-{k:04d}.safetensors" for k in range(done)]

    commits.clear()
    with caplog.at_level(logging.INFO, logger="featcal"):
        resumed = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert ("already calibrated" in caplog.text) == bool(first)
    if first:
        assert f"{done} block(s) already calibrated, continuing at block {done}" in caplog.text
    assert commits == then
    assert max_abs_diff(resumed.model, straight.model)[0] == 0.0
    assert resumed.drift == straight.drift
    assert not (tmp_path / "state").exists()


def test_checkpoint_every_is_validated(tmp_path, capsys):
    from featcal.config import parse

    with pytest.raises(ConfigError, match="checkpoint_every: Input should be greater than or equal to 1"):
        parse(FeatCalConfig, {"checkpoint_every": 0})
    fam = clip_family(tmp_path / "fam")
    assert main(calibrate_argv(fam, tmp_path / "out", "--checkpoint-every", "0")) == 2
    assert "checkpoint_every: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _clip_family_4_blocks(root: Path) -> dict:
    """clip_family with 4 blocks instead of 2, so that a checkpoint can lie between the first and the kill."""
    import transformers as T

    from tests.builders import tiny

    cfg = tiny.tiny_config("clip")
    cfg.num_hidden_layers = 4
    torch.manual_seed(0)
    base = T.CLIPVisionModel(cfg).eval()
    base_dir = tiny.save(base, root / "base")
    save_image_processor(base_dir)
    experts = {f"task{i}": tiny.save(tiny.perturbed(base, 100 + i), root / f"expert{i}") for i in range(2)}
    merged = task_arithmetic("clip", base_dir, experts, root / "merged")
    data = {t: write_png_folder(root / f"data-{t}", n_per_class=2, seed=i) for i, t in enumerate(experts)}
    return {"base": base_dir, "experts": experts, "merged": merged, "data": data}


def test_sigkilled_after_an_unchecked_block_resumes_from_the_last_checkpoint(tmp_path, caplog):
    fam = _clip_family_4_blocks(tmp_path / "fam")
    main(calibrate_argv(fam, tmp_path / "straight"))  # checkpoint after every block

    out = tmp_path / "killed"
    every = ("--checkpoint-every", "2")
    code = (f"import sys, torch; torch.set_num_threads({torch.get_num_threads()}); "
            "from featcal.cli.main import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, KILL_ENV: "2", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code, *calibrate_argv(fam, out, *every)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = default_resume_dir(out)
    assert sorted(p.name for p in state.glob("block-*")) == ["block-0000.safetensors", "block-0001.safetensors"]
    assert [p.name for p in state.glob("chains-*")] == ["chains-0002"]  # block 2 finished but was not checkpointed

    with caplog.at_level(logging.INFO, logger="featcal"):
        assert main(calibrate_argv(fam, out, *every)) == 0
    assert "2 block(s) already calibrated, continuing at block 2" in caplog.text
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "straight" / "model.safetensors")
    assert not state.exists()
