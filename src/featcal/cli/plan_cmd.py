"""`featcal plan`: the peak memory a `featcal calibrate` with the same arguments would need, before any work.

Also behind `featcal calibrate --dry-run` (print and stop) and `--max-memory SIZE` (refuse to start a
run whose estimate exceeds SIZE, listing the options that would fit). See calibration/planner.py.
"""

from __future__ import annotations

import argparse
import os

from featcal.cli.calibrate_args import add_arguments, config_from_args, parse_pairs, run_options_from_args
from featcal.config import FeatCalConfig


def _plan(args: argparse.Namespace, config: FeatCalConfig, check_device: bool):
    from featcal.calibration.pipeline import check_calibration_inputs
    from featcal.calibration.planner import plan_for_checkpoint

    experts = parse_pairs(args.expert, "--expert")
    options = run_options_from_args(args)
    # every check the run makes before its work (task names, options, output, checkpoints' headers, each
    # task's data), so a plan that prints is a run that starts; the NaN scan, which reads all weights, is left
    checked = check_calibration_inputs(
        args.merged, base=args.base, experts=experts, calibration_sources=parse_pairs(args.calib, "--calib"),
        config=config, out=args.out, **options.model_dump(), check_finite=False, check_device=check_device,
        heads=parse_pairs(args.tune_head, "--tune-head"),
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return plan_for_checkpoint(checked.merged, tasks=len(experts), config=config, max_length=options.max_length,
                               world=world)


def check_plan(args: argparse.Namespace, config: FeatCalConfig, show: bool, check_device: bool = True) -> bool:
    """Print the plan when `show`; raise ConfigError when it exceeds --max-memory. Returns `show`.

    `check_device=False` (featcal plan) plans for a device this machine may lack."""
    from featcal.calibration.planner import fmt, parse_size, render
    from featcal.errors import ConfigError

    limit = parse_size(args.max_memory) if args.max_memory is not None else None
    plan, options = _plan(args, config, check_device)
    if show:
        print(render(plan, options, limit))
    elif limit is not None and plan.total > limit:
        good = [name for name, p in options if p.total <= limit]
        hint = f"; these fit: {', '.join(good)}" if good else "; no single memory option fits (see featcal plan)"
        raise ConfigError(f"estimated peak memory {fmt(plan.total)} exceeds --max-memory {fmt(limit)}{hint}")
    return show


def run(args: argparse.Namespace) -> int:
    check_plan(args, config_from_args(args, FeatCalConfig), show=True, check_device=False)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="estimate the peak memory of a calibration (same arguments as calibrate)",
        description="Print the peak memory per process that `featcal calibrate` with these arguments would "
        "need, broken down, and the options (bf16 chains, spilling, smaller batches, more ranks) that "
        "reduce it. Makes every check calibrate makes before its work (checkpoint headers, each task's "
        "data, the output directory), but loads no weights and scans none for NaN.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
