"""Point-to-point groups of a lowered pipeline schedule: which sends and receives go into one ``batch_isend_irecv``.

NCCL ignores tags and runs a communicator's point-to-point operations on one stream, in the order each rank
issues them: a group (one ``batch_isend_irecv``, or one bare ``isend`` / ``irecv``) completes only when every
operation in it has its partner posted by the peer, the k-th send from rank a to rank b pairing with b's k-th
receive from a. The executor's lowered order (:func:`moonrt.scheduler.pipeline_sim.lower`: ``RECV`` right before
the compute that reads it, ``SEND`` right after the one that produced it, each its own call) is valid under gloo's
tag matching, but under NCCL it deadlocks for interleaved schedules (pp 2, vpp 2, four micro-batches: rank 0
sends ``B0.1`` while rank 1 first sends ``B1.1``, each waiting for a receive the other posts later).

:func:`p2p_groups` rebuilds each rank's list as its compute actions plus :class:`P2PGroup` s, in lock-step rounds
(torch's ``_add_send_recv`` walks the ranks the same way): in each round every rank runs its next compute action
whose received inputs have been posted; then every send those actions produced is issued in the sender's group of
that round and its receive in the receiver's group of the same round. Each rank has at most one group per round,
in round order, and every operation's partner is in the peer's group of the same round. That is deadlock-free
under NCCL's rules: take the unfinished group with the smallest round k (on any rank); every group of an earlier
round has finished, so its rank reaches it (the computes before it read only receives of earlier rounds), and so
does each peer reach its own round-k group, which holds the partners of all its operations, so it finishes. A
receive is thereby posted as soon as its send is (the executor waits on it only before the compute that reads
it); a send is issued right after the compute that produced it, as before.

:func:`check_nccl_order` proves that for given group lists with a dry run under those rules (each rank blocked in
its current group until every operation of it has its partner posted), and checks that partners carry the same
(op, micro-batch, stage): what in-order matching delivers is what the executor expects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from moonrt.scheduler.pipeline_ir import COMM_OPS, COMPUTE_OPS, Action, Schedule
from moonrt.scheduler.pipeline_sim import _peer, lower


@dataclasses.dataclass(frozen=True, slots=True)
class P2PGroup:
    """Communication actions one rank issues as one ``batch_isend_irecv`` (``round``: the lock-step round)."""

    round: int
    actions: tuple[Action, ...]

    def label(self) -> str:
        return "{" + " ".join(a.label() for a in self.actions) + "}"


Item = Action | P2PGroup
"""One entry of a grouped action list: a compute action or a group of communication actions."""


def _steps(sch: Schedule, rank: int) -> list[tuple[Action, list[Action], list[Action]]]:
    """Rank's compute actions, each with the receives it reads (the RECVs before it) and its sends (after it)."""
    steps: list[tuple[Action, list[Action], list[Action]]] = []
    needs: list[Action] = []
    for a in sch.actions[rank]:
        if a.op in COMPUTE_OPS:
            steps.append((a, needs, []))
            needs = []
        elif a.op.startswith("RECV"):
            needs.append(a)
        elif not steps:
            raise ValueError(f"rank {rank}: {a.label()} before any compute action (nothing to send)")
        else:
            steps[-1][2].append(a)
    if needs:
        raise ValueError(f"rank {rank}: {needs[0].label()} after the last compute action (nothing reads it)")
    return steps


def p2p_groups(schedule: Schedule) -> tuple[tuple[Item, ...], ...]:
    """Per rank: the compute actions of ``schedule`` (lowered first if compute-only) in their order, with its
    communication actions regrouped into :class:`P2PGroup` s by lock-step rounds (see the module docstring).

    Raises ValueError when no rank can run its next compute action and no send is pending (a schedule that
    :func:`moonrt.scheduler.pipeline_sim.validate` rejects as well).
    """
    sch = schedule if schedule.lowered or schedule.pp == 1 else lower(schedule)
    steps = [_steps(sch, r) for r in range(sch.pp)]
    pos = [0] * sch.pp
    posted: set[tuple[int, Action]] = set()
    out: list[list[Item]] = [[] for _ in range(sch.pp)]
    rnd = 0
    while any(pos[r] < len(steps[r]) for r in range(sch.pp)):
        sends: list[tuple[int, Action]] = []
        ran = False
        for r in range(sch.pp):
            if pos[r] < len(steps[r]):
                a, needs, produced = steps[r][pos[r]]
                if all((r, x) in posted for x in needs):
                    out[r].append(a)
                    sends += [(r, s) for s in produced]
                    pos[r] += 1
                    ran = True
        if not ran:
            stuck = [f"rank {r} at {steps[r][pos[r]][0].label()}" for r in range(sch.pp) if pos[r] < len(steps[r])]
            raise ValueError(f"schedule {sch.kind!r}: no rank can run its next action ({'; '.join(stuck)})")
        groups: dict[int, list[Action]] = {}
        for r, s in sends:
            peer, match, peer_chunk, _ = _peer(sch, r, s)
            recv = Action(match, s.microbatch, peer_chunk)  # type: ignore[arg-type]
            groups.setdefault(r, []).append(s)
            groups.setdefault(peer, []).append(recv)
            posted.add((peer, recv))
        for r in sorted(groups):
            out[r].append(P2PGroup(rnd, tuple(groups[r])))
        rnd += bool(groups)
    return tuple(tuple(items) for items in out)


