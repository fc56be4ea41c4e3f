"""Baseline expert-placement policies for comparison with MoonEP (K3_SYSTEMS §6.4).

* **No redundancy**: every expert lives only on its home rank (rank h holds experts
  ``[h*G, (h+1)*G)``); a rank computes everything routed to its home group.
* **DeepSeek EPLB** (written from its published description, the "global" policy): from
  *predicted* per-expert loads, (1) replicate: give each of the ``num_redundant`` extra physical
  slots to the expert with the largest load per replica; (2) balanced packing: sort replicas by
  predicted per-replica load, descending, and put each onto the rank with the smallest predicted
  load among ranks that still have a free slot (every rank holds ``(E + num_redundant) / R``
  replicas). At run time each expert's actual assignments are split evenly over its replicas.
  The placement is static between re-plans; predictions come from past steps (e.g. an exponential
  moving average, :class:`MovingAverage`), so per-step fluctuation of expert shares shows up as
  imbalance.

A static policy is a table of physical replicas (:class:`ReplicaTable`: ``replica_expert [P]`` and
``replica_rank [P]``), fixed between re-plans; :meth:`ReplicaTable.placement` turns it and one call's
loads into the :class:`moonrt.scheduler.placement.Placement` every policy produces (the plain
all-to-all dispatcher runs :func:`no_redundancy` that way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moonrt.scheduler.placement import Placement

__all__ = ["ReplicaTable", "no_redundancy", "eplb", "rank_loads", "moved_assignments", "MovingAverage",
           "replica_moves"]


@dataclass(frozen=True)
class ReplicaTable:
    """A static placement policy's physical replicas (each expert's assignments of a call are split
    evenly over its replicas, remainder to the lower replica ids).

    Attributes:
        replica_expert: ``[P]`` int64, the expert of physical replica p (P = E + redundant).
        replica_rank: ``[P]`` int64, the rank holding replica p.
        num_ranks: R.
    """

    replica_expert: np.ndarray
    replica_rank: np.ndarray
    num_ranks: int

    @property
    def num_experts(self) -> int:
        return int(self.replica_expert.max()) + 1

    def replicas_per_expert(self) -> np.ndarray:
        """``[E]`` int64 number of replicas of each expert."""
        return np.bincount(self.replica_expert, minlength=self.num_experts)

    def holds(self) -> np.ndarray:
        """``[R, E]`` int64: replicas of expert e on rank r."""
        out = np.zeros((self.num_ranks, self.num_experts), np.int64)
        np.add.at(out, (self.replica_rank, self.replica_expert), 1)
        return out

    def placement(self, load: np.ndarray) -> Placement:
        """The :class:`Placement` of one call with per-expert ``load [E]`` (numpy int64 arrays).

        ``alloc[e, r]``: the shares of e's replicas on rank r; ``copies[r]``: the experts rank r
        holds replicas of that it does not home (rank h homes ``[h*E/R, (h+1)*E/R)``), ascending,
        padded with -1 to the largest count over ranks. Needs ``E % R == 0`` (home experts).
        """
        E, R = self.num_experts, self.num_ranks
        if E % R:
            raise ValueError(f"num_experts: {E} is not divisible by num_ranks={R}; expected home groups of E/R")
        share = _replica_shares(np.asarray(load, np.int64), self)
        alloc = np.zeros((E, R), np.int64)
        np.add.at(alloc, (self.replica_expert, self.replica_rank), share)
        foreign = (self.holds() > 0) & (np.arange(E)[None, :] // (E // R) != np.arange(R)[:, None])
        copies = np.full((R, int(foreign.sum(1).max())), -1, np.int64)
        for r in range(R):
            held = np.nonzero(foreign[r])[0]
            copies[r, :held.shape[0]] = held
        return Placement(alloc=alloc, copies=copies, capacity=alloc.sum(0))


def no_redundancy(num_experts: int, num_ranks: int) -> ReplicaTable:
    """Contiguous home placement: expert e on rank ``e // (E / R)``, no copies."""
    if num_ranks < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts: {num_experts} is not divisible by num_ranks={num_ranks}")
    e = np.arange(num_experts, dtype=np.int64)
    return ReplicaTable(e, e // (num_experts // num_ranks), num_ranks)


def eplb(weights: np.ndarray, num_ranks: int, num_redundant: int) -> ReplicaTable:
    """DeepSeek EPLB global policy: replicate the hottest-per-replica expert, then balanced packing.

    Args:
        weights: ``[E]`` float, predicted load of each expert.
        num_ranks: R.
        num_redundant: extra physical replicas in total; ``(E + num_redundant) % R == 0``.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or (w < 0).any():
        raise ValueError(f"weights: shape {w.shape}, expected a non-negative [E] vector of predicted loads")
    E = w.shape[0]
    P = E + num_redundant
    if num_redundant < 0 or num_ranks < 1 or P % num_ranks != 0:
        raise ValueError(f"num_redundant: {num_redundant}, expected >= 0 with (E + num_redundant) % R == 0 "
                         f"(E={E}, R={num_ranks})")
    # (1) replicate: each extra slot to the expert with the largest load per replica (ties: smaller id)
    cnt = np.ones(E, np.int64)
    replica_expert = np.empty(P, np.int64)
    replica_expert[:E] = np.arange(E)
    for i in range(E, P):
        e = int(np.argmax(w / cnt))
        replica_expert[i] = e
        cnt[e] += 1
    # (2) balanced packing of replicas (each carries w / cnt) onto R ranks with P / R slots each
    per = P // num_ranks
    rw = w[replica_expert] / cnt[replica_expert]
    order = np.argsort(-rw, kind="stable")
    pack_load = np.zeros(num_ranks)
    pack_n = np.zeros(num_ranks, np.int64)
    replica_rank = np.empty(P, np.int64)
    for p in order:
        free = pack_n < per
        r = int(np.argmin(np.where(free, pack_load, np.inf)))
        replica_rank[p] = r
        pack_load[r] += rw[p]
        pack_n[r] += 1
    return ReplicaTable(replica_expert, replica_rank, num_ranks)


def _replica_shares(load: np.ndarray, table: ReplicaTable) -> np.ndarray:
    """``[P]`` int64: actual assignments each replica computes (even split, remainder to lower replica ids)."""
    n = table.replicas_per_expert()
    e = table.replica_expert
    order = np.argsort(e, kind="stable")  # replica index among its expert's replicas, by replica id
    se = e[order]
    rank_in_expert = np.empty_like(e)
    rank_in_expert[order] = np.arange(e.shape[0]) - np.searchsorted(se, se, side="left")
    return load[e] // n[e] + (rank_in_expert < load[e] % n[e])


def rank_loads(load: np.ndarray, table: ReplicaTable) -> np.ndarray:
    """``[R]`` int64 assignments each rank computes under a static placement, for actual ``load [E]``."""
    share = _replica_shares(np.asarray(load, np.int64), table)
    return np.bincount(table.replica_rank, weights=share, minlength=table.num_ranks).astype(np.int64)


def moved_assignments(counts: np.ndarray, table: ReplicaTable) -> float:
    """Assignments sent to another rank (source rank != computing rank), in expectation.

    Each source's assignments to expert e are spread over e's replicas in proportion to what each
    replica computes; the part on the source's own rank stays local.
    """
    c = np.asarray(counts, np.float64)
    load = c.sum(0)
    share = _replica_shares(load.astype(np.int64), table).astype(np.float64)
    on_rank = np.zeros_like(c)  # [R, E] assignments of e computed on rank r
    np.add.at(on_rank, (table.replica_rank, table.replica_expert), share)
    frac = np.divide(on_rank, load[None, :], out=np.zeros_like(on_rank), where=load[None, :] > 0)
    return float(c.sum() - (c * frac).sum())


def replica_moves(old: ReplicaTable, new: ReplicaTable) -> int:
    """Expert replicas the new placement puts on a rank that did not hold them (weights to fetch)."""
    return int(np.maximum(new.holds() - old.holds(), 0).sum())


class MovingAverage:
    """Exponential moving average of per-expert loads, the prediction EPLB plans from.

    ``update(load [E])`` folds in one observed step; ``value`` is the current prediction ``[E]`` float64
    (None before the first update).
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha: {alpha!r}, expected 0 < alpha <= 1")
        self.alpha = alpha
        self.value: np.ndarray | None = None

    def update(self, load: np.ndarray) -> None:
        x = np.asarray(load, np.float64)
        self.value = x.copy() if self.value is None else (1.0 - self.alpha) * self.value + self.alpha * x
