"""`featcal.merge`: validate the inputs, stream the merge, optionally write a checkpoint + featcal.json.

Order matters for big models: the configuration, the expert names, the output directory and the
whole family (configs, names, shapes, dtypes, finite values) are checked before any merging, the
merged tensors are checked for NaN/Inf before anything is written, and the output is written
through a temporary directory that only replaces `out` once complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from featcal.config import (
    DEFAULT_MAX_LENGTH,
    MergeConfig,
    OutputOptions,
    RunOptions,
    check_expert_kinds,
    parse,
    run_options,
)
from featcal.errors import ConfigError
from featcal.io.read.checkpoint import CheckpointReader, copy_side_files
from featcal.io.read.family import open_family
from featcal.io.read.hashes import checkpoint_hashes
from featcal.io.read.layouts import RenamedSource
from featcal.io.read.lora import kind_record
from featcal.io.read.sources import MergeInput, ModuleSource
from featcal.io.read.validate import check_finite_state, validate_expert_names, validate_family
from featcal.io.read.vocab import VocabPlan
from featcal.io.write.atomic import (
    atomic_output_dir,
    check_output_dir,
    check_replaceable,
    refuse_output_over_inputs,
)
from featcal.io.write.card import check_hub_ids, replaced_files, write_card
from featcal.io.write.report import Timer, build_report, peak_rss_mb, write_report
from featcal.io.write.task_heads import HeadPlan, plan_heads
from featcal.io.write.tokenizer import TokenizerPlan, input_folder, plan_tokenizer
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
    return parse(MergeConfig, {**config.model_dump(exclude_unset=True), **params})  # unset fields stay unset


def check_expert_options(config: MergeConfig, experts: Iterable[str]) -> None:
    """Per-expert weights, densities and drop rates must name experts of this merge (a typo would otherwise
    merge at the default silently)."""
    names = list(experts)
    for option in ("weights", "densities", "drop_rates"):
        unknown = [n for n in getattr(config, option) if n not in names]
        if unknown:
            raise ConfigError(f"{option} names {', '.join(map(repr, unknown))}, not an expert of this merge "
                              f"(experts: {', '.join(names)})")


def _describe(source) -> dict[str, Any]:
    if hasattr(source, "describe"):  # a LoRA adapter applied to the base (io/read/lora.py), a dequantised GGUF
        return source.describe()
    if isinstance(source, RenamedSource):  # read under other names (layouts.py): say which
        return {**_describe(source.source), "read_as": source.view}
    if isinstance(source, CheckpointReader):  # a folder holding adapter files too: read as full weights, said
        return {"path": str(source.path), "sha256": checkpoint_hashes(source.path), **kind_record(source.path, False)}
    return {"path": str(source.path), "in_memory": True}


@dataclass
class OutputPlan:
    """What the written folder holds besides the weights (decided, and refused where ambiguous, before any
    merging): its dtype, tokenizer, task heads, and the input cards and mergekit files it replaces."""

    dtype: torch.dtype | None = None
    tokenizer: TokenizerPlan | None = None
    heads: HeadPlan | None = None
    replaced: dict[str, dict[str, str]] = field(default_factory=dict)
    hub_ids: dict[str, str] = field(default_factory=dict)  # role -> hub id given for the card (io/write/card.py)


def plan_output(base: MergeInput, experts: Mapping[str, MergeInput], base_src, expert_srcs: Mapping[str, Any],
                names: list[str], options: OutputOptions, vocab: VocabPlan | None) -> OutputPlan:
    """The OutputPlan of a merge (ConfigError for a tokenizer conflict no tokenizer_source settles)."""
    folders = {n: input_folder(experts[n], s) for n, s in expert_srcs.items()}
    base_folder = input_folder(base, base_src)
    tokenizer = None
    if vocab is not None and vocab.tokenizer_from is not None:  # a grown vocabulary needs the grown tokenizer
        if options.tokenizer_source not in (None, vocab.tokenizer_from):
            raise ConfigError(f"tokenizer_source {options.tokenizer_source!r}: the merge's vocabulary grows to expert "
                              f"{vocab.tokenizer_from!r}'s rows, so its tokenizer is the one the output can carry")
    elif base_folder is not None or options.tokenizer_source is not None:
        tokenizer = plan_tokenizer(base_folder, folders, options.tokenizer_source)
    dtype = getattr(torch, options.dtype) if options.dtype is not None else None
    replaced = replaced_files({"base": base_folder, **{f"expert {n!r}": f for n, f in folders.items()}})
    return OutputPlan(dtype, tokenizer, plan_heads(base_src, expert_srcs, names), replaced, dict(options.hub_id))


def cast_floating(state: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The floating tensors in `dtype` (None: as they are); integer tensors (position ids) untouched."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


@dataclass(frozen=True)
class _Opened:
    """A merge's inputs as opened and checked: the family (base and experts, under the base's naming), the grown
    vocabulary's plan (None without), what the written folder holds besides the weights, the data loaded for
    RegMean(++) (None without)."""

    family: Family
    vocab: VocabPlan | None
    plan: OutputPlan
    data: Any = None


def _write_output(request: MergeRequest, merged: dict[str, Tensor], merger, opened: _Opened, *,
                  seconds: dict[str, float], total: Timer) -> dict[str, Any]:
    """The checkpoint directory: the base's side files, the weights, the tokenizer, the task heads, then
    featcal.json and the model card, atomically; the report written."""
    out, overwrite, family, vocab, plan = (Path(request.out), request.options.overwrite, opened.family, opened.vocab,
                                           opened.plan)
    save = Timer()
    with atomic_output_dir(out, overwrite) as tmp:
        if isinstance(family.base, ModuleSource):
            family.base.save_config(tmp)
        else:
            copy_side_files(family.base.path, tmp)  # never the base's card nor a mergekit recipe (io/write/card.py)
            if isinstance(family.base, RenamedSource):
                family.base.write_config(tmp)  # a CLIPModel base's vision tower: a CLIPVisionModel config
        files = save_state_dict(merged, tmp)
        if plan.dtype is not None:
            _set_config_dtype(tmp, plan.dtype)
        if plan.tokenizer is not None:
            plan.tokenizer.write(tmp)
        if vocab is not None:  # config vocab_size and tokenizer of the grown rows (merging/vocab.py)
            vocab.write(tmp)
        heads = plan.heads.write(tmp, family.experts) if plan.heads is not None else None
        copied = [n for n in family.names if not family.is_floating(n)]
        report = build_report(
            "merge",
            merger.params(),
            inputs={"base": _describe(family.base), "experts": {n: _describe(s) for n, s in family.experts.items()},
                    **merger.report_inputs()},
            output={"path": str(out), "files": files, "sha256": checkpoint_hashes(tmp), "dtype": _dtype_name(merged)},
            tensors={"total": len(family.names), "merged": len(family.names) - len(copied), "copied_from_base": copied},
        )
        report["seconds"] = {
            **{k: round(v, 3) for k, v in seconds.items()}, "save": round(save.seconds, 3), "total": round(total.seconds, 3),
        }
        report["peak_rss_mb"] = round(peak_rss_mb(), 1)
        if vocab is not None:
            report["vocabulary"] = vocab.report()
        if plan.tokenizer is not None:
            report["tokenizer"] = plan.tokenizer.report(tmp)
        elif vocab is not None and vocab.tokenizer_from is not None:
            report["tokenizer"] = {"source": f"expert {vocab.tokenizer_from!r}", "chosen_by": "grown vocabulary"}
        if heads:
            report["task_heads"] = heads
        if plan.replaced:
            report["replaced_input_files"] = plan.replaced
        write_card(tmp, report, hub_ids=plan.hub_ids)  # records each input's hub id in the report too
        write_report(tmp, report)
    log.info("merged checkpoint written to %s", out)
    return report


def _dtype_name(state: Mapping[str, Tensor]) -> str | None:
    """The floating dtype of the written weights (None when they mix several)."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _set_config_dtype(directory: Path, dtype: torch.dtype) -> None:
    """config.json's dtype (transformers 5's key; `torch_dtype` before) says what the weights are stored in."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype" if "torch_dtype" not in config else "torch_dtype"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    expert_kind: Mapping[str, str] | None = None,
    dtype: str | None = None,
    tokenizer_source: str | None = None,
    hub_id: Mapping[str, str] | None = None,
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

    `dtype` ('float32', 'bfloat16', 'float16'): the floating dtype of the result and the written weights
    (default: the base's). `tokenizer_source` ('base' or an expert's name): whose tokenizer the output carries
    when the experts' disagree where the base lacks one (a chat template; io/write/tokenizer.py). The output also
    gets a model card (README.md) and, when the experts' label sets differ, each task's head in heads/. `hub_id`
    (role -> hub id; role "base" or an expert's name): how the card names an input its own record names no hub id
    for (io/write/card.py); the card never names an input by an absolute path.

    `calibration` (regmean, regmean++ only; data-free methods refuse it): task -> a data source path,
    read like `featcal calibrate` reads it (`num_calibration_examples` drawn with `seed`, in batches of
    `calibration_batch_size`, texts truncated to `max_length` tokens, `allow_fewer`), or in-memory
    batches (a tensor or a dict of model inputs, or a list of those), one entry per expert.

    `expert_kind` (task -> "full" or "adapter"): how to read an expert folder that holds both full weights and
    a LoRA / PEFT adapter; such a folder is refused without it.
    """
    cfg = resolve_config(method, config, params)
    options = run_options(overwrite=overwrite, allow_pickle=allow_pickle, max_length=max_length,
                          allow_fewer=allow_fewer, expert_kind=expert_kind or {})
    outputs = parse(OutputOptions, {"dtype": dtype, "tokenizer_source": tokenizer_source,
                                    "hub_id": dict(hub_id or {})})
    return merge_to(MergeRequest(base, experts, cfg, out=out, options=options, outputs=outputs,
                                 calibration=calibration, progress=progress)).state


