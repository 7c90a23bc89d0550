"""Build (or reuse) a zoo: pretrain a base, fit frozen probe heads, fine-tune one expert per task.

Deterministic for a given (preset, seed). A finished zoo is recognised by its fingerprint and reused;
a build writes into a temporary directory and is renamed into place only when complete.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from featcal.errors import OutputExistsError
from featcal.evaluation.classification import accuracy, fit_linear_probe, pooled_features
from featcal.experiments.zoo.presets import AnyPreset, TextZooPreset, ZooPreset, get_preset
from featcal.experiments.zoo.pretrain import pretrain
from featcal.experiments.zoo.stages import (
    BuildLog,
    l2_norm,
    regime_check,
    state_copy,
    task_vector,
    write_manifest,
)
from featcal.experiments.zoo.store import MANIFEST, Zoo
from featcal.experiments.zoo.tasks import TASKS, make_splits
from featcal.experiments.zoo.text_build import build_text, check_text_inputs
from featcal.experiments.zoo.train import finetune, pixel_values
from featcal.io.read.models import hf_progress_bars, load_model
from featcal.io.write.atomic import atomic_output_dir, check_output_dir, check_replaceable
from featcal.io.write.report import peak_rss_mb

log = logging.getLogger(__name__)


def cached(out: str | os.PathLike, preset: ZooPreset, seed: int) -> Zoo | None:
    """The zoo at `out` if it was built from exactly this preset and seed, else None."""
    path = Path(out) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if manifest.get("fingerprint") != preset.fingerprint(seed):
        return None
    return Zoo.open(out)


def build_zoo(out: str | os.PathLike, preset: str | AnyPreset = "default", seed: int = 0, *,
              overwrite: bool = False, progress: bool = True, base_cache: str | os.PathLike | None = None,
              sources: str | os.PathLike | None = None, on_expert: Callable[[str], None] | None = None) -> Zoo:
    """Return the zoo at `out`, building it first unless an identical one is already there.

    `base_cache` (vision): a directory of pretrained bases keyed by `preset.pretrain_fingerprint(seed)`;
    the pretraining stage (most of the build) is skipped when the key is there, and stored when not.
    `sources` (text): the folder of downloaded text archives (featcal.experiments.zoo.text_sources).
    `progress=False` silences every bar, transformers' loading and saving bars included.
    `on_expert(task)`: called as each expert is trained and saved (a caller's own progress bar counts them).
    """
    with hf_progress_bars(progress):
        return _reuse_or_build(out, get_preset(preset) if isinstance(preset, str) else preset, seed, overwrite,
                               progress, base_cache, sources, on_expert)


def _reuse_or_build(out: str | os.PathLike, p: AnyPreset, seed: int, overwrite: bool, progress: bool,
                    base_cache: str | os.PathLike | None, sources: str | os.PathLike | None,
                    on_expert: Callable[[str], None] | None = None) -> Zoo:
    hit = cached(out, p, seed)
    if hit is not None:
        log.info("zoo %s: reusing the cached build (preset %s, seed %d)", out, p.name, seed)
        return hit
    if (Path(out) / MANIFEST).exists() and not overwrite:
        raise OutputExistsError(
            f"{out} holds a zoo built from another preset, seed or zoo version; pass --overwrite to rebuild it"
        )
    check_output_dir(out, overwrite)
    check_replaceable(out, overwrite, marker=MANIFEST)  # --overwrite replaces a zoo, never a user's folder
    if isinstance(p, TextZooPreset):
        check_text_inputs(sources)  # a missing source is named before the output directory is touched
        with atomic_output_dir(out, overwrite) as tmp:
            build_text(tmp, p, seed, progress, sources, on_expert)
        return Zoo.open(out)
    from featcal.experiments.zoo.vision_presets import VisionRealPreset

    if isinstance(p, VisionRealPreset):  # the real DINOv2-small on real images (vision_build.py)
        from featcal.experiments.zoo.vision_build import build_vision_real, check_vision_inputs

        check_vision_inputs(p, sources)  # a missing source is named before the output directory is touched
        with atomic_output_dir(out, overwrite) as tmp:
            build_vision_real(tmp, p, seed, progress, sources, on_expert)
        return Zoo.open(out)
    with atomic_output_dir(out, overwrite) as tmp:
        _build(tmp, p, seed, progress, Path(base_cache) if base_cache else None, on_expert)
    return Zoo.open(out)


def few_shot(x: np.ndarray, y: np.ndarray, shots: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first `shots` examples of every class, in split order (all of them when `shots` is None)."""
    if shots is None:
        return x, y
    if shots < 1:
        raise ValueError(f"probe_shots must be at least 1, got {shots}")
    keep = np.concatenate([np.flatnonzero(y == c)[:shots] for c in np.unique(y)])
    keep.sort()
    return x[keep], y[keep]


def _save(model, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)


def _pretrained_base(p: ZooPreset, seed: int, progress: bool, cache: Path | None) -> tuple[object, dict, bool]:
    """The pretrained base (from the cache when it holds this key), its metrics, and whether cached."""
    import transformers

    key = cache / f"base-{p.pretrain_fingerprint(seed)}" if cache else None
    if key is not None and (key / "pretrain.json").exists():
        return load_model(key), json.loads((key / "pretrain.json").read_text()), True
    torch.manual_seed(seed)
    base = transformers.CLIPVisionModel(p.model.config())
    metrics = pretrain(base, p.pretrain, seed, progress)
    if key is not None:
        with atomic_output_dir(key, overwrite=True) as tmp:
            _save(base, tmp)
            (tmp / "pretrain.json").write_text(json.dumps(metrics) + "\n")
    return base, metrics, False


def _build(root: Path, p: ZooPreset, seed: int, progress: bool, base_cache: Path | None = None,
           on_expert: Callable[[str], None] | None = None) -> None:
    """Write a complete vision zoo into `root` (an empty temporary directory), stage by stage."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    notes = BuildLog(log)
    _check_tasks(p)

    t = time.perf_counter()
    data, sizes = _write_splits(root, p, seed)
    timings["data"] = time.perf_counter() - t

    t = time.perf_counter()
    base, pre, reused = _pretrained_base(p, seed, progress, base_cache)
    _save(base, root / "base")
    timings["pretrain"] = time.perf_counter() - t
    where = f"reused from {base_cache}" if reused else f"{timings['pretrain']:.0f}s"
    notes.note(f"pretrain: {p.pretrain.steps} steps, final loss {pre['final_loss']:.3f}, "
               f"train accuracy {pre['final_train_accuracy']:.3f} ({where})")

    t = time.perf_counter()
    heads, tests, base_acc = _fit_heads(root, p, base, data)
    timings["probes"] = time.perf_counter() - t

    t = time.perf_counter()
    base_sd = state_copy(base)
    expert_acc, tv_norm, vectors = _finetune_experts(root, p, seed, progress, base, base_sd, heads, data, tests,
                                                   base_acc, notes, on_expert)
    timings["experts"] = time.perf_counter() - t

    s = p.regime_scaling
    ta_acc, regime, ok = regime_check(base, base_sd, vectors, s, lambda m, n: accuracy(m, heads[n], *tests[n]),
                                      base_acc, expert_acc, notes)
    timings["total"] = time.perf_counter() - t0
    notes.note(f"build time {timings['total']:.0f}s, peak RSS {peak_rss_mb():.0f} MiB")

    manifest = {
        "format": "featcal-zoo",
        "preset": p.name,
        "seed": seed,
        "fingerprint": p.fingerprint(seed),
        "architecture": "CLIPVisionModel",
        "model": p.model.__dict__,
        "tasks": {n: {"classes": list(TASKS[n].classes), "real_data": TASKS[n].pool is not None, "sizes": sizes[n],
                      "base_accuracy": base_acc[n], "expert_accuracy": expert_acc[n],
                      f"task_arithmetic_{s}_accuracy": ta_acc[n], "task_vector_relative_norm": tv_norm[n]}
                  for n in p.tasks},
        "regime": {**regime, "ordered": ok},
        "pretrain": {**pre, "reused_from_cache": reused},
    }
    write_manifest(root, manifest, notes, timings)


def _check_tasks(p: ZooPreset) -> None:
    unknown = [t for t in p.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"preset {p.name}: unknown tasks {unknown}")


def _write_splits(root: Path, p: ZooPreset, seed: int) -> tuple[dict, dict[str, dict[str, int]]]:
    """Fixed splits per task, written as uint8 images and labels under data/."""
    (root / "data").mkdir()
    data: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    sizes: dict[str, dict[str, int]] = {}
    for name in p.tasks:
        task = TASKS[name]
        train = p.train
        if task.pool is not None:
            train = min(train, len(task.pool()[1]) - p.calibration - p.test)
        sz = {"train": train, "calibration": p.calibration, "test": p.test}
        data[name] = make_splits(task, sz, seed)
        sizes[name] = sz
        save_file({f"{s}_{k}": torch.from_numpy(np.ascontiguousarray(v)) for s, (x, y) in data[name].items()
                   for k, v in (("images", x), ("labels", y))}, str(root / "data" / f"{name}.safetensors"))
    return data, sizes


def _fit_heads(root: Path, p: ZooPreset, base, data: dict) -> tuple[dict, dict, dict[str, float]]:
    """Linear probes on the base's pooled features (few-shot when the preset says so), then frozen."""
    (root / "heads").mkdir()
    heads, tests, base_acc = {}, {}, {}
    for name in p.tasks:
        x, y = few_shot(*data[name]["train"], p.probe_shots)
        heads[name] = fit_linear_probe(pooled_features(base, pixel_values(x)), y, len(TASKS[name].classes), c=p.probe_c)
        heads[name].save(root / "heads" / f"{name}.safetensors")
        tests[name] = (pixel_values(data[name]["test"][0]), torch.from_numpy(data[name]["test"][1]))
        base_acc[name] = accuracy(base, heads[name], *tests[name])
    return heads, tests, base_acc


def _finetune_experts(root: Path, p: ZooPreset, seed: int, progress: bool, base, base_sd: dict, heads: dict,
                      data: dict, tests: dict, base_acc: dict[str, float], notes: BuildLog,
                      on_expert: Callable[[str], None] | None = None):
    """The full encoder fine-tuned per task through its frozen head; (accuracies, |task vector|s, vectors)."""
    expert_acc, tv_norm, vectors = {}, {}, {}
    base_norm = l2_norm(base_sd.values())
    for i, name in enumerate(p.tasks):
        expert = copy.deepcopy(base)
        x, y = data[name]["train"]
        finetune(expert, heads[name], x, y, p.finetune, seed * 1000 + i, desc=f"expert {name}", progress=progress)
        _save(expert, root / "experts" / name)
        expert_acc[name] = accuracy(expert, heads[name], *tests[name])
        vectors[name] = task_vector(expert, base_sd)
        tv_norm[name] = float(l2_norm(vectors[name].values()) / base_norm)
        notes.note(f"expert {name}: base {base_acc[name]:.3f} -> expert {expert_acc[name]:.3f}, "
                   f"|task vector|/|base| {tv_norm[name]:.4f}")
        if on_expert is not None:
            on_expert(name)
    return expert_acc, tv_norm, vectors
