"""`featcal.merge`: validate the inputs, stream the merge, optionally write a checkpoint + featcal.json.

Order matters for big models: the configuration, the expert names, the output directory and the
whole family (configs, names, shapes, dtypes, finite values) are checked before any merging, the
merged tensors are checked for NaN/Inf before anything is written, and the output is written
through a temporary directory that only replaces `out` once complete.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from featcal.config import MergeConfig, parse, run_options
from featcal.errors import ConfigError
from featcal.io.atomic import (
    atomic_output_dir,
    check_output_dir,
    check_replaceable,
    refuse_output_over_inputs,
)
from featcal.io.checkpoint import CheckpointReader, copy_side_files
from featcal.io.inputs import open_source
from featcal.io.layouts import RenamedSource, harmonise
from featcal.io.report import Timer, build_report, checkpoint_hashes, peak_rss_mb, write_report
from featcal.io.sources import MergeInput, ModuleSource
from featcal.io.validate import check_finite_state, validate_expert_names, validate_family
from featcal.io.vocab import VocabPlan, grown_vocabulary
from featcal.merging.calibration_data import (
    CalibrationInput,
    check_calibration_data,
    check_calibration_request,
    load_calibration,
)
from featcal.merging.family import Family
from featcal.merging.registry import check_method, make_merger
from featcal.merging.streaming import merge_family
from featcal.merging.writer import save_state_dict

log = logging.getLogger(__name__)
DEFAULT_METHOD = "task_arithmetic"


def resolve_config(method: str, config: MergeConfig | None, params: Mapping[str, Any]) -> MergeConfig:
    """One validated MergeConfig from `method`, an optional `config` and keyword overrides.

    `config` is the starting point; keyword parameters override its fields; `method` overrides its
    method unless left at the default. A method contradicting `config.method` is an error.
    """
    check_method(method)
    if config is None:
        return parse(MergeConfig, {"method": method, **params})
    if not isinstance(config, MergeConfig):
        raise ConfigError(f"config must be a MergeConfig, got {type(config).__name__}")
    check_method(config.method)
    if method != DEFAULT_METHOD and method != config.method:
        raise ConfigError(f"method={method!r} contradicts config.method={config.method!r}; give one of them")
    return parse(MergeConfig, {**config.model_dump(), **params})


def check_expert_options(config: MergeConfig, experts: Iterable[str]) -> None:
    """Per-expert weights, densities and drop rates must name experts of this merge (a typo would otherwise
    merge at the default silently)."""
    names = list(experts)
    for field in ("weights", "densities", "drop_rates"):
        unknown = [n for n in getattr(config, field) if n not in names]
        if unknown:
            raise ConfigError(f"{field} names {', '.join(map(repr, unknown))}, not an expert of this merge "
                              f"(experts: {', '.join(names)})")


def _describe(source) -> dict[str, Any]:
    if hasattr(source, "describe"):  # a LoRA adapter applied to the base (io/lora.py), a dequantised GGUF
        return source.describe()
    if isinstance(source, RenamedSource):  # read under other names (layouts.py): say which
        return {**_describe(source.source), "read_as": source.view}
    if isinstance(source, CheckpointReader):
        return {"path": str(source.path), "sha256": checkpoint_hashes(source.path)}
    return {"path": str(source.path), "in_memory": True}


def _write_output(
    out: Path, overwrite: bool, merged: dict[str, Tensor], merger, family: Family, *, seconds: dict[str, float],
    total: Timer, vocab: VocabPlan | None = None,
) -> None:
    """The checkpoint directory: the base's side files, the weights, then featcal.json, atomically."""
    save = Timer()
    with atomic_output_dir(out, overwrite) as tmp:
        if isinstance(family.base, ModuleSource):
            family.base.save_config(tmp)
        else:
            copy_side_files(family.base.path, tmp)
            if isinstance(family.base, RenamedSource):
                family.base.write_config(tmp)  # a CLIPModel base's vision tower: a CLIPVisionModel config
        files = save_state_dict(merged, tmp)
        if vocab is not None:  # config vocab_size and tokenizer of the grown rows (merging/vocab.py)
            vocab.write(tmp)
        copied = [n for n in family.names if not family.is_floating(n)]
        report = build_report(
            "merge",
            merger.params(),
            inputs={"base": _describe(family.base), "experts": {n: _describe(s) for n, s in family.experts.items()},
                    **merger.report_inputs()},
            output={"path": str(out), "files": files, "sha256": checkpoint_hashes(tmp)},
            tensors={"total": len(family.names), "merged": len(family.names) - len(copied), "copied_from_base": copied},
        )
        report["seconds"] = {
            **{k: round(v, 3) for k, v in seconds.items()}, "save": round(save.seconds, 3), "total": round(total.seconds, 3),
        }
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)
        if vocab is not None:
            report["vocabulary"] = vocab.report()
        write_report(tmp, report)
    log.info("merged checkpoint written to %s", out)


