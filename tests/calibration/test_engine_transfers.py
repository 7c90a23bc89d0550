"""What the engine moves to the calibration device, and when it waits on it (issue 19's GPU profile)."""

from __future__ import annotations

import pytest
import torch

import featcal.calibration.engine.context as context
from featcal import calibrate
from featcal.calibration.maths.drift import DriftSums
from tests.builders.reference_featcal import family_data, noisy_family


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_model_inputs_reach_the_device_once_per_batch(monkeypatch, kind):
    """Pixels / token ids feed the stem only: later blocks get the token masks and nothing else."""
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    whole, masks = [], []
    to_device, masks_to_device = context.to_device, context.masks_to_device
    monkeypatch.setattr(context, "to_device", lambda batch, device: whole.append(1) or to_device(batch, device))

    def counted(stack, batch, device):
        moved = masks_to_device(stack, batch, device)
        masks.append(sorted(moved))
        return moved

    monkeypatch.setattr(context, "masks_to_device", counted)
    calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    n_batches = sum(len(b) for b in data.values())
    assert len(whole) == n_batches  # the block-0 capture
    assert len(masks) > 2 * n_batches  # every block's statistics and propagation read masks
    assert all(keys == (["attention_mask"] if kind == "bert" else []) for keys in masks)


def test_drift_sums_on_the_device_equal_python_float_sums():
    """Summing per batch in float64 tensors, read back once, gives the bits of the float()-per-batch sums."""
    g = torch.Generator().manual_seed(0)
    drift, sums, counts = DriftSums(), {}, {}
    for i in range(7):
        task = f"t{i % 3}"
        hm, he = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
        mask = (torch.rand(3, 5, generator=g) > 0.3).float() if i % 2 else None
        drift.add(task, hm, he, mask)
        rel = (hm - he).pow(2).sum(-1) / he.pow(2).sum(-1).clamp_min(1e-12)
        m = torch.ones_like(rel) if mask is None else mask
        sums[task] = sums.get(task, 0.0) + float((rel * m).sum())
        counts[task] = counts.get(task, 0.0) + float(m.sum())
    expected = sum(sums[t] / counts[t] for t in sums) / len(sums)
    assert drift.mean() == expected
    assert drift.sum == sums and drift.count == counts
