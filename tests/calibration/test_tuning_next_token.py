"""`tune` on a causal LM (issue #42): candidates are scored, without labels, by agreement with the experts'
next-token predictions on the held-out calibration windows, through the model's own LM head."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.calibration import tuning
from tests.builders.reference_featcal import family_data, noisy_family


@pytest.fixture(scope="module")
def llama():
    base, experts, merged = noisy_family("llama")
    return base, experts, merged, family_data("llama", experts)


@torch.no_grad()
def _direct(model, expert, batches):
    """(agreeing positions / valid positions, valid positions, mean KL(expert || model) over them), by hand."""
    agree = total = 0
    kl = 0.0
    for b in batches:
        lm, le = (torch.log_softmax(m(**b).logits.double(), -1) for m in (model, expert))
        valid = b["attention_mask"].bool()
        agree += int((lm.argmax(-1) == le.argmax(-1))[valid].sum())
        total += int(valid.sum())
        kl += float((le.exp() * (le - lm)).sum(-1)[valid].sum())
    return agree / total, total, kl / total


def test_a_causal_lms_candidates_are_scored_by_the_experts_next_token_predictions(llama):
    base, experts, merged, data = llama
    cfg = FeatCalConfig(tune=True, tune_budget=4.0, tune_folds=1, tune_holdout=0.5)
    rec = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).tuning
    assert rec.next_token["used"] and rec.next_token["tasks"] == list(experts) and rec.heads == []
    assert "next-token prediction" in rec.criterion
    # the first candidate is the configured setting calibrated on the fit part: redo it, and count by hand
    split = tuning.split_calibration(data, 0.5, cfg.seed)
    fit_only = calibrate(merged, base=base, experts=experts, calibration=split.fit, progress=False).model
    first = rec.candidates[0]
    padded = 0
    for t in experts:
        agreement, positions, _ = _direct(fit_only, experts[t], split.held[t])
        assert first.per_task[t]["agreement"] == pytest.approx(agreement, abs=1e-12)
        assert rec.next_token["held_out_positions"][t] == positions  # padding is not a position
        padded += sum(int((b["attention_mask"] == 0).sum()) for b in split.held[t])
    assert padded > 0  # the held-out windows hold padding, so excluding it is checked
    for c in rec.candidates:
        assert c.disagreement == pytest.approx(1.0 - sum(c.per_task[t]["agreement"] for t in experts) / len(experts))
    best = min((c.disagreement, c.drift) for c in rec.candidates)
    assert (rec.chosen.disagreement, rec.chosen.drift) == best
    assert rec["chosen"]["disagreement"] == rec.chosen.disagreement  # featcal.json's view of the same record
    assert "next-token disagreement with the experts" in tuning.summary_line(rec)


def test_next_token_scores_and_the_soft_tiebreak_against_a_direct_computation(llama):
    _, experts, merged, data = llama
    adapter = adapter_for(merged)
    heads = dict.fromkeys(experts, tuning.NEXT_TOKEN)
    refs = {t: tuning.expert_reference(t, experts[t], adapter, data[t], tuning.NEXT_TOKEN, keep_log_probs=True)
            for t in experts}
    sc = tuning.score(merged, adapter, data, refs, heads)
    for t in experts:
        agreement, _, kl = _direct(merged, experts[t], data[t])
        assert sc.per_task[t]["agreement"] == pytest.approx(agreement, abs=1e-12)
        assert sc.per_task[t]["soft"] == pytest.approx(kl, rel=1e-4)
        assert float(sc.samples[t]["agreement"].mean()) == pytest.approx(agreement)  # what the evidence reads
    assert sc.disagreement == pytest.approx(1.0 - sum(sc.per_task[t]["agreement"] for t in experts) / 2)
    own = tuning.score(experts["task0"], adapter, {"task0": data["task0"]}, refs, heads)
    assert own.disagreement == 0.0 and own.soft == pytest.approx(0.0, abs=1e-6)
    # without the soft tie-break the expert keeps token ids only, one per valid position: no logits
    ids_only = tuning.expert_reference("task0", experts["task0"], adapter, data["task0"], tuning.NEXT_TOKEN)
    for pred, b in zip(ids_only.predictions, data["task0"], strict=True):
        assert pred.log_probs is None and pred.ids.dtype == torch.int64
        assert pred.ids.numel() == int(b["attention_mask"].sum())
        assert pred.counts.tolist() == b["attention_mask"].sum(1).tolist()


def test_next_token_scoring_is_off_when_asked_or_without_an_lm_head(llama):
    base, experts, merged, data = llama
    cfg = FeatCalConfig(tune=True, tune_budget=3.0, tune_next_token=False)
    rec = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).tuning
    assert rec["next_token"] == {"used": False, "why": "tune_next_token is off"}
    assert all(c["disagreement"] is None for c in rec["candidates"]) and rec["criterion"] == tuning.CRITERION
    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 50}
    assert tuning.has_lm_head(T.LlamaForCausalLM(T.LlamaConfig(**tiny)))
    assert not tuning.has_lm_head(T.LlamaModel(T.LlamaConfig(**tiny)))  # no head
    assert not tuning.has_lm_head(T.BertForMaskedLM(T.BertConfig(**tiny)))  # a masked LM predicts no next token
    assert not tuning.has_lm_head(T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)))  # an encoder-decoder


def test_the_cli_turns_next_token_scoring_off_only_with_tune():
    from featcal.cli.calibrate_args import config_from_args
    from featcal.cli.main import build_parser
    from featcal.errors import ConfigError

    parser = build_parser()
    base = ["calibrate", "--merged", "m", "--base", "b", "--expert", "a=e", "--calib", "a=d", "--out", "o"]
    args = parser.parse_args([*base, "--tune", "--no-tune-next-token"])
    assert config_from_args(args, FeatCalConfig).tune_next_token is False
    with pytest.raises(ConfigError, match="tune_next_token given without tune"):
        config_from_args(parser.parse_args([*base, "--no-tune-next-token"]), FeatCalConfig)
