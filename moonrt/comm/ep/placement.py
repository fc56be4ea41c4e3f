"""Placement policies of the EP dispatcher: where every token-expert assignment of one MoE layer call is computed
(K3_SYSTEMS §6.2-6.4).

:class:`moonrt.comm.ep.dispatch.EPDispatcher` is one dispatcher (validation, counts all-gather, layout,
transport) given one of these small objects; the policy turns the all-gathered ``[R, E]`` routing counts into a
:class:`~moonrt.scheduler.placement.Placement`:

- :class:`MoonEPPlacement`: the MoonEP greedy (:func:`moonrt.scheduler.moonep.plan`), made on the counts' device by
  the kernel registry's planner (:func:`moonrt.scheduler.moonep_torch.plan_device`) with B slots per rank for
  copies of hot experts, so every rank computes ``s * k`` rows;
- :class:`HomePlacement`: the plain all-to-all baseline, every assignment on its expert's home rank (the
  no-redundancy policy, :func:`moonrt.scheduler.baselines.no_redundancy`), no slots: a rank computes as many rows
  as its home experts were chosen.

A policy sees only the counts (every rank passes the same ones), so every rank computes the same placement.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from moonrt.ops.kernels import check_choice
from moonrt.scheduler.baselines import no_redundancy
from moonrt.scheduler.moonep import MoonEPPlan, plan
from moonrt.scheduler.moonep_torch import plan_device
from moonrt.scheduler.placement import Placement


@runtime_checkable
class PlacementPolicy(Protocol):
    """What :class:`~moonrt.comm.ep.dispatch.EPDispatcher` asks of a placement policy.

    ``name``: the policy's config spelling (``parallel.ep_dispatcher``). ``slots(experts_per_rank)``: B, slots per
    rank for copies of other ranks' experts. ``plan_on_device(counts, num_slots)``: the placement of ``counts
    [R, E]`` int64 made on their device (no host synchronization), or None for a policy that places on the host;
    ``place(counts, total_tokens, num_slots)``: ``(plan, placement)`` from the host copy of ``counts`` (the plan
    the handle carries, and the same placement as dense int64 CPU tensors).
    """

    name: str

    def slots(self, experts_per_rank: int) -> int: ...

    def plan_on_device(self, counts: torch.Tensor, num_slots: int) -> MoonEPPlan | None: ...

    def place(self, counts: torch.Tensor, total_tokens: int | None, num_slots: int) -> tuple[object, Placement]: ...


class MoonEPPlacement:
    """MoonEP's placement (K3_SYSTEMS §6.2-6.3): the greedy planner with B slots per rank.

    Args:
        num_slots: B per rank (default None: E/R, which always suffices, §6.2).
        kernels: backend of the greedy planner (``kernels.moonep`` of :mod:`moonrt.ops.kernels`: ``auto`` = Triton
            on CUDA, numba on CPU; ``torch``, ``numba``, ``triton``). Every backend gives the same plan.
    """

    name = "moonep"

    def __init__(self, num_slots: int | None = None, kernels: str = "auto") -> None:
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0):
            raise ValueError(f"num_slots = {num_slots!r}: expected an integer >= 0")
        self.num_slots = num_slots
        self.kernels = check_choice("moonep", kernels)

    def slots(self, experts_per_rank: int) -> int:
        return experts_per_rank if self.num_slots is None else self.num_slots

    def plan_on_device(self, counts: torch.Tensor, num_slots: int) -> MoonEPPlan:
        """The MoonEP plan of ``counts [R, E]`` computed on their device without a host synchronization
        (``moonep.plan``'s greedy, bit for bit; the kernel backend ``self.kernels``)."""
        return plan_device(counts, num_slots=num_slots, validate=False, kernels=self.kernels)

    def place(self, counts: torch.Tensor, total_tokens: int | None, num_slots: int) -> tuple[object, Placement]:
        """The MoonEP planner on the host copy of ``counts [R, E]``: ``(MoonEPPlan, its placement as dense int64
        CPU tensors)``."""
        p = plan(counts.numpy(), num_slots=num_slots, total_tokens=total_tokens)
        return p, p.to_torch()


class HomePlacement:
    """The plain all-to-all baseline (K3_SYSTEMS §6.3-6.4): every assignment on its expert's home rank (rank h
    homes experts ``[h*E/R, (h+1)*E/R)``), no slots, no weight copies; ``capacity[r]`` = load of rank r's home
    experts, so under skewed routing the hottest rank computes far more than ``s * k`` rows."""

    name = "alltoall"

    def slots(self, experts_per_rank: int) -> int:
        return 0

    def plan_on_device(self, counts: torch.Tensor, num_slots: int) -> None:
        """Placed on the host (:meth:`place`)."""
        return None

    def place(self, counts: torch.Tensor, total_tokens: int | None, num_slots: int) -> tuple[object, Placement]:
        """The no-redundancy placement of ``counts [R, E]`` (host), as ``(placement, placement)``."""
        world, num_experts = counts.shape
        placement = no_redundancy(num_experts, world).placement(counts.sum(0).numpy()).to_torch()
        return placement, placement


PLACEMENTS: dict[str, type[MoonEPPlacement] | type[HomePlacement]] = {"moonep": MoonEPPlacement,
                                                                       "alltoall": HomePlacement}
"""``parallel.ep_dispatcher`` -> its placement policy."""


def placement_policy(kind: str, *, num_slots: int | None = None, kernels: str = "auto") -> PlacementPolicy:
    """The policy that ``parallel.ep_dispatcher = kind`` names (``num_slots`` / ``kernels``: MoonEP's only; the
    baseline has no slots and plans on the host). ValueError naming the field for any other kind."""
    if kind == "moonep":
        return MoonEPPlacement(num_slots, kernels)
    if kind == "alltoall":
        return HomePlacement()
    raise ValueError(f"parallel.ep_dispatcher = {kind!r}: expected one of " + ", ".join(PLACEMENTS))
