"""Guarantees, safe loading: safetensors by default, pickles only on request and only plain tensors, no remote code.

Covers docs/guarantees.md "Loading": a pytorch_model.bin checkpoint is refused by every entry point
(merge, calibrate, run, load_model, the Python API) without --allow-pickle; with it, it loads through
torch.load(weights_only=True) and gives the same result; a pickle whose unpickling would run code is
refused even with --allow-pickle, and the code never runs; custom code named by a config's auto_map
never runs, and no call in the code base turns trust_remote_code on.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import featcal
from featcal import calibrate, merge
from featcal.errors import CheckpointError
from featcal.io.read.models import load_model
from tests.builders.guarantees import (
    calibrate_argv,
    cli,
    copy_family,
    leftovers,
    merge_argv,
    one_line_error,
    save_as_pickle,
    save_malicious_pickle,
    weights_sha,
)

SRC = Path(featcal.__file__).parent
REFUSED = r"holds only pickled weights \(pytorch_model.bin\); pickles can run code when loaded, so featcal refuses them"


pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def pickled(clip, tmp_path_factory):
    """The clip family with expert 'task1' (and a copy of the merged model) as plain-tensor pickles."""
    root = tmp_path_factory.mktemp("pickled")
    fam = copy_family(clip, root / "fam")
    fam["experts"]["task1"] = save_as_pickle(clip["experts"]["task1"], root / "task1-bin")
    fam["merged_bin"] = save_as_pickle(clip["merged"], root / "merged-bin")
    return fam


@pytest.fixture
def exploit(clip, tmp_path):
    """Expert 'task1' replaced by a pickle that writes `marker` when unpickled with weights_only=False."""
    marker = tmp_path / "PWNED"
    evil = save_malicious_pickle(clip["experts"]["task1"], tmp_path / "evil", marker)
    fam = {**clip, "experts": {**clip["experts"], "task1": evil}}
    return fam, marker


def _run_file(fam, tmp_path, out, calibrate_too=True, **top):
    doc = {"merge": {"base": str(fam["base"]), "experts": {t: str(p) for t, p in fam["experts"].items()}},
           "out": str(out), **top}
    if calibrate_too:
        doc["calibrate"] = {"calibration": {t: str(p) for t, p in fam["data"].items()},
                            "config": {"num_calibration_examples": 4, "calibration_batch_size": 2}}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(doc))
    return run


# --- pickles are refused unless asked for ---------------------------------------------------------------


def test_every_cli_entry_point_refuses_pickles(pickled, tmp_path, capsys):
    out = tmp_path / "out"
    merged_bin = {**pickled, "merged": pickled["merged_bin"]}
    for argv, who in [
        (merge_argv(pickled["base"], pickled["experts"], out), "expert 'task1'"),
        (calibrate_argv(pickled, out), "expert 'task1'"),
        (calibrate_argv(merged_bin, out), "merged model"),
        (["run", _run_file(pickled, tmp_path, out), "--no-progress"], "expert 'task1'"),
        (["run", _run_file(pickled, tmp_path, out, calibrate_too=False), "--no-progress"], "expert 'task1'"),
    ]:
        rc, _, err = cli(argv, capsys)
        line = one_line_error(err)
        assert rc == 2 and re.search(rf"error: {who}: .*{REFUSED}", line), line
        assert "--allow-pickle" in line
        assert not out.exists() and leftovers(tmp_path) == []


def test_python_entry_points_refuse_pickles(pickled):
    with pytest.raises(CheckpointError, match=REFUSED):
        load_model(pickled["merged_bin"])
    with pytest.raises(CheckpointError, match=rf"expert 'task1': .*{REFUSED}"):
        merge(pickled["base"], pickled["experts"], progress=False)
    model = load_model(pickled["merged"])
    with pytest.raises(CheckpointError, match=REFUSED):
        calibrate(model, base=pickled["base"], experts=pickled["experts"],
                  calibration={t: [torch.zeros(1, 3, 16, 16)] for t in pickled["experts"]}, progress=False)


def test_allow_pickle_loads_plain_tensors_with_the_same_result(clip, pickled, tmp_path, capsys):
    rc, _, err = cli(merge_argv(pickled["base"], pickled["experts"], tmp_path / "m-bin", "--allow-pickle"), capsys)
    assert rc == 0, err
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "m-st"), capsys)
    assert rc == 0, err
    assert weights_sha(tmp_path / "m-bin") == weights_sha(tmp_path / "m-st")
    assert not list((tmp_path / "m-bin").glob("*.bin"))  # the output is safetensors whatever the input

    merged_bin = {**pickled, "merged": pickled["merged_bin"]}
    rc, _, err = cli(calibrate_argv(merged_bin, tmp_path / "c-bin", "--allow-pickle"), capsys)
    assert rc == 0, err
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "c-st"), capsys)
    assert rc == 0, err
    assert weights_sha(tmp_path / "c-bin") == weights_sha(tmp_path / "c-st")
    reference = load_model(clip["merged"]).state_dict()
    loaded = load_model(pickled["merged_bin"], allow_pickle=True).state_dict()
    assert all(torch.equal(reference[k], loaded[k]) for k in reference)


# --- a malicious pickle never runs, even with --allow-pickle ---------------------------------------------


def test_the_exploit_is_real(exploit):
    _, marker = exploit
    torch.load(exploit[0]["experts"]["task1"] / "pytorch_model.bin", weights_only=False)  # what featcal never does
    assert marker.read_text() == "pwned"


EXPLOIT_REFUSED = (r"refusing .*pytorch_model.bin: it holds more than plain tensors \(Unsupported global: GLOBAL "
                   r"(builtins\.)?exec\), and unpickling that could run code")


def test_malicious_pickle_is_refused_by_every_entry_point_even_when_allowed(exploit, tmp_path, capsys):
    fam, marker = exploit
    out = tmp_path / "out"
    for argv in [
        merge_argv(fam["base"], fam["experts"], out, "--allow-pickle"),
        calibrate_argv(fam, out, "--allow-pickle"),
        ["run", _run_file(fam, tmp_path, out, allow_pickle=True), "--no-progress"],
    ]:
        rc, _, err = cli(argv, capsys)
        line = one_line_error(err)
        assert rc == 2 and re.search(EXPLOIT_REFUSED, line) and "expert 'task1'" in line, line
        assert not out.exists()
    with pytest.raises(CheckpointError, match=EXPLOIT_REFUSED):
        load_model(fam["experts"]["task1"], allow_pickle=True)
    with pytest.raises(CheckpointError, match=EXPLOIT_REFUSED):
        merge(fam["base"], fam["experts"], allow_pickle=True, progress=False)
    assert not marker.exists()


def test_a_pickle_beside_safetensors_is_never_read(clip, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    fam = copy_family(clip, tmp_path / "fam")
    for d in (fam["merged"], fam["experts"]["task0"]):
        save_malicious_pickle(d, tmp_path / "evil", marker)
        (tmp_path / "evil" / "pytorch_model.bin").rename(d / "pytorch_model.bin")
        (d / "training_args.bin").write_bytes((d / "pytorch_model.bin").read_bytes())
        for p in (tmp_path / "evil").iterdir():
            p.unlink()
        (tmp_path / "evil").rmdir()
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "m", "--allow-pickle"), capsys)
    assert rc == 0, err
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "c", "--allow-pickle"), capsys)
    assert rc == 0, err
    assert not marker.exists()
    assert not list((tmp_path / "c").glob("*.bin")) and not list((tmp_path / "m").glob("*.bin"))


# --- remote code ---------------------------------------------------------------------------------------------


def _plant_remote_code(directory: Path, marker: Path, **config) -> None:
    """auto_map entries pointing at modules that write `marker` when imported."""
    body = f"open({str(marker)!r}, 'w').write('executed')\n"
    for name in ("configuration_evil", "modeling_evil", "image_processing_evil"):
        (directory / f"{name}.py").write_text(body)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"}
    cfg.update(config)
    (directory / "config.json").write_text(json.dumps(cfg))
    proc = directory / "preprocessor_config.json"
    if proc.exists():
        data = json.loads(proc.read_text())
        data["auto_map"] = {"AutoImageProcessor": "image_processing_evil.EvilProcessor"}
        proc.write_text(json.dumps(data))


def test_auto_map_code_never_runs(clip, tmp_path, capsys):
    marker = tmp_path / "EXECUTED"
    fam = copy_family(clip, tmp_path / "fam")
    for d in (fam["base"], fam["merged"], *fam["experts"].values()):
        _plant_remote_code(d, marker)
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "m"), capsys)
    assert rc == 0, err
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "c"), capsys)
    assert rc == 0, err  # the built-in CLIP classes are used; the shipped code is ignored
    assert type(load_model(fam["merged"])).__name__ == "CLIPVisionModel"
    assert not marker.exists()


def test_a_model_that_needs_remote_code_is_refused(clip, tmp_path, capsys):
    marker = tmp_path / "EXECUTED"
    fam = copy_family(clip, tmp_path / "fam")
    for d in (fam["base"], fam["merged"], *fam["experts"].values()):
        _plant_remote_code(d, marker, model_type="evilnet", architectures=["EvilModel"])
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "c"), capsys)
    assert rc == 2
    assert "needs custom code shipped with the checkpoint, and featcal never runs such code" in one_line_error(err)
    with pytest.raises(CheckpointError, match="featcal never runs such code"):
        load_model(fam["merged"])
    assert not marker.exists() and not (tmp_path / "c").exists()


def test_trust_remote_code_is_never_turned_on():
    """No source file sets it True; every Auto*.from_pretrained behind merge/calibrate/run passes False explicitly.

    (Explicitly: left at None, transformers asks interactively whether to run shipped code.)
    """
    files = sorted(SRC.rglob("*.py"))
    assert files
    for f in files:
        assert not re.search(r"trust_remote_code\s*=\s*(True|1|not\b)", f.read_text()), f
    entry_packages = ("io", "data", "calibration", "merging", "cli")
    checked = 0
    for f in files:
        if f.relative_to(SRC).parts[0] not in entry_packages:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            flags = {k.arg: k.value for k in node.keywords}
            if name.startswith("Auto") or "trust_remote_code" in flags:
                value = flags.get("trust_remote_code")
                assert isinstance(value, ast.Constant) and value.value is False, f"{f}:{node.lineno}"
                checked += 1
    assert checked >= 4  # AutoConfig (models, data), AutoImageProcessor, AutoTokenizer, the model class
