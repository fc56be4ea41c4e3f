"""Pipeline schedules as per-rank action lists: generators, and the one entry point for executor and planner.

Pure data shared by the pipeline executor and the memory planner (K3_SYSTEMS §8-§10).
:func:`build_schedule` returns a compute-only :class:`Schedule` (IR: :mod:`.pipeline_ir`); :func:`lower`
inserts the sends and receives, :func:`validate` proves the result deadlock-free under the executor's
semantics and :func:`simulate` times it (:mod:`.pipeline_sim`); :mod:`.pipeline_p2p` groups the sends and
receives into the ``batch_isend_irecv`` calls the executor issues, in an order NCCL completes.
:func:`in_flight`, which the memory planner uses, reads the simulator's peak live counts.

Schedules (``pp`` ranks, ``vpp`` chunks per rank, ``m`` micro-batches; rank r):

- ``gpipe``: all forwards, then all backwards (``vpp = 1``); every rank holds all ``m``.
- ``1f1b``: ``pp - r - 1`` warm-up forwards, then one forward / one backward; holds ``pp - r``.
- ``interleaved`` (Megatron, loop placement, ``vpp >= 2``, ``m`` a multiple of ``pp``): forwards
  walk the chunks in rounds of ``pp`` micro-batches; warm-up ``2 (pp - r - 1) + (vpp - 1) pp``
  forwards, so ``warm-up + 1`` chunk activations are live at the peak (23 on rank 0 vs 9 on the
  last at pp = 8, vpp = 2: 11.5 vs 4.5 micro-batches' worth).
- ``zb`` (alias ``zb1p``): zero-bubble ZB1P (Qi et al. 2024, the order of torch's
  ``ScheduleInterleavedZeroBubble``): the backward is split into ``I`` (input grad, on the critical
  path) and ``W`` (weight grad); warm-up ``(pp - r - 1) + (vpp - 1) pp`` forwards, then F / I with
  rank r holding back its first ``r`` W passes to fill the cool-down bubble. At ``vpp = 1`` every
  rank holds at most ``pp`` micro-batches (1F1B's rank-0 peak; activations live until their W) for
  a third of 1F1B's idle time under unit costs (``pp - 1`` vs ``3 (pp - 1)`` units per rank).
- ``zbv``: zero-bubble ZB-V (exactly two chunks per rank, V placement: rank 0 holds the first and
  the last stage), the order of torch's ``ScheduleZBVZeroBubble``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from moonrt.config import PIPELINE_SCHEDULES, schedule_error
from moonrt.scheduler.pipeline_ir import COMM_OPS, COMPUTE_OPS, OPS, Action, Schedule
from moonrt.scheduler.pipeline_sim import UNIT_COSTS, SimResult, Slot, lower, simulate, validate

SCHEDULES: tuple[str, ...] = PIPELINE_SCHEDULES
ALIASES: dict[str, str] = {"zb1p": "zb"}
ScheduleKind = str


def _rounds(pp: int, vpp: int, rank: int, warm: int, m: int, zero_bubble: bool, defer_w: int) -> list[Action]:
    """Warm-up / steady / cool-down order over chunks in rounds of ``pp`` micro-batches (loop placement).

    Forward number k runs micro-batch ``(k // (pp vpp)) pp + k % pp`` through chunk ``(k // pp) % vpp``;
    backward number k the same micro-batch through the mirrored chunk. With ``zero_bubble`` the
    backward is I, and the W of backward number j follows backward number ``j + defer_w``.
    """
    total = m * vpp

    def fwd_(k: int) -> tuple[int, int]:
        group, pos = divmod(k, pp * vpp)
        return group * pp + pos % pp, (pos // pp) % vpp

    def bwd_(k: int) -> tuple[int, int]:
        mb, c = fwd_(k)
        return mb, vpp - 1 - c

    if vpp == 1:
        def fwd_(k: int) -> tuple[int, int]:  # noqa: F811 -- any m when there is one chunk
            return k, 0

        bwd_ = fwd_
    warm = min(warm, total)
    seq = [Action("F", *fwd_(k)) for k in range(warm)]
    f = b = w = 0
    f = warm
    bop = "I" if zero_bubble else "B"
    while b < total:
        if f < total:
            seq.append(Action("F", *fwd_(f)))
            f += 1
        seq.append(Action(bop, *bwd_(b)))
        b += 1
        if zero_bubble and b > defer_w:
            seq.append(Action("W", *bwd_(w)))
            w += 1
    while zero_bubble and w < total:
        seq.append(Action("W", *bwd_(w)))
        w += 1
    return seq


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-V order of ``rank`` (chunk 0 = stage rank, chunk 1 = stage 2 pp - 1 - rank).

    Built for ``max(m, 2 pp - 1)`` micro-batches (the steady state needs that many) and cut back to
    ``m``, as torch does.
    """
    n = max(2 * pp - 1, m)
    seq: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        seq.append(Action("F", f0, 0))
        f0 += 1
    for _ in range(rank):
        seq += [Action("F", f1, 1), Action("F", f0, 0)]
        f1 += 1
        f0 += 1
    for _ in range(pp - rank):
        seq += [Action("F", f1, 1), Action("I", b1, 1), Action("W", b1, 1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            seq.append(Action("F", f0, 0))
            f0 += 1
        seq += [Action("I", b0, 0), Action("W", b0, 0), Action("F", f1, 1), Action("I", b1, 1), Action("W", b1, 1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        seq += [Action("I", b0, 0), Action("I", b1, 1)]
        b0 += 1
        b1 += 1
    for _ in range(pp - rank):
        seq += [Action("I", b0, 0), Action("W", w0, 0)]
        b0 += 1
        w0 += 1
    seq += [Action("W", i, 1) for i in range(w1, b1)] + [Action("W", i, 0) for i in range(w0, b0)]
    return [a for a in seq if a.microbatch < m]


def _check(kind: str, pp: int, m: int, vpp: int) -> str:
    kind = ALIASES.get(kind, kind)
    bad = schedule_error(kind, pp, m, vpp)
    if bad is not None:
        field, value, expected = bad
        raise ValueError(f"{field} = {value!r}: expected {expected}")
    return kind


def build_schedule(kind: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Compute-only action lists of schedule ``kind`` (see the module docstring for the orders).

    Raises ValueError naming the field for an unknown schedule or invalid degrees: ``vpp`` must be 1
    for gpipe / 1f1b, >= 2 for interleaved, 2 for zbv; interleaved (and zb with ``vpp > 1``) need
    ``microbatches`` a multiple of ``pp`` (so at least ``pp``), as in Megatron.
    """
    kind = _check(kind, pp, microbatches, vpp)
    m = microbatches
    gens: dict[str, Callable[[int], list[Action]]] = {
        "gpipe": lambda r: [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)],
        "1f1b": lambda r: _rounds(pp, 1, r, pp - r - 1, m, False, 0),
        "interleaved": lambda r: _rounds(pp, vpp, r, 2 * (pp - r - 1) + (vpp - 1) * pp, m, False, 0),
        "zb": lambda r: _rounds(pp, vpp, r, (pp - r - 1) + (vpp - 1) * pp, m, True, r),
        "zbv": lambda r: _zbv(pp, m, r),
    }
    acts = tuple(tuple(gens[kind](r)) for r in range(pp))
    return Schedule(kind, pp, vpp, m, acts, "v" if kind == "zbv" else "loop")


@functools.lru_cache(maxsize=64)
def _simulated(schedule: Schedule) -> SimResult:
    return simulate(schedule)


def in_flight(schedule: Schedule, rank: int) -> tuple[int, float]:
    """Peak number of (micro-batch, chunk) activations alive on ``rank``, from :func:`simulate`.

    Returns ``(peak_chunks, peak_microbatch_equivalents)``; one micro-batch's worth is ``vpp``
    chunks (all of the rank's layers), so the second value is ``peak_chunks / vpp``.
    """
    sim = _simulated(schedule)
    return sim.peak_live[rank], sim.peak_live_microbatches[rank]


__all__ = [
    "ALIASES",
    "Action",
    "COMM_OPS",
    "COMPUTE_OPS",
    "OPS",
    "SCHEDULES",
    "Schedule",
    "ScheduleKind",
    "SimResult",
    "Slot",
    "UNIT_COSTS",
    "build_schedule",
    "in_flight",
    "lower",
    "simulate",
    "validate",
]
