"""Issue 36: FeatCal on any block-stacked transformer, found from the model's structure.

For every model type in blocks/catalog.py's VERIFIED (32, built from transformers' own config classes, tiny
and random, 1-2 blocks): calibration runs, the end-to-end drift goes down, the output loads with
from_pretrained, and the calibrated parameters equal the dense reference (tests/builders/reference_featcal.py). Then:
recurrent / shared-layer models are refused from the config alone in under a second, before any weight is
read; the families the hand-written adapters served are found exactly as those adapters found them; the
generated docs page is current.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import transformers as T
from torch import nn

from featcal import FeatCalConfig, calibrate
from featcal.blocks import catalog
from featcal.blocks.adapters import adapter_for
from featcal.blocks.capture import capture_block_input
from featcal.blocks.discovery import calibrated_modules
from featcal.blocks.support import check_config
from featcal.errors import UnsupportedModelError
from tests.builders.reference_featcal import max_abs_diff, reference_calibrate
from tests.builders.tiny import family_of

pytestmark = pytest.mark.usefixtures("one_thread")

SL, FU = "sliding_attention", "full_attention"
H = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
         max_position_embeddings=64)
KV = dict(num_key_value_heads=2)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
TOWERS = dict(text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2),
              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4))
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4)

# model type -> (config class, model class, config fields); "text", "vision" or "seq2seq" data follows the config
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(**H, **KV)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(**H, **KV, sliding_window=4)),  # window < 8 tokens
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM,  # a sliding window on the upper layer: two layer types
              dict(**H, **KV, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(**H, **KV, head_dim=8)),  # per-head q/k norms
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,  # a shared expert beside the routed ones, on flat tokens
                  dict(**H, **KV, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(**H, **KV, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(**H, **KV, **IDS, num_local_experts=4, num_experts_per_tok=2)),
    "phimoe": (T.PhimoeConfig, T.PhimoeForCausalLM,  # a router that is an nn.Linear: kept merged
               dict(**H, **KV, **IDS, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(**H, **KV, **IDS)),  # fused qkv and gate/up
    "phi": (T.PhiConfig, T.PhiForCausalLM, dict(**H, **IDS)),  # parallel attention and MLP, partial rotary
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(**H, **KV, head_dim=8)),  # z·(1 + w) norms
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(**H, **KV, head_dim=8, sliding_window=3)),
    "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                    dict(**H, **KV, head_dim=8, sliding_window=3, layer_types=[SL, FU])),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, dict(**H, **KV, **IDS)),  # q/k norms over all heads
    "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(**H, **KV, **IDS)),  # centred, weight-only norms
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel,  # Conv1D: weights stored in×out
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=100, bos_token_id=1, eos_token_id=2)),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(**H, bos_token_id=1, eos_token_id=2)),
    "falcon": (T.FalconConfig, T.FalconForCausalLM,  # adds the attention output into the MLP's, in place
               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=100, bos_token_id=1,
                    eos_token_id=2)),
    "bert": (T.BertConfig, T.BertModel, dict(**H)),
    "roberta": (T.RobertaConfig, T.RobertaForSequenceClassification, dict(**H)),
    "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaModel, dict(**H)),
    "deberta-v2": (T.DebertaV2Config, T.DebertaV2Model, dict(**H)),
    "distilbert": (T.DistilBertConfig, T.DistilBertModel,
                   dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=100, max_position_embeddings=64)),
    "modernbert": (T.ModernBertConfig, T.ModernBertModel,  # global + local attention; weights large enough to matter
                   dict(**H, **IDS, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=4,
                        initializer_range=0.3)),
    "electra": (T.ElectraConfig, T.ElectraModel, dict(**H, embedding_size=16)),  # a stem projection before block 0
    "clip": (T.CLIPConfig, T.CLIPModel, dict(**TOWERS, projection_dim=8)),  # the vision tower of a dual encoder
    "siglip": (T.SiglipConfig, T.SiglipModel, dict(**TOWERS)),  # no class token: every token counts
    "vit": (T.ViTConfig, T.ViTForImageClassification, dict(**VISION, intermediate_size=64)),
    "dinov2": (T.Dinov2Config, T.Dinov2Model, dict(**VISION, mlp_ratio=2)),  # LayerScale kept merged
    "t5": (T.T5Config, T.T5ForConditionalGeneration,
           dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "mt5": (T.MT5Config, T.MT5ForConditionalGeneration,
            dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "bart": (T.BartConfig, T.BartForConditionalGeneration,
             dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)),
}


def tiny(model_type: str, seed: int = 0) -> nn.Module:
    cfg_cls, cls, fields = FAMILIES[model_type]
    torch.manual_seed(seed)
    return cls(cfg_cls(**fields)).eval()


def batches(model: nn.Module, tasks, seed: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """One batch per task of what the model reads: two images, or two texts of 8 tokens (the second padded)."""
    out = {}
    for i, t in enumerate(tasks):
        g = torch.Generator().manual_seed(seed + i)
        if model.main_input_name == "pixel_values" or hasattr(model, "vision_model"):
            out[t] = [{"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}]
            continue
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, -3:] = 0
        batch = {"input_ids": torch.randint(3, 100, (2, 8), generator=g), "attention_mask": mask}
        if model.config.is_encoder_decoder:
            batch["decoder_input_ids"] = torch.randint(3, 100, (2, 5), generator=g)
        out[t] = [batch]
    return out


def test_the_verified_list_is_what_this_file_calibrates():
    assert set(FAMILIES) == set(catalog.VERIFIED) and len(FAMILIES) >= 25
    assert all(tiny(t).config.model_type == t for t in ("xlm-roberta", "deberta-v2", "gemma3_text", "mt5"))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_calibration_lowers_the_drift_loads_and_equals_the_reference(model_type, tmp_path):
    base, experts, merged = family_of(tiny(model_type))
    data = batches(merged, experts)
    result = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    out = result.model
    e2e = result.end_to_end
    assert e2e["calibrated"] < e2e["merged"], e2e
    changed = {k for k, v in out.state_dict().items() if not torch.equal(v, merged.state_dict()[k])}
    stacks = adapter_for(out).stacks(out)
    assert changed and all(any(k.startswith(s.blocks_path + ".") for s in stacks) for k in changed)
    out.save_pretrained(tmp_path)
    back = type(out).from_pretrained(tmp_path)
    assert max_abs_diff(back, out)[0] == 0.0
    diff, where = max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))
    assert diff < 1e-5, (diff, where)


# --- what the structure tells -----------------------------------------------------------------------

def test_conv1d_weights_are_solved_in_their_stored_layout():
    """GPT-2's Conv1D stores W as in×out: a calibrated c_attn keeps that shape and its output moves toward the experts'."""
    model = tiny("gpt2")
    kinds = {c.name: (c.kind, c.transposed) for c in calibrated_modules(model.transformer.h[0])}
    assert kinds["attn.c_attn"] == ("linear", True) and kinds["ln_1"] == ("layernorm", False)
    base, experts, merged = family_of(model)
    out = calibrate(merged, base=base, experts=experts, calibration=batches(merged, experts), progress=False).model
    w = out.transformer.h[0].attn.c_attn.weight
    assert w.shape == merged.transformer.h[0].attn.c_attn.weight.shape == (32, 96)
    assert not torch.equal(w, merged.transformer.h[0].attn.c_attn.weight)


@pytest.mark.parametrize("model_type,offset", [("llama", 0.0), ("gemma", 1.0), ("qwen3", 0.0), ("cohere", 0.0)])
def test_norms_are_found_by_what_they_compute(model_type, offset):
    """RMS norms z·w and z·(1 + w), Qwen3's per-head q/k norms, Cohere's centred weight-only norm: by probing."""
    model = tiny(model_type)
    block = model.model.layers[0]
    norms = {c.name: c.form for c in calibrated_modules(block) if c.kind != "linear"}
    assert norms and all(f.offset == offset for f in norms.values())
    assert all(f.centred == (model_type == "cohere") for f in norms.values())
    if model_type == "qwen3":
        assert {"self_attn.q_norm", "self_attn.k_norm"} <= set(norms)


def test_mixture_of_experts_keep_their_experts_merged_and_say_so(caplog):
    """Routed experts and the router keep their merged values; attention and norms are calibrated; log and record."""
    base, experts, merged = family_of(tiny("qwen3_moe"))
    with caplog.at_level("WARNING", logger="featcal"):
        result = calibrate(merged, base=base, experts=experts, calibration=batches(merged, experts), progress=False)
    sm, so = merged.state_dict(), result.model.state_dict()
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        assert torch.equal(so[p + "mlp.experts.gate_up_proj"], sm[p + "mlp.experts.gate_up_proj"])
        assert torch.equal(so[p + "mlp.gate.weight"], sm[p + "mlp.gate.weight"])
        assert not torch.equal(so[p + "self_attn.q_proj.weight"], sm[p + "self_attn.q_proj.weight"])
    kept = result.kept_merged["decoder"]
    assert "mixture-of-experts" in kept["mlp.experts"] and "mlp.gate" in kept
    assert any("mlp.experts keep(s) the merged values" in r.getMessage() for r in caplog.records)


def test_expert_lists_of_linears_are_not_calibrated_as_dense_layers():
    """Experts held as a list of Linear sub-networks (not transformers 5's fused tensors) are kept merged too."""
    from featcal.blocks.discovery import kept_merged

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.experts = nn.ModuleList([Expert(), Expert()])

    block = Block()
    assert [c.name for c in calibrated_modules(block)] == ["attn"]
    assert "mixture-of-experts" in kept_merged(block)["experts"]


def test_sliding_window_layers_get_their_own_masks_in_calibration():
    """Qwen2 with sliding and full layers: each block's statistics see its own type's mask (a reference that
    replays block 0's mask everywhere disagrees)."""
    model = tiny("qwen2")
    (stack,) = adapter_for(model).stacks(model)
    assert stack.layer_types == (FU, SL)
    base, experts, merged = family_of(model)
    data = batches(merged, experts)
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))[0] < 1e-5


