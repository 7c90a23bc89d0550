"""The exact method's arithmetic next to the forward floor (featcal.experiments.bench.cost)."""

import pytest
import transformers

from featcal.blocks.grams import gram_chunks
from featcal.experiments.bench.cost import arithmetic_cost_ratio, block_macs, gram_macs


def test_block_counts_match_a_hand_count():
    # d=2, m=4, n=3 (below the symmetric-Gram width): projections 4·d² + fc1/fc2 2·d·m + attention 2·n·d
    b = block_macs(hidden=2, intermediate=4, tokens=3)
    assert b.forward == 44
    # Grams: 3·d² + m² = 28; cross: q/k/v d², out d², fc1 d² (d < m), fc2 in×out m·d (< m²) = 12 + 8
    assert b.statistics == 28 + 20
    assert b.floor == 88 and b.exact_method == 3 * 44 + 48
    plain = block_macs(hidden=2, intermediate=4, tokens=3, symmetric=False, cheaper_cross=False)
    assert plain.statistics == 2 * (3 * 4 + 16)  # full Grams and in×in cross moments everywhere


def test_symmetric_gram_count_is_the_block_upper_triangle():
    for width in (100, 256, 768, 1000, 3072):
        k = gram_chunks(width)
        if k == 1:
            assert gram_macs(width) == width * width
            continue
        assert gram_macs(width) < width * width
        # equal chunks: (k+1)/(2k) of the full product; unequal ones within a row of it
        assert gram_macs(width) == pytest.approx(width * width * (k + 1) / (2 * k), rel=2 / width)
    assert gram_macs(768, symmetric=False) == 768 * 768


def test_statistics_keep_the_exact_method_well_above_the_floor():
    # the statistics alone cost most of a floor: no exact implementation can approach 1x
    for d, n in ((64, 17), (192, 17), (768, 50), (4096, 512)):
        b = block_macs(hidden=d, intermediate=4 * d, tokens=n)
        assert b.statistics / b.floor > 0.3
        assert b.ratio > 1.8
        assert b.ratio < block_macs(d, 4 * d, n, symmetric=False, cheaper_cross=False).ratio


def test_ratio_for_a_clip_vision_config():
    cfg = transformers.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, image_size=224, patch_size=32)
    assert arithmetic_cost_ratio(cfg) == pytest.approx(block_macs(768, 3072, 50).ratio)
    assert 2.1 < arithmetic_cost_ratio(cfg) < 2.3  # the count: about 2.2x (3.06x with the plain count)
    assert 3.0 < block_macs(768, 3072, 50, symmetric=False, cheaper_cross=False).ratio < 3.1
