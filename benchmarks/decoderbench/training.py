"""The domain experts' fine-tuning loop. Keyed code: editing this file changes every expert's key
(decoderbench/keys.py, area "train"); the base they start from, the data and the settings are keyed apart.

Next-token loss, AdamW (warm-up, then linear decay to 10 %, gradient clipping 1.0), the last `train_layers`
blocks only (embeddings, tied LM head and final norm stay the base's), `steps` steps of `batch_size`
training windows. Each expert is saved as safetensors with its tokenizer and record.json
(basemodel.save_checkpoint) under a folder named by its key.
"""

from __future__ import annotations

import time


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
