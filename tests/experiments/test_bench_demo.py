"""`featcal bench --rows demo` (`make demo`): exactly the story's rows, the regime line on the full pool, the zoo
build's base and expert scores reused (equal to scoring them again), the table and the figure, one progress bar
over the whole run, and options that would change the rows refused before any work."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.experiments.bench.rows import CalibratedRow, demo_plan, full_plan
from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
from featcal.experiments.bench.table import bench_table
from featcal.experiments.zoo.presets import PRESETS, ModelShape
from featcal.experiments.zoo.pretrain import PretrainSettings
from featcal.experiments.zoo.train import FinetuneSettings

MICRO = dataclasses.replace(
    PRESETS["tiny"], name="micro-demo", tasks=("stripes", "colours"),
    model=ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    train=64, calibration=16, test=32,
    pretrain=PretrainSettings(images=200, categories=8, steps=3, batch_size=16, lr=1e-3, warmup=1),
    finetune=FinetuneSettings(steps=3, batch_size=16, lr=1e-3, warmup=1),
)
OTHER_BAR = re.compile(r"Loading weights|Writing model shards|expert \w+:|calibrat\w*:|merg\w*:")


def _settings(root, **kw) -> BenchSettings:
    return BenchSettings(preset=MICRO.name, seed=0, calib_sizes=(8,), zoo_dir=root / "zoo", wudi_steps=1,
                         eval_batch_size=32, **kw)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's rows on a micro zoo it builds itself, with the bar on (its stderr kept), and the full bench's
    rows on the same zoo for comparison."""
    root = tmp_path_factory.mktemp("bench-demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, MICRO.name, MICRO)
        report = run_bench(_settings(root, rows="demo"), progress=True)
        full = run_bench(_settings(root, methods=("task_arithmetic", "wudi")), progress=False)
        out = write_bench(report, root / "out")
    return report, full, out


def _labels(report) -> list[str]:
    return [line.split(" | ")[0].lstrip("| ") for line in bench_table(report).splitlines()[2:]]


def test_demo_has_exactly_the_story_rows(demo):
    report, _, _ = demo
    alone = {r["method"]: r["average_accuracy"] for r in report["rows"] if r["method"] in ("task_arithmetic", "wudi")
             and not r["calibrated"]}
    best = max(alone, key=alone.get)
    want = ["experts (each on its task)", "base", "task_arithmetic", "task_arithmetic + FeatCal (8/task)",
            "task_arithmetic + FeatCal [tuned] (8/task)", "wudi"]
    if best == "wudi":  # TA's + FeatCal row is already there when TA is the best merge
        want.append("wudi + FeatCal (8/task)")
    assert _labels(report) == want
    marked = [r for r in report["rows"] if r.get("best_merge")]
    assert [r["method"] for r in marked] == ([best] if best == "wudi" else [])
    assert report["params"]["rows"] == "demo" and report["params"]["featcal_variants"] == ["reference", "tuned"]


def test_regime_line_reads_regmean_on_the_whole_pool_as_the_full_sweep_does(demo):
    report, full, _ = demo
    assert report["regime"]["regmean_examples"] == MICRO.calibration == 16  # not the demo's 8
    assert set(report["regime"]["merged_for_the_regime_only"]) == {"regmean"}
    assert report["params"]["regime_calibration_examples"] == 16


def test_demo_reuses_the_zoo_builds_scores_which_equal_scoring_again(demo):
    report, full, _ = demo
    for method in ("expert", "base"):
        reused = [r for r in report["rows"] if r["method"] == method]
        scored = [r for r in full["rows"] if r["method"] == method]
        assert [r["per_task"] for r in reused] == [r["per_task"] for r in scored]
        assert all(r["accuracy_from"] == "zoo build" for r in reused)
        assert all("accuracy_from" not in r for r in scored)
    ta = [r for r in report["rows"] if r["method"] == "task_arithmetic"]
    ta_full = [r for r in full["rows"] if r["method"] == "task_arithmetic"]
    assert ta[0]["per_task"] == ta_full[0]["per_task"]  # the same merge alone
    assert ta[1]["per_task"] == ta_full[1]["per_task"]  # and the same paper-settings calibration (deterministic)


def test_demo_writes_the_table_and_the_drift_figure(demo):
    report, _, out = demo
    assert (out / "table.md").read_text() == bench_table(report)
    assert (out / "drift.png").stat().st_size > 0
    data = json.loads((out / "bench.json").read_text())
    assert "task_arithmetic" in data["drift"] and all(data["drift"].values())
    assert not (out / "calib_sizes.png").exists()  # one size: no sweep figure


def test_summary_skips_rows_the_demo_does_not_have(demo):
    report, _, _ = demo
    ta = report["summary"]["task_arithmetic"]["variants"]
    assert set(ta["reference"]["gap_closed"]) == {8} and set(ta["tuned"]["gap_closed"]) == {8}
    assert report["summary"]["wudi"]["variants"]["tuned"]["gap_closed"] == {}


def test_one_bar_over_the_whole_run(tmp_path, capfd, monkeypatch):
    """The zoo build's experts and every stage counted on one bar named bench, which ends full; no other bar."""
    monkeypatch.setitem(PRESETS, MICRO.name, MICRO)
    run_bench(_settings(tmp_path, rows="demo"), progress=True)
    err = capfd.readouterr().err
    frames = [f for f in re.split(r"[\r\n]", err) if re.search(r"\d+%\|", f)]
    assert frames and all(f.startswith("bench:") for f in frames), frames[:5]
    assert not OTHER_BAR.search(err), err[-2000:]
    done, total = map(int, re.search(r"(\d+)/(\d+) \[", frames[-1]).groups())
    assert done == total and done >= len(MICRO.tasks) + 6  # the two experts trained, loads, warm-up, merges, rows
    assert "zoo: expert" in err  # the build's experts were stages of this bar

    run_bench(_settings(tmp_path, rows="demo"), progress=False)  # the zoo reused; no bar at all
    err = capfd.readouterr().err
    assert not re.search(r"\d+%\|", err), err[-2000:]


def test_plans():
    plan = demo_plan(32, 256)
    assert plan.merges == ("task_arithmetic", "wudi") and plan.regime_size == 256
    assert plan.calibrated["task_arithmetic"] == (CalibratedRow(32, "reference"), CalibratedRow(32, "tuned"))
    assert not plan.best_needs_row("task_arithmetic") and plan.best_needs_row("wudi")
    assert demo_plan(32, 16).regime_size == 16
    full = full_plan(("average", "ties"), (8, 64), ("reference", "joint_bias"))
    assert [(r.size, r.variant) for r in full.calibrated["ties"]] == [
        (8, "reference"), (8, "joint_bias"), (64, "reference"), (64, "joint_bias")]
    assert full.drift_rows["average"] == CalibratedRow(64, "reference") and full.best_merge_row is None


@pytest.mark.parametrize("change, flag", [
    ({"methods": ("ties",)}, "--methods"), ({"calib_sizes": (8, 16)}, "--calib-sizes"),
    ({"featcal_variants": ("joint_bias",)}, "--featcal-variants"), ({"baselines": ("surgery",)}, "--baselines"),
    ({"rows": "most"}, "--rows"),
])
def test_options_that_change_the_demo_rows_are_refused_before_work(tmp_path, change, flag):
    settings = dataclasses.replace(BenchSettings(preset="tiny", calib_sizes=(8,), zoo_dir=tmp_path / "zoo", rows="demo"),
                                   **change)
    with pytest.raises(ConfigError, match=flag):
        validate(settings)
    assert not (tmp_path / "zoo").exists()


def test_cli_demo_default_size_and_refusal(tmp_path, capsys):
    from featcal.experiments.bench.options import BenchOptions

    assert BenchOptions(rows="demo").sizes(256) == (32,) and BenchOptions().sizes(256) == (256,)
    assert BenchOptions(rows="demo").sizes(16) == (16,)
    code = main(["bench", "--preset", "tiny", "--rows", "demo", "--methods", "ties", "--out", str(tmp_path / "o")])
    assert code == 2 and "--rows demo" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_make_demo_runs_one_bench_command_with_the_demo_rows():
    """`make demo`'s recipe is one featcal command (after the sources it depends on), and that command parses."""
    import shlex
    from pathlib import Path

    from featcal.cli.main import build_parser

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    commands = [line.strip() for line in recipe.splitlines() if not line.strip().startswith("@#")]
    assert len(commands) == 1 and commands[0].startswith("$(BIN)/featcal bench "), commands
    args = build_parser().parse_args(shlex.split(commands[0])[1:])
    assert (args.preset, args.rows, args.seed) == ("text", "demo", 0)


def test_every_zoo_builder_reports_each_expert(tmp_path):
    """The text build (real MiniLM and data, a micro version) calls on_expert once per task, in order, as the
    synthetic vision build does (the bar test above); the bench's one bar counts these calls."""
    from featcal.experiments.zoo.build import build_zoo
    from featcal.experiments.zoo.train import FinetuneSettings as Steps

    micro_text = dataclasses.replace(PRESETS["text-tiny"], name="text-micro", tasks=("sentences_en", "hedges"),
                                     train=16, calibration=8, test=8, max_length=16,
                                     finetune=Steps(steps=1, batch_size=4, lr=1e-4, warmup=0, weight_decay=0.0))
    seen: list[str] = []
    build_zoo(tmp_path / "zoo", micro_text, seed=0, progress=False, on_expert=seen.append)
    assert seen == ["sentences_en", "hedges"]