def test_what_runs_between_blocks_is_refused_at_the_first_batch():
    """A model that changes the hidden states between two blocks is refused by the replay check, not calibrated."""
    from featcal.blocks.adapters import StructuralAdapter
    from featcal.calibration.engine.driver import check_context_replay
    from featcal.errors import FeatCalError

    model = tiny("llama")
    adapter = StructuralAdapter(model)
    (stack,) = adapter.stacks(model)
    # what the model does to the hidden states after block 0 and before block 1 (DeBERTa's optional conv does)
    handle = model.model.layers[1].register_forward_pre_hook(lambda _m, args: (args[0] * 2, *args[1:]))
    try:
        mod, kw = adapter.stack_call(model, stack, batches(model, ["a"])["a"][0], None)
        with torch.no_grad():
            h, ctx = adapter.capture(mod, stack, model, kw)
            with pytest.raises(FeatCalError, match="block 1's input is not block 0's output"):
                check_context_replay(adapter, stack, model, mod, kw, h, ctx)
    finally:
        handle.remove()


# --- refused from the config alone ------------------------------------------------------------------

@pytest.mark.parametrize("model_type,part", [
    ("mamba", "linear_attention layers"), ("jamba", "linear_attention layers"),
    ("rwkv", "attention \\(RwkvSelfAttention\\)"), ("albert", "share parameters"),
])
def test_unsupported_types_are_refused_from_the_config_in_under_a_second(model_type, part):
    config = T.AutoConfig.for_model(model_type)  # full-size defaults: nothing is allocated on the meta device
    check_config(T.AutoConfig.for_model("bert"))  # imports warm
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=part):
        check_config(config)
    assert time.perf_counter() - start < 1.0
    assert model_type in catalog.REFUSED


