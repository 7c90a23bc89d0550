"""The arguments `featcal calibrate` and `featcal plan` share, and the flag <-> schema plumbing of every command.

Flags of a pydantic schema (FeatCalConfig, MergeConfig) are generated from its fields, so the schema
stays the one place where an option, its default, its help and its valid range are defined; values
are validated by the same schema as the Python API and YAML run files. Imported by calibrate_cmd,
plan_cmd and merge_cmd (none of which imports another's arguments).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from featcal.config import FeatCalConfig, OutputDtype, RunOptions, check_tune_options, parse, run_options
from featcal.errors import ConfigError

_PREFIX = "cfg_"


def _flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keywords for one pydantic field annotation (bool, int, float, str, Path, Literal, X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _flag_kwargs(members[0])
        return {"type": str}
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return {"choices": choices, "type": type(choices[0])}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation, "metavar": annotation.__name__.upper()}
    if annotation is Path:
        return {"type": str, "metavar": "DIR"}
    return {"type": str}


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str | None = None,
                     choices: Mapping[str, Sequence[str]] | None = None) -> None:
    """One --flag per field of `model` (bools get --x / --no-x); unset flags keep the schema default. `choices`:
    field -> the values its flag accepts, known when the parser is built (MergeConfig.method: the registry's).
    Mapping fields (MergeConfig.method_options) have no flag."""
    group = parser.add_argument_group(title or f"{model.__name__} options")
    for name, field in model.model_fields.items():
        if typing.get_origin(field.annotation) is dict:
            continue
        default = field.default
        help_text = (field.description or name.replace("_", " ")) + f" (default: {default})"
        kwargs = _flag_kwargs(field.annotation)
        if choices and name in choices:
            kwargs = {"type": str, "choices": list(choices[name])}
        group.add_argument(
            "--" + name.replace("_", "-"), dest=_PREFIX + name, default=argparse.SUPPRESS, help=help_text, **kwargs,
        )


def config_from_args(args: argparse.Namespace, model: type[BaseModel], **extra: Any):
    """The validated config built from the flags that were given, plus `extra` fields (ConfigError on a bad
    value)."""
    given = {k[len(_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_PREFIX)}
    config = parse(model, {**given, **extra})
    return check_tune_options(config) if isinstance(config, FeatCalConfig) else config


def run_options_from_args(args: argparse.Namespace) -> RunOptions:
    """The validated RunOptions of --overwrite, --allow-pickle, --max-length, --allow-fewer, --expert-kind (as a run file's
    top-level keys and featcal.merge's keywords are validated)."""
    given = {k: getattr(args, k) for k in RunOptions.model_fields if hasattr(args, k)}
    if "expert_kind" in given:  # --expert-kind NAME=KIND, repeated
        given["expert_kind"] = parse_pairs(given["expert_kind"], "--expert-kind")
    return run_options(**given)


def add_expert_kind(p: argparse.ArgumentParser) -> None:
    """--expert-kind NAME=full|adapter (merge, calibrate, plan): how to read a folder holding both."""
    p.add_argument("--expert-kind", action="append", metavar="NAME=KIND", dest="expert_kind",
                   help="full or adapter: how to read an expert folder that holds both full weights and a LoRA/PEFT "
                   "adapter (refused without it; repeat per task)")


def apply_threads(threads: int) -> None:
    """--threads N (bench, zoo build): torch's CPU threads; 0 keeps torch's default. A negative count is refused
    here, in one line (torch would raise deep inside, or run single-threaded)."""
    if threads < 0:
        raise ConfigError(f"--threads must be 0 (torch's default) or a positive number of threads, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


def parse_pairs(pairs: list[str] | None, flag: str) -> dict[str, str]:
    """NAME=VALUE pairs into an ordered dict, refusing malformed and repeated names."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(f"{flag} expects NAME=VALUE, got {pair!r}")
        name = name.strip()
        if name in out:
            raise ConfigError(f"{flag} {name!r} is given twice")
        out[name] = value.strip()
    return out


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """--dtype: the written weights' floating dtype (featcal merge and calibrate)."""
    p.add_argument("--dtype", default=None, choices=typing.get_args(OutputDtype),
                   help="floating dtype of the written weights (computed in float32 either way; default: the base's "
                   "for a merge, the merged checkpoint's for a calibration)")


def add_arguments(p: argparse.ArgumentParser, inputs_required: bool = True) -> None:
    """The calibrate arguments, shared with `featcal plan` (which can plan from a config alone: its
    `inputs_required` False leaves --base, --merged, --expert, --calib and --out for it to check)."""
    required = inputs_required
    p.add_argument("--base", required=required,
                   help="pretrained base checkpoint (directory, hub id, or a .gguf file / folder holding one)")
    p.add_argument("--merged", required=required, help="merged checkpoint to calibrate")
    p.add_argument("--expert", action="append", metavar="NAME=PATH", required=required,
                   help="a task's fine-tuned expert (repeat per task): a checkpoint, a .gguf file, or a LoRA/PEFT "
                   "adapter folder (applied to the base)")
    add_expert_kind(p)
    p.add_argument("--calib", action="append", metavar="NAME=DATA", required=required,
                   help="a task's calibration data (repeat per task): an image folder, a text file or folder, chat / "
                   "SFT .jsonl, .csv / .tsv, .parquet, a saved dataset, or a hub dataset id NAME[:CONFIG][@SPLIT] "
                   "(docs/data.md)")
    p.add_argument("--out", required=required, help="output directory for the calibrated checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickled (*.bin) checkpoints")
    p.add_argument("--max-length", type=int, default=128, metavar="INT", help="truncate texts to this many tokens")
    p.add_argument("--allow-fewer", action="store_true",
                   help="use all examples of a task holding fewer than --num-calibration-examples (with a warning)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--tune-head", action="append", metavar="NAME=PATH",
                   help="with --tune: a task's classification head saved by featcal (safetensors), read on the "
                   "pooled output (--tune-head-pooling); candidates are then scored first by agreement with the "
                   "expert's predictions (repeat per task)")
    p.add_argument("--max-memory", metavar="SIZE", default=None,
                   help="refuse to start when the estimated peak memory per process exceeds SIZE (e.g. 16GiB)")
    add_config_flags(p, FeatCalConfig, "FeatCal options")
