"""Stages every zoo build shares (vision: build.py, text: text_build.py): the build log, the task vectors
and the regime check, and the final write of the manifest beside the log."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from featcal.experiments.zoo.store import MANIFEST
from featcal.io.write.atomic import atomic_write_text
from featcal.io.write.report import package_versions

log = logging.getLogger("featcal.experiments.zoo.build")


class BuildLog:
    """What a build notes: logged as it happens and kept for the zoo's build.log."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.lines: list[str] = []
        self.logger = logger

    def note(self, msg: str) -> None:
        self.logger.info(msg)
        self.lines.append(msg)


def state_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def l2_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(v.float().pow(2).sum() for v in tensors))


def task_vector(expert: torch.nn.Module, base_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v - base_sd[k] for k, v in expert.state_dict().items()}


def regime_check(base: torch.nn.Module, base_sd: Mapping[str, torch.Tensor], vectors: Mapping[str, Mapping],
                 scaling: float, evaluate: Callable[[torch.nn.Module, str], float], base_acc: Mapping[str, float],
                 expert_acc: Mapping[str, float], notes: BuildLog) -> tuple[dict[str, float], dict[str, Any], bool]:
    """The zoo's own in-memory Task Arithmetic at `scaling` (the bench uses featcal.merge), evaluated per task;
    returns (TA accuracy per task, the mean accuracies of base / TA / experts, whether they are ordered)."""
    merged = copy.deepcopy(base)
    merged.load_state_dict({k: v + scaling * sum(vec[k] for vec in vectors.values()) for k, v in base_sd.items()})
    ta_acc = {name: evaluate(merged, name) for name in vectors}
    mean = lambda d: float(np.mean(list(d.values())))  # noqa: E731
    regime = {"base": mean(base_acc), f"task_arithmetic_{scaling}": mean(ta_acc), "experts": mean(expert_acc)}
    ok = regime["base"] < regime[f"task_arithmetic_{scaling}"] < regime["experts"]
    notes.note(f"regime: base {regime['base']:.3f} < TA {scaling} {regime[f'task_arithmetic_{scaling}']:.3f} < "
               f"experts {regime['experts']:.3f}: {'yes' if ok else 'NO'}")
    return ta_acc, regime, ok


def write_manifest(root: Path, manifest: Mapping[str, Any], notes: BuildLog, timings: Mapping[str, float]) -> None:
    """The zoo's manifest and build.log, written last (a build is complete once they are there). Every zoo's
    manifest ends with how it was built: its stage timings, torch's thread count and the package versions."""
    provenance = {"timings_s": {k: round(v, 2) for k, v in timings.items()}, "threads": torch.get_num_threads(),
                  "versions": package_versions()}
    atomic_write_text(root / MANIFEST, json.dumps({**manifest, **provenance}, indent=2) + "\n")
    atomic_write_text(root / "build.log", "\n".join(notes.lines) + "\n")
