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
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.data.batch import BatchLike
from featcal.data.inputs import (
    FeatureFn,
    ModelLike,
    batch_size,
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


@dataclass
class TaskData:
    """One task's training data for a surgery module: `sample(idx)` -> (merged, expert) features [b, d]."""

    n: int
    dim: int
    sample: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def cached_task_data(
    merged_features: Mapping[str, torch.Tensor], expert_features: Mapping[str, torch.Tensor]
) -> dict[str, TaskData]:
    """Training data served from precomputed features (the default: the backbone is frozen)."""
    pairs = check_features(merged_features, expert_features)
    return {
        t: TaskData(fm.shape[0], fm.shape[1], lambda idx, fm=fm, fe=fe: (fm[idx], fe[idx]))
        for t, (fm, fe) in pairs.items()
    }


def _concat(batches: list[BatchLike], task: str) -> BatchLike:
    """One batch holding every calibration example of a task (what live sampling slices)."""
    try:
        if isinstance(batches[0], torch.Tensor):
            return torch.cat(batches)
        return {k: torch.cat([b[k] for b in batches]) if isinstance(v, torch.Tensor) else v
                for k, v in batches[0].items()}
    except (RuntimeError, KeyError, TypeError) as exc:
        raise CalibrationDataError(
            f"task {task!r}: calibration batches cannot be joined for live feature recomputation ({exc}); "
            "pad them to one shape or use cached features"
        ) from None


def _slice(batch: BatchLike, idx: torch.Tensor) -> BatchLike:
    if isinstance(batch, torch.Tensor):
        return batch[idx]
    return {k: v[idx] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}


def live_task_data(
    merged: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration: Mapping[str, list[BatchLike]],
    feature_fn: FeatureFn,
) -> dict[str, TaskData]:
    """Training data recomputed every step by the frozen merged model and expert t, as the authors' code
    does: the same optimisation as the cached features, at the published method's real cost."""
    out = {}
    for task, expert in experts.items():
        examples = _concat(calibration[task], task)

        @torch.no_grad()
        def sample(idx, examples=examples, expert=expert):
            sub = _slice(examples, idx)
            fm = feature_fn(merged, to_device(sub, model_device(merged))).float().cpu()
            fe = feature_fn(expert, to_device(sub, model_device(expert))).float().cpu()
            return fm, fe

        n = sum(batch_size(b) for b in calibration[task])
        probe_m, probe_e = sample(torch.arange(1))
        if probe_m.shape != probe_e.shape or probe_m.dim() != 2:
            raise CalibrationDataError(
                f"task {task!r}: features must both be [N, d]; merged {tuple(probe_m.shape)}, expert {tuple(probe_e.shape)}"
            )
        out[task] = TaskData(n, probe_m.shape[1], sample)
    return out


def train_module(
    module: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor],
    data: TaskData,
    *,
    lr: float,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    desc: str,
    progress: bool = True,
) -> list[float]:
    """Adam (betas 0.9, 0.999, no weight decay) on `loss_fn(merged_batch, expert_batch, generator)`.

    Returns the loss of every step, so callers and tests can see the optimisation progress.
    """
    opt = torch.optim.Adam(module.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    history: list[float] = []
    module.train()
    for idx in tqdm(batch_indices(data.n, batch_size, steps, generator), total=steps, desc=desc, leave=False,
                    disable=not progress):
        merged, expert = data.sample(idx)
        loss = loss_fn(merged, expert, generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
    module.eval()
    return history


def fit_modules(
    data: Mapping[str, TaskData],
    make_module: Callable[[int, torch.Generator], nn.Module],
    make_loss: Callable[[nn.Module], Callable],
    *,
    lr: float,
    steps: int,
    batch_size: int,
    seed: int,
    desc: str,
    progress: bool = True,
) -> tuple[dict[str, nn.Module], dict[str, list[float]]]:
    """One module per task, each with its own generator (init, batch order, noise): see task_generator."""
    if not data:
        raise CalibrationDataError("no tasks to train surgery modules for")
    modules, history = {}, {}
    for task, d in data.items():
        g = task_generator(seed, task)
        module = make_module(d.dim, g)
        history[task] = train_module(
            module, make_loss(module), d, lr=lr, steps=steps, batch_size=batch_size, generator=g, desc=f"{desc} {task}",
            progress=progress,
        )
        modules[task] = module
    return modules, history


@torch.no_grad()
def collect_features(
    merged: ModelLike,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, BatchLike | list[BatchLike]],
    feature_fn: FeatureFn | None = None,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Features of the merged model and of expert t on task t's calibration inputs, [N_t, d] each."""
    from featcal.io.read.family import open_input

    fn = feature_fn or pooled_features
    batches = calibration_batches(calibration, experts)
    for task, model in experts.items():  # a missing or pickle-only checkpoint fails before any forward
        open_input(model, label=f"expert {task!r}")
    merged_m = load(merged, "merged model").eval()
    merged_out: dict[str, torch.Tensor] = {}
    expert_out: dict[str, torch.Tensor] = {}
    for task, model in experts.items():
        expert_m = load(model, f"expert {task!r}").eval()
        fm, fe = [], []
        for b in tqdm(batches[task], desc=f"features {task}", leave=False, disable=not progress):
            fm.append(fn(merged_m, to_device(b, model_device(merged_m))).float().cpu())
            fe.append(fn(expert_m, to_device(b, model_device(expert_m))).float().cpu())
        merged_out[task], expert_out[task] = torch.cat(fm), torch.cat(fe)
    return merged_out, expert_out
