"""The use cases called from Python (featcal.jobs, issue 52): `featcal.run` and `featcal.plan` take one request
and return a typed result, with the numbers and the output the CLI commands print and write."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers as T
import yaml

import featcal
from featcal import jobs
from featcal.calibration.planning import cost, fit, planner
from featcal.calibration.planning.planner import fmt
from featcal.config import FeatCalConfig, RunOptions
from featcal.errors import ConfigError
from tests.builders.guarantees import cli
from tests.builders.pipeline_family import bert_family, clip_family

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ["--num-calibration-examples", "4", "--calibration-batch-size", "2", "--max-length", "16"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_family(tmp_path_factory.mktemp("bert"))


@pytest.fixture
def fixed_rss(monkeypatch):
    """One measured baseline for the CLI and the Python call (the plan adds this process's RSS)."""
    monkeypatch.setattr(planner, "current_rss", lambda: 400 * 2**20)
    monkeypatch.setattr(fit, "current_rss", lambda: 400 * 2**20)


def _request(fam, out, **fields) -> jobs.PlanRequest:
    return jobs.PlanRequest(base=fam["base"], merged=fam["merged"], experts=fam["experts"], calibration=fam["data"],
                            out=out, config=FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2),
                            options=RunOptions(max_length=16), **fields)


def _argv(fam, out, *extra) -> list[str]:
    argv = ["plan", "--base", fam["base"], "--merged", fam["merged"], "--out", out, *SETTINGS, *extra]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    return argv


def test_plan_from_checkpoints_gives_the_numbers_featcal_plan_prints(bert, tmp_path, capsys, fixed_rss):
    rc, printed, err = cli(_argv(bert, tmp_path / "out", "--time-from", "stated", "--target", "cpu"), capsys)
    assert rc == 0, err
    result = featcal.plan(_request(bert, tmp_path / "out", time_from="stated", targets=("cpu",)))
    assert isinstance(result, jobs.PlanResult)
    assert result.text + "\n" == printed  # the command prints the result, nothing else
    peak = re.search(r"estimated peak memory per process: (.+)", printed).group(1)
    assert fmt(result.peak_memory) == peak and result.peak_memory == result.memory.total > 400 * 2**20
    total = re.search(r"total ≈ ([^:]+):", printed).group(1)
    assert cost.duration(result.seconds) == total and result.seconds > 0
    assert result.time.throughput.source == "stated"
    assert len(result.blocks) == 2  # the tiny BERT's two blocks
    assert set(result.data) == set(bert["experts"]) and all(r["examples"] == 4 for r in result.data.values())
    [cpu] = result.fits
    assert cpu.target.name == "cpu" and cpu.fits
    assert result.max_memory is None and result.fits_max_memory is None
    assert not (tmp_path / "out").exists()  # a plan writes nothing


def test_plan_takes_keywords_and_a_memory_limit(bert, tmp_path, fixed_rss):
    result = featcal.plan(base=bert["base"], merged=bert["merged"], experts=bert["experts"],
                          calibration=bert["data"], out=tmp_path / "out", max_memory="1MiB", estimate_time=False,
                          summarise_data=False)
    assert result.time is None and result.seconds is None and result.data == {}
    assert result.max_memory == 2**20 and result.fits_max_memory is False and result.options_that_fit() == []
    assert "--max-memory 1.00 MiB: does NOT fit" in result.text
    with pytest.raises(TypeError, match="not both"):
        featcal.plan(_request(bert, tmp_path / "out"), tasks=2)


def test_plan_from_a_config_alone_matches_the_cli(bert, capsys, fixed_rss):
    rc, printed, err = cli(["plan", "--config", bert["merged"], "--tasks", "2", *SETTINGS, "--target", "cpu"], capsys)
    assert rc == 0, err
    request = jobs.PlanRequest(model_config=bert["merged"], tasks=2, targets=("cpu",), options=RunOptions(max_length=16),
                               config=FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2))
    result = jobs.plan(request)
    assert result.text + "\n" == printed
    assert f"estimated peak memory per process: {fmt(result.peak_memory)}" in printed
    assert f"total ≈ {cost.duration(result.seconds)}:" in printed
    assert [f.target.name for f in result.fits] == ["cpu"] and result.data == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.tasks = 3  # one frozen request


