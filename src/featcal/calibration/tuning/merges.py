"""The starting merge of the search: rebuilt at other scalings where it is a task-vector merge.

A merge θ0 + s·v(experts), v independent of s, is the same merge at scaling factor·s after
θ ← θ0 + factor·(θ − θ0); `featcal calibrate --tune` learns s from the merged checkpoint's own featcal.json
when it ties the merge to these inputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.calibration.core.inputs import adapter_reader
from featcal.calibration.tuning.search import MAX_MERGE_SCALING
from featcal.config import (
    TASK_VECTOR_METHODS as TASK_VECTOR_METHODS,  # the method table's, importable here as before
)
from featcal.config import is_task_vector_merge
from featcal.io.read.checkpoint import read_json
from featcal.io.read.hashes import checkpoint_hashes
from featcal.io.read.param_sources import CheckpointSource, ModelSource, ParamSource
from featcal.io.write.report import REPORT_NAME


@torch.no_grad()
def rescale_merge(model: nn.Module, base: ParamSource, factor: float) -> None:
    """θ ← θ0 + factor·(θ − θ0) for every floating parameter the base holds, in place (float64 arithmetic).

    For a task-vector merge θ = θ0 + s·v this is the same merge rebuilt at scaling factor·s.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point() or base.shape(name) != tuple(p.shape):
            continue
        b = base.get(name).to(device=p.device, dtype=torch.float64)
        p.copy_((b + factor * (p.to(torch.float64) - b)).to(p.dtype))


def base_source(base: nn.Module | str | os.PathLike, model: nn.Module, allow_pickle: bool) -> ParamSource:
    """Where the base's parameters are read from to rebuild the merge (a model given, or its files)."""
    if isinstance(base, nn.Module):
        return ModelSource(base, "base")
    return CheckpointSource(base, model, "base", allow_pickle=allow_pickle,
                            reader=adapter_reader(base, None, "base", allow_pickle))


def _field(record: Any, key: str) -> Any:
    """record[key] where the record is a JSON object, else None (a hand-edited report may hold anything)."""
    return record.get(key) if isinstance(record, dict) else None


def merge_scaling_from_report(merged_dir: str | os.PathLike, base_dir: str | os.PathLike,
                              expert_dirs: Mapping[str, str | os.PathLike]) -> tuple[float | None, str]:
    """(s, why) when `merged_dir` is a featcal task-vector merge of exactly this base and these experts.

    Why: `featcal calibrate --tune` is given a merged checkpoint, not how it was made; the merge's own
    featcal.json says it, and the checkpoints' hashes tie it to the inputs, so the merge can be rebuilt
    at other scalings. Otherwise (None, the reason) and the scaling is not searched.
    """
    path = Path(merged_dir) / REPORT_NAME
    if not path.is_file():
        return None, f"no {REPORT_NAME} in the merged checkpoint"
    try:
        report = read_json(path)
    except Exception as exc:  # an unreadable report only means the scaling is not searched
        return None, f"{path}: {exc}"
    if not isinstance(report, dict):
        return None, f"{path}: not a featcal report (a JSON {type(report).__name__}, not an object)"
    params = _field(report, "params")
    method, scaling = _field(params, "method"), _field(params, "scaling")
    if report.get("command") != "merge" or not isinstance(method, str) or not is_task_vector_merge(method):
        return None, f"the merged checkpoint is not a featcal task-vector merge ({report.get('command')!r}, {method!r})"
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling <= MAX_MERGE_SCALING:
        return None, f"{path}: no usable scaling ({scaling!r})"
    recorded_output = _field(_field(report, "output"), "sha256")
    current = {k: v for k, v in checkpoint_hashes(merged_dir).items() if k != REPORT_NAME}
    if recorded_output != current:  # rebuilding "the merge at another scaling" needs the merge the report describes
        return None, (f"the merged checkpoint's files are not those its {REPORT_NAME} records (changed after the "
                      "merge), so its scaling is not trusted")
    inputs = _field(report, "inputs")
    recorded_base = _field(_field(inputs, "base"), "sha256")
    experts = _field(inputs, "experts")
    recorded_experts = sorted(repr(_field(e, "sha256")) for e in (experts.values() if isinstance(experts, dict) else ()))
    if recorded_base != checkpoint_hashes(base_dir) or recorded_experts != sorted(
        repr(checkpoint_hashes(d)) for d in expert_dirs.values()
    ):
        return None, "the merged checkpoint was made from another base or other experts"
    return float(scaling), f"{REPORT_NAME} of the merged checkpoint: {method}, scaling {scaling:g}"
