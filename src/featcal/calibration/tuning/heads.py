"""What a tune request may score with, checked before any work: task heads, the merge's scaling, tie-breaks."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from featcal.blocks.heads import load_head
from featcal.calibration.maths.distributed import current_group
from featcal.calibration.tuning.features import Head
from featcal.calibration.tuning.search import MAX_MERGE_SCALING
from featcal.config import FeatCalConfig
from featcal.errors import CheckpointError, ConfigError


def check_request(config: FeatCalConfig, base: Any, experts: Mapping[str, Any], heads: Mapping[str, Head] | None,
                  merge_scaling: float | None) -> None:
    """Everything about a tune request that can be refused before any work (the model unopened: whether it
    has an LM head for tune_next_token is checked once it is, `check_soft_tiebreak`)."""
    if heads is not None:
        _check_heads(heads, experts)
    if config.tune and config.tune_tiebreak == "soft" and not config.tune_next_token:
        check_soft_tiebreak(heads or {}, experts, "give heads or use tune_tiebreak 'drift'")
    if not config.tune:
        if heads:
            raise ConfigError("heads are used only to score candidates when tune=True")
        if merge_scaling is not None:
            raise ConfigError("merge_scaling is used only to search the starting merge when tune=True")
        return
    if merge_scaling is not None:
        if isinstance(merge_scaling, bool) or not isinstance(merge_scaling, (int, float)) or not (
            0 < merge_scaling <= MAX_MERGE_SCALING
        ):
            raise ConfigError(f"merge_scaling must be a number in (0, {MAX_MERGE_SCALING:g}], got {merge_scaling!r}")
        if base is None:
            raise ConfigError("merge_scaling needs the base model (base=): the merge is rebuilt from it")
    if current_group().active:
        raise ConfigError("tune runs in one process; run it without torchrun (the refit alone can be distributed "
                          "by passing the chosen values)")


def _check_heads(heads: Any, experts: Mapping[str, Any]) -> None:
    if not isinstance(heads, Mapping):
        raise ConfigError(f"heads must map task names to heads, not {type(heads).__name__}")
    unknown = [t for t in heads if t not in experts]
    if unknown:
        raise ConfigError(f"heads given for unknown task(s) {unknown} (tasks are {list(experts)})")
    bad = [t for t, h in heads.items() if not callable(h)]
    if bad:
        raise ConfigError(f"head(s) of task(s) {bad} are neither an nn.Module nor a callable head(model, batch)")


def check_soft_tiebreak(heads: Mapping[str, Any], experts: Iterable[str], fix: str) -> None:
    """tune_tiebreak 'soft' compares predictions' softmax: every task needs a head (or the LM head)."""
    missing = sorted(t for t in experts if t not in heads)
    if missing:
        raise ConfigError(f"tune_tiebreak 'soft' compares the heads' outputs: it needs a head for every task "
                          f"(none for {missing}); {fix}")


def load_heads(paths: Mapping[str, str | os.PathLike], tasks: Iterable[str], tune: bool,
               width: int | None = None) -> dict[str, nn.Module]:
    """Heads saved by featcal (LinearHead / CosineHead safetensors) for `featcal calibrate --tune-head` and
    a run file's `calibrate.heads`; refused in one line before any work (unknown task, no tune, bad file, no
    class, NaN / Inf, or, given the model's feature `width`, another input width: found otherwise only once
    the search has run its first candidate)."""
    if not paths:
        return {}
    if not tune:
        raise ConfigError("heads are used only to score candidates with --tune (tune: true)")
    tasks = list(tasks)
    unknown = [t for t in paths if t not in tasks]
    if unknown:
        raise ConfigError(f"head(s) given for unknown task(s) {unknown} (tasks are {tasks})")
    heads = {}
    for t, p in paths.items():
        try:
            with warnings.catch_warnings():  # torch warns of a zero-class head, which _check_head refuses below
                warnings.simplefilter("ignore", UserWarning)
                heads[t] = load_head(p)
        except CheckpointError as exc:
            raise CheckpointError(f"head of task {t!r}: {exc}") from None
        except Exception as exc:  # a file that is not safetensors at all
            raise CheckpointError(f"head of task {t!r}: cannot read {p}: {exc}") from None
        _check_head(f"head of task {t!r} ({p})", heads[t], width)
    return heads


def _check_head(label: str, head: nn.Module, width: int | None) -> None:
    """At least one class, finite values, and (when known) the input width of the model's pooled features."""
    matrix = next((v for v in head.state_dict().values() if v.dim() == 2), None)
    if matrix is None or matrix.shape[0] < 1:
        raise CheckpointError(f"{label}: it has no class (a {tuple(matrix.shape) if matrix is not None else 'missing'} "
                              "weight); a head scores at least one")
    values = [*head.state_dict().values(), torch.tensor([float(getattr(head, "scale", 1.0))])]
    if not all(bool(torch.isfinite(v.float()).all()) for v in values):
        raise CheckpointError(f"{label}: it holds NaN or Inf values")
    if width is not None and matrix.shape[1] != width:
        raise CheckpointError(f"{label}: it reads {matrix.shape[1]} features but the model's pooled output has {width}")
