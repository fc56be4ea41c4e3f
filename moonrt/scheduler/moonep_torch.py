"""MoonEP planner in torch: the algorithm of :mod:`moonrt.scheduler.moonep` on the counts' device.

Same integer algorithm and tie-breaks as the numba planner (K3_SYSTEMS §6.2), written with a
fixed number of tensor steps and no ``.item()`` in the planning loop, so that a GPU run plans on
the GPU without a host synchronization per layer (§6.1: "no host synchronization per layer").
The plans are identical to :func:`moonrt.scheduler.moonep.plan` (tested on many random cases).

* Group balance: ``R - 1`` masked rounds (a round with no surplus left moves nothing).
* Hottest-first split, all donor groups at once: state ``quota [R, R]`` (group h -> receiver u) and
  ``rem [R, G]``; ``R - 1 + G`` steps bound the work of every group (each productive step zeroes a
  receiver's quota or an expert's remainder; a group has at most ``R - 1`` receivers and G experts).
"""

from __future__ import annotations

import torch

from moonrt.scheduler.moonep import MoonEPPlan, validate_counts

__all__ = ["plan_torch", "send_split_torch"]


def _check(counts: torch.Tensor, num_slots: int | None, total_tokens: int | None) -> int:
    """Input checks (these synchronize with the device once); returns B."""
    if not isinstance(counts, torch.Tensor):
        raise ValueError(f"counts: {type(counts).__name__}, expected a torch.Tensor [R, E] (use moonep.plan for numpy)")
    _, B, _ = validate_counts(counts, num_slots, total_tokens)
    return B


def plan_torch(counts: torch.Tensor, num_slots: int | None = None, total_tokens: int | None = None,
               validate: bool = True) -> MoonEPPlan:
    """Plan one MoE layer on ``counts.device``; identical to :func:`moonrt.scheduler.moonep.plan`.

    Args:
        counts: ``[R, E]`` integer tensor, ``counts[r, e]`` = assignments source rank ``r`` routes
            to expert ``e`` (the all-gathered router counts).
        num_slots: B, slots per rank (default ``E // R``).
        total_tokens: tokens over all ranks, allows unequal per-rank totals (§6.1); see ``plan``.
        validate: run the input checks (one device synchronization). With ``validate=False`` and
            ``num_slots >= E // R`` the whole plan is computed without a host synchronization;
            the caller then guarantees well-formed counts (equal per-rank totals unless
            ``total_tokens`` is given).

    Returns:
        :class:`MoonEPPlan` whose arrays are int64 tensors on ``counts.device``.
    """
    if not isinstance(counts, torch.Tensor) or counts.dim() != 2:
        _check(counts, num_slots, total_tokens)  # raises with the standard message
    R, E = counts.shape
    if validate or (num_slots is not None and num_slots < E // max(R, 1)):
        B = _check(counts, num_slots, total_tokens)
    else:
        if E % R != 0:
            raise ValueError(f"counts: E={E} experts is not divisible by R={R} ranks")
        B = E // R if num_slots is None else int(num_slots)
    G = E // R
    dev = counts.device
    c = counts.to(torch.int64)
    load = c.sum(0)  # [E]
    total = load.sum()
    ranks = torch.arange(R, device=dev)
    cap = total // R + (ranks < total % R).to(torch.int64)  # [R]
    bal = load.view(R, G).sum(1) - cap  # [R]
    quota = torch.zeros(R, R, dtype=torch.int64, device=dev)
    donor = torch.full((R,), -1, dtype=torch.int64, device=dev)
    for _ in range(R - 1):
        # One-element index tensors keep indexing on the device (a 0-d index may be read on the host).
        h = torch.argmax(bal).reshape(1)  # first maximum: smaller rank on ties
        u = torch.argmin(bal).reshape(1)
        m = torch.where(bal.index_select(0, h) > 0, -bal.index_select(0, u), 0)
        quota.index_put_((h, u), m, accumulate=True)
        donor.index_put_((u,), torch.where(m > 0, h, donor.index_select(0, u)))
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
    alloc = alloc3.reshape(E, R)

    home = torch.arange(E, device=dev) // G
    foreign = (alloc.T > 0) & (home[None, :] != ranks[:, None])  # [R, E]
    key = torch.where(foreign, torch.arange(E, device=dev)[None, :], E)
    key = torch.sort(key, dim=1).values[:, : min(B, E)]
    if B > E:
        key = torch.cat([key, torch.full((R, B - E), E, dtype=torch.int64, device=dev)], dim=1)
    copies = torch.where(key == E, -1, key)
    if B < G:
        need = foreign.sum(1)
        if int(need.max()) > B:
            r = int(torch.argmax(need))
            raise ValueError(f"num_slots: {B} slots per rank are too few for exact balance with these counts: "
                             f"rank {r} needs {int(need[r])} copies (E/R = {G} always suffices)")
    cuts = torch.zeros(E, R + 1, dtype=torch.int64, device=dev)
    cuts[:, 1:] = torch.cumsum(alloc, dim=1)
    return MoonEPPlan(alloc=alloc, copies=copies, capacity=cap, cuts=cuts, donor=donor, num_slots=B)


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
