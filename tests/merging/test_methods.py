"""The merging maths on hand-computed examples (dyadic numbers, so float32 results are exact)."""

import pytest
import torch

from featcal.merging.methods import (
    average,
    dare,
    dare_ta,
    dare_ties,
    derive_seed,
    disjoint_merge,
    keep_count,
    kth_largest,
    task_arithmetic,
    task_vector,
    ties,
    ties_from_task_vectors,
)
from featcal.merging.selection import StreamingKthLargest

pytestmark = pytest.mark.usefixtures("one_thread")

t = torch.tensor
BASE = t([1.0, 2.0, 3.0, 4.0, 5.0])
TAUS = [
    t([0.5, -0.25, 0.125, 0.0, 0.375]),
    t([-0.375, 0.75, 0.25, -0.125, -0.0625]),
    t([0.25, -0.125, -0.875, 0.25, 0.0625]),
]
EXPERTS = [BASE + tau for tau in TAUS]


def test_average_and_task_arithmetic():
    # Σ τ = [0.375, 0.375, -0.5, 0.125, 0.375]
    assert torch.allclose(average(BASE, EXPERTS), BASE + t([0.375, 0.375, -0.5, 0.125, 0.375]) / 3, atol=1e-7)
    # s = 0.5
    assert torch.equal(task_arithmetic(BASE, EXPERTS, scaling=0.5), t([1.1875, 2.1875, 2.75, 4.0625, 5.1875]))


def test_ties_hand_computed():
    # density 0.6 of 5 entries -> keep 3 per expert:
    #   τ̂1 = [0.5, -0.25, 0, 0, 0.375]; τ̂2 = [-0.375, 0.75, 0.25, 0, 0]; τ̂3 = [0.25, 0, -0.875, 0.25, 0]
    # summed mass [0.375, 0.5, -0.625, 0.25, 0.375] -> signs [+, +, -, +, +]
    # disjoint means: (0.5 + 0.25)/2, 0.75, -0.875, 0.25, 0.375
    merged = ties(BASE, EXPERTS, density=0.6, scaling=0.5)
    assert torch.equal(merged, BASE + 0.5 * t([0.375, 0.75, -0.875, 0.25, 0.375]))
    assert torch.equal(merged, t([1.1875, 2.375, 2.5625, 4.125, 5.1875]))


def test_ties_density_one_is_sign_election_only():
    # nothing trimmed: entry 1 is [-0.25, 0.75, -0.125] -> + -> 0.75 alone (TA would give 0.375)
    merged = ties(BASE, EXPERTS, density=1.0, scaling=1.0)
    assert merged[1] == 2.75
    assert merged[3] == 4.0 + (0.25 + 0.0) / 1  # -0.125 disagrees with the elected +


def test_ties_exact_cancellation_merges_to_zero():
    a, b = t([0.5, 0.25]), t([-0.5, 0.25])
    assert torch.equal(disjoint_merge([a, b]), t([0.0, 0.25]))


def test_ties_threshold_ties_are_kept():
    tau = t([0.5, 0.25, 0.25, 0.125])  # k = 2, but two entries tie at the threshold 0.25
    merged = ties_from_task_vectors(torch.zeros(4), [tau], density=0.5, scaling=1.0)
    assert torch.equal(merged, t([0.5, 0.25, 0.25, 0.0]))


@pytest.mark.parametrize("n,d,k", [(5, 0.6, 3), (10, 0.3, 3), (10, 0.2, 2), (7, 0.01, 1), (4, 1.0, 4), (0, 0.5, 0)])
def test_keep_count(n, d, k):
    assert keep_count(n, d) == k


def test_bf16_expert_upcast_against_fp32_base():
    expert = (BASE + TAUS[0]).bfloat16()
    tau = task_vector(expert, BASE)
    assert tau.dtype == torch.float32 and torch.equal(tau, TAUS[0])
    assert task_vector(torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)).dtype == torch.float64


def _gens(seed, n):
    return [torch.Generator().manual_seed(derive_seed(seed, f"e{i}", "w")) for i in range(n)]


def test_dare_drops_and_rescales():
    tau = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    out = dare(tau, 0.75, torch.Generator().manual_seed(1))
    kept = out != 0
    assert torch.allclose(out[kept], tau[kept] * 4.0)
    assert abs(kept.float().mean().item() - 0.25) < 0.02
    assert dare(tau, 0.0, torch.Generator()) is tau


def test_dare_reproducible_and_seed_dependent():
    big = [BASE.repeat(40) + torch.randn(200, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    base = BASE.repeat(40)
    a = dare_ta(base, big, _gens(0, 3), drop_rate=0.5)
    assert torch.equal(a, dare_ta(base, big, _gens(0, 3), drop_rate=0.5))
    assert not torch.equal(a, dare_ta(base, big, _gens(1, 3), drop_rate=0.5))
    assert not torch.equal(a, task_arithmetic(base, big))


def test_dare_p0_equals_task_arithmetic_and_ties():
    assert torch.equal(dare_ta(BASE, EXPERTS, _gens(3, 3), drop_rate=0.0, scaling=0.5),
                       task_arithmetic(BASE, EXPERTS, scaling=0.5))
    assert torch.equal(dare_ties(BASE, EXPERTS, _gens(3, 3), drop_rate=0.0, density=0.6, scaling=0.5),
                       ties(BASE, EXPERTS, density=0.6, scaling=0.5))


def test_derive_seed_separates_experts_and_tensors():
    seeds = {derive_seed(0, "a", "w"), derive_seed(0, "b", "w"), derive_seed(0, "a", "v"), derive_seed(1, "a", "w")}
    assert len(seeds) == 4 and derive_seed(0, "a", "w") == derive_seed(0, "a", "w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_streaming_kth_largest_is_exact(dtype):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=g, dtype=dtype).abs() for n in (1, 300, 77, 1000)]
    parts += [torch.zeros(40, dtype=dtype), torch.full((25,), 0.5, dtype=dtype), torch.tensor([1e-30, 3e30], dtype=dtype)]
    every = torch.cat(parts)
    for k in (1, 2, 26, 700, every.numel()):
        sel = StreamingKthLargest(k, dtype)
        while not sel.done:
            for p in reversed(parts):
                sel.observe(p)
            sel.end_pass()
        assert sel.value == kth_largest(every, k)
    assert sel.passes == (2 if dtype == torch.float32 else 4)


def test_streaming_kth_largest_rejects_too_large_k():
    sel = StreamingKthLargest(5)
    sel.observe(torch.ones(3))
    with pytest.raises(ValueError, match="exceeds"):
        sel.end_pass()
