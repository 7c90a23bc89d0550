"""`featcal reproduce SETTING --out DIR`: one of the paper's settings, TA -> FeatCal -> evaluation."""

from __future__ import annotations

import argparse
from typing import Any

from featcal.cli.commands import HELP


def _settings_help() -> str:
    from featcal.experiments.reproduce.settings import SETTINGS

    return "settings:\n" + "\n".join(
        f"  {name:<26} {s.description}\n  {'':<26} tasks: {','.join(s.task_names)}" for name, s in SETTINGS.items()
    )


def register(subparsers: Any) -> None:
    from featcal.experiments.reproduce.settings import SETTINGS

    p = subparsers.add_parser(
        "reproduce",
        help=HELP["reproduce"],
        description="Task Arithmetic (s=0.3) -> FeatCal -> evaluation for one of the paper's settings.\n"
        "Writes DIR/metrics.json (beside the paper's numbers), DIR/metrics.txt and DIR/run_config.json;\n"
        "a rerun with the same parameters reuses the stages already in DIR. All model and dataset ids\n"
        "are resolved first: --model-dir, --data-dir, the HF cache (HF_HOME), then the hub unless\n"
        "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set.",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("setting", choices=sorted(SETTINGS), metavar="SETTING", help=", ".join(SETTINGS))
    p.add_argument("--out", required=True, metavar="DIR", help="run directory (created; reused to resume)")
    from featcal.cli.flags import add_flags
    from featcal.experiments.reproduce.options import ReproduceOptions

    add_flags(p, ReproduceOptions, prefix="", skip=("setting", "out"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from featcal.cli.flags import given_values
    from featcal.experiments.reproduce.options import ReproduceOptions
    from featcal.experiments.reproduce.runner import reproduce

    reproduce({"setting": args.setting, "out": args.out, **given_values(args, ReproduceOptions, "")})
    return 0
