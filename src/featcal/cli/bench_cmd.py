"""`featcal bench`: the main offline demonstration (experts, base, merges alone and + FeatCal)."""

from __future__ import annotations

import argparse

from featcal.cli.commands import HELP
from featcal.experiments.zoo.presets import PRESETS, get_preset


def _baseline_params(opts, baselines: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Step overrides for the baselines that train (defaults: the authors' 500 / 300 steps)."""
    out: dict[str, dict[str, int]] = {}
    wudi = opts.wudi_steps if opts.wudi_steps is not None else getattr(get_preset(opts.preset), "wudi_steps", None)
    for name, steps in (("surgery", opts.surgery_steps), ("probsurgery", opts.surgery_steps), ("wudi", wudi)):
        if steps is not None and name in baselines:
            out[name] = {"steps": steps}
    return out


def _run(args: argparse.Namespace) -> int:
    from featcal.cli.calibrate_args import apply_threads
    from featcal.cli.flags import options_from_args
    from featcal.experiments.bench.baselines import parse_baselines
    from featcal.experiments.bench.metrics import cost_ratio_text
    from featcal.experiments.bench.options import BenchOptions
    from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
    from featcal.experiments.bench.table import bench_table, variant_tag
    from featcal.io.write.atomic import check_output_dir, check_replaceable

    opts = options_from_args(args, BenchOptions, "")
    apply_threads(opts.threads)
    settings = BenchSettings(
        preset=opts.preset, seed=opts.seed, calib_sizes=opts.sizes(get_preset(opts.preset).calibration),
        methods=opts.method_list(), sources=opts.path(opts.sources), wudi_steps=opts.wudi_steps,
        zoo_dir=opts.path(opts.zoo_dir), base_cache=opts.path(opts.base_cache), rebuild_zoo=opts.rebuild_zoo,
        baselines=(baselines := parse_baselines(opts.baselines)),
        baseline_params=_baseline_params(opts, baselines),
        surgery_features=opts.surgery_features,
        featcal_variants=opts.variant_list(), rows=opts.rows,
    )
    validate(settings)
    check_output_dir(args.out, opts.overwrite)  # before any work
    check_replaceable(args.out, opts.overwrite, marker="bench.json")  # a report featcal wrote, not any folder
    report = run_bench(settings, progress=not args.no_progress)
    out = write_bench(report, args.out, opts.overwrite)
    print(bench_table(report), end="")
    for m in settings.resolved_methods():
        s = report["summary"][m]
        for n in settings.calib_sizes:
            for variant, v in s["variants"].items():
                if n not in v["gap_closed"]:  # a size or variant this merge was not calibrated at (--rows demo)
                    continue
                closed, tag = v["gap_closed"][n], variant_tag(variant)
                print(f"{m}: gap to experts closed by FeatCal{tag} ({n}/task): "
                      f"{'n/a' if closed is None else f'{100 * closed:.1f}%'}, cost {cost_ratio_text(v['cost_ratio'][n])} the "
                      f"forward floor (the exact method's arithmetic: {report['summary']['cost_ratio_arithmetic']:.2f}x)")
    for r in report["rows"]:
        if r.get("baseline") and r.get("merge"):
            closed = r["gap_closed"]
            how = ("authors' procedure, features recomputed every step" if r["params"].get("recompute_features")
                   else "features cached: not the authors' cost")
            print(f"{r['merge']} + {r['method']}: gap closed {'n/a' if closed is None else f'{100 * closed:.1f}%'} "
                  f"in {r['seconds']:.1f}s ({how})")
    print(report["regime"]["line"])
    figures = [out / f for f in ("drift.png", "calib_sizes.png") if (out / f).is_file()]
    print(f"wrote {out / 'bench.json'}, {out / 'table.md'}" + "".join(f", {f}" for f in figures))
    return 0


def register(subparsers) -> None:
    from featcal.cli.flags import add_flags
    from featcal.experiments.bench.options import BenchOptions

    p = subparsers.add_parser("bench", help=HELP["bench"])
    p.add_argument("--out", required=True, help="output directory: bench.json, table.md, drift.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_flags(p, BenchOptions, prefix="", choices={"preset": sorted(PRESETS)})
    p.set_defaults(func=_run)
