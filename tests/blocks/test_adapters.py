"""Adapters: every supported class is found and calibrated where it should be; 4.x checkpoints map."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as T
from safetensors.torch import save_file
from torch import nn

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.blocks.capture import capture_block_input
from featcal.errors import FeatCalError
from tests.builders import tiny
from tests.builders.reference_featcal import max_abs_diff, padding_change_effect, reference_calibrate
from tests.builders.tiny import padded_ids


def _changed(a: nn.Module, b: nn.Module) -> set[str]:
    sa, sb = a.state_dict(), b.state_dict()
    return {k for k in sa if sa[k].is_floating_point() and not torch.equal(sa[k], sb[k])}


@pytest.mark.parametrize("kind", ["clip", "vit", "bert", "t5", "llama"])
def test_adapter_is_named_after_the_model_type(kind):
    model = tiny.tiny_model(kind)
    assert adapter_for(model).name == model.config.model_type


def test_unsupported_architecture_is_named():
    model = T.MambaForCausalLM(T.MambaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(FeatCalError, match="MambaForCausalLM: layers 0 are linear_attention layers"):
        calibrate(model, base=model, experts={"a": model}, calibration={"a": [padded_ids(vocab=50)]}, progress=False)


def test_clipmodel_calibrates_only_the_vision_tower():
    cfg = T.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        vision_config=tiny.tiny_config("clip").to_dict(), projection_dim=8,
    )
    torch.manual_seed(0)
    base, experts, merged = tiny.family_of(T.CLIPModel(cfg))
    data = {t: [{"pixel_values": torch.randn(2, 3, 16, 16)}] for t in experts}
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    changed = _changed(out, merged)
    assert changed and all(k.startswith("vision_model.encoder.layers.") for k in changed)
    assert max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))[0] < 1e-5


@pytest.mark.parametrize("cls,prefix", [(T.ViTForImageClassification, "vit.layers."), (T.BertForSequenceClassification, "bert.encoder.layer.")])
def test_heads_keep_their_merged_weights(cls, prefix):
    kind = "vit" if "ViT" in cls.__name__ else "bert"
    torch.manual_seed(0)
    base, experts, merged = tiny.family_of(cls(tiny.tiny_config(kind)))
    data = {t: [{**tiny.sample_inputs(kind, seed=i), "labels": torch.tensor([0, 1])}] for i, t in enumerate(experts)}
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model  # labels are not inputs
    changed = _changed(out, merged)
    assert changed and all(k.startswith(prefix) for k in changed)


def test_t5_without_decoder_inputs_starts_from_decoder_start_token():
    torch.manual_seed(0)
    base, experts, merged = tiny.family_of(T.T5Model(tiny.tiny_config("t5")))
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    result = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    out = result.model
    assert [d["stack"] for d in result.drift] == ["encoder", "encoder", "decoder", "decoder"]
    assert any(k.startswith("decoder.block.1.layer.1.EncDecAttention") for k in _changed(out, merged))
    assert max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))[0] < 1e-5


def test_t5_decoder_cross_attention_sees_calibrated_encoder():
    """Decoder block 0's drift "before" is measured with the merged decoder reading the CALIBRATED encoder."""
    base, experts, merged = tiny.family_of(tiny.tiny_model("t5"))
    data = {t: [tiny.sample_inputs("t5", seed=i)] for i, t in enumerate(experts)}
    result = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    out = result.model
    hybrid = copy.deepcopy(merged)  # calibrated encoder, decoder as merged
    hybrid.encoder.load_state_dict(out.encoder.state_dict())
    per_task = []
    with torch.no_grad():
        for t, e in experts.items():
            batch = data[t][0]
            hm = hybrid(**batch, output_hidden_states=True).decoder_hidden_states[1]
            he = e(**batch, output_hidden_states=True).decoder_hidden_states[1]
            per_task.append(float(((hm - he).pow(2).sum(-1) / he.pow(2).sum(-1)).mean()))
    decoder0 = next(d for d in result.drift if d["stack"] == "decoder" and d["layer"] == 0)
    assert decoder0["before"] == pytest.approx(sum(per_task) / len(per_task), rel=1e-4)


