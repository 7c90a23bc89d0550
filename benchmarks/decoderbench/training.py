"""The base read from its GGUF, and the domain experts fine-tuned from it here (cached by what determines them).

Experts: next-token loss, AdamW (warm-up, then linear decay to 10 %, gradient clipping 1.0), the last
`train_layers` blocks only (embeddings, tied LM head and final norm stay the base's), `steps` steps of
`batch_size` training windows. Each is saved as safetensors with its tokenizer and train.json, through a
temporary folder renamed into place, under a folder named by a hash of every input that determines it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path


def load_base(gguf_path: Path):
    """The base model (featcal.io.gguf: dequantised float32) and its tokenizer, both from the GGUF file."""
    import transformers as T

    from featcal.io.gguf import load_gguf_model

    model = load_gguf_model(gguf_path, "base")
    tokenizer = T.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


def load_tokenizer(gguf_path: Path):
    import transformers as T

    return T.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def save_checkpoint(model, tokenizer, path: Path, record: dict) -> None:
    """model + tokenizer + a JSON record, written through `path`.tmp renamed into place (all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)  # what a killed earlier attempt left: the bench's own temporary folder
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    tmp.rename(path)


def base_checkpoint(base, tokenizer, cache: Path, base_sha: str) -> Path:
    """The dequantised base as a safetensors checkpoint: what `featcal eval --base` reads (it takes no GGUF file).
    Merges and calibrations are given the .gguf itself."""
    path = cache / "base" / f"base-{base_sha[:12]}"
    if not (path / "record.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(base, tokenizer, path, {"from_gguf_sha256": base_sha})
    return path


def expert_key(settings: dict, base_sha: str, domain: str, data_version: int) -> str:
    """A hash of everything that determines an expert (the Python version too, for the stdlib domain)."""
    keep = {k: settings[k] for k in ("seq_len", "batch_size", "steps", "lr", "warmup", "train_layers")}
    keep.update(seed=settings["seed"], base=base_sha, domain=domain, data=data_version,
                python=platform.python_version() if domain == "python" else None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def trainable(model, train_layers: int) -> list:
    """Freeze everything but the last `train_layers` decoder blocks (embeddings, tied head, final norm frozen)."""
    layers = model.model.layers
    k = min(train_layers, len(layers))
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in layers[len(layers) - k:] for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def train_expert(model, windows, *, steps: int, batch_size: int, lr: float, warmup: int, train_layers: int,
                 seed: int) -> dict:
    """Fine-tune `model` in place on `windows` (steps x batch_size rows); returns the loss curve and s/step."""
    import torch

    torch.manual_seed(seed)
    params = trainable(model, train_layers)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, warmup)) * max(0.1, 1 - i / max(1, steps)))
    model.train()
    losses, times = [], []
    for step in range(steps):
        batch = windows[step * batch_size:(step + 1) * batch_size]
        t = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    steady = times[1:] or times
    return {"losses": losses, "s_per_step": round(sum(steady) / len(steady), 3), "train_seconds": round(sum(times), 1)}


def sanity(model, tok, prompt: str = "The capital of France is", new_tokens: int = 4) -> dict:
    """What the loaded base is, and that it computes: finite logits on a short prompt and its greedy continuation."""
    import torch

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        out = ids
        for _ in range(new_tokens):
            out = torch.cat([out, model(input_ids=out).logits[:, -1:].argmax(-1)], dim=1)
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    return {"class": type(model).__name__, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "layer_types": {t: types.count(t) for t in sorted(set(types))},
            "sliding_window": getattr(cfg, "sliding_window", None), "prompt_tokens": int(ids.shape[1]),
            "logits_finite": bool(torch.isfinite(logits).all()),
            "greedy": tok.decode(out[0, ids.shape[1]:].tolist())}