def test_calibrate_refuses_an_unsupported_checkpoint_before_loading_weights(tmp_path, capsys, monkeypatch):
    """featcal calibrate on a Mamba family: one line naming the recurrent layers, no model loaded, under a second."""
    from featcal.calibration.front import pipeline
    from tests.builders.guarantees import calibrate_argv, cli, one_line_error

    model = T.MambaForCausalLM(T.MambaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, state_size=4))
    dirs = {}
    for name in ("base", "merged", "e0", "e1"):
        model.save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    fam = {"base": dirs["base"], "merged": dirs["merged"], "experts": {"a": dirs["e0"], "b": dirs["e1"]},
           "data": {"a": tmp_path / "d.jsonl", "b": tmp_path / "d.jsonl"}}
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    start = time.perf_counter()
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert time.perf_counter() - start < 1.0
    assert rc == 2 and "linear_attention layers" in one_line_error(err) and not (tmp_path / "out").exists()


# --- today's families: found exactly as the hand-written adapters found them -------------------------

# what the adapters of featcal 0.1 (blocks/adapters/{clip,vit,dinov2,bert,t5,llama,gemma3}.py) declared:
# their RMS norm classes (every nn.Linear and affine nn.LayerNorm was calibrated besides), and their stacks
OLD_RMS = ("T5LayerNorm", "MT5LayerNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Gemma3RMSNorm")
OLD_STACKS = {  # model type -> [(name, blocks_path, entry_path, mask_key, class_token_head, cross_mask_key)]
    "clip_vision_model": [("vision", "encoder.layers", "", None, True, None)],
    "clip": [("vision", "vision_model.encoder.layers", "vision_model", None, True, None)],
    "vit": [("vision", "vit.layers", "vit", None, True, None)],
    "dinov2": [("vision", "encoder.layer", "", None, True, None)],
    "bert": [("encoder", "encoder.layer", "", "attention_mask", False, None)],
    "t5": [("encoder", "encoder.block", "encoder", "attention_mask", False, None),
           ("decoder", "decoder.block", "decoder", "decoder_attention_mask", False, "attention_mask")],
    "mt5": [("encoder", "encoder.block", "encoder", "attention_mask", False, None),
            ("decoder", "decoder.block", "decoder", "decoder_attention_mask", False, "attention_mask")],
    "llama": [("decoder", "model.layers", "model", "attention_mask", False, None)],
    "mistral": [("decoder", "model.layers", "model", "attention_mask", False, None)],
    "qwen2": [("decoder", "model.layers", "model", "attention_mask", False, None)],
    "gemma3_text": [("decoder", "model.layers", "model", "attention_mask", False, None)],
}


