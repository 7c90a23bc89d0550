"""One calibration at one setting (no hyperparameter search): check everything, then run the block engine.

`featcal.calibrate` (api.py) dispatches here, or to the search (tuning/), which calls this for every
candidate and for the final refit. Each stage below is one step of the run, in the order it happens.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter, adapter_for
from featcal.blocks.structure import Stack
from featcal.calibration.core.inputs import (
    ModelLike,
    as_model,
    check_base_for_rho,
    check_batches,
    check_tasks,
    check_variant_packages,
    identity,
    normalise_batches,
    resolve_device,
)
from featcal.calibration.core.result import CalibrationResult, DriftRow
from featcal.calibration.engine import expert_placement
from featcal.calibration.engine.driver import (
    EngineOptions,
    EngineResult,
    ExpertReads,
    FeatCalEngine,
    SearchHooks,
)
from featcal.calibration.engine.param_names import needed_param_names
from featcal.calibration.engine.placement import Placement
from featcal.calibration.engine.template import expert_template
from featcal.calibration.maths.distributed import RankGroup, current_group
from featcal.calibration.resume import store as resume_mod
from featcal.config import FeatCalConfig
from featcal.data.batch import Batch
from featcal.io.read.family import InputFamily, open_family
from featcal.io.read.validate import validate_expert_names

log = logging.getLogger("featcal.calibration")


def resume_store(
    config: FeatCalConfig, model: nn.Module, base: ModelLike | None, experts: Mapping[str, ModelLike],
    data: Mapping[str, list[Batch]], group: RankGroup, expert_kind: Mapping[str, str] | None = None,
) -> resume_mod.ResumeStore | None:
    """The per-block checkpoint store for this run, when `config.resume` and a `resume_dir` are set."""
    if not config.resume or config.resume_dir is None:
        return None
    fingerprint = {
        "config": resume_mod.config_digest(config),
        "merged": resume_mod.module_digest(model),
        "base": "none" if base is None else identity(base),
        "tasks": ",".join(experts),
        "ranks": str(group.world),
        **{f"expert {t}": identity(e) for t, e in experts.items()},
        **{f"data {t}": resume_mod.batches_digest(b) for t, b in data.items()},
        **{f"kind {t}": k for t, k in (expert_kind or {}).items()},  # one folder, two experts: full or adapter
    }
    return resume_mod.ResumeStore(config.resume_dir, fingerprint, rank=group.rank, world=group.world,
                                  barrier=group.barrier)


# --- the stages --------------------------------------------------------------------------------------
def _check_request(config: FeatCalConfig, base: ModelLike | None, experts: Mapping[str, ModelLike],
                   calibration: Mapping[str, Any]) -> torch.device:
    """Expert names, tasks, device and ρ, refused before anything is loaded; the device to calibrate on."""
    validate_expert_names(experts.keys())
    check_tasks(experts, calibration)
    device = resolve_device(config.device, offload=config.offload_blocks)
    check_variant_packages(config)
    check_base_for_rho(config, base)
    return device


def _model_to_calibrate(merged: ModelLike, inplace: bool, allow_pickle: bool) -> nn.Module:
    """The merged model, loaded when given as a path; a copy of a model passed in unless `inplace`."""
    model = as_model(merged, "merged model", allow_pickle)
    if isinstance(merged, nn.Module) and not inplace:
        model = copy.deepcopy(model)
    return model


def _calibration_data(model: nn.Module, adapter: Adapter, main: str, experts: Mapping[str, ModelLike],
                      calibration: Mapping[str, Iterable[Any]], group: RankGroup) -> dict[str, list[Batch]]:
    """Each task's batches as dicts of tensors, checked against the model and against the ranks' shares."""
    data = {t: normalise_batches(t, calibration[t], main) for t in experts}
    for t, batches in data.items():
        check_batches(t, batches, main, getattr(model, "config", None), adapter)
    for t, batches in data.items():
        group.shard(len(batches), t)  # enough batches for every rank, checked before any work
    return data


def _open_resume_store(config: FeatCalConfig, model: nn.Module, base: ModelLike | None,
                       experts: Mapping[str, ModelLike], data: Mapping[str, list[Batch]],
                       group: RankGroup, expert_kind: Mapping[str, str] | None = None,
                       ) -> resume_mod.ResumeStore | None:
    store = resume_store(config, model, base, experts, data, group, expert_kind)
    if store is not None:
        store.available()  # refuses, before any work, a state left by a run with other inputs
    return store


def _checked_sources(model: nn.Module, template: nn.Module, stacks: list[Stack], family: InputFamily,
                     experts: Mapping[str, ModelLike], check_finite: bool, final_names: list[str] | None = None,
                     as_read: bool = False) -> ExpertReads:
    """Where each expert's and the base's parameters are read from (`family`, opened by io/read/family.py: the model
    given, or its files read block by block into `template`; a LoRA adapter applied to the base, a GGUF file
    dequantised), completed to a grown vocabulary, every parameter the run reads checked against the merged model
    (and, with `check_finite`, for NaN/Inf). `final_names`: the parameters of the norms solved outside the blocks
    (calibrate_final_norm, calibrate_stem_norm), which the base's anchor is read for too. `as_read` (prefetch): the
    streamed experts are checked as they are read; the ExpertReads says which (its `resident` left to the caller)."""
    stem_names, block_names = needed_param_names(model, stacks)
    block_names = block_names + list(final_names or [])  # read from experts and base like a block's (the anchor)
    experts_src, base_src = family.calibration_sources(model, template, stem_names + block_names, block_names,
                                                       check_finite, streamed_as_read=as_read)
    as_read_tasks = {t for t in experts if check_finite and as_read and family.streamed(t)}
    return ExpertReads(experts_src, base_src, prefetch=as_read, check_as_read=as_read_tasks)


def _run_engine(model: nn.Module, template: nn.Module, adapter: Adapter, reads: ExpertReads,
                data: dict[str, list[Batch]], config: FeatCalConfig, device: torch.device,
                options: EngineOptions) -> EngineResult:
    """Calibrate block by block on `device`; the model goes back where it was. `options.placement` is set here."""
    origin = next(model.parameters()).device
    placement = Placement(device, config.offload_blocks)
    placement.setup(model, template)  # both on the device, or (offload_blocks) both on the host
    model.eval()
    template.eval()
    engine = FeatCalEngine(model, template, adapter, reads, data, config, device,
                           dataclasses.replace(options, placement=placement))
    log.info(
        "featcal: %s (%s adapter), %d task(s), %d batch(es), device %s",
        type(model).__name__, adapter.name, len(data), sum(len(v) for v in data.values()), device,
    )
    with resume_mod.discard_on_error(options.resume):
        engine.run()
    model.to(origin)
    return engine.result()


def calibrate_setting(
    merged: ModelLike,
    *,
    base: ModelLike | None = None,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Iterable[Any]],
    config: FeatCalConfig,
    progress: bool = True,
    inplace: bool = False,
    allow_pickle: bool = False,
    keep_resume_state: bool = False,
    check_finite: bool = True,
    expert_kind: Mapping[str, str] | None = None,
    prefetch: bool = True,
    resident: bool = True,
    search: SearchHooks = SearchHooks(),
) -> CalibrationResult:
    """Calibrate `merged` toward its experts at `config`'s setting (its `tune` is not looked at); see
    `featcal.calibrate` for the arguments. Every input is checked before any work, except that with `prefetch`
    (the default) the experts read from files are checked for NaN / Inf as their blocks are read, ahead of
    the block that needs them (prefetch.py). `prefetch=False`: every read on the main thread when needed, every
    input scanned first (the same result bit for bit; tests compare the two). `resident=False`: experts in
    memory on the device are copied into the template block by block too (expert_placement.py; the same result).
    `search`: what a search asks of its calibrations (engine.SearchHooks)."""
    device = _check_request(config, base, experts, calibration)
    model = _model_to_calibrate(merged, inplace, allow_pickle)
    adapter = adapter_for(model)  # unsupported architectures fail here, before any work
    stacks = adapter.stacks(model)
    adapter.prepare(model)  # while the model is whole on one device (an encoder's final norm, for its decoder)
    group = current_group()
    data = _calibration_data(model, adapter, adapter.main_input(model, stacks[0]), experts, calibration, group)
    store = _open_resume_store(config, model, base, experts, data, group, expert_kind)
    template = expert_template(model, stacks)  # stems held; each block's storage only while it is calibrated
    final = adapter.final_norm(model, stacks[-1]) if config.calibrate_final_norm else None
    stem = adapter.stem_norm(model, stacks[0]) if config.calibrate_stem_norm else None
    solved_norms = [n for norm in (stem, final) if norm is not None for n in norm.param_names()]
    family = open_family(base, experts, allow_pickle=allow_pickle, expert_kind=expert_kind, eager=False)
    reads = _checked_sources(model, template, stacks, family, experts, check_finite, solved_norms, as_read=prefetch)
    where = expert_placement.choose(experts, template, device, config, allowed=resident)
    log.info("featcal: experts %s (%s)", where.experts, where.why)
    reads = dataclasses.replace(reads, resident=where.resident)
    ran = _run_engine(model, template, adapter, reads, data, config, device,
                      EngineOptions(progress, group, store, search=search))
    if store is not None and not keep_resume_state:
        store.delete()
    del template
    return CalibrationResult(model=model, drift=[DriftRow.from_dict(r) for r in ran.drift], end_to_end=ran.end_to_end,
                             final_norm=ran.final_norm,
                             stem_norm=ran.stem_norm, kept_merged=ran.kept_merged,
                             resume_store=store if keep_resume_state else None,
                             placement=where.record())  # the caller deletes it after writing