@dataclass(frozen=True)
class MergeRequest:
    """One merge (`featcal merge`, a run file's `merge:`, featcal.merge): the base and the experts (name ->
    checkpoint dir, hub id or nn.Module), the validated MergeConfig (method and hyperparameters; featcal.merge's
    resolve_config builds it from keywords), the output folder (None: only the state dict comes back), how the
    inputs are read (`options`: overwrite, allow_pickle, max_length, allow_fewer, expert_kind), what the written
    folder holds (`outputs`: dtype, tokenizer_source, hub_id), RegMean(++)'s calibration data, progress bars."""

    base: MergeInput
    experts: Mapping[str, MergeInput]
    config: MergeConfig
    out: str | os.PathLike | None = None
    options: RunOptions = field(default_factory=RunOptions)
    outputs: OutputOptions = field(default_factory=OutputOptions)
    calibration: Mapping[str, CalibrationInput] | None = None
    progress: bool = True


@dataclass(frozen=True)
class MergeResult:
    """A merge: the merged state dict (keyed like the base checkpoint, in the base's dtypes or `outputs.dtype`),
    and with an output folder, that folder and its featcal.json (`report`); None for both without."""

    state: dict[str, Tensor]
    out: Path | None = None
    report: dict[str, Any] | None = None


def merge_to(request: MergeRequest) -> MergeResult:
    """The merge `request` describes (featcal.merge's docstring says what each part does): every input checked
    first, the merge streamed, its tensors checked for NaN / Inf, then (with `out`) the folder written atomically."""
    total = Timer()
    if not isinstance(request.config, MergeConfig):
        raise ConfigError(f"config must be a MergeConfig, got {type(request.config).__name__}")
    r = dataclasses.replace(request, config=resolve_config(request.config.method, request.config, {}))
    cfg = r.config
    _check_merge_request(r)
    opened = _open_merge_inputs(r)
    validate_seconds = total.seconds

    loaded, data_timer = None, Timer()
    if opened.data is not None:
        loaded = load_calibration(opened.data, progress=r.progress)
    data_seconds = {"load_data": data_timer.seconds} if loaded is not None else {}
    merger = make_merger(cfg, calibration=loaded, allow_pickle=r.options.allow_pickle)
    family = opened.family
    work = Timer()
    merged = merge_family(merger, family, progress=r.progress)
    if opened.vocab is not None:
        merged = opened.vocab.grow(merged)  # the extra vocabulary rows: the mean of the experts that have them
    merged = cast_floating(merged, opened.plan.dtype)
    check_finite_state(f"the {cfg.method} merge", merged)  # finite inputs can still overflow the output dtype
    merge_seconds = work.seconds
    log.info("merged %d experts with %s in %.2f s", len(family.experts), cfg.method, merge_seconds)

    if r.out is None:
        return MergeResult(merged)
    report = _write_output(r, merged, merger, opened, total=total,
                           seconds={"validate": validate_seconds, **data_seconds, "merge": merge_seconds})
    return MergeResult(merged, Path(r.out), report)


