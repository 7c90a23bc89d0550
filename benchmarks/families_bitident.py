"""Bit-identity check across featcal versions: calibrate tiny seeded families of the model types the
hand-written adapters of featcal 0.1 served, and print the sha256 of each calibrated state dict.

Uses only the public API (featcal.calibrate, FeatCalConfig), so it runs against any checkout:

    PYTHONPATH=/path/to/old/src python benchmarks/families_bitident.py > old.txt
    PYTHONPATH=$PWD/src        python benchmarks/families_bitident.py > new.txt
    diff old.txt new.txt      # empty: the same checkpoints, bit for bit

Each family is calibrated with the default settings and with a few that take other engine paths
(sequential statistics, the one-pass mode, the final and stem norms, the joint bias solve), once more with
base and experts read from checkpoint folders (the front door's path, io/read/family.py), and tuned
(`tune`: the label-free search over the merge's scaling, rho, lambda and alpha, scored by the held-out
drift; `tune_heads`: scored through a callable head reading the model's logits, where it has them).
A version whose `tune` scores causal LMs by next-token agreement (tune_next_token) runs `tune` with it
off, so that the same search is compared; `tune_next_token` is printed where the option exists.
Then every merge method (RegMean and RegMean++ on in-memory batches, WUDI with a few steps) merges saved
checkpoints of a few families (`python benchmarks/families_bitident.py --merges`, or a family name to run
that one only).
"""

from __future__ import annotations

import copy
import hashlib
import sys
import tempfile
from pathlib import Path

import torch
import transformers as T

from featcal import FeatCalConfig, calibrate, merge

torch.set_num_threads(1)
SL, FU = "sliding_attention", "full_attention"
H = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
         max_position_embeddings=64)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=4)
FAMILIES = {
    "clip_vision_model": lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**VISION)),
    "clip": lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        vision_config=VISION, projection_dim=8)),
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(**VISION)),
    "dinov2": lambda: T.Dinov2Model(T.Dinov2Config(**{k: v for k, v in VISION.items() if k != "intermediate_size"},
                                                   mlp_ratio=2)),
    "bert": lambda: T.BertModel(T.BertConfig(**H)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "mt5": lambda: T.MT5ForConditionalGeneration(T.MT5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**H, num_key_value_heads=2)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**H, num_key_value_heads=2, sliding_window=4)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**H, num_key_value_heads=2)),
    "gemma3_text": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **{**H, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=8, sliding_window=3, layer_types=[SL, FU, SL])),
}
SETTINGS = {
    "default": FeatCalConfig(),
    "as_merged": FeatCalConfig(block_statistics="as_merged"),
    "one_pass": FeatCalConfig(block_statistics="sequential_one_pass"),
    "norms": FeatCalConfig(calibrate_final_norm=True, calibrate_stem_norm=True),
    "joint_bias": FeatCalConfig(bias_solve="joint"),
}
HAS_NEXT_TOKEN = "tune_next_token" in FeatCalConfig.model_fields  # featcal versions that score LMs by it
TUNE = dict(tune=True, tune_budget=6.0, **({"tune_next_token": False} if HAS_NEXT_TOKEN else {}))
TUNED = {  # name -> (config, calibrate's keywords); the family's merge is Task Arithmetic at 0.3
    "tune": (FeatCalConfig(**TUNE), {"merge_scaling": 0.3}),
    "tune_heads": (FeatCalConfig(**TUNE), {"heads": "logits"}),
    **({"tune_next_token": (FeatCalConfig(tune=True, tune_budget=6.0), {"merge_scaling": 0.3})} if HAS_NEXT_TOKEN else {}),
}


def family(model: torch.nn.Module, n: int = 2):
    """(base, experts, Task Arithmetic merge at 0.3): seeded noise on every parameter."""
    model.eval()
    experts = {}
    for i in range(n):
        e = copy.deepcopy(model)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.2 * (p.std() if p.dim() > 1 else 1.0))
        experts[f"task{i}"] = e.eval()
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.add_(0.3 * sum(dict(e.named_parameters())[name] - p for e in experts.values()))
    return model, experts, merged.eval()


