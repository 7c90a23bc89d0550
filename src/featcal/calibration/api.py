"""`featcal.calibrate`: the public entry point. Validates everything, then runs the block engine."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import adapter_for
from featcal.calibration import resume as resume_mod
from featcal.calibration.distributed import RankGroup, current_group
from featcal.calibration.engine import FeatCalEngine, needed_param_names
from featcal.calibration.placement import Placement
from featcal.config import FeatCalConfig
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError
from featcal.io.param_sources import CheckpointSource, ModelSource, ParamSource, validate_source
from featcal.io.validate import first_non_finite, validate_expert_names

log = logging.getLogger("featcal.calibration")

ModelLike = nn.Module | str | os.PathLike


def resolve_device(name: str, *, offload: bool = False) -> torch.device:
    """The torch device `name` means here; a ConfigError naming it when this machine has no such device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    why = " (offload_blocks puts each block there)" if offload else ""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested{why} but CUDA is not available")
        index, count = torch.device(name).index, torch.cuda.device_count()
        if index is not None and index >= count:
            raise ConfigError(f"device {name!r} requested{why} but this machine has {count} CUDA device(s)")
    return torch.device(name)


def _as_model(m: ModelLike, what: str, allow_pickle: bool) -> nn.Module:
    if isinstance(m, nn.Module):
        return m
    from featcal.io.models import load_model

    log.info("loading %s from %s", what, m)
    return load_model(m, allow_pickle=allow_pickle)


