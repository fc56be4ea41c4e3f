"""MoonEP planners on the counts' device: the algorithms of :mod:`moonrt.scheduler.moonep` without a host sync.

Same integer algorithms and tie-breaks as the numba planner (K3_SYSTEMS §6.2), with no ``.item()``,
so that a GPU run plans on the GPU without a host synchronization per layer (§6.1: "no host
synchronization per layer"). Plans are identical to :func:`moonrt.scheduler.moonep.plan` with the
same ``method`` (tested on many random cases and on the adversarial corpus).

* :func:`plan_device` (``method="greedy"``, the default plan): the greedy placement through the kernel registry's
  op ``moonep_greedy`` (:mod:`moonrt.ops.kernels`, config ``kernels.moonep``): on CUDA its Triton backend (two
  launches, :mod:`moonrt.ops.moonep.triton`), on CPU its numba backend (one compiled call), or torch ops anywhere;
  then the slot policy, copies and cut points in a fixed sequence of vectorized torch ops. A bounded number of ops
  per plan whatever E and R are, except with the ``torch`` backend (below).
* :func:`plan_torch`: :func:`plan_device` with the ``torch`` backend, the greedy rounds in torch ops: ``R - 1``
  masked rounds for group balance and ``R - 1 + G`` steps for the hottest-first split (each productive step zeroes
  a receiver's quota or an expert's remainder); about ``10 * (2R + G)`` small ops per plan.
* :func:`plan_prefix` (``method="prefix"``): the closed form, a fixed sequence of 64 vectorized torch ops (76 with
  the slot policy; view ops not counted) whatever E and R are: sorts, cumulative sums and ``searchsorted`` on
  ``[R, R + E/R]`` or smaller, one ``[E, R]`` scatter and cumulative sum. It costs 10-24% more copies than the
  greedy (``benchmarks/bench_moonep_device.py``).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from moonrt.ops.kernels import check_choice, kernel
from moonrt.scheduler.moonep import MoonEPPlan, validate_counts

__all__ = ["plan_device", "plan_prefix", "plan_torch", "send_split_torch", "to_host"]


def _check(counts: torch.Tensor, num_slots: int | None, total_tokens: int | None) -> int:
    """Input checks (these synchronize with the device once); returns B."""
    if not isinstance(counts, torch.Tensor):
        raise ValueError(f"counts: {type(counts).__name__}, expected a torch.Tensor [R, E] (use moonep.plan for numpy)")
    _, B, _ = validate_counts(counts, num_slots, total_tokens)
    return B


def _slots(counts: torch.Tensor, num_slots: int | None, total_tokens: int | None, validate: bool) -> int:
    """B after the input checks (all of them with ``validate``, else the shape checks only: no sync)."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 2:
        _check(counts, num_slots, total_tokens)  # raises with the standard message
    R, E = counts.shape
    if validate:
        return _check(counts, num_slots, total_tokens)
    if R < 1 or E % R != 0:
        raise ValueError(f"counts: E={E} experts is not divisible by R={R} ranks")
    B = E // R if num_slots is None else num_slots
    if isinstance(B, bool) or not isinstance(B, numbers.Integral) or B < 0:
        raise ValueError(f"num_slots: {num_slots!r}, expected an integer >= 0 (default E/R = {E // R})")
    return int(B)


def _finish(alloc3: torch.Tensor, quota: torch.Tensor, cap: torch.Tensor, B: int, ranks: torch.Tensor,
            gi: torch.Tensor) -> MoonEPPlan:
    """Slot policy, copies, donors and cut points from ``alloc3 [R, G, R]`` (group h's expert i computed
    on rank u), as ``moonep._finish_core``: a rank with more than B foreign experts keeps the B with the
    most assignments (ties: larger expert id); the others' assignments go back to their home rank.
    ``quota [R, R]``: group h's assignments computed on rank u != h (zero diagonal). Works on each
    rank's ``[G]`` share of its one donor group, never on ``[R, E]`` (but for the cut points).
    ``ranks``, ``gi``: ``arange(R)``, ``arange(G)`` on the device."""
    R, G, _ = alloc3.shape
    top, donor = quota.max(0)  # every rank receives from at most one group
    has = top > 0
    dc = donor * has  # the donor, 0 where none
    by_rank = alloc3.permute(0, 2, 1)  # [h, u, G] view
    seg = by_rank[dc, ranks] * has[:, None]  # [R, G]: rank u's share of its donor group
    if B < G:
        if B > 0:
            key = torch.where(seg > 0, seg * G + gi, -1)  # distinct per row among held experts
            kept = torch.where(key >= torch.topk(key, B, dim=1).values[:, B - 1:], seg, 0)
        else:
            kept = torch.zeros_like(seg)
            has = torch.zeros_like(has)
        drop = seg - kept
        by_rank.index_put_((dc, ranks), -drop, accumulate=True)
        by_rank.index_put_((dc, dc), drop, accumulate=True)  # computed at home
        seg = kept
    donor = torch.where(has, donor, -1)
    ids = torch.sort(torch.where(seg > 0, gi + dc[:, None] * G, R * G), dim=1).values[:, : min(B, G)]
    copies = torch.where(ids == R * G, -1, ids)
    if B > G:
        copies = torch.nn.functional.pad(copies, (0, B - G), value=-1)
    alloc = alloc3.view(R * G, R)
    cuts = torch.nn.functional.pad(torch.cumsum(alloc, dim=1), (1, 0))
    capacity = cap if B >= G else alloc.sum(0)
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=capacity, cuts=cuts, donor=donor, num_slots=B, target=cap)


