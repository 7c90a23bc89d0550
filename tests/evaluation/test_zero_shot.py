"""CLIP zero-shot heads and evaluation, on hand-made examples and a tiny real CLIPModel."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T

from featcal.errors import CalibrationDataError, ConfigError
from featcal.evaluation.zero_shot import (
    ZeroShotClassifier,
    build_text_head,
    evaluate_zero_shot,
    zero_shot_logits,
)
from featcal.experiments.task_data.templates import CLIP_CLASSNAMES, CLIP_TEMPLATES, clip_prompts
from tests.builders.hub import clip_tokenizer


class _FakeTokenizer:
    """Maps each whole text to one id, so the fake text tower can look its embedding up."""

    def __init__(self, texts):
        self.ids = {t: i for i, t in enumerate(texts)}

    def __call__(self, texts, **_):
        return {"input_ids": torch.tensor([[self.ids[t]] for t in texts]),
                "attention_mask": torch.ones(len(texts), 1, dtype=torch.long)}


class _FakeClip(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)

    def get_text_features(self, input_ids, attention_mask):
        return self.table[input_ids[:, 0]]


def test_head_normalises_each_template_then_the_mean():
    texts = ["A one", "A two", "B one", "B two"]
    clip = _FakeClip([[3.0, 4.0], [10.0, 0.0], [0.0, 2.0], [0.0, 5.0]])
    head = build_text_head(clip, _FakeTokenizer(texts), ["A", "B"], ["{} one", "{} two"])
    # class A: mean(0.6,0.8 ; 1,0) = (0.8, 0.4) -> /|.| ; class B: both (0, 1)
    norm = math.hypot(0.8, 0.4)
    assert torch.allclose(head, torch.tensor([[0.8 / norm, 0.4 / norm], [0.0, 1.0]]), atol=1e-6)


def test_logits_are_scaled_cosines():
    feats = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    logits = zero_shot_logits(feats, head, logit_scale=100.0)
    s = 100.0 / math.sqrt(2)
    assert torch.allclose(logits, torch.tensor([[100.0, 0.0], [s, s]]), atol=1e-4)


def test_empty_head_inputs_are_refused():
    with pytest.raises(ConfigError):
        build_text_head(_FakeClip([[1.0]]), _FakeTokenizer([]), [], ["{}"])


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    tok = clip_tokenizer(tmp_path_factory.mktemp("tok"))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    config = T.CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=77, eos_token_id=eos, pad_token_id=eos,
                         bos_token_id=tok.convert_tokens_to_ids("<|startoftext|>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4),
        projection_dim=16,
    )
    torch.manual_seed(0)
    return T.CLIPModel(config).eval(), tok


def test_classifier_matches_clip_own_logits_for_one_template(tiny_clip):
    model, tok = tiny_clip
    classes, template = ["cat", "dog", "photo"], "a photo of a {}."
    head = build_text_head(model, tok, classes, [template])
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ours = ZeroShotClassifier.from_clip(model, head)(pixels)
    enc = tok([template.format(c) for c in classes], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=pixels)
    assert torch.allclose(ours, theirs.logits_per_image, atol=1e-4)


class _ConstantClassifier(torch.nn.Module):
    def __init__(self, cls: int, n: int):
        super().__init__()
        self.cls, self.n = cls, n

    def forward(self, pixel_values):
        out = torch.zeros(pixel_values.shape[0], self.n)
        out[:, self.cls] = 1.0
        return out


def _image_dataset(labels):
    import datasets
    from PIL import Image

    images = [Image.new("L", (8, 8), color=i * 20) for i in range(len(labels))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def test_accuracy_counts_correct_predictions_across_batches():
    processor = T.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    data = _image_dataset([1, 0, 1, 2, 1])
    result = evaluate_zero_shot(_ConstantClassifier(1, 3), data, processor, batch_size=2)
    assert result == {"accuracy": 60.0, "n": 5}


def test_missing_image_column_is_named():
    import datasets

    processor = T.CLIPImageProcessor()
    data = datasets.Dataset.from_dict({"img": [0], "label": [0]})
    with pytest.raises(CalibrationDataError, match="'image'"):
        evaluate_zero_shot(_ConstantClassifier(0, 3), data, processor)


def test_templates_and_class_counts_of_the_eight_tasks():
    counts = {t: len(c) for t, c in CLIP_CLASSNAMES.items()}
    assert counts == {"sun397": 397, "stanford-cars": 196, "resisc45": 45, "eurosat": 10, "svhn": 10,
                      "gtsrb": 43, "mnist": 10, "dtd": 47}
    for task, templates in CLIP_TEMPLATES.items():
        assert templates and all(t.count("{}") == 1 for t in templates), task
        assert len(set(CLIP_CLASSNAMES[task])) == len(CLIP_CLASSNAMES[task]), task
    assert len(CLIP_TEMPLATES["resisc45"]) == 18 and CLIP_TEMPLATES["resisc45"][1] == "aerial imagery of {}."
    with pytest.raises(ConfigError, match="cifar10"):
        clip_prompts("cifar10")


def test_long_class_names_are_cut_at_the_text_towers_length(tiny_clip):
    model, tok = tiny_clip
    saved = tok.model_max_length
    tok.model_max_length = 10**6  # a tokenizer that does not know the tower's limit
    try:
        head = build_text_head(model, tok, ["red and white triangle " * 20, "stop"], ['a photo of a "{}" sign.'])
    finally:
        tok.model_max_length = saved
    assert head.shape == (2, 16) and torch.allclose(head.norm(dim=-1), torch.ones(2))
