"""The block driver (SPEC §2): capture block-0 inputs, then per block gather statistics, solve, propagate.

For each stack (one for encoders and decoders, two for T5) the engine

1. captures what block 0 is called with, on the merged side and on each expert side: a forward
   pre-hook (with_kwargs) records the positional and keyword arguments and stops the forward;
2. for block l, task by task: loads expert t's block-l weights into an expert "template" model, runs
   it on he(t) batch by batch (hooks.py keeps, for that batch only, each group's expert input xe or
   each Linear's expert output ye), then runs the merged block l AS MERGED on hm(t) (hooks fold xs,
   xe / ye and the norms' normalised inputs into float32 sums), and advances he(t);
3. folds each finished task into per-task-normalised float64 sums, solves every Linear / LayerNorm /
   RMSNorm of the block in closed form, loads the solution, and propagates hm(t) through the
   CALIBRATED block.

With `offload_blocks` (placement.py) the models and chains stay on the host: the stems go to the
device for step 1, block l of both models for steps 2-3, and each batch's chain entries as they are used.

Resume (resume.py): after every `checkpoint_every`-th block and after the last one, the blocks
calibrated since the previous checkpoint and all chains are committed.

Drift record per block: mean over valid tokens of ‖hm − he‖² / ‖he‖² (token weights 1, padding 0),
averaged over tasks, where he is expert t's block output and hm the merged block's output on the
merged chain (which is already calibrated upstream) — "before" with the block as merged, "after"
with the block calibrated. Both come from forwards the method runs anyway.

End-to-end drift (`end_to_end`): "before" above is not the merge's own drift past block 0 (its input
is already calibrated), so the merged model AS MERGED is also run, block by block, on a reference
chain ("r") of each task's first batch: one more block forward per task and block. After the last
block its output and the calibrated one are compared with the expert's on that batch (the class
token only where the output is read from it); calibration that makes this worse is warned about.

Final norm (`calibrate_final_norm`, off by default): after the last block of the last stack, the norm
the output goes through before the head (the adapter's `final_norm`) is solved as the in-block norms
are, from the final chains the engine holds (hm(t) and expert t's affine; no block runs), with the last
block's token weights. Its record (`final_norm`) has the drift after the norm, as merged and solved.
"""

from __future__ import annotations

import inspect
import logging
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.blocks.adapters import Adapter, FinalNorm, Stack
from featcal.blocks.adapters.base import get_path
from featcal.blocks.capture import _hidden, _split_call
from featcal.blocks.discovery import ROUTED_EXPERTS, Calibrated, calibrated_modules, kept_merged, module_kind
from featcal.blocks.linear import features, weight_of
from featcal.calibration import one_pass, solver
from featcal.calibration.chains import ChainStore
from featcal.calibration.distributed import RankGroup, current_group
from featcal.calibration.hooks import (
    ExpertRecorder,
    MergedFolder,
    StopAfter,
    group_inputs,
    normalised_input,
    plan_block,
)
from featcal.calibration.placement import Placement
from featcal.calibration.resume import Position, ResumeStateError, ResumeStore, common_position
from featcal.calibration.statistics import NormalisedSums, NormNormalised, TaskSums
from featcal.config import FeatCalConfig
from featcal.data.batch import Batch
from featcal.errors import FeatCalError
from featcal.io import interrupts
from featcal.io.param_sources import ParamSource, load_into

log = logging.getLogger("featcal.calibration")

# An "output" Linear takes the teacher form (hooks.py) when tokens × this < its input width: 1 counts the
# pass's float32 tokens·in·out against the fold's float64 in·in·out as equal work (float64 is slower, so
# the rule leans toward the fold). Tests set it to 0 (no module takes it) or a large value (every one): both exact.
TEACHER_FORM_TOKENS_PER_INPUT = 1.0


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _masks_to_device(stack: Stack, batch: Batch, device: torch.device) -> Batch:
    """What block-level statistics read of a batch, on `device`: its token masks, nothing else.

    The model inputs (pixels, token ids) feed the stem alone; moving a whole batch again for every block
    took ~40 % of a ViT-B/32 calibration's wall time on a GPU (docs/scaling.md, "GPU check").
    """
    return {k: batch[k].to(device) for k in stack.mask_keys if isinstance(batch.get(k), torch.Tensor)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.equal(a, b)) or (a.is_floating_point() and torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def check_context_replay(adapter: Adapter, stack: Stack, model: nn.Module, module: nn.Module,
                         kwargs: dict[str, Any], hidden: torch.Tensor, ctx: dict[str, Any],
                         place: Placement | None = None) -> None:
    """Check once, on one batch, that every block is called with what the engine would replay.

    The engine calls block l with block 0's context (updated block by block by `adapter.next_context`,
    and picked per block by `adapter.block_kwargs`: per layer type where types differ) on the previous
    block's output. An architecture that gives a block another mask or bias than that, runs something
    between two blocks, or calls a block twice would be calibrated silently wrong, so the model's own
    forward is run once, in full, and each block's call is compared with the replay, argument by argument,
    as it happens (one block's output is held at a time). With `place` offloading, each block visits the
    device for its own call.
    """
    blocks = stack.blocks(model)
    state: dict[str, Any] = {"ctx": ctx, "out": None, "calls": [0] * len(blocks)}
    name = type(model).__name__

    def refuse(why: str) -> FeatCalError:
        return FeatCalError(f"{name}: {stack.name} {why}; FeatCal replays each block on the previous block's output "
                            "with the context it captured, so this architecture is not supported")

    def pre(layer: int, block: nn.Module, args: tuple, kw: dict) -> None:
        state["calls"][layer] += 1
        if state["calls"][layer] > 1:
            raise refuse(f"block {layer} is called more than once per forward")
        if place is not None:
            place.move(block, True)
        h, actual = _split_call(block, inspect.signature(block.forward), args, kw)
        predicted = adapter.block_kwargs(stack, layer, state["ctx"])
        for arg in sorted(set(predicted) | set(actual)):
            if not _same(predicted.get(arg), actual.get(arg)):
                raise refuse(f"block {layer} is called with another {arg!r} than block {max(layer - 1, 0)} passes on")
        if layer > 0 and not _same(h, _hidden(state["out"])):
            raise refuse(f"block {layer}'s input is not block {layer - 1}'s output (something runs between them)")

    def post(layer: int, block: nn.Module, out: Any) -> None:
        if place is not None:
            place.move(block, False)
        state["ctx"] = adapter.next_context(stack, layer, state["ctx"], out)
        state["out"] = out

    handles = []
    for layer, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(_pre_hook, pre, layer), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_post_hook, post, layer)))
    try:
        module(**kwargs)
    finally:
        for h in handles:
            h.remove()
        if place is not None:
            for block in blocks:
                place.move(block, False)
    missing = [i for i, n in enumerate(state["calls"]) if n == 0]
    if missing:
        raise refuse(f"block(s) {missing} never run in the model's forward")


