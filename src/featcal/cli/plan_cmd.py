"""`featcal plan`: the peak memory a `featcal calibrate` with the same arguments would need, before any work.

Also behind `featcal calibrate --dry-run` (print and stop) and `--max-memory SIZE` (refuse to start a
run whose estimate exceeds SIZE, listing the options that would fit). See calibration/planner.py.

`featcal plan --config CONFIG --tasks N` plans from a model's config alone (a config.json, a folder holding
one, or a hub id; no weights, no data), with the run's time at a stated throughput (calibration/cost.py) and
what fits on each kind of machine (`--target`, calibration/fit.py).
"""

from __future__ import annotations

import argparse
import os

from featcal.cli.calibrate_args import add_arguments, config_from_args, parse_pairs, run_options_from_args
from featcal.cli.commands import HELP
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError

_INPUTS = ("base", "merged", "expert", "calib")  # what names checkpoints and data (with --out: a calibrate's inputs)


def _plan(args: argparse.Namespace, config: FeatCalConfig, check_device: bool):
    from featcal.calibration.pipeline import check_calibration_inputs, feature_width
    from featcal.calibration.planner import plan_for_checkpoint
    from featcal.calibration.tuning import load_heads
    from featcal.io.models import load_config

    experts = parse_pairs(args.expert, "--expert")
    options = run_options_from_args(args)
    heads = parse_pairs(args.tune_head, "--tune-head")
    # every check the run makes before its work (task names, options, output, checkpoints' headers, each
    # task's data as the run draws and tokenises it, the --tune-head files), so a plan that prints is a run
    # that starts; the NaN scan, which reads all weights, is left
    checked = check_calibration_inputs(
        args.merged, base=args.base, experts=experts, calibration_sources=parse_pairs(args.calib, "--calib"),
        config=config, out=args.out, **options.model_dump(), check_finite=False, check_device=check_device,
        heads=heads,
    )
    load_heads(heads, checked.tasks, config.tune, feature_width(load_config(checked.merged)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan, alternatives = plan_for_checkpoint(checked.merged, tasks=len(experts), config=config,
                                             max_length=options.max_length, world=world)
    return plan, alternatives, checked


def data_lines(args: argparse.Namespace, config: FeatCalConfig, checked) -> list[str]:
    """Per task, the examples and tokens its data gives the run and how it is read (packed windows, or one example
    per record): read now as the run will read it (calibration/data_summary.py)."""
    from featcal.calibration.data_summary import read_task_data, task_data_lines

    options = run_options_from_args(args)
    sources = parse_pairs(args.calib, "--calib")
    records = read_task_data({t: sources[t] for t in checked.tasks}, model_dir=checked.data_dir,
                             experts=checked.experts, config=config, max_length=options.max_length,
                             allow_fewer=options.allow_fewer)
    return task_data_lines(records, options.max_length)


def check_plan(args: argparse.Namespace, config: FeatCalConfig, show: bool, check_device: bool = True) -> bool:
    """Print the plan when `show`; raise ConfigError when it exceeds --max-memory. Returns `show`.

    `check_device=False` (featcal plan) plans for a device this machine may lack."""
    from featcal.calibration.planner import fmt, parse_size, render

    limit = parse_size(args.max_memory) if args.max_memory is not None else None
    plan, options, checked = _plan(args, config, check_device)
    if show:
        print(render(plan, options, limit))
        print("\n".join(data_lines(args, config, checked)))
    elif limit is not None and plan.total > limit:
        good = [name for name, p in options if p.total <= limit]
        hint = f"; these fit: {', '.join(good)}" if good else "; no single memory option fits (see featcal plan)"
        raise ConfigError(f"estimated peak memory {fmt(plan.total)} exceeds --max-memory {fmt(limit)}{hint}")
    return show


def _targets(args: argparse.Namespace, default: tuple[str, ...]) -> list:
    from featcal.calibration import fit
    from featcal.calibration.planner import parse_size

    size = {k: parse_size(getattr(args, k)) if getattr(args, k) else None for k in ("device_memory", "host_memory")}
    return [fit.target(name, device_bytes=size["device_memory"], host_bytes=size["host_memory"], f32=args.flops,
                       f64=args.flops64) for name in (args.target or default)]


def _check_inputs(args: argparse.Namespace) -> None:
    """Checkpoints and data, or --config: one or the other, refused before any work."""
    given = [f"--{n}" for n in _INPUTS if getattr(args, n) is not None]
    if args.config is not None:
        if given:
            raise ConfigError(f"--config plans from a model's config alone, while {', '.join(given)} name a run's "
                              "checkpoints and data: give one or the other")
        if args.tasks is None:
            raise ConfigError("--config needs --tasks N: the number of experts (tasks) to plan for")
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


def _time_source(args: argparse.Namespace, config: FeatCalConfig) -> bool:
    """Whether the time comes from a measured probe of this machine: --time-from, by default a probe for a run on
    this machine (checkpoints given, its device here, no --flops) and the stated throughput for --config."""
    from featcal.calibration.time_estimate import can_probe

    rates = [f"--{f}" for f in ("flops", "flops64") if getattr(args, f) is not None]
    if args.time_from == "probe":
        if rates:
            raise ConfigError(f"--time-from probe measures the rates that {' and '.join(rates)} state: give one")
        if not can_probe(config.device):
            raise ConfigError(f"--time-from probe: device {config.device} is not on this machine to be measured; "
                              "use --time-from stated (or --flops) to plan for it")
        return True
    if args.time_from == "stated":
        return False
    return args.config is None and not rates and can_probe(config.device)


def _time(merged, tasks: int, config: FeatCalConfig, args: argparse.Namespace, measure: bool) -> str:
    from featcal.calibration import cost
    from featcal.calibration.time_estimate import time_report

    stated = cost.with_rates(cost.throughput_for(config.device), args.flops, args.flops64)
    return time_report(merged, tasks=tasks, config=config, max_length=run_options_from_args(args).max_length,
                       measure=measure,
                       throughput=stated)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args, FeatCalConfig)
    _check_inputs(args)
    _rates(args)
    from featcal.calibration import fit
    from featcal.calibration.planner import parse_size, render

    limit = parse_size(args.max_memory) if args.max_memory is not None else None
    measure = _time_source(args, config)
    max_length = run_options_from_args(args).max_length
    if args.config is None:
        plan, options, checked = _plan(args, config, check_device=False)
        merged = checked.merged
        print(render(plan, options, limit))
        print("\n".join(data_lines(args, config, checked)))
        print(_time(merged, len(args.expert), config, args, measure))
        if args.target:
            print(fit.plan_report(merged, tasks=len(args.expert), config=config, max_length=max_length,
                                  targets=_targets(args, ()), with_plan=False))
        return 0
    import featcal.calibration.pipeline  # noqa: F401  (what calibrate imports: the measured baseline sees it too)
    from featcal.calibration import cost

    if args.tasks < 1:
        raise ConfigError(f"--tasks must be at least 1, got {args.tasks}")
    tp = cost.with_rates(cost.throughput_for(config.device), args.flops, args.flops64)
    if measure:  # --time-from probe: this machine's rates, for the plan and its targets' times
        from featcal.calibration import time_estimate
        from featcal.calibration.planner import model_shape
        from featcal.io.models import load_config

        shape = model_shape(load_config(args.config), max_length)
        found = time_estimate.probe(shape, config, device=time_estimate.probe_device(config.device))
        tp = time_estimate.measured_throughput(found, tp)
    print(fit.plan_report(args.config, tasks=args.tasks, config=config, max_length=max_length,
                          targets=_targets(args, tuple(fit.TARGETS)), throughput=tp, max_memory=limit,
                          world=int(os.environ.get("WORLD_SIZE", "1"))))
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
                   help="sustained float32 FLOP/s to estimate time at, instead of the stated one (calibration/cost.py)")
    g.add_argument("--time-from", choices=("probe", "stated"), default=None,
                   help="the run's time from a short measured probe of this machine (about 1 s; the default for a "
                   "run on this machine), or at the stated throughput of its device kind (the default with --config)")
    g.add_argument("--flops64", type=float, default=None, metavar="FLOP/S",
                   help="sustained float64 FLOP/s (the fold and the solves), instead of the stated one")
    p.set_defaults(func=run)
