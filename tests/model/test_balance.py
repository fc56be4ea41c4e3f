"""Quantile Balancing: exact form and histogram estimator (K3_SYSTEMS §5.3, report Eq. 12-14)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonrt.models.k3.model.balance import (
    MarginHistogram,
    expert_loads,
    maxvio,
    qb_bias_exact,
    qb_bias_from_margins,
    qb_margins,
    target_load,
)

# 8 tokens x 4 experts, k = 1, bias 0: tokens 0-3 pick E1, 4-6 pick E2, 7 picks E3, none E4.
EXAMPLE_SCORES = torch.tensor([
    [0.60, 0.54, 0.21, 0.43],
    [0.66, 0.38, 0.35, 0.07],
    [0.89, 0.56, 0.82, 0.32],
    [0.87, 0.70, 0.38, 0.32],
    [0.70, 0.83, 0.64, 0.32],
    [0.41, 0.89, 0.09, 0.13],
    [0.76, 0.77, 0.34, 0.61],
    [0.32, 0.85, 0.86, 0.60],
], dtype=torch.float64)


def test_report_example_4310_to_2222():
    bias = torch.zeros(4, dtype=torch.float64)
    assert expert_loads(EXAMPLE_SCORES, bias, 1).tolist() == [4, 3, 1, 0]
    assert maxvio(expert_loads(EXAMPLE_SCORES, bias, 1)) == pytest.approx(1.0)
    raw = qb_bias_exact(EXAMPLE_SCORES, bias, 1, center=False).double()
    # thresholds a_i = second-largest score; E1's margins sorted: .28 .17 .07 .06 0 0 0 -.53 -> q+1 = 3rd = .07
    torch.testing.assert_close(raw, torch.tensor([-0.07, -0.01, 0.03, 0.25], dtype=torch.float64), atol=1e-6, rtol=0)
    new = qb_bias_exact(EXAMPLE_SCORES, bias, 1).double()
    torch.testing.assert_close(new, raw - raw.mean(), atol=1e-6, rtol=0)
    assert abs(new.sum().item()) < 1e-6
    assert raw[0] < 0 and raw[1] < 0 and raw[2] > 0 and raw[3] > 0  # hot experts pushed down, cold up
    assert expert_loads(EXAMPLE_SCORES, new, 1).tolist() == [2, 2, 2, 2]
    assert maxvio(expert_loads(EXAMPLE_SCORES, new, 1)) == 0.0


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(2, 12), k_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       bias_scale=st.sampled_from([0.0, 0.05, 0.5]))
def test_exact_update_hits_target_with_fixed_thresholds(m, n, k_frac, seed, bias_scale):
    """Eq. 13-14: with the thresholds a_i fixed, expert j gets #{i: m_ij > -b_j} = floor(m k / n) tokens.

    Scores are continuous random values, so no two scores and no two score differences tie (with
    probability 1). The only margin ties left are structural: each token's (k+1)-th expert j has margin
    ``-bias_j``. Where such a tie sits at the cut the count falls short; ``>=`` always counts >= q + 1.
    """
    k = 1 + int(k_frac * (n - 2))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(m, n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    assert scores.unique().numel() == m * n
    bias = torch.randn(n, generator=g, dtype=torch.float64) * bias_scale
    q = target_load(m, n, k)
    assert q == m * k // n and abs(q - m * k / n) < 1
    margins = qb_margins(scores, bias, k)
    assert margins.dtype == torch.float64
    raw = qb_bias_from_margins(margins, k, center=False).double()
    torch.testing.assert_close(raw, qb_bias_exact(scores, bias, k, center=False).double())
    counts = (margins > -raw).sum(0)
    counts_ge = (margins >= -raw).sum(0)
    assert (counts <= q).all() and (counts_ge >= q + 1).all()
    top = margins.sort(0, descending=True).values
    untied = top[q] != top[q - 1] if q > 0 else torch.ones(n, dtype=torch.bool)
    # tie-free at the cut -> exactly the target load
    assert (counts[untied] == q).all()
    # a tie at the cut is the structural margin -bias_j
    for j in (~untied).nonzero().flatten().tolist():
        assert abs(top[q, j] + bias[j]) < 1e-12
    # centering is a common shift (changes no top-k) to zero mean
    centered = qb_bias_exact(scores, bias, k).double()
    torch.testing.assert_close(centered, raw - raw.mean(), atol=1e-6, rtol=0)
    assert abs(centered.sum().item()) < 1e-5


def test_repeated_exact_updates_balance_a_skewed_batch():
    g = torch.Generator().manual_seed(0)
    m, n, k = 512, 16, 2
    scores = torch.sigmoid(torch.randn(m, n, generator=g, dtype=torch.float64)
                           + torch.linspace(-2, 2, n, dtype=torch.float64))
    bias = torch.zeros(n, dtype=torch.float64)
    start = maxvio(expert_loads(scores, bias, k))
    for _ in range(8):
        bias = qb_bias_exact(scores, bias, k).double()
    end = maxvio(expert_loads(scores, bias, k))
    assert start > 2.0 and end < 0.1


@pytest.mark.parametrize("seed,bins,m,n,k", [(0, 512, 300, 8, 2), (1, 64, 1000, 16, 3), (2, 17, 50, 5, 1),
                                            (3, 200, 2000, 32, 4)])
def test_histogram_within_one_bin_of_exact(seed, bins, m, n, k):
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(m, n, generator=g) * 2 + torch.randn(n, generator=g))
    bias = torch.randn(n, generator=g) * 0.1
    margins = qb_margins(scores, bias, k)
    assert margins.abs().max() < 1.25  # data inside the histogram range
    hist = MarginHistogram(n, bins=bins, lo=-1.25, hi=1.25)
    # accumulate in uneven micro-batches
    for chunk in margins.split([m // 3, m // 5, m - m // 3 - m // 5]):
        hist.add(chunk)
    assert hist.num_tokens == m and int(hist.counts.sum()) == m * n
    exact_raw = qb_bias_from_margins(margins, k, center=False)
    est_raw = hist.bias(k, center=False)
    w = hist.bin_width
    assert (est_raw - exact_raw).abs().max() <= w + 1e-6
    # centered: both subtract their mean, so the error is at most twice the bin width
    assert (hist.bias(k) - qb_bias_from_margins(margins, k)).abs().max() <= 2 * w + 1e-6
    # and the estimate is not trivially coarse: finer bins -> smaller error
    fine = MarginHistogram(n, bins=bins * 8, lo=-1.25, hi=1.25)
    fine.add(margins)
    assert (fine.bias(k, center=False) - exact_raw).abs().max() <= w / 8 + 1e-6


def test_histogram_sums_across_ranks_like_one_big_batch():
    """Summing per-rank histograms (what the all-reduce does) equals the histogram of all margins."""
    g = torch.Generator().manual_seed(5)
    n, k = 8, 2
    parts = [qb_margins(torch.rand(64, n, generator=g), torch.zeros(n), k) for _ in range(3)]
    ranks = [MarginHistogram(n, bins=128) for _ in parts]
    for h, p in zip(ranks, parts):
        h.add(p)
    total = torch.stack([h.counts for h in ranks]).sum(0)

    def fake_all_reduce(t: torch.Tensor) -> None:
        t.copy_(total)

    ranks[0].all_reduce(fake_all_reduce)
    whole = MarginHistogram(n, bins=128)
    whole.add(torch.cat(parts))
    assert torch.equal(ranks[0].counts, whole.counts)
    torch.testing.assert_close(ranks[0].bias(k), whole.bias(k))
    ranks[0].reset()
    assert ranks[0].num_tokens == 0


def test_histogram_clamps_out_of_range_and_bad_input():
    h = MarginHistogram(3, bins=4, lo=-1.0, hi=1.0)
    h.add(torch.tensor([[-5.0, 0.1, 7.0]]))
    assert h.counts.tolist() == [[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="margins"):
        h.add(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="k = 3"):
        h.bias(3)
    with pytest.raises(ValueError, match="no margins"):
        MarginHistogram(3).bias(1)
    with pytest.raises(ValueError, match="bins"):
        MarginHistogram(3, bins=0)
    with pytest.raises(ValueError, match="lo < hi"):
        MarginHistogram(3, lo=1.0, hi=1.0)
    with pytest.raises(ValueError, match="bias"):
        qb_bias_exact(torch.zeros(4, 3), torch.zeros(4), 1)
    with pytest.raises(ValueError, match="k = 3"):
        qb_bias_exact(torch.zeros(4, 3), torch.zeros(3), 3)