def _old_family(model_type: str) -> nn.Module:
    if model_type == "clip_vision_model":
        return T.CLIPVisionModel(T.CLIPVisionConfig(**VISION, intermediate_size=64)).eval()
    if model_type == "qwen2":  # uniform layers: mixed ones were refused before
        return T.Qwen2ForCausalLM(T.Qwen2Config(**H, **KV)).eval()
    return tiny(model_type)


@pytest.mark.parametrize("model_type", list(OLD_STACKS))
def test_the_families_of_the_old_adapters_are_found_as_they_found_them(model_type):
    """Same stacks, same modules in the same order with the same kinds, same block arguments."""
    model = _old_family(model_type)
    adapter = adapter_for(model)
    stacks = adapter.stacks(model)
    got = [(s.name, s.blocks_path, s.entry_path, s.mask_key, s.class_token_head, s.cross_mask_key) for s in stacks]
    assert got == OLD_STACKS[model_type]
    if model_type in ("t5", "mt5"):
        assert all(n.endswith(("EncDecAttention.k", "EncDecAttention.v")) for n in stacks[1].cross_modules)
        assert len(stacks[1].cross_modules) == 2
    for stack in stacks:
        for block in stack.blocks(model):
            old = [(n, "linear" if isinstance(m, nn.Linear) else "layernorm" if isinstance(m, nn.LayerNorm)
                    else "rmsnorm") for n, m in block.named_modules()
                   if isinstance(m, (nn.Linear, nn.LayerNorm)) or type(m).__name__ in OLD_RMS]
            assert [(c.name, c.kind) for c in calibrated_modules(block)] == old
    stack = stacks[0]
    data = batches(model, ["a"])["a"][0]
    mod, kw = adapter.stack_call(model, stack, data, None)
    with torch.no_grad():
        hidden, ctx = adapter.capture(mod, stack, model, kw)
        assert torch.equal(hidden, capture_block_input(mod, stack.blocks(model)[0], kw)[0])
        for layer in range(len(stack.blocks(model))):
            # the old adapters replayed block 0's call; Gemma 3's gave each block its own type's call
            _, old_ctx = capture_block_input(mod, stack.blocks(model)[layer if stack.layer_types else 0], kw)
            new = adapter.block_kwargs(stack, layer, ctx)
            assert new.keys() == old_ctx.keys()
            for k, v in new.items():
                assert v is old_ctx[k] or _equal(v, old_ctx[k]), k


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --- generated documentation ------------------------------------------------------------------------

