"""RegMean's statistics and its closed-form solve: pure functions plus the per-task Gram collection.

Per Linear and task, G_t = E_w[x xᵀ] over the tokens of task t's calibration data at that Linear's
input, with token weights w: padding (attention_mask 0) weighs 0, exactly as in FeatCal, because both
accumulate with featcal.calibration.maths.statistics.GramSums (here one per Linear, summed in float64) and
both take their token weights from the architecture's FeatCal adapter (`Adapter.module_mask`).
Means rather than sums, as in the reference code, so tasks with more tokens do not outweigh the
others. The merge sums are additive over tasks, so experts are visited one at a time and only
A = Σ_t G̃_t (in×in) and B = Σ_t G̃_t W_tᵀ (in×out) are kept, whatever the number of experts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from featcal.blocks.adapters.base import Adapter
from featcal.blocks.grams import GramSums, WeightFn
from featcal.blocks.structure import Stack
from featcal.data.batch import BatchLike
from featcal.errors import FeatCalError

log = logging.getLogger(__name__)


def scale_off_diagonal(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """G̃ = α·G + (1−α)·diag(G): off-diagonal entries scaled by α, the diagonal kept."""
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram))


def regmean_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W = (A⁻¹ B)ᵀ, with A = Σ G̃_t, B = Σ G̃_t W_tᵀ; pseudo-inverse where A is singular."""
    try:
        chol = torch.linalg.cholesky(a)
        wt = torch.cholesky_solve(b, chol)
    except torch.linalg.LinAlgError:
        wt = torch.linalg.pinv(a, hermitian=True) @ b
    return wt.T


def regmean_weight(grams: list[torch.Tensor], weights: list[torch.Tensor], alpha: float = 0.9) -> torch.Tensor:
    """RegMean of one Linear weight from each task's Gram [in, in] and weight [out, in]."""
    scaled = [scale_off_diagonal(g.double(), alpha) for g in grams]
    a = sum(scaled)
    b = sum(g @ w.double().T for g, w in zip(scaled, weights, strict=True))
    return regmean_solve(a, b).to(weights[0].dtype)


class TokenWeights:
    """Which tokens of a Linear's input count, per batch, from the FeatCal adapter of the architecture.

    - Inside a stack's blocks: the adapter's mask for that module (padding 0; T5 cross-attention k/v:
      the encoder's mask, decoder modules: the decoder's).
    - Outside every block: a pooled input (batch, d) is one token per example and weighs 1; a
      per-token input (an LM head, BERT's MLM transform) takes the last stack's mask.
    - No adapter (an architecture FeatCal does not calibrate): every token weighs 1, and a batch with
      padding is warned about once, since its padding tokens then enter the Grams.
    """

    def __init__(self, model: nn.Module) -> None:
        from featcal.blocks.adapters import adapter_for

        self.adapter: Adapter | None = None
        self.stacks: list[Stack] = []
        try:
            self.adapter = adapter_for(model)
            self.stacks = self.adapter.stacks(model)
        except FeatCalError:
            self.adapter = None
        self._model_name = type(model).__name__
        self._warned = False

    def _locate(self, name: str) -> tuple[Stack, str] | None:
        """(stack, name inside its block) of module `name`, or None outside every block."""
        for stack in self.stacks:
            prefix = stack.blocks_path + "."
            if name.startswith(prefix):
                return stack, name[len(prefix):].partition(".")[2]
        return None

    def for_batch(self, batch: BatchLike) -> WeightFn:
        """(module name, its input x) -> token weights of x (on x's device), or None when all are 1."""
        if not isinstance(batch, Mapping) or self.adapter is None or not self.stacks:
            self._warn_padding(batch)
            return lambda _name, _x: None
        adapter, last = self.adapter, self.stacks[-1]

        def weights(name: str, x: torch.Tensor) -> torch.Tensor | None:
            where = self._locate(name)
            if where is not None:
                return adapter.module_mask(where[0], batch, where[1], x)
            if x.dim() <= 2:  # pooled: one token per example
                return None
            return adapter.module_mask(last, batch, name, x)

        return weights

    def _warn_padding(self, batch: BatchLike) -> None:
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if self._warned or not isinstance(mask, torch.Tensor) or bool(mask.all()):
            return
        self._warned = True
        log.warning(
            "%s has no featcal adapter: RegMean cannot tell its padding tokens apart, so they enter the Grams",
            self._model_name,
        )


class LinearGrams:
    """E_w[x xᵀ] of the inputs of named Linears over one task's batches (one float64 GramSums each)."""

    def __init__(self) -> None:
        self.sums: dict[str, GramSums] = {}

    def add(self, name: str, x: torch.Tensor, w: torch.Tensor | None) -> None:
        g = self.sums.get(name)
        if g is None:
            g = self.sums[name] = GramSums.zeros(x.shape[-1], x.device, torch.float64)
        g.add(x.detach(), w)

    def mean(self, name: str) -> torch.Tensor | None:
        """E_w[x xᵀ] for `name` (float64), or None if the module never saw a token of weight > 0."""
        g = self.sums.get(name)
        moments = None if g is None else g.means()
        return None if moments is None else moments[2]

    @contextmanager
    def watching(self, modules: Mapping[str, nn.Module], weights: WeightFn) -> Iterator[LinearGrams]:
        """Accumulate the inputs of `modules` (name -> Linear), weighted by `weights`, while open."""
        handles = [
            m.register_forward_hook(lambda _m, args, _out, name=name: self.add(name, args[0], weights(name, args[0])))
            for name, m in modules.items()
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


class RegMeanSums:
    """A = Σ_t G̃_t and B = Σ_t G̃_t W_tᵀ for one Linear, accumulated expert by expert."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def add(self, gram: torch.Tensor | None, weight: torch.Tensor) -> None:
        if gram is None:  # the module saw no input for this task: RegMean gives that expert no say
            return
        g = scale_off_diagonal(gram.double(), self.alpha)
        gw = g @ weight.detach().double().T
        self.a = g if self.a is None else self.a + g
        self.b = gw if self.b is None else self.b + gw

    def solve(self) -> torch.Tensor | None:
        """The merged weight [out, in] in float64, or None if no task fed this Linear any input."""
        if self.a is None or not torch.any(self.a):
            return None
        return regmean_solve(self.a, self.b)
