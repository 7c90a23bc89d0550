"""tune_scope "block": ρ and λ chosen block by block inside the calibration's own pass (docs/tuning.md, issue 50).

The model-wide search (tuning/) calibrates the whole model once per candidate, about ten calibrations. Here,
at block l, the pass the paper runs anyway folds each task's statistics twice: over its fit examples and over
all of them (the fit part's raw sums plus the held-out part's; the forwards are the same). A candidate (ρ, λ, α)
is then a solve from the fit statistics (no forward), loaded into the merged block and scored by one forward
of that block over the held-out examples: the drift ‖hm − he‖² / ‖he‖² of its output from expert t's block
output, which the pass has just computed (class-token weighted in a class-token-read stack's last block, as
the model-wide search reads its output). A walk along the ladders picks the best; the block is solved at that
setting from ALL examples' statistics (the refit, at the price of a solve) and every chain propagates through
it, as in a plain calibration. The next block starts its walk from the best of the configured setting and
this block's choice.

α enters the statistics linearly, so the pass folds them at α 0 and at α 1 and any α is a blend of the two
(statistics.blend_alpha; the teacher form, which fixes α in the pass, is off). What it does not choose: the merge's scaling
(its part in the anchor Ā = θ0 + ρ·s·v is ρ's; the stem and head keep the merge as given). The held-out
examples' chains run through earlier blocks solved with them (the refit): every candidate of a block is
scored on the same inputs, so the comparison is fair, but the scores are not of unseen inputs past block 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from featcal.blocks.capture import hidden_of
from featcal.calibration.engine.context import BlockContext
from featcal.calibration.engine.gather import BlockDrift, GatherPass
from featcal.calibration.maths import solves
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.maths.statistics import NormalisedSums, TaskSums, blend_alpha

log = logging.getLogger("featcal.calibration")

# the ladders the searches step along (the configured value is inserted where it is not on one); the model-wide
# search (tuning/search.py) steps ρ, λ and α along these too
LADDERS: dict[str, tuple[float, ...]] = {
    "anchor_blend_rho": (0.0, 0.5, 1.0, 1.6, 2.2, 3.0, 4.0, 6.0, 8.0, 10.0),
    "lambda_ratio": (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
    "teacher_interp_alpha": (0.0, 0.25, 0.5, 0.75, 1.0),
}
# what a block's solve can change without another forward (α: from the sums at α 0 and 1, statistics.blend_alpha)
BLOCK_KNOBS = ("anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha")
# the most settings one block scores: the configured one, the previous block's choice, and steps along the ladders
BLOCK_CANDIDATES = 10


@dataclass
class BlockTuning:
    """The per-block search's inputs and, block by block, what it chose.

    `held_out`: per task, the (global) indices of its batches that are held out; `start`: the configured values
    of `knobs`; `limit`: the most settings scored per block."""

    held_out: Mapping[str, frozenset[int]]
    start: dict[str, float]
    knobs: tuple[str, ...]
    limit: int
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _previous: dict[str, float] | None = None

    def walk(self, score: Callable[[dict[str, float]], float]) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(the best setting, every setting scored in order with its held-out drift), within `limit` scores:
        the configured setting and the previous block's choice first, then each knob stepped up while the drift
        falls, else down, in passes until none moves."""
        scored: dict[tuple, float] = {}
        order: list[dict[str, Any]] = []

        def get(s: dict[str, float]) -> float | None:
            key = tuple(s[k] for k in self.knobs)
            if key not in scored:
                if len(scored) >= self.limit:
                    return None
                scored[key] = score(s)
                order.append({**s, "drift": scored[key]})
            return scored[key]

        best, best_drift = dict(self.start), get(self.start)
        if self._previous is not None and self._previous != best:
            d = get(self._previous)
            if d is not None and d < best_drift * (1.0 - 1e-9):
                best, best_drift = dict(self._previous), d
        moved = True
        while moved and len(scored) < self.limit:
            moved = False
            for knob in self.knobs:
                values = sorted(set(LADDERS[knob]) | {best[knob], self.start[knob]})
                for step in (1, -1):
                    j, went = values.index(best[knob]) + step, False
                    while 0 <= j < len(values):
                        cand = {**best, knob: values[j]}
                        d = get(cand)
                        if d is None or not d < best_drift * (1.0 - 1e-9):
                            break
                        best, best_drift, went = cand, d, True
                        j += step
                    if went:
                        moved = True
                        break
        self._previous = best
        return best, order

    def record(self, stack: str, layer: int, chosen: dict[str, float], order: list[dict[str, Any]]) -> None:
        start = order[0]["drift"]
        best = min(o["drift"] for o in order)
        self.blocks.append({"stack": stack, "layer": layer, "chosen": chosen, "held_out_drift": best,
                            "start_drift": start, "candidates": order})
        log.info("featcal tune %s block %d: chose %s (held-out drift %.6g, configured %.6g, %d scored)", stack, layer,
                 ", ".join(f"{k}={v:g}" for k, v in chosen.items()), best, start, len(order))