def _normalise_batches(task: str, batches: Iterable[Any], main_input: str) -> list[dict[str, torch.Tensor]]:
    """Tensors become {main_input: tensor}; dicts are kept. Refuses empty sets and foreign objects."""
    if isinstance(batches, (torch.Tensor, Mapping)):
        batches = [batches]
    out = []
    for i, b in enumerate(batches):
        if isinstance(b, torch.Tensor):
            out.append({main_input: b})
        elif isinstance(b, Mapping):
            bad = [k for k, v in b.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise CalibrationDataError(f"task {task!r}, batch {i}: entries {bad} are not tensors")
            out.append(dict(b))
        else:
            raise CalibrationDataError(
                f"task {task!r}, batch {i}: a batch must be a tensor or a dict of tensors, not {type(b).__name__}"
            )
    if not out:
        raise CalibrationDataError(f"the calibration set of task {task!r} is empty")
    return out


def _check_batches(task: str, batches: list[dict[str, torch.Tensor]], main_input: str, config: Any) -> None:
    """Cheap checks that each batch fits the model, so a bad one fails here and not deep in a forward."""
    vocab = getattr(config, "vocab_size", None)
    for i, b in enumerate(batches):
        where = f"task {task!r}, batch {i}"
        if main_input not in b and "inputs_embeds" not in b:
            raise CalibrationDataError(f"{where}: no {main_input!r} (keys: {sorted(b)})")
        x = b.get(main_input)
        if x is None:
            continue
        if x.numel() == 0:
            raise CalibrationDataError(f"{where}: {main_input!r} is empty")
        if main_input == "input_ids":
            if x.is_floating_point() or x.dim() != 2:
                raise CalibrationDataError(f"{where}: input_ids must be integer (batch, tokens), got {x.dtype} {tuple(x.shape)}")
            if vocab is not None and (int(x.max()) >= vocab or int(x.min()) < 0):
                raise CalibrationDataError(f"{where}: input_ids outside the vocabulary [0, {vocab})")
            mask = b.get("attention_mask")
            if mask is not None and tuple(mask.shape) != tuple(x.shape):
                raise CalibrationDataError(
                    f"{where}: attention_mask {tuple(mask.shape)} does not match input_ids {tuple(x.shape)}"
                )
        elif main_input == "pixel_values":
            if x.dim() != 4:
                raise CalibrationDataError(
                    f"{where}: pixel_values must be (batch, channels, height, width), got {tuple(x.shape)}"
                )
            vision = getattr(config, "vision_config", config)
            channels, size = getattr(vision, "num_channels", None), getattr(vision, "image_size", None)
            if channels is not None and x.shape[1] != channels:
                raise CalibrationDataError(f"{where}: pixel_values have {x.shape[1]} channels, the model takes {channels}")
            if isinstance(size, int) and tuple(x.shape[2:]) != (size, size):
                raise CalibrationDataError(
                    f"{where}: pixel_values are {tuple(x.shape[2:])} pixels, the model takes ({size}, {size})"
                )
        if main_input == "input_ids":
            limit = getattr(config, "max_position_embeddings", None)
            if limit is not None and getattr(config, "model_type", "") != "t5" and x.shape[1] > limit:
                raise CalibrationDataError(f"{where}: {x.shape[1]} tokens, the model takes at most {limit}")


def _check_finite(
    model: nn.Module, sources: Mapping[str, ParamSource], base: ParamSource | None,
    stem_names: list[str], block_names: list[str],
) -> None:
    """Refuse NaN/Inf in any parameter the run reads, naming its owner, before any forward runs."""
    def read(src: ParamSource, names: list[str]):  # lazily: one tensor in memory at a time
        return ((n, src.get(n)) for n in names)

    owners = [("merged model", model.named_parameters())]
    owners += [(src.label, read(src, stem_names + block_names)) for src in sources.values()]
    if base is not None:
        owners.append((base.label, read(base, block_names)))
    for label, tensors in owners:
        bad = first_non_finite(tensors)
        if bad is not None:
            raise CheckpointError(f"{label}: parameter {bad[0]!r} contains NaN or Inf ({bad[1]} value(s))")


def _check_tasks(experts: Mapping[str, Any], calibration: Mapping[str, Any]) -> None:
    if not experts:
        raise CalibrationDataError("no experts given: FeatCal calibrates toward at least one expert")
    no_data = [t for t in experts if t not in calibration]
    no_expert = [t for t in calibration if t not in experts]
    if no_data:
        raise CalibrationDataError(f"expert(s) {no_data} have no calibration data (calibration has {list(calibration)})")
    if no_expert:
        raise CalibrationDataError(f"calibration task(s) {no_expert} have no expert (experts are {list(experts)})")


def _identity(source: ModelLike) -> str:
    """What identifies an input for resuming: its weights in memory, its files on disk."""
    if isinstance(source, nn.Module):
        return resume_mod.module_digest(source)
    path = os.fspath(source)
    if os.path.isfile(path):  # a GGUF file: its identity, like a folder's, from name, size and mtime
        st = os.stat(path)
        return f"file:{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return resume_mod.files_digest(path) if os.path.isdir(path) else f"id:{path}"


def resume_store(
    config: FeatCalConfig, model: nn.Module, base: ModelLike | None, experts: Mapping[str, ModelLike],
    data: Mapping[str, list[dict[str, torch.Tensor]]], group: RankGroup,
) -> resume_mod.ResumeStore | None:
    """The per-block checkpoint store for this run, when `config.resume` and a `resume_dir` are set."""
    if not config.resume or config.resume_dir is None:
        return None
    fingerprint = {
        "config": resume_mod.config_digest(config),
        "merged": resume_mod.module_digest(model),
        "base": "none" if base is None else _identity(base),
        "tasks": ",".join(experts),
        "ranks": str(group.world),
        **{f"expert {t}": _identity(e) for t, e in experts.items()},
        **{f"data {t}": resume_mod.batches_digest(b) for t, b in data.items()},
    }
    return resume_mod.ResumeStore(config.resume_dir, fingerprint, rank=group.rank, world=group.world,
                                  barrier=group.barrier)


def adapter_reader(expert: ModelLike, base: ModelLike | None, label: str, allow_pickle: bool):
    """A LoRA / PEFT adapter folder read as base + ΔW (io/lora.py), a GGUF file dequantised (io/gguf.py);
    None for any other input (a checkpoint folder, read by CheckpointSource itself)."""
    from featcal.io.gguf import open_gguf
    from featcal.io.inputs import open_source
    from featcal.io.lora import is_adapter_dir, open_adapter

    gguf = open_gguf(expert, label)
    if gguf is not None:
        return gguf
    if not is_adapter_dir(expert):
        return None
    if base is None:
        need = "pass base= (the model it was trained on) to apply it" if label != "base" else "the base must be a model"
        raise ConfigError(f"{label}: {expert} is a LoRA adapter; {need}")
    return open_adapter(expert, open_source(base, label="base", allow_pickle=allow_pickle), label,
                        allow_pickle=allow_pickle)


def calibrate(
    merged: ModelLike,
    *,
    base: ModelLike | None = None,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Iterable[Any]],
    config: FeatCalConfig | None = None,
    progress: bool = True,
    inplace: bool = False,
    allow_pickle: bool = False,
    keep_resume_state: bool = False,
    check_finite: bool = True,
    heads: Mapping[str, Any] | None = None,
    merge_scaling: float | None = None,
) -> nn.Module:
    """Calibrate a merged model toward its experts with FeatCal (SPEC §2); returns the calibrated model.

    merged, base, experts: transformers models, or checkpoint paths / hub ids. Experts and base given as
    paths are read block by block from their safetensors and never loaded whole. calibration: per task,
    a list of batches (a tensor for the model's main input, or a dict of keyword inputs). The result
    is the merged model's class, with `featcal_drift = [{"block", "stack", "layer", "before", "after"}]` and
    `featcal_end_to_end = {"merged", "calibrated", ...}` (final-block drift; a warning is logged when worse).
    A model passed as `merged` is copied unless `inplace=True`.

    With `config.resume_dir` every finished block is checkpointed there and a rerun with the same inputs
    continues after the last finished block; the state is deleted on success unless `keep_resume_state`
    (the caller deletes it once its output is written); `config.checkpoint_every` spaces the checkpoints.
    With `config.offload_blocks` the models and chains stay on the CPU and only the block being
    calibrated goes to `config.device` (placement.py). `check_finite` scans, before any work, every
    parameter the run reads (merged, base, experts; one tensor at a time) for NaN/Inf. Under an initialised torch.distributed process
    group the batches are shared out over the ranks and the statistics all-reduced (distributed.py).

    With `config.tune` the hyperparameters are first chosen on held-out calibration examples without
    labels, then refit on all of them (tuning.py; the result carries `featcal_tuning`): `heads` (task ->
    nn.Module on the pooled output, or callable head(model, batch) -> logits) add agreement with the
    experts' predictions to the score, and `merge_scaling` (the s of a task-vector merge θ0 + s·v) lets the
    search rebuild the merge at other scalings.
    """
    config = config if config is not None else FeatCalConfig()
    if not isinstance(config, FeatCalConfig):
        raise ConfigError(f"config must be a FeatCalConfig, not {type(config).__name__}")
    from featcal.calibration import tuning

    tuning.check_request(config, base, experts, heads, merge_scaling)
    if config.tune:
        return tuning.calibrate_tuned(
            merged, base=base, experts=experts, calibration=calibration, config=config, heads=heads,
            merge_scaling=merge_scaling, progress=progress, inplace=inplace, allow_pickle=allow_pickle,
            keep_resume_state=keep_resume_state, check_finite=check_finite,
        )
    validate_expert_names(experts.keys())
    _check_tasks(experts, calibration)
    device = resolve_device(config.device, offload=config.offload_blocks)
    if base is None and config.anchor_blend_rho != 1.0:
        raise ConfigError(
            f"anchor_blend_rho={config.anchor_blend_rho} extrapolates from the base model: pass base=, or set rho to 1"
        )

    model = _as_model(merged, "merged model", allow_pickle)
    if isinstance(merged, nn.Module) and not inplace:
        model = copy.deepcopy(model)
    adapter = adapter_for(model)  # unsupported architectures fail here, before any work
    stacks = adapter.stacks(model)
    main = adapter.main_input(model, stacks[0])
    data = {t: _normalise_batches(t, calibration[t], main) for t in experts}
    for t, batches in data.items():
        _check_batches(t, batches, main, getattr(model, "config", None))
    group = current_group()
    for t, batches in data.items():
        group.shard(len(batches), t)  # enough batches for every rank, checked before any work

    store = resume_store(config, model, base, experts, data, group)
    if store is not None:
        store.available()  # refuses, before any work, a state left by a run with other inputs
    template = copy.deepcopy(model)  # expert t's weights are loaded into this, block by block
    sources: dict[str, ParamSource] = {}
    for t, e in experts.items():
        if isinstance(e, nn.Module):
            sources[t] = ModelSource(e, f"expert {t!r}")
        else:
            sources[t] = CheckpointSource(e, template, f"expert {t!r}", allow_pickle=allow_pickle,
                                          reader=adapter_reader(e, base, f"expert {t!r}", allow_pickle))
    base_src: ParamSource | None = None
    if base is not None:
        base_src = ModelSource(base, "base") if isinstance(base, nn.Module) else CheckpointSource(
            base, template, "base", allow_pickle=allow_pickle, reader=adapter_reader(base, None, "base", allow_pickle)
        )

    from featcal.io.vocab import pad_param_sources

    sources = pad_param_sources(sources, model)  # fewer vocabulary rows than a grown merge: its rows complete them
    stem_names, block_names = needed_param_names(model, stacks)
    for src in sources.values():
        validate_source(src, model, stem_names + block_names)
    if base_src is not None:
        validate_source(base_src, model, block_names)
    if check_finite:
        _check_finite(model, sources, base_src, stem_names, block_names)

    origin = next(model.parameters()).device
    placement = Placement(device, config.offload_blocks)
    placement.setup(model, template)  # both on the device, or (offload_blocks) both on the host
    model.eval()
    template.eval()
    engine = FeatCalEngine(model, template, adapter, sources, base_src, data, config, device, progress,
                           group=group, resume=store, placement=placement)
    log.info(
        "featcal: %s (%s adapter), %d task(s), %d batch(es), device %s",
        type(model).__name__, adapter.name, len(data), sum(len(v) for v in data.values()), device,
    )
    with resume_mod.discard_on_error(store):
        drift = engine.run()
    if store is not None and not keep_resume_state:
        store.delete()
    del template
    model.to(origin)
    model.featcal_drift = drift
    model.featcal_end_to_end = engine.end_to_end  # the merge's and the calibrated model's final-block drift
    model.featcal_resume_store = store if keep_resume_state else None  # the caller deletes it after writing
    return model
