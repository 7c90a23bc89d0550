"""Issue 49, an attacker's pass over the outputs: an output inside an input folder is refused before any work (its
files would join that input: a data folder read them as data next time); a carried mergekit recipe shows no
absolute path in any spelling and cannot break out of its code block; a merged input's featcal.json of any shape
loses no calibration to a traceback, and what it says reaches the card only as text."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import ModelCard

import featcal
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError
from featcal.io.write.card import build_card
from tests.builders.guarantees import calibrate_argv, cli, one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = ("--num-calibration-examples", "4", "--calibration-batch-size", "4")


@pytest.mark.parametrize("inside", ["merged", "expert", "data"])
def test_an_output_inside_an_input_folder_is_refused_before_work(bert, tmp_path, capsys, inside,
                                                                no_calibration_work):
    texts = tmp_path / "texts"  # a data folder: an output inside it would be read as data by the next run
    texts.mkdir()
    (texts / "a.txt").write_text("w0 w1 w2\nw3 w4\n")
    fam = {**bert, "data": {"task0": texts, "task1": bert["data"]["task1"]}}
    parent = {"merged": bert["merged"], "expert": bert["experts"]["task1"], "data": texts}[inside]
    out = parent / "calibrated"
    rc, _, err = cli(calibrate_argv(fam, out, calib_flags=FLAGS), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert "lies inside an input" in line and str(out) in line, line
    assert not out.exists() and sorted(p.name for p in texts.iterdir()) == ["a.txt"]
    with pytest.raises(ConfigError, match="lies inside an input"):
        featcal.calibrate(bert["merged"], base=bert["base"], experts=bert["experts"], calibration=fam["data"],
                          out=out, config=FeatCalConfig(num_calibration_examples=4))
    assert not out.exists()


def test_merge_refuses_an_output_inside_the_base_folder(bert, tmp_path, capsys, no_merge_work):
    base = tmp_path / "base"
    shutil.copytree(bert["base"], base)
    argv = ["merge", "--base", str(base), *[f"--expert={t}={p}" for t, p in bert["experts"].items()],
            "--out", str(base / "merged"), "--no-progress"]
    rc, _, err = cli(argv, capsys)
    assert rc == 2 and "lies inside an input (base" in one_line_error(err)
    assert not (base / "merged").exists()


RECIPE = """models:
  - model: file:///home/alice/models/m1
  - model: C:\\Users\\alice\\models\\m2
  - model: \\\\fileserver\\share\\m3
  - model: ~alice/models/m4
    parameters: {weight: 0.5, note: (/home/alice/m5)}
base_model: org/base
paths: /home/alice/a:/home/alice/b
hub: https://huggingface.co/org/base
```
# injected heading
"""


def test_a_carried_recipe_shows_no_absolute_path_and_stays_in_its_code_block(tmp_path):
    report = {"command": "calibrate", "params": {}, "output": {"path": str(tmp_path / "out")},
              "inputs": {"base": {"path": str(tmp_path / "base")}, "experts": {}},
              "replaced_input_files": {"merged/mergekit_config.yml": {"text": RECIPE}}}
    card = build_card(report)
    for leak in ("/home/alice", "alice\\", "C:\\", "\\\\fileserver", "~alice", "file://"):
        assert leak not in card.content, leak
    for name in ("m1", "m2", "m3", "m4", "(m5)", "a:b", "org/base", "https://huggingface.co/org/base"):
        assert name in card.text, name
    block = card.text.split("````yaml\n", 1)[1].split("\n````\n", 1)[0]  # a fence longer than the recipe's
    assert "# injected heading" in block and "```" in block


@pytest.mark.parametrize("written", [
    [1, 2],
    {"command": "merge", "params": [1]},
    {"command": "merge", "params": {"method": "ties", "weights": [1]}, "inputs": {"experts": [1, 2]}},
    {"command": "merge", "params": {"method": "ties\n---\nevil: 1", "paths": {"deep": "/home/alice/secret"}},
     "inputs": {"experts": {"t": {"path": "/home/alice/x", "hub_id": "/home/alice/y"}}}, "task_heads": [1]},
])
def test_a_merged_inputs_featcal_json_of_any_shape_loses_no_calibration(bert, tmp_path, capsys, written):
    merged = tmp_path / "merged"
    shutil.copytree(bert["merged"], merged)
    (merged / "featcal.json").write_text(json.dumps(written))
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv({**bert, "merged": merged}, out, calib_flags=FLAGS), capsys)
    assert rc == 0, err
    card = ModelCard.load(out / "README.md")
    assert "/home/alice" not in card.content and "evil" not in str(card.data.tags)
    assert "task_heads" not in json.loads((out / "featcal.json").read_text())  # no heads/ came with the merge


@pytest.mark.parametrize("linked", ["heads/task0.safetensors", "heads", "notes.txt"])
def test_an_input_file_linked_from_outside_its_folder_is_not_copied_into_the_output(bert, tmp_path, capsys, linked,
                                                                                     no_calibration_work):
    """calibrate copies the merge's side files and heads/ into its output: a link in them to a file elsewhere (a
    token, a key) carried that file into an output made to be shared. Refused before any work, naming the link."""
    secret = tmp_path / "token"
    secret.write_text("hf_not_for_sharing")
    merged = tmp_path / "merged"
    shutil.copytree(bert["merged"], merged)
    if linked.startswith("heads"):
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        (outside / "task0.json").write_text(json.dumps({"tensors": ["classifier.weight"]}))
        (outside / "task0.safetensors").symlink_to(secret)
        if linked != "heads":
            (merged / "heads").mkdir()
            (merged / "heads" / "task0.json").write_text(json.dumps({"tensors": ["classifier.weight"]}))
        (merged / linked).symlink_to(outside if linked == "heads" else secret)
    else:
        (merged / linked).symlink_to(secret)
    out = tmp_path / "out"
    rc, _, err = cli(calibrate_argv({**bert, "merged": merged}, out, calib_flags=FLAGS), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert f"{merged / linked} is a symbolic link to" in line and "outside" in line, line
    assert not out.exists()


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_is_read_and_copied(bert, tmp_path, capsys):
    """The hub cache's own layout: snapshots/REV/FILE -> ../../blobs/SHA. Those links stay inside the repository."""
    repo = tmp_path / "hub" / "models--org--tiny-bert"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in bert["base"].iterdir() if p.is_file())):
        shutil.copy2(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    out = tmp_path / "m"
    argv = ["merge", "--base", str(snapshot), *[f"--expert={t}={p}" for t, p in bert["experts"].items()],
            "--out", str(out), "--no-progress"]
    rc, _, err = cli(argv, capsys)
    assert rc == 0, err
    assert (out / "config.json").is_file() and not (out / "config.json").is_symlink()
