"""LoRA / PEFT adapter folders as experts (issue 15): W + scale·B·A, checked against a hand-computed merge."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from featcal import merge
from featcal.cli.main import main
from featcal.errors import CheckpointError
from featcal.merging.methods import task_arithmetic as ta_reference
from tests.builders.lora import P, full_checkpoints, lora_family, token_batches, write_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama base, one full expert and two adapters, with the experts computed by hand."""
    return lora_family(tmp_path_factory.mktemp("lora"))


def test_lora_experts_merge_equals_hand_computed(family, tmp_path):
    _, base, experts, by_hand = family
    out = tmp_path / "merged"
    merged = merge(base, experts, "task_arithmetic", scaling=0.4, out=out, progress=False)
    b = load_file(base / "model.safetensors")
    for k in b:
        want = ta_reference(b[k], [by_hand[t][k] for t in experts], scaling=0.4)
        assert torch.allclose(merged[k], want, atol=1e-5), k
    assert not torch.equal(merged["model.layers.1.self_attn.v_proj.weight"],
                           ta_reference(b["model.layers.1.self_attn.v_proj.weight"],
                                        [by_hand["full"]["model.layers.1.self_attn.v_proj.weight"], b["model.layers.1.self_attn.v_proj.weight"],
                                         b["model.layers.1.self_attn.v_proj.weight"]], scaling=0.4))  # the adapter counted
    report = json.loads((out / "featcal.json").read_text())["inputs"]["experts"]
    assert report["lora1"]["lora_adapter"] is True and report["lora1"]["adapted_tensors"] == 4
    assert report["lora2"]["use_rslora"] is True and "adapter_model.safetensors" in report["lora2"]["sha256"]
    assert report["lora1"]["base_name_warning"] is None  # the adapter names 'base', the base folder's name
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
    T.LlamaForCausalLM.from_pretrained(out)  # an ordinary checkpoint


def test_an_adapter_naming_another_base_is_applied_with_a_warning(family, tmp_path, caplog):
    """Shapes decide whether an adapter fits; a base_model_name_or_path naming another model is warned
    about and recorded (a renamed local copy of the right base is common), not refused."""
    _, base, experts, by_hand = family
    other = write_adapter(tmp_path / "other", load_file(experts["lora1"] / "adapter_model.safetensors"),
                           base_model_name_or_path="meta-llama/Llama-3.2-3B-Instruct")
    with caplog.at_level("WARNING"):
        merged = merge(base, {"o": other}, "task_arithmetic", scaling=1.0, out=tmp_path / "out", progress=False)
    assert "Llama-3.2-3B-Instruct" in caplog.text
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"],
                          by_hand["lora1"]["model.layers.0.self_attn.q_proj.weight"], atol=1e-6)
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())["inputs"]["experts"]["o"]
    assert "Llama-3.2-3B-Instruct" in report["base_name_warning"]


def test_lora_experts_whole_model_merge_and_cli(family, tmp_path, capsys):
    """WUDI loads whole models: the adapter expert is the base with its deltas (load_view); the CLI takes folders."""
    _, base, experts, by_hand = family
    merged = merge(base, {"lora1": experts["lora1"], "lora2": experts["lora2"]}, "wudi", steps=1, progress=False)
    assert set(merged) == set(load_file(base / "model.safetensors"))
    argv = ["merge", "--base", str(base), "--out", str(tmp_path / "cli"), "--no-progress",
            "--expert", f"a={experts['lora1']}", "--expert", f"b={experts['full']}"]
    assert main(argv) == 0
    assert json.loads((tmp_path / "cli" / "featcal.json").read_text())["inputs"]["experts"]["a"]["lora_adapter"]


def _bad(root, name, family_tensors, **config):
    return write_adapter(root / name, family_tensors, **config)


