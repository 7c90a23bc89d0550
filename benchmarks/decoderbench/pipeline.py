"""One seed's `featcal` stages, in the order they run, each with its time estimate.

    early         featcal merge TA (0.3); featcal eval of base, experts (each on its own domain) and TA: the
                  regime check, printed (and where --regime-only stops)
    merges        featcal merge: TIES (0.2, 1.0), RegMean (main-size windows), WUDI (its defaults)
    selection     featcal eval of each merge alone on the held-out calibration windows (the select part)
    calibrations  featcal calibrate: every merge + FeatCal (paper defaults) at the main size; TA + each
                  curve variant at every size; TA + --tune at the main size (costed as featcal's
                  planned_calibrations counts the search)
    best          the merge whose mean selection loss is lowest, + --tune at the main size (no new stage
                  when that merge is TA: the same command, hence the same key and output)
    evals         featcal eval of every merge and calibrated model on the test windows
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decoderbench.estimates import Rates, flops_per_second, wudi_flops
from decoderbench.settings import Settings
from decoderbench.stages import Stage
from decoderbench.summary import BEST, REFERENCE, row_id


@dataclass
class SeedInputs:
    """Paths one seed's stages read: the base's GGUF and its safetensors copy, experts and window files."""

    seed: int
    gguf: Path
    base_checkpoint: Path
    experts: dict[str, Path]
    files: dict[str, dict[str, Path]]  # part (test, select, calib) -> domain -> JSONL of windows
    base_from_gguf: bool = False  # give merges and calibrations the .gguf itself as --base (RegMean excepted)


def _common(inputs: SeedInputs, method: str | None = None) -> list[str]:
    """--base and the experts. The base is the safetensors copy unless base_from_gguf; RegMean always gets the copy
    (featcal reads path data for it with the base's tokenizer, which it does not take from a GGUF file)."""
    base = inputs.gguf if inputs.base_from_gguf and method != "regmean" else inputs.base_checkpoint
    return ["--base", str(base), *[a for d, p in inputs.experts.items() for a in ("--expert", f"{d}={p}")]]


def tune_args(s: Settings) -> list[str]:
    """The --tune options the bench passes (none: featcal's defaults)."""
    return ((["--tune-budget", str(s.tune_budget)] if s.tune_budget else [])
            + (["--tune-screen", str(s.tune_screen)] if s.tune_screen is not None else [])
            + (["--tune-scope", s.tune_scope] if s.tune_scope is not None else [])
            + (["--tune-fixed", s.tune_fixed] if s.tune_fixed is not None else [])
            + (["--tune-confirm", str(s.tune_confirm)] if s.tune_confirm is not None else []))


def tune_cost(s: Settings, windows: int) -> tuple[float, str]:
    """(what a tuned calibration at `windows` per domain costs at most, in calibrations on all the data, how it
    was counted): featcal.calibration.tuning.planned_calibrations for the --tune options the stage passes."""
    from featcal.calibration.tuning import planned_calibrations
    from featcal.config import FeatCalConfig

    options = {"tune": True}
    if s.tune_budget:
        options["tune_budget"] = s.tune_budget
    if s.tune_screen is not None:
        options["tune_screen"] = s.tune_screen
    if s.tune_scope is not None:
        options["tune_scope"] = s.tune_scope
    if s.tune_fixed is not None:
        options["tune_fixed"] = s.tune_fixed
    if s.tune_confirm is not None:
        options["tune_confirm"] = s.tune_confirm
    return planned_calibrations(FeatCalConfig(**options), windows)


def _calib_args(inputs: SeedInputs) -> list[str]:
    return [a for d, p in inputs.files["calib"].items() for a in ("--calib", f"{d}={p}")]


def _tasks(inputs: SeedInputs, part: str) -> list[str]:
    return [a for d, p in inputs.files[part].items() for a in ("--task", f"{d}={p}")]


class SeedStages:
    """Builds and holds one seed's stages (name -> Stage), estimating each from `rates`."""

    def __init__(self, s: Settings, inputs: SeedInputs, cache: Path, rates: Rates):
        self.s, self.inputs, self.cache, self.rates = s, inputs, cache, rates
        self.stages: dict[str, Stage] = {}
        self.rows: dict[str, str] = {}  # row -> the name of the eval stage that scores it
        self.model_of: dict[str, str] = {}  # row -> the name of the merge or calibrate stage that wrote it

    # -------------------------------------------------------------------------------- estimates
    def _tokens(self, windows: int, domains: int | None = None) -> int:
        return windows * (domains or len(self.s.domains)) * self.s.seq_len

    def _eval_estimate(self, windows: int, loads: int = 1) -> float:
        r = self.rates
        return loads * r.eval_overhead_s + self._tokens(windows) * r.eval_s_per_token

    def _calib_estimate(self, windows: int, tune: bool) -> float:
        r = self.rates
        per = windows * len(self.s.domains) * r.calib_s_per_window * self.s.seq_len / r.seq_len
        return r.calib_overhead_s + per * (tune_cost(self.s, windows)[0] if tune else 1.0)

    def _merge_estimate(self, method: str) -> float:
        r = self.rates
        if method == "ties":
            return r.ties_s
        if method == "regmean":  # each expert's forward over its windows, with the Grams' hooks
            return r.merge_s + 1.5 * self._tokens(self.s.main_size) * r.eval_s_per_token
        if method == "wudi" and self.s.model in ("smollm2", "gemma3") and not self.s.tiny:
            flops = wudi_flops(self.s.model, steps=self.s.wudi_steps or 300, tasks=len(self.s.domains))
            return r.merge_s + flops / flops_per_second(self.s.model, r)
        return r.merge_s

    # -------------------------------------------------------------------------------- stages
    def add(self, stage: Stage) -> Stage:
        return self.stages.setdefault(stage.name, stage)

    def merge(self, method: str) -> Stage:
        s, i = self.s, self.inputs
        extra = {"task_arithmetic": ["--scaling", str(s.ta_scaling)],
                 "ties": ["--density", str(s.ties_density), "--scaling", str(s.ties_scaling)],
                 "regmean": [*_calib_args(i), "--num-calibration-examples", str(s.main_size), "--max-length",
                             str(s.seq_len), "--calibration-batch-size", str(s.calib_batch), "--seed", str(i.seed)],
                 "wudi": ["--steps", str(s.wudi_steps)] if s.wudi_steps else []}[method]
        stage = self.add(Stage(f"merge:{method}", "merge", ["merge", *_common(i, method), "--method", method, *extra],
                               self.cache, self._merge_estimate(method), {"method": method}))
        self.model_of[method] = stage.name
        return stage

    def calibrate(self, merge: str, variant: str, size: int, row: str | None = None) -> Stage:
        s, i = self.s, self.inputs
        tune = variant == "featcal_tuned"
        merged = self.stages[f"merge:{merge}"]
        args = ["calibrate", "--merged", str(merged.out), *_common(i), *_calib_args(i),
                "--num-calibration-examples", str(size), "--calibration-batch-size", str(s.calib_batch),
                "--max-length", str(s.seq_len), "--seed", str(i.seed), "--no-resume"]
        units = {"windows": size * len(s.domains), "tune": tune}
        if tune:
            args += ["--tune", *tune_args(s)]
            units["calibrations"], units["tune_plan"] = tune_cost(s, size)
        stage = self.add(Stage(f"calibrate:{row_id(merge, variant, size)}", "calibrate", args, self.cache,
                               self._calib_estimate(size, tune), units))
        self.model_of[row or row_id(merge, variant, size)] = stage.name
        return stage

    def evaluate(self, row: str, role: str, path: str | Path | None = None, part: str = "test",
                 name: str | None = None, reads: str | None = None) -> Stage:
        """`featcal eval` of one model (`role`: base, merged, calibrated; expert: all experts) on a part's windows;
        `name`: the model's own name where the row is an alias (the best merge's row)."""
        s, i = self.s, self.inputs
        if role == "expert":
            models = [a for d, p in i.experts.items() for a in ("--expert", f"{d}={p}")]
            estimate = self._eval_estimate(s.eval_windows, loads=len(s.domains)) - \
                self._tokens(s.eval_windows) * self.rates.eval_s_per_token * (1 - 1 / len(s.domains))
        else:
            models = [f"--{role}", str(path)]
            estimate = self._eval_estimate(s.eval_windows if part == "test" else s.select_windows)
        windows = s.eval_windows if part == "test" else s.select_windows
        kind, tag = ("eval", "eval") if part == "test" else ("select", "select")
        stage = Stage(f"{tag}:{name or row}", kind, ["eval", *models, *_tasks(i, part), "--max-length", str(s.seq_len),
                                              "--batch-size", str(s.eval_batch)], self.cache, estimate,
                      {"tokens": self._tokens(windows, 1 if role == "expert" else None)}, reads)
        stage = self.add(stage)
        if part == "test":
            self.rows[row] = stage.name
        return stage

    def evaluate_model(self, row: str) -> Stage:
        producer = self.stages[self.model_of[row]]
        return self.evaluate(row, "merged" if producer.kind == "merge" else "calibrated", producer.out,
                             name=producer.name.split(":", 1)[1], reads=producer.name)

    def early(self) -> list[Stage]:
        """What the regime check needs: the TA merge, and base, experts and TA scored."""
        return [self.merge(REFERENCE), self.evaluate("base", "base", self.inputs.base_checkpoint),
                self.evaluate("experts", "expert"), self.evaluate_model(REFERENCE)]

    def merges(self) -> list[Stage]:
        return [self.merge(m) for m in self.s.merges if m != REFERENCE]

    def selection(self) -> list[Stage]:
        return [self.evaluate(m, "merged", self.stages[f"merge:{m}"].out, part="select") for m in self.s.merges]

    def calibrations(self) -> list[Stage]:
        s, out = self.s, []
        for m in s.merges:
            out.append(self.calibrate(m, "featcal", s.main_size))
        for variant in s.curve:
            for n in s.calib_sizes:
                out.append(self.calibrate(REFERENCE, variant, n))
        out.append(self.calibrate(REFERENCE, "featcal_tuned", s.main_size))
        if s.tune_every_merge:
            out += [self.calibrate(m, "featcal_tuned", s.main_size) for m in s.merges]
        return out

    def best(self, merge: str) -> Stage:
        """--tune on the chosen merge at the main size (the same stage as TA's when TA is chosen)."""
        return self.calibrate(merge, "featcal_tuned", self.s.main_size,
                              row=row_id(BEST, "featcal_tuned", self.s.main_size))

    def late_evals(self) -> list[Stage]:
        return [self.evaluate_model(row) for row in self.model_of if row not in self.rows]
