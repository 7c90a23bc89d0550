"""Shared training pieces of the zoo: input normalisation, the LR schedule, expert fine-tuning."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm


def pixel_values(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 (N, H, W, 3) images -> float pixel_values (N, 3, H, W) in [-1, 1], as the models expect."""
    t = torch.as_tensor(images)
    return t.permute(0, 3, 1, 2).float().div(127.5).sub(1.0).contiguous()


def schedule(warmup: int, steps: int) -> Callable[[int], float]:
    """Linear warm-up then cosine decay to zero, as a LambdaLR multiplier."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

    return f


@dataclass(frozen=True)
class FinetuneSettings:
    steps: int
    batch_size: int
    lr: float
    weight_decay: float = 0.0
    warmup: int = 20
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9)
    layer_decay: float = 1.0  # layer-wise LR decay: block l of L gets lr·decay^(L-l), the stem lr·decay^(L+1)


def optimizer(params: list, lr: float, weight_decay: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """The zoos' optimizer over `params` (tensors or parameter groups), on torch's multi-tensor (foreach) kernels:
    the same arithmetic as its per-tensor loop, bit for bit (tests/experiments/test_zoo_training.py), which is
    torch's default off CUDA; on MiniLM's 22M parameters an AdamW step takes 0.09 s instead of 0.12 s on 2 cores."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"unknown optimizer {kind!r}")


def layer_groups(model, lr: float, decay: float) -> list[dict]:
    """Optimizer parameter groups with layer-wise LR decay (the usual ViT fine-tuning recipe): lower
    layers, and most of all the embeddings, move less, so a task's skill sits in the blocks."""
    n_layers = model.config.num_hidden_layers
    groups: dict[int, list] = {}
    for name, p in model.named_parameters():
        if name.startswith(("embeddings.", "pre_layrnorm.")):
            depth = 0
        elif name.startswith("encoder.layers."):
            depth = int(name.split(".")[2]) + 1
        else:  # post_layernorm and anything above the blocks
            depth = n_layers + 1
        groups.setdefault(depth, []).append(p)
    return [{"params": ps, "lr": lr * decay ** (n_layers + 1 - d)} for d, ps in sorted(groups.items())]


def finetune(model, head: torch.nn.Module, images: np.ndarray, labels: np.ndarray, settings: FinetuneSettings,
             seed: int, desc: str = "fine-tune", progress: bool = True) -> float:
    """Fine-tune the whole encoder in place through a FROZEN head (CLIP's protocol); return last loss."""
    x, y = pixel_values(images), torch.from_numpy(labels)
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.requires_grad_(False)
    opt = optimizer(layer_groups(model, settings.lr, settings.layer_decay), settings.lr, settings.weight_decay,
                    settings.optimizer)
    return frozen_head_steps(
        model, opt, list(model.parameters()), len(x), settings, g, desc, progress,
        lambda idx: torch.nn.functional.cross_entropy(head(model(pixel_values=x[idx]).pooler_output), y[idx]),
    )


def frozen_head_steps(model, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], n: int,
                      settings: FinetuneSettings, g: torch.Generator, desc: str, progress: bool,
                      batch_loss: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The fine-tuning loop every zoo shares: `settings.steps` minibatches of `settings.batch_size` rows drawn
    from `n` with `g`, `batch_loss(rows)` minimised under the warm-up + cosine schedule with `params`' gradient
    norm clipped to 1; the model is left in eval mode. Returns the last loss."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(settings.warmup, settings.steps))
    model.train()
    loss = torch.zeros(())
    for _ in tqdm(range(settings.steps), desc=desc, disable=not progress, leave=False):
        idx = torch.randint(0, n, (settings.batch_size,), generator=g)
        loss = batch_loss(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.item())


def few_shot_rows(labels: np.ndarray, n_classes: int, shots: int, unit: str = "example") -> np.ndarray:
    """The first `shots` training rows of every class (the split is already shuffled by the seed)."""
    rows = [np.flatnonzero(labels == c)[:shots] for c in range(n_classes)]
    missing = [c for c, r in enumerate(rows) if len(r) == 0]
    if missing:
        raise ValueError(f"classes {missing} have no training {unit} for the head")
    return np.sort(np.concatenate(rows))
