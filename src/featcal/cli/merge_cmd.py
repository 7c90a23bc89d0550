"""`featcal merge`: merge experts into their base and write the merged checkpoint.

The hyperparameter flags (--method, --scaling, --density, --drop-rate, --seed) are generated from
MergeConfig, so their defaults, help and valid ranges live in one schema shared with the Python API
and YAML run files.
"""

from __future__ import annotations

import argparse

from featcal.cli.calibrate_cmd import add_config_flags, config_from_args, parse_pairs
from featcal.config import MergeConfig


def run(args: argparse.Namespace) -> int:
    from featcal.io.report import Timer
    from featcal.merging.api import merge

    timer = Timer()
    config = config_from_args(args, MergeConfig)
    experts = parse_pairs(args.expert, "--expert")
    merged = merge(
        args.base, experts, config=config, out=args.out, overwrite=args.overwrite,
        allow_pickle=args.allow_pickle, progress=not args.no_progress,
    )
    print(
        f"merged {len(experts)} experts with {config.method} ({len(merged)} tensors) into {args.out} "
        f"in {timer.seconds:.1f} s"
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "merge", help="merge fine-tuned experts into their base (Task Arithmetic, TIES, DARE, ...)",
        description="Merge experts fine-tuned from one base into a single checkpoint, reading the experts "
        "tensor by tensor. The output is an ordinary Hugging Face checkpoint plus featcal.json.",
    )
    p.add_argument("--base", required=True, help="pretrained base checkpoint (directory or hub id)")
    p.add_argument("--expert", action="append", metavar="NAME=PATH", required=True,
                   help="a task's fine-tuned expert (repeat per task)")
    p.add_argument("--out", required=True, help="output directory for the merged checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickled (*.bin) checkpoints")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_config_flags(p, MergeConfig, "merge options")
    p.set_defaults(func=run)
