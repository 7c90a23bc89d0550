"""`featcal eval` on issue 49: a gap within rounding is no gap (5), bare class ids that the models number
differently are refused (6), and a merge of classifiers with different label maps is scored on each task
through that task's own head from heads/ (7)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import featcal
from featcal.errors import ConfigError
from featcal.evaluation.metrics import gap_closed, no_gap_reason
from featcal.evaluation.report import eval_table, gap_rows
from tests.builders.data_fixtures import save_tokenizer, sentences, write_jsonl
from tests.builders.eval_models import save_bert_classifier
from tests.builders.tiny import save, tiny_config


def _values(report: dict, model: str, task: str) -> dict[str, float]:
    return {r["metric"]: r["value"] for r in report["results"] if r["model"] == model and r["task"] == task}


# --- 5. a near-zero gap -------------------------------------------------------------------------------------
def test_a_gap_within_rounding_of_the_metric_is_no_gap_and_says_so():
    merged, experts, calibrated = 3.0, 3.0 - 7e-7, 3.0 - 8.33e-5  # losses in nats: the experts 7e-7 nats better
    assert gap_closed(calibrated, merged, experts, higher_is_better=False) is None  # was 119.0 (11900 %)
    assert "within 1e-06 of the metric's scale" in no_gap_reason(merged, experts, higher_is_better=False)
    assert gap_closed(2.5, 3.0, 2.0, higher_is_better=False) == pytest.approx(0.5)  # a real gap is still measured
    assert gap_closed(70.5, 70.0, 71.0) == pytest.approx(0.5)
    assert gap_closed(1e-3, 0.0, 2e-3) == pytest.approx(0.5)  # a small metric's real gap too (not a relative 0)
    assert gap_closed(1.0, 1.0, 1.0 + 1e-12) is None and gap_closed(1.0, float("nan"), 2.0) is None

    results = [{"model": m, "task": "t", "metric": "loss", "value": v}
               for m, v in (("merged", merged), ("experts", experts), ("calibrated", calibrated))]
    rows = gap_rows(results, {"calibrated": ("loss", False)}, ["t"])
    assert [r["value"] for r in rows] == [None, None] and all("no gap" in r["reason"] for r in rows)
    json.dumps(rows, allow_nan=False)  # eval.json: null plus a reason
    table = eval_table({"tasks": ["t"], "results": results, "gap_closed": rows})
    assert "| calibrated | loss | n/a (no gap) | n/a (no gap) |" in table and "11900" not in table


# --- 6. bare class ids numbered differently by the models ----------------------------------------------------
@pytest.fixture(scope="module")
def two_maps(tmp_path_factory):
    """One classifier saved twice, the same weights under two orders of the same class names."""
    root = tmp_path_factory.mktemp("maps")
    return {"a": save_bert_classifier(root / "a", ("neg", "neu", "pos")),
            "b": save_bert_classifier(root / "b", ("pos", "neg", "neu"))}


@torch.no_grad()
def _predictions(model_dir, texts: list[str]) -> list[int]:
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    model = T.BertForSequenceClassification.from_pretrained(model_dir).eval()
    return [int(model(**tok(t, return_tensors="pt")).logits.argmax(-1)) for t in texts]


def test_class_ids_that_two_models_number_differently_are_refused_and_names_score_each_the_same(two_maps, tmp_path):
    texts = sentences(9, seed=31)
    pred = _predictions(two_maps["a"], texts)
    names = ("neg", "neu", "pos")
    gold = [p if i % 3 else (p + 1) % 3 for i, p in enumerate(pred)]  # in a's numbering: 6 of 9 right
    by_id = write_jsonl(tmp_path / "ids.jsonl", [{"text": t, "label": g} for t, g in zip(texts, gold, strict=True)])
    by_name = write_jsonl(tmp_path / "names.jsonl", [{"text": t, "label": names[g]} for t, g in zip(texts, gold,
                                                                                                  strict=True)])
    with pytest.raises(ConfigError, match=r"class ids, but the models number their classes differently \(a: 0=neg, "
                                          r"1=neu, 2=pos; b: 0=pos, 1=neg, 2=neu\).*give the labels as class names") as e:
        featcal.evaluate({"t": by_id}, two_maps, progress=False)  # a would score 66.67 %, b 33.33 % or so
    assert "\n" not in str(e.value)
    by_name_score = featcal.evaluate({"t": by_name}, two_maps, progress=False)
    b_names = ("pos", "neg", "neu")
    b_right = sum(b_names[p] == names[g] for p, g in zip(pred, gold, strict=True))  # same weights, b's names
    b_ids = write_jsonl(tmp_path / "b-ids.jsonl", [{"text": t, "label": b_names.index(names[g])}
                                                   for t, g in zip(texts, gold, strict=True)])
    for model, ids, right in (("a", by_id, 6), ("b", b_ids, b_right)):  # each model: ids in its numbering = names
        alone = featcal.evaluate({"t": ids}, {model: two_maps[model]}, progress=False)
        assert _values(alone, model, "t")["accuracy"] == pytest.approx(100.0 * right / 9)
        assert _values(by_name_score, model, "t")["accuracy"] == pytest.approx(100.0 * right / 9)


def test_class_ids_that_could_be_class_names_of_other_ids_are_refused(tmp_path):
    model = save_bert_classifier(tmp_path / "digits", ("1", "0", "2"))
    texts = sentences(6, seed=32)
    pred = _predictions(model, texts)
    write_jsonl(tmp_path / "ids.jsonl", [{"text": t, "label": i % 3} for i, t in enumerate(texts)])
    with pytest.raises(ConfigError, match="the label . could mean id . or the class named"):
        featcal.evaluate({"t": tmp_path / "ids.jsonl"}, {"m": model}, progress=False)
    named = [("1", "0", "2")[p] for p in pred]
    write_jsonl(tmp_path / "names.jsonl", [{"text": t, "label": n} for t, n in zip(texts, named, strict=True)])
    report = featcal.evaluate({"t": tmp_path / "names.jsonl"}, {"m": model}, progress=False)
    assert _values(report, "m", "t")["accuracy"] == 100.0


# --- 7. a merge of classifiers with different label maps --------------------------------------------------
LABELS = {"task0": ("negative", "positive"), "task1": ("no", "yes")}
TEXTS = {t: sentences(24, seed=40 + i) for i, t in enumerate(LABELS)}


@torch.no_grad()
def _pooled(model_dir, texts: list[str]) -> torch.Tensor:
    tok = T.AutoTokenizer.from_pretrained(model_dir)
    model = T.BertForSequenceClassification.from_pretrained(model_dir).eval()
    return torch.cat([model.bert(**tok(t, return_tensors="pt")).pooler_output for t in texts]).double()


@pytest.fixture(scope="module")
def headed(tmp_path_factory):
    """A BERT base, two experts with other label maps and heads of their own (the base's body: the merge's body is
    the base's), and their merge, which writes heads/. Each head splits its task's texts near the median along its
    own principal direction of the pooled features, so its predictions differ from the merged head's."""
    root = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    base = T.BertForSequenceClassification(tiny_config("bert")).eval()
    base_dir = save(base, root / "base")
    save_tokenizer(base_dir, "bert")
    features = _pooled(base_dir, [t for texts in TEXTS.values() for t in texts])
    mean = features.mean(0)
    directions = torch.linalg.svd(features - mean, full_matrices=False).Vh
    experts = {}
    for i, (task, names) in enumerate(LABELS.items()):
        u = directions[i]
        along = (_pooled(base_dir, TEXTS[task]) - mean) @ u
        ranked = along.sort().values
        k = max(range(6, 18), key=lambda j: float(ranked[j + 1] - ranked[j]))  # the widest split near the middle
        scale, cut = 1.0 / float(along.std()), float(ranked[k] + ranked[k + 1]) / 2 + float(mean @ u)
        e = T.BertForSequenceClassification.from_pretrained(base_dir).eval()
        with torch.no_grad():
            e.classifier.weight.copy_(torch.stack([-u, u]).float() * scale)
            e.classifier.bias.copy_(torch.tensor([cut, -cut]) * scale)
        e.config.id2label = dict(enumerate(names))
        e.config.label2id = {n: j for j, n in enumerate(names)}
        experts[task] = save(e, root / task)
        save_tokenizer(experts[task], "bert")
    featcal.merge(base_dir, experts, out=root / "merged", progress=False)
    assert (root / "merged" / "heads" / "task0.safetensors").is_file()
    return {"base": base_dir, "experts": experts, "merged": root / "merged", "root": root}


@torch.no_grad()
def _with_head(merged_dir, expert_dir, texts: list[str]) -> tuple[list[int], list[int]]:
    """The merge's predictions through the expert's head, and through its own (merged) head."""
    tok = T.AutoTokenizer.from_pretrained(merged_dir)
    model = T.BertForSequenceClassification.from_pretrained(merged_dir).eval()
    own = [int(model(**tok(t, return_tensors="pt")).logits.argmax(-1)) for t in texts]
    expert = T.BertForSequenceClassification.from_pretrained(expert_dir)
    model.classifier.load_state_dict(expert.classifier.state_dict())
    return [int(model(**tok(t, return_tensors="pt")).logits.argmax(-1)) for t in texts], own


def test_a_merge_with_per_task_heads_is_scored_through_each_tasks_own_head(headed, tmp_path):
    tasks, expected = {}, {}
    for task, names in LABELS.items():
        texts = TEXTS[task]
        through_head, own = _with_head(headed["merged"], headed["experts"][task], texts)
        assert through_head != own and set(through_head) == {0, 1}  # the merged head would score otherwise
        expected[task] = through_head
        tasks[task] = write_jsonl(tmp_path / f"{task}.jsonl", [{"text": t, "label": names[p]}
                                                                for t, p in zip(texts, through_head, strict=True)])
    report = featcal.evaluate(tasks, merged=headed["merged"], experts=headed["experts"], progress=False)
    for task in LABELS:
        assert _values(report, "merged", task)["accuracy"] == 100.0  # every label is the task head's prediction
        row = next(r for r in report["results"] if r["model"] == "merged" and r["task"] == task)
        assert row["head"] == f"heads/{task}.safetensors"
    ids = {t: write_jsonl(tmp_path / f"{t}-ids.jsonl", [{"text": x, "label": p} for x, p in zip(
        TEXTS[t], expected[t], strict=True)]) for t in LABELS}
    report = featcal.evaluate(ids, merged=headed["merged"], experts=headed["experts"], progress=False)
    assert all(_values(report, "merged", t)["accuracy"] == 100.0 for t in LABELS)  # ids read in the head's numbering


def test_a_task_without_a_head_in_heads_is_refused_naming_the_heads(headed, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2", "label": 0}])
    with pytest.raises(ConfigError, match=r"right for no task.*heads/ \(task0, task1\), and task 'sst2' has none "
                                          r"there.*--task task0=DATA") as e:
        featcal.evaluate({"sst2": data}, merged=headed["merged"], progress=False)
    assert "\n" not in str(e.value)


def _edit_meta(heads, **fields) -> None:
    meta = json.loads((heads / "task0.json").read_text())
    (heads / "task0.json").write_text(json.dumps({**meta, **fields}))


def _body_head(heads) -> None:
    """task0's "head" names, and holds, the word embeddings of the model's body (bert.*)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = "bert.embeddings.word_embeddings.weight"
    with safe_open(str(heads.parent / "model.safetensors"), "pt") as f:
        save_file({name: torch.zeros_like(f.get_tensor(name))}, str(heads / "task0.safetensors"))
    _edit_meta(heads, tensors=[name])


@pytest.mark.parametrize(("damage", "error"), [
    (lambda heads: _edit_meta(heads, id2label={"x": "negative", "1": "positive"}),
     r"task0\.json: id2label key 'x' is no class id"),  # was a ValueError traceback
    (_body_head, r"replaces 'bert\.embeddings\.word_embeddings\.weight', a tensor of the model's body \(bert\.\*\)"),
])  # was scored (50 %) through a model with its embeddings replaced, the row saying head heads/task0.safetensors
def test_a_heads_file_that_is_no_head_is_refused_before_any_model_runs(headed, tmp_path, damage, error):
    import shutil

    from featcal.errors import CheckpointError

    merged = tmp_path / "merged"
    shutil.copytree(headed["merged"], merged)
    damage(merged / "heads")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "label": "negative"} for t in TEXTS["task0"][:4]])
    with pytest.raises(CheckpointError, match=error) as e:
        featcal.evaluate({"task0": data}, merged=merged, progress=False)
    assert "\n" not in str(e.value)