def test_docs_supported_is_generated_from_the_code():
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "supported.md"
    assert page.read_text() == catalog.markdown(), "docs/supported.md is stale: featcal supported --markdown > it"


# --- through the command line ---------------------------------------------------------------------

@pytest.mark.parametrize("model_type,module", [("qwen3", "self_attn.q_norm.weight"), ("gpt2", "mlp.c_fc.weight")])
def test_featcal_calibrate_writes_a_new_family(model_type, module, tmp_path, capsys):
    """Qwen3 (per-head q/k norms) and GPT-2 (Conv1D) through the command line: checked, calibrated, written."""
    from tests.builders.guarantees import calibrate_argv, cli
    from tests.builders.pipeline_family import saved_model_family

    model = tiny(model_type)
    fam = saved_model_family(model, tmp_path)
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())
    assert report["end_to_end_drift"]["calibrated"] < report["end_to_end_drift"]["merged"]
    assert "kept_merged" not in report  # every block parameter of these two is calibrated
    back = type(model).from_pretrained(tmp_path / "out")
    key = f"{adapter_for(back).stacks(back)[0].blocks_path}.0.{module}"
    assert not torch.equal(back.state_dict()[key], fam["merged_model"].state_dict()[key])


def test_featcal_json_records_what_the_blocks_keep_merged(tmp_path, capsys):
    """T5's relative position bias table is no Linear or norm: featcal.json says it kept its merged value."""
    from tests.builders.guarantees import calibrate_argv, cli
    from tests.builders.pipeline_family import t5_family

    fam = t5_family(tmp_path / "fam")
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "out"), capsys)
    assert rc == 0, err
    kept = json.loads((tmp_path / "out" / "featcal.json").read_text())["kept_merged"]
    assert set(kept) == {"encoder", "decoder"}
    assert kept["encoder"] == {"layer.0.SelfAttention.relative_attention_bias": "not a Linear, Conv1D or norm"}


@pytest.mark.parametrize("model_type", ["gpt2", "qwen3_moe", "bart", "gemma2"])
def test_the_planner_sizes_new_families_from_their_configs(model_type):
    """featcal plan reads shapes from a meta-device model: Conv1D widths as in×out, experts not counted as Linears."""
    from featcal.calibration.planning.planner import model_shape

    shape = model_shape(T.AutoConfig.for_model(model_type), 64)  # a config naming no architecture: AutoModel
    assert shape.param_count > 0 and all(s.blocks for s in shape.stacks)
    linears = {name: (i, o) for name, i, o in shape.stacks[0].blocks[0].linears}
    if model_type == "gpt2":
        assert linears["attn.c_attn"] == (768, 3 * 768)
    if model_type == "qwen3_moe":
        assert not any("experts" in n for n in linears) and "self_attn.q_proj" in linears
    if model_type == "bart":
        assert [s.name for s in shape.stacks] == ["encoder", "decoder"]
    if model_type == "gemma2":  # rotary tables per layer type, and the second type's mask
        assert shape.stacks[0].context_bytes > 64 * 64


