"""block_statistics="sequential_one_pass" (issue 19): the sequential variant's statistics with one block forward
per batch and side, every forward paused at each stage while it is solved (calibration/engine/one_pass.py)."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.calibration.engine import driver as engine_mod
from featcal.calibration.engine.context import BlockContext
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family

SEQUENTIAL = FeatCalConfig(block_statistics="sequential")
ONE_PASS = FeatCalConfig(block_statistics="sequential_one_pass")


@pytest.mark.parametrize("kind", ["clip", "vit", "bert", "t5", "llama"])
def test_one_pass_solves_exactly_what_sequential_solves(kind):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    seq = calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False).model
    one = calibrate(merged, base=base, experts=experts, calibration=data, config=ONE_PASS, progress=False).model
    diff, where = max_abs_diff(one, seq)
    assert diff == 0.0, f"{kind}: {where} differs by {diff}"  # the same operations on the same inputs
    paper = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(one, paper)[0] > 1e-4  # and not the paper's method


def _count_block_forwards(monkeypatch, kind: str, config: FeatCalConfig) -> tuple[int, int, object]:
    """How often the first block's last Linear (fc2 / down_proj / dense) runs over a whole calibration."""
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    last = adapter_for(merged).stacks(merged)[0].blocks(merged)[0]
    mlp_out = last.mlp.fc2 if kind == "clip" else last.mlp.down_proj
    shape = (mlp_out.in_features, mlp_out.out_features)
    calls = [0]
    forward = torch.nn.Linear.forward

    def counting(self, x):
        if (self.in_features, self.out_features) == shape:
            calls[0] += 1
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    out = calibrate(merged, base=base, experts=experts, calibration=data, config=config, progress=False).model
    monkeypatch.setattr(torch.nn.Linear, "forward", forward)
    return calls[0], sum(len(b) for b in data.values()), (out, merged, experts)


@pytest.mark.parametrize("kind", ["clip", "llama"])
def test_one_pass_runs_each_block_once_per_batch_and_side(monkeypatch, kind):
    """Per block: every batch's merged and expert forward once (2 per batch), plus, per task, the block as
    merged on the first batch (the drift before) and on the reference chain, the stage-finding forward and the
    planning forward (one batch each); "sequential" runs the last Linear 4 times per batch in its statistics
    passes and once more in the propagation."""
    one, batches, _ = _count_block_forwards(monkeypatch, kind, ONE_PASS)
    seq, _, _ = _count_block_forwards(monkeypatch, kind, SEQUENTIAL)
    n_blocks = {"clip": 2, "llama": 2}[kind]
    tasks = len(noisy_family(kind)[1])
    stem_and_heads = seq - n_blocks * (5 * batches + tasks + 1)  # what neither mode spends in the blocks
    assert one == n_blocks * (2 * batches + 2 * tasks + 2) + stem_and_heads
    assert one < seq


def test_one_pass_drift_record_says_where_before_was_measured():
    base, experts, merged = noisy_family("clip")
    data = family_data("clip", experts)
    records = []
    original = engine_mod.FeatCalEngine._calibrate_block

    def spy(self, *a):
        original(self, *a)
        records.append(self.drift[-1])

    engine_mod.FeatCalEngine._calibrate_block = spy
    try:
        calibrate(merged, base=base, experts=experts, calibration=data, config=ONE_PASS, progress=False)
    finally:
        engine_mod.FeatCalEngine._calibrate_block = original
    assert records and all(r["before_batches"] == "the first of each task" for r in records)
    assert all(r["after"] < r["before"] for r in records)


def test_an_error_part_way_unwinds_every_paused_forward(monkeypatch):
    """A solve failing at a later stage leaves no forward paused (each is thrown out, not left to the garbage
    collector while the error is handled) and no hook on the model."""
    from featcal.calibration.engine import one_pass

    base, experts, merged = noisy_family("clip")
    data = family_data("clip", experts)
    calls = [0]
    original = BlockContext.solve
    made: list = []  # strong references: only the driver's own unwinding can end these forwards
    init = one_pass._Forward.__init__

    def tracked(self, *a):
        init(self, *a)
        made.append(self)

    def failing(self, *a):
        calls[0] += 1
        if calls[0] == 3:
            assert any(not fw.dead for fw in made)  # forwards are paused right now
            raise RuntimeError("solve failed")
        return original(self, *a)

    monkeypatch.setattr(one_pass._Forward, "__init__", tracked)
    monkeypatch.setattr(BlockContext, "solve", failing)
    with pytest.raises(RuntimeError, match="solve failed"):
        calibrate(merged, base=base, experts=experts, calibration=data, config=ONE_PASS, progress=False)
    assert made and all(fw.dead for fw in made)
    hooked = [m for m in merged.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert hooked == []


@pytest.mark.parametrize(("kind", "kill_after", "offload"), [("t5", 2, False), ("llama", 0, True)])
def test_one_pass_run_killed_after_a_block_resumes_bit_identical(kind, kill_after, offload, tmp_path, monkeypatch):
    """Per block, the one-pass mode advances and checkpoints the chains as the other modes do: T5 killed inside
    the decoder (position biases from the checkpoint), Llama with offloaded blocks (chains rewritten in place on
    the host)."""
    from tests.builders.reference_featcal import Crash, killed_after

    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    cfg = ONE_PASS.model_copy(update={"resume_dir": tmp_path / "state", "offload_blocks": offload})
    straight = calibrate(merged, base=base, experts=experts, calibration=data,
                         config=cfg.model_copy(update={"resume_dir": None}), progress=False)
    with killed_after(monkeypatch, kill_after), pytest.raises(Crash):
        calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    resumed = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    assert max_abs_diff(resumed.model, straight.model)[0] == 0.0
    assert resumed.drift == straight.drift
    seq = calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False).model
    assert max_abs_diff(straight.model, seq)[0] == 0.0
