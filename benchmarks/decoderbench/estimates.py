"""Time estimates for --plan, from per-unit timings recorded by earlier runs (else docs/bench-decoder.md's).

Units: a training step (scaled by the share of blocks trained), a calibration window (all blocks, one
FeatCal; --tune costs what featcal.calibration.tuning.planned_calibrations says its search costs at
most, in such calibrations), an evaluated token, a merge, and WUDI's Adam iterations (FLOPs of its
closed-form gradient, at the rate the recorded training step implies). Rough by construction: CPU timings
move with the machine's load, and these are read from one or two runs; every estimate says where its
rate came from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# (layers, hidden, intermediate, heads, kv heads, head dim, vocab) of the real bases
SHAPES = {"smollm2": (30, 576, 1536, 9, 3, 64, 49152), "gemma3": (18, 640, 2048, 4, 1, 256, 262144)}


@dataclass
class Rates:
    s_per_step: float  # one training step of batch x seq_len tokens, `trained` blocks trained
    trained: int
    calib_s_per_window: float  # FeatCal, all blocks, per calibration window of seq_len tokens
    calib_overhead_s: float  # a calibrate process's loading and checks
    merge_s: float  # a data-free task-vector merge process (TA)
    ties_s: float
    eval_s_per_token: float
    eval_overhead_s: float  # an eval process's start and one model's load
    base_load_s: float  # the bench's own GGUF read
    seq_len: int = 128
    batch_size: int = 4
    source: str = ""


# docs/bench-decoder.md, the idle runs of 2026-12-03 (2 threads): SmolLM2 884 s, Gemma 1718 s
DOC_RATES = {
    "smollm2": Rates(s_per_step=2.5, trained=15, calib_s_per_window=95.0 / 64, calib_overhead_s=40.0, merge_s=62.0,
                     ties_s=70.0, eval_s_per_token=25.0 / (4 * 24 * 128), eval_overhead_s=10.0, base_load_s=78.0,
                     source="docs/bench-decoder.md (SmolLM2 idle run, 2026-12-03: 2.4-2.6 s/step, calibration 95 s "
                            "for 4 x 16 windows, merges 62 / 70 s, 25 s per model evaluated; GGUF load 78 s on a "
                            "busy machine)"),
    "gemma3": Rates(s_per_step=4.35, trained=9, calib_s_per_window=136.0 / 64, calib_overhead_s=111.0, merge_s=117.0,
                    ties_s=196.0, eval_s_per_token=5.5e-3, eval_overhead_s=20.0, base_load_s=120.0,
                    source="docs/bench-decoder.md (Gemma idle run, 2026-12-03: 4.1-4.6 s/step on 9 blocks, "
                           "calibration 136 s of 247 s for 4 x 16 windows, merges 117 / 196 s; evaluation ~5.5 ms "
                           "per token, derived from the run's 1718 s total less its other parts)"),
}
TINY_RATES = Rates(s_per_step=0.03, trained=4, calib_s_per_window=0.02, calib_overhead_s=3.0, merge_s=3.0, ties_s=3.0,
                   eval_s_per_token=2e-5, eval_overhead_s=2.0, base_load_s=1.0, seq_len=32,
                   source="tiny mode (guessed, in-process)")


def _old_format(report: dict) -> dict:
    """Per-unit rates out of a bench.json written before the reworked bench (one seed, stages by name)."""
    s, out = report.get("settings", {}), {}
    steps = [e["s_per_step"] for e in report.get("experts", {}).values() if e.get("s_per_step")]
    if steps:
        out.update(s_per_step=sum(steps) / len(steps), trained=s.get("train_layers"))
    fc = report.get("stages", {}).get("featcal", {})
    secs = fc.get("seconds") if isinstance(fc.get("seconds"), dict) else {}
    windows = s.get("calib_examples", 0) * len(s.get("domains", ()))
    if secs.get("calibrate") and windows:
        out["calib_s_per_window"] = secs["calibrate"] / windows
        if fc.get("wall_seconds"):
            out["calib_overhead_s"] = max(0.0, fc["wall_seconds"] - secs["calibrate"])
    for name, key in (("task_arithmetic", "merge_s"), ("ties", "ties_s")):
        if report.get("stages", {}).get(name, {}).get("wall_seconds"):
            out[key] = report["stages"][name]["wall_seconds"]
    ev = report.get("eval_seconds", {})
    tokens = s.get("eval_chunks", 0) * (s.get("seq_len", 0) - 1) * len(s.get("domains", ()))
    if ev.get("task_arithmetic") and tokens:
        out["eval_s_per_token"] = ev["task_arithmetic"] / tokens
    if report.get("base", {}).get("load_seconds"):
        out["base_load_s"] = report["base"]["load_seconds"]
    return out


def _new_format(report: dict) -> dict:
    """Per-unit rates out of a reworked bench.json: stages carry what they processed (`units`)."""
    out: dict = {}
    for seed in report.get("seeds", []):
        steps = [e["s_per_step"] for e in seed.get("experts", {}).values() if e.get("s_per_step") and not e.get("cached")]
        if steps:
            out.update(s_per_step=sum(steps) / len(steps), trained=report["settings"]["train_layers"])
        for st in seed.get("stages", []):
            u, wall, secs = st.get("units") or {}, st.get("wall_seconds"), st.get("seconds")
            if st.get("cached") or not wall:
                continue
            if st["kind"] == "calibrate" and not u.get("tune") and isinstance(secs, dict) and secs.get("calibrate"):
                out["calib_s_per_window"] = secs["calibrate"] / u["windows"]
                out["calib_overhead_s"] = max(0.0, wall - secs["calibrate"])
            elif st["kind"] == "eval" and u.get("tokens") and st["name"] != "eval:experts" and secs:
                out["eval_s_per_token"] = secs / u["tokens"]  # eval.json's seconds: the scoring
                out["eval_overhead_s"] = max(0.0, wall - secs)
            elif st["name"] == "merge:task_arithmetic":
                out["merge_s"] = wall
            elif st["name"] == "merge:ties":
                out["ties_s"] = wall
    return out


def load_rates(model: str, tiny: bool, reports: list[Path]) -> Rates:
    """The doc figures, overridden by whatever the given bench.json files (same model, not tiny) recorded."""
    if tiny:
        return TINY_RATES
    rates = asdict(DOC_RATES[model])
    used = []
    for path in reports:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        s = report.get("settings", {})
        if s.get("tiny") or s.get("model", "smollm2") != model:
            continue
        found = _new_format(report) if "seeds" in report else _old_format(report)
        if found:
            rates.update({k: v for k, v in found.items() if v is not None})
            used.append(f"{path} ({', '.join(sorted(found))})")
    if used:
        rates["source"] = "measured in " + "; ".join(used) + "; the rest: " + DOC_RATES[model].source
    return Rates(**rates)


def step_scale(model: str, trained: int, recorded: int) -> float:
    """How a training step's cost moves with the number of blocks trained (by FLOPs: forward over every block
    and the tied head, backward into the head's input and through the trained blocks, twice a forward)."""
    if model not in SHAPES:
        return 1.0
    return train_flops(model, trained, 1) / train_flops(model, recorded, 1)


