"""`all_finite`: the one-pass finite test the scans use (a finite sum proves every element finite)."""

from __future__ import annotations

import pytest
import torch

from featcal.io.read.validate import all_finite, first_non_finite, non_finite_count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_finite_and_non_finite_tensors(dtype):
    t = torch.randn(64, 33).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[17, 5] = bad
        assert not all_finite(u)
        assert non_finite_count(u) == 1
    both = t.clone()
    both[0, 0], both[1, 1] = float("inf"), float("-inf")  # their sum is NaN, still caught
    assert not all_finite(both)


def test_finite_values_whose_sum_overflows_are_finite():
    # the fast sum overflows to inf; the exact test must then clear the tensor
    big = torch.full((8,), 3.0e38, dtype=torch.float32)
    assert not torch.isfinite(big.sum())
    assert all_finite(big)
    half = torch.full((64,), 60000.0, dtype=torch.float16)  # sums past fp16's max, not past float32's
    assert all_finite(half)


def test_float8_is_checked():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    t = torch.randn(16).to(torch.float8_e4m3fn)
    assert all_finite(t)
    u = torch.randn(16)
    u[3] = float("nan")
    assert not all_finite(u.to(torch.float8_e4m3fn))


def test_first_non_finite_names_the_first_bad_tensor_and_counts():
    a, b, c = torch.ones(4), torch.ones(4), torch.ones(4)
    b[1] = b[2] = float("nan")
    c[0] = float("inf")
    assert first_non_finite([("a", a), ("b", b), ("c", c)]) == ("b", 2)
    assert first_non_finite([("a", a), ("i", torch.arange(3))]) is None
