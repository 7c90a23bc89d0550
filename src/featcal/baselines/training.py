"""What Surgery and ProbSurgery share: feature collection, checks, batch order and the per-task Adam loop.

Both methods freeze the merged backbone and train a small module on its final representation, so
the backbone's features on the calibration set never change during training. They are computed
once here (merged model and expert t on task t's calibration inputs) and the modules are trained on
the cached features: the same optimisation as re-running the frozen backbone every step (the
authors' code does), at a fraction of the cost.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.baselines.inputs import (
    Batch,
    FeatureFn,
    ModelLike,
    calibration_batches,
    load,
    model_device,
    pooled_features,
    to_device,
)
from featcal.errors import CalibrationDataError


def task_generator(seed: int, task: str) -> torch.Generator:
    """A generator per task, so a task's module does not depend on which other tasks are trained."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(task.encode()))


def check_features(
    merged_features: Mapping[str, torch.Tensor], expert_features: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pair each task's merged and expert features, refusing missing tasks and mismatched shapes."""
    if not merged_features:
        raise CalibrationDataError("no tasks: merged_features is empty")
    missing = [t for t in merged_features if t not in expert_features]
    extra = [t for t in expert_features if t not in merged_features]
    if missing or extra:
        raise CalibrationDataError(
            "merged and expert features must cover the same tasks: "
            + (f"no expert features for {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"no merged features for {extra}" if extra else "")
        )
    pairs = {}
    for task, fm in merged_features.items():
        fe = expert_features[task]
        if fm.dim() != 2 or fm.shape != fe.shape:
            raise CalibrationDataError(
                f"task {task!r}: features must both be [N, d]; merged {tuple(fm.shape)}, expert {tuple(fe.shape)}"
            )
        if fm.shape[0] == 0:
            raise CalibrationDataError(f"task {task!r}: no calibration features")
        pairs[task] = (fm.detach().float(), fe.detach().float())
    dims = {f.shape[1] for f, _ in pairs.values()}
    if len(dims) > 1:
        raise CalibrationDataError(f"feature widths differ between tasks: {sorted(dims)}")
    return pairs


def batch_indices(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` index batches drawn without replacement within each pass over the n examples."""
    size = min(batch_size, n)
    order = torch.randperm(n, generator=generator)
    pos = 0
    for _ in range(steps):
        if pos + size > n:
            order, pos = torch.randperm(n, generator=generator), 0
        yield order[pos : pos + size]
        pos += size


def train_module(
    module: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor],
    merged: torch.Tensor,
    expert: torch.Tensor,
    *,
    lr: float,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    desc: str,
) -> list[float]:
    """Adam (betas 0.9, 0.999, no weight decay) on `loss_fn(merged_batch, expert_batch, generator)`.

    Returns the loss of every step, so callers and tests can see the optimisation progress.
    """
    opt = torch.optim.Adam(module.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    history: list[float] = []
    module.train()
    for idx in tqdm(batch_indices(merged.shape[0], batch_size, steps, generator), total=steps, desc=desc, leave=False):
        loss = loss_fn(merged[idx], expert[idx], generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
    module.eval()
    return history


@torch.no_grad()
def collect_features(
    merged: ModelLike,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Batch | list[Batch]],
    feature_fn: FeatureFn | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Features of the merged model and of expert t on task t's calibration inputs, [N_t, d] each."""
    from featcal.merging.sources import open_source

    fn = feature_fn or pooled_features
    batches = calibration_batches(calibration, experts)
    for task, model in experts.items():  # a missing or pickle-only checkpoint fails before any forward
        open_source(model, label=f"expert {task!r}")
    merged_m = load(merged, "merged model").eval()
    merged_out: dict[str, torch.Tensor] = {}
    expert_out: dict[str, torch.Tensor] = {}
    for task, model in experts.items():
        expert_m = load(model, f"expert {task!r}").eval()
        fm, fe = [], []
        for b in tqdm(batches[task], desc=f"features {task}", leave=False):
            fm.append(fn(merged_m, to_device(b, model_device(merged_m))).float().cpu())
            fe.append(fn(expert_m, to_device(b, model_device(expert_m))).float().cpu())
        merged_out[task], expert_out[task] = torch.cat(fm), torch.cat(fe)
    return merged_out, expert_out
