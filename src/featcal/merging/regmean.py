"""RegMean (Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models")
and RegMean++ (forward-order variant whose Grams come from the merged model's own inputs).

Each linear layer's weight (nn.Linear, and transformers' Conv1D read as out×in) is the closed-form minimiser of Σ_t ‖X_t W − X_t W_t‖², with the Grams'
off-diagonals shrunk by α:   W = (Σ_t G̃_t)⁻¹ Σ_t G̃_t W_tᵀ  (transposed back to out×in),
G_t = E[x xᵀ] over task t's calibration tokens, G̃_t = α G_t + (1−α) diag(G_t), α = 0.9. Tokens are
weighted as in FeatCal (padding weighs 0): see featcal.merging.regmean_grams.
Every other parameter (Linear biases, norms, embeddings, tied heads) is the experts' average, as
in the paper.
- RegMean: G_t from expert t's own activations on task t's data (one full forward per expert).
- RegMean++: blocks in forward order; at block l, G_t is recorded inside expert t's block l fed the
  MERGED model's hidden state, i.e. the output of the already-merged blocks < l on task t's data
  (stem: averaged). Linears outside the blocks (pooler, LM head) use the fully merged model's inputs.
  Blocks are found and chained with the FeatCal calibrator's adapter (found from the model's structure,
  blocks/adapters); plain RegMean needs no adapter and works on any model built from linear layers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.blocks.linear import as_patterns, linear_modules, stored_as, weight_of
from featcal.config import parse
from featcal.data.batch import BatchLike
from featcal.data.inputs import (
    ModelLike,
    calibration_batches,
    call_model,
    load,
    model_device,
    to_device,
    validate_family_inputs,
)
from featcal.merging.method_params import RegMeanParams
from featcal.merging.regmean_grams import LinearGrams, RegMeanSums, TokenWeights

ExpertLoader = Callable[[], nn.Module]  # an expert, loaded (or handed over) when its turn comes


class StateMean:
    """Running mean of models' floating-point state (float64 sums); integer buffers from the first."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.n = 0

    @torch.no_grad()
    def add(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if k not in self.total:
                self.dtypes[k] = v.dtype
                self.total[k] = v.double().clone() if v.is_floating_point() else v.clone()
            elif v.is_floating_point():
                self.total[k] += v.double()
        self.n += 1

    def mean(self) -> dict[str, torch.Tensor]:
        return {
            k: (v / self.n).to(self.dtypes[k]) if self.dtypes[k].is_floating_point else v
            for k, v in self.total.items()
        }


def average_state(models: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """The experts' average state: what RegMean gives every parameter it does not solve for."""
    acc = StateMean()
    for m in models:
        acc.add(m)
    return acc.mean()


def _gram_forward(model: nn.Module, batches: list[BatchLike], grams: LinearGrams, modules: Mapping[str, nn.Module],
                  weights: TokenWeights) -> None:
    """Run `model` over `batches`, folding the inputs of `modules` into `grams` with each batch's token weights."""
    device = model_device(model)
    for b in batches:
        b = to_device(b, device)
        with grams.watching(modules, weights.for_batch(b)):
            call_model(model, b)


@torch.no_grad()
def regmean(
    base: ModelLike,
    experts: Mapping[str, ModelLike],
    calibration: Mapping[str, BatchLike | list[BatchLike]],
    alpha: float = 0.9,
    plus_plus: bool = False,
    exclude: str | Iterable[str] = (),
    progress: bool = True,
) -> nn.Module:
    """The RegMean (or RegMean++) merge as a model of the base's class, in eval mode.

    `calibration`: task -> batches (tensor or dict of model kwargs), one entry per expert.
    `exclude`: regexes of Linear module names to average instead of solving.
    """
    params = parse(RegMeanParams, dict(alpha=alpha, exclude=as_patterns(exclude)))
    batches = calibration_batches(calibration, experts)
    validate_family_inputs(base, experts)
    loaders = {t: (lambda m=m, t=t: load(m, f"expert {t!r}")) for t, m in experts.items()}
    return regmean_models(load(base, "base"), loaders, batches, params, plus_plus=plus_plus, progress=progress)


@torch.no_grad()
def regmean_models(
    base: nn.Module,
    experts: Mapping[str, ExpertLoader],
    batches: Mapping[str, list[BatchLike]],
    params: RegMeanParams,
    plus_plus: bool = False,
    progress: bool = True,
) -> nn.Module:
    """RegMean (`plus_plus` False) or RegMean++ on inputs already validated as one family: `experts` are loaded
    when their turn comes (plain RegMean holds one at a time; RegMean++ needs them all). The base is not
    modified."""
    names = list(linear_modules(base, params.exclude))
    merged = copy.deepcopy(base).eval()
    weights = TokenWeights(merged)
    if plus_plus:
        experts_m = {t: load_expert().eval() for t, load_expert in experts.items()}
        merged.load_state_dict(average_state(experts_m.values()))
        _regmean_plus_plus(merged, experts_m, batches, names, params.alpha, weights, progress)
    else:
        _regmean_plain(merged, experts, batches, names, params.alpha, weights, progress)
    return merged


def _load_solved(merged: nn.Module, sums: Mapping[str, RegMeanSums]) -> None:
    """Write each solved Linear weight into `merged` (unsolvable ones keep the average)."""
    for name, s in sums.items():
        w = s.solve()
        if w is not None:
            module = merged.get_submodule(name)
            module.weight.copy_(stored_as(module, w).to(module.weight.dtype))  # a Conv1D's stored in×out


def _regmean_plain(merged, experts, batches, names, alpha, weights, progress) -> None:
    """Experts visited one at a time (a path is loaded, used and dropped): only the sums are kept."""
    sums = {n: RegMeanSums(alpha) for n in names}
    mean = StateMean()
    for task, load_expert in tqdm(experts.items(), desc="regmean grams", leave=False, disable=not progress):
        expert = load_expert().eval()
        modules = {n: expert.get_submodule(n) for n in names}
        grams = LinearGrams()
        _gram_forward(expert, batches[task], grams, modules, weights)
        for n in names:
            sums[n].add(grams.mean(n), weight_of(modules[n]))
        mean.add(expert)
        del expert, modules, grams
    merged.load_state_dict(mean.mean())
    _load_solved(merged, sums)


def _as_dict(batch: BatchLike, main_input: str) -> dict:
    return {main_input: batch} if isinstance(batch, torch.Tensor) else dict(batch)


def _hidden(output):
    """Blocks return a tensor, or a tuple whose first item is it (T5)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _regmean_plus_plus(merged, experts, batches, names, alpha, weights, progress) -> None:
    """Forward order on the merged side's block-input chains, captured and advanced with the FeatCal
    engine's adapter machinery (stack entry, block-0 capture, block-to-block context), so each block
    runs once per batch: O(L) block forwards, like FeatCal itself."""
    from featcal.blocks.adapters import adapter_for

    adapter = adapter_for(merged)
    stacks = adapter.stacks(merged)
    device = model_device(merged)
    main = adapter.main_input(merged, stacks[0])
    data = {t: [to_device(_as_dict(b, main), device) for b in bs] for t, bs in batches.items()}
    upstream: dict[tuple[str, int], torch.Tensor] | None = None
    in_blocks: set[str] = set()
    for stack in stacks:
        blocks = stack.blocks(merged)
        hidden, ctx = {}, {}
        for t, bs in data.items():
            for i, b in enumerate(bs):
                mod, kw = adapter.stack_call(merged, stack, b, None if upstream is None else upstream[(t, i)])
                hidden[(t, i)], ctx[(t, i)] = adapter.capture(mod, stack, merged, kw)
        for layer in tqdm(range(len(blocks)), desc=f"regmean++ {stack.name}", leave=False, disable=not progress):
            prefix = f"{stack.blocks_path}.{layer}."
            block_names = [n for n in names if n.startswith(prefix)]
            in_blocks.update(block_names)
            sums = {n: RegMeanSums(alpha) for n in block_names}
            for t, expert in experts.items():
                modules = {n: expert.get_submodule(n) for n in block_names}
                grams = LinearGrams()
                expert_block = stack.blocks(expert)[layer]
                for i, b in enumerate(data[t]):
                    with grams.watching(modules, weights.for_batch(b)):
                        expert_block(hidden[(t, i)], **adapter.block_kwargs(stack, layer, ctx[(t, i)]))
                for n, m in modules.items():
                    sums[n].add(grams.mean(n), weight_of(m))
            _load_solved(merged, sums)
            for key in hidden:  # advance the merged chains through the merged block
                raw = blocks[layer](hidden[key], **adapter.block_kwargs(stack, layer, ctx[key]))
                hidden[key] = _hidden(raw)
                ctx[key] = adapter.next_context(stack, layer, ctx[key], raw)
        if stack is not stacks[-1]:  # the next stack reads this one's output (an encoder's, through its final norm)
            upstream = {k: adapter.stack_output(merged, stack, h) for k, h in hidden.items()}
    # Linears outside every block: their inputs in the (now fully merged) model.
    outside = [n for n in names if n not in in_blocks]
    if outside:
        sums = {n: RegMeanSums(alpha) for n in outside}
        modules = {n: merged.get_submodule(n) for n in outside}
        for task, expert in experts.items():
            grams = LinearGrams()
            _gram_forward(merged, batches[task], grams, modules, weights)
            for n in outside:
                sums[n].add(grams.mean(n), weight_of(expert.get_submodule(n)))
        _load_solved(merged, sums)
