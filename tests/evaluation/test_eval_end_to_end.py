"""`featcal eval` end to end on a calibrated tiny Llama family: roles, the gap column, the files written,
and the leakage guard against the examples calibration recorded (issue #38)."""

from __future__ import annotations

import json
import re

import pytest

from featcal.cli.main import main
from featcal.data.fingerprint import example_sha256
from featcal.evaluation.metrics import gap_closed
from tests.builders.data_fixtures import sentences, write_jsonl
from tests.builders.guarantees import calibrate_argv, cli, one_line_error
from tests.builders.pipeline_family import llama_text_family

CALIBRATION = {t: sentences(4, seed=10 + i) for i, t in enumerate(("task0", "task1"))}
HELD_OUT = {t: sentences(5, seed=20 + i) for i, t in enumerate(("task0", "task1"))}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """base, two experts, their Task Arithmetic merge, and the merge calibrated by `featcal calibrate`."""
    root = tmp_path_factory.mktemp("llama")
    fam = {**llama_text_family(root, CALIBRATION), "root": root}
    assert main([str(a) for a in calibrate_argv(fam, root / "calibrated")]) == 0  # as a user would
    fam["calibrated"] = root / "calibrated"
    return fam


def _eval_argv(fam, out, tasks: dict, *extra) -> list[str]:
    argv = ["eval", "--base", fam["base"], "--merged", fam["merged"], "--calibrated", fam["calibrated"],
            "--out", out, "--no-progress", "--batch-size", "2"]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in tasks.items():
        argv += ["--task", f"{t}={d}"]
    return argv + list(extra)


def test_calibration_records_each_example_fingerprint(family):
    from featcal.data.sources import TextExample

    recorded = json.loads((family["calibrated"] / "featcal.json").read_text())["inputs"]["calibration"]
    for t, texts in CALIBRATION.items():
        assert sorted(recorded[t]["example_sha256"]) == sorted(example_sha256(TextExample(s)) for s in texts)


def test_roles_gap_column_and_outputs(family, tmp_path, capsys):
    tasks = {t: write_jsonl(tmp_path / f"{t}.jsonl", [{"text": s} for s in texts]) for t, texts in HELD_OUT.items()}
    rc, out, err = cli(_eval_argv(family, tmp_path / "eval", tasks), capsys)
    assert rc == 0, err
    written = sorted(p.name for p in (tmp_path / "eval").iterdir())
    assert written == ["eval.json", "eval.png", "table.md"]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["command"] == "eval" and report["calibration_overlap"] == []
    assert all(set(r) >= {"model", "task", "metric", "value", "examples"} and r["examples"] == 5 for r in report["results"])
    cells = {(r["model"], r["task"], r["metric"]): r["value"] for r in report["results"]}
    models = {m for m, _, _ in cells}
    assert models == {"base", "merged", "calibrated", "experts"}
    assert {t for m, t, _ in cells if m == "experts"} == {"task0", "task1"}  # each expert on its own task
    assert report["models"]["experts"]["paths"] == {t: str(d) for t, d in family["experts"].items()}
    gap = {(g["task"]): g["value"] for g in report["gap_closed"] if g["model"] == "calibrated"}
    for t in ("task0", "task1"):
        assert gap[t] == gap_closed(cells["calibrated", t, "loss"], cells["merged", t, "loss"], cells["experts", t, "loss"],
                                    higher_is_better=False)
    means = [sum(cells[m, t, "loss"] for t in ("task0", "task1")) / 2 for m in ("calibrated", "merged", "experts")]
    assert gap["mean"] == gap_closed(*means, higher_is_better=False)
    table = (tmp_path / "eval" / "table.md").read_text()
    assert "## mean token loss" in table and "## share of the merge → experts gap closed" in table
    assert re.search(r"^\| calibrated \| loss \|", table, re.M) and table in out


def test_overlapping_data_is_refused_then_flagged_and_disjoint_data_passes(family, tmp_path, capsys):
    overlapping = CALIBRATION["task1"][:2] + HELD_OUT["task1"]  # two calibration examples among seven
    tasks = {"task0": write_jsonl(tmp_path / "t0.jsonl", [{"text": s} for s in HELD_OUT["task0"]]),
             "task1": write_jsonl(tmp_path / "t1.jsonl", [{"text": s, "label": 1} for s in overlapping])}
    rc, _, err = cli(_eval_argv(family, tmp_path / "refused", tasks), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "model 'calibrated' was calibrated on 2 of the 7 examples of task 'task1'" in line
    assert "--allow-calibration-overlap" in line and not (tmp_path / "refused").exists()

    rc, out, err = cli(_eval_argv(family, tmp_path / "flagged", tasks, "--allow-calibration-overlap"), capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "flagged" / "eval.json").read_text())
    assert report["calibration_overlap"] == [{"model": "calibrated", "task": "task1", "examples": 2, "of": 7,
                                              "calibration_tasks": ["task1"]}]
    flagged = {(r["model"], r["task"]) for r in report["results"] if r.get("calibration_overlap")}
    assert flagged == {("calibrated", "task1")}
    assert "⚠" in out and "not a held-out score" in out

    # the merge and the experts recorded no calibration; the calibrated model saw none of the held-out texts
    disjoint = {**tasks, "task1": write_jsonl(tmp_path / "t1-held.jsonl", [{"text": s} for s in HELD_OUT["task1"]])}
    rc, _, err = cli(_eval_argv(family, tmp_path / "clean", disjoint), capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "clean" / "eval.json").read_text())["calibration_overlap"] == []


