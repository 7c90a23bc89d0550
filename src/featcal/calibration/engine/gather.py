"""Statistics gathering for one block (docs/method.md §3, §4): block_statistics "as_merged" and "sequential".

Both run expert t's block on he(t) and the merged block on hm(t), batch by batch, task by task, with hooks
(hooks.py) folding what the calibrated modules see into per-task sums, and fold each finished task into
the block's per-task-normalised sums (statistics.py):

- "as_merged" (the paper's): every module's statistics on the block as merged, one solve, then the
  propagation through the calibrated block;
- "sequential": the block's modules in stages, in forward order (`stages`); each stage's statistics on the
  merged block whose earlier stages are already solved, then its solve; then the propagation.

A gatherer returns the block's drift before (the block as merged) and after (calibrated); it works through
the BlockContext (context.py), which holds the chains, token weights, solve and propagation. The third
mode, "sequential_one_pass", is in one_pass.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from featcal.blocks.capture import hidden_of
from featcal.blocks.discovery import Calibrated
from featcal.calibration.engine.context import BlockContext
from featcal.calibration.engine.expert_tape import TapeEntry
from featcal.calibration.engine.hooks import ExpertRecorder, MergedFolder, StopAfter, group_inputs, plan_block
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.maths.statistics import NormalisedSums, TaskSums
from featcal.data.batch import Batch
from featcal.errors import FeatCalError


@dataclass
class BlockDrift:
    """A block's drift before (the block as merged) and after calibration, summed over the ranks.

    `before_batches`: where "before" was measured when not on every batch (one_pass.py)."""

    before: DriftSums
    after: DriftSums
    before_batches: str | None = None


def as_merged(block: BlockContext, bar) -> BlockDrift:
    """block_statistics "as_merged": every module's statistics on the block as merged, one solve, propagate."""
    mods = block.merged_modules()
    sums, before = gather(block, mods, bar)
    block.solve(mods, sums)
    del sums
    return BlockDrift(before, block.propagate(bar))


def sequential(block: BlockContext, bar) -> BlockDrift:
    """block_statistics "sequential": stage by stage in forward order, then propagate."""
    before = solve_in_order(block, block.merged_modules(), bar)
    return BlockDrift(before, block.propagate(bar))


def stages(block: BlockContext, mods_m: list[Calibrated]) -> list[list[Calibrated]]:
    """block_statistics sequential: the block's calibrated modules in forward order, in stages.

    A stage is one norm, or the Linears reading one input tensor with alike token weights (q/k/v,
    gate/up): solving one of them does not change another's input, so they are solved together. The
    order comes from one forward of the merged block, as merged, on one batch (its output is discarded).
    """
    run = block.run
    first = next(((t, bs[0]) for t, bs in run.shares.items() if bs), None)
    if first is None:
        raise FeatCalError("block_statistics sequential: this rank holds no calibration batch")
    t, (b, _) = first
    calls: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()

    def hook(name: str, args: tuple) -> None:
        if name not in seen and args and isinstance(args[0], torch.Tensor):
            seen.add(name)
            calls.append((name, args[0]))

    handles = [c.module.register_forward_pre_hook(lambda _m, a, n=c.name: hook(n, a)) for c in mods_m]
    try:
        block.call(block.merged, ("m", t, b))
    finally:
        for h in handles:
            h.remove()
    by_name = {c.name: c for c in mods_m}
    linear_calls = [(n, x) for n, x in calls if by_name[n].kind == "linear"]
    group = group_inputs(linear_calls, block.token_kind)
    out: dict[str, list[Calibrated]] = {}
    for n, _ in calls:
        out.setdefault(group.get(n, n), []).append(by_name[n])
    return list(out.values())


