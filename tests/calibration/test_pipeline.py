"""calibrate_to_dir(CalibrateRequest) end to end on tiny families: outputs, report, validation before work, atomicity."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from featcal import FeatCalConfig
from featcal.calibration.front.pipeline import CalibrateRequest, calibrate_to_dir
from featcal.config import RunOptions
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError, OutputExistsError
from tests.builders.pipeline_family import t5_family

CFG = FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2)




def _run(fam, out, *, overwrite=False, **kw):
    args = dict(merged=fam["merged"], base=fam["base"], experts=fam["experts"], calibration=fam["data"], config=CFG,
                out=out, progress=False)
    args.update(kw)
    return calibrate_to_dir(CalibrateRequest(**args, options=RunOptions(overwrite=overwrite))).report


def _state(cls, path):
    return cls.from_pretrained(path).state_dict()


def _changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if not torch.equal(a[k], b[k])}


def test_clip_image_folders_end_to_end(clip, tmp_path):
    out = tmp_path / "calibrated"
    report = _run(clip, out)
    merged, calibrated = _state(T.CLIPVisionModel, clip["merged"]), _state(T.CLIPVisionModel, out)
    changed = _changed(merged, calibrated)
    assert any(".mlp.fc1.weight" in k for k in changed) and any(".self_attn.k_proj.weight" in k for k in changed)
    assert any(".fc2.bias" in k for k in changed)  # biases are calibrated by default
    assert not any(k.startswith("embeddings.") for k in changed)  # the stem stays merged
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert (out / "preprocessor_config.json").is_file()  # carried from the base, where the data was processed

    on_disk = json.loads((out / "featcal.json").read_text())
    assert on_disk == json.loads(json.dumps(report, default=str))
    assert on_disk["command"] == "calibrate"
    assert on_disk["params"]["lambda_ratio"] == 0.05 and on_disk["params"]["num_calibration_examples"] == 4
    assert set(on_disk["inputs"]["experts"]) == {"task0", "task1"}
    assert "model.safetensors" in on_disk["inputs"]["merged"]["sha256"]
    assert on_disk["inputs"]["calibration"]["task0"]["examples"] == 4
    assert on_disk["inputs"]["calibration"]["task0"]["batches"] == 2
    assert on_disk["inputs"]["processor_dir"] == str(clip["base"])
    blocks = on_disk["drift"]
    assert len(blocks) == 2 and set(blocks[0]) >= {"block", "before", "after"}
    assert set(on_disk["seconds"]) >= {"load", "calibrate", "save", "total"}
    assert on_disk["peak_rss_mb"] > 0
    assert not list(tmp_path.glob(".featcal-tmp-*"))


def test_same_inputs_same_output(clip, tmp_path):
    a, b = _run(clip, tmp_path / "a"), _run(clip, tmp_path / "b")
    assert a["output"]["sha256"]["model.safetensors"] == b["output"]["sha256"]["model.safetensors"]
    other = _run(clip, tmp_path / "c", config=CFG.model_copy(update={"lambda_ratio": 5.0}))
    assert other["output"]["sha256"]["model.safetensors"] != a["output"]["sha256"]["model.safetensors"]


def test_bert_jsonl_end_to_end(bert, tmp_path):
    out = tmp_path / "calibrated"
    report = _run(bert, out)
    changed = _changed(_state(T.BertModel, bert["merged"]), _state(T.BertModel, out))
    assert any("attention.self.query.weight" in k for k in changed)
    assert not any(k.startswith("embeddings.") for k in changed)
    assert T.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [2, 5, 6, 3]  # tokenizer copied
    assert report["inputs"]["calibration"]["task1"]["examples"] == 4
    assert len(report["drift"]) == 2


def test_t5_with_targets_calibrates_encoder_and_decoder(tmp_path):
    fam = t5_family(tmp_path / "fam")
    out = tmp_path / "calibrated"
    report = _run(fam, out)
    assert [(d["stack"], d["layer"]) for d in report["drift"]] == [
        ("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1)
    ]
    changed = _changed(_state(T.T5ForConditionalGeneration, fam["merged"]), _state(T.T5ForConditionalGeneration, out))
    assert any(k.startswith("decoder.block.1.layer.1.EncDecAttention.q") for k in changed)
    assert any(k.startswith("encoder.block.0.") for k in changed)


def test_task_name_mismatch_is_named_before_work(clip, tmp_path):
    data = dict(clip["data"])
    data["tsak1"] = data.pop("task1")
    with pytest.raises(ConfigError, match=r"'task1' have an expert but no calibration data.*'tsak1' have calibration data but no expert"):
        _run(clip, tmp_path / "out", calibration=data)
    assert not (tmp_path / "out").exists()


def test_existing_output_dir_is_refused_then_replaced_on_request(clip, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not empty"):
        _run(clip, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(OutputExistsError, match="replaces only an output featcal wrote"):
        _run(clip, out, overwrite=True)  # not a featcal output: never replaced
    assert (out / "keep.txt").read_text() == "mine"
    (out / "featcal.json").write_text("{}")  # an earlier output: replaced on request
    _run(clip, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_output_may_not_be_an_input(clip):
    with pytest.raises(ConfigError, match="is an input.*merged"):
        _run(clip, clip["merged"], overwrite=True)


def test_write_failure_leaves_nothing(clip, tmp_path, monkeypatch):
    def failing_save(self, directory, *args, **kwargs):
        (directory / "model.safetensors").write_bytes(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(T.PreTrainedModel, "save_pretrained", failing_save)
    with pytest.raises(OSError, match="No space left"):
        _run(clip, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_missing_inputs_are_named(clip, tmp_path):
    experts = {**clip["experts"], "task1": tmp_path / "no-such-expert"}
    with pytest.raises(CheckpointError, match="expert 'task1'.*no-such-expert"):
        _run(clip, tmp_path / "out", experts=experts)
    data = {**clip["data"], "task0": tmp_path / "no-such-data"}
    with pytest.raises(CalibrationDataError, match="task 'task0'.*no-such-data does not exist"):
        _run(clip, tmp_path / "out", calibration=data)
    with pytest.raises(CalibrationDataError, match="task 'task0'.*fewer than the 50"):
        _run(clip, tmp_path / "out", config=CFG.model_copy(update={"num_calibration_examples": 50}))
    assert not (tmp_path / "out").exists()


def test_mixed_architectures_are_refused(clip, bert, tmp_path):
    experts = {**clip["experts"], "task1": bert["experts"]["task1"]}
    with pytest.raises(CheckpointError, match=r"expert 'task1' \(bert\)"):
        _run(clip, tmp_path / "out", experts=experts)