def check_nccl_order(schedule: Schedule, items: Sequence[Sequence[Item]]) -> None:
    """Dry-run ``items[r]`` (every rank's grouped list of ``schedule``) under NCCL's point-to-point rules.

    A rank stays in its current group until every operation in it has its partner posted: a send to b is the
    k-th one to b, its partner b's k-th receive from this rank (and vice versa); a partner is posted once b has
    reached the group holding it. Bare communication actions count as groups of one (an ``isend`` / ``irecv``
    each). Raises ValueError naming each stuck rank and what it waits for, or a partner pair whose actions differ
    (in-order matching would deliver the wrong tensors).
    """
    pp = schedule.pp
    groups: list[list[list[tuple[str, int, int, Action]]]] = []
    where: dict[tuple[int, str, int, int], int] = {}  # (rank, kind, peer, k) -> index of its group on that rank
    ops: dict[tuple[int, str, int, int], Action] = {}
    for r in range(pp):
        count: dict[tuple[str, int], int] = {}
        mine: list[list[tuple[str, int, int, Action]]] = []
        for item in items[r]:
            acts = item.actions if isinstance(item, P2PGroup) else (item,) if item.op in COMM_OPS else ()
            if not acts:
                continue
            g = []
            for a in acts:
                peer = _peer(schedule, r, a)[0]
                kind = "send" if a.op.startswith("SEND") else "recv"
                k = count.get((kind, peer), 0)
                count[(kind, peer)] = k + 1
                where[(r, kind, peer, k)] = len(mine)
                ops[(r, kind, peer, k)] = a
                g.append((kind, peer, k, a))
            mine.append(g)
        groups.append(mine)
    for (r, kind, peer, k), a in ops.items():
        if kind != "send":
            continue
        b = ops.get((peer, "recv", r, k))
        _, match, peer_chunk, _ = _peer(schedule, r, a)
        if b is None:
            raise ValueError(f"rank {r}: {a.label()} (send {k} to rank {peer}) has no receive {k} on rank {peer}")
        if (b.op, b.microbatch, b.chunk) != (match, a.microbatch, peer_chunk):
            raise ValueError(f"rank {r}'s send {k} to rank {peer} is {a.label()}, but rank {peer}'s receive {k} from "
                             f"rank {r} is {b.label()}: NCCL pairs them in order (tags are ignored)")
    for (r, kind, peer, k), b in ops.items():
        if kind == "recv" and (peer, "send", r, k) not in ops:
            raise ValueError(f"rank {r}: {b.label()} (receive {k} from rank {peer}) has no send {k} on rank {peer}")
    pos = [0] * pp
    while True:
        moved = False
        for r in range(pp):
            while pos[r] < len(groups[r]) and all(
                    where[(peer, "recv" if kind == "send" else "send", r, k)] <= pos[peer]
                    for kind, peer, k, _ in groups[r][pos[r]]):
                pos[r] += 1
                moved = True
        if not moved:
            break
    stuck = [r for r in range(pp) if pos[r] < len(groups[r])]
    if stuck:
        waits = []
        for r in stuck:
            g = groups[r][pos[r]]
            missing = [f"{a.label()} (rank {peer})" for kind, peer, k, a in g
                       if where[(peer, "recv" if kind == "send" else "send", r, k)] > pos[peer]]
            waits.append(f"rank {r} in group {pos[r]} waits for the partners of {', '.join(missing)}")
        raise ValueError(f"schedule {schedule.kind!r} deadlocks under NCCL point-to-point rules: " + "; ".join(waits))


__all__ = ["Item", "P2PGroup", "check_nccl_order", "p2p_groups"]