def solve_in_order(block: BlockContext, mods_m: list[Calibrated], bar) -> DriftSums:
    """block_statistics sequential: per stage in forward order, the statistics of its modules on the
    merged block whose earlier stages are already calibrated, then their solve. Returns the drift before.

    Exact; each stage runs only what its statistics need (issue 19): the merged block up to the stage's
    modules, the expert block up to them where the stage has Linears (a norm's statistics need no expert
    forward), and whole forwards where whole outputs are used: both blocks in the first stage (the drift
    before; the as-merged reference chain advances there), the expert's in the last stage with Linears
    (where the expert chains advance, no later stage reading them)."""
    run = block.run
    staged = stages(block, mods_m)
    bar.total = sum(len(run.batches(t)) for t in run.tasks) * (len(staged) + 1)
    bar.refresh()
    linear = [i for i, stage in enumerate(staged) if any(c.kind == "linear" for c in stage)]
    last_linear = linear[-1] if linear else 0
    tokens = run.tokens_per_task()
    before = None
    for i, stage in enumerate(staged):
        expert = "full" if i in (0, last_linear) else ("until" if i in linear else "none")
        sums, drift = gather(block, stage, bar, expert=expert, merged_until=i > 0, advance_experts=i == last_linear,
                             advance_reference=i == 0, tokens=tokens)
        before = drift if i == 0 else before
        block.solve(stage, sums)
        del sums
    if before is None:  # no calibrated module ran: nothing to solve, the drift still recorded
        before = gather(block, [], bar)[1]
    return before


def gather(block: BlockContext, mods_m: list[Calibrated], bar, *, expert: str = "full", merged_until: bool = False,
           advance_experts: bool = True, advance_reference: bool = True,
           tokens: dict[str, float] | None = None) -> tuple[NormalisedSums, DriftSums | None]:
    """Run expert t's block and the merged block batch by batch; fold the statistics of `mods_m`.

    Advances every expert chain he(t) through its block (unless `advance_experts` is false) and the
    as-merged reference chain (unless `advance_reference` is). `expert` "until" / `merged_until` stop
    that side's forward once the modules of `mods_m` have run; expert "none" runs no expert forward
    (norms only: their statistics read the expert's parameters, not its activations). Returns
    (NormalisedSums, drift before), the drift None unless both sides ran whole forwards.
    """
    if expert != "full" and advance_experts:
        raise FeatCalError("internal: the expert chains advance only through whole expert forwards")
    if expert == "none" and any(c.kind == "linear" for c in mods_m):
        raise FeatCalError("internal: a Linear's statistics need the expert's forward")
    pass_ = GatherPass(block, mods_m, expert, merged_until, advance_experts, advance_reference)
    tokens = block.run.tokens_per_task() if tokens is None else tokens
    for t in block.run.tasks:
        pass_.task(t, tokens[t], bar)
    return pass_.sums, block.run.reduced(pass_.before) if pass_.whole else None


