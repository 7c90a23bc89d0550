"""`featcal merge`: merge experts into their base and write the merged checkpoint.

The hyperparameter flags (--method, --scaling, --density, --drop-rate, --seed, --alpha, --steps, --lr,
--num-calibration-examples, --calibration-batch-size) are generated from MergeConfig, so their
defaults, help and valid ranges live in one schema shared with the Python API and YAML run files.
RegMean and RegMean++ read calibration data given as `featcal calibrate` takes it (--calib NAME=DATA
per expert); the data-free methods refuse --calib.
"""

from __future__ import annotations

import argparse

from featcal.cli.calibrate_args import (
    add_config_flags,
    add_expert_kind,
    add_output_flags,
    config_from_args,
    parse_pairs,
    run_options_from_args,
)
from featcal.config import MergeConfig, method_names
from featcal.errors import ConfigError

PER_EXPERT_FLAGS = {"weights": "--weight", "densities": "--expert-density", "drop_rates": "--expert-drop-rate"}


def per_expert_options(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """--weight / --expert-density / --expert-drop-rate NAME=VALUE pairs, as MergeConfig's per-expert fields
    (values validated there)."""
    out = {}
    for field, flag in PER_EXPERT_FLAGS.items():
        pairs = parse_pairs(getattr(args, field, None), flag)
        if pairs:
            out[field] = {name: _number(value, flag, name) for name, value in pairs.items()}
    return out


def _number(value: str, flag: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} {name}={value}: {value!r} is not a number") from None


def run(args: argparse.Namespace) -> int:
    from featcal.io.report import Timer
    from featcal.merging.api import merge

    timer = Timer()
    config = config_from_args(args, MergeConfig, **per_expert_options(args))
    options = run_options_from_args(args)
    experts = parse_pairs(args.expert, "--expert")
    calibration = parse_pairs(args.calib, "--calib") or None
    merged = merge(
        args.base, experts, config=config, out=args.out, progress=not args.no_progress, calibration=calibration,
        **options.model_dump(), dtype=args.dtype, tokenizer_source=args.tokenizer_source,
    )
    print(
        f"merged {len(experts)} experts with {config.method} ({len(merged)} tensors) into {args.out} "
        f"in {timer.seconds:.1f} s"
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "merge", help="merge fine-tuned experts into their base (Task Arithmetic, TIES, DARE, RegMean, WUDI, ...)",
        description="Merge experts fine-tuned from one base into a single checkpoint, reading the experts "
        "tensor by tensor (RegMean, RegMean++ and WUDI load whole models; RegMean reads --calib data). "
        "The output is an ordinary Hugging Face checkpoint plus featcal.json.",
    )
    p.add_argument("--base", required=True,
                   help="pretrained base checkpoint (directory, hub id, or a .gguf file / folder holding one)")
    p.add_argument("--expert", action="append", metavar="NAME=PATH", required=True,
                   help="a task's fine-tuned expert (repeat per task): a checkpoint, a .gguf file, or a LoRA/PEFT "
                   "adapter folder (applied to the base)")
    add_expert_kind(p)
    p.add_argument("--out", required=True, help="output directory for the merged checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickled (*.bin) checkpoints")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--calib", action="append", metavar="NAME=DATA",
                   help="regmean, regmean++: a task's calibration data, as for featcal calibrate (an image folder, "
                   "text, chat / SFT JSONL, CSV, parquet, a saved or hub dataset: docs/data.md; repeat per expert); "
                   "data-free methods refuse it")
    p.add_argument("--max-length", type=int, default=128, metavar="INT",
                   help="regmean, regmean++: truncate texts to this many tokens")
    p.add_argument("--allow-fewer", action="store_true",
                   help="regmean, regmean++: use all examples of a task holding fewer than --num-calibration-examples")
    add_output_flags(p)
    p.add_argument("--tokenizer-source", default=None, metavar="base|NAME",
                   help="whose tokenizer the output carries: the base's, or an expert's (default: the base's, "
                   "completed by what every expert agrees on and the base lacks, e.g. a chat template; experts that "
                   "disagree there are refused until this picks one)")
    p.add_argument("--weight", action="append", dest="weights", metavar="NAME=W",
                   help="an expert's weight w (repeat per expert; others: 1): θ0 + s·Σ w·τ (task_arithmetic, ties, "
                   "dare_ta, dare_ties), Σ w·θ / Σ w (linear)")
    p.add_argument("--expert-density", action="append", dest="densities", metavar="NAME=D",
                   help="ties, dare_ties: an expert's own density (repeat per expert; others: --density)")
    p.add_argument("--expert-drop-rate", action="append", dest="drop_rates", metavar="NAME=P",
                   help="dare_ta, dare_ties: an expert's own drop rate (repeat per expert; others: --drop-rate)")
    add_config_flags(p, MergeConfig, "merge options", choices={"method": method_names()})
    p.set_defaults(func=run)
