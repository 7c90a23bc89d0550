"""Build the text zoo: the real all-MiniLM-L6-v2 as base, cosine heads on class prototypes, 8 experts.

Heads come first and stay frozen: each class's prototype is the mean of the base's (mean-pooled,
unit-normalised) embeddings of a few of its training examples, and logits are scale·cos. That is the
form of CLIP's zero-shot heads (text-tower prototypes, logit scale) and about as weak, so fine-tuning
has room to help, as it has on the paper's CLIP experts. Each expert is the whole encoder fine-tuned on
its task through its frozen head, saved as an ordinary HF checkpoint (safetensors + tokenizer).
Deterministic for a (preset, seed): splits, head shots, batch order and dropout all come from the seed.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from featcal.blocks.heads import CosineHead
from featcal.evaluation.classification import accuracy, pooled_features
from featcal.evaluation.features import Inputs, features, num_examples, select
from featcal.experiments.zoo.presets import TextZooPreset
from featcal.experiments.zoo.stages import (
    BuildLog,
    l2_norm,
    regime_check,
    state_copy,
    task_vector,
    write_manifest,
)
from featcal.experiments.zoo.text_sources import (
    MODEL_PACKAGE,
    MODEL_VERSION,
    SOURCES,
    check_sources,
    model_path,
)
from featcal.experiments.zoo.text_tasks import TEXT_TASKS, split_examples, task_examples
from featcal.experiments.zoo.train import few_shot_rows, frozen_head_steps, optimizer, trainable_parameters
from featcal.io.write.report import peak_rss_mb

log = logging.getLogger(__name__)


def check_text_inputs(sources: str | None = None) -> None:
    """Every data archive and the base model package are there and readable (before any work)."""
    check_sources(sources)
    model_path()


def tokenize(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, max_length=max_length, truncation=True, padding="max_length", return_tensors="pt")
    return {"input_ids": enc["input_ids"].to(torch.int32), "attention_mask": enc["attention_mask"].to(torch.int8)}


def as_inputs(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.long() for k, v in stored.items()}


def finetune_text(model, head: torch.nn.Module, inputs: Inputs, labels: torch.Tensor, settings, seed: int,
                  desc: str, progress: bool) -> float:
    """Fine-tune the encoder in place through a FROZEN head (mean pooling), the embeddings and the first
    `settings.frozen_blocks` blocks left at the base; return the last loss."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    for p in head.parameters():
        p.requires_grad_(False)
    params = trainable_parameters(model, settings.frozen_blocks)
    opt = optimizer(params, settings.lr, settings.weight_decay)
    return frozen_head_steps(
        model, opt, params, num_examples(inputs), settings, g, desc, progress,
        lambda idx: torch.nn.functional.cross_entropy(head(features(model, select(inputs, idx), "mean")), labels[idx]),
        lengths=inputs["attention_mask"].sum(1) if settings.length_groups else None,
    )


