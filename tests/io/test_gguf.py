"""GGUF inputs (issue 15): a tiny Llama written as GGUF with the gguf package's writer, merged like safetensors."""

import json
import sys

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from featcal import merge
from featcal.cli.main import main
from featcal.errors import CheckpointError
from tests.builders.gguf_files import write_llama_gguf
from tests.builders.tiny import perturbed, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The same base and experts as safetensors folders and as GGUF (a file, and a folder holding one)."""
    root = tmp_path_factory.mktemp("gguf")
    base = tiny_model("llama")
    e1, e2 = perturbed(base, 11), perturbed(base, 12)
    st = {n: root / f"st-{n}" for n in ("base", "e1", "e2")}
    for n, m in zip(st, (base, e1, e2), strict=True):
        m.save_pretrained(st[n])
    (root / "gg-e1").mkdir()
    gg = {"base": write_llama_gguf(base, root / "base.gguf"), "e1": write_llama_gguf(e1, root / "gg-e1" / "model.gguf")}
    return root, st, gg


def test_gguf_inputs_merge_like_their_safetensors(family, tmp_path):
    _, st, gg = family
    want = merge(st["base"], {"a": st["e1"], "b": st["e2"]}, "ties", density=0.5, progress=False)
    out = tmp_path / "merged"
    got = merge(gg["base"], {"a": gg["e1"].parent, "b": st["e2"]}, "ties", density=0.5, out=out, progress=False)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k  # float32 GGUF: dequantising is exact
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".gguf")) == ["model.safetensors"]
    assert load_file(out / "model.safetensors").keys() == want.keys()
    report = json.loads((out / "featcal.json").read_text())["inputs"]
    assert report["base"]["dequantised_from_gguf"] is True and "base.gguf" in report["base"]["sha256"]
    assert report["experts"]["a"]["dequantised_from_gguf"] is True
    assert "dequantised_from_gguf" not in report["experts"]["b"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    model = T.LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, want["model.layers.1.self_attn.k_proj.weight"])
    assert len(T.AutoTokenizer.from_pretrained(out)) == 100  # the GGUF's tokenizer came along


def test_gguf_cli_and_refusals(family, tmp_path, capsys):
    root, st, gg = family
    out = tmp_path / "out"
    argv = ["merge", "--base", str(gg["base"]), "--out", str(out), "--no-progress", "--expert", f"a={gg['e1']}"]
    assert main(argv) == 0 and (out / "model.safetensors").is_file()
    capsys.readouterr()

    truncated = tmp_path / "cut.gguf"
    data = gg["e1"].read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    bad_out = tmp_path / "bad"
    rc = main(["merge", "--base", str(st["base"]), "--out", str(bad_out), "--no-progress", "--expert", f"a={truncated}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("featcal: error: ") and err.count("\n") == 0 and "cut.gguf" in err
    assert not bad_out.exists()

    bert = tmp_path / "bert"
    tiny_model("bert").save_pretrained(bert)
    with pytest.raises(CheckpointError, match="holds a llama model but the base is bert"):
        merge(bert, {"a": gg["e1"]}, out=bad_out, progress=False)
    assert not bad_out.exists()

    two = tmp_path / "two"
    two.mkdir()
    for n in ("x.gguf", "y.gguf"):
        (two / n).write_bytes(data)
    with pytest.raises(CheckpointError, match="several GGUF files"):
        merge(st["base"], {"a": two}, progress=False)


def test_gguf_without_the_gguf_package_names_the_install(family, monkeypatch):
    _, st, gg = family
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(CheckpointError, match=r"needs the gguf package: pip install gguf"):
        merge(st["base"], {"a": gg["e1"]}, progress=False)


def test_gguf_base_and_expert_calibrate(family, tmp_path, capsys, monkeypatch):
    """featcal calibrate --base X.gguf --expert a=Y.gguf: dequantised, checked, calibrated, reported."""
    import featcal.io.read.gguf as io_gguf

    _, st, gg = family
    merged = tmp_path / "merged"
    merge(gg["base"], {"a": gg["e1"], "b": st["e2"]}, out=merged, progress=False)
    loads = []
    real = io_gguf.load_gguf_model
    monkeypatch.setattr(io_gguf, "load_gguf_model", lambda f, *a, **k: loads.append(f.name) or real(f, *a, **k))
    argv = ["calibrate", "--base", str(gg["base"]), "--merged", str(merged), "--out", str(tmp_path / "cal"),
            "--no-progress", "--num-calibration-examples", "8", "--calibration-batch-size", "4"]
    for t, d in (("a", gg["e1"].parent), ("b", st["e2"])):
        f = tmp_path / f"{t}.jsonl"
        f.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 5 + j) % 90}" for j in range(6))}) + "\n"
                             for i in range(8)))
        argv += ["--expert", f"{t}={d}", "--calib", f"{t}={f}"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "cal" / "featcal.json").read_text())
    assert report["inputs"]["base"]["dequantised_from_gguf"] and report["inputs"]["experts"]["a"]["dequantised_from_gguf"]
    assert "base.gguf" in report["inputs"]["base"]["sha256"]
    # the header checks read no values: the base GGUF is dequantised for the NaN/Inf scan and for calibration only,
    # the expert's for calibration only (checked as its blocks are read, calibration/engine/prefetch.py)
    assert sorted(loads) == ["base.gguf", "base.gguf", "model.gguf"]
    before, after = load_file(merged / "model.safetensors"), load_file(tmp_path / "cal" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if "layers.0.self_attn" in k)
