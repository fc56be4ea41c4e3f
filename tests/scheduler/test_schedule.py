"""Pipeline schedule IR: generators x lowering x validator x simulator on a grid, the known
bubble and in-flight formulas (K3_SYSTEMS §8, §9), and a validator that names the rank of a broken order."""

from __future__ import annotations

import dataclasses

import pytest

from moonrt.scheduler.pipeline import (
    OPS,
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    in_flight,
    lower,
    simulate,
    validate,
)

GRID = [(p, v, m) for p in range(1, 9) for v in range(1, 5) for m in range(p, 4 * p + 1)]


def _kinds(v: int) -> list[str]:
    return {1: ["gpipe", "1f1b", "zb"], 2: ["interleaved", "zb", "zbv"]}.get(v, ["interleaved", "zb"])


def _buildable(kind: str, p: int, v: int, m: int) -> bool:
    return not ((kind == "interleaved" or (kind == "zb" and v > 1)) and m % p)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 9))
def test_grid_generators_validate_simulate(p):
    """Every generator on P 1-8, V 1-4, M P..4P: each compute action exactly once, lowered order valid,
    1F1B bubble == (P-1)/(M+P-1), interleaved and zero-bubble strictly below it (P > 1), peak live per
    rank == 1F1B's P - r and Megatron's interleaved warm-up + 1."""
    for _, v, m in (g for g in GRID if g[0] == p):
        one_f1b = (p - 1) / (m + p - 1)
        for kind in _kinds(v):
            if not _buildable(kind, p, v, m):
                continue
            sch = build_schedule(kind, p, m, v)
            split = kind in ("zb", "zbv")
            for r, acts in enumerate(sch.actions):
                want = sorted((op, i, c) for op in ("FIW" if split else "FB") for i in range(m) for c in range(v))
                assert sorted((a.op, a.microbatch, a.chunk) for a in acts) == want, (kind, p, v, m, r)
            low = validate(sch)
            assert low == lower(sch) and (low.lowered or p == 1)
            sim = simulate(sch)
            if kind == "1f1b":
                assert sim.bubble_fraction == pytest.approx(one_f1b, abs=1e-12)
                assert sim.peak_live == tuple(min(p - r, m) for r in range(p))
            elif kind == "gpipe":
                assert sim.peak_live == (m,) * p
            elif p > 1 and kind != "gpipe":
                assert sim.bubble_fraction < one_f1b - 1e-9, (kind, p, v, m, sim.bubble_fraction)
            if kind == "interleaved":
                assert sim.peak_live == tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))
            if kind == "zb" and v == 1:  # ZB1P keeps 1F1B's peak of the first rank: P on every rank
                assert sim.peak_live == tuple(min(p, m) for _ in range(p))
                assert sim.makespan == 3 * m + (p - 1)  # idle P - 1 per rank, 1F1B: 3 (P - 1)


def test_megatron_numbers_and_in_flight_from_simulator():
    """pp = 8, vpp = 2: 23 chunks (11.5 micro-batches) live on rank 0 vs 9 (4.5) on the last (§9)."""
    sch = build_schedule("interleaved", 8, 16, vpp=2)
    sim = simulate(sch)
    assert (sim.peak_live[0], sim.peak_live[7]) == (23, 9)
    assert in_flight(sch, 0) == (23, 11.5) and in_flight(sch, 7) == (9, 4.5)
    assert in_flight(sch, 0)[1] == pytest.approx(8 * (1 + 7 / 16))
    sch = build_schedule("1f1b", 4, 2)
    assert [in_flight(sch, r) for r in range(4)] == [(2, 2), (2, 2), (2, 2), (1, 1)]


