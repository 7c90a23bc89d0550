"""Guarantees from issue 20 about models: output dtype, option bounds and drift warnings, hub layouts.

Covers docs/guarantees.md: a 16-bit merge is calibrated in float32 and written in its own dtype;
`covariance_eps` and `lambda_ratio` have upper bounds; a calibration that makes the end-to-end drift
worse than the merge's is reported; the README's hub pairing (a full CLIPModel base with
transformers-4 CLIPVisionModel experts) merges and calibrates, from local stand-ins laid out like
the hub.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch
import yaml
from safetensors.torch import load_file

from featcal.config import FeatCalConfig, parse
from featcal.errors import ConfigError
from tests.builders.guarantees import (
    calibrate_argv,
    cli,
    copy_family,
    edit_config,
    merge_argv,
    one_line_error,
    rewrite,
    weights_sha,
)
from tests.builders.hub import build_clip_hub
from tests.builders.pipeline_family import t5_family

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]



def _store_as(directory, dtype: torch.dtype) -> None:
    """Rewrite a checkpoint's floating tensors (and its config's dtype) in `dtype`; exact for upcasts."""
    rewrite(directory, lambda sd: sd.update({k: v.to(dtype) for k, v in sd.items() if v.is_floating_point()}))
    edit_config(directory, dtype=str(dtype).removeprefix("torch."))


# --- item 9: the merged model's dtype is kept -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_merge_is_calibrated_in_float32_and_written_in_its_dtype(clip, tmp_path, capsys, dtype):
    name = str(dtype).removeprefix("torch.")
    half = copy_family({k: v for k, v in clip.items() if k != "merged"}, tmp_path / "half")
    for d in (half["base"], *half["experts"].values()):
        _store_as(d, dtype)
    half["merged"] = tmp_path / "half" / "merged"
    rc, _, err = cli(merge_argv(half["base"], half["experts"], half["merged"]), capsys)
    assert rc == 0, err
    assert {v.dtype for v in load_file(half["merged"] / "model.safetensors").values() if v.is_floating_point()} == {dtype}
    full = copy_family(half, tmp_path / "full")  # the same values stored in float32 (the upcast is exact)
    for d in (full["base"], full["merged"], *full["experts"].values()):
        _store_as(d, torch.float32)

    for fam in (half, full):
        rc, _, err = cli(calibrate_argv(fam, fam["base"].parent / "cal"), capsys)
        assert rc == 0, err
    out16, out32 = tmp_path / "half" / "cal", tmp_path / "full" / "cal"
    got, reference = load_file(out16 / "model.safetensors"), load_file(out32 / "model.safetensors")
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {dtype}
    assert json.loads((out16 / "config.json").read_text())["dtype"] == name
    assert json.loads((out16 / "featcal.json").read_text())["output"]["dtype"] == name
    # computed in float32 and rounded once: exactly the float32 calibration of the same values, cast
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v.to(dtype) if v.is_floating_point() else v), k
    merged = load_file(half["merged"] / "model.safetensors")
    assert not torch.equal(got["encoder.layers.0.mlp.fc1.weight"], merged["encoder.layers.0.mlp.fc1.weight"])
    assert (out16 / "model.safetensors").stat().st_size < 0.6 * (out32 / "model.safetensors").stat().st_size


# --- item 10: bounded ridge terms; a calibration that makes the end-to-end drift worse is reported -----------



@pytest.mark.parametrize(("field", "value"), [
    ("covariance_eps", 1e300), ("covariance_eps", 0.0101), ("lambda_ratio", 1e300), ("lambda_ratio", 100.5),
])
def test_ridge_terms_have_an_upper_bound(field, value):
    with pytest.raises(ConfigError, match=rf"invalid FeatCalConfig: {field}: Input should be less than or equal"):
        parse(FeatCalConfig, {field: value})
    assert parse(FeatCalConfig, {"covariance_eps": 0.01, "lambda_ratio": 100.0}).covariance_eps == 0.01


def test_a_huge_covariance_eps_is_refused_before_any_work(clip, tmp_path, capsys, no_calibration_work):
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "out", "--covariance-eps", "1e300"), capsys)
    assert rc == 2 and "covariance_eps: Input should be less than or equal to 0.01" in one_line_error(err)
    assert not (tmp_path / "out").exists()
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
        "calibrate": {"calibration": {t: str(p) for t, p in clip["data"].items()}, "config": {"lambda_ratio": 1e300}},
        "out": str(tmp_path / "run-out"),
    }))
    rc, _, err = cli(["run", run, "--no-progress"], capsys)
    assert rc == 2 and "lambda_ratio: Input should be less than or equal to 100" in one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


# ρ = 10 with λ = 100: every weight pinned to θ0 + 10·(θm − θ0), far past the merge: worse end to end
WORSE = ("--anchor-blend-rho", "10", "--lambda-ratio", "100")


def test_a_calibration_that_worsens_the_end_to_end_drift_is_reported(clip, tmp_path, capsys):
    rc, out, err = cli(calibrate_argv(clip, tmp_path / "good"), capsys)
    assert rc == 0, err
    assert "end-to-end drift (final vision block, class token, first batch of each task): merged" in out
    assert "WORSE" not in out
    good = json.loads((tmp_path / "good" / "featcal.json").read_text())
    e2e = good["end_to_end_drift"]
    assert e2e["tokens"] == "class token" and 0 <= e2e["calibrated"] < e2e["merged"]
    assert good["warnings"] == []

    rc, out, err = cli(calibrate_argv(clip, tmp_path / "bad", *WORSE), capsys)
    assert rc == 0, err  # a legal configuration: the output is written, and the report says what it did
    bad = json.loads((tmp_path / "bad" / "featcal.json").read_text())
    assert bad["end_to_end_drift"]["calibrated"] > bad["end_to_end_drift"]["merged"]
    assert bad["end_to_end_drift"]["merged"] == pytest.approx(e2e["merged"])  # the merge's drift, not the run's
    assert [w for w in bad["warnings"] if "end-to-end drift worse than the merge's" in w]
    assert "WORSE than the merge" in out


def test_the_console_warns_when_the_end_to_end_drift_gets_worse(clip, tmp_path):
    argv = [str(a) for a in calibrate_argv(clip, tmp_path / "bad", *WORSE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "featcal", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "WARNING featcal.calibration: calibration made the end-to-end drift worse than the merge's" in done.stderr


# --- item 12: the README's hub pairing, transformers-4 layouts, one-sided position_ids, explicit tied copies ----

REV = "0" * 40


def _hub_cache(models: Path, cache: Path) -> Path:
    """A hub cache (models--ORG--NAME/snapshots/REV, refs/main) holding every checkpoint under `models`."""
    for d in sorted(p.parent for p in models.rglob("config.json")):
        org, name = d.relative_to(models).parts
        repo = cache / f"models--{org}--{name}"
        shutil.copytree(d, repo / "snapshots" / REV)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(REV)
    return cache


def _readme_commands() -> list[list[str]]:
    """The hub commands of docs/quickstart.md ("Command line": once the README's), continuations joined, placeholders
    (`...`) left out."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    block = text.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = [shlex.split(line, comments=True) for line in joined.splitlines() if line.startswith("featcal ")]
    return [c for c in commands if "..." not in c]


@pytest.fixture(scope="module")
def clip_hub(tmp_path_factory):
    """The README's hub ids, resolved offline from a hub cache of tiny stand-ins laid out like the hub.

    The base is a whole CLIPModel whose file also keeps `position_ids` buffers (as the hub's does); the
    eurosat expert is a CLIPVisionModel in the transformers-4 layout (`vision_model.` prefix), svhn in the 5.x one.
    """
    root = tmp_path_factory.mktemp("clip-hub")
    models, data = build_clip_hub(root, ("eurosat", "svhn"), n_train=256, n_test=2)
    base = models / "openai" / "clip-vit-base-patch32"
    rewrite(base, lambda sd: sd.update({"vision_model.embeddings.position_ids": torch.arange(17)[None],
                                        "text_model.embeddings.position_ids": torch.arange(77)[None]}))
    cache = _hub_cache(models, root / "hub-cache")
    work = root / "work"
    for where in (work / "data", work / "examples" / "data"):  # README paths, and the example's own folder
        where.mkdir(parents=True)
        (where / "eurosat-train").symlink_to(data / "tanganke" / "eurosat")
        (where / "svhn-train").symlink_to(data / "svhn" / "cropped_digits")
        (where / "eurosat-test").symlink_to(data / "tanganke" / "eurosat")  # its test split, for `featcal eval`
    shutil.copy2(REPO / "examples" / "ta_featcal.yaml", work / "examples" / "ta_featcal.yaml")
    return {"models": models, "cache": cache, "work": work}


@pytest.fixture
def offline_hub(clip_hub, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(clip_hub["cache"]))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(clip_hub["work"])
    return clip_hub


def test_the_readme_hub_commands_work(offline_hub, capsys):
    from featcal.experiments.reproduce.clip import load_vision_tower

    commands = _readme_commands()
    assert [c[:2] for c in commands] == [["featcal", "merge"], ["featcal", "calibrate"], ["featcal", "run"],
                                         ["featcal", "eval"]]
    assert "openai/clip-vit-base-patch32" in commands[0] and "tanganke/clip-vit-base-patch32_eurosat" in " ".join(commands[0])
    for argv in commands:
        rc, _, err = cli([*argv[1:], "--no-progress"], capsys)
        assert rc == 0, (argv, err)

    work, models = offline_hub["work"], offline_hub["models"]
    # merge: the base's vision tower with the experts' task vectors, written as a CLIPVisionModel (5.x names)
    config = json.loads((work / "merged" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("clip_vision_model", ["CLIPVisionModel"])
    merged = load_file(work / "merged" / "model.safetensors")
    base = load_vision_tower(models / "openai" / "clip-vit-base-patch32").state_dict()
    experts = [load_vision_tower(models / "tanganke" / f"clip-vit-base-patch32_{t}").state_dict()
               for t in ("eurosat", "svhn")]
    assert merged.keys() == base.keys()
    for k, v in base.items():
        torch.testing.assert_close(merged[k], v + 0.3 * sum(e[k] - v for e in experts), rtol=0, atol=1e-6)
    report = json.loads((work / "merged" / "featcal.json").read_text())
    assert report["inputs"]["base"]["read_as"] == "the vision tower of a CLIPModel"
    # calibrate and run: CLIPVisionModel checkpoints the base's processor preprocesses for
    for out in (work / "calibrated", work / "examples" / "runs" / "clip-b32-ta-featcal"):
        tower = load_vision_tower(out)
        assert set(tower.state_dict()) == set(base)
        assert (out / "processor_config.json").is_file() or (out / "preprocessor_config.json").is_file()
    calibrated = load_file(work / "calibrated" / "model.safetensors")
    assert not torch.equal(calibrated["encoder.layers.0.mlp.fc1.weight"], merged["encoder.layers.0.mlp.fc1.weight"])
    # eval: the vision towers read zero-shot through the base CLIP, on the test split, the expert on its task
    report = json.loads((work / "eval" / "eval.json").read_text())
    assert report["tasks"]["eurosat"]["split"] == "test"
    assert {(r["model"], r["metric"]) for r in report["results"]} == {
        (m, "accuracy") for m in ("base", "merged", "calibrated", "experts")}
    assert [g["model"] for g in report["gap_closed"] if g["task"] == "eurosat"] == ["base", "calibrated"]


def test_a_position_ids_buffer_on_one_side_only_is_left_out(clip, tmp_path, capsys):
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "clean"), capsys)
    assert rc == 0, err
    fam = copy_family(clip, tmp_path / "fam")
    rewrite(fam["base"], lambda sd: sd.update({"embeddings.position_ids": torch.arange(17)[None]}))  # as 4.x saved
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "merged"), capsys)
    assert rc == 0, err
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == load_file(
        tmp_path / "clean" / "model.safetensors").keys()  # recreated by the model: not written
    assert weights_sha(tmp_path / "merged") == weights_sha(tmp_path / "clean")

    for d in fam["experts"].values():  # now the other way round: the experts have it, merged model and base not
        rewrite(d, lambda sd: sd.update({"embeddings.position_ids": torch.arange(17)[None]}))
    rewrite(fam["base"], lambda sd: sd.pop("embeddings.position_ids"))
    for name, family in (("cal", fam), ("cal-clean", clip)):
        rc, _, err = cli(calibrate_argv(family, tmp_path / name), capsys)
        assert rc == 0, err
    assert weights_sha(tmp_path / "cal") == weights_sha(tmp_path / "cal-clean")


