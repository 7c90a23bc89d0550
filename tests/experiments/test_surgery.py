"""Surgery and ProbSurgery: identity at start, training reduces the distance to the expert, determinism."""

import pytest
import torch
import torch.nn.functional as F

from featcal.errors import CalibrationDataError, ConfigError
from featcal.experiments.baselines.probsurgery import ProbSurgeryModule, fit_probsurgery, kl_standard_normal
from featcal.experiments.baselines.surgery import SurgeryModule, fit_surgery


def synthetic(n=128, d=24, tasks=("a", "b"), seed=0):
    """Expert features = merged features minus a per-task low-rank ReLU bias (what Surgery models)."""
    g = torch.Generator().manual_seed(seed)
    merged, expert = {}, {}
    for t in tasks:
        f = torch.randn(n, d, generator=g)
        down, up = torch.randn(d, 4, generator=g), torch.randn(4, d, generator=g) * 0.5
        merged[t], expert[t] = f, f - F.relu(f @ down) @ up
    return merged, expert


def l1(a, b):
    return F.l1_loss(a, b).item()


def test_surgery_module_is_identity_at_initialisation():
    f = torch.randn(5, 12)
    assert torch.equal(SurgeryModule(12, 4, torch.Generator().manual_seed(0))(f), f)


def test_probsurgery_module_is_identity_at_initialisation():
    m = ProbSurgeryModule(12, 8, torch.Generator().manual_seed(0))
    f = torch.randn(5, 12)
    mu, logvar = m.moments(f)
    assert torch.equal(m(f), f) and not mu.any() and not logvar.any()


def test_surgery_training_reduces_distance_to_expert():
    merged, expert = synthetic()
    mods = fit_surgery(merged, expert, rank=16, lr=1e-2, steps=200, batch_size=32, seed=0)
    for t in merged:
        h = mods.history[t]
        assert len(h) == 200
        assert sum(h[-20:]) / 20 < 0.6 * sum(h[:20]) / 20
        assert l1(mods.apply(t, merged[t]), expert[t]) < 0.6 * l1(merged[t], expert[t])


def test_probsurgery_training_reduces_distance_to_expert():
    merged, expert = synthetic()
    mods = fit_probsurgery(merged, expert, rank=32, lr=1e-2, steps=200, batch_size=32, seed=0)
    for t in merged:
        h = mods.history[t]
        assert sum(h[-20:]) / 20 < 0.5 * sum(h[:20]) / 20  # noise shrinks and the mean learns the bias
        assert l1(mods.apply(t, merged[t]), expert[t]) < 0.7 * l1(merged[t], expert[t])
        # inference is the mean: no sampling, so repeated calls agree
        assert torch.equal(mods.apply(t, merged[t]), mods.apply(t, merged[t]))


def test_kl_matches_torch_distributions():
    mu, logvar = torch.randn(6, 5), torch.randn(6, 5)
    q = torch.distributions.Normal(mu, torch.exp(0.5 * logvar))
    p = torch.distributions.Normal(torch.zeros(5), torch.ones(5))
    ref = torch.distributions.kl_divergence(q, p).sum(1).mean()
    torch.testing.assert_close(kl_standard_normal(mu, logvar), ref)
    assert kl_standard_normal(torch.zeros(3, 4), torch.zeros(3, 4)).item() == 0.0


@pytest.mark.parametrize("fit", [fit_surgery, fit_probsurgery])
def test_same_seed_same_modules_other_seed_differs(fit):
    merged, expert = synthetic(n=40)
    a = fit(merged, expert, steps=20, seed=3).state_dict()
    b = fit(merged, expert, steps=20, seed=3).state_dict()
    c = fit(merged, expert, steps=20, seed=4).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_a_task_module_does_not_depend_on_the_other_tasks():
    merged, expert = synthetic(n=40, tasks=("a", "b"))
    both = fit_surgery(merged, expert, steps=15, seed=0).state_dict()
    alone = fit_surgery({"a": merged["a"]}, {"a": expert["a"]}, steps=15, seed=0).state_dict()
    assert all(torch.equal(alone[k], both[k]) for k in alone)


def test_bad_features_and_parameters_are_refused_before_training():
    merged, expert = synthetic(n=10)
    with pytest.raises(CalibrationDataError, match="'b'"):
        fit_surgery(merged, {"a": expert["a"]})
    with pytest.raises(CalibrationDataError, match="task 'a'"):
        fit_surgery({"a": merged["a"]}, {"a": expert["a"][:, :5]})
    with pytest.raises(ConfigError, match="rank"):
        fit_surgery(merged, expert, rank=0)
    with pytest.raises(ConfigError, match="kl_weight"):
        fit_probsurgery(merged, expert, kl_weight=-1.0)
    mods = fit_surgery(merged, expert, steps=1)
    with pytest.raises(ConfigError, match="'c'"):
        mods.apply("c", merged["a"])
