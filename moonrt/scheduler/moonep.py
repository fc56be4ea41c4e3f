"""MoonEP placement planner: exact per-rank balance with at most E/R expert copies per rank.

Implements K3_SYSTEMS §6.1-§6.3 (K3 report §5.2.1). Notation: R EP ranks, E routed experts,
``G = E // R`` experts per home group (rank ``h`` is home to experts ``[h*G, (h+1)*G)``), ``B``
prefetch slots per rank (default ``G``).

Algorithm (the constructive proof of §6.2):

1. *Group balance.* ``bal[h] = load(group h) - capacity[h]``. While some ``bal > 0``: donor
   ``h = argmax bal`` (ties: smaller rank), receiver ``u = argmin bal`` (ties: smaller rank);
   the donor's group gives ``-bal[u]`` assignments to ``u``; ``bal[u] = 0``, ``bal[h] += bal[u]``
   (``h`` may overshoot into a deficit and later receive from another group). Every rank receives
   from at most one home group, so it hosts at most ``G`` foreign experts; at most ``R - 1`` rounds.
2. *Hottest-first split.* Per donor group, repeatedly match the receiver with the largest
   remaining quota (ties: smaller rank) with the group's expert with the most remaining
   assignments (ties: larger expert id) and move ``min(quota, remaining)``. Whatever is left of
   the group stays on its home rank.

Everything is integer arithmetic with explicit tie-breaks, so every rank computes the identical
plan from the same all-gathered counts. :mod:`moonrt.scheduler.moonep_torch` is the same algorithm
in torch (runs on the device of the counts, no host synchronization) and gives identical plans.

Data movement (§6.3): per expert ``e``, its assignments are ordered by (source rank, position in
the source's token order); ``plan.cuts[e]`` cuts that order into destination ranks ``0..R-1``:
assignment ``j`` of expert ``e`` is computed on rank ``d`` with ``cuts[e, d] <= j < cuts[e, d+1]``.
:func:`send_split` turns that into each source rank's send layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from moonrt.scheduler.placement import Placement

__all__ = ["MoonEPPlan", "plan", "send_split", "transfer_matrix", "validate_counts", "capacities"]


@dataclass(frozen=True)
class MoonEPPlan(Placement):
    """A MoonEP placement for one MoE layer (K3_SYSTEMS §6.3): a :class:`Placement` (``alloc``,
    ``copies``, ``capacity``) plus the planner's bookkeeping. Arrays are numpy (from :func:`plan`)
    or torch tensors on the counts' device (from :func:`moonrt.scheduler.moonep_torch.plan_torch`).

    Attributes (besides those of :class:`Placement`; here ``capacity`` is the balanced target of §6.1):
        cuts: ``[E, R + 1]`` int64. Per-expert cut points over destination ranks: the exclusive
            cumulative sum of ``alloc[e]``; ``cuts[e, 0] = 0``, ``cuts[e, R] = load[e]``.
        donor: ``[R]`` int64. The home rank whose experts fill rank ``r``'s slots (-1: none).
        num_slots: B, slots per rank.

    In numpy plans ``alloc`` and ``cuts`` are views of one ``[E, 2R + 1]`` buffer (row stride
    ``2R + 1``, not C-contiguous); use ``np.ascontiguousarray`` where a dense copy is needed.
    """

    cuts: Any
    donor: Any
    num_slots: int

    def to_numpy(self) -> MoonEPPlan:
        """The same plan with numpy arrays (a no-op for numpy plans)."""
        conv = lambda a: a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
        return MoonEPPlan(conv(self.alloc), conv(self.copies), conv(self.capacity), conv(self.cuts),
                          conv(self.donor), self.num_slots)


def capacities(total: int, num_ranks: int) -> np.ndarray:
    """``[R]`` int64 targets: ``total // R`` each, the first ``total % R`` ranks one more (§6.1)."""
    cap = np.full(num_ranks, total // num_ranks, dtype=np.int64)
    cap[: total % num_ranks] += 1
    return cap


def validate_counts(counts: Any, num_slots: int | None, total_tokens: int | None) -> tuple[np.ndarray, int, int]:
    """Check planner inputs; returns ``(counts as int64 numpy [R, E], B, total assignments)``.

    Raises ValueError naming the field, the value and what was expected.
    """
    if hasattr(counts, "detach"):  # torch tensor
        if counts.dtype.is_floating_point or counts.dtype.is_complex or str(counts.dtype) == "torch.bool":
            raise ValueError(f"counts: dtype {counts.dtype}, expected an integer tensor [R, E]")
        counts = counts.detach().cpu().numpy()
    arr = np.asarray(counts)
    if arr.ndim != 2:
        raise ValueError(f"counts: shape {tuple(arr.shape)}, expected 2 dimensions [R, E]")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"counts: dtype {arr.dtype}, expected an integer array [R, E]")
    R, E = arr.shape
    if R < 1 or E < 1:
        raise ValueError(f"counts: shape {(R, E)}, expected R >= 1 ranks and E >= 1 experts")
    if E % R != 0:
        raise ValueError(f"counts: E={E} experts is not divisible by R={R} ranks (home groups need E % R == 0)")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        r, e = np.argwhere(arr < 0)[0]
        raise ValueError(f"counts: counts[{r}, {e}] = {arr[r, e]}, expected non-negative assignment counts")
    G = E // R
    B = G if num_slots is None else num_slots
    if not isinstance(B, (int, np.integer)) or isinstance(B, bool) or B < 0:
        raise ValueError(f"num_slots: {num_slots!r}, expected an integer >= 0 (default E/R = {G})")
    total = int(arr.sum())
    per_rank = arr.sum(1)
    if total_tokens is None:
        if R > 1 and not (per_rank == per_rank[0]).all():
            r = int(np.argmax(per_rank != per_rank[0]))
            raise ValueError(f"counts: per-rank totals differ (rank 0: {per_rank[0]}, rank {r}: {per_rank[r]}); "
                             "expected equal s*k on every rank, or pass total_tokens for floor/ceil targets")
    else:
        if not isinstance(total_tokens, (int, np.integer)) or isinstance(total_tokens, bool) or total_tokens < 0:
            raise ValueError(f"total_tokens: {total_tokens!r}, expected an integer >= 0 (tokens over all ranks)")
        if (total_tokens == 0 and total != 0) or (total_tokens > 0 and total % total_tokens != 0):
            raise ValueError(f"total_tokens: {total_tokens}, but counts sum to {total} assignments; expected "
                             "counts.sum() == total_tokens * k for an integer top-k")
    return arr, int(B), total


