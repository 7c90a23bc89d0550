"""The norms outside the blocks, solved as the in-block norms are (docs/method.md §2, §5): both off by default.

- the stem norm (`calibrate_stem_norm`): the norm whose output is block 0's input (BERT's embeddings
  LayerNorm, CLIP's pre_layrnorm), solved before block 0 from its normalised input on the merged stem
  (the stem is not otherwise calibrated, so this is the stem as merged), against expert t's own affine,
  not normalised per task, every token weighted as block 0's inputs are (padding 0); the merged chains
  are then captured again through it. Its record's drift is block 0's input drift, before and after.
- the final norm (`calibrate_final_norm`): the norm between the last block and the head, solved after the
  last block from the final chains the engine holds (hm(t), already calibrated upstream, and expert t's
  affine; no block runs), with the last block's token weights. Its record has the drift after the norm,
  as merged and solved.

Architectures without such a norm are a logged no-op, recorded as {"calibrated": False, "why"}.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import FinalNorm
from featcal.blocks.discovery import module_kind
from featcal.blocks.structure import Stack, get_path
from featcal.calibration.engine.context import RunContext
from featcal.calibration.engine.hooks import normalised_input
from featcal.calibration.maths import solves
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.maths.statistics import NormalisedSums, TaskSums
from featcal.data.batch import Batch
from featcal.errors import FeatCalError

log = logging.getLogger("featcal.calibration")

NORM_KINDS = ("layernorm", "rmsnorm")  # what a norm outside the blocks must be to be solved


def stem_norm(run: RunContext, stack: Stack) -> FinalNorm | None:
    """The stem norm `calibrate_stem_norm` solves before `stack`'s block 0, None where the model has none."""
    stem = run.adapter.stem_norm(run.merged, stack)
    kind = None if stem is None else module_kind(stem.module)
    return stem if kind in NORM_KINDS else None


def _fold_task(run: RunContext, sums: NormalisedSums, t: str, task_sums: TaskSums, path: str, norm_e: nn.Module,
               kind: str) -> None:
    """Task t's moments of norm `path`, summed over the ranks, folded into `sums` against expert t's affine."""
    run.group.reduce_task_sums(task_sums, t)
    expert = {path: {"weight": norm_e.weight, "bias": getattr(norm_e, "bias", None)}}
    sums.add_task(t, task_sums, expert, {path} if kind == "rmsnorm" else set())


def _solve_and_load(run: RunContext, sums: NormalisedSums, path: str, kind: str, module: nn.Module,
                    what: str) -> None:
    """The norm's solve from its folded moments, loaded into the merged model."""
    acc = sums.norms.get(path)
    if acc is None:
        raise FeatCalError(f"{path}: no calibration token reached {what}")
    run.load_solved(solves.solve_norm(run.cfg, run.base_param, path, kind, module, acc))


# --- the stem norm ---------------------------------------------------------------------------------
def calibrate_stem_norm(run: RunContext, stacks: list[Stack], norm: FinalNorm | None) -> dict[str, Any]:
    """Solve the stem norm `norm` of `stacks[0]`, then recapture the merged chains through it (module docstring)."""
    stack = stacks[0]
    if norm is None:
        why = f"{type(run.merged).__name__} has no norm between its embeddings and its first {stack.name} block"
        log.info("featcal: calibrate_stem_norm: %s; nothing is calibrated", why)
        return {"calibrated": False, "stack": stack.name, "why": why}
    kind = module_kind(norm.module)
    with run.place.stems([run.merged, run.template], stacks):
        sums = NormalisedSums(run.cfg.teacher_interp_alpha)
        before = _stem_statistics(run, stack, norm, kind, sums)
        _solve_and_load(run, sums, norm.path, kind, norm.module, "the stem norm")
        after = _recapture(run, stack)
    record = {"calibrated": True, "module": norm.path, "kind": kind, "stack": stack.name,
              "before": run.reduced(before).mean(), "after": run.reduced(after).mean()}
    log.info("featcal %s stem norm %s: block-0 input drift %.6g -> %.6g (mean ||hm-he||^2/||he||^2)",
             stack.name, norm.path, record["before"], record["after"])
    return record


def _stem_statistics(run: RunContext, stack: Stack, norm: FinalNorm, kind: str, sums: NormalisedSums) -> DriftSums:
    """The stem norm's moments on the merged stem folded into `sums`, task by task; the block-0 input drift."""
    norm_e = get_path(run.template, norm.path)
    names = norm.param_names()
    before = DriftSums()
    for t in run.tasks:
        run.load_expert(t, names)
        task_sums = TaskSums()
        for b, batch in run.batches(t):
            batch = run.on_device(batch)
            x = _stem_norm_input(run, stack, norm.module, batch)
            task_sums.add_norm(norm.path, normalised_input(norm.module, x), run.adapter.token_mask(stack, batch, x))
            he = run.chains.hidden(("e", t, b))
            before.add(t, run.chains.hidden(("m", t, b)), he, run.adapter.token_mask(stack, batch, he))
        _fold_task(run, sums, t, task_sums, norm.path, norm_e, kind)
    return before


