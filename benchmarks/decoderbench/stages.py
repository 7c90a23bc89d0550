"""The bench's `featcal` stages (merge, calibrate, eval): keyed, cached, run, and recorded.

A stage is a `featcal` command line. Its output folder is named by a key of its arguments (the paths in
them already name what they hold: experts and the base's copy by their own keys, data files by content
hashes, models by the key of the stage that wrote them) and of the featcal sources that compute that kind
of stage (decoderbench/keys.py: merging code for a merge, calibration code for a calibration, evaluation
code for an eval), so a rerun finds every finished stage, a killed run resumes at the first unfinished
one, and a change to featcal recomputes only the stages it could change. featcal writes its outputs
atomically, so a folder that exists is complete. Beside it, `<folder>.stage.json` keeps what the bench
measured when the stage ran (wall seconds, the runner, featcal's git commit and whether the tree was
dirty), so a cached stage still reports its own cost and the code it ran under.

Disk: a calibrated checkpoint is needed only by its own evaluation, so once that is done its weights can
be pruned (`prune`: the *.safetensors files go, featcal.json and a PRUNED.json marker stay); a pruned
model whose evaluation is missing is calibrated again (`unprune`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from decoderbench import keys

FEATCAL_JSON, EVAL_JSON, PRUNED = "featcal.json", "eval.json", "PRUNED.json"
RUNNERS = ("subprocess", "inprocess")


@dataclass
class Stage:
    """One `featcal` command: `args` without --out, which is `cache/<kind>/<slug>-<key>`."""

    name: str  # e.g. "merge:ties", "calibrate:ties+featcal@32", "eval:ties+featcal@32", "select:ties"
    kind: str  # merge | calibrate | eval | select
    args: list[str]
    out: Path = field(init=False)
    key: str = field(init=False)
    cache: Path
    estimate_s: float = 0.0
    units: dict = field(default_factory=dict)  # what the time estimate is made of (windows, tokens, ...)
    reads: str | None = None  # an eval: the name of the stage whose model it scores

    def __post_init__(self) -> None:
        self.key = keys.stage_key(self.kind, self.args)
        self.out = self.cache / {"select": "eval"}.get(self.kind, self.kind) / f"{self.slug}-{self.key}"

    @property
    def slug(self) -> str:
        return self.name.split(":", 1)[1].replace("+", "_").replace("@", "_")

    @property
    def area(self) -> str:
        return keys.KIND_AREA[self.kind]

    def argv_to(self, out: Path) -> list[str]:
        return [*self.args, "--no-progress", "--out", str(out)]

    @property
    def argv(self) -> list[str]:
        return self.argv_to(self.out)

    @property
    def command(self) -> str:
        return "featcal " + shlex.join(self.argv)

    @property
    def report_path(self) -> Path:
        return self.out / (EVAL_JSON if self.kind in ("eval", "select") else FEATCAL_JSON)

    @property
    def done(self) -> bool:
        return self.report_path.is_file()

    @property
    def record_path(self) -> Path:
        return self.out.with_name(self.out.name + ".stage.json")


def execute(argv: list[str], runner: str, threads: int) -> tuple[int, str]:
    """Run `featcal ARGV` (in this process, or a fresh one with `threads` threads): (exit status, output tail)."""
    if runner == "inprocess":
        import contextlib
        import io

        from featcal.cli.main import main as featcal_main

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # its tables: the bench prints its own
            rc = featcal_main(argv)
        return rc, printed.getvalue()[-4000:]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "featcal", *argv], env=env, capture_output=True, text=True)
    return done.returncode, done.stdout[-4000:] + done.stderr[-4000:]


def run_stage(stage: Stage, runner: str, threads: int, log) -> dict:
    """Run the stage unless its output exists; return its record (command, times, peak RSS, cached)."""
    if stage.done:
        record = json.loads(stage.record_path.read_text()) if stage.record_path.is_file() else {}
        return _info(stage, record, cached=True)
    log(stage.command)
    stage.out.parent.mkdir(parents=True, exist_ok=True)
    git = keys.git_state(stage.area)  # the code it runs under, as it starts
    t = time.perf_counter()
    rc, tail = execute(stage.argv, runner, threads)
    wall = round(time.perf_counter() - t, 1)
    if rc != 0 or not stage.done:
        sys.stderr.write(tail)
        raise SystemExit(f"failed ({rc}): {stage.command}")
    record = {"wall_seconds": wall, "estimate_s": round(stage.estimate_s), "runner": runner, "threads": threads,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "key": stage.key,
              "code": {"area": stage.area, "digest": keys.code_digest(stage.area)}, "featcal_git": git}
    stage.record_path.write_text(json.dumps(record, indent=1) + "\n")
    return _info(stage, record, cached=False)


def _info(stage: Stage, record: dict, cached: bool) -> dict:
    report = json.loads(stage.report_path.read_text())
    info = {"name": stage.name, "kind": stage.kind, "command": stage.command, "out": str(stage.out),
            "cached": cached, "wall_seconds": record.get("wall_seconds"), "runner": record.get("runner"),
            "seconds": report.get("seconds"),
            "peak_rss_mb": report.get("peak_rss_mb"), "estimate_s": round(stage.estimate_s), "key": stage.key,
            "code": record.get("code"), "featcal_git": record.get("featcal_git")}
    if report.get("drift"):  # calibration: feature drift from the experts, by block, before -> after
        info["blocks_calibrated"] = len(report["drift"])
        info["end_to_end_drift"] = report.get("end_to_end_drift")
    if report.get("tuning"):
        info["tuning_chosen"] = report["tuning"].get("chosen")
    if (stage.out / PRUNED).is_file():
        info["pruned"] = True
    return info


def is_pruned(stage: Stage) -> bool:
    return (stage.out / PRUNED).is_file()


def prune(stage: Stage) -> int:
    """Delete the stage's weights (*.safetensors), keeping its reports and a PRUNED.json marker; bytes freed."""
    files = sorted(stage.out.glob("*.safetensors"))
    freed = sum(f.stat().st_size for f in files)
    (stage.out / PRUNED).write_text(json.dumps({"removed": [f.name for f in files], "bytes": freed,
                                                "why": "its evaluation is done; rerun the stage to get it back"}) + "\n")
    for f in files:
        f.unlink()
    return freed


def unprune(stage: Stage) -> None:
    """Forget a pruned stage (its folder and record, the bench's own cache), so that it runs again."""
    import shutil

    shutil.rmtree(stage.out)
    stage.record_path.unlink(missing_ok=True)


def eval_rows(stage: Stage) -> dict[str, dict[str, dict[str, float]]]:
    """eval.json's results as row -> task -> {loss, ppl, acc, tokens} (the metrics of a causal LM)."""
    names = {"loss": "loss", "perplexity": "ppl", "next_token_accuracy": "acc"}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in json.loads(stage.report_path.read_text())["results"]:
        if r["metric"] in names:
            cell = out.setdefault(r["model"], {}).setdefault(r["task"], {})
            cell[names[r["metric"]]] = r["value"]
            cell["tokens"] = r.get("tokens")
    return out
