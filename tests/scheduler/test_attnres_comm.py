"""Cache-based Block AttnRes communication plan (K3_SYSTEMS §9): aligned counts equal
the closed forms, unaligned splits, V placement, each block held once per rank, bad input."""

from __future__ import annotations

import pytest

from moonrt.scheduler.attnres_comm import even_layer_ranges, hop_plan, produced_blocks
from moonrt.scheduler.pipeline import build_schedule


def _aligned(p: int, v: int, n_p: int, b: int) -> list[range]:
    c = p * v
    return [range(s * n_p * b, (s + 1) * n_p * b) for s in range(c)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("n_p,b", [(1, 1), (2, 3), (3, 2)])
def test_aligned_counts_equal_formulas(p, v, n_p, b):
    c = p * v
    rng = _aligned(p, v, n_p, b)
    naive = hop_plan(rng, b, lambda s: s % p, "naive")
    cached = hop_plan(rng, b, lambda s: s % p, "cached")
    if p == 1:  # every hop is local: nothing crosses
        assert naive.total == cached.total == 0
        return
    assert naive.total == n_p * c * (c - 1) // 2 + (c - 1)
    assert naive.max_hop == (c - 1) * n_p + 1
    assert cached.total == n_p * p * (p - 1) // 2 + (p - 1) + (v - 1) * p * (p - 1) * n_p
    assert cached.max_hop == (p - 1) * n_p + 1
    assert not any(naive.partial) and not any(cached.partial)  # cuts on block boundaries
    # every later-round hop carries exactly the P - 1 chunks produced since the receiver's last chunk
    assert all(len(s) == (p - 1) * n_p for s in cached.sends[p:])


def test_report_example():
    """P = 4, V = 2, N_p = 2: naive 63 blocks (largest hop 15), cached 39 (largest 7)."""
    rng = _aligned(4, 2, 2, 12)
    assert (hop_plan(rng, 12, lambda s: s % 4, "naive").total, hop_plan(rng, 12, lambda s: s % 4).total) == (63, 39)


def _receipts(plan, rank_of, n_stages):
    got: dict[int, list[int]] = {}
    for s, blocks in enumerate(plan.sends):
        got.setdefault(rank_of(s + 1), []).extend(blocks)
    return got


@pytest.mark.parametrize("layers,b,stages,p", [(93, 12, 16, 8), (93, 12, 8, 4), (9, 4, 4, 2), (10, 3, 6, 3),
                                               (93, 12, 32, 16), (7, 2, 7, 7)])
def test_unaligned_each_block_held_once(layers, b, stages, p):
    """Any split: a rank never receives a block it holds (produced or received) -> each held once; the
    cached hops carry the completed blocks minus what the receiver holds; partial flags at cuts inside a
    block; every block a later stage needs is on its rank before it runs."""
    rng = even_layer_ranges(layers, stages)
    rank_of = lambda s: s % p  # noqa: E731
    plan = hop_plan(rng, b, rank_of, "cached")
    naive = hop_plan(rng, b, rank_of, "naive")
    produced = produced_blocks(rng, b)
    assert sorted(x for pr in produced for x in pr) == list(range(-(-layers // b) + 1))
    own = {r: [x for s in range(stages) if rank_of(s) == r for x in produced[s]] for r in range(p)}
    for r, recv in _receipts(plan, rank_of, stages).items():
        mine = own[r] + recv
        assert len(mine) == len(set(mine)), f"rank {r} holds a block twice"
        assert set(mine) == plan.held[r]
    held: dict[int, set[int]] = {}
    done: set[int] = set()
    for s in range(stages):
        r = rank_of(s)
        assert done <= held.setdefault(r, set()) | set(), f"stage {s} on rank {r} lacks {done - held[r]}"
        held[r] |= set(produced[s])
        done |= set(produced[s])
        if s < stages - 1:
            held.setdefault(rank_of(s + 1), set()).update(plan.sends[s])
            last = rng[s][-1]
            assert plan.partial[s] == ((last + 1) % b != 0)
            assert set(naive.sends[s]) == done
    assert plan.total <= naive.total and plan.max_hop <= naive.max_hop


def test_v_placement_local_hops_and_bytes():
    sch = build_schedule("zbv", 4, 8, vpp=2)
    rng = _aligned(4, 2, 1, 2)
    plan = hop_plan(rng, 2, sch.rank_of)
    assert plan.remote == tuple(s != 3 for s in range(7))  # stages 3 -> 4 on the same rank
    assert plan.sends[3] == () and not plan.partial[3]
    # the V returns to rank 2, which holds blocks 0..2 (received) and 3 (its own): sends 4 and 5
    assert plan.sends[4] == (4, 5)
    assert plan.bytes_per_hop(10.0)[4] == 20.0 and plan.bytes_per_hop(10.0)[3] == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match=r"layer_ranges\[1\] = range\(5, 8\): expected a non-empty contiguous"):
        hop_plan([range(0, 4), range(5, 8)], 2, lambda s: s)
    with pytest.raises(ValueError, match="mode = 'all'"):
        hop_plan([range(0, 4)], 2, lambda s: s, "all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size = 0"):
        hop_plan([range(0, 4)], 0, lambda s: s)
    with pytest.raises(ValueError, match=r"stages = 10: expected 1 <= stages <= num_layers \(9\)"):
        even_layer_ranges(9, 10)
