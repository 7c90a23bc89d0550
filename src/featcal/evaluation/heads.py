"""Per-task heads of a classifier merge: each task scored through its own expert's head (issue 49.7).

A merge of classifiers whose experts' label maps differ writes each expert's head beside the model,
`heads/<task>.safetensors` with `heads/<task>.json` (its id2label and tensor names; io/write/task_heads.py); the
model's own head is then the method's merge of theirs, right for no task. `featcal calibrate` carries
heads/ on. `featcal eval` scores a model holding heads/ on task T through heads/T (its tensors put in place
of the model's head, its id2label reading the labels); a task with no head there is refused, naming the
heads there are, before any model runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from featcal.errors import CheckpointError, ConfigError
from featcal.io.read.checkpoint import HEADS_DIR

LINEAR = ("weight", "bias")  # how io/write/task_heads.py saves a head that is one Linear


@dataclass(frozen=True)
class TaskHead:
    """One task's head as the merge wrote it: its file, the model tensors it replaces, its label map."""

    task: str
    file: Path
    tensors: tuple[str, ...]
    id2label: dict[int, str] | None

    def state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the model's names (a head saved as `weight` / `bias` mapped back)."""
        from safetensors.torch import load_file

        try:
            saved = load_file(str(self.file))
        except Exception as exc:
            raise CheckpointError(f"cannot read the head of task {self.task!r}, {self.file}: {exc}") from None
        if set(saved) == set(LINEAR) and set(saved) != set(self.tensors):
            names = {end: [n for n in self.tensors if n.endswith(end)] for end in LINEAR}
            if len(self.tensors) != 2 or any(len(v) != 1 for v in names.values()):
                raise CheckpointError(f"{self.file} is a linear head, but {self.file.with_suffix('.json')} names "
                                      f"the tensors {list(self.tensors)}, not one weight and one bias")
            return {names[end][0]: saved[end] for end in LINEAR}
        if set(saved) != set(self.tensors):
            raise CheckpointError(f"{self.file} holds {sorted(saved)}, but {self.file.with_suffix('.json')} names "
                                  f"{list(self.tensors)}")
        return saved

    def label_config(self, config: Any) -> SimpleNamespace:
        """What reads the task's labels: the model's class count with this head's id2label."""
        return SimpleNamespace(num_labels=getattr(config, "num_labels", None), id2label=self.id2label or {})


def task_heads(path: str | Path) -> dict[str, TaskHead] | None:
    """task -> head from `path`/heads/, None when the folder has none."""
    folder = Path(path) / HEADS_DIR
    if not folder.is_dir():
        return None
    heads = {}
    for meta_file in sorted(folder.glob("*.json")):
        heads[meta_file.stem] = _read_head(meta_file)
    return heads or None


def _read_head(meta_file: Path) -> TaskHead:
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {meta_file}: {exc}") from None
    tensors = meta.get("tensors") if isinstance(meta, dict) else None
    file = meta_file.with_suffix(".safetensors")
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) for t in tensors):
        raise CheckpointError(f"{meta_file} names no head tensors (`tensors`): not a head written by featcal merge")
    if not file.is_file():
        raise CheckpointError(f"{meta_file} has no {file.name} beside it: the head of task {meta_file.stem!r} is missing")
    labels = meta.get("id2label")
    if isinstance(labels, Mapping) and any(not str(k).lstrip("-").isdigit() for k in labels):
        odd = next(k for k in labels if not str(k).lstrip("-").isdigit())
        raise CheckpointError(f"{meta_file}: id2label key {odd!r} is no class id (an integer): not a head written by "
                              "featcal merge")
    id2label = {int(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) and labels else None
    return TaskHead(meta_file.stem, file, tuple(tensors), id2label)


def head_for(heads: Mapping[str, TaskHead], task: str, *, model: str, path: Path) -> TaskHead:
    """Task `task`'s head, or a refusal saying why the model's own head will not do and how to name the task."""
    if task in heads:
        return heads[task]
    raise ConfigError(
        f"model {model!r} ({path}) is a merge of classifiers whose label maps differ: its own head is the merge of "
        f"theirs, right for no task, so each task is scored through its expert's head in {HEADS_DIR}/ "
        f"({', '.join(sorted(heads))}), and task {task!r} has none there: name the task after the expert whose head "
        f"reads it (--task {sorted(heads)[0]}=DATA)"
    )


def check_head_shapes(head: TaskHead, path: Path, *, model: str) -> None:
    """Refuse, from the checkpoint's headers, a head whose tensors the model does not have at these shapes, or
    that replaces a tensor of the model's body (inside its `base_model_prefix`): a head is what lies outside it
    (io/write/task_heads.py), and a "head" replacing the embeddings would score another model under this one's name."""
    from featcal.io.read.checkpoint import CheckpointReader
    from featcal.io.write.task_heads import base_model_prefix

    reader = CheckpointReader(path)
    present = set(reader.keys())
    config = reader.config
    body = base_model_prefix(config) if isinstance(config, Mapping) else None
    for name, tensor in sorted(head.state().items()):
        if body and name.startswith(f"{body}."):
            raise CheckpointError(f"model {model!r}: {head.file} replaces {name!r}, a tensor of the model's body "
                                  f"({body}.*), not of its head")
        if name not in present:
            raise CheckpointError(f"model {model!r}: {head.file} replaces tensor {name!r}, which {path} does not hold")
        shape = tuple(reader.meta(name)[0])
        if shape != tuple(tensor.shape):
            raise CheckpointError(f"model {model!r}: {head.file} holds {name!r} of shape {tuple(tensor.shape)}, the "
                                  f"model's is {shape}")


@torch.no_grad()
def apply_head(model: torch.nn.Module, head: TaskHead) -> None:
    """Put `head`'s tensors in place of the model's own (in place: the next task puts its own)."""
    own = model.state_dict()
    for name, tensor in head.state().items():
        if name not in own or tuple(own[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{head.file}: the loaded model has no tensor {name!r} of shape {tuple(tensor.shape)}")
        own[name].copy_(tensor)
