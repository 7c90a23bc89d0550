"""WUDI merging (Cheng et al., 2025, "Whoever Started the Interference Should End It: Guiding
Data-Free Model Merging via Task Vectors", arXiv 2503.08099). Data-free.

For every linear layer's weight (nn.Linear; transformers' Conv1D read as out × in), with task vectors
τ_t = W_t − W_0 (out × in), find
    τ_m = argmin Σ_t (1/‖τ_t‖²_F) ‖(τ_m − τ_t) τ_tᵀ‖²_F
by Adam from τ_m = Σ_t τ_t: the rows of a task vector span (approximately) the inputs that task
feeds the layer, so the interference of τ_m with task t is measured on them without data.
As in the published code: Adam (lr 1e-5, no weight decay), 300 iterations, the whole objective's
gradient each step (here in closed form, `wudi_gradient`: the objective is quadratic); every other tensor (biases, norms, embeddings, tied LM heads) takes the mean task vector.
The result is θ_0 + τ_m.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.blocks.linear import as_patterns, is_conv1d, linear_modules
from featcal.config import parse
from featcal.data.inputs import ModelLike, load_family
from featcal.merging.method_params import WudiParams


def wudi_objective(merged_tv: torch.Tensor, task_vectors: torch.Tensor) -> torch.Tensor:
    """Σ_t ‖(τ_m − τ_t) τ_tᵀ‖²_F / ‖τ_t‖²_F for task_vectors [T, out, in]; a zero τ_t contributes 0."""
    diff = merged_tv.unsqueeze(0) - task_vectors
    product = torch.matmul(diff, task_vectors.transpose(1, 2))
    return (product.pow(2).sum(dim=(1, 2)) * inverse_norm_weights(task_vectors)).sum()


def inverse_norm_weights(task_vectors: torch.Tensor) -> torch.Tensor:
    """1/‖τ_t‖²_F per task vector [T, out, in], 0 for a zero τ_t (it contributes nothing)."""
    norms = task_vectors.flatten(1).pow(2).sum(1)
    return torch.where(norms > 0, 1.0 / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))


def wudi_gradient(task_vectors: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """∂`wudi_objective`/∂τ_m as a closure, in closed form: the objective is quadratic in τ_m, so

        ∇ = 2 Σ_t w_t (τ_m − τ_t) τ_tᵀτ_t = 2 (τ_m A − B),  A = Σ_t w_t τ_tᵀτ_t,  B = Σ_t w_t τ_t τ_tᵀτ_t,

    with w_t = 1/‖τ_t‖²_F. A and B are built once, so an Adam step costs one out·in·in product where
    autograd through the objective costs about 3T of them. They are held in float64 because τ_m A and B
    nearly cancel where the task vectors barely interfere (the case WUDI is for): the difference is the
    gradient. Where in > 2T·out the per-task form 2 Σ_t w_t ((τ_m − τ_t) τ_tᵀ) τ_t (2T·out·out·in) is cheaper
    and has no such cancellation; it runs in the task vectors' dtype.
    """
    weights = inverse_norm_weights(task_vectors)
    n_tasks, out_dim, in_dim = task_vectors.shape
    if in_dim > 2 * n_tasks * out_dim:
        scaled = task_vectors * weights.view(-1, 1, 1)

        def per_task(merged: torch.Tensor) -> torch.Tensor:
            diff = merged.unsqueeze(0) - task_vectors
            return torch.matmul(torch.matmul(diff, task_vectors.transpose(1, 2)), scaled).sum(0).mul_(2.0)

        return per_task
    wide = task_vectors.to(torch.float64)
    grams = torch.matmul(wide.transpose(1, 2), wide).mul_(weights.to(torch.float64).view(-1, 1, 1))  # w_t τ_tᵀτ_t
    a = grams.sum(0)
    b = torch.matmul(wide, grams).sum(0)
    del wide, grams

    def closed_form(merged: torch.Tensor) -> torch.Tensor:
        return (merged.to(torch.float64) @ a).sub_(b).mul_(2.0).to(merged.dtype)

    return closed_form


def wudi_layer(task_vectors: torch.Tensor, steps: int = 300, lr: float = 1e-5) -> torch.Tensor:
    """The merged task vector of one Linear weight: Adam on `wudi_objective` from Σ_t τ_t, each step's
    gradient from `wudi_gradient` (the published code differentiates the objective; the same gradient)."""
    tvs = task_vectors.detach()
    merged = torch.nn.Parameter(tvs.sum(0).clone())
    if steps:
        gradient = wudi_gradient(tvs)
        opt = torch.optim.Adam([merged], lr=lr, weight_decay=0.0)
        for _ in range(steps):
            merged.grad = gradient(merged.detach())
            opt.step()
    return merged.detach()


@torch.no_grad()
def wudi(
    base: ModelLike,
    experts: Mapping[str, ModelLike],
    steps: int = 300,
    lr: float = 1e-5,
    seed: int = 0,
    device: str = "cpu",
    exclude: str | Iterable[str] = (),
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Merged state dict (the base's keys). `exclude`: regexes of Linear module names to average instead.

    Deterministic: the method draws no random numbers (`seed` is accepted for a uniform API).
    """
    params = parse(WudiParams, dict(steps=steps, lr=lr, seed=seed, device=device, exclude=as_patterns(exclude)))
    base_m, experts_m = load_family(base, experts)
    return wudi_models(base_m, experts_m, params, progress=progress)


@torch.no_grad()
def wudi_models(
    base: nn.Module, experts: Mapping[str, nn.Module], params: WudiParams, progress: bool = True
) -> dict[str, torch.Tensor]:
    """WUDI on models already validated as one family; returns the merged state dict (base's keys)."""
    # linear weights solved as out×in: a Conv1D's (stored in×out) transposed in and back out
    linear_weights = {f"{n}.weight": m for n, m in linear_modules(base, params.exclude).items()}
    base_sd = base.state_dict()
    expert_sds = [m.state_dict() for m in experts.values()]
    merged: dict[str, torch.Tensor] = {}
    for name, w0 in tqdm(base_sd.items(), desc="wudi", leave=False, disable=not progress):
        if not w0.is_floating_point():
            merged[name] = w0.clone()
            continue
        tvs = torch.stack([sd[name].to(params.device, torch.float32) - w0.to(params.device, torch.float32)
                           for sd in expert_sds])
        if name in linear_weights:
            conv = is_conv1d(linear_weights[name])  # task vectors stored in×out: solved as out×in
            tau = wudi_layer(tvs.transpose(1, 2) if conv else tvs, params.steps, params.lr)
            tau = tau.T if conv else tau
        else:
            tau = tvs.mean(0)
        merged[name] = (w0.float() + tau.cpu()).to(w0.dtype)
    return merged
