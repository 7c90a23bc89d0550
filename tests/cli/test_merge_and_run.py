"""`featcal merge` and `featcal run`: round trips through featcal.cli.main.main, and one-line errors."""

import json

import pytest
import torch
import transformers as T
import yaml

from featcal.cli.main import main
from featcal.io.read.checkpoint import CheckpointReader
from tests.builders.pipeline_family import clip_family
from tests.builders.tiny import make_family, without_log_lines

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return make_family("clip", tmp_path_factory.mktemp("clip"), n_experts=2)


def _argv(base, experts, out, *extra):
    argv = ["merge", "--base", str(base), "--out", str(out), "--no-progress"]
    for name, path in experts.items():
        argv += ["--expert", f"{name}={path}"]
    return argv + list(extra)


def _error(capsys) -> str:
    err = without_log_lines(capsys.readouterr().err)
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("featcal: error: ")
    return err


def test_merge_round_trip(clip, tmp_path, capsys):
    base, experts = clip
    out = tmp_path / "merged"
    rc = main(_argv(base, experts, out, "--method", "ties", "--density", "0.5", "--scaling", "0.8"))
    assert rc == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("merged 2 experts with ties") and str(out) in summary
    from featcal import merge

    expected = merge(base, experts, "ties", density=0.5, scaling=0.8, progress=False)
    reader = CheckpointReader(out)
    assert all(torch.equal(reader.get(k), expected[k]) for k in expected)
    assert type(T.AutoModel.from_pretrained(out)) is T.CLIPVisionModel
    report = json.loads((out / "featcal.json").read_text())
    assert report["params"] == {"method": "ties", "scaling": 0.8, "density": 0.5}


def test_merge_progress_bar_goes_to_stderr(clip, tmp_path, capsys):
    base, experts = clip
    argv = [a for a in _argv(base, experts, tmp_path / "m") if a != "--no-progress"]
    assert main(argv) == 0
    assert "merging (task_arithmetic)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,match",
    [(["--density", "1.5"], "density"), (["--drop-rate", "1"], "drop_rate"), (["--scaling", "0"], "scaling")],
)
def test_merge_out_of_range(clip, tmp_path, capsys, extra, match):
    base, experts = clip
    assert main(_argv(base, experts, tmp_path / "m", *extra)) == 2
    assert match in _error(capsys)
    assert not (tmp_path / "m").exists()


