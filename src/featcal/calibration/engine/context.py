"""What the block driver shares with the statistics gatherers and the norm solves.

`RunContext` holds one calibration's models, data and chains, and the operations on them that every
step needs (moving a batch, loading an expert's parameters, advancing a chain, loading a solution).
`BlockContext` is one block's view of it: the block's modules on both sides, its token weights
(docs/method.md §4), its solve and its propagation (§3). The gatherers (gather.py, one_pass.py) and the
norms outside the blocks (outer_norms.py) work through these two, never through the engine.

Chains are keyed (side, task, batch): "m" the merged model's chain hm(t), "e" expert t's he(t), "r" the
merge as merged followed end to end on each task's first batch (engine/driver.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter
from featcal.blocks.capture import hidden_of
from featcal.blocks.discovery import Calibrated, calibrated_modules
from featcal.blocks.linear import features, weight_of
from featcal.blocks.structure import Stack
from featcal.calibration.engine.chains import ChainStore
from featcal.calibration.engine.expert_placement import point_into
from featcal.calibration.engine.param_names import block_param_names
from featcal.calibration.engine.placement import Placement
from featcal.calibration.engine.prefetch import BlockReader, checked_reads
from featcal.calibration.maths import solves
from featcal.calibration.maths.distributed import RankGroup
from featcal.calibration.maths.drift import DriftSums
from featcal.calibration.maths.statistics import NormalisedSums
from featcal.config import FeatCalConfig
from featcal.data.batch import Batch
from featcal.io.read.param_sources import ParamSource, copy_into

# An "output" Linear takes the teacher form (hooks.py) when tokens × this < its input width: 1 counts the
# pass's float32 tokens·in·out against the fold's float64 in·in·out as equal work (float64 is slower, so
# the rule leans toward the fold). Tests set it to 0 (no module takes it) or a large value (every one): both exact.
TEACHER_FORM_TOKENS_PER_INPUT = 1.0


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A whole batch on `device`: what the stem reads."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def masks_to_device(stack: Stack, batch: Batch, device: torch.device) -> Batch:
    """What block-level statistics read of a batch, on `device`: its token masks, nothing else.

    The model inputs (pixels, token ids) feed the stem alone; moving a whole batch again for every block
    took ~40 % of a ViT-B/32 calibration's wall time on a GPU (docs/bench-scaling.md, the GPU check).
    """
    return {k: batch[k].to(device) for k in stack.mask_keys if isinstance(batch.get(k), torch.Tensor)}


@dataclass(frozen=True)
class ExpertReads:
    """Where the engine reads the experts' and the base's parameters from (core._checked_sources), and how.

    `prefetch`: read the experts' next block on a background thread (prefetch.py); off, every read is made on the
    main thread when the block needs it (the same values, later). `check_as_read`: the tasks whose tensors are
    checked for NaN / Inf as they are read (streamed experts not scanned before the run). `resident`
    (expert_placement.py): the experts are models on the device, used in place (nothing to read ahead)."""

    experts: dict[str, ParamSource]
    base: ParamSource | None
    prefetch: bool = True
    check_as_read: frozenset[str] | set[str] = frozenset()
    resident: bool = False


class RunContext:
    """One calibration's models, data and chains (see the module docstring). The device is the placement's."""

    def __init__(self, merged: nn.Module, template: nn.Module, adapter: Adapter, reads: ExpertReads,
                 calibration: dict[str, list[Batch]], config: FeatCalConfig, group: RankGroup,
                 placement: Placement) -> None:
        self.merged, self.template, self.adapter = merged, template, adapter
        self.experts, self.base, self.cfg = reads.experts, reads.base, config
        device = placement.device
        self.device, self.group, self.place = device, group, placement
        self.tasks = list(calibration)
        # this rank's share of every task's batches, with their global indices (the chain keys)
        self.shares = {t: [(b, calibration[t][b]) for b in group.shard(len(calibration[t]), t)] for t in self.tasks}
        dtype = next(merged.parameters()).dtype
        self.chains = ChainStore(config.chain_dtype, config.spill_dir, compute_dtype=dtype, device=device,
                                 home=placement.chain_home)
        # per task, the first batch of this rank's share: where the uncalibrated merge is followed end to end
        self.reference = {t: self.shares[t][0][0] for t in self.tasks if self.shares[t]}
        self.reader: BlockReader | None = None  # the engine's background reads of the next blocks (prefetch.py)
        self.check_as_read: set[str] = set(reads.check_as_read)  # tasks whose tensors are checked as they are read
        self.resident = reads.resident  # expert_placement.py: the template's parameters point at the experts' own
        self.block_tuning: Any = None  # tune_scope "block" (block_tuning.BlockTuning): what each block chose
        self.expert_tape: Any = None  # a search's candidates: the experts' block forwards kept (expert_tape.py)

    def batches(self, task: str) -> list[tuple[int, Batch]]:
        """(global batch index, batch) of this rank's share of `task`."""
        return self.shares[task]

    def on_device(self, batch: Batch) -> Batch:
        return to_device(batch, self.device)

    def masks(self, stack: Stack, batch: Batch) -> Batch:
        return masks_to_device(stack, batch, self.device)

    def load_expert(self, task: str, names: list[str]) -> None:
        """Expert `task`'s values of parameters `names`, read into the template model: taken from the reader
        when it read them ahead, else read here one tensor at a time (checked alike)."""
        values = self.reader.take(task, names) if self.reader is not None else None
        if values is None:
            values = checked_reads(self.experts[task], names, task in self.check_as_read)
        load = point_into if self.resident else copy_into
        load(self.template, values.items() if isinstance(values, dict) else values)

    def base_param(self, name: str) -> torch.Tensor | None:
        """The base's value of parameter `name` on the device (the anchor's θ0), None without a base."""
        return None if self.base is None else self.base.get(name).to(self.device)

    def load_solved(self, solved: solves.Solved) -> None:
        """Load solved values (every solve having read the merged ones first); every rank keeps rank 0's."""
        for p, value in solved.items():
            p.copy_(value.to(dtype=p.dtype, device=p.device))
        self.group.broadcast_([p.data for p in solved])  # bit for bit

    def reduced(self, drift: DriftSums) -> DriftSums:
        """`drift` summed over the ranks."""
        return drift.reduce(self.group, self.tasks)

    def tokens_per_task(self) -> dict[str, float]:
        """Token positions each task's merged chains hold, summed over the ranks (so every rank decides alike)."""
        local = torch.tensor([float(sum(self.chains.tokens(("m", t, b)) for b, _ in self.batches(t)))
                              for t in self.tasks], dtype=torch.float64)
        return dict(zip(self.tasks, self.group.reduce_values(local).tolist(), strict=True))

    def put_output(self, key: tuple, stack: Stack, layer: int, ctx: dict[str, Any], raw: Any) -> None:
        """Chain `key` <- the output `raw` of block `layer` called with context `ctx`, the context updated as
        the block passes it on (stored only when it changed)."""
        self.chains.put_hidden(key, hidden_of(raw))
        new_ctx = self.adapter.next_context(stack, layer, ctx, raw)
        if new_ctx is not ctx:
            self.chains.put_context(key, new_ctx)

    def advance(self, key: tuple, stack: Stack, layer: int, block: nn.Module) -> None:
        """Chain `key` <- block(chain `key`), its context updated as the block passes it on."""
        ctx = self.chains.context(key)
        raw = block(self.chains.hidden(key), **self.adapter.block_kwargs(stack, layer, ctx))
        self.put_output(key, stack, layer, ctx, raw)

    def class_token_weights(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Token weights (B, S) of x (B, S, d) in a class-token-read stack's last block: the class token 1, the
        others cls_token_weight, times the 0/1 mask if any (docs/method.md §4)."""
        w = torch.full(tuple(x.shape[:-1]), self.cfg.cls_token_weight, dtype=torch.float32, device=x.device)
        w[..., 0] = 1.0
        return w if mask is None else w * mask

    def block(self, stack: Stack, layer: int, n_blocks: int) -> BlockContext:
        return BlockContext(self, stack, layer, n_blocks)


@dataclass(frozen=True)
class BlockContext:
    """Block `layer` of `stack` (of `n_blocks`), as the gatherers see it."""

    run: RunContext
    stack: Stack
    layer: int
    n_blocks: int

    @property
    def merged(self) -> nn.Module:
        """The merged model's block."""
        return self.stack.blocks(self.run.merged)[self.layer]

    @property
    def expert(self) -> nn.Module:
        """The template's block, into which expert t's parameters are loaded."""
        return self.stack.blocks(self.run.template)[self.layer]

    def merged_modules(self) -> list[Calibrated]:
        return calibrated_modules(self.merged, self.run.adapter)

    def expert_modules(self, block: nn.Module | None = None) -> dict[str, Calibrated]:
        """The expert block's calibrated modules by name (of `block`: a copy of it)."""
        return {c.name: c for c in calibrated_modules(self.expert if block is None else block, self.run.adapter)}

    def param_names(self) -> list[str]:
        return block_param_names(self.run.merged, self.stack, self.layer)

    def kwargs(self, ctx: dict[str, Any]) -> dict[str, Any]:
        """What the block is called with besides its input, from a chain's context."""
        return self.run.adapter.block_kwargs(self.stack, self.layer, ctx)

    def call(self, block: nn.Module, key: tuple) -> tuple[dict[str, Any], Any]:
        """(the context, the raw output) of `block` run on chain `key`."""
        ctx = self.run.chains.context(key)
        return ctx, block(self.run.chains.hidden(key), **self.kwargs(ctx))

    def token_mask(self, batch: Batch, h: torch.Tensor) -> torch.Tensor | None:
        return self.run.adapter.token_mask(self.stack, batch, h)

    def class_token_weighted(self, name: str) -> bool:
        """Last block of a class-token-read stack: non-class tokens weigh less, except at k/v (docs/method.md §4)."""
        return self.stack.class_token_head and self.layer == self.n_blocks - 1 and not self.run.adapter.is_kv(name)

    def token_kind(self, name: str) -> tuple:
        """What a module's token weights depend on (modules sharing an input share statistics only if alike)."""
        return self.run.adapter.is_cross_module(self.stack, name), self.class_token_weighted(name)

    def weights(self, name: str, x: torch.Tensor, *, batch: Batch) -> torch.Tensor | None:
        """Token weights (B, S) for module `name`'s input x (B, S, d), docs/method.md §4; None when all are 1."""
        mask = self.run.adapter.module_mask(self.stack, batch, name, x)  # None: every token weighs 1
        if self.class_token_weighted(name):
            return self.run.class_token_weights(x, mask)
        return mask

    def teacher_form(self, plan: dict, linears_e: dict[str, nn.Module], tokens: float) -> dict:
        """{"output" module: (α, W_t)} for the modules whose teacher term is cheaper summed in the pass.

        Folding C_t W_tᵀ in costs in·in·out (float64) per task; the teacher form costs tokens·in·out
        (float32) in the pass, so it is taken when the task has fewer tokens than the module has inputs.
        """
        a = float(self.run.cfg.teacher_interp_alpha)
        tuning = self.run.block_tuning
        if a == 1.0 or (tuning is not None and "teacher_interp_alpha" in tuning.knobs):
            return {}  # the teacher form fixes α in the pass; a block that chooses α folds the other forms
        return {name: (a, weight_of(linears_e[name])) for name, p in plan.items()
                if p.mode == "output" and tokens * TEACHER_FORM_TOKENS_PER_INPUT < features(linears_e[name])[0]}

    def new_sums(self) -> NormalisedSums:
        """Empty cross-task sums for this block's solves."""
        cfg = self.run.cfg
        return NormalisedSums(cfg.teacher_interp_alpha, joint_bias=cfg.bias_solve == "joint")

    def solve(self, mods: list[Calibrated], sums: NormalisedSums) -> None:
        """Solve `mods` from `sums` and load the solution into the merged block (docs/method.md §5)."""
        prefix = f"{self.stack.blocks_path}.{self.layer}."
        self.run.load_solved(solves.solve_modules(self.run.cfg, self.run.base_param, prefix, mods, sums))

    def put_output(self, key: tuple, ctx: dict[str, Any], raw: Any) -> None:
        self.run.put_output(key, self.stack, self.layer, ctx, raw)

    def advance(self, key: tuple, block: nn.Module) -> None:
        self.run.advance(key, self.stack, self.layer, block)

    def advance_reference(self, task: str, b: int) -> None:
        """Batch `b` of `task` is the task's reference: its as-merged chain goes through the block as merged."""
        if self.run.reference.get(task) == b:
            self.run.advance(("r", task, b), self.stack, self.layer, self.merged)

    def propagate(self, bar) -> DriftSums:
        """hm(t) <- calibrated block(hm(t)) for every batch (docs/method.md §3); returns the drift after."""
        run, after = self.run, DriftSums()
        block_m = self.merged
        for t in run.tasks:
            for b, batch in run.batches(t):
                ctx_m, raw = self.call(block_m, ("m", t, b))
                he = run.chains.hidden(("e", t, b))
                after.add(t, hidden_of(raw), he, self.token_mask(run.masks(self.stack, batch), he))
                self.put_output(("m", t, b), ctx_m, raw)
                bar.update(1)
        return run.reduced(after)
