"""block_statistics="sequential" (issue 17 variant): each module's statistics taken on the block whose earlier
modules are already calibrated, checked against the dense reference solving one module at a time."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.blocks.discovery import calibrated_modules
from featcal.calibration.engine import gather
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, reference_calibrate

SEQUENTIAL = FeatCalConfig(block_statistics="sequential")


@pytest.mark.parametrize("kind", ["clip", "bert", "t5", "llama"])
def test_sequential_engine_equals_the_dense_one_module_at_a_time_reference(kind):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    out = calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False).model
    ref = reference_calibrate(merged, base, experts, data, SEQUENTIAL, sequential=True)
    diff, where = max_abs_diff(out, ref)
    assert diff < 1e-5, f"{kind}: {where} differs by {diff}"
    paper = reference_calibrate(merged, base, experts, data, SEQUENTIAL, sequential=False)
    assert max_abs_diff(out, paper)[0] > 1e-4  # the variant is not the paper's method
    again = calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False).model
    assert max_abs_diff(out, again)[0] == 0.0  # deterministic


def test_first_module_of_each_block_is_solved_as_the_paper_does():
    """Block 0's first stage sees the block as merged, so its solve equals the paper's (only later ones differ)."""
    base, experts, merged = noisy_family("bert")
    data = family_data("bert", experts)
    seq = calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False).model
    paper = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    s, p = seq.state_dict(), paper.state_dict()
    first = "encoder.layer.0.attention.self."  # q/k/v: the block's first stage, reading the block input
    for name in ("query", "key", "value"):
        assert torch.equal(s[first + name + ".weight"], p[first + name + ".weight"]), name
    assert not torch.equal(s["encoder.layer.0.output.dense.weight"], p["encoder.layer.0.output.dense.weight"])


def test_stages_follow_the_forward_and_group_shared_inputs(monkeypatch):
    base, experts, merged = noisy_family("llama")
    data = family_data("llama", experts)
    seen: list[list[list[str]]] = []
    original = gather.stages

    def spy(block, mods):
        stages = original(block, mods)
        seen.append([[c.name for c in s] for s in stages])
        return stages

    monkeypatch.setattr(gather, "stages", spy)
    calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False)
    adapter = adapter_for(merged)
    blocks = adapter.stacks(merged)[0].blocks(merged)
    assert len(seen) == len(blocks)
    assert seen[0] == [["input_layernorm"], ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                       ["self_attn.o_proj"], ["post_attention_layernorm"], ["mlp.gate_proj", "mlp.up_proj"],
                       ["mlp.down_proj"]]
    every = {c.name for c in calibrated_modules(blocks[0], adapter)}
    assert {n for stage in seen[0] for n in stage} == every


def test_block_statistics_is_validated_and_a_cli_flag():
    from featcal.cli.calibrate_args import config_from_args
    from featcal.cli.main import build_parser
    from featcal.config import parse
    from featcal.errors import ConfigError

    with pytest.raises(ConfigError, match="block_statistics"):
        parse(FeatCalConfig, {"block_statistics": "forward"})
    assert FeatCalConfig().block_statistics == "as_merged"
    args = build_parser().parse_args(["calibrate", "--block-statistics", "sequential", "--base", "b", "--merged", "m",
                                      "--expert", "a=e", "--calib", "a=c", "--out", "o"])
    assert config_from_args(args, FeatCalConfig).block_statistics == "sequential"


def test_each_stage_runs_only_the_forward_its_statistics_need(monkeypatch):
    """Issue 19: on Llama (stages: norm, q/k/v, o, norm, gate/up, down) the statistics passes run a batch's
    down_proj 4 times per block, not 12 (6 stages x 2 sides): the expert and the merged block whole in the
    first stage (the drift before) and in the down stage (where the expert chains advance); the norm stages
    run no expert forward, and the other stages stop both sides once their own modules have run."""
    import traceback

    base, experts, merged = noisy_family("llama")
    data = family_data("llama", experts)
    layers = merged.model.layers
    down = layers[0].mlp.down_proj
    shape = (down.in_features, down.out_features)
    calls = {"statistics": 0, "other": 0}
    forward = torch.nn.Linear.forward

    def counting(self, x):
        if (self.in_features, self.out_features) == shape:
            frames = {f.name for f in traceback.extract_stack()}
            calls["statistics" if "gather" in frames and "advance" not in frames else "other"] += 1
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    calibrate(merged, base=base, experts=experts, calibration=data, config=SEQUENTIAL, progress=False)
    batches = sum(len(b) for b in data.values())
    assert calls["statistics"] == len(layers) * 4 * batches
    assert calls["other"] >= len(layers) * batches  # the propagation through each calibrated block
