"""--check-cache: recompute one cached result, chosen at random (seeded), and compare it with the cached one.

Candidates: every cached expert and every cached stage of the run the other flags describe (the same
settings and seeds), except an evaluation whose model's weights were pruned (recomputing it would need the
calibration first). The choice is `random.Random(--check-seed)`, weighted by 1 / (1 + estimated seconds),
so cheap stages come up more often but any can; `--check-stage NAME` names one instead.

Verdicts:
    weights   an expert, a merge, a calibration that kept its weights: every tensor of every *.safetensors
              file bit-identical (same names, dtypes, shapes and bytes)
    metrics   an evaluation: every (model, task, metric) of eval.json within RTOL
    report    a calibration whose weights were pruned: featcal.json's per-block drift, end-to-end drift and
              tuning choice within RTOL (strings equal)
RTOL: |cached - recomputed| <= RTOL x max(1, |cached|). The recomputation is written under
`--cache/check/` and deleted when it matches (kept, for a look, when it does not).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from decoderbench.stages import FEATCAL_JSON, Stage, execute, is_pruned

RTOL = 1e-6


@dataclass
class Item:
    label: str  # "seed 0 merge:ties", "seed 0 expert:python"
    key: str
    estimate_s: float
    cached: Path
    how: str  # weights | metrics | report
    recompute: Callable[[Path], None]  # writes the result afresh into the given folder


def _featcal(stage: Stage, runner: str, threads: int, out: Path) -> None:
    rc, tail = execute(stage.argv_to(out), runner, threads)
    if rc != 0:
        raise SystemExit(f"check-cache: recomputing {stage.name} failed ({rc}):\n{tail}")


def candidates(views: dict, runner: str, threads: int, train: Callable[[dict, Path], None],
               train_estimate_s: float) -> list[Item]:
    """Every cached result of the views (decoder_bench.seed_views) that can be recomputed and compared."""
    out = []
    for v in views["seeds"]:
        tag = f"seed {v['seed']}"
        for d, spec in v["specs"].items():
            if v["records"][d].get("cached"):
                out.append(Item(f"{tag} expert:{d}", spec["key"], train_estimate_s, spec["path"], "weights",
                                partial(train, spec)))
        for st in v["listed"]:
            producer = v["stages"].stages.get(st.reads) if st.reads else None
            if not st.done or (producer is not None and is_pruned(producer)):
                continue
            how = "metrics" if st.kind in ("eval", "select") else "report" if is_pruned(st) else "weights"
            out.append(Item(f"{tag} {st.name}", st.key, st.estimate_s, st.out, how, partial(_featcal, st, runner, threads)))
    return out


def choose(items: list[Item], seed: int, name: str | None = None) -> Item | None:
    if name:
        return next((x for x in items if x.label == name or x.label.split(" ", 2)[2] == name), None)
    return random.Random(seed).choices(items, weights=[1.0 / (1.0 + x.estimate_s) for x in items])[0]


# ---------------------------------------------------------------------------------------------- comparisons

def _bitwise_equal(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare_weights(cached: Path, fresh: Path) -> tuple[bool, str]:
    from safetensors import safe_open

    files = sorted(p.name for p in cached.glob("*.safetensors"))
    if files != sorted(p.name for p in fresh.glob("*.safetensors")) or not files:
        return False, f"weight files differ: {files} cached, {sorted(p.name for p in fresh.glob('*.safetensors'))} recomputed"
    n = 0
    for name in files:
        with safe_open(cached / name, "pt") as x, safe_open(fresh / name, "pt") as y:
            if set(x.keys()) != set(y.keys()):
                return False, f"{name}: tensor names differ ({sorted(set(x.keys()) ^ set(y.keys()))[:5]} ...)"
            for k in sorted(x.keys()):
                a, b = x.get_tensor(k), y.get_tensor(k)
                if a.dtype != b.dtype or a.shape != b.shape:
                    return False, f"{name}:{k}: {a.dtype} {tuple(a.shape)} cached, {b.dtype} {tuple(b.shape)} recomputed"
                if not _bitwise_equal(a, b):
                    diff = (a.double() - b.double()).abs().max().item()
                    return False, f"{name}:{k} differs (largest |difference| {diff:.3g})"
                n += 1
    return True, f"weights bit-identical: {n} tensors in {len(files)} file(s)"


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}.{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in _flat(val, f"{prefix}[{i}]").items()}
    return {prefix: obj}


def _within(a: dict, b: dict, what: str) -> tuple[bool, str]:
    if a.keys() != b.keys():
        return False, f"{what}: entries differ ({sorted(set(a) ^ set(b))[:5]} ...)"
    worst, where = 0.0, None
    for k, x in a.items():
        y = b[k]
        if isinstance(x, (int, float)) and not isinstance(x, bool) and isinstance(y, (int, float)):
            if math.isnan(x) and math.isnan(y):
                continue
            rel = abs(x - y) / max(1.0, abs(x))
            if not rel <= worst:
                worst, where = rel, k
        elif x != y:
            return False, f"{what}: {k} is {x!r} cached, {y!r} recomputed"
    if worst > RTOL:
        return False, f"{what}: {where} differs by {worst:.3g} relative (> {RTOL:g})"
    return True, f"{what}: {len(a)} values equal within {RTOL:g} relative (largest relative difference {worst:.3g})"


def compare_metrics(cached: Path, fresh: Path) -> tuple[bool, str]:
    def metrics(p: Path) -> dict:
        rows = json.loads((p / "eval.json").read_text())["results"]
        return {f"{r['model']} {r['task']} {r['metric']}": r["value"] for r in rows}

    return _within(metrics(cached), metrics(fresh), "eval.json metrics")


def compare_report(cached: Path, fresh: Path) -> tuple[bool, str]:
    def numbers(p: Path) -> dict:
        r = json.loads((p / FEATCAL_JSON).read_text())
        return _flat({"drift": r.get("drift"), "end_to_end_drift": r.get("end_to_end_drift"),
                      "tuning_chosen": (r.get("tuning") or {}).get("chosen")})

    ok, text = _within(numbers(cached), numbers(fresh), "featcal.json drift and tuning choice (weights pruned)")
    return ok, text


COMPARE = {"weights": compare_weights, "metrics": compare_metrics, "report": compare_report}


def run(items: list[Item], scratch: Path, seed: int | None, name: str | None, say=print) -> int:
    """Choose, recompute, compare and print the verdict: 0 when it matches, 1 when not, 2 when nothing to check."""
    if not items:
        say("check-cache: nothing is cached for these settings (run the bench first): nothing to check")
        return 2
    if seed is None and not name:
        seed = random.SystemRandom().randrange(1_000_000)
    item = choose(items, seed, name)
    if item is None:
        say(f"check-cache: no cached result named {name!r}; cached: " + ", ".join(x.label for x in items))
        return 2
    how = "named by --check-stage" if name else f"drawn with --check-seed {seed}"
    say(f"check-cache: {item.label} (key {item.key}, {item.cached}), {how} among {len(items)} cached results; "
        f"recomputing (estimate ~{item.estimate_s:.0f} s)")
    fresh = scratch / f"{item.cached.name}"
    if fresh.exists():
        shutil.rmtree(fresh)
    fresh.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    item.recompute(fresh)
    seconds = time.perf_counter() - t
    ok, text = COMPARE[item.how](item.cached, fresh)
    if ok:
        shutil.rmtree(fresh)
    say(f"check-cache: {'MATCH' if ok else 'MISMATCH'}: {item.label}: {text}; recomputed in {seconds:.1f} s"
        + ("" if ok else f"; the recomputation is kept in {fresh}"))
    return 0 if ok else 1
