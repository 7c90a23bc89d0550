"""Which modules are norms FeatCal can solve, found by what they compute rather than by class name.

A norm is solved per channel from the moments of its normalised input z (docs/method.md §5), so FeatCal must know
z exactly and how the weight is applied to it. `nn.LayerNorm` says so itself. Any other module is probed:
a leaf module whose parameters are a 1-D `weight` (and optionally a 1-D `bias`) is run once, on the CPU, on
a random input with a random weight put in its place (`torch.func.functional_call`: the module's own
weights, wherever they live, are neither read nor touched), and its output is compared with

    y = z · (c + w) + b,    z = x / sqrt(mean(x²) + ε)  (RMS type)  or  (x − mean) / sqrt(var + ε)  (centred)

for a constant c found from the probe and an ε among the module's own float attributes (ε matters only for
small inputs, so a second, tiny input checks it). Llama-style RMS norms (c = 0), the Gemma family's
z·(1 + w) (c = 1), T5's and Qwen3's / OLMo's q/k norms all fit; a module that fits no form is not a norm
FeatCal solves and keeps its merged value. Probing on the meta device works too (the probe runs on CPU
tensors), so the support check needs no weights.

Why the solve needs no conversion for c ≠ 0: the per-channel RMS solve γ = (Σt et γt + λ γ̄)/(Σt et + λ) is an
affine blend whose coefficients sum to 1, and so is the anchor ρ·θm + (1−ρ)·θ0; solving on the stored w gives
exactly the w whose c + w is the solve on γ = c + w (tests/blocks/test_gemma3.py checks it). Only z depends on the form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_PROBE_TOKENS = 6
_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class NormForm:
    """How a norm computes: y = z·(offset + w) + b, z centred (LayerNorm) or not (RMS), with its ε."""

    centred: bool
    eps: float
    offset: float = 0.0
    bias: bool = False

    @property
    def kind(self) -> str:
        """The calibrated-module kind: "layernorm" (centred) or "rmsnorm"."""
        return "layernorm" if self.centred else "rmsnorm"


_CACHE: dict[tuple, NormForm | None] = {}


def norm_form(module: nn.Module) -> NormForm | None:
    """The module's NormForm, or None when it is no norm with a weight FeatCal can solve."""
    if isinstance(module, nn.LayerNorm):
        if not module.elementwise_affine or module.weight is None:
            return None
        return NormForm(True, float(module.eps), 0.0, module.bias is not None)
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"} or next(module.children(), None):
        return None
    bias = params.get("bias")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape):
        return None
    eps_values = _float_attributes(module)
    key = (type(module), int(weight.numel()), bias is not None, eps_values)
    if key not in _CACHE:
        _CACHE[key] = _probe(module, int(weight.numel()), bias is not None, eps_values)
    return _CACHE[key]


def normalise(module: nn.Module, x: torch.Tensor, form: NormForm | None = None) -> torch.Tensor:
    """A norm's input without its affine (float32): what its weight multiplies."""
    form = form if form is not None else norm_form(module)
    if form is None:
        raise ValueError(f"{type(module).__name__} is not a norm featcal calibrates")
    xf = x.float()
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(xf, module.normalized_shape, eps=module.eps)
    return _normalised(xf, form.centred, form.eps)


def _normalised(x: torch.Tensor, centred: bool, eps: float) -> torch.Tensor:
    if centred:
        return F.layer_norm(x, (x.shape[-1],), eps=eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _float_attributes(module: nn.Module) -> tuple[float, ...]:
    """The module's own small positive float attributes: where a norm keeps its ε."""
    return tuple(sorted({float(v) for v in vars(module).values()
                         if isinstance(v, float) and not isinstance(v, bool) and 0.0 < v < 0.1}))


def _probe(module: nn.Module, d: int, has_bias: bool, eps_values: tuple[float, ...]) -> NormForm | None:
    """Run the module on random CPU inputs with a random weight in place; the form it fits, if any."""
    from torch.func import functional_call

    g = torch.Generator().manual_seed(0)
    w = torch.randn(d, generator=g)
    b = torch.randn(d, generator=g) if has_bias else None
    x = torch.randn(2, _PROBE_TOKENS, d, generator=g) + 0.5  # a non-zero mean tells centred from RMS
    tiny = x * 1e-3  # mean(x²) ~ 1e-6: ε decides the output
    params = {"weight": w, **({"bias": b} if b is not None else {})}
    try:
        with torch.no_grad():
            y, y_tiny = (functional_call(module, params, (t,)) for t in (x, tiny))
    except Exception:  # not callable on one tensor: no norm of ours
        return None
    if not (isinstance(y, torch.Tensor) and y.shape == x.shape and isinstance(y_tiny, torch.Tensor)):
        return None
    y, y_tiny = y.float(), y_tiny.float()
    shift = b if b is not None else torch.zeros(d)
    for centred in (False, True):
        for eps in eps_values:
            z = _normalised(x, centred, eps)
            offset = _offset(y - shift, z, w)
            if offset is None:
                continue
            scale = offset + w
            if torch.allclose(y, z * scale + shift, **_TOLERANCE) and torch.allclose(
                    y_tiny, _normalised(tiny, centred, eps) * scale + shift, **_TOLERANCE):
                return NormForm(centred, eps, offset, has_bias)
    return None


def _offset(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> float | None:
    """The constant c with y = z·(c + w), read where z is large, or None when no constant fits."""
    big = z.abs() > 0.5
    if not bool(big.any()):
        return None
    c = (y / torch.where(big, z, torch.ones_like(z)) - w)[big]
    value = float(c.median())
    return round(value, 6) if torch.allclose(c, torch.full_like(c, value), rtol=0, atol=1e-3) else None
