"""The exact method's arithmetic next to the forward floor (featcal.experiments.bench.cost)."""

import pytest
import transformers

from featcal.experiments.bench.cost import arithmetic_cost_ratio, block_macs


def test_block_counts_match_a_hand_count():
    # d=2, m=4, n=3: projections 4·d² + fc1/fc2 2·d·m + attention 2·n·d = 16 + 16 + 12
    b = block_macs(hidden=2, intermediate=4, tokens=3)
    assert b.forward == 44
    assert b.statistics == 2 * (3 * 4 + 16)  # xs·xsᵀ and xs·xeᵀ: q/k/v's shared input, out, fc1 (d²), fc2 (m²)
    assert b.floor == 88 and b.exact_method == 3 * 44 + 56
    assert b.ratio == pytest.approx(188 / 88)


def test_statistics_alone_exceed_the_issue_budget_at_every_width():
    # why 1.3× the floor is out of reach for the exact method: the Grams alone cost more than that
    for d, n in ((64, 17), (192, 17), (768, 50), (4096, 512)):
        b = block_macs(hidden=d, intermediate=4 * d, tokens=n)
        assert b.statistics / b.floor > 1.3
        assert b.ratio > 2.5


def test_ratio_for_a_clip_vision_config():
    cfg = transformers.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, image_size=224, patch_size=32)
    assert arithmetic_cost_ratio(cfg) == pytest.approx(block_macs(768, 3072, 50).ratio)
    assert 3.0 < arithmetic_cost_ratio(cfg) < 3.1
