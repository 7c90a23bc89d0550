"""RegMean and RegMean++ on tiny models: exact special cases, the closed form, forward-order inputs."""

import copy

import pytest
import torch

from featcal.baselines.gram import regmean_weight, scale_off_diagonal
from featcal.baselines.regmean import regmean
from featcal.errors import CalibrationDataError, CheckpointError
from tiny import make_family, perturbed, sample_inputs, tiny_model


def family(kind, n=3, scale=0.2):
    base = tiny_model(kind)
    experts = {f"t{i}": perturbed(base, 100 + i, scale) for i in range(n)}
    calib = {t: [sample_inputs(kind, batch=4, seed=i), sample_inputs(kind, batch=4, seed=10 + i)]
             for i, t in enumerate(experts)}
    return base, experts, calib


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("plus_plus", [False, True])
@pytest.mark.parametrize("kind", ["clip", "llama", "t5"])
def test_one_expert_gives_the_expert(kind, plus_plus):
    base, experts, calib = family(kind, n=1)
    merged = regmean(base, experts, calib, plus_plus=plus_plus)
    assert max_diff(experts["t0"].state_dict(), merged.state_dict()) < 1e-5


@pytest.mark.parametrize("plus_plus", [False, True])
def test_identical_experts_give_them_back(plus_plus):
    base, experts, calib = family("bert", n=1)
    same = {"a": experts["t0"], "b": copy.deepcopy(experts["t0"])}
    merged = regmean(base, same, {"a": calib["t0"], "b": sample_inputs("bert", batch=4, seed=7)}, plus_plus=plus_plus)
    assert max_diff(experts["t0"].state_dict(), merged.state_dict()) < 1e-5


def test_closed_form_is_least_squares_on_the_stacked_inputs():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, 6, generator=g), torch.randn(30, 6, generator=g) * 2]
    ws = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in xs]
    grams = [x.double().T @ x.double() / len(x) for x in xs]
    # alpha = 1: argmin Σ_t (1/n_t)‖X_t Wᵀ − X_t W_tᵀ‖²
    a = torch.cat([x.double() / len(x) ** 0.5 for x in xs])
    y = torch.cat([x.double() @ w.T / len(x) ** 0.5 for x, w in zip(xs, ws, strict=True)])
    ref = torch.linalg.lstsq(a, y).solution.T
    torch.testing.assert_close(regmean_weight(grams, ws, alpha=1.0), ref)
    # alpha = 0: diagonal Grams, i.e. a per-input-channel weighted average of the experts
    diag = [torch.diagonal(gm) for gm in grams]
    ref0 = sum(w * d for w, d in zip(ws, diag, strict=True)) / sum(diag)
    torch.testing.assert_close(regmean_weight(grams, ws, alpha=0.0), ref0)


def test_scale_off_diagonal_keeps_the_diagonal():
    gm = torch.arange(9.0).reshape(3, 3)
    out = scale_off_diagonal(gm, 0.5)
    assert torch.equal(torch.diagonal(out), torch.diagonal(gm))
    assert out[0, 1] == 0.5 * gm[0, 1] and out[2, 0] == 0.5 * gm[2, 0]


def test_non_linear_parameters_are_averaged_and_linears_solved():
    base, experts, calib = family("clip")
    merged = regmean(base, experts, calib).state_dict()
    sds = [e.state_dict() for e in experts.values()]
    for name in ("encoder.layers.0.layer_norm1.weight", "encoder.layers.1.mlp.fc1.bias", "embeddings.patch_embedding.weight"):
        torch.testing.assert_close(merged[name], sum(s[name] for s in sds) / 3)
    w = "encoder.layers.0.mlp.fc1.weight"
    assert (merged[w] - sum(s[w] for s in sds) / 3).abs().max() > 1e-3


def test_plus_plus_uses_the_merged_models_propagated_inputs():
    """Independent reference for CLIP: block l's Grams from expert block l on merged hidden_states[l]."""
    base, experts, calib = family("clip")
    got = regmean(base, experts, calib, plus_plus=True, alpha=0.9)
    plain = regmean(base, experts, calib, plus_plus=False, alpha=0.9)

    ref = copy.deepcopy(base)
    sds = [e.state_dict() for e in experts.values()]
    ref.load_state_dict({k: sum(s[k] for s in sds) / 3 for k in sds[0]})
    for layer in range(2):
        acts = {}
        for t, expert in experts.items():
            block = expert.encoder.layers[layer]
            feats = {}
            hooks = [m.register_forward_hook(lambda _m, a, _o, n=n, feats=feats: feats.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
                     for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
            with torch.no_grad():
                for b in calib[t]:
                    h = ref(**b, output_hidden_states=True).hidden_states[layer]
                    block(h, None)
            for hk in hooks:
                hk.remove()
            acts[t] = {n: torch.cat(v).double() for n, v in feats.items()}
        for n, m in ref.encoder.layers[layer].named_modules():
            if isinstance(m, torch.nn.Linear):
                grams = [acts[t][n].T @ acts[t][n] / len(acts[t][n]) for t in experts]
                ws = [e.encoder.layers[layer].get_submodule(n).weight.detach() for e in experts.values()]
                with torch.no_grad():
                    m.weight.copy_(regmean_weight(grams, ws, alpha=0.9))
    assert max_diff(ref.state_dict(), got.state_dict()) < 1e-4
    assert max_diff(plain.state_dict(), got.state_dict()) > 1e-3


def test_checkpoint_paths_work_like_models(tmp_path):
    base_dir, expert_dirs = make_family("clip", tmp_path, n_experts=2, scale=0.2)
    calib = {t: sample_inputs("clip", batch=4, seed=i) for i, t in enumerate(expert_dirs)}
    from featcal.io.models import load_model

    from_paths = regmean(base_dir, expert_dirs, calib)
    from_models = regmean(load_model(base_dir), {t: load_model(p) for t, p in expert_dirs.items()}, calib)
    assert max_diff(from_models.state_dict(), from_paths.state_dict()) == 0.0


def test_bad_inputs_are_refused_naming_the_problem():
    base, experts, calib = family("clip", n=2)
    with pytest.raises(CalibrationDataError, match="'t1'"):
        regmean(base, experts, {"t0": calib["t0"]})
    with pytest.raises(CalibrationDataError, match="empty"):
        regmean(base, experts, {"t0": calib["t0"], "t1": []})
    other = tiny_model("clip")
    other.encoder.layers[0].mlp.fc1 = torch.nn.Linear(32, 48)
    with pytest.raises(CheckpointError, match="encoder.layers.0.mlp.fc1"):
        regmean(base, {"t0": experts["t0"], "t1": other}, calib)


def test_a_bad_last_expert_is_refused_before_any_model_is_loaded(tmp_path, monkeypatch):
    import importlib

    rm = importlib.import_module("featcal.baselines.regmean")  # the package exports a function of that name

    base_dir, expert_dirs = make_family("clip", tmp_path, n_experts=2)
    expert_dirs["broken"] = tmp_path / "nowhere"
    loaded = []
    monkeypatch.setattr(rm, "load", lambda m, what: loaded.append(what))
    calib = {t: sample_inputs("clip") for t in expert_dirs}
    with pytest.raises(CheckpointError, match="expert 'broken'"):
        regmean(base_dir, expert_dirs, calib)
    assert loaded == []
