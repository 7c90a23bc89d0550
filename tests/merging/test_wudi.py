"""WUDI: reduces its own interference objective, keeps a lone task vector, averages the rest."""

import pytest
import torch

from featcal.errors import CheckpointError, ConfigError
from featcal.merging.wudi import wudi, wudi_layer, wudi_objective
from tests.builders.tiny import perturbed, tiny_model


def test_objective_is_zero_at_a_lone_task_vector_and_weights_by_inverse_norm():
    tv = torch.randn(1, 5, 7)
    assert wudi_objective(tv[0], tv).item() == pytest.approx(0.0, abs=1e-10)
    # one task, merged = 0: ‖τ τᵀ‖² / ‖τ‖²
    expected = (tv[0] @ tv[0].T).pow(2).sum() / tv[0].pow(2).sum()
    torch.testing.assert_close(wudi_objective(torch.zeros(5, 7), tv), expected)
    # a zero task vector contributes nothing instead of dividing by zero
    both = torch.cat([tv, torch.zeros(1, 5, 7)])
    torch.testing.assert_close(wudi_objective(torch.zeros(5, 7), both), expected)


def test_optimisation_reduces_the_objective_from_the_sum():
    tvs = torch.randn(3, 6, 10, generator=torch.Generator().manual_seed(0))
    start = wudi_objective(tvs.sum(0), tvs).item()
    out = wudi_layer(tvs, steps=200, lr=1e-2)
    assert wudi_objective(out, tvs).item() < 0.5 * start
    assert torch.equal(wudi_layer(tvs, steps=0), tvs.sum(0))


def test_single_expert_is_returned_exactly():
    base = tiny_model("clip")
    expert = perturbed(base, 1)
    merged = wudi(base, {"a": expert}, steps=20, lr=1e-3)
    assert all(torch.equal(merged[k], v) for k, v in expert.state_dict().items())


def test_linear_weights_optimised_other_tensors_take_the_mean_task_vector():
    base = tiny_model("clip")
    experts = {f"t{i}": perturbed(base, i, 0.2) for i in range(3)}
    merged = wudi(base, experts, steps=30, lr=1e-3)
    sd0, sds = base.state_dict(), [e.state_dict() for e in experts.values()]
    name = "encoder.layers.0.layer_norm1.weight"
    torch.testing.assert_close(merged[name], sd0[name] + sum(s[name] - sd0[name] for s in sds) / 3)
    w = "encoder.layers.0.mlp.fc1.weight"
    tvs = torch.stack([s[w] - sd0[w] for s in sds])
    assert wudi_objective(merged[w] - sd0[w], tvs) < wudi_objective(tvs.sum(0), tvs)
    again = wudi(base, experts, steps=30, lr=1e-3)
    assert all(torch.equal(again[k], merged[k]) for k in merged)


def test_tied_lm_head_is_averaged_with_its_embedding():
    base = tiny_model("t5")
    experts = {f"t{i}": perturbed(base, i, 0.2) for i in range(2)}
    merged = wudi(base, experts, steps=5, lr=1e-3)
    assert torch.equal(merged["lm_head.weight"], merged["shared.weight"])


def test_bad_inputs_are_refused():
    base = tiny_model("clip")
    with pytest.raises(ConfigError, match="lr"):
        wudi(base, {"a": perturbed(base, 1)}, lr=0.0)
    with pytest.raises(CheckpointError, match="expert 'a'"):
        wudi(base, {"a": tiny_model("vit")})


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (7, 7), (2, 40)])  # (2, 40): wider than 2T·out, per-task form
def test_closed_form_gradient_equals_autograd_of_the_definition(shape):
    from featcal.merging.wudi import wudi_gradient

    g = torch.Generator().manual_seed(1)
    tvs = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    tvs[1] = 0.0  # a zero task vector contributes nothing
    merged = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    wudi_objective(merged, tvs).backward()
    torch.testing.assert_close(wudi_gradient(tvs)(merged.detach()), merged.grad)


def test_closed_form_keeps_float32_steps_on_the_float64_trajectory():
    """Nearly orthogonal task vectors (WUDI's case), where τ_m·A and B nearly cancel: 100 float32 Adam steps stay
    within round-off of the same steps in float64, as close as autograd through the objective in float32 gets."""
    g = torch.Generator().manual_seed(0)
    tvs = torch.stack([torch.randn(48, 4, generator=g) @ torch.randn(4, 96, generator=g) * 1e-3 for _ in range(4)])
    reference = wudi_layer(tvs.double(), steps=100, lr=1e-5).float()
    ours = wudi_layer(tvs, steps=100, lr=1e-5)
    merged = torch.nn.Parameter(tvs.sum(0).clone())
    opt = torch.optim.Adam([merged], lr=1e-5)
    for _ in range(100):
        opt.zero_grad()
        wudi_objective(merged, tvs).backward()
        opt.step()
    moved = (reference - tvs.sum(0)).abs().max()
    assert moved > 1e-4  # the steps did move it
    assert (ours - reference).abs().max() <= max(2 * (merged.detach() - reference).abs().max(), 1e-6 * moved)
