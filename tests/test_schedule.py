"""Pipeline schedules as per-rank action lists: deadlock-free simulation and in-flight counts
(K3_SYSTEMS §8: 1F1B holds pp - r; interleaved 1 + (pp-1)/(pp*v) times pp on rank 0; GPipe all)."""

from __future__ import annotations

import pytest

from moonrt.scheduler.pipeline import build_schedule, in_flight, simulate


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 8), (8, 16), (4, 2)])
def test_1f1b_in_flight_is_pp_minus_rank(pp, m):
    sch = build_schedule("1f1b", pp, m)
    simulate(sch)
    for r in range(pp):
        assert in_flight(sch, r) == (min(pp - r, m), min(pp - r, m))


@pytest.mark.parametrize("pp,v,m", [(8, 2, 16), (4, 2, 8), (4, 3, 12), (16, 4, 32), (2, 2, 4)])
def test_interleaved_factor_reproduced(pp, v, m):
    sch = build_schedule("interleaved", pp, m, vpp=v)
    simulate(sch)  # deadlock-free
    _, rank0 = in_flight(sch, 0)
    assert rank0 == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    for r in range(pp):
        chunks, _ = in_flight(sch, r)
        assert chunks == 2 * (pp - r - 1) + (v - 1) * pp + 1
    if (pp, v) == (8, 2):
        assert (rank0, in_flight(sch, 7)[1]) == (11.5, 4.5)  # the report's example


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 6)])
def test_gpipe_holds_all(pp, m):
    sch = build_schedule("gpipe", pp, m)
    simulate(sch)
    assert all(in_flight(sch, r) == (m, m) for r in range(pp))


def test_every_action_once_and_bubbles_ordered():
    for kind, v in (("1f1b", 1), ("interleaved", 2), ("gpipe", 1)):
        sch = build_schedule(kind, 4, 8, vpp=v)
        for acts in sch.actions:
            assert sorted((a.op, a.microbatch, a.chunk) for a in acts) == sorted(
                (op, i, c) for op in "FB" for i in range(8) for c in range(v))
    b1 = simulate(build_schedule("1f1b", 4, 8)).bubble(build_schedule("1f1b", 4, 8))
    bi = simulate(build_schedule("interleaved", 4, 8, vpp=2)).bubble(build_schedule("interleaved", 4, 8, vpp=2))
    assert bi < b1  # interleaving shrinks the bubble


def test_deadlock_detected_and_bad_input():
    from moonrt.scheduler.pipeline import Action, Schedule

    bad = Schedule("custom", 2, 1, 1, ((Action("B", 0), Action("F", 0)), (Action("F", 0), Action("B", 0))))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)
    with pytest.raises(ValueError, match="schedule = 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="microbatches = 6: expected a multiple of pp"):
        build_schedule("interleaved", 4, 6, vpp=2)
    with pytest.raises(ValueError, match="pp = 0"):
        build_schedule("1f1b", 0, 4)
