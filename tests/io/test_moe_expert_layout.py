"""Issue 49: a mixture of experts saved one tensor per expert (`...experts.3.w1.weight`, as the hub's Mixtral
checkpoints are) is refused, before any work, in one line naming the tensor, when an expert is missing, an index
lies past the experts its config makes, or the experts' tensors disagree in shape with each other or with the
config. Every input of the family damaged the same way passes the tensor-against-tensor checks: `featcal merge`
then wrote an unloadable merge with rc 0, `featcal calibrate` stacked experts 0, 1, 2, 4 as 0 to 3 (rc 0) or
failed while loading the model ("see the above report")."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tests.builders.data_fixtures import save_tokenizer, sentences, write_jsonl
from tests.builders.guarantees import calibrate_argv, cli, merge_argv, one_line_error
from tests.builders.tiny import family_of

pytestmark = pytest.mark.usefixtures("one_thread")

EXPERTS = "model.layers.0.block_sparse_moe.experts."


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral family (4 experts a layer) saved by save_pretrained: per-expert tensors on disk."""
    root = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))
    base, experts, merged = family_of(model.eval())
    base.save_pretrained(root / "base")
    merged.save_pretrained(root / "merged")
    save_tokenizer(root / "merged", "bert")
    for t, e in experts.items():
        e.save_pretrained(root / t)
    return {"base": root / "base", "merged": root / "merged", "experts": {t: root / t for t in experts},
            "data": {t: write_jsonl(root / f"{t}.jsonl", [{"text": s} for s in sentences(6, seed=i)])
                     for i, t in enumerate(experts)}}


def _damage(directory, how: str) -> None:
    path = directory / "model.safetensors"
    t = load_file(path)
    if how == "missing":  # expert 2 gone
        for k in [k for k in t if k.startswith(EXPERTS + "2.")]:
            del t[k]
    elif how == "gap":  # expert 3 saved as 4: indices 0, 1, 2, 4 (still four of them)
        for k in [k for k in t if k.startswith(EXPERTS + "3.")]:
            t[k.replace(EXPERTS + "3.", EXPERTS + "4.")] = t.pop(k)
    elif how == "extra":  # a fifth expert where the config makes four
        for k in [k for k in t if k.startswith(EXPERTS + "3.")]:
            t[k.replace(EXPERTS + "3.", EXPERTS + "4.")] = t[k].clone()
    elif how == "one_shape":  # expert 2's w1 narrower than the others'
        t[EXPERTS + "2.w1.weight"] = torch.zeros(60, 32)
    elif how == "all_shapes":  # every expert wider than the config's intermediate_size
        for e in range(4):
            t[EXPERTS + f"{e}.w1.weight"], t[EXPERTS + f"{e}.w3.weight"] = torch.zeros(72, 32), torch.zeros(72, 32)
    save_file(t, str(path), metadata={"format": "pt"})


CASES = {
    "missing": "experts.2.w1.weight is missing",
    "gap": "experts.4.* is expert 4, past the 4 experts",
    "extra": "experts.4.* is expert 4, past the 4 experts",
    "one_shape": "experts.2.w1.weight has shape (60, 32), expert 0's",
    "all_shapes": "make model.layers.0.mlp.experts.gate_up_proj of shape (4, 144, 32), but its config.json makes "
                  "(4, 128, 32)",
}


def _damaged_family(mixtral, root, how: str) -> dict:
    fam = {"base": root / "base", "merged": root / "merged", "experts": {t: root / t for t in mixtral["experts"]},
           "data": mixtral["data"]}
    for src, dst in [(mixtral["base"], fam["base"]), (mixtral["merged"], fam["merged"]),
                     *((mixtral["experts"][t], fam["experts"][t]) for t in fam["experts"])]:
        shutil.copytree(src, dst)
        _damage(dst, how)
    return fam


@pytest.mark.parametrize("how", list(CASES))
def test_a_damaged_per_expert_layout_is_refused_by_merge_and_calibrate_before_work(mixtral, tmp_path, capsys, how,
                                                                                  no_calibration_work):
    fam = _damaged_family(mixtral, tmp_path, how)
    rc, _, err = cli(merge_argv(fam["base"], fam["experts"], tmp_path / "m"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert line.startswith(f"featcal: error: base ({fam['base']}): ") and CASES[how] in line, line
    assert not (tmp_path / "m").exists()
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "c"), capsys)
    assert rc == 2
    line = one_line_error(err)
    assert line.startswith(f"featcal: error: the merged model ({fam['merged']}): ") and CASES[how] in line, line
    assert not (tmp_path / "c").exists()


def test_one_damaged_expert_is_named_against_the_merged_model(mixtral, tmp_path, capsys, no_calibration_work):
    fam = {**mixtral, "experts": {**mixtral["experts"], "task1": tmp_path / "task1"}}
    shutil.copytree(mixtral["experts"]["task1"], fam["experts"]["task1"])
    _damage(fam["experts"]["task1"], "gap")
    rc, _, err = cli(calibrate_argv(fam, tmp_path / "c"), capsys)
    assert rc == 2
    assert "expert 'task1'" in one_line_error(err) and "experts.3.w1.weight" in err
