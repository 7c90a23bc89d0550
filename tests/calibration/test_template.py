"""The lean expert template (calibration/engine/template.py): its blocks hold no storage except the one being calibrated,
and the calibrated model is the one a full copy of the merged model as template gives, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from featcal import FeatCalConfig
from featcal.blocks.adapters import adapter_for
from featcal.calibration.core import setting as core
from featcal.calibration.engine import driver as engine
from featcal.calibration.engine.template import block_storage, expert_template
from tests.builders.reference_featcal import family_data, noisy_family


def _block_params(model, stacks):
    return [(si, layer, p) for si, s in enumerate(stacks) for layer, b in enumerate(s.blocks(model))
            for p in b.parameters()]


@pytest.mark.parametrize("kind", ["clip", "t5", "llama"])
def test_the_template_copies_the_stems_only(kind):
    _, _, merged = noisy_family(kind)
    stacks = adapter_for(merged).stacks(merged)
    template = expert_template(merged, stacks)
    in_blocks = {id(p) for _, _, p in _block_params(template, stacks)}
    assert in_blocks and all(p.numel() == 0 for _, _, p in _block_params(template, stacks))
    names_m = dict(merged.named_parameters(remove_duplicate=False))
    for name, p in template.named_parameters(remove_duplicate=False):
        assert p.dtype == names_m[name].dtype
        if id(p) not in in_blocks:  # a stem: a copy with the merged values, not the merged tensor itself
            assert torch.equal(p, names_m[name]) and p.data_ptr() != names_m[name].data_ptr()
    tied_m = {n for n, _ in merged.named_parameters(remove_duplicate=False)} - dict(merged.named_parameters()).keys()
    tied_t = {n for n, _ in template.named_parameters(remove_duplicate=False)} - dict(template.named_parameters()).keys()
    assert tied_t == tied_m  # tied parameters stay tied


def test_block_storage_is_given_back_also_on_failure():
    _, _, merged = noisy_family("llama")
    stacks = adapter_for(merged).stacks(merged)
    template = expert_template(merged, stacks)
    expert_block, merged_block = stacks[0].blocks(template)[0], stacks[0].blocks(merged)[0]
    with pytest.raises(RuntimeError, match="boom"), block_storage(expert_block, merged_block):
        shapes = {n: p.shape for n, p in expert_block.named_parameters()}
        assert shapes == {n: p.shape for n, p in merged_block.named_parameters()}
        raise RuntimeError("boom")
    assert all(p.numel() == 0 for p in expert_block.parameters())


def _calibrate(fam, **options):
    merged, base, experts, data = fam
    cfg = FeatCalConfig(**options)
    return core.calibrate_setting(copy.deepcopy(merged), base=base, experts=experts, calibration=data, config=cfg,
                                  progress=False, resident=False)


@pytest.mark.parametrize("kind,options", [
    ("clip", {}),
    ("t5", {"block_statistics": "sequential"}),
    ("llama", {"offload_blocks": True}),
    ("llama", {"calibrate_final_norm": True}),
])
def test_one_block_at_a_time_and_the_same_model_as_a_full_template(kind, options, monkeypatch):
    base, experts, merged = noisy_family(kind)
    fam = (merged, base, experts, family_data(kind, experts))
    held: list[int] = []  # template blocks holding storage, seen from inside each block's statistics
    gatherer = engine.BLOCK_STATISTICS[options.get("block_statistics", "as_merged")]

    def watching(block, bar):
        blocks = [b for s in block.run.adapter.stacks(block.run.template) for b in s.blocks(block.run.template)]
        held.append(sum(any(p.numel() for p in b.parameters()) for b in blocks))
        return gatherer(block, bar)

    monkeypatch.setitem(engine.BLOCK_STATISTICS, options.get("block_statistics", "as_merged"), watching)
    lean = _calibrate(fam, **options)
    assert held and set(held) == {1}
    monkeypatch.setattr(core, "expert_template", lambda model, stacks: copy.deepcopy(model))
    full = _calibrate(fam, **options)
    sl, sf = lean.model.state_dict(), full.model.state_dict()
    assert sl.keys() == sf.keys() and all(torch.equal(sl[k], sf[k]) for k in sl)
    assert [r.after for r in lean.drift] == [r.after for r in full.drift]
