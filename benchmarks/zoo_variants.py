"""Try a variant of the default zoo (pretraining / fine-tuning budgets, model width) and report its regime.

Why: issue #4 asks for a zoo in which Task Arithmetic sits between the base and the experts and
FeatCal's gap closure can be compared with the paper's. Each variant is a `ZooPreset` derived from
`default` with a few fields replaced; the bench itself (featcal's merge + calibrate) measures it.

    python benchmarks/zoo_variants.py --tag lr4e4 --pretrain-lr 4e-4 --pretrain-steps 2000 \
        --ft-lr 2e-4 --ft-steps 400 --calib 64 --root /tmp/zoo-variants

Prints one RESULT line: base, TA, TA + FeatCal, experts (average accuracies) and the gap closed.
Pretrained bases are cached under ROOT/bases, so variants that differ only downstream share one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from featcal.experiments.bench.run import BenchSettings, run_bench
from featcal.experiments.zoo.presets import PRESETS, ModelShape


def variant(args: argparse.Namespace):
    d = PRESETS["default"]
    model = d.model
    if args.hidden or args.layers:
        hidden = args.hidden or d.model.hidden_size
        model = ModelShape(hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=args.layers or d.model.num_hidden_layers,
                           num_attention_heads=hidden // 64, patch_size=d.model.patch_size)
    pretrain = dataclasses.replace(d.pretrain, **{k: v for k, v in {
        "lr": args.pretrain_lr, "steps": args.pretrain_steps, "images": args.pretrain_images}.items() if v is not None})
    finetune = dataclasses.replace(d.finetune, **{k: v for k, v in {
        "lr": args.ft_lr, "steps": args.ft_steps, "layer_decay": args.layer_decay}.items() if v is not None})
    heads = {k: v for k, v in {"probe_shots": args.probe_shots, "probe_c": args.probe_c}.items() if v is not None}
    return dataclasses.replace(d, name=f"variant-{args.tag}", model=model, pretrain=pretrain, finetune=finetune,
                               **heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--root", default="zoo-variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--pretrain-lr", type=float)
    ap.add_argument("--pretrain-steps", type=int)
    ap.add_argument("--pretrain-images", type=int)
    ap.add_argument("--ft-lr", type=float)
    ap.add_argument("--ft-steps", type=int)
    ap.add_argument("--layer-decay", type=float)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--probe-shots", type=int, help="labelled examples per class for the frozen heads")
    ap.add_argument("--probe-c", type=float, help="inverse L2 strength of the probe heads")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    preset = variant(args)
    PRESETS[preset.name] = preset
    root = Path(args.root)
    report = run_bench(BenchSettings(preset=preset.name, seed=args.seed, calib_sizes=(args.calib,),
                                     methods=("task_arithmetic",), zoo_dir=root / args.tag,
                                     base_cache=root / "bases"), progress=False)
    rows = {(r["method"], r["calibrated"]): r for r in report["rows"]}
    base, ta = rows[("base", False)]["average_accuracy"], rows[("task_arithmetic", False)]["average_accuracy"]
    fc = rows[("task_arithmetic", True)]
    result = {"tag": args.tag, "base": base, "ta": ta, "ta_featcal": fc["average_accuracy"],
              "experts": report["experts_average"], "gap_closed": fc["gap_closed"], "cost_ratio": fc["cost_ratio"],
              "preset": dataclasses.asdict(preset), "build": report["zoo"]["regime_at_build"]}
    (root / f"{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"RESULT {args.tag}: base {base:.3f} TA {ta:.3f} TA+FeatCal {fc['average_accuracy']:.3f} "
          f"experts {report['experts_average']:.3f} gap closed {fc['gap_closed']:.3f} cost x{fc['cost_ratio']:.2f}")


if __name__ == "__main__":
    main()
