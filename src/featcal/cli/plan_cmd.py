"""`featcal plan`: the peak memory a `featcal calibrate` with the same arguments would need, before any work.

Also behind `featcal calibrate --dry-run` (print and stop) and `--max-memory SIZE` (refuse to start a
run whose estimate exceeds SIZE, listing the options that would fit). See calibration/planner.py.
"""

from __future__ import annotations

import argparse
import os

from featcal.config import FeatCalConfig


def _plan(args: argparse.Namespace, config: FeatCalConfig):
    from featcal.calibration.planner import plan_for_checkpoint
    from featcal.cli.calibrate_cmd import parse_pairs
    from featcal.io.checkpoint import resolve_checkpoint

    experts = parse_pairs(args.expert, "--expert")
    import featcal.calibration.pipeline  # noqa: F401  (the measured baseline includes what calibrate imports)

    merged = resolve_checkpoint(args.merged, allow_pickle=args.allow_pickle)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return plan_for_checkpoint(merged, tasks=len(experts), config=config, max_length=args.max_length, world=world)


def check_plan(args: argparse.Namespace, config: FeatCalConfig, show: bool) -> bool:
    """Print the plan when `show`; raise ConfigError when it exceeds --max-memory. Returns `show`."""
    from featcal.calibration.planner import fmt, parse_size, render
    from featcal.errors import ConfigError

    limit = parse_size(args.max_memory) if args.max_memory is not None else None
    plan, options = _plan(args, config)
    if show:
        print(render(plan, options, limit))
    elif limit is not None and plan.total > limit:
        good = [name for name, p in options if p.total <= limit]
        hint = f"; these fit: {', '.join(good)}" if good else "; no single memory option fits (see featcal plan)"
        raise ConfigError(f"estimated peak memory {fmt(plan.total)} exceeds --max-memory {fmt(limit)}{hint}")
    return show


def run(args: argparse.Namespace) -> int:
    from featcal.cli.calibrate_cmd import config_from_args

    check_plan(args, config_from_args(args, FeatCalConfig), show=True)
    return 0


def register(subparsers) -> None:
    from featcal.cli.calibrate_cmd import add_arguments

    p = subparsers.add_parser(
        "plan", help="estimate the peak memory of a calibration (same arguments as calibrate)",
        description="Print the peak memory per process that `featcal calibrate` with these arguments would "
        "need, broken down, and the options (bf16 chains, spilling, smaller batches, more ranks) that "
        "reduce it. Reads configs only: no weights, no data.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