class _SplitPass(GatherPass):
    """The paper's gathering pass ("as_merged"), each task's sums folded over its fit batches and over all of them;
    where α is chosen, each at α 0 and at α 1 (the teacher form off: statistics.blend_alpha)."""

    def __init__(self, block: BlockContext, mods_m: list, tuning: BlockTuning) -> None:
        super().__init__(block, mods_m, "full", False, True, True)
        del self.sums  # the plain pass's one set of sums: here `fit` and `all`
        self.tuning = tuning
        joint = block.run.cfg.bias_solve == "joint"
        self.alphas = (0.0, 1.0) if "teacher_interp_alpha" in tuning.knobs else (float(block.run.cfg.teacher_interp_alpha),)
        self.fit = {a: NormalisedSums(a, joint) for a in self.alphas}
        self.all = {a: NormalisedSums(a, joint) for a in self.alphas}

    def task(self, t: str, tokens: float, bar) -> None:
        run = self.block.run
        run.load_expert(t, self.names)
        fit, held = TaskSums(), TaskSums()
        teacher = None
        for b, batch in run.batches(t):
            into = held if b in self.tuning.held_out[t] else fit
            teacher = self.batch(t, b, run.masks(self.block.stack, batch), into, teacher, tokens)
            bar.update(1)
        expert_params = {c.name: c.params() for c in self.mods_e.values()}
        for sums in self.fit.values():
            sums.add_task(t, fit, expert_params, self.rms)
        fit.merge_(held)  # all of the task's examples: the refit's statistics
        for sums in self.all.values():
            sums.add_task(t, fit, expert_params, self.rms)

    def at(self, part: dict[float, NormalisedSums], setting: dict[str, float]) -> NormalisedSums:
        """`part`'s sums at `setting`'s α (the configured α where α is not chosen)."""
        if len(self.alphas) == 1:
            return part[self.alphas[0]]
        return blend_alpha(part[0.0], part[1.0], setting["teacher_interp_alpha"])


def tuned_as_merged(block: BlockContext, bar) -> BlockDrift:
    """block_statistics "as_merged" with the block's ρ and λ chosen on held-out examples (module docstring)."""
    run = block.run
    tuning: BlockTuning = run.block_tuning
    mods = block.merged_modules()
    pass_ = _SplitPass(block, mods, tuning)
    tokens = run.tokens_per_task()
    for t in run.tasks:
        pass_.task(t, tokens[t], bar)
    before = run.reduced(pass_.before)
    as_merged = {p: p.detach().clone() for c in mods for p in c.module.parameters(recurse=False)}
    prefix = f"{block.stack.blocks_path}.{block.layer}."
    last = block.layer == block.n_blocks - 1 and block.stack.class_token_head

    def restore() -> None:
        for p, value in as_merged.items():
            p.copy_(value)

    def solve(setting: dict[str, float], sums) -> None:
        restore()  # every solve reads the block as merged (its anchor ρ·θm + (1−ρ)·θ0)
        cfg = run.cfg.model_copy(update=setting)
        run.load_solved(solves.solve_modules(cfg, run.base_param, prefix, mods, sums))

    def score(setting: dict[str, float]) -> float:
        solve(setting, pass_.at(pass_.fit, setting))
        drift = DriftSums()
        for t in run.tasks:
            for b, batch in run.batches(t):
                if b not in tuning.held_out[t]:
                    continue
                _, raw = block.call(block.merged, ("m", t, b))
                he = run.chains.hidden(("e", t, b))  # expert t's block output: the pass advanced the chain
                hm = hidden_of(raw)
                mask = block.token_mask(run.masks(block.stack, batch), he)
                drift.add(t, hm, he, run.class_token_weights(he, mask) if last else mask)
        return drift.mean()

    chosen, order = tuning.walk(score)
    pass_.fit.clear()
    solve(chosen, pass_.at(pass_.all, chosen))
    as_merged.clear()
    tuning.record(block.stack.name, block.layer, chosen, order)
    return BlockDrift(before, block.propagate(bar))


def choose_held_out(batches: Mapping[str, list[Any]], n_fit: Mapping[str, int]) -> dict[str, frozenset[int]]:
    """Per task, the indices of its held-out batches when its fit batches come first (`n_fit` of them)."""
    return {t: frozenset(range(n_fit[t], len(bs))) for t, bs in batches.items()}
