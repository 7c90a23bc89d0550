"""A dense, literal FeatCal (docs/method.md §3-§5) for tests: every activation kept, x~ formed explicitly, float64.

Deliberately naive and independent of featcal's engine/statistics/solver: it shares only the adapters'
model knowledge (where the blocks are, how to reach block 0 and what each block is called with, masks, which
modules are norms and with which ε). Experts are in-memory models. Linear weights are handled as out×in
(transformers' Conv1D stores them in×out: transposed here, explicitly).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from featcal.blocks.adapters import adapter_for

D = torch.float64


class _Stop(Exception):
    pass


def _capture(module, block, kwargs):
    seen = {}

    def hook(_m, args, kw):
        seen["a"], seen["k"] = args, kw
        raise _Stop

    h = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        module(**kwargs)
    except _Stop:
        pass
    finally:
        h.remove()
    sig = inspect.signature(block.forward)
    bound = sig.bind(*seen["a"], **seen["k"]).arguments
    first = next(iter(sig.parameters))
    ctx = {}
    for k, v in bound.items():
        if sig.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
            ctx.update(v)
        elif k != first:
            ctx[k] = v
    return bound[first], ctx


def _capture_stack(adapter, stack, model, module, kwargs):
    """Block 0's input and what the blocks are called with: block 0's call, or with several layer types the
    adapter's record of each type's call (the model's own calls)."""
    if stack.layer_types:
        return adapter.capture(module, stack, model, kwargs)
    return _capture(module, stack.blocks(model)[0], kwargs)


def _modules(block, adapter):
    from featcal.blocks.discovery import mixtures_of_experts
    from featcal.blocks.norms import norm_form

    moe = mixtures_of_experts(block)  # experts and routers keep their merged values
    out = {}
    for name, m in block.named_modules():
        if moe.holds(name):
            continue
        if isinstance(m, (nn.Linear, Conv1D)):
            out[name] = ("linear", m)
        elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            out[name] = ("layernorm", m)
        elif norm_form(m) is not None:
            out[name] = ("layernorm" if norm_form(m).centred else "rmsnorm", m)
    return out


def _w(m, w=None):
    """A linear layer's weight as out×in (Conv1D stores it transposed)."""
    w = m.weight if w is None else w
    return w.T if isinstance(m, Conv1D) else w


def _eps(m):
    from featcal.blocks.norms import norm_form

    return m.eps if isinstance(m, nn.LayerNorm) else norm_form(m).eps


def _record(block, mods, order=None):
    """Hooks that append each calibrated module's input to a list (and, given `order`, each module's name
    there when it first runs: the forward order)."""
    store = {n: [] for n in mods}

    def hook(n, x):
        store[n].append(x.detach())
        if order is not None and n not in order:
            order.append(n)

    hooks = [m.register_forward_hook(lambda _m, i, _o, n=n: hook(n, i[0])) for n, (_, m) in mods.items()]
    return store, hooks


def _gather(stack, layer, n_blocks, block_m, mods, adapter, experts, calibration, cfg, hm, he, cm, ce):
    """Every calibrated module's xs, xe and token weights per task (float64, tokens flattened) from one forward
    of the merged block and of each expert's on the current chains, and the modules' forward order."""
    tasks = list(experts)
    per_task, order = {}, []
    for t in tasks:
        block_e = stack.blocks(experts[t])[layer]
        mods_e = _modules(block_e, adapter)
        xs_all, xe_all, w_all = {n: [] for n in mods}, {n: [] for n in mods}, {n: [] for n in mods}
        for b, batch in enumerate(calibration[t]):
            store_e, hooks = _record(block_e, mods_e)
            block_e(he[t, b], **adapter.block_kwargs(stack, layer, ce[t, b]))
            for h in hooks:
                h.remove()
            store_m, hooks = _record(block_m, mods, order)
            block_m(hm[t, b], **adapter.block_kwargs(stack, layer, cm[t, b]))
            for h in hooks:
                h.remove()
            for n in mods:
                xs, xe = store_m[n][0], store_e[n][0]
                mask = adapter.module_mask(stack, batch, n, xs)
                w = torch.ones(xs.shape[:-1]) if mask is None else mask.clone()
                if stack.class_token_head and layer == n_blocks - 1 and not adapter.is_kv(n):
                    w[:, 1:] *= cfg.cls_token_weight
                xs_all[n].append(xs.reshape(-1, xs.shape[-1]).to(D))
                xe_all[n].append(xe.reshape(-1, xe.shape[-1]).to(D))
                w_all[n].append(w.reshape(-1).to(D))
        per_task[t] = {
            n: (torch.cat(xs_all[n]), torch.cat(xe_all[n]), torch.cat(w_all[n]), mods_e[n][1]) for n in mods
        }
    return per_task, order


def _solve_module(n, kind, m, per_task, full, base_params, cfg):
    """docs/method.md §5's solve of module `n` from its per-task activations: {parameter: new value}."""
    alpha, lam, eps, rho = cfg.teacher_interp_alpha, cfg.lambda_ratio, cfg.covariance_eps, cfg.anchor_blend_rho
    tasks = list(per_task)
    new = {}
    if kind == "linear":
        anc_w = rho * _w(m).to(D) + (1 - rho) * _w(m, base_params[full + ".weight"]).to(D)
        a = (lam + eps) * torch.eye(anc_w.shape[1], dtype=D)
        rhs = lam * anc_w.T
        stats = []
        for t in tasks:
            xs, xe, w, me = per_task[t][n]
            xt = alpha * xe + (1 - alpha) * xs
            p = w / w.sum()
            c = (xs * p[:, None]).T @ xs
            x = (xs * p[:, None]).T @ xt
            s = torch.linalg.matrix_norm(c)
            a = a + c / s
            rhs = rhs + (x / s) @ _w(me).to(D).T
            stats.append((s, (p[:, None] * xs).sum(0), (p[:, None] * xt).sum(0), me))
        wsol = torch.linalg.solve(a, rhs).T
        new[m.weight] = _w(m, wsol)
        if m.bias is not None and cfg.calibrate_bias:
            anc_b = rho * m.bias.to(D) + (1 - rho) * base_params[full + ".bias"].to(D)
            num, den = lam * anc_b, lam
            for s, mu_s, mu_t, me in stats:
                num = num + (me.bias.to(D) + _w(me).to(D) @ mu_t - wsol @ mu_s) / s
                den = den + 1 / s
            new[m.bias] = num / den
    elif cfg.calibrate_layernorm:
        anc_w = rho * m.weight.to(D) + (1 - rho) * base_params[full + ".weight"].to(D)
        zs = {}
        for t in tasks:
            xs, _, w, me = per_task[t][n]
            if kind == "rmsnorm":
                z = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + _eps(m))
            else:
                z = F.layer_norm(xs, (xs.shape[-1],), eps=_eps(m))
            p = w / w.sum()
            zs[t] = ((p[:, None] * z).sum(0), (p[:, None] * z * z).sum(0), me)
        if kind == "rmsnorm" or getattr(m, "bias", None) is None:  # weight only: γ alone
            num = lam * anc_w + sum(e * me.weight.to(D) for _, e, me in zs.values())
            new[m.weight] = num / (lam + sum(e for _, e, _ in zs.values()))
        else:
            anc_b = rho * m.bias.to(D) + (1 - rho) * base_params[full + ".bias"].to(D)
            gam, bet = torch.empty_like(anc_w), torch.empty_like(anc_w)
            for ch in range(anc_w.shape[0]):
                mat = torch.tensor([[lam, 0.0], [0.0, lam + len(tasks)]], dtype=D)
                r = torch.stack([lam * anc_w[ch], lam * anc_b[ch]])
                for mm, e, me in zs.values():
                    g_t, b_t = me.weight[ch].to(D), me.bias[ch].to(D)
                    mat = mat + torch.stack([torch.stack([e[ch], mm[ch]]), torch.stack([mm[ch], torch.zeros((), dtype=D)])])
                    r = r + torch.stack([e[ch] * g_t + mm[ch] * b_t, mm[ch] * g_t + b_t])
                sol = torch.linalg.solve(mat, r)
                gam[ch], bet[ch] = sol[0], sol[1]
            new[m.weight], new[m.bias] = gam, bet
    return new


