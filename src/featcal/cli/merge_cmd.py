"""`featcal merge`: merge experts into their base and write the merged checkpoint.

The option flags (--method, --scaling, --density, ..., the per-expert --weight NAME=W, the calibration data's,
--overwrite, --dtype, ...) are generated from MergeConfig, RunOptions and OutputOptions (cli/flags.py), so their
defaults, help and valid ranges live in one schema shared with the Python API and YAML run files.
RegMean and RegMean++ read calibration data given as `featcal calibrate` takes it (--calib NAME=DATA
per expert); the data-free methods refuse --calib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.cli.calibrate_args import (
    add_base_flag,
    add_config_flags,
    add_expert_flag,
    add_output_flags,
    add_run_flags,
    config_from_args,
    output_options_from_args,
    parse_pairs,
    run_options_from_args,
)
from featcal.cli.commands import HELP
from featcal.cli.flags import PREFIX, add_flag
from featcal.config import MergeConfig, load_plugins, method_names, own_parameters, registered_methods


def _method_values(args: argparse.Namespace) -> dict:
    """The values given to the methods' own flags (`_add_method_flags`): MergeConfig hands them to the chosen
    method's parameter model, which refuses those it does not declare."""
    return {k[len(PREFIX):]: v for k, v in vars(args).items()
            if k.startswith(PREFIX) and k[len(PREFIX):] not in MergeConfig.model_fields}


def _add_method_flags(p: argparse.ArgumentParser) -> None:
    """One flag per parameter a method declares beyond MergeConfig's (a plugin's own, e.g. --temperature), in one
    group per method; a name two methods declare is one flag, validated by the chosen method's model."""
    added: set[str] = set()
    for spec in registered_methods():
        own = {n: f for n, f in own_parameters(spec, MergeConfig.model_fields).items() if n not in added}
        if not own:
            continue
        group = p.add_argument_group(f"method {spec.name}: its own parameters")
        for name, info in own.items():
            add_flag(group, name, info)
            added.add(name)


def run(args: argparse.Namespace) -> int:
    from featcal import jobs
    from featcal.io.write.report import Timer

    timer = Timer()
    # --weight NAME=W etc. included: MergeConfig's per-expert fields; a method's own flags go to its own model
    config = config_from_args(args, MergeConfig, **_method_values(args))
    options = run_options_from_args(args)
    experts = parse_pairs(args.expert, "--expert")
    calibration = parse_pairs(args.calib, "--calib") or None
    done = jobs.merge(jobs.MergeRequest(
        args.base, experts, config, out=args.out, options=options, outputs=output_options_from_args(args),
        calibration=calibration, progress=not args.no_progress,
    ))
    print(
        f"merged {len(experts)} experts with {config.method} ({len(done.state)} tensors) into {Path(args.out)} "
        f"in {timer.seconds:.1f} s"
    )
    return 0


def register(subparsers) -> None:
    load_plugins()  # installed merge-method plugins: their names in --method, their parameters as flags
    p = subparsers.add_parser(
        "merge", help=HELP["merge"],
        description="Merge experts fine-tuned from one base into a single checkpoint, reading the experts "
        "tensor by tensor (RegMean, RegMean++ and WUDI load whole models; RegMean reads --calib data). "
        "The output is an ordinary Hugging Face checkpoint plus featcal.json.",
    )
    add_base_flag(p, required=True)
    add_expert_flag(p, required=True)
    p.add_argument("--out", required=True, help="output directory for the merged checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--calib", action="append", metavar="NAME=DATA",
                   help="regmean, regmean++: a task's calibration data, as for featcal calibrate (an image folder, "
                   "text, chat / SFT JSONL, CSV, parquet, a saved or hub dataset: docs/data.md; repeat per expert); "
                   "data-free methods refuse it")
    add_run_flags(p)
    add_output_flags(p, only=None)
    add_config_flags(p, MergeConfig, choices={"method": method_names()},
                     titles={"DataOptions": "calibration data of regmean, regmean++ (docs/data.md)"})
    _add_method_flags(p)
    p.set_defaults(func=run)
