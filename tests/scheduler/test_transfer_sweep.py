"""The O(R·E) sweep transfer matrix equals the old [R_src, E, R_dst] broadcast on random plans."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler.helpers import MODES, make_counts

from moonrt.scheduler.moonep import plan, transfer_matrix


def broadcast_transfer_matrix(counts: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """The previous implementation, kept as the reference: ``[R_src, R_dst]`` int64 through an
    ``[R_src, E, R_dst]`` temporary (O(R²·E) time and memory)."""
    c = np.asarray(counts, dtype=np.int64)
    cuts = np.asarray(cuts)
    start = np.zeros_like(c)
    np.cumsum(c[:-1], axis=0, out=start[1:])  # [R, E] exclusive prefix over sources
    lo = np.maximum(cuts[None, :, :-1], start[:, :, None])  # [R_src, E, R_dst]
    hi = np.minimum(cuts[None, :, 1:], (start + c)[:, :, None])
    return np.maximum(hi - lo, 0).sum(1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), R=st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32]), G=st.integers(1, 7),
       mode=st.sampled_from(MODES), equal=st.booleans())
def test_sweep_equals_broadcast_on_random_plans(seed: int, R: int, G: int, mode: str, equal: bool) -> None:
    counts = make_counts(np.random.default_rng(seed), R, G, mode, equal=equal)
    total = int(counts.sum())
    k = 1  # unequal rows: any integer top-k works with total_tokens = total / k
    p = plan(counts, total_tokens=None if equal else total // k)
    got = transfer_matrix(counts, p.cuts)
    np.testing.assert_array_equal(got, broadcast_transfer_matrix(counts, p.cuts))
    assert got.dtype == np.int64 and got.shape == (R, R)
    np.testing.assert_array_equal(got.sum(1), counts.sum(1))  # every assignment leaves its source once
    np.testing.assert_array_equal(got.sum(0), p.alloc.sum(0))  # and arrives where the plan computes it


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), R=st.integers(1, 9), E=st.integers(1, 12))
def test_sweep_equals_broadcast_on_arbitrary_cuts(seed: int, R: int, E: int) -> None:
    """Not only planner output: any per-expert partition of the load into R destination ranges."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (R, E)) * (rng.random((R, E)) < 0.7)
    load = counts.sum(0)
    cuts = np.zeros((E, R + 1), np.int64)
    for e in range(E):
        inner = np.sort(rng.integers(0, load[e] + 1, R - 1))
        cuts[e, 1:R] = inner
        cuts[e, R] = load[e]
    np.testing.assert_array_equal(transfer_matrix(counts, cuts), broadcast_transfer_matrix(counts, cuts))


def test_sweep_refuses_mismatched_cuts() -> None:
    with pytest.raises(ValueError, match=r"cuts: shape \(3, 4\), expected \[E, R \+ 1\]"):
        transfer_matrix(np.ones((2, 4), np.int64), np.zeros((3, 4), np.int64))
