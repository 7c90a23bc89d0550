"""RegMean (Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models")
and RegMean++ (forward-order variant whose Grams come from the merged model's own inputs).

Each Linear weight is the closed-form minimiser of Σ_t ‖X_t W − X_t W_t‖², with the Grams'
off-diagonals shrunk by α:   W = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ  (transposed back to out×in),
G_t = E[x xᵀ] over task t's calibration tokens, G̃_t = α G_t + (1−α) diag(G_t), α = 0.9.
Every other parameter (Linear biases, norms, embeddings, tied heads) is the experts' average, as
in the paper.
- RegMean: G_t from expert t's own activations on task t's data (one full forward per expert).
- RegMean++: blocks in forward order; at block l, G_t is recorded inside expert t's block l fed the
  MERGED model's hidden state, i.e. the output of the already-merged blocks < l on task t's data
  (stem: averaged). Linears outside the blocks (pooler, LM head) use the fully merged model's inputs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.baselines.blocks import find_blocks, run_until, swapped_block
from featcal.baselines.gram import GramAccumulator, RegMeanSums
from featcal.baselines.inputs import (
    Batch,
    ModelLike,
    calibration_batches,
    call_model,
    load_family,
    model_device,
    to_device,
)
from featcal.baselines.linear import as_patterns, linear_modules
from featcal.baselines.params import RegMeanParams
from featcal.config import parse


@torch.no_grad()
def average_state(experts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Mean of the experts' floating-point state (in float64, cast back); integer buffers from the first."""
    states = iter(m.state_dict() for m in experts)
    first = next(states)
    total = {k: v.double().clone() if v.is_floating_point() else v.clone() for k, v in first.items()}
    for sd in states:
        for k, v in sd.items():
            if v.is_floating_point():
                total[k] += v.double()
    n = len(experts)
    return {k: (v / n).to(first[k].dtype) if first[k].is_floating_point() else v for k, v in total.items()}


def _forward_all(model: nn.Module, batches: list[Batch]) -> None:
    device = model_device(model)
    for b in batches:
        call_model(model, to_device(b, device))


@torch.no_grad()
def regmean(
    base: ModelLike,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, Batch | list[Batch]],
    alpha: float = 0.9,
    plus_plus: bool = False,
    exclude: str | Iterable[str] = (),
) -> nn.Module:
    """The RegMean (or RegMean++) merge as a model of the base's class, in eval mode.

    `calibration`: task -> batches (tensor or dict of model kwargs), one entry per expert.
    `exclude`: regexes of Linear module names to average instead of solving.
    """
    params = parse(RegMeanParams, dict(alpha=alpha, plus_plus=plus_plus, exclude=as_patterns(exclude)))
    batches = calibration_batches(calibration, experts)
    base_m, experts_m = load_family(base, experts)
    for m in experts_m.values():
        m.eval()
    names = list(linear_modules(base_m, params.exclude))
    merged = copy.deepcopy(base_m).eval()
    merged.load_state_dict(average_state(list(experts_m.values())))
    if params.plus_plus:
        _regmean_plus_plus(merged, experts_m, batches, names, params.alpha)
    else:
        _regmean_plain(merged, experts_m, batches, names, params.alpha)
    return merged


def _load_solved(merged: nn.Module, sums: Mapping[str, RegMeanSums]) -> None:
    """Write each solved Linear weight into `merged` (unsolvable ones keep the average)."""
    for name, s in sums.items():
        w = s.solve()
        if w is not None:
            target = merged.get_submodule(name).weight
            target.copy_(w.to(target.dtype))


def _regmean_plain(merged, experts, batches, names, alpha) -> None:
    sums = {n: RegMeanSums(alpha) for n in names}
    for task, expert in tqdm(experts.items(), desc="regmean grams", leave=False):
        modules = {n: expert.get_submodule(n) for n in names}
        acc = GramAccumulator()
        with acc.watching(modules):
            _forward_all(expert, batches[task])
        for n in names:
            sums[n].add(acc.mean(n), modules[n].weight)
    _load_solved(merged, sums)


def _regmean_plus_plus(merged, experts, batches, names, alpha) -> None:
    probe = to_device(next(iter(batches.values()))[0], model_device(merged))
    block_names = find_blocks(merged, probe)
    in_block = {b: [n for n in names if n.startswith(b + ".")] for b in block_names}
    for block in tqdm(block_names, desc="regmean++ blocks", leave=False):
        sums = {n: RegMeanSums(alpha) for n in in_block[block]}
        for task, expert in experts.items():
            expert_block = expert.get_submodule(block)
            modules = {n: expert.get_submodule(n) for n in in_block[block]}
            acc = GramAccumulator()
            with swapped_block(merged, block, expert_block), acc.watching(modules):
                for b in batches[task]:
                    run_until(merged, block, to_device(b, model_device(merged)))
            for n, m in modules.items():
                sums[n].add(acc.mean(n), m.weight)
        _load_solved(merged, sums)
    # Linears outside every block: their inputs in the (now fully merged) model.
    outside = [n for n in names if not any(n.startswith(b + ".") for b in block_names)]
    if outside:
        sums = {n: RegMeanSums(alpha) for n in outside}
        for task, expert in experts.items():
            acc = GramAccumulator()
            with acc.watching({n: merged.get_submodule(n) for n in outside}):
                _forward_all(merged, batches[task])
            for n in outside:
                sums[n].add(acc.mean(n), expert.get_submodule(n).weight)
        _load_solved(merged, sums)
