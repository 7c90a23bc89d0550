"""What every calibration checks and prepares before any work: the device, the merged model, the
calibration batches (normalised and checked against the model) and the task names. The checkpoints are opened
and checked by the front door (io/read/family.py). Shared by a single calibration (core/setting.py) and the
hyperparameter search (tuning/).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter
from featcal.calibration.resume import store as resume_mod
from featcal.config import FeatCalConfig
from featcal.errors import CalibrationDataError, ConfigError
from featcal.io.read import models as io_models  # looked up at call time (tests watch load_model)
from featcal.io.read.family import open_input
from featcal.io.read.tensor_source import TensorSource

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


def check_variant_packages(config: FeatCalConfig) -> None:
    """The packages an option's variant runs on, before any work: block_statistics sequential_one_pass runs each
    block forward in a greenlet (the `one-pass` extra)."""
    if config.block_statistics == "sequential_one_pass":
        from featcal.io.process.extras import require

        require("one-pass", "block_statistics sequential_one_pass")


def as_model(m: ModelLike, what: str, allow_pickle: bool) -> nn.Module:
    if isinstance(m, nn.Module):
        return m
    log.info("loading %s from %s", what, m)
    return io_models.load_model(m, allow_pickle=allow_pickle)


def normalise_batches(task: str, batches: Iterable[Any], main_input: str) -> list[dict[str, torch.Tensor]]:
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


def check_batches(task: str, batches: list[dict[str, torch.Tensor]], main_input: str, config: Any,
                  adapter: Adapter) -> None:
    """Cheap checks that each batch fits the model (the adapter's `check_batch`), so a bad one fails here
    and not deep in a forward."""
    for i, b in enumerate(batches):
        adapter.check_batch(config, b, main_input, f"task {task!r}, batch {i}")


def check_tasks(experts: Mapping[str, Any], calibration: Mapping[str, Any]) -> None:
    if not experts:
        raise CalibrationDataError("no experts given: FeatCal calibrates toward at least one expert")
    no_data = [t for t in experts if t not in calibration]
    no_expert = [t for t in calibration if t not in experts]
    if no_data:
        raise CalibrationDataError(f"expert(s) {no_data} have no calibration data (calibration has {list(calibration)})")
    if no_expert:
        raise CalibrationDataError(f"calibration task(s) {no_expert} have no expert (experts are {list(experts)})")


def identity(source: ModelLike) -> str:
    """What identifies an input for resuming: its weights in memory, its files on disk."""
    if isinstance(source, nn.Module):
        return resume_mod.module_digest(source)
    path = os.fspath(source)
    if os.path.isfile(path):  # a GGUF file: its identity, like a folder's, from name, size and mtime
        st = os.stat(path)
        return f"file:{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return resume_mod.files_digest(path) if os.path.isdir(path) else f"id:{path}"

def adapter_reader(expert: ModelLike, base: ModelLike | None, label: str, allow_pickle: bool,
                   kind: str | None = None) -> TensorSource:
    """`expert` opened as calibrate opens it (io/read/family.py's `open_input`): a LoRA / PEFT adapter folder read as
    base + ΔW, a GGUF file dequantised, a checkpoint folder read one tensor at a time. `kind` (full / adapter)
    settles an expert folder holding both; the base (`label` "base") is read as its full weights."""
    opened_base = None if base is None else (lambda: open_input(base, label="base", allow_pickle=allow_pickle))
    return open_input(expert, label=label, allow_pickle=allow_pickle, base=opened_base, kind=kind,
                      may_be_adapter=label != "base")


def check_base_for_rho(config: FeatCalConfig, base: Any) -> None:
    """ρ ≠ 1 extrapolates from the base model: refused without one."""
    if base is None and config.anchor_blend_rho != 1.0:
        raise ConfigError(
            f"anchor_blend_rho={config.anchor_blend_rho} extrapolates from the base model: pass base=, or set rho to 1"
        )