def merge(
    base: MergeInput,
    experts: Mapping[str, MergeInput],
    method: str = DEFAULT_METHOD,
    *,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    config: MergeConfig | None = None,
    progress: bool = True,
    calibration: Mapping[str, CalibrationInput] | None = None,
    max_length: int = 128,
    allow_fewer: bool = False,
    **params: Any,
) -> dict[str, Tensor]:
    """Merge `experts` (name -> checkpoint dir, hub id or nn.Module) into `base` with `method`.

    Returns the merged state dict, keyed like the base checkpoint, in the base's dtypes. With `out`,
    also writes an ordinary HF checkpoint there (model.safetensors, the base's config and
    tokenizer/processor files, featcal.json), atomically; an existing non-empty `out` is refused
    unless `overwrite` (`overwrite`, `allow_pickle`, `max_length`, `allow_fewer` are validated by RunOptions, as
    the CLI flags and a run file's keys are). Hyperparameters (`scaling`, `density`, `drop_rate`, `seed`, `alpha`, `steps`,
    `lr`, `num_calibration_examples`, `calibration_batch_size`) come as keywords or in `config`; they
    are validated by MergeConfig, and unknown ones are refused.

    `calibration` (regmean, regmean++ only; data-free methods refuse it): task -> a data source path,
    read like `featcal calibrate` reads it (`num_calibration_examples` drawn with `seed`, in batches of
    `calibration_batch_size`, texts truncated to `max_length` tokens, `allow_fewer`), or in-memory
    batches (a tensor or a dict of model inputs, or a list of those), one entry per expert.
    """
    total = Timer()
    cfg = resolve_config(method, config, params)
    run_options(overwrite=overwrite, allow_pickle=allow_pickle, max_length=max_length, allow_fewer=allow_fewer)
    if not isinstance(experts, Mapping):
        raise ConfigError(f"experts must be a mapping of task name -> checkpoint, got {type(experts).__name__}")
    validate_expert_names(experts.keys())
    check_expert_options(cfg, experts.keys())
    check_calibration_request(cfg.method, experts, calibration)
    if out is not None:
        check_output_dir(out, overwrite)
        refuse_output_over_inputs(out, {"base": base, **{f"expert {n!r}": e for n, e in experts.items()},
                                        **{f"calibration data {t!r}": c for t, c in (calibration or {}).items()}})
        check_replaceable(out, overwrite)

    base_src = open_source(base, label="base", allow_pickle=allow_pickle)
    expert_srcs = {n: open_source(e, label=f"expert {n!r}", allow_pickle=allow_pickle, base=base_src)
                   for n, e in experts.items()}  # base=: a LoRA adapter folder is applied to the base
    viewed = harmonise({"base": base_src, **{f"expert {n!r}": s for n, s in expert_srcs.items()}}, "base")
    base_src, expert_srcs = viewed["base"], {n: viewed[f"expert {n!r}"] for n in expert_srcs}  # one naming
    expert_srcs, vocab = grown_vocabulary(base_src, expert_srcs)  # more rows than the base: base rows merged
    if out is not None and isinstance(base_src, ModuleSource):
        base_src.check_can_save()
    model_dir = None if isinstance(base_src, ModuleSource) else Path(base_src.path)
    if calibration:
        check_calibration_data(calibration, model_dir=model_dir, config=cfg, max_length=max_length,
                               allow_fewer=allow_fewer)
    validate_family(base_src, expert_srcs, progress=progress)
    validate_seconds = total.seconds

    loaded, data_timer = None, Timer()
    if calibration:
        loaded = load_calibration(calibration, model_dir=model_dir, config=cfg, max_length=max_length,
                                  allow_fewer=allow_fewer, progress=progress)
    data_seconds = {"load_data": data_timer.seconds} if loaded is not None else {}
    merger = make_merger(cfg, calibration=loaded, allow_pickle=allow_pickle)
    family = Family(base_src, expert_srcs)
    work = Timer()
    merged = merge_family(merger, family, progress=progress)
    if vocab is not None:
        merged = vocab.grow(merged)  # the extra vocabulary rows: the mean of the experts that have them
    check_finite_state(f"the {cfg.method} merge", merged)  # finite inputs can still overflow the base dtype
    merge_seconds = work.seconds
    log.info("merged %d experts with %s in %.2f s", len(expert_srcs), cfg.method, merge_seconds)

    if out is not None:
        _write_output(Path(out), overwrite, merged, merger, family,
                      seconds={"validate": validate_seconds, **data_seconds, "merge": merge_seconds}, total=total,
                      vocab=vocab)
    return merged
