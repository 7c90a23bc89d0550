"""`featcal reproduce` end to end on local copies laid out like the hub, plus the offline message."""

from __future__ import annotations

import json
import time

import pytest
import torch
import transformers as T

from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.experiments.reproduce.settings import SETTINGS, get_setting
from tests.builders.hub import build_clip_hub, build_glue_hub, build_mergebench_hub


def _run(capsys, *argv):
    rc = main(["reproduce", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ settings
def test_settings_use_the_paper_ids_and_numbers():
    b32 = get_setting("clip-vit-b32-ta8")
    assert b32.base_id == "openai/clip-vit-base-patch32"
    assert b32.task_names == ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")
    assert b32.tasks[1].expert_id == "tanganke/clip-vit-base-patch32_stanford-cars"
    data = {t.name: (t.data.id, t.data.config) for t in b32.tasks}
    assert data["stanford-cars"] == ("tanganke/stanford_cars", None)
    assert data["svhn"] == ("svhn", "cropped_digits") and data["mnist"] == ("ylecun/mnist", None)
    ref = b32.reference
    assert (ref.merge_avg, ref.featcal_avg) == (67.5, 85.5)
    assert sum(ref.featcal.values()) / 8 == pytest.approx(85.5, abs=0.05)
    assert sum(ref.merge.values()) / 8 == pytest.approx(67.5, abs=0.1)
    assert get_setting("clip-vit-l14-ta8").tasks[0].expert_id == "tanganke/clip-vit-large-patch14_sun397"
    t5 = get_setting("flan-t5-base-glue-ta8")
    assert t5.base_id == "google/flan-t5-base" and t5.tasks[0].expert_id == "tanganke/flan-t5-base_glue-cola"
    assert {t.data.id for t in t5.tasks} == {"nyu-mll/glue"}
    assert {t.name: t.data.eval_split for t in t5.tasks}["mnli"] == "validation_matched"
    llama = get_setting("llama-3.1-8b-mergebench")
    assert llama.base_id == "meta-llama/Llama-3.1-8B" and llama.tasks[1].expert_id == "MergeBench/Llama-3.1-8B_math"
    assert llama.tasks[1].data.id == "MergeBench/math_val"
    assert (llama.reference.merge_avg, llama.reference.featcal_avg) == (63.5, 65.8)
    assert set(SETTINGS) == {"clip-vit-b32-ta8", "clip-vit-b16-ta8", "clip-vit-l14-ta8", "flan-t5-base-glue-ta8",
                             "llama-3.2-3b-mergebench", "llama-3.1-8b-mergebench"}
    with pytest.raises(ConfigError, match="cars"):
        b32.restrict(["cars"])
    assert b32.restrict(["mnist", "eurosat"]).task_names == ("eurosat", "mnist")


# ------------------------------------------------------------------ offline
def test_offline_lists_every_missing_id_at_once_and_stops_fast(tmp_path, capsys):
    start = time.perf_counter()
    rc, out, err = _run(capsys, "clip-vit-b32-ta8", "--out", tmp_path / "run")
    assert time.perf_counter() - start < 15
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("featcal: error: ") and err.count("featcal: error") == 1
    for model_id in get_setting("clip-vit-b32-ta8").model_ids():
        assert model_id in err
    for ref in get_setting("clip-vit-b32-ta8").dataset_refs():
        assert ref.id in err
    assert "svhn (cropped_digits)" in err and "--model-dir" in err and "--data-dir" in err and "HF_HOME" in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_offline_message_leaves_out_what_is_local(tmp_path, capsys):
    models, data = build_glue_hub(tmp_path, tasks=("rte",), n_train=4, n_val=4)
    rc, _, err = _run(capsys, "flan-t5-base-glue-ta8", "--out", tmp_path / "run", "--tasks", "rte,cola",
                      "--model-dir", models, "--data-dir", data)
    assert rc == 2
    assert "tanganke/flan-t5-base_glue-cola" in err and "nyu-mll/glue (cola)" in err
    assert "google/flan-t5-base" not in err and "glue-rte" not in err and "(rte)" not in err


# ------------------------------------------------------------------ CLIP end to end
@pytest.fixture(scope="module")
def clip_hub(tmp_path_factory):
    return build_clip_hub(tmp_path_factory.mktemp("clip-hub"), tasks=("eurosat", "mnist"))


def _clip_args(hub, out, *extra):
    models, data = hub
    return ("clip-vit-b32-ta8", "--out", out, "--tasks", "eurosat,mnist", "--num-calibration-examples", 16,
            "--calibration-batch-size", 8, "--device", "cpu", "--batch-size", 8,
            "--model-dir", models, "--data-dir", data, *extra)


def test_clip_reproduce_end_to_end_then_resume(clip_hub, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    rc, stdout, err = _run(capsys, *_clip_args(clip_hub, out))
    assert rc == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    assert "eurosat" in stdout and "+FeatCal" in stdout and (out / "metrics.txt").read_text() in stdout
    for stage in ("merged", "featcal"):
        per_task = metrics["results"][stage]["per_task"]
        assert set(per_task) == {"eurosat", "mnist"} and all(0 <= v <= 100 for v in per_task.values())
        assert metrics["results"][stage]["average"] == pytest.approx(sum(per_task.values()) / 2, abs=1e-3)
        assert metrics["details"][stage]["mnist"]["n"] == 20
    assert metrics["reference"]["merged"]["per_task"] == {"eurosat": 73.3, "mnist": 96.1}
    assert metrics["reference"]["featcal"]["average"] == pytest.approx((96.2 + 98.8) / 2)
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["identity"]["seed"] == 42 and run_config["merge"]["scaling"] == 0.3
    assert "torch" in run_config["versions"] and run_config["data"]["mnist"]["calibration_rows"] == 24

    # the merged tower is Task Arithmetic of the base tower and the (4.x-layout) experts
    models, _ = clip_hub
    base = T.CLIPVisionModel.from_pretrained(models / "openai/clip-vit-base-patch32").state_dict()
    experts = [T.CLIPVisionModel.from_pretrained(models / f"tanganke/clip-vit-base-patch32_{t}").state_dict()
               for t in ("eurosat", "mnist")]
    merged = T.CLIPVisionModel.from_pretrained(out / "merged").state_dict()
    calibrated = T.CLIPVisionModel.from_pretrained(out / "featcal").state_dict()
    for name, b in base.items():
        expected = b + 0.3 * sum(e[name] - b for e in experts)
        assert torch.allclose(merged[name], expected, atol=1e-6), name
    block = "encoder.layers.1.mlp.fc1.weight"
    assert not torch.allclose(calibrated[block], merged[block])  # FeatCal moved the last block
    assert torch.equal(calibrated["embeddings.patch_embedding.weight"], merged["embeddings.patch_embedding.weight"])

    # the reported mnist accuracy is what CLIPModel's own forward gives (mnist has a single template)
    clip = T.CLIPModel.from_pretrained(models / "openai/clip-vit-base-patch32").eval()
    clip.vision_model = T.CLIPVisionModel.from_pretrained(out / "featcal").eval()
    proc = T.CLIPProcessor.from_pretrained(models / "openai/clip-vit-base-patch32")
    import datasets

    test = datasets.load_from_disk(str(clip_hub[1] / "ylecun/mnist"))["test"]
    prompts = [f'a photo of the number: "{d}".' for d in range(10)]
    enc = proc(text=prompts, images=[im.convert("RGB") for im in test["image"]], return_tensors="pt", padding=True)
    with torch.no_grad():
        pred = clip(**enc).logits_per_image.argmax(-1)
    accuracy = 100.0 * float((pred == torch.tensor(test["label"])).float().mean())
    assert metrics["results"]["featcal"]["per_task"]["mnist"] == pytest.approx(accuracy)

    # resume: nothing is merged, calibrated or evaluated again
    def refuse(*_a, **_k):
        raise AssertionError("a stage present in DIR was recomputed")

    monkeypatch.setattr("featcal.merging.api.merge", refuse)
    monkeypatch.setattr("featcal.calibration.front.api.calibrate", refuse)
    monkeypatch.setattr("featcal.experiments.reproduce.clip.evaluate_zero_shot", refuse)
    rc, _, err = _run(capsys, *_clip_args(clip_hub, out))
    assert rc == 0, err
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["results"] == metrics["results"]
    assert resumed["seconds"]["merge"] == "reused" and resumed["seconds"]["featcal"] == "reused"

    # other parameters in the same DIR are refused, before any work
    rc, _, err = _run(capsys, *_clip_args(clip_hub, out, "--seed", 7))
    assert rc == 2 and "seed: 42 there, 7 now" in err


def test_clip_eval_subset_is_deterministic_and_data_is_checked_before_work(clip_hub, tmp_path, capsys):
    runs = {}
    for name in ("a", "b"):
        rc, _, err = _run(capsys, *_clip_args(clip_hub, tmp_path / name, "--max-eval-samples", 5))
        assert rc == 0, err
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    details = runs["a"]["details"]
    assert details["merged"]["eurosat"]["n"] == 5 and details["featcal"]["mnist"]["n"] == 5
    assert runs["a"]["results"] == runs["b"]["results"]  # same inputs and seed -> same numbers
    for stage in ("merged", "featcal"):  # ... and byte-identical checkpoints
        a, b = (tmp_path / n / stage / "model.safetensors" for n in ("a", "b"))
        assert a.read_bytes() == b.read_bytes(), stage

    too_many = tmp_path / "too-many"
    rc, _, err = _run(capsys, *_clip_args(clip_hub, too_many)[:-4], "--num-calibration-examples", 1000,
                      "--model-dir", clip_hub[0], "--data-dir", clip_hub[1])
    assert rc == 2 and "task eurosat" in err and "fewer than --num-calibration-examples 1000" in err
    assert not (too_many / "merged").exists()


# ------------------------------------------------------------------ FLAN-T5 GLUE end to end
def test_glue_reproduce_end_to_end(tmp_path, capsys):
    models, data = build_glue_hub(tmp_path / "hub", tasks=("rte", "stsb"))
    out = tmp_path / "run"
    rc, stdout, err = _run(capsys, "flan-t5-base-glue-ta8", "--out", out, "--tasks", "rte,stsb",
                           "--num-calibration-examples", 16, "--calibration-batch-size", 8, "--device", "cpu",
                           "--batch-size", 8, "--model-dir", models, "--data-dir", data)
    assert rc == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    details = metrics["details"]["featcal"]
    assert details["rte"]["metric"] == "exact_match" and details["rte"]["n"] == 16
    assert details["stsb"]["metric"] == "spearman" and 0 <= details["stsb"]["unparsable"] <= 16
    assert metrics["reference"]["merged"]["average"] is None  # the paper gives only the 8-task average
    model = T.T5ForConditionalGeneration.from_pretrained(out / "featcal")
    merged = T.T5ForConditionalGeneration.from_pretrained(out / "merged")
    tok = T.AutoTokenizer.from_pretrained(out / "featcal")
    assert tok.eos_token_id == 1
    name = "decoder.block.1.layer.2.DenseReluDense.wo.weight"
    assert not torch.allclose(model.state_dict()[name], merged.state_dict()[name])


# ------------------------------------------------------------------ MergeBench end to end
def test_mergebench_writes_checkpoints_and_the_lm_eval_commands(tmp_path, capsys):
    models, data = build_mergebench_hub(tmp_path / "hub", tasks=("math", "instruction"))
    out = tmp_path / "run"
    rc, stdout, err = _run(capsys, "llama-3.2-3b-mergebench", "--out", out, "--tasks", "math,instruction",
                           "--num-calibration-examples", 8, "--calibration-batch-size", 4, "--device", "cpu",
                           "--model-dir", models, "--data-dir", data)
    assert rc == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    command = metrics["evaluate_with"]["featcal"]
    assert command.startswith("lm_eval --model hf") and f"pretrained={(out / 'featcal').resolve()}" in command
    assert "gsm8k_cot" in command and "ifeval" in command and command in stdout
    model = T.LlamaForCausalLM.from_pretrained(out / "featcal")
    assert model.config.num_hidden_layers == 2
    assert (out / "featcal" / "tokenizer.json").is_file()


def test_a_split_without_the_hub_columns_is_refused_before_any_work(clip_hub, tmp_path, capsys):
    import shutil

    import datasets

    data = tmp_path / "data"
    shutil.copytree(clip_hub[1], data)
    eurosat = datasets.load_from_disk(str(clip_hub[1] / "tanganke/eurosat")).rename_column("image", "img")
    shutil.rmtree(data / "tanganke/eurosat")
    eurosat.save_to_disk(str(data / "tanganke/eurosat"))
    out = tmp_path / "run"
    rc, _, err = _run(capsys, *_clip_args((clip_hub[0], data), out))
    assert rc == 2 and "task eurosat" in err and "['image']" in err and "'train'" in err
    assert not (out / "merged").exists() and not (out / "run_config.json").exists()

    # labels that do not match the task's class names are refused too
    original = datasets.load_from_disk(str(clip_hub[1] / "tanganke/eurosat"))
    relabelled = original.cast_column("label", datasets.ClassLabel(names=[f"c{i}" for i in range(12)]))
    shutil.rmtree(data / "tanganke/eurosat")
    relabelled.save_to_disk(str(data / "tanganke/eurosat"))
    rc, _, err = _run(capsys, *_clip_args((clip_hub[0], data), out))
    assert rc == 2 and "12 classes" in err and "10 class names" in err
    assert not (out / "merged").exists()


def test_metrics_table_lists_tasks_beside_the_paper():
    from featcal.experiments.reproduce.report import build_metrics, format_table

    setting = get_setting("clip-vit-b32-ta8").restrict(["mnist"])
    metrics = build_metrics(setting, {"merged": {"mnist": {"accuracy": 50.0}}, "featcal": {"mnist": {"accuracy": 75.0}}})
    table = format_table(metrics)
    assert "mnist" in table and "50.0" in table and "75.0" in table and "96.1" in table and "98.8" in table
    full = build_metrics(get_setting("llama-3.2-3b-mergebench"), {})
    table = format_table(full)
    assert "math" not in table and "60.1" in table and "62.1" in table  # averages only


def test_models_are_found_in_the_hf_cache_named_by_hf_home(tmp_path):
    """HF_HOME is read when huggingface_hub is imported, so the check runs in a fresh process."""
    import os
    import shutil
    import subprocess
    import sys

    models, data = build_mergebench_hub(tmp_path / "hub", tasks=("math",), n_rows=2)
    commit = "0" * 40
    for model_id in ("meta-llama/Llama-3.2-3B", "MergeBench/Llama-3.2-3B_math"):
        repo = tmp_path / "home" / "hub" / ("models--" + model_id.replace("/", "--"))
        shutil.copytree(models / model_id, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    code = (
        "from featcal.experiments.reproduce.resolve import Sources, resolve_all\n"
        "from featcal.experiments.reproduce.settings import get_setting\n"
        f"r = resolve_all(get_setting('llama-3.2-3b-mergebench').restrict(['math']), Sources(None, {str(data)!r}))\n"
        "print(r.models['meta-llama/Llama-3.2-3B'])\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"models--meta-llama--Llama-3.2-3B/snapshots/{commit}")
