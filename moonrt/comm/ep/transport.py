"""The transport seam of the EP dispatcher: what moves the routing counts, the token rows and the expert weights
between the EP ranks (K3_SYSTEMS §6.3).

:class:`moonrt.comm.ep.dispatch.EPDispatcher` computes the layouts (host data, the same whatever the transport)
and calls these verbs to move the data; :class:`EPTransport` is the protocol, :class:`CollectiveTransport` the
implementation over torch.distributed collectives of one EP group (``all_gather_single`` and ``all_to_all_single``:
:mod:`moonrt.comm.ep.collectives`, :mod:`moonrt.comm.ep.slots`); :class:`moonrt.comm.ep.heap.HeapTransport` the one
over a symmetric heap (one-sided puts, issue 48 item 2). A transport implements the same verbs, differentiable as
the collectives' are, and is passed as ``EPDispatcher(transport=)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moonrt.comm.ep.collectives import (
    Mover,
    build_dedup,
    combine_tokens,
    combine_tokens_dedup,
    dispatch_tokens,
    dispatch_tokens_dedup,
)
from moonrt.comm.ep.layout import AnyDedup, AnyLayout, AnyWeightLayout
from moonrt.comm.ep.slots import SlotPool, SlotRefill, fetch_slot_weights


@runtime_checkable
class EPTransport(Protocol):
    """The verbs an EP dispatcher moves data with, over one EP group of ``world_size`` ranks (this one ``rank``).

    - ``all_gather(row [n]) -> [R * n]``: every rank's row in rank order (the routing counts; int64, on the row's
      device).
    - ``dedup_layout(layout, device)``: the :class:`DedupLayout` of ``layout`` (one metadata exchange).
    - ``dispatch(x [s, H], weights [s, k], layout, dedup) -> (rows [rows, H], row_weights [rows])`` and
      ``combine(y [rows, H], weights [s, k] | None, layout, dedup, deps, refill, dtype) -> [s, H]``: differentiable,
      each the other's adjoint (with ``dedup`` the rows come weighted and ``weights`` is None).
    - ``fetch_slots(home, weight_layout, pool, dep) -> (slots, refill)``: differentiable prefetch of expert weights
      into slots (gradients return to the home rank).
    """

    world_size: int
    rank: int

    def all_gather(self, row: torch.Tensor) -> torch.Tensor: ...

    def dedup_layout(self, layout: AnyLayout, device: torch.device | None) -> AnyDedup: ...

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, layout: AnyLayout,
                 dedup: AnyDedup | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, y: torch.Tensor, weights: torch.Tensor | None, layout: AnyLayout, dedup: AnyDedup | None,
                deps: tuple[torch.Tensor, ...], refill: Callable[[], None] | None,
                dtype: torch.dtype) -> torch.Tensor: ...

    def fetch_slots(self, home: tuple[torch.Tensor, ...], layout: AnyWeightLayout, pool: SlotPool | None,
                    dep: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], SlotRefill | None]: ...


class RowTransport:
    """The row verbs every :class:`EPTransport` here shares: dispatch, combine, the dedup layout and the slot-weight
    prefetch, each one function of :mod:`moonrt.comm.ep.collectives` / :mod:`moonrt.comm.ep.slots` over ``mover``:
    a process group (:class:`CollectiveTransport`) or the heap's row exchange
    (:class:`moonrt.comm.ep.heap.HeapTransport`), so both backends run the same autograd and the same layouts."""

    mover: Mover

    def dedup_layout(self, layout: AnyLayout, device: torch.device | None) -> AnyDedup:
        return build_dedup(layout, self.mover, device)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, layout: AnyLayout,
                 dedup: AnyDedup | None) -> tuple[torch.Tensor, torch.Tensor]:
        if dedup is None:
            return dispatch_tokens(x, weights, layout, self.mover)
        return dispatch_tokens_dedup(x, weights, layout, dedup, self.mover)

    def combine(self, y: torch.Tensor, weights: torch.Tensor | None, layout: AnyLayout, dedup: AnyDedup | None,
                deps: tuple[torch.Tensor, ...], refill: Callable[[], None] | None,
                dtype: torch.dtype) -> torch.Tensor:
        if dedup is None:
            if weights is None:
                raise ValueError("weights: None, expected the router weights [s, k] (combine without dedup)")
            return combine_tokens(y, weights, layout, self.mover, deps=deps, refill=refill)
        return combine_tokens_dedup(y, layout, dedup, self.mover, deps=deps, refill=refill, dtype=dtype)

    def fetch_slots(self, home: tuple[torch.Tensor, ...], layout: AnyWeightLayout, pool: SlotPool | None,
                    dep: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], SlotRefill | None]:
        return fetch_slot_weights(home, layout, self.mover, pool=pool, dep=dep)


class CollectiveTransport(RowTransport):
    """:class:`EPTransport` over torch.distributed collectives of ``group`` (None: the default group; without an
    initialized process group, one rank and local copies)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = self.mover = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def all_gather(self, row: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return row
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=row.device)
        dist.all_gather_single(out, row, group=self.group)
        return out
