"""featcal.evaluate's metrics, each equal to a direct computation on the same examples (issue #38).

The direct computations run the model one example at a time, unpadded, and read the loss and the
predictions straight from the logits, so a wrong mask, shift, padding side, batch order or label map
in the batched, length-sorted evaluation makes a test fail.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as T

import featcal
from featcal.errors import ConfigError, EvaluationDataError
from featcal.evaluation.metrics import gap_closed, macro_f1, spearman
from tests.builders.data_fixtures import sentences, write_jsonl, write_png_folder
from tests.builders.eval_models import save_bert_classifier, save_clip, save_llama, save_t5


def _values(report: dict, model: str, task: str) -> dict[str, float]:
    return {r["metric"]: r["value"] for r in report["results"] if r["model"] == model and r["task"] == task}


def _examples(report: dict, model: str, task: str) -> int:
    return next(r["examples"] for r in report["results"] if r["model"] == model and r["task"] == task)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("eval") / "llama")


@torch.no_grad()
def _hand_lm(model, rows: list[tuple[list[int], list[bool]]]) -> tuple[float, float, int]:
    """(mean loss, next-token accuracy in %, tokens): token i scored from the logits at i - 1, one row at a time."""
    nll, hits, n = 0.0, 0, 0
    for ids, scored in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        for i in range(1, len(ids)):
            if scored[i]:
                nll -= float(torch.log_softmax(logits[i - 1].double(), -1)[ids[i]])
                hits += int(logits[i - 1].argmax()) == ids[i]
                n += 1
    return nll / n, 100.0 * hits / n, n


def test_causal_lm_loss_perplexity_and_accuracy_equal_a_direct_computation(llama, tmp_path):
    texts = sentences(9, seed=3, lo=1, hi=12)  # lengths 2..12 tokens with </s>: padding in every batch
    write_jsonl(tmp_path / "held_out.jsonl", [{"text": t} for t in texts])
    report = featcal.evaluate({"lm": tmp_path / "held_out.jsonl"}, {"llama": llama}, progress=False, batch_size=4)
    tok = T.AutoTokenizer.from_pretrained(llama)
    model = T.LlamaForCausalLM.from_pretrained(llama).eval()
    rows = [(ids, [True] * len(ids)) for ids in tok(texts)["input_ids"]]
    loss, acc, n = _hand_lm(model, rows)
    got = _values(report, "llama", "lm")
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert got["next_token_accuracy"] == pytest.approx(acc)
    assert _examples(report, "llama", "lm") == 9
    assert next(r["tokens"] for r in report["results"] if r["task"] == "lm") == n == sum(len(i) - 1 for i, _ in rows)


def test_chat_is_scored_on_the_assistant_turns_only(llama, tmp_path):
    conversations = [
        [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        for u, a in zip(sentences(5, seed=4), sentences(5, seed=5), strict=True)
    ]
    conversations.append([{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"},
                          {"role": "assistant", "content": "w4 w5 w6"}, {"role": "user", "content": "w7 w8"},
                          {"role": "assistant", "content": "w9"}])
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    report = featcal.evaluate({"chat": tmp_path / "chat.jsonl"}, {"llama": llama}, progress=False, batch_size=4)

    # by hand: the rendering is each turn's "role : content . " in a row, the assistant tokens those of "content ."
    tok = T.AutoTokenizer.from_pretrained(llama)
    rows = []
    for turns in conversations:
        ids, scored = [], []
        for t in turns:
            head = tok(f"{t['role']} : ", add_special_tokens=False)["input_ids"]
            body = tok(f"{t['content']} . ", add_special_tokens=False)["input_ids"]
            ids += head + body
            scored += [False] * len(head) + [t["role"] == "assistant"] * len(body)
        rows.append((ids, scored))
    loss, acc, n = _hand_lm(T.LlamaForCausalLM.from_pretrained(llama).eval(), rows)
    got = _values(report, "llama", "chat")
    assert got["loss"] == pytest.approx(loss, rel=1e-5) and got["next_token_accuracy"] == pytest.approx(acc)
    assert next(r["tokens"] for r in report["results"] if r["task"] == "chat") == n
    everything, _, _ = _hand_lm(T.LlamaForCausalLM.from_pretrained(llama).eval(), [(i, [True] * len(i)) for i, _ in rows])
    assert got["loss"] != pytest.approx(everything, rel=1e-3)  # scoring the prompts too would be another number


def test_chat_data_needs_a_chat_template(tmp_path):
    plain = save_llama(tmp_path / "plain", chat=False)
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "w1"},
                                                        {"role": "assistant", "content": "w2"}]}])
    with pytest.raises(EvaluationDataError, match="no chat template"):
        featcal.evaluate({"chat": tmp_path / "chat.jsonl"}, {"plain": plain}, progress=False)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return save_bert_classifier(tmp_path_factory.mktemp("eval") / "bert")


@torch.no_grad()
def _hand_predictions(model_dir, texts: list[str]) -> list[int]:
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    model = T.BertForSequenceClassification.from_pretrained(model_dir).eval()
    return [int(model(**tok(t, return_tensors="pt")).logits.argmax(-1)) for t in texts]


def _hand_macro_f1(pred: list[int], gold: list[int]) -> float:
    scores = []
    for c in sorted(set(pred) | set(gold)):
        tp = sum(p == g == c for p, g in zip(pred, gold, strict=True))
        fp = sum(p == c != g for p, g in zip(pred, gold, strict=True))
        fn = sum(g == c != p for p, g in zip(pred, gold, strict=True))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return 100.0 * sum(scores) / len(scores)


def test_classifier_accuracy_and_macro_f1_equal_argmax_of_the_logits(classifier, tmp_path):
    texts = sentences(12, seed=6)
    pred = _hand_predictions(classifier, texts)
    gold = [p if i % 3 else (p + 1) % 3 for i, p in enumerate(pred)]  # a third wrong: accuracy 2/3
    names = ("neg", "neu", "pos")
    write_jsonl(tmp_path / "by_name.jsonl", [{"text": t, "label": names[g].upper()} for t, g in zip(texts, gold, strict=True)])
    write_jsonl(tmp_path / "by_id.jsonl", [{"text": t, "label": g} for t, g in zip(texts, gold, strict=True)])
    report = featcal.evaluate({"names": tmp_path / "by_name.jsonl", "ids": tmp_path / "by_id.jsonl"},
                              {"bert": classifier}, progress=False, batch_size=5)
    for task in ("names", "ids"):
        got = _values(report, "bert", task)
        assert got["accuracy"] == pytest.approx(100.0 * 8 / 12)
        assert got["macro_f1"] == pytest.approx(_hand_macro_f1(pred, gold))


def test_a_classlabel_in_another_order_is_translated_by_name_and_unknown_names_are_refused(classifier, tmp_path):
    texts = sentences(10, seed=7)
    pred = _hand_predictions(classifier, texts)
    data_order = ["pos", "neg", "neu"]  # the data's id i is the model's class data_order[i]
    model_ids = {"neg": 0, "neu": 1, "pos": 2}
    data_ids = [data_order.index(["neg", "neu", "pos"][p]) for p in pred]  # every label right, in the data's ids
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=data_order)})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts, "label": data_ids}, features=features)}
                         ).save_to_disk(str(tmp_path / "reordered"))
    report = featcal.evaluate({"t": tmp_path / "reordered"}, {"bert": classifier}, progress=False)
    assert _values(report, "bert", "t")["accuracy"] == 100.0
    assert [model_ids[data_order[i]] for i in data_ids] == pred  # the translation the test expects

    other = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    datasets.Dataset.from_dict({"text": texts, "label": data_ids}, features=other).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(EvaluationDataError, match=r"classes \(0=a, 1=b, 2=c\) are not those of model 'bert' \(id2label: 0=neg"):
        featcal.evaluate({"t": tmp_path / "other"}, {"bert": classifier}, progress=False)
    write_jsonl(tmp_path / "unknown.jsonl", [{"text": "w1", "label": "positive"}])
    with pytest.raises(EvaluationDataError, match="'positive' are not classes of model 'bert'"):
        featcal.evaluate({"t": tmp_path / "unknown.jsonl"}, {"bert": classifier}, progress=False)
    write_jsonl(tmp_path / "no_label.jsonl", [{"text": "w1"}])
    with pytest.raises(EvaluationDataError, match="no label.*--label-column"):
        featcal.evaluate({"t": tmp_path / "no_label.jsonl"}, {"bert": classifier}, progress=False)


def test_an_encoder_without_a_task_head_is_refused_naming_what_would_make_it_evaluable(tmp_path):
    from tests.builders.tiny import tiny_model

    tiny_model("bert").save_pretrained(tmp_path / "encoder")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "w1", "label": 0}])
    with pytest.raises(ConfigError, match="BertModel, an encoder with no task head.*ForSequenceClassification"):
        featcal.evaluate({"t": tmp_path / "d.jsonl"}, {"encoder": tmp_path / "encoder"}, progress=False)


def test_text_to_text_exact_match_equals_unbatched_greedy_generations(tmp_path):
    t5 = save_t5(tmp_path / "t5")
    tok = T.AutoTokenizer.from_pretrained(t5)
    model = T.T5ForConditionalGeneration.from_pretrained(t5).eval()
    texts = sentences(10, seed=8, lo=1, hi=10)
    with torch.no_grad():
        answers = [tok.decode(model.generate(**tok(t, return_tensors="pt"), max_new_tokens=4, do_sample=False)[0],
                              skip_special_tokens=True) for t in texts]
    assert len(set(answers)) > 2  # the answers differ: a batch order mix-up would show
    targets = [f"  {a.upper()} " if i % 2 else "w39 w38" for i, a in enumerate(answers)]  # half right (case, spaces)
    write_jsonl(tmp_path / "qa.jsonl", [{"text": t, "target": y} for t, y in zip(texts, targets, strict=True)])
    report = featcal.evaluate({"qa": tmp_path / "qa.jsonl"}, {"t5": t5}, progress=False, batch_size=3)
    expected = 100.0 * sum(a.strip().lower() == y.strip().lower() for a, y in zip(answers, targets, strict=True)) / 10
    assert expected >= 40 and _values(report, "t5", "qa") == {"exact_match": pytest.approx(expected)}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    save_clip(root / "clip")
    write_png_folder(root / "images", n_per_class=4, classes=("cat", "dog", "the photo"))
    return root


@torch.no_grad()
def _hand_zero_shot(clip_dir, images: list, names: list[str], tower=None) -> list[int]:
    model = T.CLIPModel.from_pretrained(clip_dir).eval()
    processor = T.CLIPProcessor.from_pretrained(clip_dir)
    text = processor.tokenizer([f"a photo of a {n}." for n in names], padding=True, return_tensors="pt")
    head = F.normalize(model.get_text_features(**text).pooler_output, dim=-1)
    pixels = processor.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
    if tower is None:
        feats = model.get_image_features(pixel_values=pixels).pooler_output
    else:
        feats = model.visual_projection(tower(pixel_values=pixels).pooler_output)
    return (F.normalize(feats, dim=-1) @ head.T).argmax(-1).tolist()


def test_clip_zero_shot_accuracy_equals_the_argmax_over_class_name_embeddings(clip):
    from PIL import Image

    files = sorted((clip / "images").rglob("*.png"))
    names = sorted({f.parent.name for f in files})
    gold = [names.index(f.parent.name) for f in files]
    pred = _hand_zero_shot(clip / "clip", [Image.open(f) for f in files], names)
    report = featcal.evaluate({"pets": clip / "images"}, {"clip": clip / "clip"}, progress=False, batch_size=5)
    assert _values(report, "clip", "pets") == {"accuracy": pytest.approx(100.0 * np.mean(np.equal(pred, gold)))}

    # a bare vision tower is read through the --base CLIP's text head and projection
    tower_dir = clip / "tower"
    tower = T.CLIPVisionModel.from_pretrained(clip / "clip")
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.3 * torch.randn_like(p) * p.std())
    tower.save_pretrained(tower_dir)
    T.CLIPImageProcessor.from_pretrained(clip / "clip").save_pretrained(tower_dir)
    pred = _hand_zero_shot(clip / "clip", [Image.open(f) for f in files], names, tower=tower.eval())
    report = featcal.evaluate({"pets": clip / "images"}, {"tower": tower_dir}, base=clip / "clip", progress=False)
    assert _values(report, "tower", "pets")["accuracy"] == pytest.approx(100.0 * np.mean(np.equal(pred, gold)))
    with pytest.raises(ConfigError, match="--base"):
        featcal.evaluate({"pets": clip / "images"}, {"tower": tower_dir}, progress=False)


def test_metric_helpers_match_their_libraries_and_the_gap_runs_both_ways():
    import scipy.stats
    from sklearn.metrics import f1_score

    x, y = [1, 2, 2, 4, 5, 5], [5, 3, 3, 1, 2, 0]
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic)
    assert spearman([2, 2, 2], [1, 2, 3]) == 0.0
    assert macro_f1([0, 1, 1, 2], [0, 1, 2, 2]) == pytest.approx(f1_score([0, 1, 2, 2], [0, 1, 1, 2], average="macro"))
    assert gap_closed(75.0, 70.0, 80.0) == pytest.approx(0.5)
    assert gap_closed(2.5, 3.0, 2.0, higher_is_better=False) == pytest.approx(0.5)  # a loss: lower is better
    assert gap_closed(3.0, 3.0, 3.5, higher_is_better=False) is None  # experts worse than the merge: no gap
