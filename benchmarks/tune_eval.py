"""`tune` against the paper's defaults on a zoo: test accuracy, share of the TA → experts gap closed, time.

Why: `--tune` chooses ρ, λ, α and the Task Arithmetic scaling from held-out *calibration* examples by a
label-free score; only the test split, never seen by the choice, says whether that choice is good.

    python benchmarks/tune_eval.py --zoo zoo-cache/text-seed0 --calib 256 --scaling 0.3 --budget 10 \
        --criterion drift,heads --json /tmp/tune.json

`--criterion drift` scores candidates by final-feature drift only; `heads` adds agreement with each
expert's predictions through the zoo's frozen heads (the Python API's `heads=`). One row per setting;
`--json` keeps every candidate. `--candidate-accuracy` (analysis only) also evaluates every candidate's
model on the test split, to see how well the label-free score ranks candidates; the choice never sees it
(one split only: cross-fitted, a candidate is k models; `--tune-folds 1` forces one split at small sizes).
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch

from featcal.calibration.front.api import calibrate
from featcal.config import FeatCalConfig
from featcal.evaluation.classification import accuracy
from featcal.evaluation.features import batches as _batches
from featcal.evaluation.features import features
from featcal.experiments.bench.metrics import gap_closed
from featcal.experiments.zoo.store import Zoo
from featcal.io.write.report import Timer
from featcal.merging.api import merge


def _spearman(a: list[float], b: list[float]) -> float | None:
    """Rank correlation (ties averaged) of two equally long lists; None under 3 values or a constant list."""
    from scipy.stats import spearmanr

    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", required=True)
    ap.add_argument("--calib", type=int, default=256, help="calibration examples per task")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--scaling", type=float, default=0.3, help="Task Arithmetic scaling of the merge calibrated")
    ap.add_argument("--budget", type=float, default=10.0, help="tune_budget")
    ap.add_argument("--seed", type=int, default=0, help="the split's seed")
    ap.add_argument("--criterion", default="drift,heads", help="comma-separated: drift, heads")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tune-folds", default="auto", help="tune_folds (auto: 2 folds at <= 4 held-out examples per task)")
    ap.add_argument("--candidate-accuracy", action="store_true",
                    help="analysis only: test accuracy of every candidate (fit on the fit part), never used to choose")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    zoo = Zoo.open(args.zoo)
    tasks = list(zoo.tasks)
    loaded = zoo.load()
    base, experts, heads, pooling = loaded.base, loaded.experts, loaded.heads, loaded.pooling
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge(zoo.base_dir, zoo.expert_dirs, "task_arithmetic", scaling=args.scaling,
                                 progress=False))
    ta = loaded.mean_accuracy(merged)
    ex = float(np.mean([accuracy(experts[t], heads[t], *loaded.tests[t], pooling=pooling) for t in tasks]))
    print(f"TA {args.scaling:g}: {ta:.4f}   experts: {ex:.4f}", flush=True)
    calibration = {t: _batches(zoo.split(t, "calibration", limit=args.calib)[0], args.batch_size) for t in tasks}
    head_fns = {t: (lambda model, batch, h=heads[t]: h(features(model, batch, pooling))) for t in tasks}

    records = [{"setting": f"task_arithmetic {args.scaling:g}", "accuracy": ta, "experts": ex}]
    runs = [("FeatCal, paper defaults", FeatCalConfig(num_calibration_examples=args.calib), {})]
    for crit in args.criterion.split(","):
        kwargs = {"merge_scaling": args.scaling, **({"heads": head_fns} if crit == "heads" else {})}
        cfg = FeatCalConfig(num_calibration_examples=args.calib, tune=True, tune_budget=args.budget, seed=args.seed,
                            tune_folds=args.tune_folds)
        runs.append((f"FeatCal --tune ({crit})", cfg, kwargs))
    seen_accuracy: list[float] = []
    if args.candidate_accuracy:  # wrap the scorer: the search still ranks by the label-free score alone
        from featcal.calibration import tuning

        label_free = tuning.score

        def scored(model, *a, **k):
            seen_accuracy.append(loaded.mean_accuracy(model))
            return label_free(model, *a, **k)

        tuning.score = scored
    for label, cfg, kwargs in runs:
        seen_accuracy.clear()
        clock = Timer()
        result = calibrate(merged, base=base, experts=experts, calibration=calibration, config=cfg, progress=False,
                           **kwargs)
        out = result.model
        seconds = clock.seconds
        acc = loaded.mean_accuracy(out)
        rec = {"setting": label, "accuracy": acc, "gap_closed": gap_closed(acc, ta, ex), "seconds": round(seconds, 1)}
        tuning = result.tuning
        if tuning is not None:
            rec["chosen"] = tuning["chosen"]
            rec["candidates"] = tuning["candidates"]
            if args.candidate_accuracy and tuning["folds"] > 1:  # k models per candidate: no one accuracy
                print("--candidate-accuracy needs one split (--tune-folds 1); not recorded", flush=True)
            elif args.candidate_accuracy:
                for c, acc_c in zip(rec["candidates"], seen_accuracy, strict=True):
                    c["test_accuracy_analysis_only"] = acc_c
                rec["spearman_drift_vs_accuracy"] = _spearman([-c["drift"] for c in rec["candidates"]], seen_accuracy)
                if rec["candidates"][0]["disagreement"] is not None:
                    rec["spearman_agreement_vs_accuracy"] = _spearman(
                        [-c["disagreement"] for c in rec["candidates"]], seen_accuracy)
            rec["tuning_seconds"] = tuning["seconds"]
            rec["split"] = {t: {k: v for k, v in s.items() if k != "held_out_indices"} for t, s in tuning["split"].items()}
        records.append(rec)
        chosen = "" if tuning is None else "  chose " + ", ".join(
            f"{k}={v:g}" for k, v in tuning["chosen"].items()
            if k in ("merge_scaling", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha") and v is not None)
        closed = "n/a (no gap)" if rec["gap_closed"] is None else f"{rec['gap_closed']:.3f}"
        print(f"{label:>28}: acc {acc:.4f}, gap closed {closed}, {seconds:.0f} s{chosen}", flush=True)
        for key in ("spearman_drift_vs_accuracy", "spearman_agreement_vs_accuracy"):
            if key in rec:
                print(f"{'':>30}{key}: {rec[key]}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=2)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
