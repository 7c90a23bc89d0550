"""`featcal calibrate`: calibrate a merged checkpoint toward its experts, from the command line.

The FeatCal flags are generated from FeatCalConfig's fields, so the schema stays the one place
where an option, its default, its help and its valid range are defined; values are validated by
the same schema as the Python API and YAML run files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.cli.calibrate_args import (  # noqa: F401  (add_config_flags, parse_pairs: re-exported)
    add_arguments,
    add_config_flags,
    add_output_flags,
    config_from_args,
    output_options_from_args,
    parse_pairs,
    run_options_from_args,
)
from featcal.cli.commands import HELP
from featcal.config import FeatCalConfig


def drift_table(drift: list[dict] | None) -> str:
    """A short plain-text table of per-block feature drift before and after calibration."""
    if not drift:
        return "(no per-block drift recorded)"
    labels = [f"{r['stack']}.{r['layer']}" if "stack" in r and "layer" in r else str(r["block"]) for r in drift]
    width = max(5, *(len(label) for label in labels))
    lines = [f"{'block':>{width}}  {'drift before':>12}  {'drift after':>12}  {'change':>8}"]
    for label, row in zip(labels, drift, strict=True):
        before, after = float(row["before"]), float(row["after"])
        change = f"{100.0 * (after - before) / before:+.1f}%" if before else "n/a"
        lines.append(f"{label:>{width}}  {before:12.4g}  {after:12.4g}  {change:>8}")
    return "\n".join(lines)


def end_to_end_line(e2e: dict) -> str:
    """The merge's and the calibrated model's final-block drift: the per-block "before" column starts from
    calibrated inputs past block 0, so only this line compares the calibrated model with the merge itself."""
    worse = "  WORSE than the merge" if e2e["calibrated"] > e2e["merged"] else ""
    return (f"end-to-end drift (final {e2e['stack']} block, {e2e['tokens']}, first batch of each task): "
            f"merged {e2e['merged']:.4g} -> calibrated {e2e['calibrated']:.4g}{worse}")


def print_data_lines(report: dict) -> None:
    """Per task, the examples and tokens the calibration read and how (calibration/front/data_summary.py), from
    featcal.json's record of each task's data."""
    from featcal.calibration.front.data_summary import task_data_lines

    records = (report.get("inputs") or {}).get("calibration") or {}
    for line in task_data_lines(records, (report.get("params") or {}).get("max_length")):
        print(line)


def write_drift_figure(report: dict, out: str) -> Path:
    """drift.png beside the checkpoint (written atomically, after it): per block, the drift as merged and after."""
    from featcal.evaluation.drift_plot import PLOT_PNG, calibration_drift_png
    from featcal.io.write.atomic import atomic_write_bytes

    path = Path(out) / PLOT_PNG
    atomic_write_bytes(path, calibration_drift_png(report.get("drift") or [], f"featcal calibrate: {Path(out).name}"))
    return path


def run(args: argparse.Namespace) -> int:
    from featcal import jobs
    from featcal.calibration.maths.distributed import init_from_env

    if args.plot:  # before any work: the figure needs matplotlib
        from featcal.io.process.extras import require

        require("plot", "--plot")
    config = config_from_args(args, FeatCalConfig)
    options = run_options_from_args(args)
    outputs = output_options_from_args(args)
    if args.dry_run or args.max_memory is not None:
        from featcal.cli.plan_cmd import check_plan
        from featcal.io.write.card import check_hub_ids

        check_hub_ids(outputs.hub_id, parse_pairs(args.expert, "--expert"))  # the run refuses these: so does its plan

        if check_plan(args, config, show=args.dry_run):
            return 0  # --dry-run: the plan was the whole job
    init_from_env(config.device)  # under torchrun: one rank per process, batches shared out
    done = jobs.calibrate(jobs.CalibrateRequest(
        args.merged, args.base, parse_pairs(args.expert, "--expert"), parse_pairs(args.calib, "--calib"), args.out,
        config=config, options=options, outputs=outputs, heads=parse_pairs(args.tune_head, "--tune-head"),
        progress=not args.no_progress,
    ))
    if not done.main:
        return 0  # rank 0 wrote the checkpoint and prints the summary
    report = done.report
    print_data_lines(report)
    print(drift_table(report.get("drift")))
    if report.get("end_to_end_drift"):
        print(end_to_end_line(report["end_to_end_drift"]))
    if report.get("tuning"):
        from featcal.calibration.tuning import summary_line

        print(summary_line(report["tuning"]))
    if args.plot:
        print(f"drift figure: {write_drift_figure(report, args.out)}")
    s = report["seconds"]
    print(
        f"calibrated checkpoint: {Path(args.out)}  (load {s['load']:.1f} s, calibrate {s['calibrate']:.1f} s, "
        f"save {s['save']:.1f} s; peak RSS {report['peak_rss_mb']:.0f} MiB)"
    )
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help=HELP["calibrate"],
        description="Calibrate a merged checkpoint block by block toward its experts with closed-form "
        "ridge solves, using a small unlabeled calibration set per task. Any block-stacked transformers model "
        "whose structure featcal finds is supported (Llama, Mistral, Qwen, Gemma, Phi, GPT-2, BERT, T5, BART, "
        "CLIP, ViT, ...); `featcal supported [MODEL]` lists the verified families and checks any model from "
        "its config.",
    )
    add_arguments(p)
    add_output_flags(p, only=("dtype", "hub_id"))
    p.add_argument("--dry-run", action="store_true", help="print the memory plan (featcal plan) and stop")
    p.add_argument("--plot", action="store_true",
                   help="also write the per-block drift figure beside the checkpoint (drift.png; needs "
                   "matplotlib: pip install 'featcal[plot]')")
    p.set_defaults(func=run)