def wudi_flops(model: str, steps: int = 300, tasks: int = 4) -> float:
    """float32-equivalent FLOPs of featcal's WUDI (merging/wudi.py, its closed-form gradient). Per Linear
    (out x in): A = sum_t w_t tau_t^T tau_t and B = sum_t w_t tau_t tau_t^T tau_t are built once (2 x tasks x
    out x in x in each), then every Adam step is one (out x in) @ (in x in) product, all in float64, counted
    twice (float64 at half the float32 rate the training step measures); where in > 2 x tasks x out, the
    per-task form instead: 4 x tasks x out x out x in per step in float32, nothing built. Untrained blocks'
    Linears (zero task vectors) cost the same: featcal does not skip them."""
    layers, h, inter, heads, kv, hd, _ = SHAPES[model]
    shapes = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    total = 0.0
    for o, i in shapes:
        if i > 2 * tasks * o:
            total += steps * 4.0 * tasks * o * o * i
        else:
            total += 2.0 * (2 * 2.0 * tasks * o * i * i + steps * 2.0 * o * i * i)
    return total * layers


def train_flops(model: str, trained: int, tokens: int) -> float:
    layers, h, inter, heads, kv, hd, vocab = SHAPES[model]
    block = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    return 2.0 * tokens * (layers * block + 2 * vocab * h + 2 * trained * block)


def flops_per_second(model: str, rates: Rates) -> float:
    """The machine's throughput as the recorded training step implies it."""
    return train_flops(model, rates.trained, rates.batch_size * rates.seq_len) / rates.s_per_step
