"""The expert placement of one MoE layer call: where every token-expert assignment is computed (K3_SYSTEMS §6).

One type for every policy. The MoonEP planner returns one per call
(:class:`moonrt.scheduler.moonep.MoonEPPlan` is a :class:`Placement` plus the planner's cut points
and donors); the static baselines (:mod:`moonrt.scheduler.baselines`: no redundancy, EPLB) give
one per call from their replica table and the call's loads (``ReplicaTable.placement``); the EP
dispatcher (:mod:`moonrt.comm.ep.dispatch`, its policies in :mod:`moonrt.comm.ep.placement`) moves tokens and
expert weights by it.

Notation: R EP ranks, E routed experts, ``G = E // R`` experts homed per rank (rank ``h`` homes
experts ``[h*G, (h+1)*G)`` and always holds their weights), B slots per rank for copies of other
ranks' experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Where every assignment of one MoE layer call is computed. Arrays are int64, numpy or torch.

    Attributes:
        alloc: ``[E, R]``. ``alloc[e, r]`` = assignments of expert ``e`` computed on rank ``r``;
            ``alloc.sum(1)`` is the per-expert load of the call.
        copies: ``[R, B]``. Expert ids held in rank ``r``'s slots (copies of experts homed
            elsewhere), ascending, then ``-1`` for empty slots. A rank computes only its home
            experts and the experts in its slots.
        capacity: ``[R]``. Assignments each rank computes, ``alloc.sum(0)``.

    In numpy MoonEP plans ``alloc`` is a view with a row stride of ``2R + 1`` (not C-contiguous);
    use ``np.ascontiguousarray`` (or :meth:`to_torch`) where a dense copy is needed.
    """

    alloc: Any
    copies: Any
    capacity: Any

    @property
    def num_ranks(self) -> int:
        return int(self.alloc.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.alloc.shape[0])

    @property
    def experts_per_rank(self) -> int:
        """G = E / R, home experts per rank."""
        return self.num_experts // self.num_ranks

    def copies_per_rank(self) -> Any:
        """``[R]`` int64: number of occupied slots (copied foreign experts) per rank."""
        return (self.copies >= 0).sum(1)

    def num_copies(self) -> int:
        """Total number of copied experts (occupied slots) over all ranks."""
        return int((self.copies >= 0).sum())

    def segment_sizes(self, rank: int) -> Any:
        """``[E + B]`` int64 rows rank ``rank`` computes per dispatch segment (§6.3): segment ``i < E``
        is home expert ``i`` (non-zero only for the rank's own experts), segment ``E + j`` is slot
        ``j`` (expert ``copies[rank, j]``; 0 for an empty slot). Sums to ``capacity[rank]``."""
        E, G = self.num_experts, self.experts_per_rank
        col = self.alloc[:, rank]
        home = col * 0
        home[rank * G:(rank + 1) * G] = col[rank * G:(rank + 1) * G]
        slot_ids = self.copies[rank]
        occupied = slot_ids >= 0
        slots = col[slot_ids.clip(0, E - 1)] * occupied
        if isinstance(col, np.ndarray):
            return np.concatenate([home, slots])
        import torch  # torch placements only: the numpy planners and ep-sim never load torch

        return torch.cat([home, slots])

    def to_torch(self) -> Placement:
        """``alloc``, ``copies``, ``capacity`` as dense int64 CPU tensors (what the EP data path reads).

        Returns a plain :class:`Placement` (a subclass's extra fields are dropped)."""
        import torch  # see segment_sizes

        def conv(a: Any) -> torch.Tensor:
            if isinstance(a, torch.Tensor):
                return a.detach().to("cpu", torch.int64).contiguous()
            return torch.from_numpy(np.ascontiguousarray(a)).to(torch.int64)

        return Placement(alloc=conv(self.alloc), copies=conv(self.copies), capacity=conv(self.capacity))