def test_a_report_without_fingerprints_refuses_its_own_calibration_files(family, tmp_path, capsys):
    import shutil

    old = tmp_path / "old-calibrated"
    shutil.copytree(family["calibrated"], old)
    report = json.loads((old / "featcal.json").read_text())
    for record in report["inputs"]["calibration"].values():
        del record["example_sha256"]  # as featcal wrote it before issue #38
    (old / "featcal.json").write_text(json.dumps(report))
    rc, _, err = cli(["eval", "--model", f"old={old}", "--task", f"t={family['data']['task0']}", "--out",
                      tmp_path / "e", "--no-progress"], capsys)
    assert rc == 2 and "drawn from the very file of task 't'" in one_line_error(err)
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": s} for s in HELD_OUT["task0"]])
    rc, _, err = cli(["eval", "--model", f"old={old}", "--task", f"t={held}", "--out", tmp_path / "e2", "--no-progress"],
                     capsys)
    assert rc == 0, err


def test_bad_invocations_are_refused_before_any_work(family, tmp_path, capsys):
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": s} for s in HELD_OUT["task0"]])
    cases = [
        (["--model", f"merged={family['merged']}", "--task", f"t={held}"], "'merged' is a role's name"),
        (["--expert", f"task9={family['merged']}", "--task", f"t={held}"], "expert(s) for 'task9' have no evaluation data"),
        (["--model", f"m={family['merged']}"], "nothing to evaluate"),
        (["--task", f"t={held}"], "no model to evaluate"),
        (["--model", f"m={family['merged']}", "--task", f"t={tmp_path / 'missing.jsonl'}"], "does not exist"),
        (["--model", f"m={family['merged']}", "--task", f"t={held}", "--template", "no placeholder"], "exactly one {}"),
    ]
    for extra, message in cases:
        rc, _, err = cli(["eval", "--out", tmp_path / "never", "--no-progress", *extra], capsys)
        assert rc == 2 and message in one_line_error(err), (extra, err)
    assert not (tmp_path / "never").exists()
    rc, _, err = cli(["eval", "--out", family["merged"], "--overwrite", "--model", f"m={family['merged']}", "--task",
                      f"t={held}"], capsys)
    assert rc == 2 and "holds no eval.json" in one_line_error(err)


def test_lm_eval_prints_the_command_when_the_harness_is_absent(family, tmp_path, capsys, monkeypatch):
    from featcal.evaluation import lm_eval

    monkeypatch.setattr(lm_eval, "installed", lambda: False)
    rc, out, err = cli(["eval", "--model", f"merged9={family['merged']}", "--lm-eval", "hellaswag,arc_easy",
                        "--out", tmp_path / "lm", "--no-progress"], capsys)
    assert rc == 0, err
    command = f"lm_eval --model hf --model_args pretrained={family['merged'].resolve()} --tasks hellaswag,arc_easy"
    assert command in out
    report = json.loads((tmp_path / "lm" / "eval.json").read_text())
    assert report["lm_eval"]["ran"] is False and command in report["lm_eval"]["commands"]["merged9"]


@pytest.mark.parametrize("name", ["ck,trust_remote_code=True", "ck=peft", "a,b"])
def test_lm_eval_refuses_a_path_that_would_inject_model_args(family, tmp_path, capsys, monkeypatch, name):
    """lm-eval splits --model_args on ',' and '=': a folder named `ck,trust_remote_code=True` would turn remote
    code on in the command featcal runs or prints. Refused in one line before any scoring; nothing written."""
    import shutil

    from featcal.evaluation import lm_eval

    monkeypatch.setattr(lm_eval, "installed", lambda: False)
    crafted = tmp_path / "o" / name
    shutil.copytree(family["merged"], crafted)
    rc, out, err = cli(["eval", "--model", f"x={crafted}", "--lm-eval", "hellaswag", "--out", tmp_path / "e",
                        "--no-progress"], capsys)
    assert rc == 2 and "--model_args" in one_line_error(err), err
    assert "trust_remote_code" not in out and not (tmp_path / "e").exists()
    with pytest.raises(Exception, match="model_args"):
        lm_eval.lm_eval_argv(crafted, ["hellaswag"], tmp_path / "x")


def test_lm_eval_runs_when_installed_and_its_results_are_read_back(family, tmp_path, capsys, monkeypatch):
    """A stand-in `lm_eval` module (what the harness's CLI does: parse the flags, write a results file)."""
    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        "import json, sys, pathlib\n"
        "a = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        "out = pathlib.Path(a['--output_path']) / 'model'\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "res = {t: {'acc,none': 0.25, 'acc_stderr,none': 0.1, 'alias': t} for t in a['--tasks'].split(',')}\n"
        "(out / 'results_2025.json').write_text(json.dumps({'results': res, 'args': a}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    rc, _, err = cli(["eval", "--model", f"m={family['merged']}", "--lm-eval", "hellaswag", "--out", tmp_path / "lm",
                      "--no-progress"], capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "lm" / "eval.json").read_text())
    assert report["lm_eval"]["ran"] is True
    assert report["lm_eval"]["results"] == [{"model": "m", "task": "hellaswag", "metric": "acc,none", "value": 0.25}]
    ran = json.loads(next((tmp_path / "lm" / "lm_eval" / "m").rglob("results_*.json")).read_text())["args"]
    assert ran["--model_args"] == f"pretrained={family['merged'].resolve()}" and ran["--tasks"] == "hellaswag"
    assert "## lm-evaluation-harness" in (tmp_path / "lm" / "table.md").read_text()


def test_no_progress_draws_no_bar(family, tmp_path, capfd):
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": s} for s in HELD_OUT["task0"]])
    capfd.readouterr()
    assert main(["eval", "--model", f"m={family['merged']}", "--task", f"t={held}", "--out", str(tmp_path / "e"),
                 "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert not re.search(r"Loading weights|\d+%\||it/s|s/it", err), err[-2000:]
