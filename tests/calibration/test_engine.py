"""The streaming engine against the dense reference, and its storage / source / determinism options."""

from __future__ import annotations

import logging

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.errors import CalibrationDataError, CheckpointError, ConfigError
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, reference_calibrate

KINDS = ["clip", "vit", "bert", "t5", "llama"]


_SETTINGS: dict[str, tuple] = {}
_DRIFT: dict[str, list] = {}  # the calibration's drift record, per kind


def _setting(kind: str):
    """(kind, base, experts, merged, data, calibrated with defaults): built once per kind."""
    if kind not in _SETTINGS:
        base, experts, merged = noisy_family(kind)
        data = family_data(kind, experts)
        result = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
        _SETTINGS[kind] = (kind, base, experts, merged, data, result.model)
        _DRIFT[kind] = result.drift
    return _SETTINGS[kind]


@pytest.fixture(params=KINDS)
def setting(request):
    return _setting(request.param)


@pytest.fixture(params=["clip", "t5", "llama"])
def some_setting(request):
    """The kinds whose block context differs most: none (CLIP), position bias (T5), rotary tuples (Llama)."""
    return _setting(request.param)


def test_streaming_engine_equals_dense_reference_and_is_deterministic(setting):
    kind, base, experts, merged, data, out = setting
    ref = reference_calibrate(merged, base, experts, data, FeatCalConfig())
    diff, where = max_abs_diff(out, ref)
    assert diff < 1e-5, f"{kind}: {where} differs by {diff}"
    changed, _ = max_abs_diff(out, merged)  # calibration did something
    assert changed > 1e-3
    assert type(out) is type(merged)
    again = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    assert max_abs_diff(out, again.model)[0] == 0.0  # bit-identical
    assert _DRIFT[kind] == again.drift


@pytest.mark.parametrize("kind", ["clip", "t5"])
def test_switches_leave_bias_and_norms_merged(kind):
    kind, base, experts, merged, data, _ = _setting(kind)
    cfg = FeatCalConfig(calibrate_bias=False, calibrate_layernorm=False)
    out = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).model
    ref = reference_calibrate(merged, base, experts, data, cfg)
    assert max_abs_diff(out, ref)[0] < 1e-5
    mods = dict(merged.named_modules())
    so, sm = out.state_dict(), merged.state_dict()
    for name, mod in out.named_modules():
        is_norm = isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith(("RMSNorm", "LayerNorm"))
        for pname in (["weight", "bias"] if is_norm else ["bias"]):
            key = f"{name}.{pname}"
            if key in so and getattr(mods[name], pname, None) is not None:
                assert torch.equal(so[key], sm[key]), key


def test_drift_record_is_per_block_and_matches_definition(setting):
    kind, base, experts, merged, data, out = setting
    drift = _DRIFT[kind]
    n_blocks = {"t5": 4}.get(kind, 2)
    assert [d["block"] for d in drift] == list(range(n_blocks))
    assert all(d["before"] > 0 and d["after"] > 0 for d in drift)
    # first block: "before" is the plain merge's block-1 drift, computable by hand
    if kind in ("clip", "vit", "llama"):
        per_task = []
        for t, e in experts.items():
            num = den = 0.0
            for batch in data[t]:
                with torch.no_grad():
                    hm = merged(**batch, output_hidden_states=True).hidden_states[1]
                    he = e(**batch, output_hidden_states=True).hidden_states[1]
                rel = (hm - he).pow(2).sum(-1) / he.pow(2).sum(-1)
                m = batch.get("attention_mask", torch.ones(rel.shape)).float()
                num += float((rel * m).sum())
                den += float(m.sum())
            per_task.append(num / den)
        assert drift[0]["before"] == pytest.approx(sum(per_task) / len(per_task), rel=1e-4)


def test_paths_give_the_same_result_as_models(setting, tmp_path):
    kind, base, experts, merged, data, a = setting
    paths = {}
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
        paths[t] = tmp_path / t
    base.save_pretrained(tmp_path / "base")
    merged.save_pretrained(tmp_path / "merged")
    b = calibrate(str(tmp_path / "merged"), base=tmp_path / "base", experts=paths, calibration=data, progress=False).model
    assert max_abs_diff(a, b)[0] == 0.0


def test_path_experts_are_streamed_not_loaded(monkeypatch, tmp_path):
    """With merged in memory, no model is ever loaded whole from the expert or base paths."""
    import featcal.io.read.models

    kind, base, experts, merged, data, expected = _setting("llama")
    for t, e in experts.items():
        e.save_pretrained(tmp_path / t)
    base.save_pretrained(tmp_path / "base")

    def refuse(*args, **kwargs):
        raise AssertionError("load_model called")

    monkeypatch.setattr(featcal.io.read.models, "load_model", refuse)
    out = calibrate(merged, base=tmp_path / "base", experts={t: tmp_path / t for t in experts}, calibration=data,
                    progress=False).model
    assert max_abs_diff(out, expected)[0] == 0.0


