"""Lowering, validation and timing simulation of pipeline schedules (IR in :mod:`.pipeline_ir`).

- :func:`lower` inserts the point-to-point actions a rank needs around its compute actions: ``RECV_F``
  right before the ``F`` of a stage whose previous stage is on another rank, ``SEND_F`` right after
  the ``F`` of a stage whose next stage is on another rank, ``RECV_B`` / ``SEND_B`` likewise around
  ``B`` / ``I``. Neighbouring stages on the same rank (V placement) exchange locally.
- :func:`validate` proves a lowered schedule runs under the executor's semantics (``SEND_*`` is
  non-blocking, ``RECV_*`` blocks until the matching send has been issued): every action at most
  once and every (stage, micro-batch) forwarded and backwarded on its rank, local inputs produced
  earlier on the rank (no ``B`` before its ``F``, no ``W`` before its ``I``, no compute before its
  ``RECV``), every send matched by exactly one receive on the right rank and vice versa, and no
  cycle (a dry run of all ranks that must finish). Errors name the rank and the action.
- :func:`simulate` runs the same dry run with action costs (default: ``F``, ``I``, ``W`` one unit,
  ``B = I + W`` two units, communication free) and returns every rank's timeline, the bubble
  fraction and the peak number of live (micro-batch, chunk) activations per rank. The memory
  planner's in-flight counts come from here (:func:`moonrt.scheduler.pipeline.in_flight`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from moonrt.scheduler.pipeline_ir import COMM_OPS, COMPUTE_OPS, Action, Schedule

UNIT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0,
                                   "SEND_F": 0.0, "RECV_F": 0.0, "SEND_B": 0.0, "RECV_B": 0.0}
"""Default costs: one unit per forward, input-grad and weight-grad pass; a full backward is I + W."""


def lower(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions around the compute actions (idempotent: existing comm is replaced)."""
    last = schedule.num_stages - 1
    out: list[tuple[Action, ...]] = []
    for r, acts in enumerate(schedule.actions):
        seq: list[Action] = []
        for a in acts:
            if a.op in COMM_OPS:
                continue
            s = schedule.stage(r, a.chunk)
            prev_remote = s > 0 and schedule.rank_of(s - 1) != r
            next_remote = s < last and schedule.rank_of(s + 1) != r
            if a.op == "F":
                seq += [Action("RECV_F", a.microbatch, a.chunk)] if prev_remote else []
                seq.append(a)
                seq += [Action("SEND_F", a.microbatch, a.chunk)] if next_remote else []
            elif a.op in ("B", "I"):
                seq += [Action("RECV_B", a.microbatch, a.chunk)] if next_remote else []
                seq.append(a)
                seq += [Action("SEND_B", a.microbatch, a.chunk)] if prev_remote else []
            else:
                seq.append(a)
        out.append(tuple(seq))
    return dataclasses.replace(schedule, actions=tuple(out))


def _name(schedule: Schedule, rank: int, a: Action) -> str:
    return f"{a.label()} (stage {schedule.stage(rank, a.chunk)}, micro-batch {a.microbatch})"


def _peer(schedule: Schedule, rank: int, a: Action) -> tuple[int, str, int, int]:
    """For a comm action: (peer rank, matching op, peer chunk, this action's stage)."""
    s = schedule.stage(rank, a.chunk)
    peer_stage = s + 1 if a.op in ("SEND_F", "RECV_B") else s - 1
    if not 0 <= peer_stage < schedule.num_stages:
        raise ValueError(f"rank {rank}: {_name(schedule, rank, a)} has no neighbouring stage "
                         f"{peer_stage} to talk to")
    match = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[a.op]
    return schedule.rank_of(peer_stage), match, schedule.chunk_of(peer_stage), s


