"""Issue 49.3 and its minor items: mixtures of experts' routers and experts found by structure, stacks named by it.

A router is the one weight matrix scoring every expert beside them (blocks/discovery.py): found whether
transformers made it a module of its own (Mixtral's gate) or a plain / subclassed `nn.Linear` (PhiMoE's `router`,
JetMoE's `router.layer`, Switch Transformers' `router.classifier`), and kept at its merged value, recorded as a
router. 3-D parameters that no router scores (XLNet's attention) are no experts. A lone stack whose attention does
not say whether it is causal (MPT, BLOOM) is named from transformers' registry of causal-LM heads.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from torch import nn

from featcal import calibrate
from featcal.blocks import catalog
from featcal.blocks.discovery import OTHER, ROUTED_EXPERTS, ROUTER, calibrated_modules, kept_merged
from featcal.calibration.engine.hooks import ExpertRecorder
from featcal.errors import FeatCalError
from tests.blocks.test_families import batches
from tests.builders.tiny import family_of

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model type -> (model, the block holding experts, its router's module, its experts' module)
ROUTED = {
    "phimoe": (lambda: T.PhimoeForCausalLM(T.PhimoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, **IDS)),
        "model.layers.0", "mlp.router", "mlp.experts"),
    "jetmoe": (lambda: T.JetMoeForCausalLM(T.JetMoeConfig(
        hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=100, max_position_embeddings=64, **IDS)),
        "model.layers.0", "mlp.router.layer", "mlp.input_linear"),
    "switch_transformers": (lambda: T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        encoder_sparse_step=2, decoder_sparse_step=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        "encoder.block.1", "layer.1.mlp.router.classifier", "layer.1.mlp.experts"),
}


@pytest.mark.parametrize("model_type", list(ROUTED))
def test_routers_that_are_linear_layers_keep_their_merged_values(model_type):
    make, block_path, router, experts = ROUTED[model_type]
    torch.manual_seed(0)
    model = make().eval()
    block = model.get_submodule(block_path)
    assert isinstance(block.get_submodule(router), nn.Linear)  # what made them look like dense layers
    names = [c.name for c in calibrated_modules(block)]
    assert names and not any(n == router or n.startswith(router + ".") for n in names)
    kept = kept_merged(block)
    assert kept[router] == ROUTER and kept[experts] == ROUTED_EXPERTS

    base, tasks, merged = family_of(model)
    result = calibrate(merged, base=base, experts=tasks, calibration=batches(merged, tasks), progress=False)
    assert result.end_to_end["calibrated"] < result.end_to_end["merged"]
    stack = "encoder" if model_type == "switch_transformers" else "decoder"
    assert result.kept_merged[stack][router] == ROUTER
    before, after = merged.state_dict(), result.model.state_dict()
    routers = [k for k in before if k.startswith(block_path + ".") and f".{router}." in f".{k[len(block_path) + 1:]}"]
    assert routers and all(torch.equal(after[k], before[k]) for k in routers)
    assert any(not torch.equal(after[k], before[k]) for k in before if k.startswith(block_path + "."))


class _Fused(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(n, 2 * d, d))
        self.down = nn.Parameter(torch.randn(n, d, d))


class _Moe(nn.Module):
    def __init__(self, d: int = 4, n: int = 3):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)  # a plain Linear scoring the n experts
        self.experts = _Fused(n, d)
        self.shared = nn.Sequential(nn.Linear(d, 2 * d), nn.Linear(2 * d, d))  # every token: calibrated
        self.shared_gate = nn.Linear(d, 1)  # a 1-output gate: not a router of 3 experts


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = _Moe()


def test_the_router_is_found_by_structure_and_dense_layers_beside_it_are_calibrated():
    block = _Block()
    assert [c.name for c in calibrated_modules(block)] == ["attn", "mlp.shared.0", "mlp.shared.1", "mlp.shared_gate"]
    assert kept_merged(block) == {"mlp.router": ROUTER, "mlp.experts": ROUTED_EXPERTS}


def test_three_dimensional_parameters_no_router_scores_are_no_experts():
    """XLNet stores its attention projections as (d_model, heads, head_dim) tensors: kept, but not as experts."""
    block = _Block()
    block.mlp.router = nn.Linear(4, 5)  # scores 5 of something, not the 3 experts
    assert kept_merged(block)["mlp.experts"] == OTHER
    assert "mlp.router" in [c.name for c in calibrated_modules(block)]
    xlnet = catalog.verdict("xlnet")
    assert xlnet["supported"] and xlnet["stacks"][0]["kept_merged"] == {"rel_attn": OTHER}


@pytest.mark.parametrize("model_type,stack", [("mpt", "decoder"), ("bloom", "decoder"), ("xglm", "decoder"),
                                              ("deberta-v2", "encoder"), ("bert", "encoder"), ("llama", "decoder")])
def test_a_lone_stack_is_named_decoder_or_encoder_by_structure(model_type, stack):
    v = catalog.verdict(model_type)
    assert v["supported"] and [s["stack"] for s in v["stacks"]] == [stack]


def test_a_linear_layer_returning_more_than_its_output_is_refused_in_words():
    class Scoring(nn.Linear):  # PhiMoE's router, were it calibrated: (logits, weights, experts)
        def forward(self, x):
            y = super().forward(x)
            return y, y.softmax(-1), y.argmax(-1)

    mod = Scoring(4, 3)
    with ExpertRecorder({"mlp.router": mod}, None), pytest.raises(FeatCalError, match="returns a tuple"):
        mod(torch.randn(2, 4))
