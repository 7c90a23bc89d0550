"""Analysis only: how far per-block schedules of ρ / λ could take FeatCal on a zoo, judged by TEST labels.

Why: issue 17 asks `--tune` to search "per-block schedules, if it pays". Before building a schedule knob
into the config and the search, this bounds what one could buy: it calibrates the merge with a per-block
ρ or λ (every other value as given) and reads each result's test accuracy, i.e. it picks with labels, which
`--tune` never can. If even this oracle stays below a goal, a label-free search over the same schedules
cannot reach it. Not a method: nothing here is exposed in featcal's API.

    python benchmarks/block_schedule_oracle.py --zoo zoo-cache/default-seed0 --calib 256 --scaling 0.45 \\
        --rho 4 --lam 0.05 --alpha 0.5 --json runs/schedule-oracle-default-s0.json

The schedule is applied by wrapping the engine's per-block solve (FeatCalEngine._solve_and_load) so that
block l solves with ρ_l / λ_l; statistics are gathered as usual (α is read while gathering, so it is not
scheduled here).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from featcal.blocks.adapters import adapter_for
from featcal.calibration.engine import context
from featcal.calibration.front.api import calibrate
from featcal.config import FeatCalConfig
from featcal.evaluation.features import batches as _batches
from featcal.experiments.zoo.store import Zoo
from featcal.merging.api import merge

# per-block multipliers of the given value, for a 4-block zoo (longer stacks: interpolated)
SHAPES: dict[str, list[float]] = {
    "flat": [1.0, 1.0, 1.0, 1.0],
    "rising": [0.5, 0.75, 1.0, 1.5],
    "rising_steep": [0.5, 1.0, 1.5, 2.5],
    "falling": [1.5, 1.0, 0.75, 0.5],
    "falling_steep": [2.5, 1.5, 1.0, 0.5],
    "last_x2": [1.0, 1.0, 1.0, 2.0],
    "last_x3": [1.0, 1.0, 1.0, 3.0],
    "last_x4": [1.0, 1.0, 1.0, 4.0],
    "first_x2": [2.0, 1.0, 1.0, 1.0],
    "low_then_last_x2.7": [0.75, 0.75, 0.75, 2.0],
}


def _resample(shape: list[float], n: int) -> list[float]:
    """The shape stretched to n blocks by linear interpolation (the same list when n == len(shape))."""
    if n == len(shape):
        return list(shape)
    xs = [i * (len(shape) - 1) / max(n - 1, 1) for i in range(n)]
    return [shape[int(x)] + (shape[min(int(x) + 1, len(shape) - 1)] - shape[int(x)]) * (x - int(x)) for x in xs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", required=True)
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--scaling", type=float, default=0.3, help="Task Arithmetic scaling of the merge calibrated")
    ap.add_argument("--rho", type=float, default=2.2)
    ap.add_argument("--lam", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=0.25)
    ap.add_argument("--knobs", default="anchor_blend_rho,lambda_ratio", help="which knobs get a schedule")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    zoo = Zoo.open(args.zoo)
    loaded = zoo.load()
    calibration = {t: _batches(zoo.split(t, "calibration", limit=args.calib)[0], args.batch_size) for t in zoo.tasks}
    merged = copy.deepcopy(loaded.base)
    merged.load_state_dict(merge(zoo.base_dir, zoo.expert_dirs, "task_arithmetic", scaling=args.scaling,
                                 progress=False))
    schedule: dict[str, list[float]] = {}
    solve = context.BlockContext.solve

    def scheduled(self, mods, sums):  # block `layer` solves with its own ρ / λ
        run = self.run
        cfg = run.cfg
        if schedule:
            run.cfg = cfg.model_copy(update={k: v[self.layer] for k, v in schedule.items()})
        try:
            return solve(self, mods, sums)
        finally:
            run.cfg = cfg

    context.BlockContext.solve = scheduled
    base_values = {"anchor_blend_rho": args.rho, "lambda_ratio": args.lam}
    cfg = FeatCalConfig(num_calibration_examples=args.calib, anchor_blend_rho=args.rho, lambda_ratio=args.lam,
                        teacher_interp_alpha=args.alpha)
    stacks = adapter_for(merged).stacks(merged)
    if len(stacks) != 1:
        raise SystemExit("block_schedule_oracle: one stack of blocks only (the zoos' encoders)")
    n_blocks = len(stacks[0].blocks(merged))
    records = []
    for knob in args.knobs.split(","):
        for name, shape in SHAPES.items():
            if name == "flat" and records:
                continue  # the unscheduled calibration once
            schedule.clear()
            if name != "flat":
                schedule[knob] = [base_values[knob] * m for m in _resample(shape, n_blocks)]
            out = calibrate(merged, base=loaded.base, experts=loaded.experts, calibration=calibration, config=cfg,
                            progress=False).model
            rec = {"knob": None if name == "flat" else knob, "shape": name,
                   "values": schedule.get(knob), "accuracy": round(100 * loaded.mean_accuracy(out), 2)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    best = max(records, key=lambda r: r["accuracy"])
    print(f"flat {records[0]['accuracy']:.2f}; best schedule {best['accuracy']:.2f} ({best['knob']} {best['shape']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