@pytest.mark.parametrize("cls,cfg_cls", [(T.MistralForCausalLM, T.MistralConfig), (T.Qwen2ForCausalLM, T.Qwen2Config)])
def test_llama_family_decoders(cls, cfg_cls):
    cfg = cfg_cls(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base, experts, merged = tiny.family_of(cls(cfg))
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    changed = _changed(out, merged)
    assert any(k.endswith("input_layernorm.weight") for k in changed)
    if cls is T.Qwen2ForCausalLM:  # q/k/v carry biases in Qwen2
        assert "model.layers.0.self_attn.q_proj.bias" in changed
    assert max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))[0] < 1e-5


def test_padding_tokens_do_not_count():
    """Changing what sits under attention_mask == 0 leaves the calibration unchanged."""
    base, experts, merged = tiny.family_of(tiny.tiny_model("bert"))
    data = {t: [padded_ids(seed=i)] for i, t in enumerate(experts)}
    assert padding_change_effect(merged, base, experts, data) < 1e-6


# --- checkpoints saved with transformers-4 names ------------------------------------------------

_VIT4 = [("layers.", "encoder.layer."), ("attention.q_proj", "attention.attention.query"),
         ("attention.k_proj", "attention.attention.key"), ("attention.v_proj", "attention.attention.value"),
         ("attention.o_proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense")]


def _save_as_v4(model: nn.Module, directory, rename) -> None:
    directory.mkdir(parents=True)
    tensors = {rename(k): v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))


def _vit4(key: str) -> str:
    for new, old in _VIT4:
        key = key.replace(new, old, 1) if new in key else key
    return key


@pytest.mark.parametrize("kind,rename", [("clip", lambda k: "vision_model." + k), ("vit", _vit4)])
def test_transformers4_checkpoints_stream_like_models(kind, rename, tmp_path):
    base, experts, merged = tiny.family_of(tiny.tiny_model(kind))
    data = {t: [tiny.sample_inputs(kind, seed=i)] for i, t in enumerate(experts)}
    paths = {}
    for t, e in experts.items():
        _save_as_v4(e, tmp_path / t, rename)
        paths[t] = tmp_path / t
    _save_as_v4(base, tmp_path / "base", rename)
    with open(tmp_path / "task0" / "model.safetensors", "rb") as f:
        assert (b"vision_model." if kind == "clip" else b"attention.attention.query") in f.read(4096)
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    b = calibrate(merged, base=tmp_path / "base", experts=paths, calibration=data, progress=False).model
    assert max_abs_diff(a, b)[0] == 0.0


def test_block_lists_are_found_in_the_4x_module_layout():
    class OldViT(nn.Module):  # the base model of ViT 4.x: its blocks at encoder.layer
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layer = nn.ModuleList([nn.Linear(2, 2)])

        def forward(self, pixel_values):
            return self.encoder.layer[0](pixel_values)

    class Old(nn.Module):  # ViT 4.x: vit.encoder.layer
        def __init__(self):
            super().__init__()
            self.config = T.ViTConfig(num_hidden_layers=1)
            self.vit = OldViT()

    stacks = adapter_for(Old()).stacks(Old())
    assert stacks[0].blocks_path == "vit.encoder.layer" and stacks[0].entry_path == "vit"


