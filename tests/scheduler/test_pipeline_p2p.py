"""Point-to-point groups of the pipeline (``moonrt/scheduler/pipeline_p2p.py``): every schedule's groups complete
under NCCL's rules, keep each rank's compute order, post every receive before the compute that reads it and every
send after the one that produced it; the per-action order they replace deadlocks there, and the dry run says where."""

from __future__ import annotations

import pytest

from moonrt.scheduler.pipeline import COMM_OPS, Action, build_schedule, lower
from moonrt.scheduler.pipeline_p2p import P2PGroup, check_nccl_order, p2p_groups

CASES = [(kind, p, v, m) for kind, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3)), ("zb", (1, 2)),
                                          ("zbv", (2,)))
         for p in (2, 3, 4) for v in vs for m in (p, p + 1, 2 * p)
         if not ((kind == "interleaved" or (kind == "zb" and v > 1)) and m % p)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb", "zbv"])
def test_groups_complete_under_nccl_rules_and_keep_the_order(kind: str) -> None:
    for _, p, v, m in (c for c in CASES if c[0] == kind):
        sch = lower(build_schedule(kind, p, m, v))
        items = p2p_groups(sch)
        check_nccl_order(sch, items)  # raises on a deadlock or a mispaired send
        for r in range(p):
            compute = [a for a in sch.actions[r] if a.op not in COMM_OPS]
            assert [a for a in items[r] if isinstance(a, Action)] == compute, (kind, p, v, m, r)
            comm = [a for g in items[r] if isinstance(g, P2PGroup) for a in g.actions]
            assert sorted(map(str, comm)) == sorted(str(a) for a in sch.actions[r] if a.op in COMM_OPS)
            rounds = [g.round for g in items[r] if isinstance(g, P2PGroup)]
            assert rounds == sorted(set(rounds))  # at most one group per round, in round order
            seen: set[tuple[str, int, int]] = set()
            for item in items[r]:
                acts = item.actions if isinstance(item, P2PGroup) else (item,)
                for a in acts:
                    key = (a.op, a.microbatch, a.chunk)
                    if a.op == "SEND_F":
                        assert ("F", a.microbatch, a.chunk) in seen
                    elif a.op == "SEND_B":
                        assert {("B", a.microbatch, a.chunk), ("I", a.microbatch, a.chunk)} & seen
                    seen.add(key)
                if isinstance(item, Action) and item.op in ("F", "B", "I"):
                    i = sch.actions[r].index(item)
                    before = sch.actions[r][i - 1] if i else None
                    if before is not None and before.op.startswith("RECV"):
                        assert (before.op, before.microbatch, before.chunk) in seen, (kind, p, v, m, r, item)


def test_the_per_action_order_deadlocks_under_nccl_rules() -> None:
    """The lowered list, one call per SEND / RECV (gloo's tag matching runs it), at pp 2, vpp 2, 4 micro-batches:
    each rank's first send to the other waits for a receive the other posts only after its own send."""
    sch = lower(build_schedule("interleaved", 2, 4, 2))
    with pytest.raises(ValueError, match=r"deadlocks under NCCL .*rank 0 in group 1 .*rank 1 in group 1"):
        check_nccl_order(sch, sch.actions)


def test_a_mispaired_order_is_named() -> None:
    """Two receives posted in the other order than their sends: NCCL pairs in order, the check names both."""
    sch = lower(build_schedule("gpipe", 2, 2))
    items = [list(x) for x in p2p_groups(sch)]
    recvs = [i for i, g in enumerate(items[1]) if isinstance(g, P2PGroup) and g.actions[0].op == "RECV_F"]
    a, b = recvs[0], recvs[1]
    items[1][a], items[1][b] = items[1][b], items[1][a]
    with pytest.raises(ValueError, match=r"send 0 to rank 1 is SEND_F0.*receive 0 from rank 0 is RECV_F1"):
        check_nccl_order(sch, items)
