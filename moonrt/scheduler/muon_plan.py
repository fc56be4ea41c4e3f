"""Ownership plan for distributed Muon: every orthogonalization unit goes to exactly one data-parallel rank.

A **unit** is what one rank updates alone (K3 report §2.7 and its infrastructure section): one block of a
Muon matrix (a head's ``[head_dim, in]`` slice, one expert's matrix, a whole dense matrix), or one whole
AdamW parameter (embedding, norm, ...). Under ZeRO-1 the owner receives the summed gradient of its units,
keeps their optimizer state, updates them and all-gathers the new values (``moonrt.comm.zero.muon``).

:func:`plan_units` is a pure planner: greedy LPT (longest processing time first) on the units' cost --
Newton-Schulz FLOPs for Muon blocks (:func:`moonrt.ops.muon.ns_flops`, plus the element-wise work), a few
FLOPs per element for AdamW -- which is within 4/3 of the optimal makespan (Graham 1969). Ties break by unit
index and then by rank, so every rank computes the same plan with no communication.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

from torch import nn

from moonrt.ops.muon import NS_STEPS, Blocking, block_grid, ns_flops

MUON_ELEMENTWISE_FLOPS = 8
"""Per element of a Muon block outside Newton-Schulz: momentum lerp, Nesterov lerp, decay and update."""
ADAMW_FLOPS = 16
"""Per element of an AdamW parameter (two moment updates, bias corrections, sqrt, divide, decay, update)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Unit:
    """One orthogonalization (or AdamW) unit: ``rows x cols`` elements; ``muon`` False: an AdamW parameter
    (``rows`` = its element count, ``cols`` = 1)."""

    rows: int
    cols: int
    muon: bool = True

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def flops(self, ns_steps: int = NS_STEPS) -> int:
        """Optimizer FLOPs of one step of this unit."""
        if self.muon:
            return ns_flops(self.rows, self.cols, ns_steps) + MUON_ELEMENTWISE_FLOPS * self.numel
        return ADAMW_FLOPS * self.numel


@dataclasses.dataclass(frozen=True, slots=True)
class MuonPlan:
    """``owner[u]``: the rank that updates unit ``u``; ``load[r]``: rank ``r``'s FLOPs; ``sizes[r]``: its elements.

    ``units[r]``: rank ``r``'s units in increasing index order (the order of its segment of the flat
    gradient and parameter buffers); ``offsets[u]``: unit ``u``'s first element inside its owner's segment.
    """

    ranks: int
    owner: tuple[int, ...]
    load: tuple[int, ...]
    sizes: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @property
    def shard(self) -> int:
        """Elements per rank in the padded flat layout: the largest owner's size."""
        return max(self.sizes, default=0)

    @property
    def imbalance(self) -> float:
        """Largest rank FLOPs over the mean (1.0: perfect)."""
        mean = sum(self.load) / self.ranks
        return max(self.load) / mean if mean else 1.0


def plan_units(units: Sequence[Unit], ranks: int, ns_steps: int = NS_STEPS) -> MuonPlan:
    """Assign every unit to one of ``ranks`` ranks, balancing FLOPs (greedy LPT; deterministic)."""
    if ranks < 1:
        raise ValueError(f"ranks = {ranks}: expected an integer >= 1")
    cost = [u.flops(ns_steps) for u in units]
    order = sorted(range(len(units)), key=lambda i: (-cost[i], -units[i].numel, i))
    heap = [(0, 0, r) for r in range(ranks)]  # (flops, elements, rank): least loaded first
    owner = [0] * len(units)
    load, sizes = [0] * ranks, [0] * ranks
    for i in order:
        _, _, r = heapq.heappop(heap)
        owner[i] = r
        load[r] += cost[i]
        sizes[r] += units[i].numel
        heapq.heappush(heap, (load[r], sizes[r], r))
    mine: list[list[int]] = [[] for _ in range(ranks)]
    offsets = [0] * len(units)
    fill = [0] * ranks
    for i, r in enumerate(owner):
        mine[r].append(i)
        offsets[i] = fill[r]
        fill[r] += units[i].numel
    return MuonPlan(ranks=ranks, owner=tuple(owner), load=tuple(load), sizes=tuple(sizes),
                    units=tuple(tuple(m) for m in mine), offsets=tuple(offsets))


def unit_layout(model: nn.Module, blocks: Mapping[str, Blocking | None]
                ) -> tuple[list[tuple[str, nn.Parameter]], list[Unit], list[tuple[int, int, int, int]]]:
    """The trainable parameters, their units (Muon blocks of ``blocks``' parameters, whole AdamW parameters
    otherwise) and per unit ``(parameter index, block index or -1, rows, cols)``, in ``named_parameters`` order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    units: list[Unit] = []
    raw: list[tuple[int, int, int, int]] = []
    for i, (name, p) in enumerate(named):
        if name in blocks:
            stack, heads, a, b = block_grid(p.shape, blocks[name])
            units += [Unit(a, b)] * (stack * heads)
            raw += [(i, k, a, b) for k in range(stack * heads)]
        else:
            units.append(Unit(p.numel(), 1, muon=False))
            raw.append((i, -1, p.numel(), 1))
    return named, units, raw