def test_spill_dir_is_identical_and_bfloat16_chains_stay_close(some_setting, tmp_path):
    kind, base, experts, merged, data, ram = some_setting
    spill = calibrate(merged, base=base, experts=experts, calibration=data, progress=False,
                      config=FeatCalConfig(spill_dir=tmp_path / "spill")).model
    assert max_abs_diff(ram, spill)[0] == 0.0
    assert not (tmp_path / "spill").exists()  # spilled chains, and the spill dir featcal created, are removed
    bf16 = calibrate(merged, base=base, experts=experts, calibration=data, progress=False,
                     config=FeatCalConfig(chain_dtype="bfloat16")).model
    diff, where = max_abs_diff(ram, bf16)
    assert 0.0 < diff < 0.05, f"{where}: {diff}"


def test_merged_model_is_not_modified_unless_inplace():
    base, experts, merged = noisy_family("clip")
    data = family_data("clip", experts)
    before = {k: v.clone() for k, v in merged.state_dict().items()}
    calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    assert all(torch.equal(before[k], v) for k, v in merged.state_dict().items())
    out = calibrate(merged, base=base, experts=experts, calibration=data, progress=False, inplace=True).model
    assert out is merged


def _shifted_images(tasks, n_batches: int, seed: int):
    """Each task's images come from their own distribution (a per-task brightness shift)."""
    out = {}
    for i, t in enumerate(tasks):
        g = torch.Generator().manual_seed(seed + i)
        out[t] = [{"pixel_values": torch.randn(4, 3, 16, 16, generator=g) * 0.5 + (i - 0.5)} for _ in range(n_batches)]
    return out


def test_calibration_reduces_held_out_drift():
    """On held-out images of each task, the calibrated merge's features sit closer to that task's expert."""
    base, experts, merged = noisy_family("clip", n_experts=2, scale=0.2)
    data = _shifted_images(experts, 4, seed=0)
    held_out = _shifted_images(experts, 2, seed=1000)
    result = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    out = result.model

    @torch.no_grad()
    def drift(model, pooled: bool) -> float:
        total = 0.0
        for t, e in experts.items():
            for batch in held_out[t]:
                o, oe = model(**batch), e(**batch)
                hm, he = (o.pooler_output, oe.pooler_output) if pooled else (o.last_hidden_state, oe.last_hidden_state)
                total += float(((hm - he).pow(2).sum(-1) / he.pow(2).sum(-1)).mean())
        return total

    assert drift(out, pooled=False) < 0.75 * drift(merged, pooled=False)
    assert drift(out, pooled=True) < 0.9 * drift(merged, pooled=True)  # the class token the head reads
    assert all(d["after"] < d["before"] for d in result.drift)


def test_logs_one_line_per_block(caplog):
    base, experts, merged = noisy_family("llama")
    data = family_data("llama", experts)
    with caplog.at_level(logging.INFO, logger="featcal.calibration"):
        calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    lines = [r.getMessage() for r in caplog.records if "drift" in r.getMessage()]
    assert len(lines) == 2 and "decoder block 0" in lines[0]


# --- bad input, refused before any work -------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    base, experts, merged = noisy_family("bert")
    return base, experts, merged, family_data("bert", experts)


def test_task_without_expert_or_data_is_named(small):
    base, experts, merged, data = small
    with pytest.raises(CalibrationDataError, match="'extra'.*no expert"):
        calibrate(merged, base=base, experts=experts, calibration={**data, "extra": data["task0"]}, progress=False)
    with pytest.raises(CalibrationDataError, match="'task1'.*no calibration data"):
        calibrate(merged, base=base, experts=experts, calibration={"task0": data["task0"]}, progress=False)


def test_empty_calibration_set_is_named(small):
    base, experts, merged, data = small
    with pytest.raises(CalibrationDataError, match="task 'task1' is empty"):
        calibrate(merged, base=base, experts=experts, calibration={**data, "task1": []}, progress=False)


def test_bad_batch_type_is_refused(small):
    base, experts, merged, data = small
    with pytest.raises(CalibrationDataError, match="batch 0"):
        calibrate(merged, base=base, experts=experts, calibration={**data, "task1": [42]}, progress=False)
    # a list of texts is a source now (tokenised with the model's tokenizer): without one it is refused by name
    with pytest.raises(CalibrationDataError, match="'task1'.*tokenizer="):
        calibrate(merged, base=base, experts=experts, calibration={**data, "task1": ["text"]}, progress=False)