# --- RegMean and WUDI on the same layers ------------------------------------------------------------

@pytest.mark.parametrize("plus_plus", [False, True])
def test_regmean_solves_conv1d_layers_as_out_by_in(plus_plus):
    """GPT-2's c_fc (Conv1D): RegMean's closed form on its out×in weight, stored back in×out; padding weighs 0."""
    from featcal.merging.regmean import regmean
    from featcal.merging.regmean_grams import LinearGrams, TokenWeights, regmean_weight

    base, experts, _ = family_of(tiny("gpt2"))
    data = batches(base, experts)
    out = regmean(base, experts, data, plus_plus=plus_plus, progress=False)
    w = out.transformer.h[0].mlp.c_fc.weight
    assert w.shape == (32, 64 * 2)
    if plus_plus:  # inputs from the merged model: differs from the average, shape kept
        avg = sum(e.transformer.h[0].mlp.c_fc.weight for e in experts.values()) / len(experts)
        assert not torch.allclose(w, avg)
        return
    grams = []
    for t, e in experts.items():  # block 0's inputs are the expert's own in plain RegMean
        g = LinearGrams()
        with torch.no_grad(), g.watching({"c": e.transformer.h[0].mlp.c_fc}, TokenWeights(e).for_batch(data[t][0])):
            e(**data[t][0])
        grams.append(g.mean("c"))
    want = regmean_weight(grams, [e.transformer.h[0].mlp.c_fc.weight.T for e in experts.values()]).T
    torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)


def test_wudi_solves_conv1d_task_vectors_as_out_by_in():
    from featcal.merging.wudi import wudi, wudi_layer

    base, experts, _ = family_of(tiny("gpt2"))
    merged = wudi(base, experts, steps=5, lr=1e-3, progress=False)
    name = "transformer.h.0.attn.c_attn.weight"
    w0 = base.state_dict()[name]
    tvs = torch.stack([e.state_dict()[name] - w0 for e in experts.values()])  # stored in×out
    with torch.enable_grad():
        want = w0 + wudi_layer(tvs.transpose(1, 2), 5, 1e-3).T
    torch.testing.assert_close(merged[name], want)


# --- the norms around the blocks, found by running the model once ----------------------------------

@pytest.mark.parametrize("model_type,stem,final,class_only", [
    ("gpt2", None, "transformer.ln_f", False),
    ("bart", "model.decoder.layernorm_embedding", None, False),  # registered after the layers, run before them
    ("modernbert", "embeddings.norm", "final_norm", False),
    ("clip", "vision_model.pre_layrnorm", "vision_model.post_layernorm", True),  # on the class token alone
    ("siglip", None, "vision_model.post_layernorm", False),
])
def test_stem_and_final_norms_are_found_by_a_probe(model_type, stem, final, class_only):
    model = tiny(model_type)
    adapter = adapter_for(model)
    stacks = adapter.stacks(model)
    got_stem = adapter.stem_norm(model, stacks[-1])
    got_final = adapter.final_norm(model, stacks[-1])
    assert (got_stem.path if got_stem else None) == stem
    assert (got_final.path if got_final else None) == final
    assert got_final is None or got_final.class_token_only == class_only
    if model_type == "bart":
        assert adapter.stem_norm(model, stacks[0]).path == "model.encoder.layernorm_embedding"


def test_final_and_stem_norms_calibrate_on_a_new_family():
    base, experts, merged = family_of(tiny("modernbert"))
    cfg = FeatCalConfig(calibrate_final_norm=True, calibrate_stem_norm=True)
    result = calibrate(merged, base=base, experts=experts, calibration=batches(merged, experts), config=cfg,
                       progress=False)
    assert result.final_norm["module"] == "final_norm" and result.stem_norm["module"] == "embeddings.norm"
    assert result.final_norm["after"] < result.final_norm["before"]
    assert not torch.equal(result.model.final_norm.weight, merged.final_norm.weight)
