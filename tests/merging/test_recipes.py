"""Per-expert weights, densities and drop rates, normalize, TIES' per-tensor threshold and `linear`:
featcal.merge against the formulas written out here, one tensor at a time."""

import json

import pytest
import torch
from safetensors.torch import load_file

from featcal import merge
from featcal.cli.main import main
from featcal.errors import ConfigError
from featcal.merging.methods import dare, derive_seed
from tests.builders.tiny import make_family

pytestmark = pytest.mark.usefixtures("one_thread")
W = {"task0": 0.5, "task1": 1.5}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base, experts = make_family("llama", tmp_path_factory.mktemp("llama"), n_experts=2, scale=0.2)
    return base, experts, load_file(base / "model.safetensors"), {
        n: load_file(d / "model.safetensors") for n, d in experts.items()}


def _taus(b, es, k):
    return {n: e[k] - b[k] for n, e in es.items()}


def test_weighted_task_arithmetic_and_normalize(llama):
    base, experts, b, es = llama
    plain = merge(base, experts, "task_arithmetic", scaling=0.7, weights=W, progress=False)
    normal = merge(base, experts, "task_arithmetic", scaling=0.7, weights=W, normalize=True, progress=False)
    for k in b:
        taus = _taus(b, es, k)
        weighted = sum(W[n] * t for n, t in taus.items())
        torch.testing.assert_close(plain[k], b[k] + 0.7 * weighted, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(normal[k], b[k] + 0.7 * weighted / sum(W.values()), rtol=1e-6, atol=1e-7)


def test_unit_weights_are_the_unweighted_method_bit_for_bit(llama):
    base, experts, _, _ = llama
    for method in ("task_arithmetic", "ties", "dare_ties"):
        a = merge(base, experts, method, progress=False)
        b = merge(base, experts, method, weights={"task0": 1.0, "task1": 1.0}, progress=False)
        assert all(torch.equal(a[k], b[k]) for k in a), method


def _top_k_mask(tau, density):
    """mergekit's magnitude trim: the floor(density·n) (at least 1) largest |τ| of one tensor, by sorting."""
    k = max(1, int(density * tau.numel()))
    mask = torch.zeros(tau.numel(), dtype=torch.bool)
    mask[torch.argsort(tau.abs().reshape(-1), descending=True)[:k]] = True
    return mask.reshape(tau.shape)


def test_ties_per_tensor_threshold_with_per_expert_densities_and_weights(llama):
    base, experts, b, es = llama
    dens = {"task0": 0.3, "task1": 0.6}
    got = merge(base, experts, "ties", scaling=1.0, ties_threshold="per_tensor", densities=dens, weights=W,
                progress=False)
    glob = merge(base, experts, "ties", scaling=1.0, densities=dens, weights=W, progress=False)
    differs = 0
    for k in b:
        weighted = {n: W[n] * torch.where(_top_k_mask(t, dens[n]), t, 0.0) for n, t in _taus(b, es, k).items()}
        stack = torch.stack(list(weighted.values()))
        sign = torch.sign(stack.sum(0))
        agree = (torch.sign(stack) == sign) & (stack != 0)
        w = torch.tensor(list(W.values())).reshape(-1, *[1] * b[k].dim())
        mean = (stack * agree).sum(0) / torch.where((w * agree).sum(0) == 0, 1.0, (w * agree).sum(0))
        torch.testing.assert_close(got[k], b[k] + mean, rtol=1e-6, atol=1e-7)
        differs += not torch.equal(got[k], glob[k])
    assert differs > len(b) // 2  # the global threshold is another merge


def test_dare_l1_rescale_and_per_expert_drop_rates(llama):
    base, experts, b, es = llama
    drops = {"task0": 0.3, "task1": 0.8}
    got = merge(base, experts, "dare_ta", scaling=1.0, drop_rates=drops, dare_rescale="l1", seed=3, progress=False)
    for k in b:
        total = 0
        for n, tau in _taus(b, es, k).items():
            keep = torch.rand(tau.shape, generator=torch.Generator().manual_seed(derive_seed(3, n, k))) >= drops[n]
            kept = torch.where(keep, tau, 0.0)
            before, after = tau.abs().sum(), kept.abs().sum()
            total = total + (kept * (before / after) if min(before, after) >= 1e-7 else kept)
        torch.testing.assert_close(got[k], b[k] + total, rtol=1e-6, atol=1e-7)
        # the inverse rescale is the DARE paper's, and the default
    default = merge(base, experts, "dare_ta", scaling=1.0, drop_rates=drops, seed=3, progress=False)
    k = "model.layers.0.mlp.up_proj.weight"
    g = torch.Generator().manual_seed(derive_seed(3, "task0", k))
    expected0 = dare(es["task0"][k] - b[k], 0.3, g)
    g = torch.Generator().manual_seed(derive_seed(3, "task1", k))
    torch.testing.assert_close(default[k], b[k] + expected0 + dare(es["task1"][k] - b[k], 0.8, g))


def test_linear_is_the_weighted_average_of_the_experts(llama):
    base, experts, b, es = llama
    got = merge(base, experts, "linear", weights=W, progress=False)
    summed = merge(base, experts, "linear", weights=W, normalize=False, progress=False)
    for k in b:
        torch.testing.assert_close(got[k], (0.5 * es["task0"][k] + 1.5 * es["task1"][k]) / 2.0)
        torch.testing.assert_close(summed[k], 0.5 * es["task0"][k] + 1.5 * es["task1"][k])


@pytest.mark.parametrize("field", ["weights", "densities", "drop_rates"])
def test_per_expert_values_must_name_an_expert(llama, field):
    base, experts, _, _ = llama
    with pytest.raises(ConfigError, match=rf"{field} names 'task9', not an expert of this merge"):
        merge(base, experts, "dare_ties", progress=False, **{field: {"task9": 0.5}})


def test_cli_per_expert_flags_are_recorded(llama, tmp_path, capsys):
    base, experts, _, _ = llama
    out = tmp_path / "m"
    argv = ["merge", "--base", str(base), "--out", str(out), "--no-progress", "--method", "ties",
            "--ties-threshold", "per_tensor", "--weight", "task0=0.5", "--expert-density", "task1=0.4"]
    for n, p in experts.items():
        argv += ["--expert", f"{n}={p}"]
    assert main(argv) == 0
    params = json.loads((out / "featcal.json").read_text())["params"]
    assert params == {"method": "ties", "scaling": 0.3, "density": 0.2, "weights": {"task0": 0.5},
                      "densities": {"task1": 0.4}, "ties_threshold": "per_tensor"}
    expected = merge(base, experts, "ties", ties_threshold="per_tensor", weights={"task0": 0.5},
                     densities={"task1": 0.4}, progress=False)
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    bad = [a if a != "task0=0.5" else "task0=half" for a in argv]
    assert main(bad + ["--overwrite"]) == 2
    assert "--weight task0=half: 'half' is not a number" in capsys.readouterr().err