class GatherPass:
    """One gathering pass over every task's batches (gather's state: the plan made from the block's first
    expert forward, the sums, the drift before)."""

    def __init__(self, block: BlockContext, mods_m: list[Calibrated], expert: str, merged_until: bool,
                 advance_experts: bool, advance_reference: bool) -> None:
        self.block, self.mods_m, self.expert = block, mods_m, expert
        self.advance_experts, self.advance_reference = advance_experts, advance_reference
        self.whole = expert == "full" and not merged_until
        self.mods_e = block.expert_modules()
        stage = {c.name for c in mods_m}
        self.linears_e = {c.name: c.module for c in self.mods_e.values()
                          if c.kind == "linear" and (self.whole or c.name in stage)}
        self.rms = {c.name for c in self.mods_e.values() if c.kind == "rmsnorm"}
        self.until_e = {n: self.mods_e[n].module for n in stage} if expert == "until" else None
        self.until_m = {c.name: c.module for c in mods_m} if merged_until else None
        self.names = block.param_names()
        self.sums = block.new_sums()
        self.before = DriftSums()
        self.plan = None  # Linear groups and statistics form, made from the block's first expert forward

    def task(self, t: str, tokens: float, bar) -> None:
        """Task t's batches folded into its own sums, then into the block's (summed over the ranks first)."""
        run = self.block.run
        run.load_expert(t, self.names)  # "none" too: the norms' targets are its parameters
        task_sums = TaskSums()
        teacher = None  # "output" modules that take the teacher form for this task (hooks.py)
        for b, batch in run.batches(t):
            teacher = self.batch(t, b, run.masks(self.block.stack, batch), task_sums, teacher, tokens)
            bar.update(1)
        expert_params = {c.name: c.params() for c in self.mods_e.values()}  # linear weights out×in (Conv1D too)
        run.group.reduce_task_sums(task_sums, t)  # the full task's moments, before normalising by st
        self.sums.add_task(t, task_sums, expert_params, self.rms)

    def batch(self, t: str, b: int, batch: Batch, task_sums: TaskSums, teacher: dict | None, tokens: float) -> dict:
        """One batch: the expert side's forward recorded, the merged side's folded; the chains advanced.
        Returns the task's teacher-form choice (made on its first batch)."""
        block = self.block
        recorder, ctx_e, raw_e = self._expert_side(t, b)
        if teacher is None:
            teacher = block.teacher_form(self.plan, self.linears_e, tokens)
        weights = partial(block.weights, batch=batch)
        with MergedFolder(self.mods_m, self.plan, recorder, task_sums, weights, teacher):
            raw_m = self._merged_forward(t, b)
        del recorder
        if self.advance_reference:  # the block as merged, outside the hooks
            block.advance_reference(t, b)
        he_next = hidden_of(raw_e) if self.expert == "full" else None
        if self.whole:
            self.before.add(t, hidden_of(raw_m), he_next, block.token_mask(batch, he_next))
        if self.advance_experts:
            block.put_output(("e", t, b), ctx_e, raw_e)
        return teacher

    def _expert_side(self, t: str, b: int) -> tuple[ExpertRecorder, dict | None, object]:
        """Expert t's forward on batch b with its recorder: replayed from the run's expert tape where a
        candidate before this one recorded it (expert_tape.py), else run (and recorded when a tape is kept)."""
        block, run = self.block, self.block.run
        tape = run.expert_tape if self.whole and self.advance_experts else None
        kept = tape.get(block.stack.name, block.layer, t, b, run.device) if tape is not None else None
        if kept is not None:
            plan, entry = kept
            self.plan = self.plan or plan
            recorder = ExpertRecorder(self.linears_e, self.plan)
            recorder.inputs, recorder.outputs = entry.inputs, entry.outputs
            return recorder, entry.ctx, entry.raw
        with ExpertRecorder(self.linears_e, self.plan) as recorder:
            ctx_e, raw_e = self._expert_forward(t, b)
        if self.plan is None:
            self.plan = plan_block(self.linears_e, recorder.calls, block.token_kind, recorder.changed_in_place())
            recorder.adopt(self.plan)
        if tape is not None:
            tape.put(block.stack.name, block.layer, t, b, self.plan,
                     TapeEntry(ctx_e, raw_e, dict(recorder.inputs), dict(recorder.outputs)))
        return recorder, ctx_e, raw_e

    # the two forwards of a batch, each its own function so that a profile names them
    # (benchmarks/profile_phases.py); the hooks around them record and fold
    def _expert_forward(self, t: str, b: int) -> tuple[dict | None, object]:
        """Expert t's block on he(t) batch b (stopped after the stage's modules with expert "until"), or nothing
        with expert "none"; returns (its chain context, its raw output)."""
        if self.expert == "none":
            return None, None
        run = self.block.run
        with StopAfter(self.until_e) as stop:
            ctx_e = run.chains.context(("e", t, b))
            return ctx_e, stop.run(self.block.expert, run.chains.hidden(("e", t, b)), **self.block.kwargs(ctx_e))

    def _merged_forward(self, t: str, b: int) -> object:
        """The merged block on hm(t) batch b (stopped after the stage's modules with merged_until)."""
        run = self.block.run
        with StopAfter(self.until_m) as stop:
            ctx_m = self.block.kwargs(run.chains.context(("m", t, b)))
            return stop.run(self.block.merged, run.chains.hidden(("m", t, b)), **ctx_m)
