"""Experts with more vocabulary rows than the base (issue 15): merged, written consistently, calibrated."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from featcal import merge
from featcal.config import FeatCalConfig
from featcal.errors import CheckpointError
from featcal.merging.methods import task_arithmetic as ta_reference
from tests.builders.hub import word_tokenizer
from tests.builders.tiny import perturbed, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = ("embed_tokens", "lm_head")
WORDS = [f"w{i}" for i in range(200)]


def _tokenizer(n: int):
    """A word tokenizer of exactly `n` tokens (3 specials + n-3 words)."""
    return word_tokenizer(WORDS[: n - 3], eos=False)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """Base of 100 rows; experts of 110, 120 and 100 rows; the 120-row one ships its own tokenizer."""
    root = tmp_path_factory.mktemp("grown")
    base = tiny_model("llama")
    base.save_pretrained(root / "base")
    _tokenizer(100).save_pretrained(root / "base")
    experts = {}
    for i, rows in enumerate((110, 120, 100)):
        e = perturbed(base, 200 + i)
        if rows != 100:
            e.resize_token_embeddings(rows)
            with torch.no_grad():  # distinct extra rows per expert, so the mean is observable
                g = torch.Generator().manual_seed(i)
                e.get_input_embeddings().weight[100:] = torch.randn(rows - 100, 32, generator=g)
                e.get_output_embeddings().weight[100:] = torch.randn(rows - 100, 32, generator=g)
        d = root / f"e{i}"
        e.save_pretrained(d)
        if rows == 120:  # the base's tokenizer with 20 tokens added after its own (ids 100..119)
            grown_tokenizer = _tokenizer(100)
            grown_tokenizer.add_tokens([f"new{i}" for i in range(20)])
            grown_tokenizer.save_pretrained(d)
        experts[f"t{i}"] = d
    return root, root / "base", experts


def _vocab_key(sd, part):
    return next(k for k in sd if part in k)


def test_grown_vocab_merge_shared_rows_by_method_extra_rows_mean(grown):
    root, base, experts = grown
    out = root / "merged"
    merged = merge(base, experts, "task_arithmetic", scaling=0.5, out=out, progress=False)
    b = load_file(base / "model.safetensors")
    es = {t: load_file(d / "model.safetensors") for t, d in experts.items()}
    for part in VOCAB:
        k = _vocab_key(b, part)
        assert merged[k].shape == (120, 32)
        shared = ta_reference(b[k], [e[k][:100] for e in es.values()], scaling=0.5)
        assert torch.allclose(merged[k][:100], shared, atol=1e-6)
        assert torch.allclose(merged[k][100:110], (es["t0"][k][100:110] + es["t1"][k][100:110]) / 2, atol=1e-6)
        assert torch.allclose(merged[k][110:120], es["t1"][k][110:120], atol=1e-6)
    for k in b:  # every other tensor is the plain method
        if not any(p in k for p in VOCAB):
            assert torch.allclose(merged[k], ta_reference(b[k], [e[k] for e in es.values()], scaling=0.5), atol=1e-6)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 120
    assert len(T.AutoTokenizer.from_pretrained(out)) == 120  # the 120-row expert's tokenizer, not the base's 100
    report = json.loads((out / "featcal.json").read_text())["vocabulary"]
    assert report["base_rows"] == 100 and report["rows"] == 120
    assert report["expert_rows"] == {"t0": 110, "t1": 120, "t2": 100}
    assert report["tokenizer_from"] == "expert 't1'" and "mean" in report["extra_rows"]
    model = T.LlamaForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape == (120, 32)
    assert model(torch.tensor([[1, 105, 119]])).logits.shape == (1, 3, 120)


def test_grown_vocab_ties_selects_over_shared_rows(grown):
    _, base, experts = grown
    merged = merge(base, experts, "ties", density=0.3, progress=False)
    es = {t: load_file(d / "model.safetensors") for t, d in experts.items()}
    k = _vocab_key(merged, "lm_head")
    assert merged[k].shape == (120, 32)
    assert torch.allclose(merged[k][110:], es["t1"][k][110:], atol=1e-6)


def test_grown_vocab_whole_model_merge(grown):
    """WUDI loads whole models: a grown expert loads cut to the base's rows (RowsView through load_view)."""
    _, base, experts = grown
    merged = merge(base, experts, "wudi", steps=1, progress=False)
    es = {t: load_file(d / "model.safetensors") for t, d in experts.items()}
    k = _vocab_key(merged, "embed_tokens")
    assert merged[k].shape == (120, 32)
    assert torch.allclose(merged[k][100:110], (es["t0"][k][100:110] + es["t1"][k][100:110]) / 2, atol=1e-6)


