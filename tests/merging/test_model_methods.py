"""RegMean, RegMean++ and WUDI as merge methods of `featcal merge`, `featcal.merge` and `featcal run`.

Same outputs as every other merge method (safetensors named like the base, featcal.json, atomic,
deterministic); RegMean(++) read calibration data as `featcal calibrate` does and refuse, before any
work, a run without it or with data for tasks that are not experts; WUDI refuses data.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
import yaml

import featcal.merging.api as merge_api
from featcal import merge
from featcal.config import MergeConfig
from featcal.errors import CalibrationDataError, ConfigError
from featcal.experiments.baselines import run_baseline
from featcal.io.read.checkpoint import CheckpointReader
from featcal.io.read.models import load_model
from featcal.merging.method_params import RegMeanParams, WudiParams
from tests.builders.data_fixtures import save_tokenizer, sentences, write_jsonl
from tests.builders.guarantees import cli, merge_argv, one_line_error, weights_sha
from tests.builders.tiny import make_family, sample_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = ("--num-calibration-examples", "4", "--calibration-batch-size", "2")
FAST = {"regmean": (), "regmean++": (), "wudi": ("--steps", "20", "--lr", "1e-4")}



@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """One BERT expert, a tokenizer beside the base, and texts of different lengths (so batches pad)."""
    root = tmp_path_factory.mktemp("bert")
    base, experts = make_family("bert", root, n_experts=1, scale=0.2)
    save_tokenizer(base, "bert")
    data = write_jsonl(root / "texts.jsonl", [{"text": s} for s in sentences(6, seed=0)])
    return {"base": base, "experts": experts, "data": {"task0": data}}


def _calib_flags(fam: dict) -> list[str]:
    return [a for t, d in fam["data"].items() for a in ("--calib", f"{t}={d}")]


def _state(directory) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(directory)
    return {k: reader.get(k) for k in reader.keys()}


@pytest.mark.parametrize("method", ["regmean", "regmean++", "wudi"])
def test_cli_and_api_write_the_same_ordinary_checkpoint(clip, tmp_path, capsys, method):
    data = _calib_flags(clip) if method != "wudi" else []
    flags = ("--method", method, *FAST[method], *(DATA if data else ()))
    rc, out, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "cli", *flags, *data), capsys)
    assert rc == 0, err
    assert out.strip().splitlines()[-1].startswith(f"merged 2 experts with {method}")
    params = dict(zip(flags[2::2], flags[3::2], strict=True))  # the method's own flags, as API keywords
    keywords = {k.lstrip("-").replace("-", "_"): float(v) if "." in v or "e" in v else int(v) for k, v in params.items()}
    api = merge(clip["base"], clip["experts"], method, out=tmp_path / "api", progress=False,
                calibration=clip["data"] if data else None, **keywords)
    written = _state(tmp_path / "cli")
    assert written.keys() == _state(clip["base"]).keys()
    assert all(torch.equal(written[k], api[k]) for k in api)
    assert type(T.AutoModel.from_pretrained(tmp_path / "cli")) is T.CLIPVisionModel
    average = merge(clip["base"], clip["experts"], "average", progress=False)
    w = "encoder.layers.0.mlp.fc1.weight"
    assert (api[w] - average[w]).abs().max() > 1e-4  # a method of its own, not the average

    report = json.loads((tmp_path / "cli" / "featcal.json").read_text())
    assert report["params"]["method"] == method
    if method == "wudi":
        assert report["params"] == {"method": "wudi", "steps": 20, "lr": 1e-4, "seed": 0}
        assert "calibration" not in report["inputs"]
    else:
        assert report["params"]["alpha"] == 0.9 and report["params"]["num_calibration_examples"] == 4
        calib = report["inputs"]["calibration"]
        assert set(calib) == set(clip["experts"])
        assert all(c["examples"] == 4 and c["batches"] == 2 and len(c["tensors_sha256"]) == 64 for c in calib.values())


def test_regmean_of_one_expert_is_the_expert(bert, tmp_path, capsys):
    """Whatever the Grams (texts of several lengths, padded), the solve of one expert gives its weights."""
    rc, _, err = cli(merge_argv(bert["base"], bert["experts"], tmp_path / "m", "--method", "regmean",
                                *_calib_flags(bert), *DATA), capsys)
    assert rc == 0, err
    merged, expert = load_model(tmp_path / "m").state_dict(), load_model(bert["experts"]["task0"]).state_dict()
    assert merged.keys() == expert.keys()
    assert max((merged[k].float() - expert[k].float()).abs().max().item() for k in merged) < 1e-5


def test_api_matches_the_baseline_on_in_memory_batches(clip):
    """featcal.merge(method="regmean", calibration=batches) is featcal.experiments.baselines' RegMean, tensor for tensor."""
    batches = {t: [sample_inputs("clip", batch=3, seed=i)] for i, t in enumerate(clip["experts"])}
    experts = {t: load_model(p) for t, p in clip["experts"].items()}
    for method in ("regmean", "regmean++"):
        got = merge(clip["base"], clip["experts"], method, calibration=batches, alpha=0.7, progress=False)
        ref = run_baseline(method, base=load_model(clip["base"]), experts=experts, calibration=batches, alpha=0.7)
        ref_sd = ref.model.state_dict()
        assert all(torch.equal(got[k], ref_sd[k]) for k in got)