@njit(cache=True)
def _plan_core(load: np.ndarray, cap: np.ndarray, R: int, G: int) -> tuple[np.ndarray, ...]:  # pragma: no cover
    """Numba kernel of §6.2. load [E] int64, cap [R] int64 -> (buf [E, 2R + 1] = [alloc | cuts],
    donor [R], slots [R, G]), all int64; ``slots`` holds each rank's copied experts ascending, -1 padded."""
    E = R * G
    bal = np.empty(R, np.int64)
    for h in range(R):
        s = 0
        for i in range(G):
            s += load[h * G + i]
        bal[h] = s - cap[h]
    quota = np.zeros((R, R), np.int64)  # quota[h, u]: assignments of group h computed on u
    donor = np.full(R, -1, np.int64)
    for _ in range(R - 1):
        h = 0
        u = 0
        for r in range(1, R):
            if bal[r] > bal[h]:
                h = r
            if bal[r] < bal[u]:
                u = r
        if bal[h] <= 0:
            break
        m = -bal[u]
        quota[h, u] += m
        bal[u] = 0
        bal[h] -= m
        donor[u] = h
    # alloc and cuts share one buffer [E, 2R + 1]: one allocation per plan instead of two keeps
    # glibc from trimming and re-faulting the heap on every call (5-10x faster when planning in a loop).
    buf = np.zeros((E, 2 * R + 1), np.int64)
    alloc = buf[:, :R]
    rem = np.empty(G, np.int64)
    q = np.empty(R, np.int64)
    for h in range(R):
        for i in range(G):
            rem[i] = load[h * G + i]
        any_quota = False
        for r in range(R):
            q[r] = quota[h, r]
            if q[r] > 0:
                any_quota = True
        while any_quota:
            u = 0
            for r in range(1, R):
                if q[r] > q[u]:
                    u = r
            if q[u] == 0:
                break
            e = G - 1
            for i in range(G - 2, -1, -1):
                if rem[i] > rem[e]:
                    e = i
            m = min(q[u], rem[e])
            alloc[h * G + e, u] += m
            q[u] -= m
            rem[e] -= m
        for i in range(G):
            alloc[h * G + i, h] += rem[i]
    # Slot table: rank r's copies all come from group donor[r]; ascending expert ids.
    slots = np.full((R, G), -1, np.int64)
    for r in range(R):
        h = donor[r]
        if h >= 0:
            n = 0
            for i in range(G):
                if alloc[h * G + i, r] > 0:
                    slots[r, n] = h * G + i
                    n += 1
    cuts = buf[:, R:]
    for e in range(E):
        acc = 0
        for r in range(R):
            acc += alloc[e, r]
            cuts[e, r + 1] = acc
    return buf, donor, slots