def reference_calibrate(merged, base, experts: dict, calibration: dict, cfg, sequential: bool = False):
    """Return a calibrated deep copy of `merged` (experts: {task: model}; calibration: {task: [dict]}).

    `sequential`: block_statistics "sequential", literally: each module solved alone, in forward order, from a
    fresh forward of the block with every module before it already solved."""
    model = copy.deepcopy(merged).eval()
    adapter = adapter_for(model)
    tasks = list(experts)
    base_params = dict(base.named_parameters())
    up_m = up_e = None
    with torch.no_grad():
        stacks = adapter.stacks(model)
        for stack in stacks:
            hm, he, cm, ce = {}, {}, {}, {}
            for t in tasks:
                for b, batch in enumerate(calibration[t]):
                    mod, kw = adapter.stack_call(model, stack, batch, None if up_m is None else up_m[t, b])
                    hm[t, b], cm[t, b] = _capture_stack(adapter, stack, model, mod, kw)
                    mod, kw = adapter.stack_call(experts[t], stack, batch, None if up_e is None else up_e[t, b])
                    he[t, b], ce[t, b] = _capture_stack(adapter, stack, experts[t], mod, kw)
            n_blocks = len(stack.blocks(model))
            for layer in range(n_blocks):
                block_m = stack.blocks(model)[layer]
                mods = _modules(block_m, adapter)
                args = (stack, layer, n_blocks, block_m, mods, adapter, experts, calibration, cfg, hm, he, cm, ce)
                per_task, order = _gather(*args)
                # sequential: one module at a time in forward order, each on the block calibrated before it
                for si, stage in enumerate([[n] for n in order] if sequential else [list(mods)]):
                    if si > 0:
                        per_task, _ = _gather(*args)
                    new = {}
                    for n in stage:
                        kind, m = mods[n]
                        new.update(_solve_module(n, kind, m, per_task, f"{stack.blocks_path}.{layer}.{n}",
                                                 base_params, cfg))
                    for p, v in new.items():
                        p.copy_(v.to(p.dtype))
                for t in tasks:
                    for b in range(len(calibration[t])):
                        out_e = stack.blocks(experts[t])[layer](he[t, b], **adapter.block_kwargs(stack, layer, ce[t, b]))
                        he[t, b] = out_e[0] if isinstance(out_e, tuple) else out_e
                        ce[t, b] = adapter.next_context(stack, layer, ce[t, b], out_e)
                for t in tasks:
                    for b in range(len(calibration[t])):
                        out = block_m(hm[t, b], **adapter.block_kwargs(stack, layer, cm[t, b]))
                        hm[t, b] = out[0] if isinstance(out, tuple) else out
                        cm[t, b] = adapter.next_context(stack, layer, cm[t, b], out)
            if stack is stacks[-1]:
                break
            up_m = {k: adapter.stack_output(model, stack, v) for k, v in hm.items()}
            up_e = {(t, b): adapter.stack_output(experts[t], stack, v) for (t, b), v in he.items()}
    return model


