"""The EP dispatcher: expert-parallel dispatch / combine with a placement policy (K3_SYSTEMS §6).

One :class:`EPDispatcher` per EP group, DeepEP style: sized once from ``(capacity, hidden, top_k,
num_experts)`` and given a placement policy (:mod:`moonrt.comm.ep.placement`: ``MoonEPPlacement``, the
balanced MoonEP plan with slots, or ``HomePlacement``, the plain all-to-all baseline) and a transport
(:mod:`moonrt.comm.ep.transport`: the collectives, or :mod:`moonrt.comm.ep.heap`: the symmetric heap); verbs in
pairs (``dispatch`` returns a :class:`EPHandle` that ``prefetch_weights`` and ``combine`` consume). Per MoE layer
call (§6.3):

1. every rank validates its input and all-gathers one int64 row ``[status, s, counts[E]]`` (on the
   data's device, over the EP group): the ``[R, E]`` routing counts plus an error flag, so bad input on
   one rank raises a ValueError on *every* rank instead of leaving the others blocked in the next
   collective (a rank that fails contributes a row of zeros, which the planner handles like any counts);
2. every rank runs the same deterministic placement. MoonEP's (the greedy of :func:`moonrt.scheduler.moonep.plan`)
   is computed by :func:`moonrt.scheduler.moonep_torch.plan_device` on the counts' device before anything is
   copied (on CUDA the kernel registry's Triton backend, on CPU its numba one; config ``kernels.moonep``); the
   table, the plan and this rank's top-k ids come to the host in one copy (the layout and NCCL's all-to-all split
   sizes are host data: that copy is the one synchronization per layer), and every rank computes its own
   send/receive layout (:mod:`moonrt.comm.ep.layout`). The baseline places on the host from the counts' copy.
   On the symmetric heap with MoonEP and ``num_slots >= E/R`` nothing comes to the host: the layout is computed
   on the device (:meth:`EPDispatcher._dispatch_device`; validation of the routing ids and of equal ``s`` behind
   ``MOONRT_DEBUG=1``), and :meth:`EPDispatcher.dispatch_async` runs the whole dispatch on the heap transport's
   worker thread while the caller computes (the K3 MoE layer's shared experts);
3. the transport's all-to-alls move tokens (and their top-k weights) into expert-grouped rows. With MoonEP rank d
   computes exactly ``plan.capacity[d]`` rows, one per assignment (``s * k`` when every rank passes the same
   s), whatever the routing: the output shape depends only on s. That holds for ``num_slots >= E/R``
   (the default); with fewer slots a rank that needed more copies computes fewer rows and its donor's
   home rank more (``plan.imbalance()``), so the row counts then follow the routing (as the baseline's always
   do). With ``dedup`` (the default) a
   token travels once per destination rank, however many of its k assignments land there: one
   int64 per assignment tells the receiver which token row it uses, the receiver expands the rows
   (and, in combine, sums them back into one row per token before the return trip); the router
   weights travel per assignment. Without it, one token row per assignment. Repeated experts in a
   token's top-k are valid: each is an assignment of its own. With ``token_padding`` p > 1 every
   segment is padded with zero rows to a multiple of p for grouped GEMMs (``handle.padding``: the
   padded bounds, the zero-fill ranges, and a static ``padded_rows``); combine reads only the real
   rows, so whatever the expert compute writes into the padding never reaches the output or a gradient;
4. ``prefetch_weights`` copies the planned experts' weights from their home ranks into the slot
   rows (from one :class:`SlotPool` that all layers may share); their gradients flow back to the
   home rank's parameter (the baseline has no slots: nothing moves);
5. ``combine`` returns each token's k weighted expert outputs summed in token order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moonrt.comm.ep.layout import (
    DedupLayout,
    DeviceDedup,
    DeviceLayout,
    DeviceWeightLayout,
    EPLayout,
    PaddedLayout,
    WeightLayout,
    build_device_layout,
    build_device_weight_layout,
    build_layout,
    build_padded,
    build_padded_device,
    build_weight_layout,
)
from moonrt.comm.ep.placement import MoonEPPlacement, PlacementPolicy
from moonrt.comm.ep.slots import SlotPool, SlotRefill
from moonrt.comm.ep.transport import CollectiveTransport, EPTransport
from moonrt.parallel.dispatch import Experts, ExpertWeights
from moonrt.scheduler.moonep_torch import to_host

DEBUG_ENV = "MOONRT_DEBUG"
"""Set to 1: the EP dispatcher reads every rank's validation back to the host on every path (the heap's device
layouts are then not used): routing ids out of range and unequal token counts are one clear ValueError on every
rank. Unset (the default), the heap path makes no host synchronization and checks only what the host knows."""

_ERRORS = {
    1: "x / topk_ids / topk_weights shapes or dtypes",
    2: "s larger than the configured capacity",
    3: "topk ids out of range",
}


@dataclasses.dataclass(frozen=True, slots=True)
class EPHandle:
    """What ``dispatch`` hands to ``prefetch_weights`` and ``combine`` (one MoE layer call).

    ``plan``: the :class:`~moonrt.scheduler.placement.Placement` of this call (MoonEP: the planner's ``MoonEPPlan``).
    ``counts [R, E]`` int64: the all-gathered routing counts. ``topk_weights [s, k]``: this rank's
    router weights (combine applies them). ``layout`` / ``weight_layout``: this rank's transport.

    Rows and assignments: every expert row is one token-expert assignment (``rows`` of them, the
    static ``plan.capacity[rank]``). With ``dedup`` set, the rows of one (source token, this rank)
    were received as one transfer row and expanded: ``dedup.expand[row]`` is that transfer row,
    ``dedup.pairs_recv <= rows`` of them came in, ``dedup.pairs_sent <= s * k`` went out.
    """

    plan: object
    counts: torch.Tensor
    topk_weights: torch.Tensor
    layout: EPLayout | DeviceLayout
    weight_layout: WeightLayout | DeviceWeightLayout
    rank: int
    dedup: DedupLayout | DeviceDedup | None = None
    padding: PaddedLayout | None = None
    """Set when ``token_padding > 1``: dispatch's rows are ``padding.padded_rows``, real row r sits at
    ``padding.row_index[r]``, ``padding.pad_ranges`` are zero fill."""
    row_weights: torch.Tensor | None = None
    """``[rows]`` router weight of each row (the dispatch's ``recv_weights``; dedup's weighted combine uses it)."""
    deps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The dispatched rows and prefetched slots, passed to combine to fix the backward order."""
    refill: list[SlotRefill] = dataclasses.field(default_factory=list)
    """Re-prefetch of the slots into the shared pool, run by combine's backward (pool only)."""

    @property
    def rows(self) -> int:
        """Assignment rows this rank computes (= ``plan.capacity[rank]``), padding excluded."""
        return self.layout.rows

    @property
    def out_rows(self) -> int:
        """Rows of dispatch's output and combine's input: ``padding.padded_rows``, else :attr:`rows`."""
        return self.layout.rows if self.padding is None else self.padding.padded_rows

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[E + B + 1]`` int64 segment bounds over dispatch's output rows (padded if ``padding``)."""
        return self.layout.cu_seqlens if self.padding is None else self.padding.cu_seqlens

    def home_cu_seqlens(self) -> torch.Tensor:
        """``[E/R + 1]`` int64: segment bounds of this rank's home experts (rows ``[0, home_rows)``)."""
        E = self.counts.shape[1]
        per_rank = E // self.counts.shape[0]
        return self.cu_seqlens[self.rank * per_rank:(self.rank + 1) * per_rank + 1]

    def slot_cu_seqlens(self) -> torch.Tensor:
        """``[B + 1]`` int64: segment bounds of the slots, relative to ``home_rows``."""
        E = self.counts.shape[1]
        return self.cu_seqlens[E:] - self.cu_seqlens[E]

    @property
    def home_rows(self) -> int:
        """Rows ``[0, home_rows)`` belong to home experts; ``[home_rows, out_rows)`` to the slots (and padding)."""
        return int(self.cu_seqlens[self.counts.shape[1]])


@dataclasses.dataclass(slots=True)
class EPCounters:
    """Cumulative counters of one dispatcher (forward calls only; backward mirrors them).

    ``token_bytes_sent [R]``: bytes of activations this rank sent to each peer (dispatch + combine;
    the entry for itself is a local copy). ``weight_bytes_sent [R]``: expert-weight bytes sent to
    each peer by ``prefetch_weights``. ``rows_computed``: rows received by the last dispatch.
    ``experts_prefetched``: slots filled, summed over calls. ``calls``: dispatches.
    ``rows_sent [R]``: token rows dispatch sent to each peer (one per (token, peer) with dedup, one
    per assignment without); ``assignments_sent [R]``: assignments sent to each peer. Token bytes
    count the activations (dispatch and combine), the router weight of each assignment and, with
    dedup, its 8-byte row index.
    """

    token_bytes_sent: list[int]
    weight_bytes_sent: list[int]
    rows_sent: list[int] = dataclasses.field(default_factory=list)
    assignments_sent: list[int] = dataclasses.field(default_factory=list)
    rows_computed: int = 0
    experts_prefetched: int = 0
    calls: int = 0
    pending: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Device-side increments of the heap path (no host read per layer): ``key -> [R]`` (or a scalar for
    ``experts_prefetched``), added into the fields by :meth:`settle` (one host copy, when a reader asks)."""

    def add_device(self, key: str, values: torch.Tensor) -> None:
        before = self.pending.get(key)
        self.pending[key] = values if before is None else before + values

    def settle(self) -> None:
        """Fold :attr:`pending` into the host counters (call before reading them)."""
        for key, values in self.pending.items():
            if key == "experts_prefetched":
                self.experts_prefetched += int(values)
            else:
                field = getattr(self, key)
                for d, n in enumerate(values.tolist()):
                    field[d] += n
        self.pending.clear()

    @classmethod
    def zeros(cls, world: int) -> EPCounters:
        return cls(token_bytes_sent=[0] * world, weight_bytes_sent=[0] * world, rows_sent=[0] * world,
                   assignments_sent=[0] * world)


class EPDispatcher:
    """Expert-parallel dispatch / combine over one EP group with a placement policy (K3_SYSTEMS §6.3).

    Args:
        group: the EP process group (``None``: the default group). Rank h homes experts
            ``[h*E/R, (h+1)*E/R)``.
        capacity: S, the most tokens a rank passes per call.
        hidden: H, width of the dispatched activations (K3: the latent width).
        top_k: k, experts per token.
        num_experts: E, divisible by the group size R.
        placement: where assignments are computed (:mod:`moonrt.comm.ep.placement`): ``MoonEPPlacement(num_slots,
            kernels)`` (B = ``num_slots`` prefetch slots per rank, default E/R, which always suffices, §6.2) or
            ``HomePlacement()`` (the all-to-all baseline: no slots, ``prefetch_weights`` returns ``[0, *shape]``).
        pool: optional :class:`SlotPool` shared with other layers' dispatchers.
        dedup: send a token once per destination rank (default) instead of once per assignment.
        token_padding: pad every segment to a multiple of this many rows (1: no padding).
        transport: what moves the data (:class:`moonrt.comm.ep.transport.EPTransport`; default the collectives
            of ``group``, :class:`~moonrt.comm.ep.transport.CollectiveTransport`). It must serve ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None, capacity: int, hidden: int, top_k: int,
                 num_experts: int, *, placement: PlacementPolicy, pool: SlotPool | None = None,
                 dedup: bool = True, token_padding: int = 1, transport: EPTransport | None = None) -> None:
        self.group = group
        self.transport: EPTransport = CollectiveTransport(group) if transport is None else transport
        self.world_size, self.rank = self.transport.world_size, self.transport.rank
        for name, value in (("capacity", capacity), ("hidden", hidden), ("top_k", top_k),
                            ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected an integer >= 1")
        if num_experts % self.world_size:
            raise ValueError(f"num_experts = {num_experts}: expected a multiple of the EP group size "
                             f"{self.world_size}")
        if top_k > num_experts:
            raise ValueError(f"top_k = {top_k}: expected <= num_experts ({num_experts})")
        if not isinstance(placement, PlacementPolicy):
            raise ValueError(f"placement = {placement!r}: expected a placement policy (MoonEPPlacement or "
                             "HomePlacement of moonrt.comm.ep.placement)")
        self.capacity, self.hidden, self.top_k, self.num_experts = capacity, hidden, top_k, num_experts
        self.experts_per_rank = num_experts // self.world_size
        self.placement = placement
        self.num_slots = placement.slots(self.experts_per_rank)
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots < 0:
            raise ValueError(f"num_slots = {self.num_slots!r}: expected an integer >= 0")
        if not isinstance(dedup, bool):
            raise ValueError(f"dedup = {dedup!r}: expected True or False")
        if isinstance(token_padding, bool) or not isinstance(token_padding, int) or token_padding < 1:
            raise ValueError(f"token_padding = {token_padding!r}: expected an integer >= 1")
        self.pool, self.dedup, self.token_padding = pool, dedup, token_padding
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self.device_layouts = (bool(getattr(self.transport, "device_layouts", False)) and not self.debug
                               and isinstance(placement, MoonEPPlacement)
                               and self.num_slots >= self.experts_per_rank)
        """Heap transport, MoonEP with ``B >= E/R`` (rows are ``s * k``, known on the host) and no debug switch:
        the layout is computed on the device (:func:`moonrt.comm.ep.layout.build_device_layout`) and the layer
        makes no host synchronization (:meth:`_dispatch_device`)."""
        self._counters = EPCounters.zeros(self.world_size)
        self.last_counts: torch.Tensor | None = None
        """``[R, E]`` int64 routing counts of the last dispatch (routing traces, metrics)."""
        self.last_rows: torch.Tensor | None = None
        """``[R]`` int64 rows every rank computed in the last dispatch (``plan.capacity``)."""

    @property
    def counters(self) -> EPCounters:
        """The traffic counters, with the heap path's device-side increments settled (one host copy if any)."""
        self._counters.settle()
        return self._counters

    @property
    def num_segments(self) -> int:
        """E + B: length of ``cu_seqlens`` minus one."""
        return self.num_experts + self.num_slots

    # ---- verbs ------------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               ranges: bool = True) -> tuple[int, str]:
        k, E = self.top_k, self.num_experts
        if x.dim() != 2 or x.shape[1] != self.hidden or not x.dtype.is_floating_point:
            return 1, f"x: shape {tuple(x.shape)} dtype {x.dtype}, expected a float tensor [s, {self.hidden}]"
        s = x.shape[0]
        if topk_ids.shape != (s, k) or topk_ids.dtype != torch.int64:
            return 1, f"topk_ids: shape {tuple(topk_ids.shape)} dtype {topk_ids.dtype}, expected int64 [{s}, {k}]"
        if topk_weights.shape != (s, k) or not topk_weights.dtype.is_floating_point:
            return 1, (f"topk_weights: shape {tuple(topk_weights.shape)} dtype {topk_weights.dtype}, "
                       f"expected a float tensor [{s}, {k}]")
        if s > self.capacity:
            return 2, f"x: s = {s} tokens, expected s <= capacity = {self.capacity}"
        if ranges and s and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= E):
            bad = topk_ids[(topk_ids < 0) | (topk_ids >= E)][0]
            return 3, f"topk_ids: value {int(bad)} out of range, expected expert ids in [0, {E})"
        return 0, ""

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
        """Send every token-expert assignment to the rank the plan computes it on.

        Args:
            x: ``[s, H]`` float, this rank's tokens (``s <= capacity``).
            topk_ids: ``[s, k]`` int64, expert ids in ``[0, E)`` (a token may list an expert twice:
                two assignments, both computed and both weighted).
            topk_weights: ``[s, k]`` float, router weights (applied by :meth:`combine`).

        Returns:
            ``recv_x [rows, H]``: the assignments this rank computes, grouped by segment (with
            ``token_padding`` p > 1: ``[handle.out_rows, H]``, each segment followed by zero rows up to a
            multiple of p, ``recv_weights`` 0 there; ``handle.padding.pad_ranges`` lists them).
            ``recv_weights [rows]``: their router weights (for kernels that fold the weight into the
            expert; then call ``combine(..., weighted=False)``).
            ``cu_seqlens [E+B+1]`` int64 (CPU): segment i spans ``cu_seqlens[i]:cu_seqlens[i+1]``;
            i < E is expert i (only home experts non-empty), E + j is ``handle.plan.copies[rank, j]``.
            ``handle``: for :meth:`prefetch_weights` and :meth:`combine`. ``rows == plan.capacity[rank]``.

        Raises ValueError on every rank of the group if any rank's input is invalid (on the heap path without
        ``MOONRT_DEBUG``: on the rank whose shapes are wrong, see :meth:`_dispatch_device`).
        """
        if self.device_layouts:
            return self._dispatch_device(x, topk_ids, topk_weights)
        try:
            code, message = self._check(x, topk_ids, topk_weights)
        except Exception as exc:  # never skip the all-gather below: the other ranks would hang in it
            code, message = 1, f"{type(exc).__name__}: {exc}"
        E, R = self.num_experts, self.world_size
        device = x.device if isinstance(x, torch.Tensor) else None  # the EP group's tensors live with the data
        row = torch.zeros(2 + E, dtype=torch.int64, device=device)
        row[0] = code
        if code == 0:
            row[1] = x.shape[0]
            row[2:] = torch.bincount(topk_ids.reshape(-1), minlength=E)
        table = self.transport.all_gather(row).view(R, 2 + E)
        on_device = self.placement.plan_on_device(table[:, 2:], self.num_slots)
        ids_host = None
        if on_device is None:
            table = table.cpu()  # the planner and the transport layout are host code: one copy of the counts
        elif code == 0 and topk_ids.device == table.device:  # plan, table and top-k ids come over in one copy
            on_device, (table, ids_host) = to_host(on_device, table, topk_ids)
        else:
            on_device, (table,) = to_host(on_device, table)
        if code:
            raise ValueError(f"EP dispatch (EP rank {self.rank}): {message}")
        if bool((table[:, 0] != 0).any()):
            bad = int((table[:, 0] != 0).nonzero()[0])
            reason = _ERRORS.get(int(table[bad, 0]), "invalid input")
            raise ValueError(f"EP dispatch: EP rank {bad} passed invalid input ({reason}); "
                             "see that rank's error for details")
        counts = table[:, 2:].contiguous()
        sizes = table[:, 1]
        total = int(sizes.sum()) if bool((sizes != sizes[0]).any()) else None
        if on_device is None:
            plan, placement = self.placement.place(counts, total, self.num_slots)
        else:
            plan, placement = on_device, on_device.to_torch()
        ids_host = topk_ids.cpu() if ids_host is None else ids_host
        layout = build_layout(ids_host, counts, placement.alloc, placement.copies, self.rank)
        if layout.rows != int(placement.capacity[self.rank]):
            raise RuntimeError(f"EP layout has {layout.rows} rows, the placement's capacity is "
                               f"{int(placement.capacity[self.rank])}: placement policy and layout disagree")
        wlayout = build_weight_layout(placement.copies, E, self.rank)
        dd = self.transport.dedup_layout(layout, device) if self.dedup else None
        recv_x, recv_w = self.transport.dispatch(x, topk_weights, layout, dd)
        row_weights, pad = recv_w, None
        if self.token_padding > 1:  # zero rows after every segment; combine reads only the real rows
            pad = build_padded(layout.cu_seqlens, self.experts_per_rank + self.num_slots, self.token_padding)
            idx = pad.row_index.to(recv_x.device)
            recv_x = recv_x.new_zeros(pad.padded_rows, recv_x.shape[1]).index_copy(0, idx, recv_x)
            recv_w = recv_w.new_zeros(pad.padded_rows).index_copy(0, idx, recv_w)
        handle = EPHandle(plan=plan, counts=counts, topk_weights=topk_weights, layout=layout,
                          weight_layout=wlayout, rank=self.rank, dedup=dd, padding=pad, row_weights=row_weights)
        handle.deps.append(recv_x)
        row_bytes = self.hidden * x.element_size()
        rows_sent = layout.send_splits if dd is None else dd.pair_send_splits
        per_assignment = topk_weights.element_size() + (0 if dd is None else 8)
        for d, (n, a) in enumerate(zip(rows_sent, layout.send_splits)):
            self._counters.token_bytes_sent[d] += n * row_bytes + a * per_assignment
            self._counters.rows_sent[d] += n
            self._counters.assignments_sent[d] += a
        self._counters.rows_computed = layout.rows
        self.last_counts, self.last_rows = counts, placement.capacity
        self._counters.calls += 1
        return recv_x, recv_w, handle.cu_seqlens, handle

    def _dispatch_device(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
        """:meth:`dispatch` with no host synchronization (the heap, MoonEP with ``B >= E/R``; issue 48 item 2).

        The counts are all-gathered and planned on the device as on the other path; the layout is
        :func:`~moonrt.comm.ep.layout.build_device_layout`'s, so nothing comes back to the host. What that costs:
        the host checks only shapes, dtypes and ``s <= capacity`` (a bad rank raises there and its peers see it
        die, :class:`~moonrt.comm.transport.shm.PeerDied`); routing ids in ``[0, E)`` and the same ``s`` on every
        rank (so ``plan.capacity == s * k``) are the caller's contract, checked with ``MOONRT_DEBUG=1`` (which
        takes the host path). The byte and row counters per peer are host data and are not updated here
        (``calls`` and ``rows_computed`` are)."""
        code, message = self._check(x, topk_ids, topk_weights, ranges=False)
        E, R, k = self.num_experts, self.world_size, self.top_k
        row = torch.zeros(2 + E, dtype=torch.int64, device=x.device)
        if code == 0:
            flat = topk_ids.reshape(-1)
            bad = (flat < 0) | (flat >= E)
            row[0] = bad.any() * 3  # on the device: the status of the routing ids, read by no one on the host
            row[1] = x.shape[0]
            row[2:].index_add_(0, torch.where(bad, 0, flat), (~bad).to(torch.int64))
        table = self.transport.all_gather(row).view(R, 2 + E)
        if code:
            raise ValueError(f"EP dispatch (EP rank {self.rank}): {message}")
        # every rank holds the same table: a device-side assert fails on every rank at once, with no host read (on
        # CPU it raises here; on CUDA it is an asynchronous device assert). MOONRT_DEBUG=1 names the bad rank.
        torch._assert_async((table[:, 0] == 0).all(), "EP dispatch: an EP rank passed topk ids outside [0, E) "
                            f"(E = {E}); rerun with {DEBUG_ENV}=1 for the rank and value")
        torch._assert_async((table[:, 1] == x.shape[0]).all(), f"EP dispatch: the EP ranks passed different token "
                            f"counts, this rank s = {x.shape[0]}; expected the same s on every rank on the heap "
                            f"path (set {DEBUG_ENV}=1 or parallel.ep_transport=collectives for unequal counts)")
        counts = table[:, 2:]
        plan = self.placement.plan_on_device(counts, self.num_slots)
        assert plan is not None  # MoonEP (device_layouts)
        block = self.capacity * k  # the most rows one rank sends another (s * k), the same on every rank
        layout = build_device_layout(topk_ids, counts, plan.alloc, plan.copies, self.rank, block)
        wlayout = build_device_weight_layout(plan.copies, E, self.rank)
        dd = self.transport.dedup_layout(layout, x.device) if self.dedup else None
        recv_x, recv_w = self.transport.dispatch(x, topk_weights, layout, dd)
        row_weights, pad = recv_w, None
        if self.token_padding > 1:
            pad = build_padded_device(layout.cu_seqlens, self.experts_per_rank + self.num_slots, self.token_padding,
                                      layout.rows)
            recv_x = recv_x.new_zeros(pad.padded_rows, recv_x.shape[1]).index_copy(0, pad.row_index, recv_x)
            recv_w = recv_w.new_zeros(pad.padded_rows).index_copy(0, pad.row_index, recv_w)
        handle = EPHandle(plan=plan, counts=counts, topk_weights=topk_weights, layout=layout,
                          weight_layout=wlayout, rank=self.rank, dedup=dd, padding=pad, row_weights=row_weights)
        handle.deps.append(recv_x)
        ranks = torch.arange(R, device=x.device)
        assignments = (layout.dst.unsqueeze(0) == ranks.unsqueeze(1)).sum(1)
        rows_sent = assignments if not isinstance(dd, DeviceDedup) else (dd.pair_rib >= 0).sum(1)
        per_assignment = topk_weights.element_size() + (0 if dd is None else 8)
        self._counters.add_device("token_bytes_sent",
                                 rows_sent * (self.hidden * x.element_size()) + assignments * per_assignment)
        self._counters.add_device("rows_sent", rows_sent)
        self._counters.add_device("assignments_sent", assignments)
        self._counters.rows_computed = x.shape[0] * k
        self.last_counts, self.last_rows = counts, plan.capacity
        self._counters.calls += 1
        return recv_x, recv_w, handle.cu_seqlens, handle

    @property
    def overlaps(self) -> bool:
        """:meth:`dispatch_async` runs the dispatch while the caller computes (the heap transport's worker)."""
        return callable(getattr(self.transport, "submit", None))

    def dispatch_async(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """:meth:`dispatch` started on the heap transport's worker thread (DeepEP's ``async_finish``): returns a
        :class:`moonrt.comm.ep.heap.PendingDispatch` at once, whose ``event`` is set when the rows are in and whose
        ``wait()`` returns what :meth:`dispatch` returns (bitwise the same, the same autograd). Meanwhile the caller
        computes what needs no rows (the shared experts) and makes no other call on this EP group."""
        submit = getattr(self.transport, "submit", None)
        if not callable(submit):
            raise ValueError(f"dispatch_async: transport {type(self.transport).__name__} has no worker, expected "
                             "the heap transport (parallel.ep_transport = shm / cuda)")
        return submit(lambda: self.dispatch(x, topk_ids, topk_weights))

    def prefetch_weights(self, handle: EPHandle, expert_weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Fill the slot rows with copies of the planned experts' weights, point-to-point from home ranks.

        Args:
            handle: from :meth:`dispatch`.
            expert_weights: this rank's home expert weights, each ``[E/R, *shape]`` (local expert
                ``i`` is global expert ``rank * E/R + i``).

        Returns:
            One ``[B, *shape]`` tensor per weight; slot j holds expert ``plan.copies[rank, j]``
            (zeros if empty). Differentiable: slot gradients are summed into the home rank's
            ``expert_weights`` gradients. Views of the :class:`SlotPool` buffer if one is set: valid
            until the next prefetch into that pool; :meth:`combine` re-prefetches them in backward.
        """
        epr = self.experts_per_rank
        for i, w in enumerate(expert_weights):
            if w.dim() < 1 or w.shape[0] != epr:
                raise ValueError(f"expert_weights[{i}]: shape {tuple(w.shape)}, expected [E/R = {epr}, ...]")
        numel = sum(w[0].numel() for w in expert_weights)
        if self.pool is not None:
            buf = self.pool.buffer
            if buf.shape != (self.num_slots, numel) or buf.dtype != expert_weights[0].dtype:
                raise ValueError(f"pool: buffer {tuple(buf.shape)} {buf.dtype}, expected "
                                 f"[{self.num_slots}, {numel}] {expert_weights[0].dtype}")
        if handle.refill or len(handle.deps) > 1:
            raise ValueError("prefetch_weights: already called for this handle (one prefetch per dispatch)")
        wl = handle.weight_layout
        slots, refill = self.transport.fetch_slots(tuple(expert_weights), wl, self.pool, handle.deps[0])
        handle.deps.extend(slots)
        if refill is not None:
            handle.refill.append(refill)
        nbytes = numel * expert_weights[0].element_size()
        if isinstance(wl, DeviceWeightLayout):  # device increments, settled when read
            self._counters.add_device("weight_bytes_sent", (wl.home == self.rank).sum(1) * nbytes)
            self._counters.add_device("experts_prefetched", wl.filled.sum())
            return slots
        for d, n in enumerate(wl.send_splits):
            self._counters.weight_bytes_sent[d] += n * nbytes
        self._counters.experts_prefetched += int(wl.filled.sum())
        return slots

    def combine(self, y: torch.Tensor, handle: EPHandle, weighted: bool = True) -> torch.Tensor:
        """Sum each token's k expert outputs back in token order.

        Args:
            y: ``[rows, H]`` expert outputs in the row order of :meth:`dispatch`.
            handle: from the matching :meth:`dispatch`.
            weighted: multiply by the router weights (``False`` if the expert already did, with
                ``recv_weights``).

        Returns:
            ``[s, H]``: ``out[t] = sum_j w[t, j] * y[row(t, j)]``, summed in fp32 with j ascending
            (with dedup: each destination sums its rows of t in fp32 and returns one row in
            ``y.dtype``, the source sums those in fp32).
        """
        if y.dim() != 2 or y.shape[0] != handle.out_rows:
            raise ValueError(f"y: shape {tuple(y.shape)}, expected [rows = {handle.out_rows}, H]")
        if handle.padding is not None:  # the real rows only: padding never reaches the output or a gradient
            y = y.index_select(0, handle.padding.row_index.to(y.device))
        refill = handle.refill[0] if handle.refill else None
        if handle.dedup is None:
            w = handle.topk_weights if weighted else torch.ones_like(handle.topk_weights)
            out = self.transport.combine(y, w, handle.layout, None, tuple(handle.deps), refill, y.dtype)
            back = handle.layout.recv_splits if isinstance(handle.layout, EPLayout) else None
        else:  # weight the rows here (fp32), sum each token's rows, send one row per token back
            acc = torch.promote_types(y.dtype, torch.float32)
            yw = y.to(acc) * handle.row_weights.to(acc).unsqueeze(1) if weighted else y
            out = self.transport.combine(yw, None, handle.layout, handle.dedup, tuple(handle.deps), refill, y.dtype)
            back = handle.dedup.pair_recv_splits if isinstance(handle.dedup, DedupLayout) else None
        row_bytes = y.shape[1] * y.element_size()
        if isinstance(back, list):
            for d, n in enumerate(back):
                self._counters.token_bytes_sent[d] += n * row_bytes
        else:  # device layouts: the rows returned to each source, settled when read
            layout = handle.layout
            assert isinstance(layout, DeviceLayout)
            per_src = torch.zeros(self.world_size, dtype=torch.int64, device=layout.src.device)
            if isinstance(handle.dedup, DeviceDedup):  # one row per (token, source): rows of a block are 0..n-1
                per_src.scatter_reduce_(0, layout.src, handle.dedup.row_rib + 1, reduce="amax")
            else:
                per_src.index_add_(0, layout.src, torch.ones_like(layout.src))
            self._counters.add_device("token_bytes_sent", per_src * row_bytes)
        return out

    def segment_weights(self, handle: EPHandle, experts: Experts) -> list[tuple[int, ExpertWeights]]:
        """The model's dispatcher seam (``moonrt.parallel.dispatch.Dispatcher``): weights for every segment.

        ``experts`` is duck-typed (a ``RoutedExperts`` sharded to this rank's home slice):
        ``first_expert``, ``num_local``, ``expert(global_id)`` and ``weights()`` (stacked
        ``[E/R, ...]`` tensors). Home segment e gets ``experts.expert(e)``; slot segment ``E + j``
        gets the prefetched copy of ``plan.copies[rank, j]`` (prefetched here, on every call and
        every rank, so the collective always runs).
        """
        first, per = self.rank * self.experts_per_rank, self.experts_per_rank
        if experts.first_expert != first or experts.num_local != per:
            raise ValueError(f"experts: hold [{experts.first_expert}, {experts.first_expert + experts.num_local}), "
                             f"expected this EP rank's home slice [{first}, {first + per})")
        out = [(e, experts.expert(e)) for e in range(first, first + per)]
        gate, up, down = self.prefetch_weights(handle, experts.weights())
        if isinstance(handle.weight_layout, DeviceWeightLayout):  # no host read: empty slots (zeros) have no rows
            return out + [(self.num_experts + j, (gate[j], up[j], down[j])) for j in range(self.num_slots)]
        filled = handle.weight_layout.filled.tolist()
        out += [(self.num_experts + j, (gate[j], up[j], down[j])) for j in range(self.num_slots) if filled[j]]
        return out
