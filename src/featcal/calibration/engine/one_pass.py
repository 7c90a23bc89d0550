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
(tests/calibration/test_one_pass.py).

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

from featcal.blocks.capture import hidden_of
from featcal.blocks.discovery import Calibrated
from featcal.calibration.engine import gather
from featcal.calibration.engine.context import BlockContext
from featcal.calibration.engine.gather import BlockDrift
from featcal.calibration.engine.hooks import ExpertRecorder, MergedFolder, plan_block
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.maths.statistics import TaskSums
from featcal.errors import FeatCalError

try:  # a small C extension (PyPI wheels for every platform torch has); imported where the variant runs
    import greenlet
except ImportError:  # pragma: no cover - a declared dependency; the message says what to install
    greenlet = None

BEFORE_BATCHES = "the first of each task"  # where this variant measures the block's drift before


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


def sequential_one_pass(block: BlockContext, bar) -> BlockDrift:
    """block_statistics "sequential_one_pass": solve the block stage by stage with one forward per batch and
    side, both chains advanced by those forwards (a block with no stage falls back to "sequential")."""
    staged = gather.stages(block, block.merged_modules())
    if not staged:
        return gather.sequential(block, bar)
    if greenlet is None:
        raise FeatCalError("block_statistics sequential_one_pass needs greenlet: pip install 'featcal[one-pass]'")
    return _OnePass(block, staged, bar).calibrate()


