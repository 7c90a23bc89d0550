"""How much of the TA → experts gap FeatCal closes as a function of the number of merged tasks.

Why: on the offline zoo FeatCal closes far less of the gap than the paper reports. If calibrating
toward a single expert closes most of its gap but closure falls as tasks are added, the limit is
conflict between the experts' block maps (one set of weights cannot serve them all), not the solver.

    python benchmarks/closure_vs_tasks.py --zoo zoo-cache/default-seed0 --sizes 1,2,4,8 --subsets 4

For each size k, `--subsets` random k-task subsets (seeded): Task Arithmetic (scaling 0.3) of those
experts, FeatCal with `--calib` examples per task, accuracy on those tasks' test splits; prints the
median gap closed per k and writes every subset to `--json` when given.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import numpy as np
import torch

from featcal.calibration.front.api import calibrate
from featcal.config import FeatCalConfig
from featcal.evaluation.classification import accuracy
from featcal.evaluation.features import batches as _batches
from featcal.experiments.bench.metrics import gap_closed
from featcal.experiments.bench.run import MERGE_PARAMS
from featcal.experiments.zoo.store import Zoo
from featcal.merging.api import merge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", default="zoo-cache/default-seed0")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--subsets", type=int, default=4)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rho", type=float, help="FeatCal anchor blend ρ (default: the config's, the demo's 2.2)")
    ap.add_argument("--lambda-ratio", type=float, help="FeatCal ridge λ (default: the config's, 0.05)")
    ap.add_argument("--json")
    args = ap.parse_args()

    zoo = Zoo.open(args.zoo)
    tasks = list(zoo.tasks)
    loaded = zoo.load()
    base, experts, heads, tests = loaded.base, loaded.experts, loaded.heads, loaded.tests
    pools = {t: zoo.split(t, "calibration")[0][: args.calib] for t in tasks}
    expert_acc = {t: accuracy(experts[t], heads[t], *tests[t]) for t in tasks}
    overrides = {"anchor_blend_rho": args.rho, "lambda_ratio": args.lambda_ratio}
    cfg = FeatCalConfig(num_calibration_examples=args.calib, **{k: v for k, v in overrides.items() if v is not None})
    rng = np.random.default_rng(args.seed)
    records = []
    for k in (int(s) for s in args.sizes.split(",")):
        seen: set[tuple[str, ...]] = set()
        for _ in range(args.subsets if k < len(tasks) else 1):
            subset = tuple(sorted(rng.choice(tasks, k, replace=False).tolist()))
            if subset in seen:
                continue
            seen.add(subset)
            state = merge(zoo.base_dir, {t: zoo.expert_dir(t) for t in subset}, "task_arithmetic",
                          **MERGE_PARAMS["task_arithmetic"])
            merged = copy.deepcopy(base)
            merged.load_state_dict(state)
            calibration = {t: _batches(pools[t], cfg.calibration_batch_size) for t in subset}
            calibrated = calibrate(merged, base=zoo.base_dir, experts={t: experts[t] for t in subset},
                                   calibration=calibration, config=cfg, progress=False).model
            ta = loaded.mean_accuracy(merged, subset)
            fc = loaded.mean_accuracy(calibrated, subset)
            ex = float(np.mean([expert_acc[t] for t in subset]))
            closed = gap_closed(fc, ta, ex)
            records.append({"k": k, "tasks": subset, "ta": ta, "featcal": fc, "experts": ex, "gap_closed": closed})
            print(f"k={k} {','.join(subset)}: TA {ta:.3f} -> FeatCal {fc:.3f} (experts {ex:.3f}), "
                  f"gap closed {'n/a' if closed is None else f'{closed:.2f}'}", flush=True)
    for k in sorted({r["k"] for r in records}):
        vals = [r["gap_closed"] for r in records if r["k"] == k and r["gap_closed"] is not None]
        if vals:
            print(f"SUMMARY k={k}: median gap closed {statistics.median(vals):.2f} over {len(vals)} subsets")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