def test_schema_defaults_are_the_published_ones():
    cfg = MergeConfig()
    assert cfg.alpha == RegMeanParams().alpha
    assert (cfg.steps, cfg.lr) == (WudiParams().steps, WudiParams().lr)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if merge() opens a checkpoint, loads data or merges."""

    def boom(*a, **k):
        raise AssertionError("work started before the request was validated")

    for name in ("open_family", "load_calibration", "merge_family"):
        monkeypatch.setattr(merge_api, name, boom)


@pytest.mark.parametrize(("method", "calib", "message"), [
    ("regmean", {}, "merge method 'regmean' needs calibration data: one --calib NAME=DATA per expert"),
    ("regmean++", {"task0": "x"}, "task(s) 'task1' have an expert but no calibration data"),
    ("regmean", {"task0": "x", "task1": "y", "task9": "z"}, "task(s) 'task9' have calibration data but no expert"),
    ("wudi", {"task0": "x", "task1": "y"}, "merge method 'wudi' is data-free and takes no calibration data"),
    ("ties", {"task0": "x", "task1": "y"}, "merge method 'ties' is data-free"),
])
def test_calibration_requests_are_refused_before_any_work(clip, tmp_path, capsys, no_work, method, calib, message):
    argv = merge_argv(clip["base"], clip["experts"], tmp_path / "m", "--method", method,
                      *[a for t, d in calib.items() for a in ("--calib", f"{t}={d}")])
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and message in one_line_error(err)
    assert not (tmp_path / "m").exists()
    with pytest.raises(ConfigError, match="calibration data"):
        merge(clip["base"], clip["experts"], method, calibration=calib or None, progress=False)


def test_unusable_calibration_sources_are_refused_before_loading(clip, bert, tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("work started before the data was validated")

    monkeypatch.setattr(merge_api, "load_calibration", boom)
    monkeypatch.setattr(merge_api, "merge_family", boom)
    missing = {**clip["data"], "task1": tmp_path / "nowhere"}
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "m", "--method", "regmean",
                                *[a for t, d in missing.items() for a in ("--calib", f"{t}={d}")], *DATA), capsys)
    assert rc == 2 and "task 'task1': calibration data" in one_line_error(err) and "does not exist" in err
    too_few = ("--num-calibration-examples", "5")  # 4 images per task
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "m", "--method", "regmean",
                                *_calib_flags(clip), *too_few), capsys)
    assert rc == 2 and "holds 4 examples, fewer than the 5 asked for" in one_line_error(err)
    texts = {t: bert["data"]["task0"] for t in clip["experts"]}  # texts for an image model
    with pytest.raises(CalibrationDataError, match="holds texts, but the model .* takes images"):
        merge(clip["base"], clip["experts"], "regmean", calibration=texts, progress=False)
    assert not (tmp_path / "m").exists()


def test_existing_output_needs_overwrite(clip, tmp_path, capsys):
    argv = merge_argv(clip["base"], clip["experts"], tmp_path / "m", "--method", "regmean", *_calib_flags(clip), *DATA)
    assert cli(argv, capsys)[0] == 0
    first = weights_sha(tmp_path / "m")
    rc, _, err = cli(argv + ["--seed", "1"], capsys)
    assert rc == 2 and "--overwrite" in one_line_error(err)
    assert weights_sha(tmp_path / "m") == first
    rc, _, err = cli(argv + ["--overwrite", "--alpha", "0.5"], capsys)
    assert rc == 0, err
    assert weights_sha(tmp_path / "m") != first  # alpha reaches the solve


def test_run_file_merges_with_regmean_and_wudi(clip, tmp_path, capsys):
    root = clip["base"].parent
    doc = {
        "merge": {"base": "base", "experts": {t: p.name for t, p in clip["experts"].items()}, "method": "regmean++",
                  "calibration": {t: p.name for t, p in clip["data"].items()},
                  "params": {"num_calibration_examples": 4, "calibration_batch_size": 2, "alpha": 0.8}},
        "out": str(tmp_path / "rm"),
    }
    run = root / "regmean.yaml"  # relative paths resolve against the run file's directory
    run.write_text(yaml.safe_dump(doc))
    rc, out, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 0, err
    assert "merged 2 experts with regmean++" in out
    api = merge(clip["base"], clip["experts"], "regmean++", calibration=clip["data"], alpha=0.8,
                num_calibration_examples=4, calibration_batch_size=2, progress=False)
    written = _state(tmp_path / "rm")
    assert all(torch.equal(written[k], api[k]) for k in api)

    doc["merge"].update(method="wudi", params={"steps": 5})
    doc["out"] = str(tmp_path / "wudi")
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "'wudi' is data-free" in one_line_error(err)
    del doc["merge"]["calibration"]
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "wudi" / "featcal.json").read_text())["params"]["steps"] == 5


def test_run_file_refuses_regmean_without_data_before_any_work(clip, tmp_path, capsys, no_work):
    doc = {"merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()},
                     "method": "regmean"},
           "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()}},
           "out": str(tmp_path / "out")}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "merge.calibration in a run file" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]