def _store_tied_copies(directory: Path, bump: float = 0.0) -> None:
    """What transformers 4 wrote for T5: the tied encoder/decoder embeddings stored beside `shared.weight`."""
    def add(sd):
        sd["encoder.embed_tokens.weight"] = sd["shared.weight"].clone()
        sd["decoder.embed_tokens.weight"] = sd["shared.weight"].clone() + bump
    rewrite(directory, add)


def test_t5_experts_that_store_tied_embeddings_merge_and_calibrate(tmp_path, capsys):
    fam = t5_family(tmp_path / "t5")
    tied = copy_family(fam, tmp_path / "tied")
    for d in tied["experts"].values():
        _store_tied_copies(d)
    for family, name in ((fam, "m-clean"), (tied, "m-tied")):
        rc, _, err = cli(merge_argv(family["base"], family["experts"], tmp_path / name), capsys)
        assert rc == 0, err
    assert weights_sha(tmp_path / "m-tied") == weights_sha(tmp_path / "m-clean")
    for family, name in ((fam, "c-clean"), (tied, "c-tied")):
        rc, _, err = cli(calibrate_argv(family, tmp_path / name), capsys)
        assert rc == 0, err
    assert weights_sha(tmp_path / "c-tied") == weights_sha(tmp_path / "c-clean")

    _store_tied_copies(next(iter(tied["experts"].values())), bump=1.0)  # a copy that is not the tied value
    rc, _, err = cli(merge_argv(tied["base"], tied["experts"], tmp_path / "m-bad"), capsys)
    assert rc == 2 and "'decoder.embed_tokens.weight' differs from 'shared.weight'" in one_line_error(err)
    rc, _, err = cli(calibrate_argv(tied, tmp_path / "c-bad"), capsys)
    assert rc == 2 and "'decoder.embed_tokens.weight' differs from 'shared.weight'" in one_line_error(err)
    assert not (tmp_path / "m-bad").exists() and not (tmp_path / "c-bad").exists()


