"""MoonEP planners in torch: the algorithms of :mod:`moonrt.scheduler.moonep` on the counts' device.

Same integer algorithms and tie-breaks as the numba planner (K3_SYSTEMS §6.2), with no ``.item()``,
so that a GPU run plans on the GPU without a host synchronization per layer (§6.1: "no host
synchronization per layer"). Plans are identical to :func:`moonrt.scheduler.moonep.plan` with the
same ``method`` (tested on many random cases and on the adversarial corpus).

* :func:`plan_device` (``method="prefix"``): the closed form, a fixed sequence of about 50 vectorized
  torch ops whatever E and R are (sorts, cumulative sums, ``searchsorted``, one ``[R, G, R]``
  interval overlap), so on a GPU a bounded number of kernel launches per plan.
* :func:`plan_torch` (``method="greedy"``): the greedy rounds, ``R - 1`` masked rounds for group
  balance and ``R - 1 + G`` steps for the hottest-first split (each productive step zeroes a
  receiver's quota or an expert's remainder); about ``10 * (2R + G)`` small ops per plan.
"""

from __future__ import annotations

import torch

from moonrt.scheduler.moonep import MoonEPPlan, validate_counts

__all__ = ["plan_device", "plan_torch", "send_split_torch"]


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
    if isinstance(B, bool) or not isinstance(B, int) or B < 0:
        raise ValueError(f"num_slots: {num_slots!r}, expected an integer >= 0 (default E/R = {E // R})")
    return B


