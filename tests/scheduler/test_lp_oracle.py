"""LP placement oracle (K3_SYSTEMS §6.4) and the greedy planner's optimality gap on small cases."""

from __future__ import annotations

import numpy as np
import pytest

from moonrt.scheduler.lp import solve_placement
from moonrt.scheduler.moonep import plan


def _counts(seed: int, R: int, G: int, mode: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    E = R * G
    p = {"lognormal": lambda: rng.lognormal(0.0, 1.5, E),
         "zipf": lambda: rng.permutation(1.0 / np.arange(1, E + 1) ** 1.2),
         "one_expert": lambda: np.eye(E)[E - 1] + 1e-12}[mode]()
    return rng.multinomial(int(rng.integers(8, 40)) * 2, p / p.sum(), size=R).astype(np.int64)


def _check_solution(counts: np.ndarray, res, B: int, upper: int | None = None) -> None:
    R, E = counts.shape
    G = E // R
    assert res.alloc is not None and (res.alloc >= 0).all()
    np.testing.assert_array_equal(res.alloc.sum(1), counts.sum(0))
    total = int(counts.sum())
    if upper is None:
        cap = np.full(R, total // R)
        cap[: total % R] += 1
        np.testing.assert_array_equal(res.alloc.sum(0), cap)
    else:
        assert res.alloc.sum(0).max() <= upper
    home = np.arange(E) // G
    for r in range(R):
        assert res.copies[r] == sorted(e for e in range(E) if home[e] != r and res.alloc[e, r] > 0)
        assert len(res.copies[r]) <= B
    assert res.num_copies == sum(len(c) for c in res.copies)


CASES = [(seed, R, G, mode) for seed, (R, G) in enumerate([(2, 3), (3, 2), (3, 4), (4, 2), (4, 4), (5, 2)])
         for mode in ("lognormal", "zipf", "one_expert")]


@pytest.mark.parametrize("seed,R,G,mode", CASES)
def test_greedy_vs_optimum(seed: int, R: int, G: int, mode: str) -> None:
    counts = _counts(seed, R, G, mode)
    greedy = plan(counts)
    res = solve_placement(counts, time_limit=60)
    assert res.status == "optimal", res
    assert res.bound == res.num_copies
    _check_solution(counts, res, G)
    g = greedy.num_copies()
    # The greedy is a feasible point of the same model, so it is never better than the optimum.
    assert g >= res.num_copies
    # Theorem bound (§6.2): <= E/R copies per rank, and per donor group <= receivers + G - 1 copies,
    # so in total <= receivers + donors * (G - 1). Every initial deficit rank needs >= 1 copy.
    assert greedy.copies_per_rank().max() <= G
    receivers = int((greedy.donor >= 0).sum())
    donors = len({int(d) for d in greedy.donor if d >= 0})
    assert g <= receivers + donors * (G - 1)
    cap = greedy.capacity
    deficit = int((counts.sum(0).reshape(R, G).sum(1) < cap).sum())
    assert res.num_copies >= deficit
    # With the greedy's own structure (one home group per rank) the optimum can only grow.
    one = solve_placement(counts, one_group=True, time_limit=60)
    assert one.status == "optimal" and res.num_copies <= one.num_copies <= g


def test_bounded_imbalance_needs_fewer_copies() -> None:
    counts = _counts(11, 4, 4, "lognormal")
    exact = solve_placement(counts, time_limit=60)
    loose = solve_placement(counts, imbalance=0.1, time_limit=60)
    assert exact.status == loose.status == "optimal"
    upper = int(np.floor(1.1 * counts.sum() / 4))
    _check_solution(counts, loose, 4, upper=upper)
    assert loose.num_copies <= exact.num_copies
    huge = solve_placement(counts, imbalance=100.0, time_limit=60)
    assert huge.num_copies == 0  # everything may stay home


def test_infeasible_without_slots() -> None:
    counts = np.zeros((4, 8), np.int64)
    counts[:, 0] = 6
    res = solve_placement(counts, num_slots=0, time_limit=30)
    assert res.status == "infeasible" and res.alloc is None and res.num_copies is None


def test_cbc_fallback_agrees() -> None:
    counts = _counts(4, 3, 3, "zipf")
    a = solve_placement(counts, solver="HiGHS", time_limit=60)
    b = solve_placement(counts, solver="PULP_CBC_CMD", time_limit=60)
    assert a.solver == "HiGHS" and b.solver == "PULP_CBC_CMD"
    assert a.status == b.status == "optimal" and a.num_copies == b.num_copies
    _check_solution(counts, b, 3)


def test_time_limit_is_not_reported_optimal() -> None:
    """A solve stopped by its time limit is never called optimal (PuLP itself reports it as optimal)."""
    rng = np.random.default_rng(1)
    p = rng.lognormal(0, 2, 64)
    counts = rng.multinomial(400, p / p.sum(), size=8)
    res = solve_placement(counts, time_limit=0.05)
    assert res.raw_status == "kTimeLimit"  # this instance needs ~1 s to prove optimality
    assert res.status in ("feasible", "not_solved")
    if res.status == "feasible":
        _check_solution(counts, res, 8)


def test_bad_arguments() -> None:
    ok = np.full((2, 4), 2, np.int64)
    with pytest.raises(ValueError, match="imbalance: -0.1"):
        solve_placement(ok, imbalance=-0.1)
    with pytest.raises(ValueError, match="time_limit: 0"):
        solve_placement(ok, time_limit=0)
    with pytest.raises(ValueError, match="solver: 'GUROBI'"):
        solve_placement(ok, solver="GUROBI")
    with pytest.raises(ValueError, match="not divisible"):
        solve_placement(np.ones((3, 4), np.int64))
