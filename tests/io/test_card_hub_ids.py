"""The model card names inputs by hub id, never by a machine's path (issue 53, item 2), and its tables stay whole
(issue 49): base_model from the id given (--hub-id ROLE=ID, a run file's hub_id:), else a hub cache path, else
config.json's `_name_or_path`; an input without one is named by a relative path and left out of base_model; the
data table shows each task's format; a `|` or a backtick in a task name is escaped."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from huggingface_hub import ModelCard

from featcal import merge
from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.io.write.card import build_card, find_hub_ids, write_card

pytestmark = pytest.mark.usefixtures("one_thread")


def _card(folder):
    return ModelCard.load(folder / "README.md")


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells, split on the `|` that are not escaped (as GitHub splits them)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def _report(root, tasks):
    """A calibration's report as featcal.json holds it, its inputs under `root` (absolute paths)."""
    return {
        "command": "calibrate", "params": {"lambda_ratio": 0.1},
        "inputs": {"merged": {"path": str(root / "merged")}, "base": {"path": str(root / "base")},
                   "experts": {t: {"path": f"/elsewhere/models/{i}"} for i, t in enumerate(tasks)},
                   "calibration": {t: {"source": str(root / "data" / f"{i}.jsonl"), "format": "jsonl",
                                       "content": "text", "examples": 4} for i, t in enumerate(tasks)}},
        "drift": [{"block": 0, "stack": "encoder", "layer": 0, "before": 1.0, "after": 0.5}],
        "output": {"path": str(root / "out")},
    }


def test_the_card_holds_no_absolute_path_and_its_tables_stay_whole(tmp_path):
    tasks = ["plain", "a|b", "tick`s"]
    report = _report(tmp_path, tasks)
    path = write_card(tmp_path, report)
    card = ModelCard.load(path)
    assert str(tmp_path) not in card.content and "/elsewhere" not in card.content
    assert card.data.base_model is None  # local folders are no hub ids: no lineage claimed
    assert "not hub ids" in card.text  # and the card says how it names them
    rows = [line for line in card.text.splitlines() if line.startswith("| ") and "jsonl" in line]
    assert len(rows) == 3
    for task, row in zip(tasks, rows, strict=True):
        cells = _cells(row)
        assert len(cells) == 4, row  # task, source, format, examples: the `|` in a name splits nothing
        assert cells[2] == "jsonl" and cells[3] == "4"  # the format the data record holds, not "?"
        assert task.replace("|", "\\|") in cells[0]
    assert rows[0].startswith("| `plain` | `data/0.jsonl` |")  # relative to the folder holding the output
    assert "``tick`s``" in rows[2]  # a longer fence around a name holding a backtick
    assert "- `plain`: `0`" in card.text  # an expert elsewhere: its folder's name only


def test_hub_ids_from_the_inputs_own_record(tmp_path):
    cache = tmp_path / "hub" / "models--org--base" / "snapshots" / "abc123"
    cache.mkdir(parents=True)
    (tmp_path / "e0").mkdir()
    (tmp_path / "e0" / "config.json").write_text(json.dumps({"_name_or_path": "org/expert-0"}))
    (tmp_path / "e1").mkdir()  # fine-tuned from the base, its config names the base: not its own id
    (tmp_path / "e1" / "config.json").write_text(json.dumps({"_name_or_path": "org/base"}))
    (tmp_path / "e2").mkdir()  # a local path saved in the config names nothing on the hub
    (tmp_path / "e2" / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/runs/e2"}))
    inputs = {"base": {"path": str(cache)}, "experts": {f"t{i}": {"path": str(tmp_path / f"e{i}")} for i in range(3)}}
    assert find_hub_ids(inputs) == {"base": ("org/base", "hub cache path"),
                                    "t0": ("org/expert-0", "config _name_or_path")}
    assert find_hub_ids(inputs, {"t1": "org/expert-1"})["t1"] == ("org/expert-1", "given")
    card = build_card({"command": "merge", "params": {"method": "ties"}, "inputs": inputs,
                       "output": {"path": str(tmp_path / "out")}})
    assert card.data.base_model == ["org/base", "org/expert-0"] and card.data.base_model_relation == "merge"


def test_merge_from_a_hub_cache_and_given_ids(bert, tmp_path):
    cached = tmp_path / "hub" / "models--org--tiny-bert" / "snapshots" / "0123abcd"
    shutil.copytree(bert["base"], cached)
    out = tmp_path / "m"
    merge(cached, bert["experts"], out=out, progress=False, hub_id={"task0": "org/task0-expert"})
    card = _card(out)
    assert card.data.base_model == ["org/tiny-bert", "org/task0-expert"]
    assert str(tmp_path) not in card.content
    base = json.loads((out / "featcal.json").read_text())["inputs"]["base"]
    assert base["hub_id"] == "org/tiny-bert" and base["hub_id_from"] == "hub cache path"
    with pytest.raises(ConfigError, match="'nope' is neither 'base' nor an expert's name"):
        merge(bert["base"], bert["experts"], out=tmp_path / "x", progress=False, hub_id={"nope": "org/x"})
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("pair", "error"), [("nope=org/x", "is neither 'base' nor an expert's name"),
                                             ("base=/abs/base", "'/abs/base' is not a hub id")])
def test_the_hub_id_flag_is_refused_before_any_work(bert, tmp_path, pair, error, capsys, no_merge_work):
    argv = ["merge", "--base", str(bert["base"]), *[f"--expert={t}={p}" for t, p in bert["experts"].items()],
            "--out", str(tmp_path / "m"), "--hub-id", pair, "--no-progress"]
    assert main(argv) == 2
    assert error in capsys.readouterr().err


def test_a_run_file_names_inputs_relative_and_by_the_ids_it_gives(bert, tmp_path, capsys):
    root = tmp_path / "project"
    shutil.copytree(bert["base"], root / "base")
    for t, p in bert["experts"].items():
        shutil.copytree(p, root / "experts" / t)
    run = {"merge": {"base": "base", "experts": {t: f"experts/{t}" for t in bert["experts"]},
                     "method": "task_arithmetic"},
           "out": "merged", "hub_id": {"base": "org/base"}}
    (root / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["run", str(root / "run.yaml"), "--no-progress"]) == 0
    card = _card(root / "merged")
    assert str(root) not in card.content and str(tmp_path) not in card.content  # featcal run's absolute paths
    assert card.data.base_model == ["org/base"]
    assert "Base model: `org/base`" in card.text
    assert all(f"| `{t}` | `experts/{t}` |" in card.text for t in bert["experts"])


def test_calibrate_takes_the_hub_id_flag_and_refuses_a_bad_one_before_work(bert, tmp_path, capsys,
                                                                         no_calibration_work):
    argv = ["calibrate", "--base", str(bert["base"]), "--merged", str(bert["merged"]),
            *[f"--expert={t}={p}" for t, p in bert["experts"].items()],
            *[f"--calib={t}={p}" for t, p in bert["data"].items()], "--out", str(tmp_path / "c"),
            "--hub-id", "base=org/base", "--hub-id", "task9=org/x", "--no-progress"]
    assert main(argv) == 2
    assert "'task9' is neither 'base' nor an expert's name" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