def test_whole_model_merges_read_the_clip_pairing_as_vision_towers(clip_hub, tmp_path, capsys):
    """RegMean on the hub pairing gives exactly RegMean on the same towers saved as CLIPVisionModels."""
    from featcal.experiments.reproduce.clip import load_vision_tower

    models, work = clip_hub["models"], clip_hub["work"]
    paired = {"base": models / "openai" / "clip-vit-base-patch32",
              "experts": {t: models / "tanganke" / f"clip-vit-base-patch32_{t}" for t in ("eurosat", "svhn")}}
    towers = {"base": tmp_path / "base", "experts": {t: tmp_path / t for t in paired["experts"]}}
    for src, dst in ((paired["base"], towers["base"]), *((paired["experts"][t], towers["experts"][t]) for t in paired["experts"])):
        load_vision_tower(src).save_pretrained(dst)
    for f in paired["base"].iterdir():  # the processor files
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, towers["base"] / f.name)
    flags = ["--method", "regmean", "--num-calibration-examples", "4", "--calibration-batch-size", "2",
             "--calib", f"eurosat={work / 'data' / 'eurosat-train'}", "--calib", f"svhn={work / 'data' / 'svhn-train'}"]
    for fam, out in ((paired, tmp_path / "rm-paired"), (towers, tmp_path / "rm-towers")):
        rc, _, err = cli(merge_argv(fam["base"], fam["experts"], out, *flags), capsys)
        assert rc == 0, err
    assert json.loads((tmp_path / "rm-paired" / "config.json").read_text())["architectures"] == ["CLIPVisionModel"]
    assert weights_sha(tmp_path / "rm-paired") == weights_sha(tmp_path / "rm-towers")


def test_a_vision_expert_of_another_shape_is_refused_not_truncated(clip_hub, tmp_path, capsys):
    import transformers as T

    from tests.builders.hub import _save_v4_vision

    base = clip_hub["models"] / "openai" / "clip-vit-base-patch32"
    vision = json.loads((base / "config.json").read_text())["vision_config"]
    deeper = T.CLIPVisionModel(T.CLIPVisionConfig(**{**vision, "num_hidden_layers": 3}))
    _save_v4_vision(deeper, tmp_path / "deeper")  # the transformers-4 layout: renamed, then compared
    rc, _, err = cli(merge_argv(base, {"deep": tmp_path / "deeper"}, tmp_path / "out"), capsys)
    assert rc == 2 and "has tensor 'vision_model.encoder.layers.2.layer_norm1.bias' and 15 more" in one_line_error(err)
    assert not (tmp_path / "out").exists()
