"""GGUF inputs (issue 15): a tiny Llama written as GGUF with the gguf package's writer, merged like safetensors."""

import json
import sys

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from featcal import merge
from featcal.cli.main import main
from featcal.errors import CheckpointError
from tests.builders.tiny import perturbed, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
gguf = pytest.importorskip("gguf")


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py), which transformers' loader undoes."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path):
    """`model` (a LlamaForCausalLM) as a float32 GGUF file with a llama-style tokenizer of its vocabulary."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(cfg.vocab_size - 3)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        a = value.detach().float().numpy()
        module, suffix = key.rsplit(".", 1)
        if key.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads, cfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_attention_heads, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
    gg = {"base": write_gguf(base, root / "base.gguf"), "e1": write_gguf(e1, root / "gg-e1" / "model.gguf")}
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
    import featcal.io.gguf as io_gguf

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
    # the header checks read no values: each GGUF is dequantised for the NaN/Inf scan and for calibration only
    assert sorted(loads) == ["base.gguf", "base.gguf", "model.gguf", "model.gguf"]
    before, after = load_file(merged / "model.safetensors"), load_file(tmp_path / "cal" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if "layers.0.self_attn" in k)