def test_merge_unknown_method_lists_the_valid_ones(clip, tmp_path, capsys):
    base, experts = clip
    with pytest.raises(SystemExit) as exc:
        main(_argv(base, experts, tmp_path / "m", "--method", "fisher"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'fisher'" in err and "ties" in err and "regmean++" in err and "wudi" in err


def test_merge_bad_inputs(clip, tmp_path, capsys):
    base, experts = clip
    assert main(_argv(tmp_path / "nope", experts, tmp_path / "m")) == 2
    assert "base: checkpoint directory" in _error(capsys)
    assert main(_argv(base, {**experts, "x": tmp_path / "nope"}, tmp_path / "m")) == 2
    assert "expert 'x'" in _error(capsys)
    assert main(["merge", "--base", str(base), "--expert", "no-equals-sign", "--out", str(tmp_path / "m")]) == 2
    assert "NAME=VALUE" in _error(capsys)
    other, _ = make_family("bert", tmp_path / "bert", n_experts=0)
    capsys.readouterr()  # drop save_pretrained's progress output
    assert main(_argv(base, {**experts, "bert": other}, tmp_path / "m")) == 2
    assert "expert 'bert'" in _error(capsys) and not (tmp_path / "m").exists()


def test_merge_existing_output(clip, tmp_path, capsys):
    base, experts = clip
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(_argv(base, experts, out)) == 2
    assert "--overwrite" in _error(capsys)
    assert (out / "notes.txt").read_text() == "keep me"
    assert main(_argv(base, experts, out, "--overwrite")) == 2  # not an output featcal wrote
    assert "replaces only an output featcal wrote" in _error(capsys)
    assert (out / "notes.txt").read_text() == "keep me"
    (out / "featcal.json").write_text("{}")  # an earlier output: replaced on request
    assert main(_argv(base, experts, out, "--overwrite")) == 0
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()


# --- featcal run ------------------------------------------------------------------------------------


def _write_run(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_run_merge_only_with_relative_paths(clip, tmp_path, capsys, monkeypatch):
    base, experts = clip
    root = base.parent
    run = _write_run(tmp_path / "run.yaml", {
        "merge": {"base": str(base), "experts": {n: str(p) for n, p in experts.items()}, "method": "dare_ta",
                  "params": {"drop_rate": 0.25, "seed": 7}},
        "out": "result",
    })
    monkeypatch.chdir(root)  # the output is relative to the run file, not to the working directory
    assert main(["run", str(run), "--no-progress"]) == 0
    out = tmp_path / "result"
    assert str(out) in capsys.readouterr().out
    from featcal import merge

    expected = merge(base, experts, "dare_ta", drop_rate=0.25, seed=7, progress=False)
    reader = CheckpointReader(out)
    assert all(torch.equal(reader.get(k), expected[k]) for k in expected)
    assert json.loads((out / "featcal.json").read_text())["params"]["seed"] == 7

    # inputs given relative to the run file's directory
    rel = _write_run(root / "rel.yaml", {
        "merge": {"base": base.name, "experts": {n: p.name for n, p in experts.items()}}, "out": str(tmp_path / "rel"),
    })
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(rel), "--no-progress"]) == 0
    assert (tmp_path / "rel" / "model.safetensors").is_file()
    assert main(["run", str(rel), "--no-progress"]) == 2  # second time: the output exists
    assert "--overwrite" in _error(capsys)


@pytest.mark.parametrize(
    "mutate,match",
    [(lambda d: d["merge"].update(method="nope"), "merge.method"),
     (lambda d: d["merge"]["params"].update(density=2.0), "density"),
     (lambda d: d.update(outt="x"), "outt"),
     (lambda d: d["merge"].update(experts={}), "at least one expert")],
)
def test_run_invalid_files(clip, tmp_path, capsys, mutate, match):
    base, experts = clip
    data = {"merge": {"base": str(base), "experts": {n: str(p) for n, p in experts.items()}, "params": {}},
            "out": str(tmp_path / "o")}
    mutate(data)
    assert main(["run", str(_write_run(tmp_path / "bad.yaml", data))]) == 2
    assert match in _error(capsys)
    assert not (tmp_path / "o").exists()


def test_run_missing_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in _error(capsys)


def test_run_calibrate_checks_tasks_before_merging(clip, tmp_path, capsys):
    base, experts = clip
    run = _write_run(tmp_path / "run.yaml", {
        "merge": {"base": str(base), "experts": {n: str(p) for n, p in experts.items()}},
        "calibrate": {"calibration": {"task0": str(tmp_path)}},
        "out": str(tmp_path / "o"),
    })
    assert main(["run", str(run)]) == 2
    assert "'task1' have an expert but no calibration data" in _error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


def test_run_merge_then_calibrate(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    out = tmp_path / "calibrated"
    run = _write_run(tmp_path / "run.yaml", {
        "merge": {"base": str(fam["base"]), "experts": {n: str(p) for n, p in fam["experts"].items()},
                  "method": "task_arithmetic"},
        "calibrate": {"calibration": {t: str(p) for t, p in fam["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
        "out": str(out),
    })
    assert main(["run", str(run), "--no-progress"]) == 0
    assert "merged and calibrated 2 experts" in capsys.readouterr().out
    report = json.loads((out / "featcal.json").read_text())
    assert report["command"] == "calibrate" and report["params"]["num_calibration_examples"] == 4
    merged = T.CLIPVisionModel.from_pretrained(fam["merged"]).state_dict()  # the tests' own TA 0.3
    calibrated = T.CLIPVisionModel.from_pretrained(out).state_dict()
    assert any(not torch.equal(merged[k], calibrated[k]) for k in merged if ".mlp.fc1." in k)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrated", "fam", "run.yaml"]  # scratch merge removed
