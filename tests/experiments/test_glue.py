"""GLUE text-to-text metrics and prompts, checked on hand-made examples."""

from __future__ import annotations

import datasets
import pytest
import scipy.stats
import torch

from featcal.errors import CalibrationDataError, ConfigError
from featcal.experiments.task_data.glue import (
    STSB_FALLBACK,
    calibration_batches,
    evaluate_glue,
    exact_match,
    parse_similarity,
    score,
    spearman,
)
from featcal.experiments.task_data.templates import GLUE_PROMPTS, glue_eval_split, glue_prompt
from tests.builders.hub import word_tokenizer


def test_exact_match_ignores_case_and_surrounding_space_only():
    assert exact_match([" Yes", "no ", "yes", "yes no"], ["yes", "no", "no", "yes"]) == 50.0
    with pytest.raises(ValueError):
        exact_match(["yes"], [])


@pytest.mark.parametrize("text,value", [("3.8", 3.8), ("about 4", 4.0), ("4.0.", 4.0), (".5", 0.5),
                                        ("-1", -1.0), ("no", None), ("", None)])
def test_parse_similarity(text, value):
    assert parse_similarity(text) == value


def test_spearman_hand_values_ties_and_constant_input():
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    x, y = [1, 2, 2, 4, 5, 5], [5, 3, 3, 1, 2, 0]
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0])
    assert spearman([2, 2, 2], [1, 2, 3]) == 0.0
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])


def test_stsb_score_uses_the_fallback_for_unparsable_generations():
    result = score("stsb", ["1.0", "no idea", "4.2", "3"], [0.5, 1.0, 4.0, 3.5])
    expected = spearman([1.0, STSB_FALLBACK, 4.2, 3.0], [0.5, 1.0, 4.0, 3.5])
    assert result["score"] == pytest.approx(100 * expected)
    assert result["unparsable"] == 1 and result["n"] == 4 and result["metric"] == "spearman"


def test_classification_score_compares_with_the_label_words():
    # rte: 0 -> yes (entailment), 1 -> no
    assert score("rte", ["yes", "no", "no"], [0, 1, 0])["score"] == pytest.approx(200 / 3)
    assert score("mnli", ["neutral", "contradiction"], [1, 2])["score"] == 100.0


def test_prompts_fill_the_hub_columns():
    text = glue_prompt("rte").input_text({"sentence1": "A cat sits.", "sentence2": "An animal sits."})
    assert text == "Does the text: 'A cat sits.' entail that 'An animal sits.' is true? Provide 'yes' or 'no'."
    assert glue_prompt("stsb").target_text(3.26) == "3.3"
    assert glue_prompt("stsb").target_text(4) == "4.0"
    assert set(GLUE_PROMPTS) == {"cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"}
    assert glue_eval_split("mnli") == "validation_matched" and glue_eval_split("cola") == "validation"
    with pytest.raises(ConfigError, match="premise"):
        glue_prompt("mnli").input_text({"hypothesis": "x"})
    with pytest.raises(ConfigError):
        glue_prompt("cola").target_text(7)


def _rte(n=3):
    return datasets.Dataset.from_dict({
        "sentence1": ["a cat sits"] * n, "sentence2": ["a dog runs"] * n, "label": [i % 2 for i in range(n)],
        "idx": list(range(n)),
    })


def test_calibration_batches_teacher_force_the_label_text():
    tok = word_tokenizer([p.template for p in GLUE_PROMPTS.values()] + ["a cat sits dog runs yes no"])
    batches = calibration_batches("rte", _rte(3), [0, 1, 2], tok, batch_size=2, decoder_start_token_id=0)
    assert [b["input_ids"].shape[0] for b in batches] == [2, 1]
    dec = batches[0]["decoder_input_ids"]
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    assert dec[:, 0].tolist() == [0, 0]  # decoder start
    assert dec[:, 1].tolist() == [yes, no]  # labels 0 -> yes, 1 -> no, shifted right by one


class _CharTokenizer:
    """One token per character plus eos (1), pad 0: label words of different lengths, as with T5's tokenizer."""

    pad_token_id = 0

    def __call__(self, texts=None, *, text_target=None, padding=True, truncation=True, max_length=512,
                 return_tensors="pt"):
        rows = [[3 + ord(c) % 50 for c in t][: max_length - 1] + [1] for t in (texts if texts is not None else text_target)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask}


def test_glue_and_calibration_data_teacher_force_alike():
    """One routine builds both: each row's mask counts exactly its target's tokens (its eos-reading position is
    masked whatever the row's padding; GLUE used to keep it in every row but the longest)."""
    from featcal.data.preprocess import TextPreprocessor
    from featcal.data.sources import TextExample

    tok = _CharTokenizer()
    data = datasets.Dataset.from_dict({"sentence": ["a b", "c d", "e"], "label": [0, 1, 1], "idx": [0, 1, 2]})
    (batch,) = calibration_batches("cola", data, [0, 1, 2], tok, batch_size=3, decoder_start_token_id=0)
    targets = [glue_prompt("cola").target_text(v) for v in data["label"]]  # unacceptable, acceptable, acceptable
    pre = object.__new__(TextPreprocessor)  # its decoder half only: no checkpoint needed
    pre.tokenizer, pre.decoder_start, pre.pad_id, pre.max_length, pre.accepted = tok, 0, 0, 32, None
    want = pre._decoder_inputs([TextExample(t, g) for t, g in zip(data["sentence"], targets, strict=True)])
    assert torch.equal(batch["decoder_input_ids"], want["decoder_input_ids"])
    assert torch.equal(batch["decoder_attention_mask"], want["decoder_attention_mask"])
    assert batch["decoder_attention_mask"].sum(1).tolist() == [len(t) + 1 for t in targets]  # the words + eos
    assert batch["decoder_input_ids"][1, len("acceptable") + 1].item() == 0  # the eos-reading position is pad


class _AnswerModel(torch.nn.Module):
    """generate() answers 'yes' to everything (as token ids, like a seq2seq model)."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok

    def generate(self, input_ids, attention_mask=None, **_):
        ids = self.tok(["yes"], return_tensors="pt")["input_ids"]
        return ids.repeat(input_ids.shape[0], 1)


def test_evaluate_glue_generates_decodes_and_scores():
    tok = word_tokenizer([p.template for p in GLUE_PROMPTS.values()] + ["a cat sits dog runs yes no"])
    result = evaluate_glue(_AnswerModel(tok), tok, "rte", _rte(4), batch_size=3)
    assert result == {"score": 50.0, "metric": "exact_match", "n": 4}
    with pytest.raises(CalibrationDataError, match="sentence2"):
        evaluate_glue(_AnswerModel(tok), tok, "rte", _rte(2).remove_columns("sentence2"))
