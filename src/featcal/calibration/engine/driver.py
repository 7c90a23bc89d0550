"""The block driver (docs/method.md §3): capture block-0 inputs, then per block gather statistics, solve,
propagate; the records of what it did.

For each stack (one for encoders and decoders, two for T5) the engine

1. captures what block 0 is called with, on the merged side and on each expert side: a forward
   pre-hook (with_kwargs) records the positional and keyword arguments and stops the forward; the first
   batch's full forward checks that the engine's replay is what the model does (replay.py);
2. calibrates each block with the gatherer `block_statistics` names (gather.py: "as_merged", the paper's,
   and "sequential"; one_pass.py: "sequential_one_pass"): for block l, task by task, expert t's block-l
   weights are loaded into an expert "template" model (template.py: its stems held, block l given storage
   while it is calibrated) and run on he(t) batch by batch (hooks.py keeps, for that batch only, each
   group's expert input xe or each Linear's expert output ye), the merged block l runs on hm(t) (hooks fold
   xs, xe / ye and the norms' normalised inputs into float32 sums), and he(t) advances; each finished task
   is folded into per-task-normalised float64 sums (statistics.py), every Linear / LayerNorm / RMSNorm of
   the block is solved in closed form (solves.py), the solution loaded, and hm(t) propagated through the
   CALIBRATED block. The gatherers work through context.py's BlockContext, never through the engine.

With `offload_blocks` (placement.py) the models and chains stay on the host: the stems go to the
device for step 1, block l of both models for step 2, and each batch's chain entries as they are used.

Resume (resume/store.py): after every `checkpoint_every`-th block and after the last one, the blocks
calibrated since the previous checkpoint and all chains are committed.

Drift record per block (drift.py): mean over valid tokens of ‖hm − he‖² / ‖he‖² (token weights 1, padding
0), averaged over tasks, where he is expert t's block output and hm the merged block's output on the
merged chain (which is already calibrated upstream) — "before" with the block as merged, "after" with
the block calibrated. Both come from forwards the method runs anyway.

End-to-end drift (`end_to_end`): "before" above is not the merge's own drift past block 0 (its input
is already calibrated), so the merged model AS MERGED is also run, block by block, on a reference
chain ("r") of each task's first batch: one more block forward per task and block. After the last
block its output and the calibrated one are compared with the expert's on that batch (the class
token only where the output is read from it); calibration that makes this worse is warned about.

The norms outside the blocks (`calibrate_stem_norm`, `calibrate_final_norm`, off by default) are solved
by outer_norms.py, before block 0 and after the last block of the last stack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.blocks.adapters import Adapter
from featcal.blocks.discovery import ROUTED_EXPERTS, kept_merged
from featcal.blocks.structure import Stack
from featcal.calibration.engine import block_tuning, gather, one_pass, outer_norms
from featcal.calibration.engine.block_tuning import BlockTuning
from featcal.calibration.engine.context import ExpertReads, RunContext  # ExpertReads: re-exported
from featcal.calibration.engine.expert_tape import ExpertTape
from featcal.calibration.engine.param_names import block_param_names, stem_param_names
from featcal.calibration.engine.placement import Placement
from featcal.calibration.engine.prefetch import BlockReader
from featcal.calibration.engine.replay import check_context_replay
from featcal.calibration.engine.template import block_storage
from featcal.calibration.maths.distributed import RankGroup, current_group
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.resume.store import Position, ResumeStateError, ResumeStore, common_position
from featcal.config import FeatCalConfig
from featcal.data.batch import Batch
from featcal.io.process import host_allocator, interrupts

log = logging.getLogger("featcal.calibration")

# block_statistics -> the gatherer that calibrates one block: (BlockContext, progress bar) -> BlockDrift
BLOCK_STATISTICS = {
    "as_merged": gather.as_merged,
    "sequential": gather.sequential,
    "sequential_one_pass": one_pass.sequential_one_pass,
}


def kept_merged_record(model: nn.Module, stacks: list[Stack], log_it: bool = True) -> dict[str, dict[str, str]]:
    """Per stack, the modules of its blocks whose parameters keep their merged values, and why (discovery.py);
    logged once per stack: routed experts as a warning (a mixture of experts' experts are left as merged), the
    rest (LayerScale, position bias tables, routers) as information."""
    out: dict[str, dict[str, str]] = {}
    for stack in stacks:
        kept: dict[str, str] = {}
        for block in stack.blocks(model):
            for name, why in kept_merged(block).items():
                kept.setdefault(name, why)
        if not kept:
            continue
        out[stack.name] = kept
        if not log_it:
            continue
        for why in dict.fromkeys(kept.values()):
            names = ", ".join(n for n, w in kept.items() if w == why)
            level = logging.WARNING if why == ROUTED_EXPERTS else logging.INFO
            log.log(level, "featcal %s blocks: %s keep(s) the merged values: %s", stack.name, names, why)
    return out


@dataclass(frozen=True)
class SearchHooks:
    """What a search (tuning/) asks of the calibrations it runs: per-block tuning (tune_scope "block"); for the
    model-wide search's candidates, no end-to-end drift (`end_to_end` off: its reference chain is one more block
    forward per task, and a candidate's record is not kept) and the experts' tape kept across them
    (expert_tape.py; used with block_statistics "as_merged" only). The default: a plain calibration."""

    block_tuning: BlockTuning | None = None
    end_to_end: bool = True
    expert_tape: ExpertTape | None = None


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, beside what it calibrates: progress bar, ranks (None: the current group), per-block
    resume store, where the models live (None: placed by the config), what a search asks of it (SearchHooks)."""

    progress: bool = True
    group: RankGroup | None = None
    resume: ResumeStore | None = None
    placement: Placement | None = None
    search: SearchHooks = SearchHooks()


@dataclass(frozen=True)
class EngineResult:
    """One engine run's records: per-block drift rows, the end-to-end drift, what calibrate_final_norm and
    calibrate_stem_norm solved (None when off), and per stack the parameters its blocks keep merged."""

    drift: list[dict[str, Any]]
    end_to_end: dict[str, Any] | None
    final_norm: dict[str, Any] | None
    stem_norm: dict[str, Any] | None
    kept_merged: dict[str, dict[str, str]]


class FeatCalEngine:
    """Calibrates `merged` in place toward the experts, block by block (see the module docstring)."""

    def __init__(
        self,
        merged: nn.Module,
        template: nn.Module,
        adapter: Adapter,
        reads: ExpertReads,
        calibration: dict[str, list[Batch]],
        config: FeatCalConfig,
        device: torch.device,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        """`reads`: where the experts' and the base's parameters come from, and how they are read (ExpertReads);
        `options`: the run's progress bar, ranks, resume store, placement and what a search asks (EngineOptions)."""
        self.merged, self.template, self.adapter, self.cfg = merged, template, adapter, config
        self.prefetch = reads.prefetch and not reads.resident
        self.group = options.group if options.group is not None else current_group()
        self.resume = options.resume
        # where the models live; the caller has already placed them (Placement.setup)
        self.place = options.placement if options.placement is not None else Placement(device, config.offload_blocks)
        self.ctx = RunContext(merged, template, adapter, reads, calibration, config, self.group, self.place)
        search = options.search
        self.ctx.block_tuning = search.block_tuning  # tune_scope "block": ρ and λ chosen per block (block_tuning.py)
        if not search.end_to_end:
            self.ctx.reference = {}  # no as-merged reference chain: end_to_end stays None
        tape = search.expert_tape
        if tape is not None and config.block_statistics == "as_merged" and search.block_tuning is None:
            tape.bind(calibration, config)
            self.ctx.expert_tape = tape
        self.chains = self.ctx.chains
        self.progress = options.progress and self.group.is_main
        self.stacks = adapter.stacks(merged)
        self.drift: list[dict[str, Any]] = []
        self.end_to_end: dict[str, Any] | None = None
        self.final_norm: dict[str, Any] | None = None  # with calibrate_final_norm: what was solved, its drift
        self.stem_norm: dict[str, Any] | None = None  # with calibrate_stem_norm: likewise
        # the stem norm to solve, if any
        self._stem = outer_norms.stem_norm(self.ctx, self.stacks[0]) if config.calibrate_stem_norm else None
        self._block_counter = 0
        self._checkpointed = 0  # blocks whose parameters the resume directory already holds
        self.kept_merged = kept_merged_record(merged, self.stacks, self.group.is_main)

    def result(self) -> EngineResult:
        """What the run did (after `run`): the per-block drift, the end-to-end drift, the outer norms' records and
        the parameters the blocks keep merged."""
        return EngineResult(self.drift, self.end_to_end, self.final_norm, self.stem_norm, self.kept_merged)

    # --- parameter bookkeeping -----------------------------------------------------------------
    def block_param_names(self, stack: Stack, layer: int) -> list[str]:
        return block_param_names(self.merged, stack, layer)

    def stem_param_names(self) -> list[str]:
        return stem_param_names(self.merged, self.stacks)

    # --- the pass ------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self) -> list[dict[str, Any]]:
        try:
            start = self._restore()
            if self.prefetch:
                self.ctx.reader = BlockReader(self.ctx.experts, self._schedule(start), len(self.ctx.tasks),
                                              self.ctx.check_as_read.__contains__)
            for si, stack in enumerate(self.stacks):
                if si < start.stack:
                    continue
                first = start.layer if si == start.stack else 0
                if first == 0:
                    self._capture(stack, self.stacks[si - 1] if si > 0 else None)
                    if si == 0 and self.cfg.calibrate_stem_norm:  # before block 0, on the chains just captured
                        self.stem_norm = outer_norms.calibrate_stem_norm(self.ctx, self.stacks, self._stem)
                n_blocks = len(stack.blocks(self.merged))
                for layer in range(first, n_blocks):
                    interrupts.check()  # SIGTERM: stop at a block boundary even if its exception was swallowed
                    self._calibrate_block(stack, layer, n_blocks)
                    self._commit(si, layer, n_blocks)
            if self.cfg.calibrate_final_norm:  # from the committed final chains: a resumed run re-solves it alike
                self.final_norm = outer_norms.calibrate_final_norm(self.ctx, self.stacks[-1])
            self.end_to_end = self._end_to_end()
            return self.drift
        finally:
            if self.ctx.reader is not None:
                self.ctx.reader.close()
                self.ctx.reader = None
            self.chains.close()

    def _schedule(self, start: Position) -> list[tuple[str, tuple[str, ...]]]:
        """The block loads the gatherers make from `start` on, in order: every task's block l, then block l+1."""
        loads = []
        for si, stack in enumerate(self.stacks[start.stack:], start.stack):
            first = start.layer if si == start.stack else 0
            for layer in range(first, len(stack.blocks(self.merged))):
                names = tuple(self.block_param_names(stack, layer))
                loads += [(t, names) for t in self.ctx.tasks]
        return loads

    # --- resume ----------------------------------------------------------------------------------
    def _restore(self) -> Position:
        """Continue from the newest checkpoint every rank holds, if any; else from the first block."""
        start = Position(0, 0, [])
        if self.resume is None:
            return start
        mine = self.resume.available()
        done = common_position(self.group.all_gather([(p.blocks_done, p.stack, p.layer) for p in mine]))
        if done is None:
            return start
        position = next(p for p in mine if p.blocks_done == done)
        self._check_position(position)
        if self._stem is not None:  # solved by the first run; its parameters come back with block 0's
            self.stem_norm = {"calibrated": True, "module": self._stem.path, "stack": self.stacks[0].name,
                              "restored": "from the resume checkpoint (its drift is in the first run's log)"}
        names = [self._block_names(k) for k in range(done)]
        params = dict(self.merged.named_parameters(remove_duplicate=False))

        def put_block(k: int, tensors: dict[str, torch.Tensor]) -> None:
            for n in names[k]:
                params[n].copy_(tensors[n].to(device=params[n].device, dtype=params[n].dtype))

        def put_chain(key: tuple, hidden: torch.Tensor, ctx: Any) -> None:
            self.chains.put_hidden(tuple(key), hidden)
            self.chains.put_context(tuple(key), ctx)

        home = self.chains.home if self.chains.home is not None else self.ctx.device  # contexts go with the chains
        self.resume.restore(position, put_block, put_chain, home)
        self.drift = [dict(r) for r in position.drift]
        self._block_counter = self._checkpointed = done
        log.info("featcal: resuming from %s: %d block(s) already calibrated, continuing at block %d",
                 self.resume.root, done, done)
        return position

    def _check_position(self, position: Position) -> None:
        """A resume state must name a place this model has: at most its blocks done, and the (stack, layer) that
        follows them in forward order; else blocks would be skipped, or an index run past the end."""
        sizes = [len(stack.blocks(self.merged)) for stack in self.stacks]
        done, total = position.blocks_done, sum(sizes)
        expected = None
        if done <= total:
            si, k = 0, done
            while si < len(sizes) and k >= sizes[si]:
                k -= sizes[si]
                si += 1
            expected = (si, k) if si < len(sizes) else (len(sizes), 0)
        if expected is None or (position.stack, position.layer) != expected:
            raise ResumeStateError(
                f"resume state in {self.resume.root} claims {done} finished block(s), continuing at stack "
                f"{position.stack} layer {position.layer}, but this model has {total} block(s) (continuing after {done} "
                f"would be at {expected}); it is not this run's: delete it (or choose another --resume-dir) to start again"
            )

    def _block_names(self, k: int) -> list[str]:
        """Parameter names of the k-th calibrated block, over all stacks in forward order (block 0's with the
        stem norm's, when calibrate_stem_norm solves one: it is checkpointed and restored with that block)."""
        if k == 0 and self._stem is not None:
            return self._stem.param_names() + self.block_param_names(self.stacks[0], 0)
        for stack in self.stacks:
            n = len(stack.blocks(self.merged))
            if k < n:
                return self.block_param_names(stack, k)
            k -= n
        raise IndexError(k)

    def _commit(self, si: int, layer: int, n_blocks: int) -> None:
        """Checkpoint after every `checkpoint_every`-th block and after the last one: the blocks
        calibrated since the previous checkpoint, then every chain (the costly part), then the state."""
        if self.resume is None:
            return
        done = self._block_counter
        last = si == len(self.stacks) - 1 and layer == n_blocks - 1
        if done % self.cfg.checkpoint_every and not last:
            self.resume.passed(done - 1)
            return
        nxt = (si, layer + 1) if layer + 1 < n_blocks else (si + 1, 0)
        params = dict(self.merged.named_parameters(remove_duplicate=False))
        blocks = {k: {n: params[n] for n in self._block_names(k)} for k in range(self._checkpointed, done)}
        chains = ((key, self.chains.raw_hidden(key), self.chains.raw_context(key)) for key in self.chains.keys())
        self.resume.commit(Position(*nxt, [dict(r) for r in self.drift]), blocks, chains)
        self._checkpointed = done

    def _capture(self, stack: Stack, previous: Stack | None) -> None:
        """Block-0 inputs of `stack` for the merged side and every expert side.

        For a second stack (T5's decoder) each side's chain still holds its last block's output from
        the previous stack; the adapter turns it into that stack's output (the encoder's final norm),
        batch by batch, and it reaches block 0 as the cross-attention input.
        """
        stem = self.stem_param_names()
        # offloading: the stems on the device (check_context_replay moves each block there for its own call)
        with self.place.stems([self.merged, self.template], self.stacks):
            for t in self.ctx.tasks:
                self.ctx.load_expert(t, stem)
                for b, batch in self.ctx.batches(t):
                    self._capture_batch(stack, previous, t, b, self.ctx.on_device(batch))

    def _capture_batch(self, stack: Stack, previous: Stack | None, t: str, b: int, batch: Batch) -> None:
        sides = [("m", self.merged), ("e", self.template)]
        if self.ctx.reference.get(t) == b:
            sides.append(("r", self.merged))  # the merge as merged, followed end to end
        for side, model in sides:
            key = (side, t, b)
            up = None
            if previous is not None:
                up = self.adapter.stack_output(model, previous, self.chains.hidden(key))
            mod, kw = self.adapter.stack_call(model, stack, batch, up)
            h, ctx = self.adapter.capture(mod, stack, model, kw)
            if side == "m" and t == self.ctx.tasks[0] and b == self.ctx.batches(t)[0][0]:
                check_context_replay(self.adapter, stack, self.merged, mod, kw, h, ctx, self.place)
            self.chains.put_hidden(key, h)
            self.chains.put_context(key, ctx)

    def _calibrate_block(self, stack: Stack, layer: int, n_blocks: int) -> None:
        """docs/method.md §3, step 2, for one block: statistics task by task, solve and load, then propagate."""
        total = sum(len(self.ctx.batches(t)) for t in self.ctx.tasks) * 2
        bar = tqdm(total=total, desc=f"featcal {stack.name} block {layer}", disable=not self.progress, leave=False)
        block = self.ctx.block(stack, layer, n_blocks)
        with self.place.blocks(block.merged, block.expert), block_storage(block.expert, block.merged):
            gatherer = (block_tuning.tuned_as_merged if self.ctx.block_tuning is not None
                        else BLOCK_STATISTICS[self.cfg.block_statistics])
            drift = gatherer(block, bar)  # offloading: only these two on the device
        if max(p.nbytes for p in block.merged.parameters()) >= host_allocator.MMAP_THRESHOLD_START:
            host_allocator.release_free_pages()  # what this block freed, not carried into the next one's peak
        bar.close()
        record = {
            "block": self._block_counter, "stack": stack.name, "layer": layer,
            "before": drift.before.mean(), "after": drift.after.mean(),
        }
        if drift.before_batches is not None:
            record["before_batches"] = drift.before_batches  # the block as merged was not run on every batch
        self._block_counter += 1
        self.drift.append(record)
        log.info(
            "featcal %s block %d: drift %.6g -> %.6g (mean ||hm-he||^2/||he||^2 over tokens and tasks)",
            stack.name, layer, record["before"], record["after"],
        )

    def _end_to_end(self) -> dict[str, Any] | None:
        """Final-block drift of the merge as merged and of the calibrated model, on each task's reference batch.

        Logs a warning when calibration made it worse. None when the chains lack the reference (a resume
        state written before it existed).
        """
        held = set(self.chains.keys())
        reference = self.ctx.reference
        if not reference:  # a search's candidate (SearchHooks.end_to_end off)
            return None
        if not self.ctx.tasks or any(("r", t, b) not in held for t, b in reference.items()):
            log.info("featcal: no reference chain held; end-to-end drift not measured")
            return None
        stack = self.stacks[-1]
        merged, calibrated = DriftSums(), DriftSums()
        for t, b in reference.items():
            batch = self.ctx.masks(stack, self.ctx.batches(t)[0][1])
            he = self.chains.hidden(("e", t, b))
            mask = self.adapter.token_mask(stack, batch, he)
            if stack.class_token_head:  # the model's output is read from the class token only
                only_cls = torch.zeros(tuple(he.shape[:-1]), dtype=torch.float32, device=he.device)
                only_cls[..., 0] = 1.0
                mask = only_cls if mask is None else only_cls * mask.to(only_cls.device)
            merged.add(t, self.chains.hidden(("r", t, b)), he, mask)
            calibrated.add(t, self.chains.hidden(("m", t, b)), he, mask)
        before = self.ctx.reduced(merged).mean()
        after = self.ctx.reduced(calibrated).mean()
        record = {"stack": stack.name, "tokens": "class token" if stack.class_token_head else "all tokens",
                  "batches": "the first of each task", "merged": before, "calibrated": after}
        if after > before and self.group.is_main:
            log.warning(
                "calibration made the end-to-end drift worse than the merge's: %.6g -> %.6g (final %s block, "
                "mean ||h-he||^2/||he||^2 on each task's first batch); check lambda_ratio, covariance_eps, "
                "anchor_blend_rho and the calibration data", before, after, stack.name,
            )
        return record