def test_clipmodel_checkpoint_serves_as_base_of_a_vision_model(tmp_path):
    """The demo's base is a full CLIPModel checkpoint while the experts are CLIPVisionModels."""
    cfg = T.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        vision_config=tiny.tiny_config("clip").to_dict(), projection_dim=8,
    )
    torch.manual_seed(0)
    full = T.CLIPModel(cfg).eval()
    full.save_pretrained(tmp_path / "clip-full")
    vision = T.CLIPVisionModel(tiny.tiny_config("clip")).eval()
    vision.load_state_dict(full.vision_model.state_dict())
    base, experts, merged = tiny.family_of(vision)
    data = {t: [tiny.sample_inputs("clip", seed=i)] for i, t in enumerate(experts)}
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    b = calibrate(merged, base=tmp_path / "clip-full", experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(a, b)[0] == 0.0


def test_mixed_attention_layer_types_get_each_their_own_arguments():
    """Qwen2 with a sliding window on its upper layers: each block is called with its own type's mask."""
    cfg = T.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = T.Qwen2ForCausalLM(cfg).eval()
    assert len(set(cfg.layer_types)) == 2
    adapter = adapter_for(model)
    (stack,) = adapter.stacks(model)
    assert stack.layer_types == tuple(cfg.layer_types)
    mod, kw = adapter.stack_call(model, stack, padded_ids(seq=8), None)
    with torch.no_grad():
        hidden, ctx = adapter.capture(mod, stack, model, kw)
        for layer in (0, 1):
            _, actual = capture_block_input(mod, stack.blocks(model)[layer], kw)
            assert torch.equal(adapter.block_kwargs(stack, layer, ctx)["attention_mask"], actual["attention_mask"])
        assert not torch.equal(adapter.block_kwargs(stack, 0, ctx)["attention_mask"],
                               adapter.block_kwargs(stack, 1, ctx)["attention_mask"])


def test_context_replay_check_catches_per_block_masks():
    """Independently of the adapter's own guard, a block-1 call that differs from the replay is caught."""
    from featcal.blocks.adapters import StructuralAdapter
    from featcal.blocks.structure import Stack
    from featcal.calibration.engine.replay import check_context_replay

    cfg = T.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, use_sliding_window=True, sliding_window=2, max_window_layers=1)
    model = T.Qwen2ForCausalLM(cfg).eval()
    adapter, stack = StructuralAdapter(model), Stack("decoder", "model.layers", "model")  # no layer types: replay
    mod, kw = adapter.stack_call(model, stack, padded_ids(seq=8), None)
    with torch.no_grad():
        h, ctx = capture_block_input(mod, stack.blocks(model)[0], kw)
        with pytest.raises(FeatCalError, match="block 1 is called with another 'attention_mask'"):
            check_context_replay(adapter, stack, model, mod, kw, h, ctx)
        uniform = T.LlamaForCausalLM(tiny.tiny_config("llama")).eval()  # same check passes where replay is exact
        mod, kw = adapter.stack_call(uniform, stack, padded_ids(seq=8), None)
        h, ctx = capture_block_input(mod, stack.blocks(uniform)[0], kw)
        check_context_replay(adapter, stack, uniform, mod, kw, h, ctx)


def test_adapters_answer_what_calibration_and_the_planner_ask():
    """Architecture questions go to the adapter: the token limit, a batch's checks, the planner's sizes."""
    from featcal.blocks.structure import Stack
    from featcal.errors import CalibrationDataError

    bert, t5, llama, clip = (tiny.tiny_model(k) for k in ("bert", "t5", "llama", "clip"))
    a_bert, a_t5, a_llama, a_clip = (adapter_for(m) for m in (bert, t5, llama, clip))
    # absolute position tables limit the tokens; T5's relative buckets do not
    assert a_bert.max_tokens(bert.config) == bert.config.max_position_embeddings
    assert a_t5.max_tokens(t5.config) is None
    long_ids = {"input_ids": torch.zeros(1, bert.config.max_position_embeddings + 1, dtype=torch.long)}
    with pytest.raises(CalibrationDataError, match="the model takes at most"):
        a_bert.check_batch(bert.config, long_ids, "input_ids", "here")
    a_t5.check_batch(t5.config, long_ids, "input_ids", "here")  # no limit to pass
    with pytest.raises(CalibrationDataError, match="here: no 'pixel_values'"):
        a_clip.check_batch(clip.config, long_ids, "pixel_values", "here")
    size = clip.config.image_size
    a_clip.check_batch(clip.config, {"pixel_values": torch.zeros(1, 3, size, size)}, "pixel_values", "here")
    with pytest.raises(CalibrationDataError, match="pixels, the model takes"):
        a_clip.check_batch(clip.config, {"pixel_values": torch.zeros(1, 3, size + 1, size)}, "pixel_values", "here")
    # the planner's per-example sizes: T5 holds decoder inputs and a position bias, Llama rotary tables
    assert (a_bert.token_tensors, a_t5.token_tensors, a_llama.token_tensors) == (2, 4, 2)
    enc, dec = a_t5.stacks(t5)
    assert a_t5.context_bytes(enc, 8, 32, 4) == 4 * 8 * 8 * 4
    assert a_t5.context_bytes(dec, 8, 32, 4) == 2 * 4 * 8 * 8 * 4
    assert a_llama.context_bytes(a_llama.stacks(llama)[0], 8, 32, 4) == 2 * 8 * 8 * 4
    assert a_bert.context_bytes(Stack("encoder", "", ""), 8, 32, 4) == 0
