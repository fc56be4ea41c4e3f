"""Pipeline schedules as per-rank action lists, and their simulation (K3_SYSTEMS §8, §10).

Pure data shared by the pipeline executor and the memory planner: :func:`build_schedule` returns,
for every pipeline rank, the ordered list of :class:`Action` (forward or backward of one
micro-batch through one of the rank's model chunks). :func:`simulate` executes all ranks in
lockstep with the data dependencies of a pipeline (forward of stage ``s`` needs stage ``s - 1``'s
forward, backward of ``s`` needs stage ``s + 1``'s backward), which proves the order is
deadlock-free and gives each rank's timeline; :func:`in_flight` walks a rank's actions and
reports the peak number of micro-batch chunks whose activations are alive.

Stages: with ``pp`` ranks and ``vpp`` chunks per rank the model is cut into ``pp * vpp`` stages;
chunk ``c`` of rank ``r`` is stage ``c * pp + r`` (Megatron's interleaved placement).

Known results the simulation reproduces (tests): 1F1B holds ``pp - r`` micro-batches on rank ``r``;
interleaved 1F1B holds ``pp * (1 + (pp - 1) / (pp * vpp))`` micro-batches' worth on rank 0
(11.5 vs 4.5 on the last rank at pp = 8, vpp = 2); GPipe holds all ``m``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ScheduleKind = Literal["1f1b", "interleaved", "gpipe"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "gpipe")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One unit of pipeline work: ``op`` ("F" or "B") of ``microbatch`` through local ``chunk``."""

    op: Literal["F", "B"]
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank action lists of one pipeline schedule (``actions[r]`` is rank r's order)."""

    kind: str
    pp: int
    vpp: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage index of ``chunk`` on ``rank``."""
        return chunk * self.pp + rank


def build_schedule(kind: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Action lists for ``kind`` in ("1f1b", "interleaved", "gpipe").

    Raises ValueError naming the field for invalid degrees (interleaved needs ``vpp >= 2`` and
    ``microbatches % pp == 0``, as in Megatron; the others need ``vpp == 1``).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule = {kind!r}: expected one of {', '.join(SCHEDULES)}")
    for name, v in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} = {v!r}: expected an integer >= 1")
    m = microbatches
    acts: list[tuple[Action, ...]] = []
    if kind == "gpipe":
        if vpp != 1:
            raise ValueError(f"vpp = {vpp}: expected 1 for schedule 'gpipe'")
        for _ in range(pp):
            acts.append(tuple([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]))
    elif kind == "1f1b":
        if vpp != 1:
            raise ValueError(f"vpp = {vpp}: expected 1 for schedule '1f1b' (use 'interleaved' for vpp > 1)")
        for r in range(pp):
            warm = min(pp - r - 1, m)
            seq = [Action("F", i) for i in range(warm)]
            f, b = warm, 0
            while f < m:
                seq.append(Action("F", f))
                f += 1
                seq.append(Action("B", b))
                b += 1
            seq += [Action("B", i) for i in range(b, m)]
            acts.append(tuple(seq))
    else:
        if vpp < 2:
            raise ValueError(f"vpp = {vpp}: expected >= 2 for schedule 'interleaved'")
        if m % pp:
            raise ValueError(f"microbatches = {m}: expected a multiple of pp ({pp}) for schedule 'interleaved'")
        total = m * vpp

        def fwd(k: int) -> Action:
            group, pos = divmod(k, pp * vpp)
            return Action("F", group * pp + pos % pp, (pos // pp) % vpp)

        def bwd(k: int) -> Action:
            group, pos = divmod(k, pp * vpp)
            return Action("B", group * pp + pos % pp, vpp - 1 - (pos // pp) % vpp)

        for r in range(pp):
            warm = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
            seq = [fwd(k) for k in range(warm)]
            f, b = warm, 0
            while f < total:
                seq.append(fwd(f))
                f += 1
                seq.append(bwd(b))
                b += 1
            seq += [bwd(k) for k in range(b, total)]
            acts.append(tuple(seq))
    return Schedule(kind, pp, vpp, m, tuple(acts))


def in_flight(schedule: Schedule, rank: int) -> tuple[int, float]:
    """Peak number of (micro-batch, chunk) activations alive on ``rank`` while it runs its actions.

    Returns ``(peak_chunks, peak_microbatch_equivalents)``; one micro-batch's worth is ``vpp``
    chunks (all of the rank's layers), so the second value is ``peak_chunks / vpp``.
    """
    live = peak = 0
    for a in schedule.actions[rank]:
        live += 1 if a.op == "F" else -1
        peak = max(peak, live)
    return peak, peak / schedule.vpp


@dataclasses.dataclass(frozen=True, slots=True)
class Timeline:
    """Result of :func:`simulate`: ``start[r][i]`` is the time step action ``i`` of rank ``r`` ran at."""

    steps: int
    start: tuple[tuple[int, ...], ...]

    def bubble(self, schedule: Schedule) -> float:
        """Idle fraction of the pipeline (1 - busy slots / all slots)."""
        busy = sum(len(a) for a in schedule.actions)
        return 1.0 - busy / (self.steps * schedule.pp)


def simulate(schedule: Schedule) -> Timeline:
    """Execute every rank's action list in order with unit-time actions and pipeline dependencies.

    Each step, every rank runs its next action if its inputs are ready (results of the previous
    step or earlier). Raises ValueError if some rank can never proceed (a deadlocked order).
    """
    pp, vpp = schedule.pp, schedule.vpp
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], int] = {}  # (op, microbatch, stage) -> step finished
    pos = [0] * pp
    start: list[list[int]] = [[] for _ in range(pp)]
    step = 0
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = []
        for r in range(pp):
            if pos[r] == len(schedule.actions[r]):
                continue
            a = schedule.actions[r][pos[r]]
            s = schedule.stage(r, a.chunk)
            if a.op == "F":
                dep = [("F", a.microbatch, s - 1)] if s > 0 else []
            else:
                dep = [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < last else [])
            if all(d in done and done[d] < step for d in dep):
                progressed.append((r, a, s))
        if not progressed:
            stuck = {r: schedule.actions[r][pos[r]] for r in range(pp) if pos[r] < len(schedule.actions[r])}
            raise ValueError(f"schedule {schedule.kind!r} deadlocks at step {step}: waiting actions {stuck}")
        for r, a, s in progressed:
            done[(a.op, a.microbatch, s)] = step
            start[r].append(step)
            pos[r] += 1
            remaining -= 1
        step += 1
    return Timeline(step, tuple(tuple(s) for s in start))


__all__ = ["Action", "SCHEDULES", "Schedule", "Timeline", "build_schedule", "in_flight", "simulate"]