def _recapture(run: RunContext, stack: Stack) -> DriftSums:
    """The merged chains captured again through the solved stem norm; the block-0 input drift after."""
    after = DriftSums()
    for t in run.tasks:
        for b, batch in run.batches(t):
            batch = run.on_device(batch)
            mod, kw = run.adapter.stack_call(run.merged, stack, batch, None)
            h, ctx = run.adapter.capture(mod, stack, run.merged, kw)
            run.chains.put_hidden(("m", t, b), h)
            run.chains.put_context(("m", t, b), ctx)
            he = run.chains.hidden(("e", t, b))
            after.add(t, h, he, run.adapter.token_mask(stack, batch, he))
    return after


def _stem_norm_input(run: RunContext, stack: Stack, module: nn.Module, batch: Batch) -> torch.Tensor:
    """What the merged stem's norm reads on `batch`: its input, from a forward of the stem to block 0."""
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_hook(lambda _m, args, _out: seen.setdefault("x", args[0]))
    try:
        mod, kw = run.adapter.stack_call(run.merged, stack, batch, None)
        run.adapter.capture(mod, stack, run.merged, kw)
    finally:
        handle.remove()
    if "x" not in seen:
        raise FeatCalError(f"the stem norm of {type(run.merged).__name__} did not run before block 0")
    return seen["x"]


# --- the final norm --------------------------------------------------------------------------------
def calibrate_final_norm(run: RunContext, stack: Stack) -> dict[str, Any]:
    """Solve the norm between `stack`'s last block and the head (module docstring)."""
    final = run.adapter.final_norm(run.merged, stack)
    kind = None if final is None else module_kind(final.module)
    if final is None or kind not in NORM_KINDS:
        why = (f"{type(run.merged).__name__} has no norm between its last {stack.name} block and its head"
               if final is None else f"{final.path} ({type(final.module).__name__}) is no calibrated norm")
        log.info("featcal: calibrate_final_norm: %s; nothing is calibrated", why)
        return {"calibrated": False, "stack": stack.name, "why": why}
    norm_e = get_path(run.template, final.path)
    with run.place.blocks(final.module, norm_e):  # offloading: the two norms on the device
        sums = NormalisedSums(run.cfg.teacher_interp_alpha)
        before = _final_norm_pass(run, stack, final, norm_e, kind, sums)
        _solve_and_load(run, sums, final.path, kind, final.module, "the final norm")
        after = _final_norm_pass(run, stack, final, norm_e, kind, None)
    tokens = "class token" if final.class_token_only else (
        f"all tokens (class token 1, others {run.cfg.cls_token_weight})" if stack.class_token_head else "all tokens")
    record = {"calibrated": True, "module": final.path, "kind": kind, "stack": stack.name, "tokens": tokens,
              "before": before.mean(), "after": after.mean()}
    log.info("featcal %s final norm %s: drift %.6g -> %.6g (mean ||nm-ne||^2/||ne||^2 over tokens and tasks)",
             stack.name, final.path, record["before"], record["after"])
    return record


def _final_norm_pass(run: RunContext, stack: Stack, final: FinalNorm, norm_e: nn.Module, kind: str,
                     sums: NormalisedSums | None) -> DriftSums:
    """One pass over the final chains: the drift after the norm (merged norm on hm, expert t's on he),
    and with `sums` the norm's statistics folded in, task by task."""
    drift = DriftSums()
    names = final.param_names()
    for t in run.tasks:
        run.load_expert(t, names)
        task_sums = TaskSums()
        for b, batch in run.batches(t):
            batch = run.masks(stack, batch)
            xm, w, mask = _final_norm_input(run, stack, final, run.chains.hidden(("m", t, b)), batch)
            xe = run.chains.hidden(("e", t, b))
            xe = xe[:, 0] if final.class_token_only else xe
            if sums is not None:
                task_sums.add_norm(final.path, normalised_input(final.module, xm), w)
            drift.add(t, final.module(xm), norm_e(xe), mask)
        if sums is not None:
            _fold_task(run, sums, t, task_sums, final.path, norm_e, kind)
    return run.reduced(drift)


def _final_norm_input(run: RunContext, stack: Stack, final: FinalNorm, h: torch.Tensor,
                      batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(what the final norm reads, its token weights, its 0/1 token mask) from a final chain entry h.

    Weights as in the last block (docs/method.md §4): padding 0, and for a class-token-read stack the class
    token 1, others cls_token_weight; a norm of the class token alone (CLIP) reads that token only.
    """
    mask = run.adapter.token_mask(stack, batch, h)
    mask = None if mask is None else mask.to(h.device)
    if final.class_token_only:
        m0 = None if mask is None else mask[:, 0]
        return h[:, 0], m0, m0
    if not stack.class_token_head:
        return h, mask, mask
    return h, run.class_token_weights(h, mask), mask