def _finish(alloc: torch.Tensor, cap: torch.Tensor, B: int) -> MoonEPPlan:
    """Slot policy, copies, donors and cut points from ``alloc [E, R]`` (as ``moonep._finish_core``).

    A rank with more than B foreign experts keeps the B with the most assignments (ties: larger
    expert id); the others' assignments go back to their home rank."""
    E, R = alloc.shape
    G = E // R
    dev = alloc.device
    ranks = torch.arange(R, device=dev)
    eids = torch.arange(E, device=dev)
    at_home = (eids // G)[None, :] == ranks[:, None]  # [R, E]
    work = alloc.T  # [R, E]
    foreign = (work > 0) & ~at_home
    if B < G:
        key = torch.where(foreign, work * E + eids, -1)  # distinct per row among foreign experts
        if B > 0:
            kth = torch.topk(key, B, dim=1).values[:, B - 1:]
            keep = foreign & (key >= kth)
        else:
            keep = torch.zeros_like(foreign)
        back = torch.where(foreign & ~keep, work, 0).sum(0)  # [E] assignments sent home
        work = torch.where(foreign & ~keep, 0, work) + at_home * back
        alloc = work.T
        foreign = keep
    key = torch.where(foreign, eids, E)
    key = torch.sort(key, dim=1).values[:, : min(B, E)]
    if B > E:
        key = torch.cat([key, torch.full((R, B - E), E, dtype=torch.int64, device=dev)], dim=1)
    copies = torch.where(key == E, -1, key)
    donor = torch.where(copies[:, :1] >= 0, copies[:, :1] // G, -1).reshape(R) if B > 0 else \
        torch.full((R,), -1, dtype=torch.int64, device=dev)
    cuts = torch.nn.functional.pad(torch.cumsum(alloc, dim=1), (1, 0))
    capacity = cap if B >= G else alloc.sum(0)
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=capacity, cuts=cuts, donor=donor, num_slots=B, target=cap)


def plan_device(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
                validate: bool = True) -> MoonEPPlan:
    """Plan one MoE layer on ``counts.device`` in a fixed number of vectorized ops; identical to
    ``moonep.plan(counts, num_slots, total_tokens, method="prefix")``.

    Args:
        counts: ``[R, E]`` integer tensor, ``counts[r, e]`` = assignments source rank ``r`` routes
            to expert ``e`` (the all-gathered router counts).
        num_slots: B, slots per rank (default ``E // R``); fewer than a rank needs: ``moonep.plan``.
        total_tokens: tokens over all ranks, allows unequal per-rank totals (§6.1); see ``moonep.plan``.
        validate: run the input checks (one device synchronization). With ``validate=False`` the
            whole plan is computed without a host synchronization and with a number of ops that
            depends on neither E nor R; the caller then guarantees well-formed counts.

    Returns:
        :class:`MoonEPPlan` whose arrays are int64 tensors on ``counts.device``.
    """
    B = _slots(counts, num_slots, total_tokens, validate)
    R, E = counts.shape
    G = E // R
    dev = counts.device
    load = counts.to(torch.int64).sum(0)  # [E]
    total = load.sum()
    ranks = torch.arange(R, device=dev)
    cap = total // R + (ranks < total % R).to(torch.int64)  # [R]
    load_RG = load.view(R, G)
    bal = load_RG.sum(1) - cap  # [R]
    # Group balance on a line. Donor positions: surplus descending, ties smaller rank, non-donors last
    # (their surplus is 0); receiver positions likewise by deficit. Keys are distinct.
    sur_def = torch.stack([bal.clamp_min(0), (-bal).clamp_min(0)])  # [2, R]
    order = torch.sort(sur_def * R + (R - 1 - ranks), dim=1, descending=True).indices  # [2, R]
    amount = torch.gather(sur_def, 1, order)  # [2, R]: surpluses by donor position, deficits by receiver position
    ends = torch.cumsum(amount, dim=1)  # P_k (inclusive) and c_j
    d_ord, r_ord = order[0], order[1]
    P, c = ends[0].contiguous(), ends[1].contiguous()
    k = torch.searchsorted(P, c - amount[1], right=True).clamp_max(R - 1)  # donor position of each receiver
    c0 = torch.nn.functional.pad(c, (1, 0))  # receiver boundaries, 0 included
    X = torch.gather(c0, 0, torch.searchsorted(c0, P))  # first boundary at or after P_k
    over = (X - P)[:-1]  # overshoot of donor position k, repaid by position k + 1
    # quota[h, u] (flat h * R + u): receivers from their donor, overshooting donors from the next donor.
    flat = torch.cat([d_ord[k] * R + r_ord, d_ord[1:] * R + d_ord[:-1]])
    quota = torch.zeros(R * R, dtype=torch.int64, device=dev).index_add_(0, flat, torch.cat([amount[1], over]))
    quota = quota.view(R, R)
    quota = quota + torch.diag(load_RG.sum(1) - quota.sum(1))  # the home rank takes the rest of its group
    # North-west corner per group: receivers (quota desc, ties smaller rank, home last) x experts
    # (load desc, ties larger id); alloc[h*G + i, u] = overlap of their intervals on the group's line.
    ukey = torch.where(torch.eye(R, dtype=torch.bool, device=dev), -1, quota * R + (R - 1 - ranks))
    ekey = load_RG * G + torch.arange(G, device=dev)
    u_ord = torch.sort(ukey, dim=1, descending=True).indices
    e_ord = torch.sort(ekey, dim=1, descending=True).indices
    u_len = torch.gather(quota, 1, u_ord)
    e_len = torch.gather(load_RG, 1, e_ord)
    u_end = torch.empty_like(quota).scatter_(1, u_ord, torch.cumsum(u_len, 1))  # back to rank order
    e_end = torch.empty_like(load_RG).scatter_(1, e_ord, torch.cumsum(e_len, 1))
    u_start, e_start = u_end - quota, e_end - load_RG
    alloc = (torch.minimum(e_end[:, :, None], u_end[:, None, :])
             - torch.maximum(e_start[:, :, None], u_start[:, None, :])).clamp_min(0)  # [R, G, R]
    return _finish(alloc.reshape(E, R), cap, B)


def plan_torch(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
               validate: bool = True) -> MoonEPPlan:
    """Plan one MoE layer on ``counts.device`` with the greedy rounds; identical to
    :func:`moonrt.scheduler.moonep.plan` (``method="greedy"``). Arguments as :func:`plan_device`.

    Its op count grows with R and E/R (see the module docstring); :func:`plan_device` is the
    fixed-op-count planner for devices."""
    B = _slots(counts, num_slots, total_tokens, validate)
    R, E = counts.shape
    G = E // R
    dev = counts.device
    c = counts.to(torch.int64)
    load = c.sum(0)  # [E]
    total = load.sum()
    ranks = torch.arange(R, device=dev)
    cap = total // R + (ranks < total % R).to(torch.int64)  # [R]
    bal = load.view(R, G).sum(1) - cap  # [R]
    quota = torch.zeros(R, R, dtype=torch.int64, device=dev)
    for _ in range(R - 1):
        # One-element index tensors keep indexing on the device (a 0-d index may be read on the host).
        h = torch.argmax(bal).reshape(1)  # first maximum: smaller rank on ties
        u = torch.argmin(bal).reshape(1)
        m = torch.where(bal.index_select(0, h) > 0, -bal.index_select(0, u), 0)
        quota.index_put_((h, u), m, accumulate=True)
        bal.index_put_((h,), -m, accumulate=True)
        bal.index_put_((u,), m, accumulate=True)

    alloc3 = torch.zeros(R, G, R, dtype=torch.int64, device=dev)  # [group h, expert i, dest u]
    rem = load.view(R, G).clone()
    groups = ranks
    for _ in range(R - 1 + G):
        u = torch.argmax(quota, dim=1)  # [R] receiver with the largest quota, smaller rank on ties
        e = G - 1 - torch.argmax(rem.flip(1), dim=1)  # [R] hottest expert, larger id on ties
        m = torch.minimum(quota[groups, u], rem[groups, e])
        quota.index_put_((groups, u), -m, accumulate=True)
        rem.index_put_((groups, e), -m, accumulate=True)
        alloc3.index_put_((groups, e, u), m, accumulate=True)
    alloc3[groups, :, groups] += rem  # the rest stays home (advanced index [R] x : x [R] -> [R, G])
    return _finish(alloc3.reshape(E, R), cap, B)


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