def _check_merge_request(r: MergeRequest) -> None:
    """What is refused before any input is opened: the experts' names, kinds and per-expert options, the hub ids,
    the calibration data's presence for the method, the output folder (free, no input, replaceable)."""
    experts, kinds, out, overwrite = r.experts, r.options.expert_kind, r.out, r.options.overwrite
    if not isinstance(experts, Mapping):
        raise ConfigError(f"experts must be a mapping of task name -> checkpoint, got {type(experts).__name__}")
    validate_expert_names(experts.keys())
    check_expert_kinds(kinds, experts)
    check_expert_options(r.config, experts.keys())
    check_hub_ids(r.outputs.hub_id, experts.keys())
    check_calibration_request(r.config.method, experts, r.calibration)
    if out is not None:
        check_output_dir(out, overwrite)
        refuse_output_over_inputs(out, {"base": r.base, **{f"expert {n!r}": e for n, e in experts.items()},
                                        **{f"calibration data {t!r}": c for t, c in (r.calibration or {}).items()}})
        check_replaceable(out, overwrite)


def _open_merge_inputs(r: MergeRequest) -> _Opened:
    """Every input opened once (a LoRA adapter folder applied to the base), under the base's naming, experts with
    more vocabulary rows than the base cut to its rows (merged as the base's, then grown back: `vocab`); the
    calibration data checked, the family validated, the output planned."""
    base, experts, cfg = r.base, r.experts, r.config
    base_src, expert_srcs, vocab = open_family(base, experts, allow_pickle=r.options.allow_pickle,
                                               expert_kind=r.options.expert_kind).merge_view()
    if r.out is not None and isinstance(base_src, ModuleSource):
        base_src.check_can_save()
    model_dir = None if isinstance(base_src, ModuleSource) else Path(base_src.path)
    data = None
    if r.calibration:
        data = check_calibration_data(r.calibration, model_dir=model_dir, config=cfg, max_length=r.options.max_length,
                                      allow_fewer=r.options.allow_fewer, experts=experts)
    validate_family(base_src, expert_srcs, progress=r.progress)
    plan = plan_output(base, experts, base_src, expert_srcs, sorted(base_src.keys()), r.outputs, vocab)
    return _Opened(Family(base_src, expert_srcs), vocab, plan, data)
