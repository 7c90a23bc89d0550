"""`featcal.calibrate(..., out=DIR)` writes the publishable folder `featcal calibrate --out` writes, by the same
writer (issue 53, item 1): it loads with AutoModelForCausalLM / AutoTokenizer (chat template included), its card
parses, featcal.json is there, and the weights equal the CLI's for the same inputs. What it cannot name in
featcal.json (models or data in memory) is refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from huggingface_hub import ModelCard
from safetensors.torch import load_file

import featcal
from featcal import FeatCalConfig
from featcal.cli.main import main
from featcal.errors import ConfigError, OutputExistsError
from tests.builders.data_fixtures import sentences
from tests.builders.pipeline_family import llama_text_family

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = dict(num_calibration_examples=4, calibration_batch_size=2)
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama family with tokenizers everywhere (the merge's with a chat template), JSONL texts per task."""
    fam = llama_text_family(tmp_path_factory.mktemp("out"), {t: sentences(4, seed=i)
                                                             for i, t in enumerate(("task0", "task1"))})
    tok = T.AutoTokenizer.from_pretrained(fam["merged"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(fam["merged"])
    return fam


def _calibrate(fam, **kw):
    return featcal.calibrate(str(fam["merged"]), base=str(fam["base"]), experts=fam["experts"],
                             calibration=fam["data"], config=FeatCalConfig(**CFG), progress=False, **kw)


def test_out_writes_the_folder_the_cli_writes(family, tmp_path, capsys):
    out = tmp_path / "api"
    result = _calibrate(family, out=out, hub_id={"base": "org/tiny-llama"})
    assert isinstance(result, featcal.CalibrationResult) and len(result.drift) == 2
    model = T.AutoModelForCausalLM.from_pretrained(out)
    tok = T.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TEMPLATE
    ids = tok("alpha beta", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, result.model(ids).logits)  # the result's model is what was written
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == ["org/tiny-llama"] and "featcal-calibrated" in card.data.tags
    report = json.loads((out / "featcal.json").read_text())
    assert report["command"] == "calibrate" and [r["block"] for r in report["drift"]] == [0, 1]
    assert (out / "generation_config.json").is_file() and (out / "config.json").is_file()

    cli = tmp_path / "cli"
    argv = ["calibrate", "--base", str(family["base"]), "--merged", str(family["merged"]),
            *[a for t, p in family["experts"].items() for a in ("--expert", f"{t}={p}")],
            *[a for t, p in family["data"].items() for a in ("--calib", f"{t}={p}")], "--out", f"{cli}//",
            "--num-calibration-examples", "4", "--calibration-batch-size", "2", "--no-progress"]
    capsys.readouterr()
    assert main(argv) == 0
    assert f"calibrated checkpoint: {cli}  (load" in capsys.readouterr().out  # the path shown clean
    assert sorted(p.name for p in cli.iterdir()) == sorted(p.name for p in out.iterdir())
    want, got = load_file(cli / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    with pytest.raises(OutputExistsError):  # refused before any work; overwrite=True replaces it
        _calibrate(family, out=out)
    _calibrate(family, out=out, overwrite=True, dtype="bfloat16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.parametrize(("change", "error"), [
    ({"calibration": {"task0": ["some text"], "task1": ["more text"]}}, r"calibration\['task0'\] is a list"),
    ({"tokenizer": "somewhere"}, "takes no tokenizer="),
    ({"keep_resume_state": True}, "takes no keep_resume_state="),
    ({"base": None}, "needs base="),
])
def test_out_refuses_what_featcal_json_cannot_name(family, tmp_path, change, error, no_calibration_work):
    kw = dict(base=str(family["base"]), experts=family["experts"], calibration=family["data"],
              config=FeatCalConfig(**CFG), progress=False, out=tmp_path / "o")
    with pytest.raises(ConfigError, match=error):
        featcal.calibrate(str(family["merged"]), **{**kw, **change})
    assert not (tmp_path / "o").exists()


def test_output_keywords_without_out_are_refused(family):
    with pytest.raises(ConfigError, match="give out= too"):
        _calibrate(family, dtype="bfloat16")
