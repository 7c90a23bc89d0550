"""The drift a run records (docs/method.md §9): mean over valid tokens of ‖hm − he‖² / ‖he‖², over tasks.

hm is the merged side's activation and he expert t's on task t's inputs; token weights are 1, padding 0
(docs/method.md §4). Per block the engine records it "before" (the block as merged) and "after" (the block
calibrated), both from forwards the method runs anyway (engine/driver.py).
"""

from __future__ import annotations

import torch

from featcal.calibration.maths.distributed import RankGroup


class DriftSums:
    """Σ over tokens of ‖hm−he‖²/‖he‖² and token counts per task, for one block (or one norm).

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

    def reduce(self, group: RankGroup, tasks: list[str]) -> DriftSums:
        """Sum the per-task sums and counts over the ranks (in place; a no-op in one process)."""
        self._read_back()
        if group.active:
            vals = torch.tensor([[self.sum.get(t, 0.0), self.count.get(t, 0.0)] for t in tasks], dtype=torch.float64)
            vals = group.reduce_values(vals).tolist()
            self.sum = {t: v[0] for t, v in zip(tasks, vals, strict=True)}
            self.count = {t: v[1] for t, v in zip(tasks, vals, strict=True)}
        return self