def _check_order(sch: Schedule, r: int, a: Action, seen: set[tuple[str, int, int]]) -> None:
    """Raise if ``a`` on rank ``r`` needs a local input that ``seen`` (earlier actions) lacks."""
    last = sch.num_stages - 1
    s = sch.stage(r, a.chunk)
    mb = a.microbatch

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"rank {r}: {_name(sch, r, a)} runs before {what}")

    def done_local(op: str, stage: int) -> bool:
        return (op, mb, sch.chunk_of(stage)) in seen

    if a.op == "F" and s > 0:
        if sch.rank_of(s - 1) == r:
            need(done_local("F", s - 1), f"the F of stage {s - 1} on the same rank")
        else:
            need(("RECV_F", mb, a.chunk) in seen, "its RECV_F")
    elif a.op in ("B", "I"):
        need(("F", mb, a.chunk) in seen, "its F")
        other = "I" if a.op == "B" else "B"
        if (other, mb, a.chunk) in seen:
            raise ValueError(f"rank {r}: {_name(sch, r, a)} repeats the backward of its {other}")
        if s < last:
            if sch.rank_of(s + 1) == r:
                need(done_local("B", s + 1) or done_local("I", s + 1),
                     f"the backward of stage {s + 1} on the same rank")
            else:
                need(("RECV_B", mb, a.chunk) in seen, "its RECV_B")
    elif a.op == "W":
        need(("I", mb, a.chunk) in seen, "its I")
    elif a.op in COMM_OPS:
        peer, _, _, _ = _peer(sch, r, a)
        if peer == r:
            raise ValueError(f"rank {r}: {_name(sch, r, a)} talks to its own rank "
                             f"(same-rank stages exchange locally)")
        if a.op == "SEND_F":
            need(("F", mb, a.chunk) in seen, "its F (nothing to send)")
        elif a.op == "SEND_B":
            need(("B", mb, a.chunk) in seen or ("I", mb, a.chunk) in seen, "its backward (nothing to send)")


def _static_checks(sch: Schedule) -> None:
    """Per-rank order checks and global completeness / send-receive matching (see module docstring)."""
    for r in range(sch.pp):
        seen: set[tuple[str, int, int]] = set()
        for a in sch.actions[r]:
            if not (0 <= a.chunk < sch.vpp and 0 <= a.microbatch < sch.microbatches):
                raise ValueError(f"rank {r}: action {a.label()}: expected chunk < {sch.vpp} and "
                                 f"micro-batch < {sch.microbatches}")
            key = (a.op, a.microbatch, a.chunk)
            if key in seen:
                raise ValueError(f"rank {r}: {_name(sch, r, a)} appears twice")
            _check_order(sch, r, a, seen)
            seen.add(key)
        for c in range(sch.vpp):
            for mb in range(sch.microbatches):
                if ("F", mb, c) not in seen:
                    raise ValueError(f"rank {r}: missing F{mb}.{c} (stage {sch.stage(r, c)}, micro-batch {mb})")
                if ("B", mb, c) not in seen and not {("I", mb, c), ("W", mb, c)} <= seen:
                    raise ValueError(f"rank {r}: missing the backward (B, or I and W) of micro-batch {mb}, "
                                     f"chunk {c} (stage {sch.stage(r, c)})")
    comm = [{(a.op, a.microbatch, a.chunk) for a in acts if a.op in COMM_OPS} for acts in sch.actions]
    for r in range(sch.pp):
        for op, mb, c in sorted(comm[r]):
            a = Action(op, mb, c)
            peer, match, pc, _ = _peer(sch, r, a)
            if (match, mb, pc) not in comm[peer]:
                raise ValueError(f"rank {peer}: missing {match}{mb}.{pc} matching rank {r}'s {op} "
                                 f"{_name(sch, r, a)}")
    # every cross-rank boundary is crossed exactly once per micro-batch in each direction
    for s in range(sch.num_stages - 1):
        src, dst = sch.rank_of(s), sch.rank_of(s + 1)
        if src == dst:
            continue
        for mb in range(sch.microbatches):
            if ("SEND_F", mb, sch.chunk_of(s)) not in comm[src]:
                raise ValueError(f"rank {src}: missing SEND_F{mb}.{sch.chunk_of(s)} (stage {s} -> rank {dst})")
            if ("SEND_B", mb, sch.chunk_of(s + 1)) not in comm[dst]:
                raise ValueError(f"rank {dst}: missing SEND_B{mb}.{sch.chunk_of(s + 1)} (stage {s + 1} -> rank {src})")


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """One action on a rank's timeline: it ran from ``start`` to ``end`` (a RECV: waited until ``end``)."""

    start: float
    end: float
    action: Action


