"""`featcal reproduce SETTING --out DIR`: one of the paper's settings, TA -> FeatCal -> evaluation."""

from __future__ import annotations

import argparse
from typing import Any


def _settings_help() -> str:
    from featcal.experiments.reproduce.settings import SETTINGS

    return "settings:\n" + "\n".join(
        f"  {name:<26} {s.description}\n  {'':<26} tasks: {','.join(s.task_names)}" for name, s in SETTINGS.items()
    )


def _tasks(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(subparsers: Any) -> None:
    from featcal.experiments.reproduce.settings import SETTINGS

    p = subparsers.add_parser(
        "reproduce",
        help="run one of the paper's settings (merge, FeatCal, evaluation) from hub ids or local copies",
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
    p.add_argument("--tasks", type=_tasks, default=None, metavar="T1,T2", help="only these tasks of the setting")
    p.add_argument("--num-calibration-examples", type=int, default=256, metavar="N", help="per task (default 256)")
    p.add_argument("--calibration-batch-size", type=int, default=16, metavar="B", help="(default 16)")
    p.add_argument("--seed", type=int, default=42, help="draws calibration examples and any eval subset (default 42)")
    p.add_argument("--max-eval-samples", type=int, default=None, metavar="N",
                   help="evaluate each task on a seeded subset of N examples (default: the whole split)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--batch-size", type=int, default=64, metavar="B", help="evaluation batch size (default 64)")
    p.add_argument("--scaling", type=float, default=None, help="Task Arithmetic s (default: the setting's, 0.3)")
    p.add_argument("--max-length", type=int, default=512, help="token limit of text inputs (default 512)")
    p.add_argument("--model-dir", default=None, metavar="D",
                   help="local models: one folder per hub id, e.g. D/openai/clip-vit-base-patch32/")
    p.add_argument("--data-dir", default=None, metavar="D",
                   help="local datasets saved with save_to_disk, one folder per id, e.g. D/tanganke/eurosat/ "
                   "(a config in a subfolder: D/nyu-mll/glue/cola/)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from featcal.experiments.reproduce.runner import reproduce

    reproduce({
        "setting": args.setting, "out": args.out, "tasks": args.tasks,
        "num_calibration_examples": args.num_calibration_examples,
        "calibration_batch_size": args.calibration_batch_size, "seed": args.seed,
        "max_eval_samples": args.max_eval_samples, "device": args.device, "batch_size": args.batch_size,
        "scaling": args.scaling, "max_length": args.max_length,
        "model_dir": args.model_dir, "data_dir": args.data_dir,
    })
    return 0