def test_batches_that_do_not_fit_the_model_are_refused(small):
    base, experts, merged, data = small
    bad_vocab = {**data, "task1": [{"input_ids": torch.full((2, 4), 1000)}]}
    with pytest.raises(CalibrationDataError, match="task 'task1', batch 0: input_ids outside the vocabulary"):
        calibrate(merged, base=base, experts=experts, calibration=bad_vocab, progress=False)
    no_ids = {**data, "task0": [{"attention_mask": torch.ones(2, 4)}]}
    with pytest.raises(CalibrationDataError, match="task 'task0', batch 0: no 'input_ids'"):
        calibrate(merged, base=base, experts=experts, calibration=no_ids, progress=False)


def test_mismatched_expert_is_named(small, tmp_path):
    from tests.builders import tiny

    base, experts, merged, data = small
    other = tiny.tiny_model("bert")
    other.resize_token_embeddings(120)
    with pytest.raises(CheckpointError, match="expert 'task1'.*embeddings.word_embeddings.weight"):
        calibrate(merged, base=base, experts={**experts, "task1": other}, calibration=data, progress=False,
                  config=FeatCalConfig(spill_dir=tmp_path / "spill"))
    assert not (tmp_path / "spill").exists()  # refused before any work: nothing spilled


def test_non_finite_solution_is_refused_naming_the_parameter():
    import copy

    base, experts, merged = noisy_family("clip")
    broken = copy.deepcopy(experts["task1"])
    with torch.no_grad():
        broken.encoder.layers[0].mlp.fc1.weight[0, 0] = float("nan")
    broken_experts = {**experts, "task1": broken}
    # the up-front scan names the expert's NaN before any work ...
    with pytest.raises(CheckpointError, match=r"expert 'task1'.*encoder\.layers\.0\.mlp\.fc1\.weight"):
        calibrate(merged, base=base, experts=broken_experts, calibration=family_data("clip", experts), progress=False)
    # ... and with the scan off, the guard on the solved weights still refuses to load them
    with pytest.raises(CalibrationDataError, match=r"encoder\.layers\.0\.mlp\.fc1\.weight"):
        calibrate(merged, base=base, experts=broken_experts, calibration=family_data("clip", experts),
                  progress=False, check_finite=False)


def test_missing_base_with_extrapolating_anchor_is_refused(small):
    base, experts, merged, data = small
    with pytest.raises(ConfigError, match="base"):
        calibrate(merged, experts=experts, calibration=data, progress=False)
    out = calibrate(merged, experts=experts, calibration=data, progress=False, config=FeatCalConfig(anchor_blend_rho=1.0))
    assert len(out.drift) == 2


def test_tensor_batches_are_the_main_input():
    base, experts, merged = noisy_family("clip")
    data = family_data("clip", experts)
    as_tensors = {t: [b["pixel_values"] for b in v] for t, v in data.items()}
    a = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    b = calibrate(merged, base=base, experts=experts, calibration=as_tensors, progress=False).model
    assert max_abs_diff(a, b)[0] == 0.0


@pytest.mark.parametrize("kind", ["clip", "llama"])
@pytest.mark.parametrize("alpha", [0.25, 0.6])
def test_teacher_form_equals_the_fold_and_the_dense_reference(kind, alpha, monkeypatch):
    """The teacher term summed in the pass (W_t applied to the merged input) gives what folding C_t W_tᵀ
    in at the end of the task gives; the engine picks it by token count, both are exact."""
    from featcal.calibration.engine import context
    from featcal.calibration.maths.statistics import TaskSums

    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    cfg = FeatCalConfig(teacher_interp_alpha=alpha)
    forms: list[bool] = []
    add = TaskSums.add_linear_tokens

    def spy(self, name, group, x, y, w, *, teacher=False):
        forms.append(teacher)
        return add(self, name, group, x, y, w, teacher=teacher)

    monkeypatch.setattr(TaskSums, "add_linear_tokens", spy)
    out = {}
    for label, factor in (("teacher", 0.0), ("fold", 1e12)):
        forms.clear()
        monkeypatch.setattr(context, "TEACHER_FORM_TOKENS_PER_INPUT", factor)
        out[label] = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False).model
        assert forms and all(forms) if label == "teacher" else not any(forms)
    diff, where = max_abs_diff(out["teacher"], out["fold"])
    assert diff < 1e-5, f"{kind}: {where} differs by {diff}"
    ref = reference_calibrate(merged, base, experts, data, cfg)
    diff, where = max_abs_diff(out["teacher"], ref)
    assert diff < 1e-5, f"{kind}: {where} differs by {diff} from the dense reference"