def test_bad_adapters_refused_before_work(family, tmp_path, capsys):
    _, base, experts, _ = family
    good = load_file(experts["lora1"] / "adapter_model.safetensors")
    q = f"{P}model.layers.0.self_attn.q_proj"
    cases = {
        "dora": (good, {"use_dora": True}, "use_dora is set"),
        "ia3": (good, {"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
        "rank": ({**good, f"{q}.lora_A.weight": torch.zeros(3, 32)}, {}, "do not fit the base weight"),
        "target": (good, {"target_modules": ["q_proj", "v_proj", "dense_h_to_4h"]}, "'dense_h_to_4h' matches nothing"),
        "untargeted": (good, {"target_modules": ["q_proj"]}, "which target_modules"),
        "missing": ({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
                     "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)}, {},
                    "which the base does not have"),
        "half": ({f"{q}.lora_A.weight": good[f"{q}.lora_A.weight"]}, {}, "needs lora_A and lora_B"),
    }
    out = tmp_path / "out"
    for name, (tensors, config, message) in cases.items():
        adapter = _bad(tmp_path, name, tensors, **config)
        with pytest.raises(CheckpointError, match=message) as info:
            merge(base, {name: adapter}, out=out, progress=False)
        assert str(adapter) in str(info.value)
        assert not out.exists()
    truncated = _bad(tmp_path, "truncated", good)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    rc = main(["merge", "--base", str(base), "--out", str(out), "--no-progress", "--expert", f"t={truncated}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("featcal: error: ") and "adapter_model.safetensors" in err
    with pytest.raises(CheckpointError, match="is a LoRA/PEFT adapter, not a model"):
        merge(experts["lora1"], {"full": experts["full"]}, progress=False)
    assert not out.exists()


def test_lora_expert_calibrates(family, tmp_path):
    """featcal calibrate reads an adapter expert as base + ΔW, block by block (no full copy written)."""
    from featcal.config import FeatCalConfig

    _, base, experts, by_hand = family
    merged_dir = tmp_path / "merged"
    merge(base, experts, "task_arithmetic", scaling=0.4, out=merged_dir, progress=False)
    data = token_batches(experts)
    from featcal.calibration.front.api import calibrate

    model = T.LlamaForCausalLM.from_pretrained(merged_dir)
    calibrated = calibrate(model, base=str(base), experts={t: str(d) for t, d in experts.items()},
                           calibration=data, config=FeatCalConfig(), progress=False)
    assert calibrated.drift
    calibrated = calibrated.model
    assert not torch.equal(calibrated.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    # the adapter expert is read as the hand-computed weights: the same calibration from full checkpoints agrees
    full_dirs = full_checkpoints(by_hand, base, tmp_path)
    reference = calibrate(model, base=str(base), experts=full_dirs, calibration=data, config=FeatCalConfig(),
                          progress=False).model
    for (n, p), (_, q) in zip(calibrated.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-4), n


def test_lora_expert_featcal_calibrate_cli(family, tmp_path, capsys):
    """`featcal calibrate --expert NAME=ADAPTER_DIR`: checked against the base, calibrated, reported."""
    _, base, experts, _ = family
    merged_dir = tmp_path / "merged"
    merge(base, experts, "task_arithmetic", scaling=0.4, out=merged_dir, progress=False)
    argv = ["calibrate", "--base", str(base), "--merged", str(merged_dir), "--out", str(tmp_path / "cal"),
            "--no-progress", "--num-calibration-examples", "8", "--calibration-batch-size", "4"]
    for t, d in experts.items():
        f = tmp_path / f"{t}.jsonl"
        f.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % 90}" for j in range(6))}) + "\n"
                             for i in range(8)))
        argv += ["--expert", f"{t}={d}", "--calib", f"{t}={f}"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "cal" / "featcal.json").read_text())
    assert "adapter_model.safetensors" in report["inputs"]["experts"]["lora1"]["sha256"]
    bad = tmp_path / "dora"
    write_adapter(bad, load_file(experts["lora1"] / "adapter_model.safetensors"), use_dora=True)
    argv = [a if a != f"lora1={experts['lora1']}" else f"lora1={bad}" for a in argv]
    argv[argv.index("--out") + 1] = str(tmp_path / "cal2")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and "use_dora" in err and err.count("\n") == 0
    assert not (tmp_path / "cal2").exists()


def test_featcal_run_with_an_adapter_and_a_grown_expert(family, tmp_path, capsys):
    """`featcal run`: its pre-merge checks read an adapter over the base and cut a grown expert to the base's
    rows; the merge then grows the vocabulary and calibration runs toward all three experts."""
    import yaml

    _, base, experts, _ = family
    grown = tmp_path / "grown"
    model = T.LlamaForCausalLM.from_pretrained(experts["full"])
    model.resize_token_embeddings(104)
    model.save_pretrained(grown)
    calib = {}
    for t in ("lora1", "lora2", "grown"):
        f = tmp_path / f"{t}.jsonl"
        f.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 3 + j) % 90}" for j in range(6))}) + "\n"
                             for i in range(8)))
        calib[t] = str(f)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "merge": {"base": str(base), "experts": {"lora1": str(experts["lora1"]), "lora2": str(experts["lora2"]),
                                                 "grown": str(grown)},
                  "method": "task_arithmetic", "params": {"scaling": 0.4}},
        "calibrate": {"calibration": calib, "config": {"num_calibration_examples": 8, "calibration_batch_size": 4}},
        "out": str(tmp_path / "out"),
    }))
    assert main(["run", str(run), "--no-progress"]) == 0, capsys.readouterr().err
    out = next(p for p in (tmp_path / "out").rglob("featcal.json") if json.loads(p.read_text())["command"] == "calibrate")
    calibrated = T.LlamaForCausalLM.from_pretrained(out.parent)
    assert calibrated.get_input_embeddings().weight.shape == (104, 32)