def _dry_run(sch: Schedule, costs: Mapping[str, float]) -> tuple[tuple[Slot, ...], ...]:
    """Execute all ranks with executor semantics; raise ValueError naming the stuck ranks on a cycle."""
    pos = [0] * sch.pp
    clock = [0.0] * sch.pp
    issued: dict[tuple[int, str, int, int], float] = {}  # (dst rank, recv op, mb, dst chunk) -> issue time
    slots: list[list[Slot]] = [[] for _ in range(sch.pp)]
    remaining = sum(len(a) for a in sch.actions)
    while remaining:
        progressed = False
        for r in range(sch.pp):
            acts = sch.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = clock[r]
                if a.op in ("RECV_F", "RECV_B"):
                    key = (r, a.op, a.microbatch, a.chunk)
                    if key not in issued:
                        break
                    end = max(t, issued[key])
                elif a.op in ("SEND_F", "SEND_B"):
                    peer, match, pc, _ = _peer(sch, r, a)
                    issued[(peer, match, a.microbatch, pc)] = t
                    end = t
                else:
                    end = t + float(costs[a.op])
                slots[r].append(Slot(t, end, a))
                clock[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = []
            for r in range(sch.pp):
                if pos[r] < len(sch.actions[r]):
                    a = sch.actions[r][pos[r]]
                    peer, match, pc, _ = _peer(sch, r, a)
                    waits.append(f"rank {r} waits at {_name(sch, r, a)} for rank {peer}'s "
                                 f"{match}{a.microbatch}.{pc}")
            raise ValueError(f"schedule {sch.kind!r} deadlocks: " + "; ".join(waits))
    return tuple(tuple(s) for s in slots)


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` runs to completion under the executor semantics; return the lowered form.

    A compute-only schedule is lowered with :func:`lower` first. Raises ValueError naming the rank and
    the action for: an action repeated or missing, a compute action before its inputs (``B`` before its
    ``F``, ``W`` before its ``I``, ``F`` before its ``RECV_F``), a send or receive without its partner,
    or a cycle (deadlock).
    """
    sch = schedule if schedule.lowered or schedule.pp == 1 else lower(schedule)
    _static_checks(sch)
    _dry_run(sch, UNIT_COSTS)
    return sch


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`.

    ``timelines[r]``: rank r's :class:`Slot` s in order (comm actions included, zero cost);
    ``makespan``: time the last rank finishes; ``busy[r]``: rank r's compute time;
    ``bubble_fraction``: ``1 - sum(busy) / (pp * makespan)``; ``peak_live[r]``: largest number of
    (micro-batch, chunk) activations alive on rank r (from its ``F`` until its ``B`` or ``W``);
    ``peak_live_microbatches[r] = peak_live[r] / vpp`` (one micro-batch's worth = all of a rank's chunks).
    """

    schedule: Schedule
    timelines: tuple[tuple[Slot, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_live: tuple[int, ...]
    peak_live_microbatches: tuple[float, ...]

    def idle_fraction(self, rank: int) -> float:
        """Idle share of ``rank`` over the makespan."""
        return 1.0 - self.busy[rank] / self.makespan if self.makespan else 0.0


def simulate(schedule: Schedule, costs: Mapping[str, float] | None = None) -> SimResult:
    """Validate and dry-run ``schedule`` (lowered first if compute-only) with per-op ``costs``.

    ``costs`` maps ops to durations; missing ops take the :data:`UNIT_COSTS` value.
    """
    c = dict(UNIT_COSTS)
    c.update(costs or {})
    sch = schedule if schedule.lowered or schedule.pp == 1 else lower(schedule)
    _static_checks(sch)
    tl = _dry_run(sch, c)  # raises on a cycle, like validate
    makespan = max((s[-1].end for s in tl if s), default=0.0)
    busy = tuple(sum(x.end - x.start for x in s if x.action.op in COMPUTE_OPS) for s in tl)
    bubble = 1.0 - sum(busy) / (sch.pp * makespan) if makespan else 0.0
    peaks = []
    for s in tl:
        live = peak = 0
        for x in s:
            live += {"F": 1, "B": -1, "W": -1}.get(x.action.op, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return SimResult(sch, tl, makespan, busy, bubble, tuple(peaks), tuple(p / sch.vpp for p in peaks))


__all__ = ["SimResult", "Slot", "UNIT_COSTS", "lower", "simulate", "validate"]