def noisy_family(kind: str, n_experts: int = 2, scale: float = 0.2, seed: int = 0):
    """A base, experts with task-vector noise on EVERY parameter (norms included), and their TA merge.

    tests/builders/tiny.py's `perturbed` scales noise by each tensor's std, so all-ones norm weights stay put;
    here they move too, so the LayerNorm/RMSNorm solves are exercised.
    """
    from tests.builders import tiny

    base = tiny.tiny_model(kind, seed)
    experts = {}
    for i in range(n_experts):
        e = tiny.perturbed(base, seed + 100 + i, scale)
        g = torch.Generator().manual_seed(seed + 200 + i)
        with torch.no_grad():
            for p in e.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=g) * scale)
        experts[f"task{i}"] = e
    merged = copy.deepcopy(base)
    with torch.no_grad():
        mp = dict(merged.named_parameters())
        for name, p0 in base.named_parameters():
            mp[name].copy_(p0 + 0.3 * sum(dict(e.named_parameters())[name] - p0 for e in experts.values()))
    return base, experts, merged


def ta_merge(base: nn.Module, experts: dict[str, nn.Module], scaling: float) -> nn.Module:
    """Task Arithmetic of `experts` on `base` at `scaling`, a new model."""
    merged = copy.deepcopy(base)
    with torch.no_grad():
        mp = dict(merged.named_parameters())
        for name, p0 in base.named_parameters():
            mp[name].copy_(p0 + scaling * sum(dict(e.named_parameters())[name] - p0 for e in experts.values()))
    return merged


def family_data(kind: str, tasks, n_batches: int = 2, seed: int = 0):
    from tests.builders import tiny

    return {t: [tiny.sample_inputs(kind, seed=seed + 10 * i + b) for b in range(n_batches)] for i, t in enumerate(tasks)}


def max_abs_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    sa, sb = a.state_dict(), b.state_dict()
    return max(((sa[k].double() - sb[k].double()).abs().max().item(), k) for k in sa if sa[k].is_floating_point())


def padding_change_effect(merged: nn.Module, base, experts, data: dict) -> float:
    """How far featcal's calibration moves when token 7 replaces the last three ids of each task's first batch's
    second row (positions its attention_mask hides): 0 up to round-off when padding counts for nothing."""
    from featcal import calibrate

    other = copy.deepcopy(data)
    for batches in other.values():
        batches[0]["input_ids"][1, -3:] = 7
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    b = calibrate(merged, base=base, experts=experts, calibration=other, progress=False).model
    return max_abs_diff(a, b)[0]


class Crash(KeyboardInterrupt):
    """A calibration killed by `killed_after`."""


@contextmanager
def killed_after(monkeypatch, block: int) -> Iterator[None]:
    """Inside: a calibration dies (Crash) right after block `block`'s resume checkpoint is committed.
    After: calibrations run to their end again."""
    from featcal.calibration.resume import store as resume

    def crash(k: int) -> None:
        if k == block:
            raise Crash

    monkeypatch.setattr(resume, "_maybe_kill", crash)
    try:
        yield
    finally:
        monkeypatch.setattr(resume, "_maybe_kill", lambda k: None)
