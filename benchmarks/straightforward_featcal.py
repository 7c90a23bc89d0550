"""FeatCal (docs/method.md §3-§5) for a transformers CLIPVisionModel, written the straightforward way the authors' demo runs it.

It is the independent yardstick of benchmarks/calibration_speed.py: the same method on the same work, with none
of featcal's engineering (no shared Grams, no streamed experts, no cheaper cross moments), so that featcal's
speed can be compared with it and its results checked against it (tests/benchmarks/test_straightforward_featcal.py). It
imports nothing from featcal; torch and the transformers model are all it reads.

The demo's way: every expert in memory, every task's block inputs hm(t) / he(t) in memory; per block, the
merged block (as merged) and expert t's block run with forward hooks recording every Linear / LayerNorm input;
per module and task the teacher input x~ = α·xe + (1−α)·xs is formed, and C, X, the means (float32, dense,
one module at a time) then the float64 solves of docs/method.md §5; the solution is loaded and hm(t) propagated.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

F32, F64 = torch.float32, torch.float64
KV = ("self_attn.k_proj", "self_attn.v_proj")  # every token of theirs feeds the class token


@dataclass(frozen=True)
class Settings:
    """The demo's hyperparameters (docs/method.md §6)."""

    alpha: float = 0.25  # x~ = α·xe + (1−α)·xs
    rho: float = 2.2  # anchor Ā = ρ·θm + (1−ρ)·θ0
    lam: float = 0.05  # ridge λ toward the anchor
    eps: float = 1e-8  # jitter on the Gram diagonal
    cls_weight: float = 0.01  # non-class tokens in the last block (not k/v)
    calibrate_bias: bool = True
    calibrate_layernorm: bool = True


def _vision(model: nn.Module) -> nn.Module:
    return getattr(model, "vision_model", model)  # older transformers wrap the tower in .vision_model


def blocks(model: nn.Module) -> nn.ModuleList:
    return _vision(model).encoder.layers


def stem(model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """The input of block 0: patch + position embeddings, then pre_layrnorm (the stem stays as it is)."""
    v = _vision(model)
    return v.pre_layrnorm(v.embeddings(pixel_values))


def run_block(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    params = inspect.signature(block.forward).parameters
    extra = {"causal_attention_mask": None} if "causal_attention_mask" in params else {}
    out = block(h, None, **extra)  # vision tower: no attention mask
    return out[0] if isinstance(out, tuple) else out


def calibrated(block: nn.Module) -> dict[str, nn.Module]:
    """Every Linear and LayerNorm of the block, by name."""
    return {n: m for n, m in block.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))}


@contextmanager
def recording(mods: Mapping[str, nn.Module]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Forward hooks appending each module's input, one tensor per call."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in mods}
    handles = [m.register_forward_hook(lambda _m, i, _o, n=n: seen[n].append(i[0])) for n, m in mods.items()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def token_weights(x: torch.Tensor, last_block: bool, name: str, s: Settings) -> torch.Tensor:
    """(B, S) weights: 1, or in the last block cls_weight for every token but the class token (k/v excepted)."""
    w = torch.ones(x.shape[:-1], dtype=F32, device=x.device)
    if last_block and name not in KV:
        w[:, 1:] = s.cls_weight
    return w


def _pixels(batch: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    return batch if isinstance(batch, torch.Tensor) else batch["pixel_values"]


def _flat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1, x.shape[-1]).to(F32) for x in xs])


