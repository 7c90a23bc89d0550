#!/usr/bin/env python
"""What `--tune` costs against one calibration, with the screen (tune_screen auto), without it (off) and per block
(tune_scope block), side by side in one process on one family: seconds, the ratio to one paper-default calibration, the candidates, and
whether the two searches chose the same setting (issue 50).

The family is calibration_speed.py's random CLIPVisionModel (base, perturbed experts, their Task Arithmetic merge
at 0.3, random inputs): the cost does not depend on what the experts learned; which setting is chosen does, so
the choice here only says whether the screen and the full search agree on this family, not which is better
(the benches say that: `featcal bench ... --featcal-variants reference,tuned,tuned+screened`).

    python benchmarks/tune_cost.py --tasks 4 --examples 256 --out runs/tune-cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_speed import PRESETS, build_family, random_batches  # noqa: E402

from featcal import FeatCalConfig, calibrate  # noqa: E402
from featcal.calibration.tuning import planned_calibrations  # noqa: E402

KNOBS = ("merge_scaling", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha")


def _timed(family: dict, data: dict, config: FeatCalConfig, scaling: float | None) -> tuple[float, dict]:
    start = time.perf_counter()
    result = calibrate(family["merged"], base=family["base"], experts=family["experts"], calibration=data,
                       config=config, progress=False, merge_scaling=scaling)
    seconds = time.perf_counter() - start
    record = result.tuning.as_dict() if result.tuning is not None else {}
    return seconds, record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--examples", type=int, default=256, help="calibration examples per task")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSON with every figure")
    args = ap.parse_args()
    args.perturbation, args.merge_scale = 0.05, 0.3
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size"):
        setattr(args, key, None)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="featcal-tune-cost-") as tmp:
        family = build_family(Path(tmp), args)
        data = {t: random_batches(family["merged"], args.examples, args.batch_size, args.seed + 100 + i)
                for i, t in enumerate(family["experts"])}
        common = dict(num_calibration_examples=args.examples, calibration_batch_size=args.batch_size)
        rows = {}
        for name, cfg, scaling in (
            ("one calibration (paper defaults)", FeatCalConfig(**common), None),
            ("tune, screen auto", FeatCalConfig(**common, tune=True, tune_screen="auto"), 0.3),
            ("tune, screen off (the search before)", FeatCalConfig(**common, tune=True, tune_screen="off"), 0.3),
            ("tune per block (tune_scope block)", FeatCalConfig(**common, tune=True, tune_scope="block"), None),
        ):
            seconds, record = _timed(family, data, cfg, scaling)
            rows[name] = {"seconds": round(seconds, 2), "tuning": record}
            if cfg.tune:
                rows[name]["planned_calibrations"] = round(planned_calibrations(cfg, args.examples)[0], 2)
            print(f"{name}: {seconds:.1f} s", flush=True)
    one = rows["one calibration (paper defaults)"]["seconds"]
    screened, full = rows["tune, screen auto"], rows["tune, screen off (the search before)"]
    blockwise = rows["tune per block (tune_scope block)"]
    summary = {
        "command": " ".join(sys.argv), "threads": args.threads, "tasks": args.tasks, "examples": args.examples,
        "preset": args.preset,
        "ratio_screened": round(screened["seconds"] / one, 2), "ratio_unscreened": round(full["seconds"] / one, 2),
        "planned_screened": screened["planned_calibrations"], "planned_unscreened": full["planned_calibrations"],
        "chosen_screened": {k: screened["tuning"]["chosen"][k] for k in KNOBS},
        "chosen_unscreened": {k: full["tuning"]["chosen"][k] for k in KNOBS},
        "candidates_screened": len(screened["tuning"]["candidates"]),
        "candidates_unscreened": len(full["tuning"]["candidates"]),
        "ratio_blockwise": round(blockwise["seconds"] / one, 2), "planned_blockwise": blockwise["planned_calibrations"],
        "blockwise_settings_scored": sum(len(b["candidates"]) for b in blockwise["tuning"]["blocks"]),
        "blockwise_chosen": [b["chosen"] for b in blockwise["tuning"]["blocks"]],
    }
    summary["same_choice"] = summary["chosen_screened"] == summary["chosen_unscreened"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
