"""`featcal bench`: the main offline demonstration (experts, base, merges alone and + FeatCal)."""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.config import MERGE_METHODS
from featcal.errors import ConfigError
from featcal.experiments.zoo.presets import PRESETS, get_preset


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--calib-sizes must be comma-separated integers, not {text!r}") from None
    return tuple(dict.fromkeys(sizes))


def _variants(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _baseline_params(args: argparse.Namespace, baselines: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Step overrides for the baselines that train (defaults: the authors' 500 / 300 steps)."""
    out: dict[str, dict[str, int]] = {}
    wudi = args.wudi_steps if args.wudi_steps is not None else getattr(get_preset(args.preset), "wudi_steps", None)
    for name, steps in (("surgery", args.surgery_steps), ("probsurgery", args.surgery_steps), ("wudi", wudi)):
        if steps is not None and name in baselines:
            out[name] = {"steps": steps}
    return out


def _run(args: argparse.Namespace) -> int:
    from featcal.cli.calibrate_args import apply_threads
    from featcal.experiments.bench.baselines import parse_baselines
    from featcal.experiments.bench.metrics import cost_ratio_text
    from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
    from featcal.experiments.bench.table import bench_table, variant_tag
    from featcal.io.atomic import check_output_dir, check_replaceable

    apply_threads(args.threads)
    sizes = _sizes(args.calib_sizes) if args.calib_sizes else (min(256, get_preset(args.preset).calibration),)
    settings = BenchSettings(
        preset=args.preset, seed=args.seed, calib_sizes=sizes,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods is not None else None,
        sources=Path(args.sources) if args.sources else None,
        wudi_steps=args.wudi_steps,
        zoo_dir=Path(args.zoo_dir) if args.zoo_dir else None,
        base_cache=Path(args.base_cache) if args.base_cache else None,
        rebuild_zoo=args.rebuild_zoo,
        baselines=(baselines := parse_baselines(args.baselines)),
        baseline_params=_baseline_params(args, baselines),
        surgery_features=args.surgery_features,
        featcal_variants=_variants(args.featcal_variants),
    )
    validate(settings)
    check_output_dir(args.out, args.overwrite)  # before any work
    check_replaceable(args.out, args.overwrite, marker="bench.json")  # a report featcal wrote, not any folder
    report = run_bench(settings, progress=not args.no_progress)
    out = write_bench(report, args.out, args.overwrite)
    print(bench_table(report), end="")
    for m in settings.resolved_methods():
        s = report["summary"][m]
        for n in settings.calib_sizes:
            for variant, v in s["variants"].items():
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
    print(f"wrote {out / 'bench.json'}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark merges alone and + FeatCal on the offline zoo")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory: bench.json, table.md, drift.png")
    p.add_argument("--calib-sizes", default=None,
                   help="calibration examples per task, comma-separated for a sweep (default: 256, or the preset's pool)")
    p.add_argument("--methods", default=None,
                   help=f"merge methods, each alone and + FeatCal, comma-separated, from {', '.join(MERGE_METHODS)} "
                        "(default: the preset's; vision presets average,task_arithmetic,ties; text all but DARE)")
    p.add_argument("--featcal-variants", default="reference",
                   help="FeatCal variants, each a calibrated row per merge and size, comma-separated, from reference "
                        "(the paper's method), joint_bias (bias_solve joint), final_norm (calibrate_final_norm), "
                        "stem_norm (calibrate_stem_norm), sequential (block_statistics sequential), sequential_one_pass "
                        "(the same solution, one forward per batch and side), tuned (--tune with its defaults, scored "
                        "through the zoo's "
                        "heads), tuned_soft (--tune --tune-tiebreak soft), tuned_auto (--tune --tune-tiebreak auto), fixed_lambda "
                        "(with a tuned one: --tune-fixed lambda_ratio), cross_fit (with a tuned one: --tune-folds 2), one_split (with a tuned one: --tune-folds 1) "
                        "; join several with '+' (tuned+sequential_one_pass) (default: reference; docs/variants.md)")
    p.add_argument("--baselines", default="",
                   help="comparison baselines, comma-separated, from surgery, probsurgery, regmean, regmean++, wudi, "
                        "or 'all' (default: none)")
    p.add_argument("--surgery-steps", type=int, default=None,
                   help="Adam steps per task of surgery and probsurgery (default: the authors' 500)")
    p.add_argument("--surgery-features", choices=("recomputed", "cached"), default="recomputed",
                   help="surgery and probsurgery: run the frozen merged model and experts every step, the authors' "
                        "procedure and cost (recomputed, the default), or compute their features once: the same "
                        "trained modules to round-off in a fraction of the time, for accuracy figures (cached)")
    p.add_argument("--wudi-steps", type=int, default=None,
                   help="Adam steps per Linear of WUDI, as a benched merge, in the regime line and as a baseline "
                        "(default: the preset's; 300, the authors', for the vision presets, 100 for text)")
    p.add_argument("--sources", default=None,
                   help="text presets: folder of the downloaded data archives (default $FEATCAL_TEXT_SOURCES or "
                        "zoo-cache/sources; `featcal zoo fetch-text` fills it)")
    p.add_argument("--zoo-dir", default=None, help="zoo cache directory (default zoo-cache/<preset>-seed<seed>)")
    p.add_argument("--base-cache", default="zoo-cache/pretrained",
                   help="cache of pretrained bases used when the zoo is built ('' to disable)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--rebuild-zoo", action="store_true",
                   help="rebuild the zoo cache if it was built from another preset, seed or zoo version "
                        "(a matching cache is always reused)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)