def data(model: torch.nn.Module, tasks) -> dict:
    out = {}
    for i, t in enumerate(tasks):
        g = torch.Generator().manual_seed(i)
        if model.main_input_name == "pixel_values" or hasattr(model, "vision_model"):
            out[t] = [{"pixel_values": torch.randn(2, 3, 16, 16, generator=g)} for _ in range(2)]
            continue
        batches = []
        for _ in range(2):
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[1, -3:] = 0
            b = {"input_ids": torch.randint(3, 100, (2, 8), generator=g), "attention_mask": mask}
            if model.config.is_encoder_decoder:
                b["decoder_input_ids"] = torch.randint(3, 100, (2, 5), generator=g)
            batches.append(b)
        out[t] = batches
    return out


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def logits_head(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A callable tune head: the model's own logits (a classifier's classes, an LM's tokens)."""
    return model(**batch).logits


def calibrated(out) -> torch.nn.Module:
    """The calibrated model from calibrate's return value: the model itself (older versions) or a result."""
    return out if isinstance(out, torch.nn.Module) else out.model


def state_digest(state: dict) -> str:
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


MERGES = {  # method -> keyword parameters (the bench's settings; WUDI shortened)
    "average": {}, "linear": {}, "task_arithmetic": {"scaling": 0.3}, "ties": {"density": 0.2, "scaling": 1.0},
    "dare_ta": {"drop_rate": 0.5, "scaling": 0.3}, "dare_ties": {"drop_rate": 0.5, "density": 0.2, "scaling": 1.0},
    "regmean": {"alpha": 0.9}, "regmean++": {"alpha": 0.9}, "wudi": {"steps": 5, "lr": 1e-3},
}
MERGED_FAMILIES = ("clip_vision_model", "bert", "llama")


def saved(root: Path, base, experts) -> tuple[Path, dict[str, Path]]:
    base.save_pretrained(root / "base")
    for t, e in experts.items():
        e.save_pretrained(root / t)
    return root / "base", {t: root / t for t in experts}


def main_merges(names: list[str]) -> None:
    for name in names or MERGED_FAMILIES:
        torch.manual_seed(0)
        base, experts, merged = family(FAMILIES[name]())
        batches = data(merged, experts)
        with tempfile.TemporaryDirectory() as tmp:
            base_dir, expert_dirs = saved(Path(tmp), base, experts)
            for method, params in MERGES.items():
                extra = {"calibration": batches} if method.startswith("regmean") else {}
                state = merge(base_dir, expert_dirs, method, progress=False, **params, **extra)
                print(f"{name:18s} merge:{method:16s} {state_digest(state)}", flush=True)


def main(names: list[str]) -> None:
    for name in names or FAMILIES:
        torch.manual_seed(0)
        base, experts, merged = family(FAMILIES[name]())
        batches = data(merged, experts)
        for setting, cfg in SETTINGS.items():
            out = calibrate(merged, base=base, experts=experts, calibration=batches, config=cfg, progress=False)
            print(f"{name:18s} {setting:16s} {digest(calibrated(out))}", flush=True)
        has_logits = hasattr(merged, "lm_head") or hasattr(merged, "classifier")
        for setting, (cfg, extra) in TUNED.items():
            if extra.get("heads") == "logits":
                if not has_logits:
                    continue
                extra = {"heads": {t: logits_head for t in experts}}
            out = calibrate(merged, base=base, experts=experts, calibration=batches, config=cfg, progress=False,
                            **extra)
            print(f"{name:18s} {setting:16s} {digest(calibrated(out))}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:  # base and experts read from their folders, block by block
            base_dir, expert_dirs = saved(Path(tmp), base, experts)
            out = calibrate(merged, base=str(base_dir), experts={t: str(d) for t, d in expert_dirs.items()},
                            calibration=batches, config=FeatCalConfig(), progress=False)
            print(f"{name:18s} {'paths':16s} {digest(calibrated(out))}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--merges"]:
        main_merges(sys.argv[2:])
    else:
        main(sys.argv[1:])