def plan(counts: Any, num_slots: int | None = None, total_tokens: int | None = None) -> MoonEPPlan:
    """Plan one MoE layer's expert placement with exact per-rank balance (K3_SYSTEMS §6.2).

    Args:
        counts: ``[R, E]`` integer (numpy or torch). ``counts[r, e]`` = token-expert assignments
            that source rank ``r`` routes to expert ``e``. Every rank must have the same total
            (``s * k``) unless ``total_tokens`` is given.
        num_slots: B, prefetch slots per rank; default ``E // R`` (the bound of §6.2 that always
            suffices). With fewer slots the plan is returned only if it fits.
        total_tokens: tokens over all ranks (``sum_r s_r``); allows per-rank totals to differ.
            Targets become ``floor(total_tokens * k / R)``, the first ``(total_tokens * k) % R``
            ranks one more (§6.1), with ``k = counts.sum() / total_tokens`` (must be an integer).

    Returns:
        A :class:`MoonEPPlan` with numpy arrays. Deterministic: identical counts give identical plans.

    Raises:
        ValueError: bad shapes/dtypes, negative counts, E not divisible by R, unequal per-rank
            totals without ``total_tokens``, or ``num_slots`` too small for this routing.
    """
    arr, B, total = validate_counts(counts, num_slots, total_tokens)
    R, E = arr.shape
    G = E // R
    cap = capacities(total, R)
    load = arr.sum(0)
    buf, donor, slots = _plan_core(load, cap, R, G)
    alloc, cuts = buf[:, :R], buf[:, R:]
    need = (slots >= 0).sum(1)
    if B < G and int(need.max()) > B:
        r = int(np.argmax(need))
        raise ValueError(f"num_slots: {B} slots per rank are too few for exact balance with these counts: rank {r} "
                         f"needs {int(need[r])} copies (E/R = {G} always suffices)")
    copies = slots[:, :B] if B <= G else np.pad(slots, ((0, 0), (0, B - G)), constant_values=-1)
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=cap, cuts=cuts, donor=donor, num_slots=B)


def send_split(counts: Any, cuts: Any, src: int) -> np.ndarray:
    """``[E, R]`` int64: how many of source rank ``src``'s assignments to expert ``e`` go to rank ``d``.

    Source ``src`` owns positions ``[S[src, e], S[src + 1, e])`` of expert ``e``'s (source rank,
    position) order, ``S`` the exclusive cumulative sum of ``counts`` over sources; destination
    ``d`` owns ``[cuts[e, d], cuts[e, d + 1])``; the split is the overlap (§6.3). Within one
    (expert, destination) pair, a source sends its tokens in position order.

    Args:
        counts: ``[R, E]`` integer counts the plan was made from.
        cuts: ``[E, R + 1]`` int64, ``plan.cuts``.
        src: source rank.
    """
    c = np.asarray(counts, dtype=np.int64)
    lo_src = c[:src].sum(0)  # [E]
    hi_src = lo_src + c[src]
    cuts = np.asarray(cuts)
    lo = np.maximum(cuts[:, :-1], lo_src[:, None])
    hi = np.minimum(cuts[:, 1:], hi_src[:, None])
    return np.maximum(hi - lo, 0)


@njit(cache=True)
def _sweep_core(counts: np.ndarray, cuts: np.ndarray) -> np.ndarray:  # pragma: no cover
    """Numba kernel of :func:`transfer_matrix`: counts [R, E] int64, cuts [E, R + 1] int64 -> [R, R] int64."""
    R, E = counts.shape
    tm = np.zeros((R, R), np.int64)
    for e in range(E):
        # Two sorted partitions of [0, load_e): sources (in rank order) and destinations (cuts[e]).
        s = 0  # source rank
        s_lo = 0
        s_hi = counts[0, e]
        d = 0  # destination rank
        while s < R and d < R:
            if s_hi == s_lo:  # empty source range
                s += 1
                if s < R:
                    s_lo = s_hi
                    s_hi = s_lo + counts[s, e]
                continue
            d_hi = cuts[e, d + 1]
            if d_hi <= s_lo:  # destination range ends before this source range starts
                d += 1
                continue
            lo = max(s_lo, cuts[e, d])
            hi = min(s_hi, d_hi)
            if hi > lo:
                tm[s, d] += hi - lo
            if d_hi < s_hi:
                d += 1
            else:
                s += 1
                if s < R:
                    s_lo = s_hi
                    s_hi = s_lo + counts[s, e]
    return tm


def transfer_matrix(counts: Any, cuts: Any) -> np.ndarray:
    """``[R_src, R_dst]`` int64: assignments source rank ``r`` sends to destination ``d`` under a plan.

    The diagonal is computed locally (no bytes move). Equals ``sum_e send_split(counts, cuts, r)[e]``
    for every ``r``, computed by one sweep over each expert's two sorted partitions of its
    assignment order (sources' ranges ``[S[r, e], S[r + 1, e])`` and destinations' cut ranges):
    O(R·E) time and O(R²) memory, no ``[R, E, R]`` temporary.

    Args:
        counts: ``[R, E]`` integer counts the plan was made from.
        cuts: ``[E, R + 1]`` int64, ``plan.cuts``.
    """
    c = np.ascontiguousarray(counts, dtype=np.int64)
    k = np.ascontiguousarray(cuts, dtype=np.int64)
    R, E = c.shape
    if k.shape != (E, R + 1):
        raise ValueError(f"cuts: shape {k.shape}, expected [E, R + 1] = {(E, R + 1)} for counts {c.shape}")
    return _sweep_core(c, k)