def linear_stats(xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
    """Weighted means over tokens: C = E[xs xsᵀ], X = E[xs x~ᵀ], μs, μ~ (x~ formed explicitly)."""
    xt = alpha * xe + (1 - alpha) * xs
    p = w / w.sum()
    xsp = xs * p[:, None]
    return {"C": xsp.T @ xs, "X": xsp.T @ xt, "mu_s": xsp.sum(0), "mu_t": (xt * p[:, None]).sum(0)}


def norm_stats(mod: nn.LayerNorm, xs: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """m = E[z], e = E[z²] of the normalised (pre-affine) merged input z."""
    z = F.layer_norm(xs, mod.normalized_shape, eps=mod.eps)
    p = w / w.sum()
    return {"m": (z * p[:, None]).sum(0), "e": (z * z * p[:, None]).sum(0)}


def solve_linear(mod: nn.Linear, base: Mapping[str, torch.Tensor], per_task: Sequence[tuple[dict, nn.Linear]],
                 s: Settings) -> dict[str, torch.Tensor]:
    """W from (Σt Ct/st + (λ+ε)I) Wᵀ = Σt (Xt/st) Wtᵀ + λĀᵀ, st = ‖Ct‖_F; then b given W."""
    anchor_w = s.rho * mod.weight.to(F64) + (1 - s.rho) * base["weight"].to(F64)
    a = (s.lam + s.eps) * torch.eye(mod.in_features, dtype=F64, device=anchor_w.device)
    rhs = s.lam * anchor_w.T
    scales = []
    for st_, expert in per_task:
        c = st_["C"].to(F64)
        norm = torch.linalg.matrix_norm(c)
        scales.append(norm)
        a = a + c / norm
        rhs = rhs + (st_["X"].to(F64) / norm) @ expert.weight.to(F64).T
    try:
        w = torch.linalg.solve(a, rhs).T
    except RuntimeError:  # singular: the minimum-norm least-squares solution
        w = (torch.linalg.pinv(a) @ rhs).T
    out = {"weight": w}
    if mod.bias is not None and s.calibrate_bias:
        num = s.lam * (s.rho * mod.bias.to(F64) + (1 - s.rho) * base["bias"].to(F64))
        den = torch.tensor(s.lam, dtype=F64)
        for (st_, expert), norm in zip(per_task, scales, strict=True):
            mu_s, mu_t = st_["mu_s"].to(F64), st_["mu_t"].to(F64)
            num = num + (expert.bias.to(F64) + expert.weight.to(F64) @ mu_t - w @ mu_s) / norm
            den = den + 1 / norm
        out["bias"] = num / den
    return out


def solve_layernorm(mod: nn.LayerNorm, base: Mapping[str, torch.Tensor], per_task: Sequence[tuple[dict, nn.LayerNorm]],
                    s: Settings) -> dict[str, torch.Tensor]:
    """Per channel [Σe+λ, Σm; Σm, T+λ][γ; β] = [Σ(eγt + mβt) + λγ̄; Σ(mγt + βt) + λβ̄]."""
    g_anchor = s.rho * mod.weight.to(F64) + (1 - s.rho) * base["weight"].to(F64)
    b_anchor = s.rho * mod.bias.to(F64) + (1 - s.rho) * base["bias"].to(F64)
    d = g_anchor.shape[0]
    mat = torch.zeros(d, 2, 2, dtype=F64, device=g_anchor.device)
    mat[:, 0, 0] = mat[:, 1, 1] = s.lam
    rhs = torch.stack([s.lam * g_anchor, s.lam * b_anchor], -1)
    for st_, expert in per_task:
        m, e = st_["m"].to(F64), st_["e"].to(F64)
        g_t, b_t = expert.weight.to(F64), expert.bias.to(F64)
        mat[:, 0, 0] += e
        mat[:, 0, 1] += m
        mat[:, 1, 0] += m
        mat[:, 1, 1] += 1.0
        rhs[:, 0] += e * g_t + m * b_t
        rhs[:, 1] += m * g_t + b_t
    sol = torch.linalg.solve(mat, rhs[..., None])[..., 0]
    return {"weight": sol[:, 0], "bias": sol[:, 1]}


@torch.no_grad()
def calibrate(merged: nn.Module, base: nn.Module, experts: Mapping[str, nn.Module],
              calibration: Mapping[str, Sequence[torch.Tensor | Mapping[str, torch.Tensor]]],
              settings: Settings | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Calibrate `merged` IN PLACE toward `experts` ({task: model}, all in memory) and return it.

    calibration: {task: [pixel_values or {"pixel_values": ...}, ...]}; base: the pretrained model (anchors).
    """
    s = settings or Settings()
    tasks = list(experts)
    base_blocks = blocks(base)
    # 1. block-0 inputs of every task, merged side and expert side, all held
    hm = {t: [stem(merged, _pixels(b).to(device)) for b in calibration[t]] for t in tasks}
    he = {t: [stem(experts[t], _pixels(b).to(device)) for b in calibration[t]] for t in tasks}
    n_blocks = len(blocks(merged))
    for layer in range(n_blocks):
        block_m = blocks(merged)[layer]
        mods = calibrated(block_m)
        last = layer == n_blocks - 1
        per_module: dict[str, list[tuple[dict, nn.Module]]] = {n: [] for n in mods}
        for t in tasks:
            block_e = blocks(experts[t])[layer]
            mods_e = calibrated(block_e)
            with recording(mods) as xs_seen:  # the merged block, as merged
                for h in hm[t]:
                    run_block(block_m, h)
            with recording(mods_e) as xe_seen:  # the expert's block, advancing he(t)
                he[t] = [run_block(block_e, h) for h in he[t]]
            for n, mod in mods.items():
                w = torch.cat([token_weights(x, last, n, s).reshape(-1) for x in xs_seen[n]])
                xs = _flat(xs_seen[n])
                if isinstance(mod, nn.Linear):
                    st_ = linear_stats(xs, _flat(xe_seen[n]), w, s.alpha)
                else:
                    st_ = norm_stats(mod, xs, w)
                per_module[n].append((st_, mods_e[n]))
            del xs_seen, xe_seen
        base_mods = calibrated(base_blocks[layer])
        solved: dict[nn.Parameter, torch.Tensor] = {}
        for n, mod in mods.items():
            ref = {k: v.to(device) for k, v in base_mods[n].named_parameters()}
            if isinstance(mod, nn.Linear):
                new = solve_linear(mod, ref, per_module[n], s)
            elif s.calibrate_layernorm:
                new = solve_layernorm(mod, ref, per_module[n], s)
            else:
                continue
            for k, v in new.items():
                solved[getattr(mod, k)] = v
        del per_module
        for p, v in solved.items():  # every solve read the merged values; now load
            p.copy_(v.to(p.dtype))
        hm = {t: [run_block(block_m, h) for h in hm[t]] for t in tasks}  # propagate through the calibrated block
    return merged
