"""block_statistics "sequential_one_pass": the sequential variant's statistics, each block run once per side.

Why (issue 19): "sequential" takes stage k's statistics on the merged block whose earlier stages are already
calibrated, so it reruns the merged block up to every stage, and the expert's block up to every stage with
Linears: about seven block forwards per block for a ViT, against the floor's two. Here every batch's merged and
expert block forwards run once each, every one in its own greenlet (a coroutine on this thread: no second OS
thread, so torch's thread pools and grad mode are untouched), paused at every stage:

- the merged forward pauses at a forward pre-hook of the stage's first module to run, after folding the
  stage's statistics from its input (made by the calibrated earlier stages) and the expert's recordings;
- the expert forward pauses after the last module of each stage with Linears has run (its recordings, for
  that batch only, are what the fold reads).

When every batch of every task waits at stage k, the stage is solved and loaded; the forwards resume and run
the stage's modules with the solved weights. What the merged forwards finally return is the calibrated block's
output, so they are also the propagation; the expert forwards' outputs advance the expert chains. The same
operations run on the same inputs in the same order as in "sequential", so the solved parameters are the same
(tests/test_one_pass.py).

The cost is memory: every batch's two paused forwards are held at once (their live activations: a few block
inputs' worth per batch and side, more inside an MLP), with one copy of the expert's block per task. The
block's drift "before" (the block as merged) needs a forward this variant does not run; it is measured on each
task's first batch only (one more block forward per task), and the record says so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Stack
from featcal.blocks.capture import _hidden
from featcal.blocks.discovery import Calibrated, calibrated_modules
from featcal.calibration.hooks import ExpertRecorder, MergedFolder, plan_block
from featcal.calibration.statistics import NormalisedSums, TaskSums
from featcal.errors import FeatCalError
from featcal.io.param_sources import load_into

try:  # a small C extension (PyPI wheels for every platform torch has); imported where the variant runs
    import greenlet
except ImportError:  # pragma: no cover - a declared dependency; the message says what to install
    greenlet = None


class _Forward(greenlet.greenlet if greenlet is not None else object):  # type: ignore[misc]
    """One block forward, run in its own greenlet and paused at stage boundaries by the hooks below."""

    def __init__(self, fn: Callable[[], Any], task: str, batch: int) -> None:
        super().__init__(fn)
        self.task, self.batch = task, batch
        self.stage = -1  # merged side: the last stage folded; expert side: the last stage it paused after
        self.recorder: ExpertRecorder | None = None  # expert side: what this batch's folds read
        self.folder: MergedFolder | None = None  # merged side: folds into the current stage's task sums

    def step(self) -> Any:
        """Run until the next pause or the end (then the forward's output); errors surface here."""
        return self.switch()


def _pause() -> None:
    """From inside a forward's hook: hand control back to the block driver until it resumes this forward."""
    greenlet.getcurrent().parent.switch()


def _ours() -> _Forward | None:
    """The forward whose greenlet is running, or None (the driver's own forwards: hooks do nothing there)."""
    current = greenlet.getcurrent()
    return current if isinstance(current, _Forward) else None


def calibrate_block(engine: Any, stack: Stack, layer: int, n_blocks: int, stages: list[list[Calibrated]], bar,
                    masks_to_device: Callable, drift_cls: type) -> tuple[Any, Any]:
    """Solve block `layer` stage by stage with one forward per batch and side; advance both chains.

    `engine` is the FeatCalEngine (its chains, token weights, solves), `stages` its `_stages` for this block,
    `masks_to_device` and `drift_cls` the engine's helpers. Returns (drift before on each task's first batch,
    drift after on every batch), both reduced over the ranks.
    """
    if greenlet is None:
        raise FeatCalError("block_statistics sequential_one_pass needs greenlet: pip install 'featcal[one-pass]'")
    bar.total = sum(len(engine._batches(t)) for t in engine.tasks) * (len(stages) + 1)
    bar.refresh()
    block_m = stack.blocks(engine.merged)[layer]
    block_e = stack.blocks(engine.template)[layer]
    names = engine.block_param_names(stack, layer)
    kind = partial(engine._token_kind, stack, layer, n_blocks)
    tokens = engine._tokens_per_task()
    batches = {t: engine._batches(t) for t in engine.tasks}

    # 1. the block as merged, before any stage is solved: the reference chain and the drift "before"
    before = drift_cls()
    as_merged: dict[str, torch.Tensor] = {}
    for t in engine.tasks:
        if engine._reference.get(t) is not None:
            engine._advance(("r", t, engine._reference[t]), stack, layer, block_m)
        if batches[t]:
            b = batches[t][0][0]
            ctx = engine.adapter.block_kwargs(stack, layer, engine.chains.context(("m", t, b)))
            as_merged[t] = _hidden(block_m(engine.chains.hidden(("m", t, b)), **ctx))

    # 2. one copy of the expert's block per task (the template holds one expert at a time), and the plan
    experts: dict[str, nn.Module] = {}
    for t in engine.tasks:
        load_into(engine.template, names, engine.experts[t])
        experts[t] = copy.deepcopy(block_e)
    mods_e = {t: {c.name: c for c in calibrated_modules(experts[t], engine.adapter)} for t in engine.tasks}
    linears_e = {t: {n: c.module for n, c in m.items() if c.kind == "linear"} for t, m in mods_e.items()}
    rms = {n for n, c in next(iter(mods_e.values())).items() if c.kind == "rmsnorm"} if mods_e else set()
    plan = _plan(engine, stack, layer, experts, linears_e, batches, kind)
    teacher = {t: engine._teacher_form(plan, linears_e[t], tokens[t]) for t in engine.tasks}
    stage_of = {c.name: k for k, stage in enumerate(stages) for c in stage}
    last_of_stage = {k: stage[-1].name for k, stage in enumerate(stages)}
    with_linears = [k for k, stage in enumerate(stages) if any(c.kind == "linear" for c in stage)]

    # 3. the forwards, paused at every stage by hooks that act only inside one of them (the running greenlet)
    merged_fw: dict[tuple[str, int], _Forward] = {}
    expert_fw: dict[tuple[str, int], _Forward] = {}
    stage_modules = {c.name: c for stage in stages for c in stage}

    def merged_pre_hook(name: str, args: tuple) -> None:
        fw = _ours()
        if fw is None or fw.recorder is not None:  # not one of ours, or an expert forward
            return
        k = stage_of[name]
        if k <= fw.stage:  # the stage's other modules, after it was folded and solved
            return
        if k != fw.stage + 1:
            raise FeatCalError(f"block_statistics sequential_one_pass: module {name} ran before the modules of "
                               f"stage {fw.stage + 1} in task {fw.task!r}, batch {fw.batch}")
        x = args[0]
        for c in stages[k]:  # a stage's modules share one input tensor (engine._stages): fold them all here
            if c.kind == "linear":
                fw.folder._linear(c.name, x)
            else:
                fw.folder._norm(c.module, c.name, x, c.form)
        fw.folder._held.clear()
        fw.stage = k
        _pause()

    def expert_hook(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        fw = _ours()
        if fw is None or fw.recorder is None:
            return
        if name in linears_e[fw.task]:
            fw.recorder._hook(name, x, y)
        k = stage_of.get(name)
        if k is not None and k in with_linears and name == last_of_stage[k]:
            fw.stage = k
            _pause()

    handles = [c.module.register_forward_pre_hook(lambda _m, a, n=c.name: merged_pre_hook(n, a))
               for c in stage_modules.values()]
    for t in engine.tasks:
        for name, c in mods_e[t].items():
            if name in stage_modules:
                handles.append(c.module.register_forward_hook(lambda _m, i, o, n=name: expert_hook(n, i[0], o)))
    task_sums: dict[str, TaskSums] = {}
    on_device: dict[tuple[str, int], Any] = {}  # each batch's token masks, moved once for the folds and the drift
    try:
        for t in engine.tasks:
            for b, batch in batches[t]:
                on_device[t, b] = masks_to_device(stack, batch, engine.device)
                weights = partial(engine._weights, stack, layer, n_blocks, batch=on_device[t, b])
                e = expert_fw[t, b] = _Forward(partial(_run, engine, stack, layer, experts[t], ("e", t, b)), t, b)
                e.recorder = ExpertRecorder(linears_e[t], plan)
                m = merged_fw[t, b] = _Forward(partial(_run, engine, stack, layer, block_m, ("m", t, b)), t, b)
                m.folder = MergedFolder([], plan, e.recorder, TaskSums(), weights, teacher[t])

        # 4. stage by stage: both forwards of every batch up to the stage, its statistics folded; then the solve
        results: dict[tuple[str, str, int], Any] = {}
        for k, stage in enumerate(stages):
            task_sums = {t: TaskSums() for t in engine.tasks}
            for t in engine.tasks:
                for b, _ in batches[t]:
                    if k in with_linears and expert_fw[t, b].stage < k:
                        _step(expert_fw[t, b], ("e", t, b), results)
                    merged_fw[t, b].folder.sums = task_sums[t]
                    _step(merged_fw[t, b], ("m", t, b), results)
                    if ("m", t, b) in results:
                        raise FeatCalError(f"block_statistics sequential_one_pass: the merged forward of task {t!r}, "
                                           f"batch {b} ended before stage {k} ({[c.name for c in stage]}) ran")
                    _drop_recordings(expert_fw[t, b].recorder, plan, stage)
                    bar.update(1)
            sums = NormalisedSums(engine.cfg.teacher_interp_alpha, joint_bias=engine.cfg.bias_solve == "joint")
            for t in engine.tasks:
                engine.group.reduce_task_sums(task_sums[t], t)
                params = {c.name: c.params() for c in mods_e[t].values()}  # linear weights out×in
                sums.add_task(t, task_sums[t], params, rms)
            del task_sums
            engine._solve_and_load(stack, layer, stage, sums)
            del sums

        # 5. the rest of every forward: the calibrated block's output (the propagation) and the expert's
        after = drift_cls()
        for t in engine.tasks:
            for b, _ in batches[t]:
                for side, fw in (("e", expert_fw[t, b]), ("m", merged_fw[t, b])):
                    while (side, t, b) not in results:
                        _step(fw, (side, t, b), results)
                (ctx_e, raw_e), (ctx_m, raw_m) = results.pop(("e", t, b)), results.pop(("m", t, b))
                he, hm = _hidden(raw_e), _hidden(raw_m)
                mask = engine.adapter.token_mask(stack, on_device.pop((t, b)), he)
                after.add(t, hm, he, mask)
                if t in as_merged and b == batches[t][0][0]:
                    before.add(t, as_merged.pop(t), he, mask)
                engine.put_output(("e", t, b), stack, layer, ctx_e, raw_e)
                engine.put_output(("m", t, b), stack, layer, ctx_m, raw_m)
                bar.update(1)
    finally:
        for h in handles:
            h.remove()
        for fw in (*merged_fw.values(), *expert_fw.values()):  # an error part way: unwind every paused forward
            if fw:  # started and not finished: paused
                fw.throw()
    return before.reduce(engine.group, engine.tasks), after.reduce(engine.group, engine.tasks)


def _run(engine: Any, stack: Stack, layer: int, block: nn.Module, key: tuple) -> tuple[dict, Any]:
    """A greenlet's body: the block's forward on chain `key`; returns (the context it was called with, its
    output), so that the chain advances from the context the block saw, fetched (and moved) once."""
    ctx = engine.chains.context(key)
    return ctx, block(engine.chains.hidden(key), **engine.adapter.block_kwargs(stack, layer, ctx))


def _step(fw: _Forward, key: tuple, results: dict) -> None:
    out = fw.step()
    if fw.dead:
        results[key] = out


def _drop_recordings(recorder: ExpertRecorder, plan: dict, stage: list[Calibrated]) -> None:
    """Free what the expert forward kept for a stage once it is folded (it is held for one batch, one stage)."""
    for c in stage:
        p = plan.get(c.name)
        if p is None:
            continue
        recorder.outputs.pop(c.name, None)
        recorder.inputs.pop(p.group, None)


def _plan(engine: Any, stack: Stack, layer: int, experts: dict[str, nn.Module], linears_e: dict,
          batches: dict, kind: Callable) -> dict:
    """The block's Linear groups and statistics forms, from one expert forward on the first batch (as the
    other modes make it from the block's first expert forward)."""
    t = next((t for t in engine.tasks if batches[t]), None)
    if t is None:
        raise FeatCalError("block_statistics sequential_one_pass: this rank holds no calibration batch")
    b = batches[t][0][0]
    with ExpertRecorder(linears_e[t], None) as recorder:
        _run(engine, stack, layer, experts[t], ("e", t, b))
    return plan_block(linears_e[t], recorder.calls, kind, recorder.changed_in_place())
