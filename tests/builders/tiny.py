"""Tiny random transformers and expert families for tests: built in temp dirs, seconds on CPU."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

KINDS = ("clip", "vit", "bert", "t5", "llama")


def tiny_config(kind: str):
    if kind == "clip":
        return T.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=16, patch_size=4, num_channels=3,
        )
    if kind == "vit":
        return T.ViTConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=16, patch_size=4, num_channels=3,
        )
    if kind == "bert":
        return T.BertConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64,
        )
    if kind == "t5":
        return T.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
    if kind == "llama":
        return T.LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0):
    cls = {
        "clip": T.CLIPVisionModel, "vit": T.ViTModel, "bert": T.BertModel,
        "t5": T.T5ForConditionalGeneration, "llama": T.LlamaForCausalLM,
    }[kind]
    torch.manual_seed(seed)
    model = cls(tiny_config(kind))
    return model.eval()


def perturbed(model, seed: int, scale: float = 0.05):
    """A fake 'expert': the model with small random task-vector noise on every float parameter."""
    import copy

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))
    return out.eval()


def save(model, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def make_family(kind: str, root: Path, n_experts: int = 3, scale: float = 0.05, seed: int = 0):
    """Save a base and `n_experts` perturbed experts under `root`; return (base_dir, {name: dir})."""
    base = tiny_model(kind, seed)
    base_dir = save(base, root / "base")
    experts = {f"task{i}": save(perturbed(base, seed + 100 + i, scale), root / f"expert{i}") for i in range(n_experts)}
    return base_dir, experts


def sample_inputs(kind: str, batch: int = 2, seq: int = 8, seed: int = 0):
    """A batch that `tiny_model(kind)` accepts, as keyword inputs."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("clip", "vit"):
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    ids = torch.randint(2, 100, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 2 :] = 0  # some padding
    if kind == "t5":
        dec = torch.randint(2, 100, (batch, seq // 2), generator=g)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    return {"input_ids": ids, "attention_mask": mask}


def family_of(model, n: int = 2, scale: float = 0.2):
    """(base, experts, TA merge at 0.3), all in memory: each expert is `model` with noise on every parameter
    (scaled by the tensor's std for matrices, absolute for vectors, so norm weights move too)."""
    import copy

    experts = {}
    for i in range(n):
        e = copy.deepcopy(model)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.dim() > 1 else 1.0))
        experts[f"task{i}"] = e.eval()
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.add_(0.3 * sum(dict(e.named_parameters())[name] - p for e in experts.values()))
    return model.eval(), experts, merged.eval()


SLIDING, GLOBAL = "sliding_attention", "full_attention"


def tiny_gemma3(layer_types=(SLIDING, GLOBAL, SLIDING), seed: int = 0, **kw) -> T.Gemma3ForCausalLM:
    """A random Gemma3ForCausalLM; the window (3) is shorter than the test sequences (8), so the masks differ."""
    fields = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                  layer_types=list(layer_types), max_position_embeddings=64)
    cfg = T.Gemma3TextConfig(**{**fields, **kw})
    torch.manual_seed(seed)
    return T.Gemma3ForCausalLM(cfg).eval()


def tiny_dinov2(seed: int = 0, image_size: int = 16, cls=T.Dinov2Model, **extra):
    """A random Dinov2 (LayerScale on), no two parameters alike."""
    cfg = T.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, patch_size=4,
                         image_size=image_size, layerscale_value=0.5, **extra)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # no two parameters alike (the ONNX exporter deduplicates equal initializers)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def pixel_batch(seed: int, size: int = 16, n: int = 3) -> dict[str, torch.Tensor]:
    """`n` random 3-channel images of `size` pixels, as a model's keyword inputs."""
    return {"pixel_values": torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))}


def padded_ids(batch=2, seq=8, seed=0, vocab=100):
    """Random token ids whose second row ends in three padding positions (attention_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": torch.randint(2, vocab, (batch, seq), generator=g), "attention_mask": mask}


def without_log_lines(err: str) -> str:
    """stderr less the INFO / DEBUG log lines the CLI writes as it works (featcal's manners: logs go to stderr),
    so that tests can hold its error contract, one `featcal: error: ...` line, to what remains."""
    return "\n".join(line for line in err.strip().splitlines() if not line.startswith(("INFO ", "DEBUG ")))
