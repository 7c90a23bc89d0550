"""The arguments `featcal calibrate` and `featcal plan` share, and the flag <-> schema plumbing of merge, calibrate
and plan.

Every option flag is generated from its schema (cli/flags.py): FeatCalConfig's and MergeConfig's, grouped by
concern, and the run options (--overwrite, --allow-pickle, --max-length, --allow-fewer, --expert-kind) and output
options (--dtype, --tokenizer-source) every command shares; only what a command works on (--base, --expert, ...)
is written here. Imported by calibrate_cmd, plan_cmd and merge_cmd (none of which imports another's arguments).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel

from featcal.cli.flags import PREFIX, add_flags, options_from_args, parse_pairs
from featcal.config import FeatCalConfig, OutputOptions, RunOptions, check_tune_options
from featcal.errors import ConfigError

__all__ = ["add_arguments", "add_config_flags", "add_output_flags", "add_run_flags", "apply_threads",
           "config_from_args", "output_options_from_args", "parse_pairs", "run_options_from_args"]


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str | None = None,
                     choices: Mapping[str, Sequence[str]] | None = None,
                     titles: Mapping[str, str] | None = None) -> None:
    """One --flag per field of `model`, one argument group per concern it is made of (`title`: its own fields'
    group; `titles`: concern class name -> its group's title); unset flags keep the schema default. `choices`:
    field -> the values its flag accepts."""
    add_flags(parser, model, titles={**(titles or {}), **({model.__name__: title} if title else {})},
              choices=choices)


def config_from_args(args: argparse.Namespace, model: type[BaseModel], **extra):
    """The validated config built from the flags that were given, plus `extra` fields (ConfigError on a bad
    value)."""
    config = options_from_args(args, model, PREFIX, **extra)
    return check_tune_options(config) if isinstance(config, FeatCalConfig) else config


def add_run_flags(p: argparse.ArgumentParser, only: Iterable[str] | None = None) -> None:
    """--overwrite, --allow-pickle, --max-length, --allow-fewer, --expert-kind NAME=KIND (RunOptions)."""
    add_flags(p, RunOptions, prefix="", only=only)


def run_options_from_args(args: argparse.Namespace) -> RunOptions:
    """The validated RunOptions of the run flags given (as a run file's top-level keys and featcal.merge's keywords
    are validated)."""
    return options_from_args(args, RunOptions, "")


def add_output_flags(p: argparse.ArgumentParser, only: Iterable[str] | None = ("dtype",)) -> None:
    """--dtype (merge and calibrate: the written weights' floating dtype), --tokenizer-source (merge)."""
    add_flags(p, OutputOptions, prefix="", only=only)


def output_options_from_args(args: argparse.Namespace) -> OutputOptions:
    return options_from_args(args, OutputOptions, "")


def apply_threads(threads: int) -> None:
    """--threads N (bench, zoo build): torch's CPU threads; 0 keeps torch's default. A negative count is refused
    here, in one line (torch would raise deep inside, or run single-threaded)."""
    if threads < 0:
        raise ConfigError(f"--threads must be 0 (torch's default) or a positive number of threads, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


def add_base_flag(p: argparse.ArgumentParser, required: bool) -> None:
    """--base as merge, calibrate and plan read it."""
    p.add_argument("--base", required=required,
                   help="pretrained base checkpoint (directory, hub id, or a .gguf file / folder holding one)")


def add_expert_flag(p: argparse.ArgumentParser, required: bool) -> None:
    """--expert as merge, calibrate and plan read it: every kind of expert the front door opens."""
    p.add_argument("--expert", action="append", metavar="NAME=PATH", required=required,
                   help="a task's fine-tuned expert (repeat per task): a checkpoint, a .gguf file, or a LoRA/PEFT "
                   "adapter folder (applied to the base)")


def add_arguments(p: argparse.ArgumentParser, inputs_required: bool = True) -> None:
    """The calibrate arguments, shared with `featcal plan` (which can plan from a config alone: its
    `inputs_required` False leaves --base, --merged, --expert, --calib and --out for it to check)."""
    required = inputs_required
    add_base_flag(p, required)
    p.add_argument("--merged", required=required, help="merged checkpoint to calibrate")
    add_expert_flag(p, required)
    p.add_argument("--calib", action="append", metavar="NAME=DATA", required=required,
                   help="a task's calibration data (repeat per task): an image folder, a text file or folder, chat / "
                   "SFT .jsonl, .csv / .tsv, .parquet, a saved dataset, or a hub dataset id NAME[:CONFIG][@SPLIT] "
                   "(docs/data.md)")
    p.add_argument("--out", required=required, help="output directory for the calibrated checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--tune-head", action="append", metavar="NAME=PATH",
                   help="with --tune: a task's classification head saved by featcal (safetensors), read on the "
                   "pooled output (--tune-head-pooling); candidates are then scored first by agreement with the "
                   "expert's predictions (repeat per task)")
    p.add_argument("--max-memory", metavar="SIZE", default=None,
                   help="refuse to start when the estimated peak memory per process exceeds SIZE (e.g. 16GiB)")
    add_run_flags(p)
    add_config_flags(p, FeatCalConfig)