def _targets(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(load [R, G], cap [R], tie [R])`` int64 on the counts' device: per home group and expert, the assignments
    over all sources; each rank's target (floor(total / R), the first ``total % R`` ranks one more, §6.1); and
    ``R - 1 - rank``, the tie-break key that is larger for smaller ranks."""
    R, E = counts.shape
    load = counts.sum(0, dtype=torch.int64).view(R, E // R)
    tie = torch.arange(R - 1, -1, -1, device=counts.device)
    return load, (load.sum() + tie) // R, tie


def plan_device(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
                validate: bool = True, kernels: str = "auto") -> MoonEPPlan:
    """Plan one MoE layer on ``counts.device``; identical to ``moonep.plan(counts, num_slots, total_tokens)`` (the
    greedy, the default plan).

    Args:
        counts: ``[R, E]`` integer tensor, ``counts[r, e]`` = assignments source rank ``r`` routes
            to expert ``e`` (the all-gathered router counts).
        num_slots: B, slots per rank (default ``E // R``); fewer than a rank needs: ``moonep.plan``.
        total_tokens: tokens over all ranks, allows unequal per-rank totals (§6.1); see ``moonep.plan``.
        validate: run the input checks (one device synchronization). With ``validate=False`` the
            whole plan is computed without a host synchronization; the caller then guarantees
            well-formed counts.
        kernels: backend of the greedy (``kernels.moonep``: ``auto`` = Triton on CUDA, numba on CPU; ``torch``,
            ``numba``, ``triton``), :mod:`moonrt.ops.kernels`.

    Returns:
        :class:`MoonEPPlan` whose arrays are int64 tensors on ``counts.device``.
    """
    check_choice("moonep", kernels)
    B = _slots(counts, num_slots, total_tokens, validate)
    R, E = counts.shape
    G = E // R
    dev = counts.device
    load, cap, _ = _targets(counts)
    alloc3 = kernel("moonep_greedy", kernels, dev)(load, cap)
    given = alloc3.sum(1).fill_diagonal_(0)  # [h, u]: group h's assignments computed on u != h
    return _finish(alloc3, given, cap, B, torch.arange(R, device=dev), torch.arange(G, device=dev))


def plan_torch(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
               validate: bool = True) -> MoonEPPlan:
    """:func:`plan_device` with the ``torch`` backend of the greedy (torch ops on any device, no host sync; its op
    count grows with R and E/R, see the module docstring)."""
    return plan_device(counts, num_slots, total_tokens, validate, kernels="torch")


def plan_prefix(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
                validate: bool = True) -> MoonEPPlan:
    """Plan one MoE layer on ``counts.device`` with the closed form in a fixed number of vectorized torch ops (with
    ``validate=False`` no host synchronization, the same ops whatever E and R are); identical to
    ``moonep.plan(counts, num_slots, total_tokens, method="prefix")``. Arguments and result as :func:`plan_device`.
    """
    B = _slots(counts, num_slots, total_tokens, validate)
    R, E = counts.shape
    G = E // R
    dev = counts.device
    load_RG, cap, tie = _targets(counts)  # [group h, expert i], targets, tie-break key
    group = load_RG.sum(1)  # [R]
    bal = group - cap
    # Group balance on a line. Row 0: donor positions (surplus descending, ties smaller rank, then the
    # non-donors with 0); row 1: receiver positions by deficit likewise. Keys are distinct.
    amount = torch.stack([bal, -bal]).clamp_min_(0)  # [2, R] by rank
    order = torch.sort(amount * R + tie, dim=1, descending=True).indices
    amount = torch.gather(amount, 1, order)  # [2, R] by position
    ends = torch.cumsum(amount, 1)
    d_ord, r_ord, P, c = order[0], order[1], ends[0], ends[1]
    k = torch.searchsorted(P[:-1], c - amount[1], right=True)  # donor position serving receiver j
    over = torch.gather(c, 0, torch.searchsorted(c, P)) - P  # donor k's overshoot (first boundary >= P_k)
    # quota[h, u]: receivers from their donor, an overshooting donor from the next donor (0 elsewhere).
    rows = torch.cat([d_ord[k], d_ord[1:]])
    cols = torch.cat([r_ord, d_ord[:-1]])
    quota = torch.zeros(R, R, dtype=torch.int64, device=dev).index_put_(
        (rows, cols), torch.cat([amount[1], over[:-1]]), accumulate=True)
    # North-west corner per group: receivers (quota descending, ties smaller rank) then the home rank
    # (the rest) and experts (load descending, ties larger id) tile the group's line; the merged
    # boundaries cut it into at most R + G - 1 pieces, each one (expert, rank) cell of alloc.
    u_ord = torch.sort((quota * R + tie).fill_diagonal_(-1), dim=1, descending=True).indices  # home last
    gi = torch.arange(G, device=dev)
    e_ord = torch.sort(load_RG * G + gi, dim=1, descending=True).indices
    u_end = torch.cumsum(torch.gather(quota, 1, u_ord[:, :-1]), 1)  # [R, R-1] receivers; home up to the group load
    e_end = torch.cumsum(torch.gather(load_RG, 1, e_ord[:, :-1]), 1)  # [R, G-1]; the last end is the group load
    ends = torch.sort(torch.cat([u_end, e_end, group[:, None]], 1), dim=1).values  # [R, R + G - 1]
    starts = torch.nn.functional.pad(ends[:, :-1], (1, 0))
    u = torch.gather(u_ord, 1, torch.searchsorted(u_end, starts, right=True))
    i = torch.gather(e_ord, 1, torch.searchsorted(e_end, starts, right=True))
    ranks = torch.arange(R, device=dev)
    alloc3 = torch.zeros(R, G, R, dtype=torch.int64, device=dev).index_put_(
        (ranks[:, None], i, u), ends - starts, accumulate=True)
    return _finish(alloc3, quota, cap, B, ranks, gi)


def send_split_torch(counts: torch.Tensor, cuts: torch.Tensor, src: int) -> torch.Tensor:
    """``[E, R]`` int64 on ``counts.device``: source ``src``'s assignments to expert ``e`` sent to rank ``d``.

    Torch form of :func:`moonrt.scheduler.moonep.send_split` (same overlap of the source's positions
    ``[S[src, e], S[src + 1, e])`` in expert e's (source rank, position) order with the destination's
    ``[cuts[e, d], cuts[e, d + 1])``, K3_SYSTEMS §6.3).
    """
    c = counts.to(torch.int64)
    lo_src = c[:src].sum(0)  # [E]
    hi_src = lo_src + c[src]
    lo = torch.maximum(cuts[:, :-1], lo_src[:, None])
    hi = torch.minimum(cuts[:, 1:], hi_src[:, None])
    return (hi - lo).clamp_min(0)


def to_host(plan: MoonEPPlan, *tensors: torch.Tensor) -> tuple[MoonEPPlan, list[torch.Tensor]]:
    """``plan`` (int64 tensors on a device) and ``tensors`` (int64) on the host in one device-to-host copy: the plan
    with numpy arrays (cut points recomputed from ``alloc`` there) and the tensors as CPU tensors of their shapes.
    The EP dispatcher's one synchronization per MoE layer (the transport layout is host code)."""
    parts = [plan.alloc, plan.copies, plan.capacity, plan.donor, plan.target, *tensors]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in parts]).cpu()
    out = list(torch.split(flat, [t.numel() for t in parts]))
    out = [o.view(t.shape) for o, t in zip(out, parts)]
    alloc, copies, capacity, donor, target = (o.numpy() for o in out[:5])
    cuts = np.zeros((alloc.shape[0], alloc.shape[1] + 1), np.int64)
    np.cumsum(alloc, axis=1, out=cuts[:, 1:])
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=capacity, cuts=cuts, donor=donor,
                      num_slots=plan.num_slots, target=target), out[5:]