def _save_expert(model, rows: int | None, directory, hidden: int | None = None):
    if hidden is not None:
        cfg = tiny_model("llama").config
        cfg.hidden_size = hidden
        model = T.LlamaForCausalLM(cfg)
    if rows is not None:
        model.resize_token_embeddings(rows)
    model.save_pretrained(directory)
    return directory


def test_fewer_rows_or_other_hidden_size_refused_before_work(grown, tmp_path):
    _, base, experts = grown
    small = _save_expert(perturbed(tiny_model("llama"), 7), 90, tmp_path / "small")
    with pytest.raises(CheckpointError, match=r"expert 'small'.*'lm_head.weight' has 90 rows, fewer than the base's 100"):
        merge(base, {**experts, "small": small}, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    wide = _save_expert(None, 120, tmp_path / "wide", hidden=48)
    with pytest.raises(CheckpointError, match=r"expert 'wide'.*has shape"):
        merge(base, {"wide": wide}, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_grown_rows_disagreeing_within_an_expert_refused(grown, tmp_path):
    from safetensors.torch import save_file

    _, base, experts = grown
    d = tmp_path / "odd"
    d.mkdir()
    sd = load_file(experts["t1"] / "model.safetensors")
    sd["lm_head.weight"] = sd["lm_head.weight"][:110].clone()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text((experts["t1"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="disagree on the number of rows"):
        merge(base, {"odd": d}, progress=False)


def test_grown_vocab_merge_then_calibrate(grown, tmp_path):
    """A grown merge calibrates toward experts with 110, 120 and 100 rows (rows they lack: the merge's)."""
    from featcal.calibration.front.pipeline import CalibrateRequest, calibrate_to_dir

    root, base, experts = grown
    merged_dir = tmp_path / "merged"
    merge(base, experts, "task_arithmetic", scaling=0.5, out=merged_dir, progress=False)
    data = {}
    for t in experts:
        f = tmp_path / f"{t}.jsonl"
        f.write_text("".join(json.dumps({"text": " ".join(WORDS[j % 117] for j in range(i, i + 6))}) + "\n"
                             for i in range(8)))
        data[t] = f
    out = tmp_path / "calibrated"
    config = FeatCalConfig(num_calibration_examples=8, calibration_batch_size=4)
    report = calibrate_to_dir(CalibrateRequest(merged_dir, base, experts, data, out, config=config,
                                               progress=False)).report
    assert report["drift"], "no block was calibrated"
    model = T.LlamaForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape == (120, 32)
    before = load_file(merged_dir / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if "layers.0.mlp" in k)


def test_mergebench_layout_with_grown_experts_reproduces_end_to_end(tmp_path, capsys):
    """Laid out like the MergeBench hub repos, experts carrying 8 rows more than the base (128320 vs 128256
    there): `featcal reproduce llama-3.2-3b-mergebench` merges, calibrates and writes consistent checkpoints."""
    from featcal.cli.main import main
    from tests.builders.hub import build_mergebench_hub

    models, data = build_mergebench_hub(tmp_path / "hub", tasks=("math", "instruction"))
    base_dir = models / "meta-llama" / "Llama-3.2-3B"
    tok = T.AutoTokenizer.from_pretrained(base_dir)
    rows = len(tok) + 8
    for task in ("math", "instruction"):
        d = models / "MergeBench" / f"Llama-3.2-3B_{task}"
        expert = T.LlamaForCausalLM.from_pretrained(d)
        expert.resize_token_embeddings(rows)
        expert.save_pretrained(d)
        grown = T.AutoTokenizer.from_pretrained(base_dir)
        grown.add_tokens([f"<extra_{i}>" for i in range(8)])
        grown.save_pretrained(d)
    out = tmp_path / "run"
    rc = main(["reproduce", "llama-3.2-3b-mergebench", "--out", str(out), "--tasks", "math,instruction",
               "--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu",
               "--model-dir", str(models), "--data-dir", str(data)])
    assert rc == 0, capsys.readouterr().err
    for stage in ("merged", "featcal"):
        model = T.LlamaForCausalLM.from_pretrained(out / stage)
        assert model.config.vocab_size == rows and model.get_input_embeddings().weight.shape[0] == rows, stage
        assert len(T.AutoTokenizer.from_pretrained(out / stage)) == rows, stage
