"""Can one set of encoder weights of the zoo's size hold all 8 tasks? A multi-task fine-tuning ceiling.

Why: FeatCal re-solves one merged encoder toward 8 experts. If joint fine-tuning of the same encoder,
from the same base, through the same frozen heads, reaches the experts' accuracy, the capacity is
there and the limit is what closed-form, block-wise calibration can recover; if it falls short,
the zoo's model is too small to hold the experts' skills at once, whatever the calibrator.

    python benchmarks/multitask_ceiling.py --zoo zoo-cache/default-seed0 --steps 400,1600

Each step: one batch of `--per-task` examples from every task, each through its own frozen head,
the mean of the 8 losses; AdamW at the experts' learning rate with their warm-up and cosine decay.

`--calibrate-toward` then runs FeatCal (paper defaults, `--calib` examples per task) from Task
Arithmetic 0.3 of the experts toward the multi-task model, given as the "expert" of every task: one
set of mutually consistent target features instead of eight conflicting ones.
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch
from tqdm import tqdm

from featcal.evaluation.classification import accuracy
from featcal.experiments.zoo.presets import get_preset
from featcal.experiments.zoo.store import Zoo
from featcal.experiments.zoo.train import schedule
from featcal.io.read.models import load_model


def train_jointly(base, heads, train, steps: int, per_task: int, lr: float, warmup: int, seed: int):
    model = copy.deepcopy(base)
    for h in heads.values():
        h.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(warmup, steps))
    model.train()
    for _ in tqdm(range(steps), desc=f"multi-task, {steps} steps", leave=False):
        loss = torch.zeros(())
        for t, (x, y) in train.items():
            idx = torch.randint(0, len(x), (per_task,), generator=g)
            loss = loss + torch.nn.functional.cross_entropy(heads[t](model(pixel_values=x[idx]).pooler_output), y[idx])
        opt.zero_grad(set_to_none=True)
        (loss / len(train)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.eval()


def calibrate_toward(zoo, loaded, target, calib: int) -> dict:
    """FeatCal from TA 0.3 toward one model for every task; accuracy before and after."""
    from featcal.calibration.front.api import calibrate
    from featcal.config import FeatCalConfig
    from featcal.evaluation.features import batches as _batches
    from featcal.experiments.bench.metrics import gap_closed
    from featcal.experiments.bench.run import MERGE_PARAMS
    from featcal.merging.api import merge

    tasks = zoo.tasks
    merged = copy.deepcopy(loaded.base)
    merged.load_state_dict(merge(zoo.base_dir, zoo.expert_dirs, "task_arithmetic", progress=False,
                                 **MERGE_PARAMS["task_arithmetic"]))
    cfg = FeatCalConfig(num_calibration_examples=calib)
    calibration = {t: _batches(zoo.split(t, "calibration")[0][:calib], cfg.calibration_batch_size) for t in tasks}
    calibrated = calibrate(merged, base=zoo.base_dir, experts=dict.fromkeys(tasks, target), calibration=calibration,
                           config=cfg, progress=False).model
    ta, fc, mt = (loaded.mean_accuracy(m) for m in (merged, calibrated, target))
    closed = gap_closed(fc, ta, mt)
    print(f"TA {ta:.4f} -> FeatCal toward the multi-task model {fc:.4f} (target {mt:.4f}): "
          f"{100 * closed:.1f}% of that gap closed", flush=True)
    return {"ta": ta, "featcal": fc, "target": mt, "gap_closed": closed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", default="zoo-cache/default-seed0")
    ap.add_argument("--preset", default="default", help="whose fine-tuning lr and warm-up to use")
    ap.add_argument("--steps", default="400,1600")
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate-toward", action="store_true",
                    help="also calibrate TA 0.3 toward the multi-task model of the last --steps value")
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    zoo = Zoo.open(args.zoo)
    ft = get_preset(args.preset).finetune
    tasks = list(zoo.tasks)
    loaded = zoo.load(experts=False)  # experts are scored one at a time below, not held
    base, heads, tests = loaded.base, loaded.heads, loaded.tests
    train = {t: zoo.split(t, "train") for t in tasks}
    experts = float(np.mean([accuracy(load_model(zoo.expert_dir(t)), heads[t], *tests[t]) for t in tasks]))
    out = {"experts": experts, "base": loaded.mean_accuracy(base)}
    print(f"base {out['base']:.4f}, experts {experts:.4f}", flush=True)
    for steps in (int(s) for s in args.steps.split(",")):
        model = train_jointly(base, heads, train, steps, args.per_task, ft.lr, ft.warmup, args.seed)
        per_task = {t: accuracy(model, heads[t], *tests[t]) for t in tasks}
        out[f"multitask_{steps}"] = {"average": float(np.mean(list(per_task.values()))), "per_task": per_task}
        print(f"multi-task {steps} steps x {args.per_task}/task: {np.mean(list(per_task.values())):.4f} "
              + " ".join(f"{t} {a:.3f}" for t, a in per_task.items()), flush=True)
    if args.calibrate_toward:
        out["calibrated_toward_multitask"] = calibrate_toward(zoo, loaded, model, args.calib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