@pytest.mark.parametrize("fields,match", [
    ({"model_config": "x", "tasks": None}, "model_config needs tasks"),
    ({"model_config": "x", "tasks": 2, "merged": "m"}, "merged name a run's checkpoints"),
    ({"base": "b"}, "a plan needs merged, experts, calibration, out"),
    ({"model_config": "x", "tasks": 2, "flops": -1.0}, "flops must be a positive number"),
    ({"model_config": "x", "tasks": 2, "targets": ("tpu",)}, "'tpu' is not one of"),
])
def test_a_bad_plan_request_is_refused_in_its_fields_words(fields, match):
    with pytest.raises(ConfigError, match=match):
        jobs.plan(**fields)


def test_run_merges_then_calibrates_and_returns_what_it_wrote(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(fam["base"]), "experts": {n: str(p) for n, p in fam["experts"].items()},
                  "method": "task_arithmetic"},
        "calibrate": {"calibration": {t: str(p) for t, p in fam["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
    }))
    result = featcal.run(jobs.RunRequest(run, out=tmp_path / "calibrated", progress=False))
    assert isinstance(result, jobs.RunResult)
    assert result.out == tmp_path / "calibrated" and (result.out / "featcal.json").is_file()
    assert result.merged and result.calibrated and result.method == "task_arithmetic"
    assert result.experts == tuple(fam["experts"]) and result.calibrated_from is None
    assert result.report["command"] == "calibrate" and result.report["params"]["num_calibration_examples"] == 4
    assert result.summary() == f"merged and calibrated 2 experts with task_arithmetic into {result.out}"
    calibrated = T.CLIPVisionModel.from_pretrained(result.out).state_dict()  # a loadable checkpoint
    merged = T.CLIPVisionModel.from_pretrained(fam["merged"]).state_dict()
    assert calibrated.keys() == merged.keys()
    assert any(not torch.equal(merged[k], calibrated[k]) for k in merged if ".mlp.fc1." in k)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrated", "fam", "run.yaml"]  # scratch merge removed

    # a merge-only file, its path and options as keywords; the CLI prints the same summary
    only = tmp_path / "merge.yaml"
    only.write_text(yaml.safe_dump({"merge": {"base": str(fam["base"]), "experts": {n: str(p) for n, p in
                                                                                   fam["experts"].items()}}}))
    merged_only = featcal.run(only, out=tmp_path / "merged", progress=False)
    assert merged_only.out == tmp_path / "merged" and not merged_only.calibrated
    assert merged_only.report["params"]["method"] == "task_arithmetic"
    rc, printed, err = cli(["run", only, "--out", tmp_path / "again", "--no-progress"], capsys)
    assert rc == 0, err
    assert printed.splitlines()[-1] == merged_only.summary().replace(str(merged_only.out), str(tmp_path / "again"))


def test_merge_and_calibrate_jobs_write_what_the_cli_and_the_keyword_calls_write(bert, tmp_path):
    """jobs.merge(MergeRequest) and jobs.calibrate(CalibrateRequest): the typed results of what `featcal merge` and
    `featcal calibrate` write, the same weights as featcal.merge's and featcal.calibrate(out=)'s keywords."""
    from safetensors.torch import load_file

    from featcal.config import MergeConfig

    merged = jobs.merge(jobs.MergeRequest(bert["base"], bert["experts"], MergeConfig(method="ties"), out=tmp_path / "m",
                                          progress=False))
    assert merged.out == tmp_path / "m" and merged.report["command"] == "merge"
    state = featcal.merge(bert["base"], bert["experts"], "ties", progress=False)
    assert all(torch.equal(merged.state[k], state[k]) for k in state)

    config = FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2)
    done = jobs.calibrate(jobs.CalibrateRequest(bert["merged"], bert["base"], bert["experts"], bert["data"],
                                                tmp_path / "c", config=config, options=RunOptions(max_length=16),
                                                progress=False))
    assert done.main and done.out == tmp_path / "c" and done.report["params"]["max_length"] == 16
    assert len(done.result.drift) == len(done.report["drift"])
    featcal.calibrate(bert["merged"], base=bert["base"], experts=bert["experts"], calibration=bert["data"],
                      config=config, out=tmp_path / "k", progress=False, max_length=16)
    ours, theirs = load_file(tmp_path / "c" / "model.safetensors"), load_file(tmp_path / "k" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(TypeError, match="CalibrateRequest"):
        jobs.calibrate({"merged": bert["merged"]})


def test_the_jobs_package_loads_merge_and_calibrate_lazily():
    """`import featcal.jobs` (the CLI's help imports it) stays free of torch: merge and calibrate load on use."""
    import subprocess
    import sys

    probe = "import sys, featcal.jobs; print('torch' in sys.modules); featcal.jobs.MergeRequest; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["False", "True"]
