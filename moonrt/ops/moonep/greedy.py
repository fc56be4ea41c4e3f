"""MoonEP's greedy placement (K3_SYSTEMS §6.2) as a kernel op: ``torch`` and ``numba`` backends of ``moonep_greedy``.

The registry op ``moonep_greedy`` (:mod:`moonrt.ops.kernels`, family ``moonep``)::

    (load [R, G] int64, cap [R] int64) -> alloc3 [R, G, R] int64

``load[h, i]``: assignments of home group h's expert i (expert ``h * G + i``) over all source ranks; ``cap[r]``: rank
r's target (§6.1, ``sum(cap) == load.sum()``). ``alloc3[h, i, u]``: those of them computed on rank u, before any slot
policy. Integer arithmetic with fixed tie-breaks, so every backend returns the same tensor:

1. *Group balance.* ``bal[h] = load[h].sum() - cap[h]``. While some ``bal > 0``: donor ``h = argmax bal`` (ties:
   smaller rank), receiver ``u = argmin bal`` (ties: smaller rank); group h gives ``-bal[u]`` assignments to u,
   ``bal[u] = 0``, ``bal[h] += bal[u]`` (h may overshoot into a deficit and later receive from another group). Each
   receiver gets its quota from one group, so it hosts at most G foreign experts; at most ``R - 1`` rounds.
2. *Hottest-first split.* Per group, repeatedly match the receiver with the largest remaining quota (ties: smaller
   rank) with the group's expert with the most remaining assignments (ties: larger expert id) and move
   ``min(quota, remaining)``; the rest of the group stays on its home rank. Each productive step zeroes a quota or an
   expert's remainder: at most ``R - 1 + G`` steps per group.

Backends: ``numba`` (CPU; the planner :func:`moonrt.scheduler.moonep.plan` runs its kernel :func:`plan_core`),
``torch`` (any device, no host synchronization: ``R - 1`` masked rounds and ``R - 1 + G`` vectorized steps over all
groups at once, about ``10 * (2R + G)`` small ops) and ``triton`` (:mod:`moonrt.ops.moonep.triton`: both phases in
two kernel launches).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

__all__ = ["greedy_numba", "greedy_torch", "group_balance", "plan_core"]


@njit(cache=True)
def group_balance(load: np.ndarray, cap: np.ndarray, R: int, G: int) -> np.ndarray:  # pragma: no cover
    """Each home group's surplus over its rank's capacity: ``sum(load[h*G:(h+1)*G]) - cap[h]`` (int64 [R])."""
    bal = np.empty(R, np.int64)
    for h in range(R):
        s = 0
        for i in range(G):
            s += load[h * G + i]
        bal[h] = s - cap[h]
    return bal


@njit(cache=True)
def plan_core(load: np.ndarray, cap: np.ndarray, R: int, G: int) -> np.ndarray:  # pragma: no cover
    """The greedy in numba. load [E] int64, cap [R] int64 -> buf [E, 2R + 1] int64 with ``alloc`` in columns
    ``[0, R)`` (the planner fills the cut columns ``[R, 2R]``)."""
    E = R * G
    bal = group_balance(load, cap, R, G)
    quota = np.zeros((R, R), np.int64)  # quota[h, u]: assignments of group h computed on u
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
    return buf


def greedy_numba(load: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """``moonep_greedy`` on CPU tensors through :func:`plan_core` (one compiled call, no torch op per step)."""
    R, G = load.shape
    buf = plan_core(load.reshape(-1).numpy(), cap.numpy(), R, G)
    return torch.from_numpy(np.ascontiguousarray(buf[:, :R])).view(R, G, R)


def greedy_torch(load: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """``moonep_greedy`` in torch ops on ``load.device``, without a host synchronization (fixed step counts)."""
    R, G = load.shape
    dev = load.device
    bal = load.sum(1) - cap  # [R]
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
    rem = load.clone()
    groups = torch.arange(R, device=dev)
    for _ in range(R - 1 + G):
        u = torch.argmax(quota, dim=1)  # [R] receiver with the largest quota, smaller rank on ties
        e = G - 1 - torch.argmax(rem.flip(1), dim=1)  # [R] hottest expert, larger id on ties
        m = torch.minimum(quota[groups, u], rem[groups, e])
        quota.index_put_((groups, u), -m, accumulate=True)
        rem.index_put_((groups, e), -m, accumulate=True)
        alloc3.index_put_((groups, e, u), m, accumulate=True)
    alloc3[groups, :, groups] += rem  # the rest stays home (advanced index [R] x : x [R] -> [R, G])
    return alloc3
