"""The experts' tape (expert_tape.py): a search's candidates replay the experts' block forwards that the first
one recorded. It must change nothing but the time: every calibration with a tape is the calibration without
one, bit for bit, whichever merge recorded it; and it is never read for other data or another config."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig
from featcal.calibration.core import setting as core
from featcal.calibration.engine.driver import SearchHooks
from featcal.calibration.engine.expert_tape import ExpertTape
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, ta_merge


@pytest.fixture(scope="module", params=["bert", "llama", "t5"])
def family(request):
    kind = request.param
    base, experts, _ = noisy_family(kind, n_experts=2)
    return base, experts, family_data(kind, experts, n_batches=2)


def _calibrate(merged, base, experts, data, cfg, tape=None, end_to_end=True):
    return core.calibrate_setting(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                                  search=SearchHooks(end_to_end=end_to_end, expert_tape=tape))


def test_a_tape_recorded_on_one_merge_replays_for_another_bit_for_bit(family):
    """Candidate 1 (TA 0.3, the paper's knobs) records; candidate 2 (TA 0.9, other ρ, λ, α) replays: its
    weights equal a plain calibration of that merge at those knobs exactly, and the tape was read."""
    base, experts, data = family
    tape = ExpertTape(2**30)
    cfg = FeatCalConfig(resume=False)
    _calibrate(ta_merge(base, experts, 0.3), base, experts, data, cfg, tape)
    recorded = len(tape.entries)
    assert recorded > 0 and tape.replayed == 0
    other = cfg.model_copy(update={"anchor_blend_rho": 4.0, "lambda_ratio": 0.2, "teacher_interp_alpha": 0.5})
    replayed = _calibrate(ta_merge(base, experts, 0.9), base, experts, data, other, tape)
    plain = _calibrate(ta_merge(base, experts, 0.9), base, experts, data, other)
    assert tape.replayed == recorded  # every expert forward of the second run came from the tape
    assert max_abs_diff(plain.model, replayed.model)[0] == 0.0
    assert [r["after"] for r in plain.drift] == [r["after"] for r in replayed.drift]


def test_the_tape_is_emptied_for_other_data_or_another_config(family):
    """Bound to other batches (or a config that differs beyond the searched knobs) the tape forgets what it
    held before any block reads it: the result is still the plain calibration of those inputs."""
    base, experts, data = family
    tape = ExpertTape(2**30)
    cfg = FeatCalConfig(resume=False)
    _calibrate(ta_merge(base, experts, 0.3), base, experts, data, cfg, tape)
    shifted = {t: [{k: v.clone() if k != "pixel_values" else v + 0.5 for k, v in b.items()} for b in bs]
               for t, bs in data.items()}
    for bs in shifted.values():  # new values for the token ids too: another data set
        for b in bs:
            if "input_ids" in b:
                b["input_ids"] = torch.flip(b["input_ids"], dims=[-1])
    merged = ta_merge(base, experts, 0.3)
    replayed = _calibrate(merged, base, experts, shifted, cfg, tape)
    assert tape.replayed == 0
    plain = _calibrate(merged, base, experts, shifted, cfg)
    assert max_abs_diff(plain.model, replayed.model)[0] == 0.0
    before = len(tape.entries)
    _calibrate(merged, base, experts, shifted, cfg.model_copy(update={"cls_token_weight": 0.5}), tape)
    assert tape.replayed == 0 and len(tape.entries) == before  # emptied, then recorded again


def test_a_full_tape_stops_recording_and_changes_nothing(family):
    """A tape too small for the whole run keeps what fits; the rest is recomputed; weights unchanged."""
    base, experts, data = family
    cfg = FeatCalConfig(resume=False)
    probe = ExpertTape(2**30)
    _calibrate(ta_merge(base, experts, 0.3), base, experts, data, cfg, probe)
    small = ExpertTape(probe.nbytes // 2)
    _calibrate(ta_merge(base, experts, 0.3), base, experts, data, cfg, small)
    assert small.full and 0 < len(small.entries) < len(probe.entries) and small.nbytes <= probe.nbytes // 2
    merged = ta_merge(base, experts, 0.6)
    replayed = _calibrate(merged, base, experts, data, cfg, small)
    assert 0 < small.replayed < len(probe.entries)
    assert max_abs_diff(_calibrate(merged, base, experts, data, cfg).model, replayed.model)[0] == 0.0


def test_a_candidate_without_the_end_to_end_drift_has_the_same_weights(family):
    """end_to_end off (a search's candidates): no reference chain, no record, the same calibration."""
    base, experts, data = family
    cfg = FeatCalConfig(resume=False)
    merged = ta_merge(base, experts, 0.3)
    plain = _calibrate(merged, base, experts, data, cfg)
    bare = _calibrate(merged, base, experts, data, cfg, end_to_end=False)
    assert plain.end_to_end is not None and bare.end_to_end is None
    assert max_abs_diff(plain.model, bare.model)[0] == 0.0
