"""What an output folder holds (docs/outputs.md): the model card, the tokenizer and chat template, the dtype,
the per-task heads, and the input cards / mergekit files it replaces."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers as T
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from featcal import FeatCalConfig, merge
from featcal.blocks.heads import LinearHead
from featcal.calibration.front.pipeline import CalibrateRequest, calibrate_to_dir
from featcal.cli.main import main
from featcal.config import OutputOptions
from featcal.errors import ConfigError
from tests.builders.data_fixtures import save_tokenizer
from tests.builders.tiny import perturbed, save, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = FeatCalConfig(num_calibration_examples=4, calibration_batch_size=2)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
CHAT = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]



def _card(folder):
    return ModelCard.load(folder / "README.md")


def test_merge_card_names_the_base_experts_and_recipe(bert, tmp_path):
    (bert["base"] / "README.md").write_text("---\nlicense: mit\n---\n# The base model's own card\n")
    try:
        out = tmp_path / "m"
        merge(bert["base"], bert["experts"], "ties", density=0.5, weights={"task0": 0.7}, out=out, progress=False,
              hub_id={"base": "org/base", **{t: f"org/{t}" for t in bert["experts"]}})
    finally:
        (bert["base"] / "README.md").unlink()
    card = _card(out)
    assert card.data.base_model == ["org/base", *(f"org/{t}" for t in bert["experts"])]  # hub ids, not paths
    assert card.data.library_name == "transformers" and card.data.base_model_relation == "merge"
    assert set(card.data.tags) >= {"merge", "featcal", "ties"}
    assert "The base model's own card" not in card.text and "Method: **ties**" in card.text
    assert "| `task0` |" in card.text and "0.7" in card.text
    report = json.loads((out / "featcal.json").read_text())
    assert report["replaced_input_files"]["base/README.md"]["sha256"]


def _fake_mergekit_merge(bert, root):
    """The merge folder as mergekit writes it: its README and mergekit_config.yml beside the weights."""
    merged = root / "mergekit-out"
    shutil.copytree(bert["merged"], merged)
    (merged / "README.md").write_text("---\ntags:\n- mergekit\n- merge\n---\n# merged\n\nThis is a merge of "
                                      "pre-trained language models created using mergekit.\n")
    recipe = {"merge_method": "task_arithmetic", "base_model": str(bert["base"]),
              "models": [{"model": str(p), "parameters": {"weight": 0.3}} for p in bert["experts"].values()]}
    (merged / "mergekit_config.yml").write_text(yaml.safe_dump(recipe))
    return merged


def test_calibrating_a_mergekit_merge_replaces_its_card_and_recipe_file(bert, tmp_path):
    merged = _fake_mergekit_merge(bert, tmp_path)
    out = tmp_path / "cal"
    calibrate_to_dir(CalibrateRequest(merged, bert["base"], bert["experts"], bert["data"], out, config=CFG,
                                      progress=False))
    assert not (out / "mergekit_config.yml").exists()
    card = _card(out)
    assert "created using mergekit" not in card.text and "mergekit" not in card.data.tags
    assert card.data.base_model is None and "featcal-calibrated" in card.data.tags  # no hub id known: no lineage
    assert str(bert["base"]) not in card.text  # nor a machine's path, the carried recipe's included
    assert "## Calibration (FeatCal)" in card.text and "### Per-block drift" in card.text
    assert "| `task0` |" in card.text and "| 4 |" in card.text  # the data: task, source, format, examples
    assert "merge_method: task_arithmetic" in card.text  # the merge's recipe, said to be the merge's
    replaced = json.loads((out / "featcal.json").read_text())["replaced_input_files"]
    assert set(replaced) == {"merged/README.md", "merged/mergekit_config.yml"}
    from featcal.io.read.hashes import file_sha256

    assert replaced["merged/mergekit_config.yml"]["sha256"] == file_sha256(merged / "mergekit_config.yml")


# --- tokenizer and chat template -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """A llama base whose tokenizer has no chat template, and two instruct experts sharing one."""
    root = tmp_path_factory.mktemp("instruct")
    base = tiny_model("llama")
    base_dir = save(base, root / "base")
    save_tokenizer(base_dir, "t5")
    experts = {}
    for i in range(2):
        d = save(perturbed(base, 100 + i), root / f"expert{i}")
        save_tokenizer(d, "t5")
        tok = T.AutoTokenizer.from_pretrained(d)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(d)
        experts[f"task{i}"] = d
    return base_dir, experts


def test_instruct_experts_chat_template_is_carried(instruct, tmp_path):
    base, experts = instruct
    assert T.AutoTokenizer.from_pretrained(base).chat_template is None
    out = tmp_path / "m"
    merge(base, experts, out=out, progress=False)
    expert_tok = T.AutoTokenizer.from_pretrained(experts["task0"])
    merged_tok = T.AutoTokenizer.from_pretrained(out)
    assert merged_tok.apply_chat_template(CHAT, tokenize=False) == expert_tok.apply_chat_template(CHAT, tokenize=False)
    assert merged_tok(["alpha beta"])["input_ids"] == expert_tok(["alpha beta"])["input_ids"]
    tok_report = json.loads((out / "featcal.json").read_text())["tokenizer"]
    assert tok_report["source"] == "base" and tok_report["chat_template_from"] == "expert 'task0', expert 'task1'"
    assert tok_report["chat_template"] is True


def test_conflicting_templates_stop_until_tokenizer_source_picks(instruct, tmp_path, capsys):
    base, experts = instruct
    other = tmp_path / "other"
    shutil.copytree(experts["task1"], other)
    tok = T.AutoTokenizer.from_pretrained(other)
    tok.chat_template = TEMPLATE.replace("<", "[")
    tok.save_pretrained(other)
    mixed = {"task0": experts["task0"], "task1": other}
    with pytest.raises(ConfigError, match=r"the base has no chat template and the experts disagree .*"
                                          r"--tokenizer-source base\|NAME"):
        merge(base, mixed, out=tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
    argv = ["merge", "--base", str(base), "--expert", f"task0={experts['task0']}", "--expert", f"task1={other}",
            "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "b"), "--tokenizer-source", "base"]) == 0
    assert T.AutoTokenizer.from_pretrained(tmp_path / "b").chat_template is None
    assert main([*argv, "--out", str(tmp_path / "t1"), "--tokenizer-source", "task1"]) == 0
    assert T.AutoTokenizer.from_pretrained(tmp_path / "t1").chat_template == TEMPLATE.replace("<", "[")
    report = json.loads((tmp_path / "t1" / "featcal.json").read_text())["tokenizer"]
    assert report["source"] == "expert 'task1'" and report["chosen_by"] == "tokenizer_source"
    assert main([*argv, "--out", str(tmp_path / "x"), "--tokenizer-source", "task7"]) == 2
    assert "tokenizer_source 'task7' is neither base nor an expert" in capsys.readouterr().err


# --- dtype -----------------------------------------------------------------------------------------------------

def test_bf16_in_bf16_out_through_merge_and_calibrate(bert, tmp_path, capsys):
    root = tmp_path / "bf16"
    for name in ("base", *bert["experts"]):
        src = bert["base"] if name == "base" else bert["experts"][name]
        T.BertModel.from_pretrained(src).to(torch.bfloat16).save_pretrained(root / name)
    save_tokenizer(root / "base", "bert")
    run = root / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": "base", "experts": {t: t for t in bert["experts"]}, "method": "ties"},
        "calibrate": {"calibration": {t: str(p) for t, p in bert["data"].items()},
                      "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}},
        "out": "out",
    }))
    assert main(["run", str(run), "--no-progress"]) == 0, capsys.readouterr().err
    weights = load_file(root / "out" / "model.safetensors")
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    assert json.loads((root / "out" / "featcal.json").read_text())["output"]["dtype"] == "bfloat16"
    # --dtype picks another one, for the merge and for the calibration
    half = tmp_path / "half"
    merge(root / "base", {t: root / t for t in bert["experts"]}, out=half, dtype="float16", progress=False)
    assert {t.dtype for t in load_file(half / "model.safetensors").values() if t.is_floating_point()} == {torch.float16}
    assert json.loads((half / "config.json").read_text()).get("dtype") == "float16"
    out32 = tmp_path / "cal32"
    calibrate_to_dir(CalibrateRequest(half, root / "base", {t: root / t for t in bert["experts"]}, bert["data"], out32,
                                      config=CFG, outputs=OutputOptions(dtype="float32"), progress=False))
    assert {t.dtype for t in load_file(out32 / "model.safetensors").values() if t.is_floating_point()} == {
        torch.float32}


def test_bad_dtype_is_refused(bert, tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        merge(bert["base"], bert["experts"], out=tmp_path / "m", dtype="int8", progress=False)


# --- task heads ------------------------------------------------------------------------------------------------

def test_different_label_sets_warn_and_write_each_tasks_head(tmp_path, caplog):
    torch.manual_seed(0)
    base = T.BertForSequenceClassification(tiny_config("bert")).eval()
    base_dir = save(base, tmp_path / "base")
    labels = {"task0": ["negative", "positive"], "task1": ["no", "yes"]}
    experts = {}
    for i, (task, names) in enumerate(labels.items()):
        e = perturbed(base, 200 + i, scale=0.3)
        e.config.id2label = dict(enumerate(names))
        e.config.label2id = {n: j for j, n in enumerate(names)}
        experts[task] = save(e, tmp_path / task)
    out = tmp_path / "m"
    with caplog.at_level(logging.WARNING, logger="featcal"):
        merge(base_dir, experts, out=out, progress=False)
    assert any("different task heads" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (out / "heads").iterdir()) == ["task0.json", "task0.safetensors", "task1.json",
                                                                  "task1.safetensors"]
    for task, names in labels.items():
        meta = json.loads((out / "heads" / f"{task}.json").read_text())
        assert list(meta["id2label"].values()) == names and meta["tensors"] == ["classifier.bias",
                                                                                "classifier.weight"]
        head = LinearHead.load(out / "heads" / f"{task}.safetensors")
        expert = load_file(experts[task] / "model.safetensors")
        assert torch.equal(head.weight.detach(), expert["classifier.weight"])
    report = json.loads((out / "featcal.json").read_text())
    assert set(report["task_heads"]) == {"task0", "task1"}
    assert "heads/" in _card(out).text


def test_same_label_sets_write_no_heads(bert, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="featcal"):
        merge(bert["base"], bert["experts"], out=tmp_path / "m", progress=False)
    assert not (tmp_path / "m" / "heads").exists()
    assert not any("different task heads" in r.getMessage() for r in caplog.records)

