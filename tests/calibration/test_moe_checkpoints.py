"""Issue 49.4: mixture-of-experts families calibrated from the checkpoint folders `save_pretrained` writes.

transformers 5 holds Mixtral's, Qwen2-MoE's, Qwen3-MoE's and PhiMoE's experts fused in 3-D parameters but writes
them one tensor per expert (`experts.0.w1.weight`, ...), as the hub's checkpoints hold them. `featcal calibrate`
reads an expert folder block by block and builds each fused parameter from its per-expert tensors with
transformers' own converter (io/read/conversions.py). Checked here: the folders really are per-expert; the fused
parameters read from them equal what from_pretrained builds; `featcal calibrate` on the folders writes a
checkpoint that from_pretrained loads, equal to the calibration of the same models held in memory (no
conversion), with the experts and the router at their merged values and featcal.json saying so.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from safetensors import safe_open

from featcal import FeatCalConfig, calibrate
from featcal.io.read.models import load_model
from featcal.io.read.param_sources import CheckpointSource
from tests.builders.guarantees import calibrate_argv, cli
from tests.builders.pipeline_family import saved_model_family
from tests.builders.reference_featcal import max_abs_diff

pytestmark = pytest.mark.usefixtures("one_thread")

H = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         vocab_size=100, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model type -> (config class, model class, fields, the router's parameter, a fused expert parameter)
MOE = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2),
                "mlp.gate.weight", "mlp.experts.gate_up_proj"),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32), "mlp.gate.weight", "mlp.experts.down_proj"),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
                  "mlp.gate.weight", "mlp.experts.gate_up_proj"),
    "phimoe": (T.PhimoeConfig, T.PhimoeForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2),
               "mlp.router.weight", "mlp.experts.gate_up_proj"),
}
CALIB = ("--num-calibration-examples", "4", "--calibration-batch-size", "2")


def _tiny(model_type: str) -> torch.nn.Module:
    cfg_cls, cls, fields, _, _ = MOE[model_type]
    torch.manual_seed(0)
    return cls(cfg_cls(**H, **fields)).eval()


def _saved_family(model_type: str, root) -> dict:
    """base, merged (with a tokenizer), two experts: saved by save_pretrained; JSONL texts per task."""
    return saved_model_family(_tiny(model_type), root)


def _keys(directory) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_fused_experts_are_read_from_per_expert_tensors_as_from_pretrained_builds_them(tmp_path):
    model = _tiny("mixtral")
    model.save_pretrained(tmp_path)
    keys = _keys(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys  # one tensor per expert, on disk
    assert not any(k.endswith("gate_up_proj") for k in keys)
    loaded = T.MixtralForCausalLM.from_pretrained(tmp_path)
    src = CheckpointSource(tmp_path, loaded, "expert")
    params = dict(loaded.named_parameters())
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert name in src and src.shape(name) == tuple(params[name].shape)
        assert torch.equal(src.get(name), params[name]), name
    assert set(src.keys()) == set(params)


@pytest.mark.parametrize("model_type", list(MOE))
def test_featcal_calibrate_runs_on_moe_checkpoint_folders_and_round_trips(model_type, tmp_path, capsys):
    _, _, _, router, fused = MOE[model_type]
    fam = _saved_family(model_type, tmp_path)
    assert any(".experts.0." in k for k in _keys(fam["experts"]["task0"]))  # the per-expert layout
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out", calib_flags=CALIB), capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())
    assert report["end_to_end_drift"]["calibrated"] < report["end_to_end_drift"]["merged"]
    kept = report["kept_merged"]["decoder"]
    assert "router" in kept[router.rpartition(".")[0]] and "experts" in kept[fused.rpartition(".")[0]]

    written = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    in_memory = calibrate(  # the same calibration with every model loaded: no conversion read on the way
        fam["merged"], base=load_model(fam["base"]), experts={t: load_model(d) for t, d in fam["experts"].items()},
        calibration=fam["data"], config=FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2),
        progress=False).model
    assert max_abs_diff(written, in_memory)[0] == 0.0
    merged = load_model(fam["merged"]).state_dict()
    out = written.state_dict()
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        assert torch.equal(out[p + router], merged[p + router]) and torch.equal(out[p + fused], merged[p + fused])
        assert not torch.equal(out[p + "self_attn.q_proj.weight"], merged[p + "self_attn.q_proj.weight"])


def test_every_verified_family_whose_checkpoints_need_a_conversion_is_calibrated_from_folders_here():
    """`featcal supported` lists a family only if `featcal calibrate` runs on its saved folders: the verified
    families whose save_pretrained output transformers converts back on load are the ones this file checks."""
    from transformers.core_model_loading import revert_weight_conversion

    from featcal.io.read.param_sources import checkpoint_key_map
    from tests.blocks.test_families import FAMILIES, tiny

    converted = set()
    for model_type in FAMILIES:
        model = tiny(model_type)
        conversions: dict = {}
        checkpoint_key_map(model, list(revert_weight_conversion(model, model.state_dict())), conversions)
        if conversions:
            converted.add(model_type)
    assert converted == set(MOE)