class _OnePass:
    """One block's stages solved inside paused forwards (see the module docstring)."""

    def __init__(self, block: BlockContext, stages: list[list[Calibrated]], bar) -> None:
        run = block.run
        self.block, self.run, self.stages, self.bar = block, run, stages, bar
        bar.total = sum(len(run.batches(t)) for t in run.tasks) * (len(stages) + 1)
        bar.refresh()
        self.tokens = run.tokens_per_task()
        self.batches = {t: run.batches(t) for t in run.tasks}
        self.stage_of = {c.name: k for k, stage in enumerate(stages) for c in stage}
        self.last_of_stage = {k: stage[-1].name for k, stage in enumerate(stages)}
        self.with_linears = [k for k, stage in enumerate(stages) if any(c.kind == "linear" for c in stage)]
        self.merged_fw: dict[tuple[str, int], _Forward] = {}
        self.expert_fw: dict[tuple[str, int], _Forward] = {}
        self.results: dict[tuple[str, str, int], Any] = {}
        self.on_device: dict[tuple[str, int], Any] = {}  # each batch's token masks, moved once for folds and drift

    def calibrate(self) -> BlockDrift:
        """Returns the drift before on each task's first batch and after on every batch, reduced over the ranks."""
        before, as_merged = self._as_merged()
        self._expert_copies()
        handles = self._hooks()
        try:
            self._start()
            for k, stage in enumerate(self.stages):
                self._solve_stage(k, stage)
            after = self._finish(before, as_merged)
        finally:
            for h in handles:
                h.remove()
            for fw in (*self.merged_fw.values(), *self.expert_fw.values()):  # an error part way: unwind every one
                if fw:  # started and not finished: paused
                    fw.throw()
        return BlockDrift(self.run.reduced(before), self.run.reduced(after), BEFORE_BATCHES)

    def _as_merged(self) -> tuple[DriftSums, dict[str, torch.Tensor]]:
        """The block as merged, before any stage is solved: the reference chain advanced, and each task's first
        batch's output (the drift before)."""
        block, run = self.block, self.run
        block_m = block.merged
        as_merged: dict[str, torch.Tensor] = {}
        for t in run.tasks:
            if run.reference.get(t) is not None:
                block.advance(("r", t, run.reference[t]), block_m)
            if self.batches[t]:
                b = self.batches[t][0][0]
                as_merged[t] = hidden_of(block.call(block_m, ("m", t, b))[1])
        return DriftSums(), as_merged

    def _expert_copies(self) -> None:
        """One copy of the expert's block per task (the template holds one expert at a time), and the plan."""
        block, run = self.block, self.run
        names = block.param_names()
        self.experts: dict[str, nn.Module] = {}
        for t in run.tasks:
            run.load_expert(t, names)
            self.experts[t] = copy.deepcopy(block.expert)
        self.mods_e = {t: block.expert_modules(self.experts[t]) for t in run.tasks}
        self.linears_e = {t: {n: c.module for n, c in m.items() if c.kind == "linear"} for t, m in self.mods_e.items()}
        mods = next(iter(self.mods_e.values()), {})
        self.rms = {n for n, c in mods.items() if c.kind == "rmsnorm"}
        self.plan = self._plan()
        self.teacher = {t: block.teacher_form(self.plan, self.linears_e[t], self.tokens[t]) for t in run.tasks}

    def _plan(self) -> dict:
        """The block's Linear groups and statistics forms, from one expert forward on the first batch (as the
        other modes make it from the block's first expert forward)."""
        t = next((t for t in self.run.tasks if self.batches[t]), None)
        if t is None:
            raise FeatCalError("block_statistics sequential_one_pass: this rank holds no calibration batch")
        b = self.batches[t][0][0]
        with ExpertRecorder(self.linears_e[t], None) as recorder:
            self.block.call(self.experts[t], ("e", t, b))
        return plan_block(self.linears_e[t], recorder.calls, self.block.token_kind, recorder.changed_in_place())

    def _hooks(self) -> list:
        """Hooks that pause the forwards at every stage; they act only inside one of them (the running greenlet)."""
        modules = {c.name: c for stage in self.stages for c in stage}
        handles = [c.module.register_forward_pre_hook(lambda _m, a, n=c.name: self._merged_pre_hook(n, a))
                   for c in modules.values()]
        for t in self.run.tasks:
            for name, c in self.mods_e[t].items():
                if name in modules:
                    handles.append(c.module.register_forward_hook(
                        lambda _m, i, o, n=name: self._expert_hook(n, i[0], o)))
        return handles

    def _merged_pre_hook(self, name: str, args: tuple) -> None:
        """Before the first module of a stage runs in a merged forward: fold the stage's statistics, pause."""
        fw = _ours()
        if fw is None or fw.recorder is not None:  # not one of ours, or an expert forward
            return
        k = self.stage_of[name]
        if k <= fw.stage:  # the stage's other modules, after it was folded and solved
            return
        if k != fw.stage + 1:
            raise FeatCalError(f"block_statistics sequential_one_pass: module {name} ran before the modules of "
                               f"stage {fw.stage + 1} in task {fw.task!r}, batch {fw.batch}")
        x = args[0]
        for c in self.stages[k]:  # a stage's modules share one input tensor (gather.stages): fold them all here
            if c.kind == "linear":
                fw.folder.fold_linear(c.name, x)
            else:
                fw.folder.fold_norm(c.module, c.name, x, c.form)
        fw.folder.end_forward()
        fw.stage = k
        _pause()

    def _expert_hook(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """After a module ran in an expert forward: record it; pause after the last module of a stage."""
        fw = _ours()
        if fw is None or fw.recorder is None:
            return
        if name in self.linears_e[fw.task]:
            fw.recorder.record(name, x, y)
        k = self.stage_of.get(name)
        if k is not None and k in self.with_linears and name == self.last_of_stage[k]:
            fw.stage = k
            _pause()

    def _start(self) -> None:
        """Every batch's two forwards, created (not yet run)."""
        block, run = self.block, self.run
        for t in run.tasks:
            for b, batch in self.batches[t]:
                self.on_device[t, b] = run.masks(block.stack, batch)
                weights = partial(block.weights, batch=self.on_device[t, b])
                e = self.expert_fw[t, b] = _Forward(partial(block.call, self.experts[t], ("e", t, b)), t, b)
                e.recorder = ExpertRecorder(self.linears_e[t], self.plan)
                m = self.merged_fw[t, b] = _Forward(partial(block.call, block.merged, ("m", t, b)), t, b)
                m.folder = MergedFolder([], self.plan, e.recorder, TaskSums(), weights, self.teacher[t])

    def _solve_stage(self, k: int, stage: list[Calibrated]) -> None:
        """Both forwards of every batch up to stage k, its statistics folded; then its solve."""
        run = self.run
        task_sums = {t: TaskSums() for t in run.tasks}
        for t in run.tasks:
            for b, _ in self.batches[t]:
                if k in self.with_linears and self.expert_fw[t, b].stage < k:
                    self._step(self.expert_fw[t, b], ("e", t, b))
                self.merged_fw[t, b].folder.sums = task_sums[t]
                self._step(self.merged_fw[t, b], ("m", t, b))
                if ("m", t, b) in self.results:
                    raise FeatCalError(f"block_statistics sequential_one_pass: the merged forward of task {t!r}, "
                                       f"batch {b} ended before stage {k} ({[c.name for c in stage]}) ran")
                _drop_recordings(self.expert_fw[t, b].recorder, self.plan, stage)
                self.bar.update(1)
        sums = self.block.new_sums()
        for t in run.tasks:
            run.group.reduce_task_sums(task_sums[t], t)
            params = {c.name: c.params() for c in self.mods_e[t].values()}  # linear weights out×in
            sums.add_task(t, task_sums[t], params, self.rms)
        del task_sums
        self.block.solve(stage, sums)

    def _finish(self, before: DriftSums, as_merged: dict[str, torch.Tensor]) -> DriftSums:
        """The rest of every forward: the calibrated block's output (the propagation) and the expert's."""
        block, run = self.block, self.run
        after = DriftSums()
        for t in run.tasks:
            for b, _ in self.batches[t]:
                for side, fw in (("e", self.expert_fw[t, b]), ("m", self.merged_fw[t, b])):
                    while (side, t, b) not in self.results:
                        self._step(fw, (side, t, b))
                (ctx_e, raw_e), (ctx_m, raw_m) = self.results.pop(("e", t, b)), self.results.pop(("m", t, b))
                he, hm = hidden_of(raw_e), hidden_of(raw_m)
                mask = block.token_mask(self.on_device.pop((t, b)), he)
                after.add(t, hm, he, mask)
                if t in as_merged and b == self.batches[t][0][0]:
                    before.add(t, as_merged.pop(t), he, mask)
                block.put_output(("e", t, b), ctx_e, raw_e)
                block.put_output(("m", t, b), ctx_m, raw_m)
                self.bar.update(1)
        return after

    def _step(self, fw: _Forward, key: tuple) -> None:
        out = fw.step()
        if fw.dead:
            self.results[key] = out


def _drop_recordings(recorder: ExpertRecorder, plan: dict, stage: list[Calibrated]) -> None:
    """Free what the expert forward kept for a stage once it is folded (it is held for one batch, one stage)."""
    for c in stage:
        p = plan.get(c.name)
        if p is None:
            continue
        recorder.outputs.pop(c.name, None)
        recorder.inputs.pop(p.group, None)
