"""The `featcal` sub-commands and their one-line help, in the order `featcal --help` lists them.

Why a table apart from the command modules: `featcal --version`, `featcal --help` and an argparse error before
the command name answer from it alone, without importing any command module (each brings its own dependencies:
pydantic's schemas, transformers, torch: seconds of start-up). Each module's `register` takes its help from here,
so the line is written once. Each command lives in featcal/cli/NAME_cmd.py (`register(subparsers)`).
"""

from __future__ import annotations

HELP: dict[str, str] = {
    "merge": "merge fine-tuned experts into their base (Task Arithmetic, TIES, DARE, RegMean, WUDI, ...)",
    "calibrate": "calibrate a merged model toward its experts (FeatCal)",
    "run": "merge (and optionally calibrate) as described by a YAML run file",
    "eval": "score models on tasks (did calibration help?): one table models x tasks",
    "zoo": "the offline model zoo (base, experts, heads, data)",
    "bench": "benchmark merges alone and + FeatCal on the offline zoo",
    "reproduce": "run one of the paper's settings (merge, FeatCal, evaluation) from hub ids or local copies",
    "plan": "estimate the peak memory and time of a calibration (same arguments as calibrate, or --config and "
            "--tasks)",
    "supported": "which models featcal can calibrate (checked from their configs, no weights read)",
}
COMMANDS = tuple(HELP)
