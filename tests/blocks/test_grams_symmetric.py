"""The symmetric Gram accumulation (featcal.blocks.grams) equals the plain product: block-upper triangle
batch by batch, symmetrised when read, for several widths (chunk counts that do and do not divide d), both
dtypes, weights with padding, merges of equal and of different layouts; and calibrate() with it forced on
a tiny model equals the dense reference and the plain path within float32 round-off."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.blocks import grams
from featcal.blocks.grams import GramSums, add_gram_, chunk_bounds, gram_chunks, symmetrised
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family, reference_calibrate


def _batches(d: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        x = (torch.randn(2, 37 + b, d, generator=g) + 0.3).to(dtype)
        w = torch.rand(2, 37 + b, generator=g).to(dtype)
        w[0, -3:] = 0  # padding
        out.append((x, w))
    return out


def _plain(batches, dtype):
    d = batches[0][0].shape[-1]
    sxx = torch.zeros(d, d, dtype=torch.float64)
    for x, w in batches:
        xf, wf = x.reshape(-1, d).double(), w.reshape(-1).double()
        sxx += (xf * wf[:, None]).T @ xf
    return sxx


@pytest.mark.parametrize("d,chunks", [(7, 3), (64, 2), (100, 3), (300, None), (384, None), (500, None), (768, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_symmetric_accumulation_equals_the_plain_product(d, chunks, dtype):
    batches = _batches(d, 3, dtype)
    g = GramSums.zeros(d, torch.device("cpu"), dtype)
    if chunks is not None:
        g.chunks = chunks
    assert g.chunks > 1  # the symmetric path, not the plain one
    for x, w in batches:
        g.add(x, w)
    _, _, c = g.means()
    plain = _plain(batches, dtype)
    expected = plain / g.sw.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(c, expected, rtol=tol, atol=tol * expected.abs().max().item())
    assert torch.equal(c, c.T)  # exactly symmetric once read
    # the held sums are only the block-upper triangle: the blocks below the diagonal were never written
    b = chunk_bounds(d, g.chunks)
    for lo, hi in zip(b[:-1], b[1:], strict=True):
        assert not g.sxx[hi:, lo:hi].any()
    assert torch.allclose(g.full_sxx().double(), plain, rtol=tol, atol=tol * plain.abs().max().item())


def test_chunk_count_and_bounds():
    assert gram_chunks(grams.SYM_MIN_D - 1) == 1
    assert all(gram_chunks(d) >= 2 for d in (384, 768, 1536, 3072))
    for d, k in [(7, 3), (768, 3), (1000, 7)]:
        b = chunk_bounds(d, k)
        assert b[0] == 0 and b[-1] == d and len(b) == k + 1
        widths = [hi - lo for lo, hi in zip(b[:-1], b[1:], strict=True)]
        assert max(widths) - min(widths) <= 1


def test_add_gram_and_symmetrised_on_their_own():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 11, generator=g)
    for k in (1, 2, 4, 11):
        sxx = torch.zeros(11, 11)
        add_gram_(sxx, x, x, k)
        assert torch.allclose(symmetrised(sxx, k), x.T @ x, rtol=1e-5, atol=1e-5)


def test_merges_of_equal_and_of_different_layouts():
    d = 300
    batches = _batches(d, 4, torch.float32, seed=1)
    a, b = GramSums.zeros(d, torch.device("cpu")), GramSums.zeros(d, torch.device("cpu"))
    for x, w in batches[:2]:
        a.add(x, w)
    for x, w in batches[2:]:
        b.add(x, w)
    plain = _plain(batches, torch.float32)
    same = GramSums(a.sw.clone(), a.sx.clone(), a.sxx.clone(), a.chunks)
    same.merge_(b)
    assert same.chunks == a.chunks > 1
    assert torch.allclose(same.full_sxx().double(), plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    full = GramSums(a.sw.clone(), a.sx.clone(), a.full_sxx())  # a full Gram (chunks 1) meets a triangular one
    full.merge_(b)
    assert full.chunks == 1
    assert torch.allclose(full.sxx.double(), plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    tri = GramSums(b.sw.clone(), b.sx.clone(), b.sxx.clone(), b.chunks)
    tri.merge_(GramSums(a.sw, a.sx, a.full_sxx()))
    assert tri.chunks == 1 and torch.allclose(tri.sxx, full.sxx, rtol=1e-6, atol=1e-6 * plain.abs().max().item())


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_calibrate_with_symmetric_grams_forced_on_equals_reference_and_plain(kind, monkeypatch, one_thread):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    plain = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    monkeypatch.setattr(grams, "SYM_MIN_D", 1)
    monkeypatch.setattr(grams, "SYM_CHUNK", 8)  # tiny widths 32 / 64: 4 / 8 chunks
    assert gram_chunks(32) == 4
    sym = calibrate(merged, base=base, experts=experts, calibration=data, progress=False).model
    assert max_abs_diff(sym, plain)[0] < 1e-5
    diff, where = max_abs_diff(sym, reference_calibrate(merged, base, experts, data, FeatCalConfig()))
    assert diff < 1e-5, f"{kind}: {where} differs by {diff}"
    assert max_abs_diff(sym, merged)[0] > 1e-3


@pytest.mark.parametrize("d,chunks", [(7, 1), (100, 3), (300, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_means_are_the_mirrored_widened_sums_exactly_and_leave_the_sums_alone(d, chunks, dtype):
    # means() widens, mirrors and scales in place on one new tensor (no in×in temporaries): bit for bit what
    # mirroring, widening and dividing out of place gives, and the sums it read are neither changed nor aliased
    g = GramSums.zeros(d, torch.device("cpu"), dtype)
    if chunks is not None:
        g.chunks = chunks
    for x, w in _batches(d, 2, dtype):
        g.add(x, w)
    held = g.sxx.clone()
    sw, mu, c = g.means()
    sw64 = g.sw.to(torch.float64)
    assert torch.equal(c, symmetrised(g.sxx, g.chunks).to(torch.float64) / sw64)
    assert torch.equal(mu, g.sx.to(torch.float64) / sw64)
    assert torch.equal(g.sxx, held) and c.data_ptr() != g.sxx.data_ptr()
    assert torch.equal(g.means()[2], c)
