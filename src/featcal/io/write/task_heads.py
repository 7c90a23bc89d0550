"""Experts whose task heads differ: classifiers trained on different label sets.

Why: merging averages every tensor of the same name, so two classifiers with different label sets (one
reads 'negative, positive', the other 'contradiction, neutral, entailment' padded to the same size, or the
same size with other names) were averaged into one head that is right for neither, silently. Heads are not
merged knowledge but each task's read-out, so:

- the experts' label maps (config.json `id2label`) are compared; when they differ, the run warns;
- the head tensors are found from the architecture: those outside the class's `base_model_prefix` (BERT's
  `classifier.*` outside `bert.`, ViT's outside `vit.`, a causal LM's `lm_head` outside `model.`);
- each task's head is written beside the model, `heads/<task>.safetensors` (its tensors under their own
  names; a single Linear also as `weight` / `bias`, so `featcal calibrate --tune-head` reads it) with
  `heads/<task>.json` (the label map, the tensor names, the architecture);
- the merged model keeps what the method made of the heads (a merge of classifiers with different labels:
  use the per-task files), and the base's label map in its config. docs/outputs.md says so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from featcal.io.read.checkpoint import HEADS_DIR

log = logging.getLogger(__name__)


def label_map(config: Mapping[str, Any]) -> dict[str, str] | None:
    """A config.json's id2label (keys as strings), None when it has none."""
    value = config.get("id2label")
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, Mapping) and value else None


def base_model_prefix(config: Mapping[str, Any]) -> str | None:
    """The architecture's `base_model_prefix` (transformers' class attribute; no model is built), None if the
    config names no class transformers has."""
    import transformers

    for arch in config.get("architectures") or ():
        cls = getattr(transformers, str(arch), None)
        prefix = getattr(cls, "base_model_prefix", None)
        if isinstance(prefix, str) and prefix:
            return prefix
    return None


@dataclass
class HeadPlan:
    """The head tensors and each expert's label map, when the experts' label sets differ."""

    tensors: list[str]
    labels: dict[str, dict[str, str] | None]
    architecture: str | None

    def write(self, directory: Path, experts: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """heads/<task>.safetensors + heads/<task>.json for every expert (read one tensor at a time)."""
        folder = directory / HEADS_DIR
        folder.mkdir(exist_ok=True)
        written = {}
        for task, source in experts.items():
            state = {n: source.get(n).contiguous() for n in self.tensors}
            linear = _as_linear(state)
            save_file(linear if linear is not None else state, str(folder / f"{task}.safetensors"),
                      metadata={"format": "pt"})
            labels = self.labels.get(task)
            meta = {"task": task, "id2label": labels, "tensors": self.tensors, "architecture": self.architecture,
                    "saved_as": "linear head (weight, bias)" if linear is not None else "the model's tensor names"}
            (folder / f"{task}.json").write_text(json.dumps(meta, indent=2) + "\n")
            written[task] = {"file": f"{HEADS_DIR}/{task}.safetensors", "labels": f"{HEADS_DIR}/{task}.json",
                             "tensors": self.tensors, "num_labels": len(labels) if labels else None}
        return written


def _as_linear(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A head that is one Linear (a 2-D weight and its bias) under featcal's LinearHead names."""
    if len(state) != 2:
        return None
    weight = next((t for n, t in state.items() if n.endswith("weight") and t.dim() == 2), None)
    bias = next((t for n, t in state.items() if n.endswith("bias") and t.dim() == 1), None)
    if weight is None or bias is None or bias.shape[0] != weight.shape[0]:
        return None
    return {"weight": weight.float().contiguous(), "bias": bias.float().contiguous()}


def plan_heads(base: Any, experts: Mapping[str, Any], names: list[str]) -> HeadPlan | None:
    """A HeadPlan when the experts' label maps differ (with a warning), else None. `base` / `experts`:
    readers with a `config` dict; `names`: the merged tensor names."""
    labels = {n: label_map(_config(e)) for n, e in experts.items()}
    if len({json.dumps(v, sort_keys=True) for v in labels.values()}) <= 1:
        return None
    config = _config(next(iter(experts.values()))) or _config(base)
    prefix = base_model_prefix(config)
    tensors = [n for n in names if prefix is not None and not n.startswith(prefix + ".")]
    shown = "; ".join(f"{t}: {', '.join(v.values()) if v else 'no labels'}" for t, v in labels.items())
    if not tensors:
        log.warning("the experts' label sets differ (%s), but no head tensors could be told apart from the "
                    "backbone (%s): nothing is written beside the model", shown, config.get("architectures"))
        return None
    log.warning("the experts carry different task heads (label sets %s): the merged model's %s is the method's "
                "merge of them, right for no task; each task's head is written to %s/ with its label map",
                shown, ", ".join(tensors), HEADS_DIR)
    archs = config.get("architectures") or [None]
    return HeadPlan(tensors, labels, archs[0])


def _config(source: Any) -> dict:
    try:
        config = source.config
    except Exception:  # an input without a config.json: nothing to compare
        return {}
    return config if isinstance(config, dict) else {}
