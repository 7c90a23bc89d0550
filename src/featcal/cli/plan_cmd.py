"""`featcal plan`: the peak memory a `featcal calibrate` with the same arguments would need, before any work.

Also behind `featcal calibrate --dry-run` (print and stop) and `--max-memory SIZE` (refuse to start a
run whose estimate exceeds SIZE, listing the options that would fit). See calibration/planning/planner.py.

`featcal plan --config CONFIG --tasks N` plans from a model's config alone (a config.json, a folder holding
one, or a hub id; no weights, no data), with the run's time at a stated throughput (calibration/planning/cost.py) and
what fits on each kind of machine (`--target`, calibration/planning/fit.py).
"""

from __future__ import annotations

import argparse

from featcal.cli.calibrate_args import add_arguments, config_from_args, parse_pairs, run_options_from_args
from featcal.cli.commands import HELP
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError

_INPUTS = ("base", "merged", "expert", "calib")  # what names checkpoints and data (with --out: a calibrate's inputs)


def plan_request(args: argparse.Namespace, config: FeatCalConfig, **fields):
    """The PlanRequest (featcal.jobs) of `featcal plan`'s flags, or `featcal calibrate`'s (which lacks the
    planning flags), with `fields` changed."""
    from featcal.jobs import PlanRequest

    flag = lambda name: getattr(args, name, None)  # noqa: E731  (calibrate has no --config, --target, ...)
    return PlanRequest(
        base=args.base, merged=args.merged, experts=parse_pairs(args.expert, "--expert"),
        calibration=parse_pairs(args.calib, "--calib"), out=args.out, heads=parse_pairs(args.tune_head, "--tune-head"),
        model_config=flag("config"), tasks=flag("tasks"), config=config, options=run_options_from_args(args),
        max_memory=args.max_memory, targets=tuple(flag("target") or ()), device_memory=flag("device_memory"),
        host_memory=flag("host_memory"), flops=flag("flops"), flops64=flag("flops64"), time_from=flag("time_from"),
        **fields,
    )


def check_plan(args: argparse.Namespace, config: FeatCalConfig, show: bool, check_device: bool = True) -> bool:
    """`featcal calibrate --dry-run` (`show`: print the memory plan and the data's summary) and --max-memory (raise
    ConfigError when the plan exceeds it). Returns `show`.

    `check_device=False` plans for a device this machine may lack."""
    from featcal import jobs
    from featcal.calibration.planning.planner import fmt

    result = jobs.plan(plan_request(args, config, check_device=check_device, estimate_time=False,
                                    summarise_data=show))
    if show:
        print(result.text)
    elif result.fits_max_memory is False:
        good = result.options_that_fit()
        hint = f"; these fit: {', '.join(good)}" if good else "; no single memory option fits (see featcal plan)"
        raise ConfigError(f"estimated peak memory {fmt(result.peak_memory)} exceeds --max-memory "
                          f"{fmt(result.max_memory)}{hint}")
    return show


def _check_inputs(args: argparse.Namespace) -> None:
    """Checkpoints and data, or --config: one or the other, refused before any work."""
    given = [f"--{n}" for n in _INPUTS if getattr(args, n) is not None]
    if args.config is not None:
        if given:
            raise ConfigError(f"--config plans from a model's config alone, while {', '.join(given)} name a run's "
                              "checkpoints and data: give one or the other")
        if args.tasks is None:
            raise ConfigError("--config needs --tasks N: the number of experts (tasks) to plan for")
        if args.tasks < 1:
            raise ConfigError(f"--tasks must be at least 1, got {args.tasks}")
        return
    missing = [f"--{n}" for n in (*_INPUTS, "out") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"featcal plan needs {', '.join(missing)} (the calibrate arguments), or --config CONFIG "
                          "--tasks N to plan from a model's config alone")
    if args.tasks is not None:
        raise ConfigError("--tasks goes with --config: with checkpoints, the tasks are the --expert given")


def _rates(args: argparse.Namespace) -> None:
    for flag in ("flops", "flops64"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ConfigError(f"--{flag} must be a positive number of FLOP/s, got {value}")


def run(args: argparse.Namespace) -> int:
    from featcal import jobs

    config = config_from_args(args, FeatCalConfig)
    _check_inputs(args)  # the flags' own words; the request checks the same in its fields' words
    _rates(args)
    print(jobs.plan(plan_request(args, config)).text)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help=HELP["plan"],
        description="Print the peak memory per process that `featcal calibrate` with these arguments would "
        "need, broken down, and the options (bf16 chains, spilling, smaller batches, more ranks) that "
        "reduce it. Makes every check calibrate makes before its work (checkpoint headers, each task's "
        "data, the output directory), but loads no weights and scans none for NaN. With --config CONFIG "
        "--tasks N instead of the checkpoints and data: the same from a model's config alone, with the run's "
        "time at a stated throughput and what fits on a 24 GB GPU, an 80 GB GPU and a CPU (--target).",
    )
    add_arguments(p, inputs_required=False)
    g = p.add_argument_group("planning from a config alone, targets")
    g.add_argument("--config", metavar="CONFIG", default=None,
                   help="a model's config.json, a folder holding one, or a hub id: plan without checkpoints or data "
                   "(instead of --base, --merged, --expert, --calib, --out)")
    g.add_argument("--tasks", type=int, default=None, metavar="INT", help="with --config: the number of experts (tasks)")
    g.add_argument("--target", action="append", default=None, metavar="NAME",
                   help="gpu-24gb, gpu-80gb or cpu (repeat): what fits there, with which options, and how long "
                   "(default with --config: all three)")
    g.add_argument("--device-memory", default=None, metavar="SIZE", help="the targets' device memory (e.g. 48GiB)")
    g.add_argument("--host-memory", default=None, metavar="SIZE", help="the targets' host memory (e.g. 256GiB)")
    g.add_argument("--flops", type=float, default=None, metavar="FLOP/S",
                   help="sustained float32 FLOP/s to estimate time at, instead of the stated one (calibration/planning/cost.py)")
    g.add_argument("--time-from", choices=("probe", "stated"), default=None,
                   help="the run's time from a short measured probe of this machine (about 1 s; the default for a "
                   "run on this machine), or at the stated throughput of its device kind (the default with --config)")
    g.add_argument("--flops64", type=float, default=None, metavar="FLOP/S",
                   help="sustained float64 FLOP/s (the fold and the solves), instead of the stated one")
    p.set_defaults(func=run)
