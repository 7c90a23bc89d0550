"""A tiny Llama family with LoRA / PEFT adapter experts whose dense weights are computed by hand.

Holds no tests itself: the LoRA, tuning and adversarial tests share it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.builders.hub import word_tokenizer
from tests.builders.tiny import perturbed, tiny_model

P = "base_model.model."


def write_adapter(directory: Path, tensors: dict, **config) -> Path:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors); `config` overrides the
    defaults (r 4, alpha 8, q_proj and v_proj)."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
           "base_model_name_or_path": "base", "fan_in_fan_out": False, "bias": "none", "task_type": "CAUSAL_LM"}
    cfg.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors",
              metadata={"format": "pt"})
    return directory


def _rand(g, *shape):
    return torch.randn(*shape, generator=g) * 0.1


def lora_family(root: Path) -> tuple[Path, Path, dict[str, Path], dict[str, dict[str, torch.Tensor]]]:
    """A tiny Llama base, one full expert and two adapters, with the experts computed by hand."""
    base_model = tiny_model("llama")
    base = root / "base"
    base_model.save_pretrained(base)
    word_tokenizer([f"w{i}" for i in range(90)], eos=False).save_pretrained(base)  # for featcal calibrate's texts
    b = load_file(base / "model.safetensors")
    full = root / "full"
    perturbed(base_model, 5).save_pretrained(full)
    g = torch.Generator().manual_seed(0)

    # adapter 1: plain LoRA on q_proj and v_proj, r 4, alpha 8 (scale 2), PEFT's layout with the adapter name
    t1, e1 = {}, dict(b)
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            out_f, in_f = b[name].shape
            a, bb = _rand(g, 4, in_f), _rand(g, out_f, 4)
            t1[f"{P}model.layers.{layer}.self_attn.{proj}.lora_A.weight"] = a
            t1[f"{P}model.layers.{layer}.self_attn.{proj}.lora_B.weight"] = bb
            e1[name] = b[name] + 2.0 * bb @ a
    a1 = write_adapter(root / "adapter1", t1)

    # adapter 2: rsLoRA, a rank pattern (gate_proj r 2), fan_in_fan_out factors on gate_proj,
    # LoRA on the embedding and lm_head as a module to save
    t2, e2 = {}, dict(b)
    name = "model.layers.0.mlp.gate_proj.weight"  # (64, 32); with fan_in_fan_out: A (r, 64), B (32, r), ΔW = (BA)^T
    a, bb = _rand(g, 2, 64), _rand(g, 32, 2)
    t2[f"{P}model.layers.0.mlp.gate_proj.lora_A.default.weight"] = a
    t2[f"{P}model.layers.0.mlp.gate_proj.lora_B.default.weight"] = bb
    e2[name] = b[name] + (16 / math.sqrt(2)) * (bb @ a).T
    emb = "model.embed_tokens.weight"  # (100, 32): A (r, 100), B (32, r), ΔW = (BA)^T
    a, bb = _rand(g, 4, 100), _rand(g, 32, 4)
    t2[f"{P}model.embed_tokens.lora_embedding_A"] = a
    t2[f"{P}model.embed_tokens.lora_embedding_B"] = bb
    e2[emb] = b[emb] + (16 / math.sqrt(4)) * (bb @ a).T
    head = _rand(g, 100, 32)
    t2[f"{P}lm_head.weight"] = head
    e2["lm_head.weight"] = head
    a2 = write_adapter(root / "adapter2", t2, r=4, lora_alpha=16, use_rslora=True, rank_pattern={"gate_proj": 2},
                        target_modules=["gate_proj", "embed_tokens"], fan_in_fan_out=True, modules_to_save=["lm_head"])
    experts = {"full": full, "lora1": a1, "lora2": a2}
    by_hand = {"full": load_file(full / "model.safetensors"), "lora1": e1, "lora2": e2}
    return root, base, experts, by_hand


def full_checkpoints(by_hand: dict[str, dict[str, torch.Tensor]], base: Path, root: Path) -> dict[str, str]:
    """The hand-computed experts as full safetensors checkpoints with the base's config, by task."""
    dirs = {}
    for t, sd in by_hand.items():
        d = root / f"full-{t}"
        d.mkdir()
        save_file({k: v.contiguous() for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text((base / "config.json").read_text())
        dirs[t] = str(d)
    return dirs


def token_batches(tasks) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Calibration data for the family: two batches of 4 random 6-token rows per task, seeded by the task."""
    data = {}
    for t in tasks:
        ids = torch.randint(3, 100, (8, 6), generator=torch.Generator().manual_seed(len(t)))
        data[t] = [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]
    return data