def test_bubble_ordering_and_costs():
    """Interleaving and zero bubble shrink the 1F1B bubble; ZBV is zero-bubble in steady state with
    F = I = W; with B = I + W the 1F1B formula holds for any F/B costs ratio 1:2 and 1:1."""
    b = {k: simulate(build_schedule(k, 4, 16, v)).bubble_fraction
         for k, v in (("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2), ("zbv", 2))}
    assert b["zbv"] <= b["zb"] < b["1f1b"] and b["interleaved"] < b["1f1b"]
    unit = simulate(build_schedule("1f1b", 4, 8), costs={"B": 1.0})
    assert unit.bubble_fraction == pytest.approx(3 / 11) and unit.makespan == 2 * (8 + 3)


def test_placement_and_lowering():
    zbv = build_schedule("zbv", 4, 8, vpp=2)
    assert [zbv.stage(0, 0), zbv.stage(0, 1), zbv.stage(3, 0), zbv.stage(3, 1)] == [0, 7, 3, 4]
    assert all(zbv.rank_of(zbv.stage(r, c)) == r and zbv.chunk_of(zbv.stage(r, c)) == c
               for r in range(4) for c in range(2))
    il = build_schedule("interleaved", 4, 8, vpp=2)
    assert il.num_stages == 8 and il.stage(1, 1) == 5 and il.rank_of(5) == 1
    low = lower(zbv)
    # stages 3 and 4 share rank 3 (the V's tip): no comm there; rank 0 sends F only from stage 0
    assert not any(a.op in ("SEND_F", "RECV_B") and a.chunk == 0 for a in low.actions[3])
    assert not any(a.op == "SEND_F" and a.chunk == 1 for a in low.actions[0])
    assert lower(low) == low  # idempotent
    one = lower(build_schedule("1f1b", 2, 2)).actions
    assert [str(a) for a in one[0]] == ["F0.0", "SEND_F0.0", "F1.0", "SEND_F1.0", "RECV_B0.0", "B0.0",
                                        "RECV_B1.0", "B1.0"]
    assert [str(a) for a in one[1]] == ["RECV_F0.0", "F0.0", "B0.0", "SEND_B0.0", "RECV_F1.0", "F1.0",
                                        "B1.0", "SEND_B1.0"]


def _edit(sch: Schedule, rank: int, acts: list[Action]) -> Schedule:
    new = list(sch.actions)
    new[rank] = tuple(acts)
    return dataclasses.replace(sch, actions=tuple(new))


def test_validator_rejects_broken_orders_naming_the_rank():
    low = lower(build_schedule("1f1b", 2, 2))
    r1 = list(low.actions[1])
    # B before its F on rank 1
    with pytest.raises(ValueError, match=r"rank 1: B0\.0 \(stage 1, micro-batch 0\) runs before its F"):
        validate(_edit(low, 1, [r1[0], r1[2], r1[1]] + r1[3:]))
    # swapped receive: rank 1 runs F0 before receiving its input
    with pytest.raises(ValueError, match=r"rank 1: F0\.0 .* runs before its RECV_F"):
        validate(_edit(low, 1, [r1[1], r1[0]] + r1[2:]))
    # missing send on rank 0: rank 1's RECV_F1 has no partner, the error names the sender
    r0 = [a for a in low.actions[0] if str(a) != "SEND_F1.0"]
    with pytest.raises(ValueError, match=r"rank 0: missing SEND_F1\.0 matching rank 1's RECV_F"):
        validate(_edit(low, 0, r0))
    # a cycle: rank 0 waits for the gradient of micro-batch 0 before sending its activations
    r0 = list(low.actions[0])
    cyc = [r0[0], r0[4], r0[1], r0[2], r0[3]] + r0[5:]  # F0, RECV_B0, SEND_F0, ...
    with pytest.raises(ValueError, match=r"deadlocks: rank 0 waits at RECV_B0\.0 .* for rank 1's SEND_B0\.0"):
        validate(_edit(low, 0, cyc))
    # a missing compute action
    with pytest.raises(ValueError, match=r"rank 1: missing the backward"):
        validate(_edit(low, 1, [a for a in r1 if str(a) not in ("B1.0", "SEND_B1.0")]))
    # W before its I (zero bubble)
    zb = build_schedule("zb", 2, 2)
    z0 = list(zb.actions[0])
    wi = next(i for i, a in enumerate(z0) if a.op == "W")
    ii = next(i for i, a in enumerate(z0) if a.op == "I" and a.microbatch == z0[wi].microbatch)
    z0[wi], z0[ii] = z0[ii], z0[wi]
    with pytest.raises(ValueError, match=r"rank 0: W\d\.0 .* runs before its I"):
        validate(_edit(zb, 0, z0))


@pytest.mark.parametrize("kind,p,m,v,msg", [
    ("nope", 2, 4, 1, r"schedule = 'nope': expected one of gpipe, 1f1b, interleaved, zb, zbv"),
    ("interleaved", 4, 2, 2, r"microbatches = 2: expected >= pp \(4\)"),
    ("interleaved", 4, 6, 2, r"microbatches = 6: expected a multiple of pp \(4\)"),
    ("interleaved", 4, 8, 1, r"vpp = 1: expected >= 2 for schedule 'interleaved'"),
    ("gpipe", 2, 4, 2, r"vpp = 2: expected 1 for schedule 'gpipe'"),
    ("1f1b", 2, 4, 2, r"vpp = 2: expected 1 for schedule '1f1b'"),
    ("zbv", 2, 4, 3, r"vpp = 3: expected 2 for schedule 'zbv'"),
    ("1f1b", 0, 4, 1, r"pp = 0: expected an integer >= 1"),
])
def test_bad_input(kind, p, m, v, msg):
    with pytest.raises(ValueError, match=msg):
        build_schedule(kind, p, m, v)


def test_names():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb", "zbv")
    assert build_schedule("zb1p", 2, 2).kind == "zb"


# ---- cross-check against torch.distributed.pipelining's orders (no process group) ---------------------
# The schedule classes only read num_stages / group_size / group_rank / stage_index of their stages to build
# `pipeline_order` (compute only, None = idle slot) and `pipeline_order_with_comms` (lowered), so stand-in
# stage objects suffice.


def _torch_order(cls_name: str, p: int, v: int, m: int, comms: bool = False) -> Schedule:
    import logging
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, cls_name)
    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=c * p, submod=None,
                              is_first=c == 0, is_last=c == v - 1) for c in range(v)]
    logging.getLogger(ts.__name__).setLevel(logging.ERROR)
    t = cls(stages, m)
    order = t.pipeline_order_with_comms if comms else t.pipeline_order
    placement = "v" if cls_name == "ScheduleZBVZeroBubble" else "loop"
    shell = Schedule("torch", p, v, m, tuple(() for _ in range(p)), placement)
    acts = []
    for r in range(p):
        seq = []
        for a in order[r]:
            if a is None or a.computation_type.value not in OPS:
                continue  # idle slots, UNSHARD / RESHARD / REDUCE_GRAD
            assert shell.rank_of(a.stage_index) == r
            seq.append(Action(a.computation_type.value, a.microbatch_index, shell.chunk_of(a.stage_index)))
        acts.append(tuple(seq))
    return dataclasses.replace(shell, actions=tuple(acts))