def _pre_hook(fn, layer: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
    fn(layer, block, args, kwargs)


def _post_hook(fn, layer: int, block: nn.Module, _args: tuple, out: Any) -> None:
    fn(layer, block, out)


def block_param_names(model: nn.Module, stack: Stack, layer: int) -> list[str]:
    """Full names of block `layer`'s parameters (tied aliases included)."""
    block = stack.blocks(model)[layer]
    prefix = f"{stack.blocks_path}.{layer}."
    return [prefix + n for n, _ in block.named_parameters(remove_duplicate=False)]


def stem_param_names(model: nn.Module, stacks: list[Stack]) -> list[str]:
    """Parameters outside every block but under a stack entry: what a forward to block 0 reads."""
    entries = [s.entry_path for s in stacks]
    blocks = [s.blocks_path + "." for s in stacks]
    names = []
    for n, _ in model.named_parameters(remove_duplicate=False):
        under_entry = any(e == "" or n.startswith(e + ".") for e in entries)
        if under_entry and not any(n.startswith(b) for b in blocks):
            names.append(n)
    return names


def needed_param_names(model: nn.Module, stacks: list[Stack]) -> tuple[list[str], list[str]]:
    """(stem names, block names): every parameter an expert must provide; the base, the block ones."""
    blocks = [n for s in stacks for layer in range(len(s.blocks(model))) for n in block_param_names(model, s, layer)]
    return stem_param_names(model, stacks), blocks


class _Drift:
    """Σ over tokens of ‖hm−he‖²/‖he‖² and token counts per task, for one block.

    Batches are summed in float64 where the activations are, and read back once (by mean() or reduce()):
    a float() per batch would stall a GPU twice a batch. The values are those of summing the batches'
    float32 sums as Python floats, in the same order.
    """

    def __init__(self) -> None:
        self.sum: dict[str, float] = {}
        self.count: dict[str, float] = {}
        self._pending: dict[str, torch.Tensor] = {}  # task -> (Σ rel, Σ count), float64, not yet read back

    def add(self, task: str, hm: torch.Tensor, he: torch.Tensor, mask: torch.Tensor | None) -> None:
        hm, he = hm.float(), he.float()
        rel = (hm - he).pow(2).sum(-1) / he.pow(2).sum(-1).clamp_min(1e-12)
        m = torch.ones_like(rel) if mask is None else mask.to(rel.dtype)
        pair = torch.stack([(rel * m).sum(), m.sum()]).to(torch.float64)
        held = self._pending.get(task)
        self._pending[task] = pair if held is None else held + pair

    def _read_back(self) -> None:
        if not self._pending:
            return
        values = torch.stack(list(self._pending.values())).tolist()  # one device-to-host copy
        for task, (s, c) in zip(self._pending, values, strict=True):
            self.sum[task] = self.sum.get(task, 0.0) + s
            self.count[task] = self.count.get(task, 0.0) + c
        self._pending = {}

    def mean(self) -> float:
        self._read_back()
        vals = [self.sum[t] / max(self.count[t], 1.0) for t in self.sum]
        return sum(vals) / max(len(vals), 1)

    def reduce(self, group: RankGroup, tasks: list[str]) -> _Drift:
        """Sum the per-task sums and counts over the ranks (in place; a no-op in one process)."""
        self._read_back()
        if group.active:
            vals = torch.tensor([[self.sum.get(t, 0.0), self.count.get(t, 0.0)] for t in tasks], dtype=torch.float64)
            vals = group.reduce_values(vals).tolist()
            self.sum = {t: v[0] for t, v in zip(tasks, vals, strict=True)}
            self.count = {t: v[1] for t, v in zip(tasks, vals, strict=True)}
        return self


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


class FeatCalEngine:
    """Calibrates `merged` in place toward the experts, block by block (see the module docstring)."""

    def __init__(
        self,
        merged: nn.Module,
        template: nn.Module,
        adapter: Adapter,
        experts: dict[str, ParamSource],
        base: ParamSource | None,
        calibration: dict[str, list[Batch]],
        config: FeatCalConfig,
        device: torch.device,
        progress: bool = True,
        group: RankGroup | None = None,
        resume: ResumeStore | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.merged, self.template, self.adapter = merged, template, adapter
        self.experts, self.base, self.cfg = experts, base, config
        self.group = group if group is not None else current_group()
        self.resume = resume
        self.tasks = list(calibration)
        # this rank's share of every task's batches, with their global indices (the chain keys)
        self.calibration = {
            t: [(b, calibration[t][b]) for b in self.group.shard(len(calibration[t]), t)] for t in self.tasks
        }
        self.device = device
        # where the models live; the caller has already placed them (Placement.setup)
        self.place = placement if placement is not None else Placement(device, config.offload_blocks)
        self.progress = progress and self.group.is_main
        self.stacks = adapter.stacks(merged)
        dtype = next(merged.parameters()).dtype
        self.chains = ChainStore(config.chain_dtype, config.spill_dir, compute_dtype=dtype, device=device,
                                 home=self.place.chain_home)
        self.drift: list[dict[str, Any]] = []
        self.end_to_end: dict[str, Any] | None = None
        self.final_norm: dict[str, Any] | None = None  # with calibrate_final_norm: what was solved, its drift
        self.stem_norm: dict[str, Any] | None = None  # with calibrate_stem_norm: likewise
        stem = adapter.stem_norm(merged, self.stacks[0]) if config.calibrate_stem_norm else None
        kind = None if stem is None else module_kind(stem.module)
        self._stem = stem if kind in ("layernorm", "rmsnorm") else None  # the stem norm to solve, if any
        # per task, the first batch of this rank's share: where the uncalibrated merge is followed end to end
        self._reference = {t: self.calibration[t][0][0] for t in self.tasks if self.calibration[t]}
        self._block_counter = 0
        self._checkpointed = 0  # blocks whose parameters the resume directory already holds
        self.kept_merged = kept_merged_record(merged, self.stacks, self.group.is_main)

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
            for si, stack in enumerate(self.stacks):
                if si < start.stack:
                    continue
                first = start.layer if si == start.stack else 0
                if first == 0:
                    self._capture(stack, self.stacks[si - 1] if si > 0 else None)
                    if si == 0 and self.cfg.calibrate_stem_norm:  # before block 0, on the chains just captured
                        self.stem_norm = self._calibrate_stem_norm(stack)
                n_blocks = len(stack.blocks(self.merged))
                for layer in range(first, n_blocks):
                    interrupts.check()  # SIGTERM: stop at a block boundary even if its exception was swallowed
                    self._calibrate_block(stack, layer, n_blocks)
                    self._commit(si, layer, n_blocks)
            if self.cfg.calibrate_final_norm:  # from the committed final chains: a resumed run re-solves it alike
                self.final_norm = self._calibrate_final_norm(self.stacks[-1])
            self.end_to_end = self._end_to_end()
            return self.drift
        finally:
            self.chains.close()

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

        home = self.chains.home if self.chains.home is not None else self.device  # contexts go where chains are held
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

    def _batches(self, task: str) -> list[tuple[int, Batch]]:
        """(global batch index, batch) of this rank's share of `task`."""
        return self.calibration[task]

    def _capture(self, stack: Stack, previous: Stack | None) -> None:
        """Block-0 inputs of `stack` for the merged side and every expert side.

        For a second stack (T5's decoder) each side's chain still holds its last block's output from
        the previous stack; the adapter turns it into that stack's output (the encoder's final norm),
        batch by batch, and it reaches block 0 as the cross-attention input.
        """
        stem = self.stem_param_names()
        # offloading: the stems on the device (check_context_replay moves each block there for its own call)
        with self.place.stems([self.merged, self.template], self.stacks):
            self._capture_tasks(stack, previous, stem)

    def _capture_tasks(self, stack: Stack, previous: Stack | None, stem: list[str]) -> None:
        for t in self.tasks:
            load_into(self.template, stem, self.experts[t])
            for b, batch in self._batches(t):
                batch = _to_device(batch, self.device)
                sides = [("m", self.merged), ("e", self.template)]
                if self._reference.get(t) == b:
                    sides.append(("r", self.merged))  # the merge as merged, followed end to end
                for side, model in sides:
                    key = (side, t, b)
                    up = None
                    if previous is not None:
                        up = self.adapter.stack_output(model, previous, self.chains.hidden(key))
                    mod, kw = self.adapter.stack_call(model, stack, batch, up)
                    h, ctx = self.adapter.capture(mod, stack, model, kw)
                    if side == "m" and t == self.tasks[0] and b == self._batches(t)[0][0]:
                        check_context_replay(self.adapter, stack, self.merged, mod, kw, h, ctx, self.place)
                    self.chains.put_hidden(key, h)
                    self.chains.put_context(key, ctx)

    def _weights(
        self, stack: Stack, layer: int, n_blocks: int, name: str, x: torch.Tensor, *, batch: Batch
    ) -> torch.Tensor | None:
        """Token weights (B, S) for module `name`'s input x (B, S, d), SPEC §2.3; None when all are 1."""
        mask = self.adapter.module_mask(stack, batch, name, x)  # None: every token weighs 1
        if self._class_token_weighted(stack, layer, n_blocks, name):
            return self._class_token_weights(x, mask)
        return mask

    def _class_token_weights(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Token weights (B, S) of x (B, S, d) in a class-token-read stack's last block: the class token 1, the
        others cls_token_weight, times the 0/1 mask if any (SPEC §2.3)."""
        w = torch.full(tuple(x.shape[:-1]), self.cfg.cls_token_weight, dtype=torch.float32, device=x.device)
        w[..., 0] = 1.0
        return w if mask is None else w * mask

    def _class_token_weighted(self, stack: Stack, layer: int, n_blocks: int, name: str) -> bool:
        """Last block of a class-token-read stack: non-class tokens weigh less, except at k/v (SPEC §2.3)."""
        return stack.class_token_head and layer == n_blocks - 1 and not self.adapter.is_kv(name)

    def _calibrate_block(self, stack: Stack, layer: int, n_blocks: int) -> None:
        """SPEC §2.2 for one block: statistics task by task, solve and load, then propagate."""
        total = sum(len(self._batches(t)) for t in self.tasks) * 2
        bar = tqdm(total=total, desc=f"featcal {stack.name} block {layer}", disable=not self.progress, leave=False)
        block_m = stack.blocks(self.merged)[layer]
        mods_m = calibrated_modules(block_m, self.adapter)
        one_pass_stages = None
        with self.place.blocks(block_m, stack.blocks(self.template)[layer]):  # offloading: only these two
            if self.cfg.block_statistics == "sequential_one_pass":
                one_pass_stages = self._stages(stack, layer, n_blocks, mods_m) or None
            if one_pass_stages:  # statistics, solves and propagation in one forward per batch and side
                before, after = one_pass.calibrate_block(self, stack, layer, n_blocks, one_pass_stages, bar,
                                                         _masks_to_device, _Drift)
            else:
                if self.cfg.block_statistics != "as_merged":  # sequential (or one pass with nothing to solve)
                    before = self._gather_and_solve_in_order(stack, layer, n_blocks, mods_m, bar)
                else:
                    sums, before = self._gather(stack, layer, n_blocks, mods_m, bar)
                    self._solve_and_load(stack, layer, mods_m, sums)
                    del sums
                after = self._propagate(stack, layer, block_m, bar)
        bar.close()
        record = {
            "block": self._block_counter, "stack": stack.name, "layer": layer,
            "before": before.mean(), "after": after.mean(),
        }
        if one_pass_stages:
            record["before_batches"] = "the first of each task"  # one_pass.py: the block as merged is not run on all
        self._block_counter += 1
        self.drift.append(record)
        log.info(
            "featcal %s block %d: drift %.6g -> %.6g (mean ||hm-he||^2/||he||^2 over tokens and tasks)",
            stack.name, layer, record["before"], record["after"],
        )

    def _token_kind(self, stack: Stack, layer: int, n_blocks: int, name: str) -> tuple:
        """What a module's token weights depend on (modules sharing an input share statistics only if alike)."""
        return self.adapter.is_cross_module(stack, name), self._class_token_weighted(stack, layer, n_blocks, name)

    def _stages(self, stack: Stack, layer: int, n_blocks: int, mods_m: list[Calibrated]) -> list[list[Calibrated]]:
        """block_statistics sequential: the block's calibrated modules in forward order, in stages.

        A stage is one norm, or the Linears reading one input tensor with alike token weights (q/k/v,
        gate/up): solving one of them does not change another's input, so they are solved together. The
        order comes from one forward of the merged block, as merged, on one batch (its output is discarded).
        """
        first = next(((t, bs[0]) for t, bs in self.calibration.items() if bs), None)
        if first is None:
            raise FeatCalError("block_statistics sequential: this rank holds no calibration batch")
        t, (b, _) = first
        block_m = stack.blocks(self.merged)[layer]
        calls: list[tuple[str, torch.Tensor]] = []
        seen: set[str] = set()

        def hook(name: str, args: tuple) -> None:
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen.add(name)
                calls.append((name, args[0]))

        handles = [c.module.register_forward_pre_hook(lambda _m, a, n=c.name: hook(n, a)) for c in mods_m]
        try:
            ctx = self.adapter.block_kwargs(stack, layer, self.chains.context(("m", t, b)))
            block_m(self.chains.hidden(("m", t, b)), **ctx)
        finally:
            for h in handles:
                h.remove()
        by_name = {c.name: c for c in mods_m}
        linear_calls = [(n, x) for n, x in calls if by_name[n].kind == "linear"]
        group = group_inputs(linear_calls, partial(self._token_kind, stack, layer, n_blocks))
        stages: dict[str, list[Calibrated]] = {}
        for n, _ in calls:
            stages.setdefault(group.get(n, n), []).append(by_name[n])
        return list(stages.values())

    def _gather_and_solve_in_order(self, stack: Stack, layer: int, n_blocks: int, mods_m: list[Calibrated],
                                   bar) -> _Drift:
        """block_statistics sequential: per stage in forward order, the statistics of its modules on the
        merged block whose earlier stages are already calibrated, then their solve. Returns the drift before.

        Exact; each stage runs only what its statistics need (issue 19): the merged block up to the stage's
        modules, the expert block up to them where the stage has Linears (a norm's statistics need no expert
        forward), and whole forwards where whole outputs are used: both blocks in the first stage (the drift
        before; the as-merged reference chain advances there), the expert's in the last stage with Linears
        (where the expert chains advance, no later stage reading them)."""
        stages = self._stages(stack, layer, n_blocks, mods_m)
        bar.total = sum(len(self._batches(t)) for t in self.tasks) * (len(stages) + 1)
        bar.refresh()
        linear = [i for i, stage in enumerate(stages) if any(c.kind == "linear" for c in stage)]
        last_linear = linear[-1] if linear else 0
        tokens = self._tokens_per_task()
        before = None
        for i, stage in enumerate(stages):
            expert = "full" if i in (0, last_linear) else ("until" if i in linear else "none")
            sums, drift = self._gather(stack, layer, n_blocks, stage, bar, expert=expert, merged_until=i > 0,
                                       advance_experts=i == last_linear, advance_reference=i == 0, tokens=tokens)
            before = drift if i == 0 else before
            self._solve_and_load(stack, layer, stage, sums)
            del sums
        if before is None:  # no calibrated module ran: nothing to solve, the drift still recorded
            before = self._gather(stack, layer, n_blocks, [], bar)[1]
        return before

    def _gather(self, stack: Stack, layer: int, n_blocks: int, mods_m: list[Calibrated], bar, *,
                expert: str = "full", merged_until: bool = False, advance_experts: bool = True,
                advance_reference: bool = True, tokens: dict[str, float] | None = None) -> tuple:
        """Run expert t's block and the merged block batch by batch; fold the statistics of `mods_m`.

        Advances every expert chain he(t) through its block (unless `advance_experts` is false) and the
        as-merged reference chain (unless `advance_reference` is). `expert` "until" / `merged_until` stop
        that side's forward once the modules of `mods_m` have run; expert "none" runs no expert forward
        (norms only: their statistics read the expert's parameters, not its activations). Returns
        (NormalisedSums, drift before), the drift None unless both sides ran whole forwards.
        """
        whole = expert == "full" and not merged_until
        if expert != "full" and advance_experts:
            raise FeatCalError("internal: the expert chains advance only through whole expert forwards")
        if expert == "none" and any(c.kind == "linear" for c in mods_m):
            raise FeatCalError("internal: a Linear's statistics need the expert's forward")
        block_m = stack.blocks(self.merged)[layer]
        block_e = stack.blocks(self.template)[layer]
        mods_e = {c.name: c for c in calibrated_modules(block_e, self.adapter)}
        stage = {c.name for c in mods_m}
        linears_e = {c.name: c.module for c in mods_e.values()
                     if c.kind == "linear" and (whole or c.name in stage)}
        rms = {c.name for c in mods_e.values() if c.kind == "rmsnorm"}
        until_e = {n: mods_e[n].module for n in stage} if expert == "until" else None
        until_m = {c.name: c.module for c in mods_m} if merged_until else None
        names = self.block_param_names(stack, layer)
        sums = NormalisedSums(self.cfg.teacher_interp_alpha, joint_bias=self.cfg.bias_solve == "joint")
        before = _Drift()

        kind = partial(self._token_kind, stack, layer, n_blocks)
        plan = None  # Linear groups and statistics form, made from the block's first expert forward
        tokens = self._tokens_per_task() if tokens is None else tokens
        for t in self.tasks:
            load_into(self.template, names, self.experts[t])  # "none" too: the norms' targets are its parameters
            task_sums = TaskSums()
            teacher = None  # "output" modules that take the teacher form for this task (hooks.py)
            for b, batch in self._batches(t):
                batch = _masks_to_device(stack, batch, self.device)
                # expert side: its block output, and what its Linears feed the statistics
                raw_e = None
                with ExpertRecorder(linears_e, plan) as recorder, StopAfter(until_e) as stop:
                    if expert != "none":
                        ctx_e = self.chains.context(("e", t, b))
                        raw_e = stop.run(block_e, self.chains.hidden(("e", t, b)),
                                         **self.adapter.block_kwargs(stack, layer, ctx_e))
                if plan is None:
                    plan = plan_block(linears_e, recorder.calls, kind, recorder.changed_in_place())
                    recorder.adopt(plan)
                if teacher is None:
                    teacher = self._teacher_form(plan, linears_e, tokens[t])
                # merged side, block as merged (up to its calibrated stages): fold this batch into the task's sums
                weights = partial(self._weights, stack, layer, n_blocks, batch=batch)
                with MergedFolder(mods_m, plan, recorder, task_sums, weights, teacher), StopAfter(until_m) as stop:
                    ctx_m = self.adapter.block_kwargs(stack, layer, self.chains.context(("m", t, b)))
                    raw_m = stop.run(block_m, self.chains.hidden(("m", t, b)), **ctx_m)
                del recorder
                if advance_reference and self._reference.get(t) == b:  # the block as merged, outside the hooks
                    self._advance(("r", t, b), stack, layer, block_m)
                he_next = _hidden(raw_e) if expert == "full" else None
                if whole:
                    before.add(t, _hidden(raw_m), he_next, self.adapter.token_mask(stack, batch, he_next))
                if advance_experts:
                    self.put_output(("e", t, b), stack, layer, ctx_e, raw_e)
                bar.update(1)
            expert_params = {c.name: c.params() for c in mods_e.values()}  # linear weights out×in (Conv1D too)
            self.group.reduce_task_sums(task_sums, t)  # the full task's moments, before normalising by st
            sums.add_task(t, task_sums, expert_params, rms)
            del task_sums
        return sums, before.reduce(self.group, self.tasks) if whole else None

    def _tokens_per_task(self) -> dict[str, float]:
        """Token positions each task's merged chains hold, summed over the ranks (so every rank decides alike)."""
        local = torch.tensor([float(sum(self.chains.tokens(("m", t, b)) for b, _ in self._batches(t)))
                              for t in self.tasks], dtype=torch.float64)
        return dict(zip(self.tasks, self.group.reduce_values(local).tolist(), strict=True))

    def _teacher_form(self, plan: dict, linears_e: dict[str, nn.Module], tokens: float) -> dict:
        """{"output" module: (α, W_t)} for the modules whose teacher term is cheaper summed in the pass.

        Folding C_t W_tᵀ in costs in·in·out (float64) per task; the teacher form costs tokens·in·out
        (float32) in the pass, so it is taken when the task has fewer tokens than the module has inputs.
        """
        a = float(self.cfg.teacher_interp_alpha)
        if a == 1.0:
            return {}
        return {name: (a, weight_of(linears_e[name])) for name, p in plan.items()
                if p.mode == "output" and tokens * TEACHER_FORM_TOKENS_PER_INPUT < features(linears_e[name])[0]}

    def _advance(self, key: tuple, stack: Stack, layer: int, block: nn.Module) -> None:
        """Chain `key` <- block(chain `key`), its context updated as the block passes it on."""
        ctx = self.chains.context(key)
        raw = block(self.chains.hidden(key), **self.adapter.block_kwargs(stack, layer, ctx))
        self.put_output(key, stack, layer, ctx, raw)

    def put_output(self, key: tuple, stack: Stack, layer: int, ctx: dict[str, Any], raw: Any) -> None:
        """Chain `key` <- the output `raw` of block `layer` called with context `ctx`, the context updated as
        the block passes it on (stored only when it changed)."""
        self.chains.put_hidden(key, _hidden(raw))
        new_ctx = self.adapter.next_context(stack, layer, ctx, raw)
        if new_ctx is not ctx:
            self.chains.put_context(key, new_ctx)

    def _end_to_end(self) -> dict[str, Any] | None:
        """Final-block drift of the merge as merged and of the calibrated model, on each task's reference batch.

        Logs a warning when calibration made it worse. None when the chains lack the reference (a resume
        state written before it existed).
        """
        held = set(self.chains.keys())
        if not self.tasks or any(("r", t, b) not in held for t, b in self._reference.items()):
            log.info("featcal: no reference chain held; end-to-end drift not measured")
            return None
        stack = self.stacks[-1]
        merged, calibrated = _Drift(), _Drift()
        for t, b in self._reference.items():
            batch = _masks_to_device(stack, self.calibration[t][0][1], self.device)
            he = self.chains.hidden(("e", t, b))
            mask = self.adapter.token_mask(stack, batch, he)
            if stack.class_token_head:  # the model's output is read from the class token only
                only_cls = torch.zeros(tuple(he.shape[:-1]), dtype=torch.float32, device=he.device)
                only_cls[..., 0] = 1.0
                mask = only_cls if mask is None else only_cls * mask.to(only_cls.device)
            merged.add(t, self.chains.hidden(("r", t, b)), he, mask)
            calibrated.add(t, self.chains.hidden(("m", t, b)), he, mask)
        before = merged.reduce(self.group, self.tasks).mean()
        after = calibrated.reduce(self.group, self.tasks).mean()
        record = {"stack": stack.name, "tokens": "class token" if stack.class_token_head else "all tokens",
                  "batches": "the first of each task", "merged": before, "calibrated": after}
        if after > before and self.group.is_main:
            log.warning(
                "calibration made the end-to-end drift worse than the merge's: %.6g -> %.6g (final %s block, "
                "mean ||h-he||^2/||he||^2 on each task's first batch); check lambda_ratio, covariance_eps, "
                "anchor_blend_rho and the calibration data", before, after, stack.name,
            )
        return record

    def _propagate(self, stack: Stack, layer: int, block_m: nn.Module, bar) -> _Drift:
        """hm(t) <- calibrated block(hm(t)) for every batch; returns the drift after calibration."""
        after = _Drift()
        for t in self.tasks:
            for b, batch in self._batches(t):
                ctx_m = self.chains.context(("m", t, b))
                raw = block_m(self.chains.hidden(("m", t, b)), **self.adapter.block_kwargs(stack, layer, ctx_m))
                hm = _hidden(raw)
                he = self.chains.hidden(("e", t, b))
                after.add(t, hm, he, self.adapter.token_mask(stack, _masks_to_device(stack, batch, self.device), he))
                self.put_output(("m", t, b), stack, layer, ctx_m, raw)
                bar.update(1)
        return after.reduce(self.group, self.tasks)

    def _base(self, name: str) -> torch.Tensor | None:
        return None if self.base is None else self.base.get(name).to(self.device)

    def _solve_and_load(self, stack: Stack, layer: int, mods, sums: NormalisedSums) -> None:
        cfg = self.cfg
        lam, eps, rho = cfg.lambda_ratio, cfg.covariance_eps, cfg.anchor_blend_rho
        prefix = f"{stack.blocks_path}.{layer}."
        solved: dict[nn.Parameter, torch.Tensor] = {}
        for c in mods:
            full = prefix + c.name
            if c.kind == "linear":
                acc = sums.linears.get(c.name)
                if acc is None:
                    log.debug("%s was not called: keeps its merged value", full)
                    continue
                base_w = self._base(full + ".weight")
                w_anchor = solver.anchor(c.weight, None if base_w is None else weight_of(c.module, base_w), rho)
                if c.module.bias is not None and cfg.calibrate_bias and cfg.bias_solve == "joint":
                    bias_anchor = solver.anchor(c.module.bias, self._base(full + ".bias"), rho)
                    w, b = solver.linear_weight_bias(acc.gram, acc.target, acc.mean, acc.inv_scale, acc.bias_target,
                                                     acc.mean_bias, w_anchor, bias_anchor, lam, eps, what=full)
                    solver.check_finite(full + ".weight", w)
                    solver.check_finite(full + ".bias", b)
                    solved[c.module.weight], solved[c.module.bias] = c.stored(w), b
                    continue
                w = solver.linear_weight(acc.gram, acc.target, w_anchor, lam, eps, what=full)
                solver.check_finite(full + ".weight", w)
                solved[c.module.weight] = c.stored(w)
                if c.module.bias is not None and cfg.calibrate_bias:
                    bias_anchor = solver.anchor(c.module.bias, self._base(full + ".bias"), rho)
                    b = solver.linear_bias(w, acc.inv_scale, acc.bias_target, acc.mean, bias_anchor, lam)
                    solver.check_finite(full + ".bias", b)
                    solved[c.module.bias] = b
            elif cfg.calibrate_layernorm:
                acc = sums.norms.get(c.name)
                if acc is None:
                    continue
                solved.update(self._solve_norm(full, c.kind, c.module, acc))
        self._load(solved)

    def _load(self, solved: dict[nn.Parameter, torch.Tensor]) -> None:
        for p, value in solved.items():  # all solves read merged values first, then load
            p.copy_(value.to(dtype=p.dtype, device=p.device))
        self.group.broadcast_([p.data for p in solved])  # every rank keeps rank 0's solution, bit for bit

    def _solve_norm(self, full: str, kind: str, module: nn.Module,
                    acc: NormNormalised) -> dict[nn.Parameter, torch.Tensor]:
        """SPEC §2.6's per-channel solve of norm `full`: (γ, β) of a LayerNorm, γ of an RMS norm (not loaded)."""
        lam, rho = self.cfg.lambda_ratio, self.cfg.anchor_blend_rho
        g_anchor = solver.anchor(module.weight, self._base(full + ".weight"), rho)
        if kind == "rmsnorm" or getattr(module, "bias", None) is None:
            g = solver.rmsnorm_weight(acc.e, acc.gamma_target, g_anchor, lam)
            solver.check_finite(full + ".weight", g)
            return {module.weight: g}
        b_anchor = solver.anchor(module.bias, self._base(full + ".bias"), rho)
        g, b = solver.layernorm_affine(acc.e, acc.m, acc.n_tasks, acc.gamma_target, acc.beta_target, g_anchor,
                                       b_anchor, lam)
        solver.check_finite(full + ".weight", g)
        solver.check_finite(full + ".bias", b)
        return {module.weight: g, module.bias: b}

    # --- the norms outside the blocks (calibrate_stem_norm, calibrate_final_norm) -------------------
    def _fold_norm_task(self, sums: NormalisedSums, t: str, task_sums: TaskSums, path: str, norm_e: nn.Module,
                        kind: str) -> None:
        """Task t's moments of norm `path`, summed over the ranks, folded into `sums` against expert t's affine."""
        self.group.reduce_task_sums(task_sums, t)
        expert = {path: {"weight": norm_e.weight, "bias": getattr(norm_e, "bias", None)}}
        sums.add_task(t, task_sums, expert, {path} if kind == "rmsnorm" else set())

    def _solve_and_load_norm(self, sums: NormalisedSums, path: str, kind: str, module: nn.Module, what: str) -> None:
        """SPEC §2.6's solve of a norm outside the blocks from its folded moments, loaded into the merged model."""
        acc = sums.norms.get(path)
        if acc is None:
            raise FeatCalError(f"{path}: no calibration token reached {what}")
        self._load(self._solve_norm(path, kind, module, acc))

    # --- the stem norm (calibrate_stem_norm) -----------------------------------------------------
    def _calibrate_stem_norm(self, stack: Stack) -> dict[str, Any]:
        """Solve the norm whose output is block 0's input as the in-block norms are (SPEC §2.6), then
        recapture the merged chains through it.

        Its statistics are those of its normalised input on the merged stem (the stem is not otherwise
        calibrated, so this is the stem as merged), against expert t's own affine, not normalised per task,
        every token weighted as block 0's inputs are (padding 0). Architectures without one are a logged
        no-op. The drift record is block 0's input drift (merged chain against expert t's), before and after."""
        if self._stem is None:
            why = f"{type(self.merged).__name__} has no norm between its embeddings and its first {stack.name} block"
            log.info("featcal: calibrate_stem_norm: %s; nothing is calibrated", why)
            return {"calibrated": False, "stack": stack.name, "why": why}
        norm = self._stem
        kind = module_kind(norm.module)
        norm_e = get_path(self.template, norm.path)
        names = norm.param_names()
        with self.place.stems([self.merged, self.template], self.stacks):
            sums = NormalisedSums(self.cfg.teacher_interp_alpha)
            before = _Drift()
            for t in self.tasks:
                load_into(self.template, names, self.experts[t])
                task_sums = TaskSums()
                for b, batch in self._batches(t):
                    batch = _to_device(batch, self.device)
                    x = self._stem_norm_input(stack, norm.module, batch)
                    task_sums.add_norm(norm.path, normalised_input(norm.module, x),
                                       self.adapter.token_mask(stack, batch, x))
                    he = self.chains.hidden(("e", t, b))
                    before.add(t, self.chains.hidden(("m", t, b)), he, self.adapter.token_mask(stack, batch, he))
                self._fold_norm_task(sums, t, task_sums, norm.path, norm_e, kind)
            self._solve_and_load_norm(sums, norm.path, kind, norm.module, "the stem norm")
            after = _Drift()
            for t in self.tasks:
                for b, batch in self._batches(t):
                    batch = _to_device(batch, self.device)
                    mod, kw = self.adapter.stack_call(self.merged, stack, batch, None)
                    h, ctx = self.adapter.capture(mod, stack, self.merged, kw)
                    self.chains.put_hidden(("m", t, b), h)
                    self.chains.put_context(("m", t, b), ctx)
                    he = self.chains.hidden(("e", t, b))
                    after.add(t, h, he, self.adapter.token_mask(stack, batch, he))
        record = {"calibrated": True, "module": norm.path, "kind": kind, "stack": stack.name,
                  "before": before.reduce(self.group, self.tasks).mean(),
                  "after": after.reduce(self.group, self.tasks).mean()}
        log.info("featcal %s stem norm %s: block-0 input drift %.6g -> %.6g (mean ||hm-he||^2/||he||^2)",
                 stack.name, norm.path, record["before"], record["after"])
        return record

    def _stem_norm_input(self, stack: Stack, module: nn.Module, batch: Batch) -> torch.Tensor:
        """What the merged stem's norm reads on `batch`: its input, from a forward of the stem to block 0."""
        seen: dict[str, torch.Tensor] = {}
        handle = module.register_forward_hook(lambda _m, args, _out: seen.setdefault("x", args[0]))
        try:
            mod, kw = self.adapter.stack_call(self.merged, stack, batch, None)
            self.adapter.capture(mod, stack, self.merged, kw)
        finally:
            handle.remove()
        if "x" not in seen:
            raise FeatCalError(f"the stem norm of {type(self.merged).__name__} did not run before block 0")
        return seen["x"]

    # --- the final norm (calibrate_final_norm) ---------------------------------------------------
    def _calibrate_final_norm(self, stack: Stack) -> dict[str, Any]:
        """Solve the norm between `stack`'s last block and the head as the in-block norms are (SPEC §2.6).

        Its statistics are those of its normalised input on the merged chain hm(t), already calibrated
        upstream, against expert t's own affine, not normalised per task; they come from the final chains,
        so no block runs. Architectures without such a norm (BERT) are a logged no-op.
        """
        final = self.adapter.final_norm(self.merged, stack)
        kind = None if final is None else module_kind(final.module)
        if final is None or kind not in ("layernorm", "rmsnorm"):
            why = (f"{type(self.merged).__name__} has no norm between its last {stack.name} block and its head"
                   if final is None else f"{final.path} ({type(final.module).__name__}) is no calibrated norm")
            log.info("featcal: calibrate_final_norm: %s; nothing is calibrated", why)
            return {"calibrated": False, "stack": stack.name, "why": why}
        norm_e = get_path(self.template, final.path)
        names = final.param_names()
        with self.place.blocks(final.module, norm_e):  # offloading: the two norms on the device
            sums = NormalisedSums(self.cfg.teacher_interp_alpha)
            before = self._final_norm_pass(stack, final, norm_e, names, kind, sums)
            self._solve_and_load_norm(sums, final.path, kind, final.module, "the final norm")
            after = self._final_norm_pass(stack, final, norm_e, names, kind, None)
        tokens = "class token" if final.class_token_only else (
            f"all tokens (class token 1, others {self.cfg.cls_token_weight})" if stack.class_token_head else "all tokens")
        record = {"calibrated": True, "module": final.path, "kind": kind, "stack": stack.name, "tokens": tokens,
                  "before": before.mean(), "after": after.mean()}
        log.info("featcal %s final norm %s: drift %.6g -> %.6g (mean ||nm-ne||^2/||ne||^2 over tokens and tasks)",
                 stack.name, final.path, record["before"], record["after"])
        return record

    def _final_norm_pass(self, stack: Stack, final: FinalNorm, norm_e: nn.Module, names: list[str], kind: str,
                         sums: NormalisedSums | None) -> _Drift:
        """One pass over the final chains: the drift after the norm (merged norm on hm, expert t's on he),
        and with `sums` the norm's statistics folded in, task by task."""
        drift = _Drift()
        for t in self.tasks:
            load_into(self.template, names, self.experts[t])
            task_sums = TaskSums()
            for b, batch in self._batches(t):
                batch = _masks_to_device(stack, batch, self.device)
                xm, w, mask = self._final_norm_input(stack, final, self.chains.hidden(("m", t, b)), batch)
                xe = self.chains.hidden(("e", t, b))
                xe = xe[:, 0] if final.class_token_only else xe
                if sums is not None:
                    task_sums.add_norm(final.path, normalised_input(final.module, xm), w)
                drift.add(t, final.module(xm), norm_e(xe), mask)
            if sums is not None:
                self._fold_norm_task(sums, t, task_sums, final.path, norm_e, kind)
        return drift.reduce(self.group, self.tasks)

    def _final_norm_input(self, stack: Stack, final: FinalNorm, h: torch.Tensor,
                          batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(what the final norm reads, its token weights, its 0/1 token mask) from a final chain entry h.

        Weights as in the last block (SPEC §2.3): padding 0, and for a class-token-read stack the class
        token 1, others cls_token_weight; a norm of the class token alone (CLIP) reads that token only.
        """
        mask = self.adapter.token_mask(stack, batch, h)
        mask = None if mask is None else mask.to(h.device)
        if final.class_token_only:
            m0 = None if mask is None else mask[:, 0]
            return h[:, 0], m0, m0
        if not stack.class_token_head:
            return h, mask, mask
        return h, self._class_token_weights(h, mask), mask