def build_text(root: Path, p: TextZooPreset, seed: int, progress: bool, sources: str | None = None,
               on_expert: Callable[[str], None] | None = None) -> None:
    """Write a complete text zoo into `root` (an empty temporary directory); `on_expert(task)` after each expert."""
    import transformers

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    notes = BuildLog(log)
    check_text_inputs(sources)
    src = model_path()

    # 1. data: deduplicated, class-capped, seeded disjoint splits, tokenised once
    t = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    (root / "data").mkdir()
    splits: dict[str, dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]]] = {}
    sizes: dict[str, dict[str, int]] = {}
    for name in p.tasks:
        parts = split_examples(task_examples(TEXT_TASKS[name], seed, sources), p.calibration, p.test, p.train, name)
        tensors = {}
        splits[name] = {}
        for split, (texts, labels) in parts.items():
            enc = tokenize(tokenizer, texts, p.max_length)
            y = torch.tensor(labels, dtype=torch.long)
            splits[name][split] = (as_inputs(enc), y)
            tensors.update({f"{split}_{k}": v for k, v in enc.items()})
            tensors[f"{split}_labels"] = y
        sizes[name] = {s: len(parts[s][1]) for s in parts}
        save_file(tensors, str(root / "data" / f"{name}.safetensors"))
    timings["data"] = time.perf_counter() - t

    # 2. base: the pretrained encoder as shipped, re-saved with its tokenizer
    torch.manual_seed(seed)
    base = transformers.BertModel.from_pretrained(src, dtype=torch.float32).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    tokenizer.save_pretrained(root / "base")

    # 3. heads: class prototypes from a few training examples, frozen before any fine-tuning
    t = time.perf_counter()
    (root / "heads").mkdir()
    heads, base_acc = {}, {}
    for name in p.tasks:
        x, y = splits[name]["train"]
        rows = torch.from_numpy(few_shot_rows(y.numpy(), len(TEXT_TASKS[name].classes), p.head_shots))
        feats = pooled_features(base, select(x, rows), pooling="mean")
        heads[name] = CosineHead.from_features(feats, y[rows], len(TEXT_TASKS[name].classes), p.head_scale)
        heads[name].save(root / "heads" / f"{name}.safetensors")
        base_acc[name] = accuracy(base, heads[name], *splits[name]["test"], pooling="mean")
    timings["heads"] = time.perf_counter() - t

    # 4. experts: the whole encoder fine-tuned per task through its frozen head
    t = time.perf_counter()
    expert_acc, tv_norm, vectors = {}, {}, {}
    base_sd = state_copy(base)
    base_norm = l2_norm(base_sd.values())
    for i, name in enumerate(p.tasks):
        expert = copy.deepcopy(base)
        te = time.perf_counter()
        finetune_text(expert, heads[name], *splits[name]["train"], p.finetune, seed * 1000 + i,
                      desc=f"expert {name}", progress=progress)
        train_s = time.perf_counter() - te
        expert.save_pretrained(root / "experts" / name, safe_serialization=True)
        tokenizer.save_pretrained(root / "experts" / name)
        expert_acc[name] = accuracy(expert, heads[name], *splits[name]["test"], pooling="mean")
        vectors[name] = task_vector(expert, base_sd)
        tv_norm[name] = float(l2_norm(vectors[name].values()) / base_norm)
        notes.note(f"expert {name}: base {base_acc[name]:.3f} -> expert {expert_acc[name]:.3f}, "
                   f"|task vector|/|base| {tv_norm[name]:.4f}, {train_s / p.finetune.steps:.2f}s/step")
        del expert
        if on_expert is not None:
            on_expert(name)
    timings["experts"] = time.perf_counter() - t

    # 5. regime check (own in-memory Task Arithmetic; the bench uses featcal.merge)
    s = p.regime_scaling
    ta_acc, regime, ok = regime_check(
        base, base_sd, vectors, s, lambda m, n: accuracy(m, heads[n], *splits[n]["test"], pooling="mean"),
        base_acc, expert_acc, notes,
    )
    timings["total"] = time.perf_counter() - t0
    notes.note(f"build time {timings['total']:.0f}s, peak RSS {peak_rss_mb():.0f} MiB")

    manifest = {
        "format": "featcal-zoo",
        "modality": "text",
        "pooling": "mean",
        "preset": p.name,
        "seed": seed,
        "fingerprint": p.fingerprint(seed),
        "architecture": "BertModel",
        "base_source": f"{MODEL_PACKAGE}=={MODEL_VERSION} (all-MiniLM-L6-v2)",
        "max_length": p.max_length,
        "head": {"kind": "cosine prototypes", "shots_per_class": p.head_shots, "scale": p.head_scale},
        "tasks": {n: {"classes": list(TEXT_TASKS[n].classes), "description": TEXT_TASKS[n].description,
                      "source": SOURCES[TEXT_TASKS[n].source].requirement,
                      "licence": SOURCES[TEXT_TASKS[n].source].licence, "sizes": sizes[n],
                      "base_accuracy": base_acc[n], "expert_accuracy": expert_acc[n],
                      f"task_arithmetic_{s}_accuracy": ta_acc[n], "task_vector_relative_norm": tv_norm[n]}
                  for n in p.tasks},
        "regime": {**regime, "ordered": ok},
        "finetune": p.finetune.__dict__,
    }
    write_manifest(root, manifest, notes, timings)