TORCH_GRID = [(p, v, m) for p in (1, 2, 3, 4, 8) for v in (1, 2, 3, 4) for m in sorted({p, 2 * p, 3 * p, 4 * p})]


@pytest.mark.parametrize("kind,cls_name", [("interleaved", "ScheduleInterleaved1F1B"),
                                           ("zb", "ScheduleInterleavedZeroBubble"),
                                           ("zbv", "ScheduleZBVZeroBubble")])
def test_orders_equal_torch_pipelining(kind, cls_name):
    """Our compute orders equal torch's `pipeline_order` (idle slots dropped) wherever both are defined:
    interleaved 1F1B (Megatron's warm-up 2 (P-r-1) + (V-1) P), interleaved zero bubble (ZB1P: warm-up
    (P-r-1) + (V-1) P, rank r defers r W passes) and ZB-V (V placement, built for max(M, 2P-1) micro-
    batches and cut back). torch's lowered orders (`pipeline_order_with_comms`, receives posted early) also
    pass our validator under blocking-receive semantics. We found no torch order on this grid that our
    validator rejects."""
    n = 0
    for p, v, m in TORCH_GRID:
        if (kind == "interleaved" and v < 2) or (kind == "zbv" and v != 2):
            continue
        mine = build_schedule(kind, p, m, v)
        theirs = _torch_order(cls_name, p, v, m)
        assert theirs.actions == mine.actions, (p, v, m)
        if p in (2, 3) and m <= 2 * p:
            validate(_torch_order(cls_name, p, v, m, comms=True))
        n += 1
    assert n >= 20


def test_where_torch_differs():
    """Two differences, both deliberate on our side:

    1. torch's ScheduleInterleaved1F1B with ONE stage per rank is not 1F1B: its warm-up is still
       2 (P-r-1) forwards (the interleaved formula with V = 1), so rank r holds min(2 (P-r) - 1, M)
       micro-batches instead of 1F1B's P - r for no bubble gain. We refuse 'interleaved' with vpp = 1
       and point to '1f1b'.
    2. torch accepts interleaved M that are not multiples of P (its "flex" rounds, e.g. P = 4, M = 6 runs
       one round of 6); its order is valid, but Megatron (and the K3 layout) require M % P == 0, and so do
       we: we raise a clear error instead.
    """
    p, m = 4, 8
    t = _torch_order("ScheduleInterleaved1F1B", p, 1, m)
    ours = simulate(build_schedule("1f1b", p, m))
    theirs = simulate(t)
    assert theirs.peak_live == tuple(min(2 * (p - r) - 1, m) for r in range(p))
    assert ours.peak_live == tuple(p - r for r in range(p))
    assert theirs.bubble_fraction >= ours.bubble_fraction - 1e-12
    with pytest.raises(ValueError, match="vpp = 1: expected >= 2 for schedule 'interleaved'"):
        build_schedule("interleaved", p, m, 1)
    flex = _torch_order("ScheduleInterleaved1F1B", 4, 2, 6)
    validate(flex)
    with pytest.raises(ValueError, match="microbatches = 6: expected a multiple of pp"):
        build_schedule("interleaved", 4, 6, 2)
