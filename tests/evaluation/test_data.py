"""featcal eval's data reading (evaluation/data.py) and the example fingerprints the leakage guard compares."""

from __future__ import annotations

import datasets
import pytest

from featcal.data.fingerprint import example_sha256
from featcal.data.sources import open_source
from featcal.errors import ConfigError
from featcal.evaluation.data import read_eval_set
from tests.builders.data_fixtures import write_jsonl, write_png_folder


def test_an_image_reads_the_same_fingerprint_from_a_folder_a_jsonl_and_a_saved_dataset(tmp_path):
    folder = write_png_folder(tmp_path / "images", n_per_class=2, classes=("cat", "dog"))
    files = sorted(folder.rglob("*.png"))
    write_jsonl(tmp_path / "images.jsonl", [{"image": str(f.relative_to(tmp_path)), "label": f.parent.name}
                                            for f in files])
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "label": [int(f.parent.name == "dog") for f in files]}, features=features,
    )}).save_to_disk(str(tmp_path / "saved"))

    calibration = open_source(folder)  # what calibration fingerprints
    recorded = [example_sha256(e) for e in calibration.examples(range(len(calibration)), "image")]
    for source in (folder, tmp_path / "images.jsonl", tmp_path / "saved"):
        data = read_eval_set("t", source)
        assert data.fingerprints("image") == recorded, source
        assert [data.label_names[v] if isinstance(v, int) else v for v in data.labels()] == [f.parent.name for f in files]
    assert read_eval_set("t", folder).label_names == ("cat", "dog")
    assert example_sha256("a text", scheme=1) != example_sha256("a text ", scheme=1)  # scheme 1: the exact text
    assert example_sha256("a text") == example_sha256("a text ")  # now: whitespace the model does not read ignored


def test_a_saved_datasetdict_is_read_at_its_evaluation_split_or_names_split(tmp_path):
    def save(splits: dict, name: str):
        datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": [f"{s} {i}" for i in range(n)]})
                              for s, n in splits.items()}).save_to_disk(str(tmp_path / name))
        return tmp_path / name

    assert read_eval_set("t", save({"train": 5, "test": 3}, "a")).read_as["split"] == "test"
    assert read_eval_set("t", save({"train": 5, "validation": 2}, "b")).read_as["split"] == "validation"
    both = save({"train": 5, "validation": 2, "test": 3}, "c")
    with pytest.raises(ConfigError, match="--split"):
        read_eval_set("t", both)
    assert len(read_eval_set("t", both, split="validation")) == 2
    with pytest.raises(ConfigError, match="no split 'dev'"):
        read_eval_set("t", both, split="dev")


def test_max_examples_is_a_seeded_subset_the_same_for_every_model(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"w{i}", "label": i % 2} for i in range(30)])
    a = read_eval_set("t", tmp_path / "d.jsonl", max_examples=8, seed=1)
    assert a.rows == read_eval_set("t", tmp_path / "d.jsonl", max_examples=8, seed=1).rows == sorted(a.rows)
    assert len(a) == 8 and a.rows != list(range(8))
    assert a.labels() == [r % 2 for r in a.rows] and a.texts() == [f"w{r}" for r in a.rows]
    with pytest.raises(ConfigError, match="--label-column"):
        read_eval_set("t", tmp_path / "d.jsonl", label_column="gold")


def test_the_guard_compares_what_an_image_model_reads_not_a_caption_beside_it(tmp_path):
    """Calibration records an image model's images; an evaluation table holding those images with captions
    overlaps for that model (the images match), however the captions read."""
    import json

    from featcal.data.calibration import load_calibration_batches
    from featcal.evaluation.leakage import overlaps
    from tests.builders.tiny import tiny_model

    model_dir = tmp_path / "vision"
    tiny_model("clip").save_pretrained(model_dir)
    folder = write_png_folder(tmp_path / "images", n_per_class=2, classes=("cat", "dog"))
    record: dict = {}
    load_calibration_batches(folder, model_dir=model_dir, num_examples=2, batch_size=2, record=record)
    (model_dir / "featcal.json").write_text(json.dumps({"inputs": {"calibration": {"pets": record}}}))
    files = sorted(folder.rglob("*.png"))
    write_jsonl(tmp_path / "captioned.jsonl", [{"image": str(f.relative_to(tmp_path)), "text": f"a photo {i}"}
                                               for i, f in enumerate(files)])
    data = read_eval_set("t", tmp_path / "captioned.jsonl")
    found = overlaps("m", model_dir, [data], "image")
    assert [(o.task, o.examples, o.of, o.calibration_tasks) for o in found] == [("t", 2, 4, ("pets",))]
    assert overlaps("m", model_dir, [data], "text") == []  # the captions were never calibrated on
