"""Shared training pieces of the zoo: input normalisation, the LR schedule, expert fine-tuning."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
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
    # the embeddings and the first `frozen_blocks` blocks stay at the base (-1: nothing frozen); read by the text zoo
    frozen_blocks: int = -1
    # text: each run of `length_groups` steps draws its rows at once, sorted by length and cut into batches (each batch
    # as wide as its longest text, as in transformers' group_by_length), in a random order; 0: each step draws its own
    length_groups: int = 0


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


def trainable_parameters(model, frozen_blocks: int, blocks_path: str = "encoder.layer") -> list[torch.nn.Parameter]:
    """The parameters fine-tuning moves, the rest set `requires_grad=False`: with `frozen_blocks` k >= 0 the
    embeddings and blocks 0..k-1 stay at the base, so the backward pass stops at block k (on MiniLM, k = 2 makes a
    step ~30 % cheaper and leaves the task in the upper blocks, where a frozen cosine head reads it); the pooler,
    unused by mean pooling, is never trained."""
    n_blocks = len(model.get_submodule(blocks_path))
    if not -1 <= frozen_blocks < n_blocks:
        raise ValueError(f"frozen_blocks must be -1 (none) to {n_blocks - 1}, got {frozen_blocks}")
    frozen = ("pooler.",)
    if frozen_blocks >= 0:
        frozen += ("embeddings.",) + tuple(f"{blocks_path}.{i}." for i in range(frozen_blocks))
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(frozen))
        if p.requires_grad:
            params.append(p)
    return params


def finetune(model, head: torch.nn.Module, images: np.ndarray, labels: np.ndarray, settings: FinetuneSettings,
             seed: int, desc: str = "fine-tune", progress: bool = True) -> float:
    """Fine-tune the whole encoder in place through a FROZEN head (CLIP's protocol); return last loss."""
    if settings.frozen_blocks != -1:
        raise ValueError("the vision zoos fine-tune the whole encoder (layer_decay moves the lower layers less)")
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
                      batch_loss: Callable[[torch.Tensor], torch.Tensor],
                      lengths: torch.Tensor | None = None) -> float:
    """The fine-tuning loop every zoo shares: `settings.steps` minibatches of `settings.batch_size` rows drawn
    from `n` with `g` (grouped by `lengths` where the settings ask, see `step_rows`), `batch_loss(rows)` minimised
    under the warm-up + cosine schedule with `params`' gradient norm clipped to 1; the model is left in eval mode.
    Returns the last loss."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(settings.warmup, settings.steps))
    model.train()
    loss = torch.zeros(())
    rows = step_rows(n, settings, g, lengths)
    for _ in tqdm(range(settings.steps), desc=desc, disable=not progress, leave=False):
        loss = batch_loss(next(rows))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.item())


def step_rows(n: int, settings: FinetuneSettings, g: torch.Generator,
              lengths: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Each step's rows, drawn with replacement from `n` with `g`. Ungrouped, one draw per step. Grouped
    (`settings.length_groups` k > 0, `lengths` given): k steps' rows drawn at once, sorted by length (stable) and cut
    into k batches taken in a random order, so short texts share batches and a trimmed batch is as wide as its own
    longest text: every row is still a uniform draw, only which rows share a step changes."""
    k = settings.length_groups
    if k > 0 and lengths is None:
        raise ValueError("length_groups needs each example's length")
    while True:
        if k <= 0:
            yield torch.randint(0, n, (settings.batch_size,), generator=g)
            continue
        drawn = torch.randint(0, n, (k * settings.batch_size,), generator=g)
        drawn = drawn[torch.sort(lengths[drawn], stable=True).indices]
        for i in torch.randperm(k, generator=g).tolist():
            yield drawn[i * settings.batch_size:(i + 1) * settings.batch_size]


def few_shot_rows(labels: np.ndarray, n_classes: int, shots: int, unit: str = "example") -> np.ndarray:
    """The first `shots` training rows of every class (the split is already shuffled by the seed)."""
    rows = [np.flatnonzero(labels == c)[:shots] for c in range(n_classes)]
    missing = [c for c, r in enumerate(rows) if len(r) == 0]
    if missing:
        raise ValueError(f"classes {missing} have no training {unit} for the head")
    return np.sort(np.concatenate(rows))
