"""`featcal eval`: score models on tasks, one table models × tasks (eval.json, table.md, eval.png)."""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.cli.commands import HELP
from featcal.cli.flags import add_flags, given_values, parse_pairs
from featcal.evaluation.options import EvalOptions


def run(args: argparse.Namespace) -> int:
    from featcal.evaluation.api import EVAL_JSON, evaluate
    from featcal.evaluation.report import eval_table

    report = evaluate(
        parse_pairs(args.task, "--task"), parse_pairs(args.model, "--model"),
        base=args.base, merged=args.merged, calibrated=args.calibrated, experts=parse_pairs(args.expert, "--expert"),
        out=args.out, overwrite=args.overwrite, lm_eval=args.lm_eval, progress=not args.no_progress,
        **given_values(args, EvalOptions, ""),
    )
    if report["results"]:
        print(eval_table(report), end="")
    lm = report.get("lm_eval") or {}
    if lm and not lm.get("ran"):
        print(f"lm-evaluation-harness is not installed (pip install 'featcal[lm-eval]'); to score the models on "
              f"{','.join(lm['tasks'])}, run:")
        for command in lm["commands"].values():
            print(f"  {command}")
    print(f"wrote {Path(args.out) / EVAL_JSON}")  # eval/ or eval: one path, eval/eval.json
    if lm.get("failed"):
        print(f"featcal: error: lm-eval failed on {', '.join(lm['failed'])} (see eval.json)")
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help=HELP["eval"],
        description="Score any number of models on any number of tasks: causal LMs on held-out text or chat "
        "(token loss, perplexity, next-token accuracy), classifiers on a label column (accuracy, macro-F1), CLIP "
        "zero-shot from class names, text-to-text models on targets (exact match). With --merged, --expert and "
        "--calibrated, the share of the merge -> experts gap closed. Writes eval.json, table.md and eval.png.",
    )
    p.add_argument("--task", action="append", metavar="NAME=DATA",
                   help="a task's evaluation data (repeat per task): any source calibration reads (a text file or "
                   "folder, .jsonl / .json / .csv / .tsv / .parquet, a saved dataset, a hub dataset id, an image folder "
                   "whose class sub-folders are labels; docs/data.md)")
    p.add_argument("--model", action="append", metavar="NAME=PATH", help="a model to score, by name (repeat)")
    p.add_argument("--base", help="the pretrained base the experts were fine-tuned from (a role of the table)")
    p.add_argument("--merged", help="the merged model (the gap's start)")
    p.add_argument("--calibrated", help="the calibrated model (FeatCal's output)")
    p.add_argument("--expert", "--experts", action="append", metavar="TASK=PATH",
                   help="a task's expert, scored on that task only (repeat per task; the gap's end)")
    p.add_argument("--out", required=True, help="output directory: eval.json, table.md, eval.png")
    p.add_argument("--overwrite", action="store_true", help="replace an output directory featcal eval wrote")
    p.add_argument("--lm-eval", metavar="TASKS",
                   help="also score every model with lm-evaluation-harness on these comma-separated tasks "
                   "(run when installed, else its command is printed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_flags(p, EvalOptions, prefix="")
    p.set_defaults(func=run)
