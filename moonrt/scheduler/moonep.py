"""MoonEP placement planner: exact per-rank balance with at most E/R expert copies per rank.

Implements K3_SYSTEMS §6.1-§6.3 (K3 report §5.2.1). Notation: R EP ranks, E routed experts,
``G = E // R`` experts per home group (rank ``h`` is home to experts ``[h*G, (h+1)*G)``), ``B``
prefetch slots per rank (default ``G``).

Algorithm (the constructive proof of §6.2; the kernel op ``moonep_greedy`` of :mod:`moonrt.ops.moonep.greedy`, whose
numba backend this planner runs and whose Triton backend :func:`moonrt.scheduler.moonep_torch.plan_device` runs on
a GPU):

1. *Group balance.* ``bal[h] = load(group h) - capacity[h]``. While some ``bal > 0``: donor
   ``h = argmax bal`` (ties: smaller rank), receiver ``u = argmin bal`` (ties: smaller rank);
   the donor's group gives ``-bal[u]`` assignments to ``u``; ``bal[u] = 0``, ``bal[h] += bal[u]``
   (``h`` may overshoot into a deficit and later receive from another group). Every rank receives
   from at most one home group, so it hosts at most ``G`` foreign experts; at most ``R - 1`` rounds.
2. *Hottest-first split.* Per donor group, repeatedly match the receiver with the largest
   remaining quota (ties: smaller rank) with the group's expert with the most remaining
   assignments (ties: larger expert id) and move ``min(quota, remaining)``. Whatever is left of
   the group stays on its home rank.

``method="prefix"`` is a closed form of the same construction (same guarantees, no step loop), which
:func:`moonrt.scheduler.moonep_torch.plan_prefix` computes in a fixed number of vectorized torch ops:

1. *Group balance on a line.* Donors (``bal > 0``) in order of surplus (largest first, ties: smaller
   rank) tile ``[0, T)`` with their surpluses, ``T`` the total surplus; receivers (``bal < 0``) in
   order of deficit (largest first, ties: smaller rank) tile ``[0, T)`` with their deficits. A
   receiver takes its whole deficit from the donor whose interval contains the receiver's start.
   A donor whose last receiver runs past the donor's end overshoots by that amount and is repaid
   by the next donor in order (which owns that point of the line). Every rank receives from at most
   one group; a donor never gives more than its load (the overshoot is less than a deficit <= CAP).
2. *North-west corner split.* Per donor group, receivers in order of quota (largest first, ties:
   smaller rank) then the home rank (the rest) tile one line, the group's experts hottest first
   (ties: larger id) tile another; ``alloc[e, u]`` is the overlap of expert e's and receiver u's
   intervals.

It needs somewhat more copies than the greedy (10-24% at E=896, R=64 and E=2,050; see
``benchmarks/bench_moonep_device.py``), which is why the greedy is the default, on every device.

*Fewer slots than copies* (``num_slots = B < E/R`` and some rank needs more than B copies): each
such rank keeps the B copies with the most assignments (ties: larger expert id); the assignments of
its other copies are computed on their experts' home rank. The balance is then no longer exact:
``plan.capacity`` is the work each rank really computes, ``plan.target`` the balanced target of
§6.1, ``plan.imbalance()`` their difference (zero on every rank whenever B copies suffice, which
E/R always do).

Everything is integer arithmetic with explicit tie-breaks, so every rank computes the identical
plan from the same all-gathered counts. :mod:`moonrt.scheduler.moonep_torch` plans on the counts' device (no host
synchronization) with identical plans: the greedy through the kernel registry (Triton on CUDA, numba on CPU, or
torch ops), the closed form in vectorized torch ops.

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

from moonrt.ops.moonep.greedy import group_balance, plan_core
from moonrt.scheduler.placement import Placement

__all__ = ["METHODS", "MoonEPPlan", "plan", "send_split", "transfer_matrix", "validate_counts", "capacities"]


METHODS = ("greedy", "prefix")


@dataclass(frozen=True)
class MoonEPPlan(Placement):
    """A MoonEP placement for one MoE layer (K3_SYSTEMS §6.3): a :class:`Placement` (``alloc``,
    ``copies``, ``capacity``) plus the planner's bookkeeping. Arrays are numpy (from :func:`plan`)
    or torch tensors on the counts' device (from :func:`moonrt.scheduler.moonep_torch.plan_torch`).

    Attributes (besides those of :class:`Placement`; ``capacity`` is the work each rank computes,
    ``alloc.sum(0)``, equal to ``target`` unless too few slots forced copies home):
        cuts: ``[E, R + 1]`` int64. Per-expert cut points over destination ranks: the exclusive
            cumulative sum of ``alloc[e]``; ``cuts[e, 0] = 0``, ``cuts[e, R] = load[e]``.
        donor: ``[R]`` int64. The home rank whose experts fill rank ``r``'s slots (-1: none).
        num_slots: B, slots per rank.
        target: ``[R]`` int64. The balanced target of §6.1 (floor/ceil of total / R).

    In numpy plans ``alloc`` and ``cuts`` are views of one ``[E, 2R + 1]`` buffer (row stride
    ``2R + 1``, not C-contiguous); use ``np.ascontiguousarray`` where a dense copy is needed.
    """

    cuts: Any
    donor: Any
    num_slots: int
    target: Any

    def imbalance(self) -> Any:
        """``[R]`` int64: ``capacity - target``, the work over (+) or under (-) the balanced target;
        all zero unless ``num_slots`` was too small for exact balance."""
        return self.capacity - self.target

    def to_numpy(self) -> MoonEPPlan:
        """The same plan with numpy arrays (a no-op for numpy plans)."""
        conv = lambda a: a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
        return MoonEPPlan(conv(self.alloc), conv(self.copies), conv(self.capacity), conv(self.cuts),
                          conv(self.donor), self.num_slots, conv(self.target))


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
def _before(keys: np.ndarray, a: int, b: int) -> bool:  # pragma: no cover
    """``(keys[a], a) < (keys[b], b)``: the total order :func:`_argsort` sorts by."""
    return keys[a] < keys[b] or (keys[a] == keys[b] and a < b)


@njit(cache=True)
def _sift(keys: np.ndarray, idx: np.ndarray, root: int, end: int) -> None:  # pragma: no cover
    """Restore the max-heap (by :func:`_before`) below ``root`` in ``idx[:end]``."""
    while True:
        child = 2 * root + 1
        if child >= end:
            return
        if child + 1 < end and _before(keys, idx[child], idx[child + 1]):
            child += 1
        if not _before(keys, idx[root], idx[child]):
            return
        idx[root], idx[child] = idx[child], idx[root]
        root = child


@njit(cache=True)
def _argsort(keys: np.ndarray) -> np.ndarray:  # pragma: no cover
    """Indices that sort ``keys`` (int64 [n]) ascending, ties by index: a heapsort, O(n log n).

    Not numba's ``np.argsort`` or ``np.sort``: the sort and the argsort helper numba generates share one qualified
    name and signature (``make_quicksort_impl.<locals>.run_quicksort1(int64[:])``) and differ only by an ABI tag that
    counts the functions the compiling process had compiled (numba issue #10128). Kernels cached by different
    processes (ranks, test workers, ``moonrt sim``) can carry the same tag for different code, and a process that
    loads both links one kernel to the other's helper: wrong plans or a segfault, seen with this planner on numba
    0.68.1 (``tests/scheduler/test_moonep_cache.py``). A function of ours has a name of its own: every tag of it is
    the same code."""
    n = keys.shape[0]
    idx = np.arange(n)
    for start in range(n // 2 - 1, -1, -1):
        _sift(keys, idx, start, n)
    for end in range(n - 1, 0, -1):
        idx[0], idx[end] = idx[end], idx[0]
        _sift(keys, idx, 0, end)
    return idx


@njit(cache=True)
def _prefix_core(load: np.ndarray, cap: np.ndarray, R: int, G: int) -> np.ndarray:  # pragma: no cover
    """Numba kernel of the closed form (``method="prefix"``, module docstring). Same in/out as the greedy's
    :func:`moonrt.ops.moonep.greedy.plan_core`. Written as two-pointer sweeps; ``moonep_torch.plan_prefix`` is its
    vectorized twin."""
    E = R * G
    bal = group_balance(load, cap, R, G)
    # Donors: surplus descending, ties smaller rank; receivers: deficit descending, ties smaller rank.
    # The keys are distinct, so any sort gives the same order.
    dkey = np.empty(R, np.int64)
    rkey = np.empty(R, np.int64)
    nd = 0
    nr = 0
    for r in range(R):
        if bal[r] > 0:
            dkey[nd] = -(bal[r] * R + (R - 1 - r))
            nd += 1
        elif bal[r] < 0:
            rkey[nr] = -(-bal[r] * R + (R - 1 - r))
            nr += 1
    dord = _argsort(dkey[:nd])
    rord = _argsort(rkey[:nr])
    dr = np.empty(nd, np.int64)
    rr = np.empty(nr, np.int64)
    for j in range(nd):
        dr[j] = (R - 1) - ((-dkey[dord[j]]) % R)
    for j in range(nr):
        rr[j] = (R - 1) - ((-rkey[rord[j]]) % R)
    quota = np.zeros((R, R), np.int64)
    k = 0
    P = bal[dr[0]] if nd > 0 else 0  # end of donor k's interval
    c = 0  # start of receiver j's interval
    for j in range(nr):
        while c >= P:  # the donor whose interval [P_{k-1}, P_k) holds c
            k += 1
            P += bal[dr[k]]
        quota[dr[k], rr[j]] += -bal[rr[j]]
        c += -bal[rr[j]]
    # Overshoot of donor k: first receiver boundary at or after P_k, minus P_k; the next donor repays it.
    P = 0
    c = 0
    j = 0
    for k in range(nd - 1):
        P += bal[dr[k]]
        while c < P:
            c += -bal[rr[j]]
            j += 1
        if c > P:
            quota[dr[k + 1], dr[k]] += c - P
    # North-west corner per group: receivers (quota desc, ties smaller rank) then home; experts hottest first.
    buf = np.zeros((E, 2 * R + 1), np.int64)
    ekey = np.empty(G, np.int64)
    ukey = np.empty(R, np.int64)
    for h in range(R):
        given = 0
        for u in range(R):
            given += quota[h, u]
            ukey[u] = -(quota[h, u] * R + (R - 1 - u))
        ukey[h] = 1  # the home rank takes the rest, after every receiver
        for i in range(G):
            ekey[i] = -(load[h * G + i] * G + i)
        uord = _argsort(ukey)
        eord = _argsort(ekey)
        a = 0  # walk the two lines together
        b = 0
        ua = 0
        ea = 0
        while a < R and b < G:
            u = uord[a]
            i = eord[b]
            ulen = quota[h, u] if u != h else load[h * G:(h + 1) * G].sum() - given
            ue = ua + ulen
            ee = ea + load[h * G + i]
            m = min(ue, ee) - max(ua, ea)
            if m > 0:
                buf[h * G + i, u] += m
            if ue <= ee:
                a += 1
                ua = ue
            else:
                b += 1
                ea = ee
    return buf


@njit(cache=True)
def _finish_core(buf: np.ndarray, R: int, G: int, B: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Slot policy, donors, slot table and cut points on ``buf [E, 2R + 1]`` (alloc | cuts), in place.

    A rank with more than ``B`` foreign experts keeps the B with the most assignments (ties: larger
    expert id) and sends the others' assignments back to their home rank. Returns ``(donor [R],
    slots [R, G])``: each rank's copied experts ascending, -1 padded; donor -1 where none."""
    E = R * G
    alloc = buf[:, :R]
    slots = np.full((R, G), -1, np.int64)
    donor = np.full(R, -1, np.int64)
    key = np.empty(G, np.int64)
    for r in range(R):
        h = -1
        n = 0
        for e in range(E):
            if alloc[e, r] > 0 and e // G != r:
                h = e // G
                key[n] = -(alloc[e, r] * E + e)
                n += 1
        if n > B:
            keep = key[_argsort(key[:n])[B - 1]] if B > 0 else -(2**62)
            for e in range(h * G, (h + 1) * G):
                if alloc[e, r] > 0 and -(alloc[e, r] * E + e) > keep:
                    alloc[e, h] += alloc[e, r]
                    alloc[e, r] = 0
            n = B
        if n > 0:
            donor[r] = h
            m = 0
            for e in range(h * G, (h + 1) * G):
                if alloc[e, r] > 0:
                    slots[r, m] = e
                    m += 1
    cuts = buf[:, R:]
    for e in range(E):
        acc = 0
        for r in range(R):
            acc += alloc[e, r]
            cuts[e, r + 1] = acc
    return donor, slots


def plan(counts: Any, num_slots: int | None = None, total_tokens: int | None = None,
         method: str = "greedy") -> MoonEPPlan:
    """Plan one MoE layer's expert placement with exact per-rank balance (K3_SYSTEMS §6.2).

    Args:
        counts: ``[R, E]`` integer (numpy or torch). ``counts[r, e]`` = token-expert assignments
            that source rank ``r`` routes to expert ``e``. Every rank must have the same total
            (``s * k``) unless ``total_tokens`` is given.
        num_slots: B, prefetch slots per rank; default ``E // R`` (the bound of §6.2 that always
            suffices). With fewer slots than a rank needs, that rank keeps its B hottest copies and
            the rest of their assignments are computed on the experts' home ranks (module
            docstring); ``plan.imbalance()`` reports the resulting deviation from exact balance.
        total_tokens: tokens over all ranks (``sum_r s_r``); allows per-rank totals to differ.
            Targets become ``floor(total_tokens * k / R)``, the first ``(total_tokens * k) % R``
            ranks one more (§6.1), with ``k = counts.sum() / total_tokens`` (must be an integer).
        method: ``"greedy"`` (§6.2's rounds, fewest copies) or ``"prefix"`` (its closed form, the
            plan :func:`moonrt.scheduler.moonep_torch.plan_prefix` computes in vectorized torch ops).

    Returns:
        A :class:`MoonEPPlan` with numpy arrays. Deterministic: identical counts give identical plans.

    Raises:
        ValueError: bad shapes/dtypes, negative counts, E not divisible by R, unequal per-rank
            totals without ``total_tokens``, or an unknown ``method``.
    """
    if method not in METHODS:
        raise ValueError(f"method: {method!r}, expected one of {METHODS}")
    arr, B, total = validate_counts(counts, num_slots, total_tokens)
    R, E = arr.shape
    G = E // R
    cap = capacities(total, R)
    load = arr.sum(0)
    buf = (plan_core if method == "greedy" else _prefix_core)(load, cap, R, G)
    donor, slots = _finish_core(buf, R, G, B)
    alloc, cuts = buf[:, :R], buf[:, R:]
    copies = slots[:, :B] if B <= G else np.pad(slots, ((0, 0), (0, B - G)), constant_values=-1)
    work = cap if B >= G else alloc.sum(0)
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=work, cuts=cuts, donor=donor, num_slots=B, target=cap)


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
