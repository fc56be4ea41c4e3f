"""Expert-parallel layout math: where each token-expert assignment and each copied expert goes (K3_SYSTEMS §6.3).

Pure index arithmetic shared by both EP dispatchers (no collectives, no autograd), on the device of the
routing counts (the dispatchers pass host tensors: the splits become Python lists). Given the
``[R, E]`` routing counts of the whole EP group and a placement (``alloc [E, R]``: assignments of
expert e computed on rank r; ``copies [R, B]``: expert held in each slot; see
:class:`moonrt.scheduler.placement.Placement`), every rank computes its own send and receive layout
locally, with no further communication:

- Per expert e the assignments are ordered by (source rank, position), where position is the
  assignment's index among this source rank's assignments of e in token order (``t * k + j``).
- The destination ranks split that order in rank order: rank d takes global positions
  ``[cut[e, d] - alloc[e, d], cut[e, d])`` with ``cut = alloc.cumsum(1)``.
- On a destination, rows are grouped by segment: segment e < E is home expert e, segment E + j is
  slot j; inside a segment rows are ordered by (source rank, position). ``cu_seqlens [E+B+1]``
  bounds the segments.

:class:`EPLayout` holds the token permutations and split sizes, :class:`WeightLayout` the
point-to-point movement of copied experts' weights from home ranks into slots. The collectives that
use them are in :mod:`moonrt.comm.ep.collectives`, the slot buffer in :mod:`moonrt.comm.ep.slots`.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class EPLayout:
    """One rank's token layout for one dispatch (K3_SYSTEMS §6.3). All index tensors are int64.

    ``send_perm [s*k]``: send-buffer position -> assignment index ``t * k + j``.
    ``send_inv [s*k]``: the inverse permutation.
    ``recv_perm [rows]``: expert row -> receive-buffer position; ``recv_inv`` its inverse.
    ``send_splits`` / ``recv_splits``: rows exchanged with each peer (lists of R ints).
    ``cu_seqlens [num_segments + 1]``: segment boundaries over the rows.
    """

    rank: int
    world_size: int
    tokens: int
    top_k: int
    rows: int
    send_perm: torch.Tensor
    send_inv: torch.Tensor
    recv_perm: torch.Tensor
    recv_inv: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    cu_seqlens: torch.Tensor


def segment_table(alloc: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """``seg [R, E]`` int64: the row segment of expert e on rank d, or -1 if d cannot compute e.

    Home experts of d (``e // (E/R) == d``) are segment e; ``copies[d, j] = e`` makes it segment
    ``E + j``. ``alloc [E, R]`` is only used for its shape.
    """
    num_experts, world = alloc.shape
    per_rank = num_experts // world
    seg = torch.full((world, num_experts), -1, dtype=torch.int64, device=copies.device)
    experts = torch.arange(num_experts, device=copies.device)
    seg[experts // per_rank, experts] = experts
    d, j = (copies >= 0).nonzero(as_tuple=True)
    seg[d, copies[d, j]] = num_experts + j
    return seg


def build_layout(
    topk_ids: torch.Tensor, counts: torch.Tensor, alloc: torch.Tensor, copies: torch.Tensor, rank: int
) -> EPLayout:
    """Compute this rank's :class:`EPLayout` from its routing and the group-wide placement.

    ``topk_ids [s, k]`` int64 (this rank's routing), ``counts [R, E]`` int64 (every rank's
    assignments per expert), ``alloc [E, R]`` int64 with ``alloc.sum(1) == counts.sum(0)``,
    ``copies [R, B]`` int64 (-1 = empty slot). Raises ValueError if the placement asks a rank to
    compute an expert it neither homes nor holds in a slot.
    """
    world, num_experts = counts.shape
    s, k = topk_ids.shape
    num_segments = num_experts + copies.shape[1]
    counts = counts.to(torch.int64)
    alloc = alloc.to(counts.device, torch.int64)
    copies = copies.to(counts.device, torch.int64)
    seg = segment_table(alloc, copies)
    off = counts.cumsum(0) - counts  # [R, E]: first global position of each source rank's block
    cut = alloc.cumsum(1)  # [E, R]: end of each destination's range
    start = cut - alloc
    # Assignments of source src to expert e that land on destination dst: interval intersection.
    src_lo, src_hi = off.unsqueeze(1), (off + counts).unsqueeze(1)  # [R_src, 1, E]
    dst_lo, dst_hi = start.t().unsqueeze(0), cut.t().unsqueeze(0)  # [1, R_dst, E]
    n_send = (torch.minimum(src_hi[rank], dst_hi[0]) - torch.maximum(src_lo[rank], dst_lo[0])).clamp_min(0)
    n_recv = (torch.minimum(src_hi[:, 0], dst_hi[0, rank]) - torch.maximum(src_lo[:, 0], dst_lo[0, rank])).clamp_min(0)
    bad = (n_send > 0) & (seg < 0)
    if bool(bad.any()):
        d, e = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"placement sends expert {e} to rank {d}, which neither homes it nor holds it in a slot")

    # Send side: in (expert, position) order this rank's assignments of expert e go to destinations
    # 0..R-1 in turn, n_send[d, e] each (its block of e's global order meets d's range in that order).
    flat = topk_ids.reshape(-1).to(counts.device)
    order = torch.argsort(flat, stable=True)
    dst = torch.empty_like(flat)
    dst[order] = torch.repeat_interleave(torch.arange(world, device=flat.device).repeat(num_experts),
                                         n_send.t().reshape(-1))
    key = dst * num_segments + seg[dst, flat]
    send_perm = torch.argsort(key, stable=True)
    send_splits = torch.bincount(dst, minlength=world)

    # Receive side: each source's chunk is sorted by segment; regroup segment-major.
    mine = seg[rank] >= 0
    per_seg = torch.zeros(world, num_segments, dtype=torch.int64, device=counts.device)
    per_seg[:, seg[rank, mine]] = n_recv[:, mine]
    seg_ids = torch.arange(num_segments, device=counts.device).repeat(world)
    seg_of_recv = torch.repeat_interleave(seg_ids, per_seg.reshape(-1))
    recv_perm = torch.argsort(seg_of_recv, stable=True)
    rows = int(per_seg.sum())
    cu = torch.zeros(num_segments + 1, dtype=torch.int64, device=counts.device)
    cu[1:] = per_seg.sum(0).cumsum(0)
    return EPLayout(
        rank=rank, world_size=world, tokens=s, top_k=k, rows=rows,
        send_perm=send_perm, send_inv=torch.argsort(send_perm), recv_perm=recv_perm,
        recv_inv=torch.argsort(recv_perm), send_splits=send_splits.tolist(),
        recv_splits=per_seg.sum(1).tolist(), cu_seqlens=cu,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class WeightLayout:
    """Point-to-point movement of copied experts' weights from home ranks into slots (§6.3).

    ``send_local [n_send]``: local (home) expert index of each sent row, ordered by (destination,
    slot). ``recv_slot [n_recv]``: slot of each received row, ordered by (source, slot).
    """

    send_local: torch.Tensor
    recv_slot: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_slots: int
    filled: torch.Tensor
    """``[B]`` bool: slots that hold an expert."""


def build_weight_layout(copies: torch.Tensor, num_experts: int, rank: int) -> WeightLayout:
    """From ``copies [R, B]`` (expert per slot, -1 empty), this rank's weight send/receive layout."""
    copies = copies.to(torch.int64)
    world, num_slots = copies.shape
    per_rank = num_experts // world
    home = torch.where(copies >= 0, copies // per_rank, -1)  # [R, B]
    send_d, send_j = (home == rank).nonzero(as_tuple=True)  # row-major: ordered by (d, j)
    send_local = copies[send_d, send_j] - rank * per_rank
    mine = home[rank]
    slots = torch.arange(num_slots, device=copies.device)
    recv_slot = torch.cat([slots[mine == h] for h in range(world)])
    return WeightLayout(
        send_local=send_local, recv_slot=recv_slot,
        send_splits=torch.bincount(send_d, minlength=world).tolist(),
        recv_splits=[int((mine == h).sum()) for h in range(world)],
        num_slots=num_slots, filled=mine >= 0,
    )



# ---- one row per (token, destination rank) --------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DedupLayout:
    """Token rows of one dispatch sent once per (token, destination rank) (K3_SYSTEMS §6.3, MoonEP).

    The :class:`EPLayout` still says where every assignment goes and stays the unit of the static
    shapes (rank d computes exactly ``layout.rows`` assignment rows); this layout says how the token
    *activations* travel: a token whose k assignments land on m distinct ranks is sent m times, not k.

    Send side: ``pair_token [pairs_sent]`` (token of each sent row, ordered by (destination, token)),
    ``pair_send_splits`` (rows to each peer), ``assign_pair [s*k]`` (index of the sent row of each
    assignment ``t * k + j``, counted inside its destination's chunk: the metadata the receiver needs).
    Receive side: ``pair_recv_splits`` (rows from each peer, ordered by (source, source's order)),
    ``expand [rows]`` (received row of each expert row: expert rows are ``received[expand]``).
    ``pairs_sent <= s * k`` and ``pairs_recv <= rows``; both are routing dependent (internal buffers only).
    """

    pair_token: torch.Tensor
    pair_send_splits: list[int]
    pair_recv_splits: list[int]
    expand: torch.Tensor

    @property
    def pairs_sent(self) -> int:
        return int(self.pair_token.shape[0])

    @property
    def pairs_recv(self) -> int:
        return int(self.expand.max()) + 1 if self.expand.numel() else 0


def assignment_destinations(layout: EPLayout) -> torch.Tensor:
    """``dst [s*k]`` int64: the rank that computes each assignment ``t * k + j`` under ``layout``."""
    world = layout.world_size
    dst = torch.empty(layout.tokens * layout.top_k, dtype=torch.int64, device=layout.send_perm.device)
    ranks = torch.arange(world, device=dst.device)
    dst[layout.send_perm] = torch.repeat_interleave(
        ranks, torch.as_tensor(layout.send_splits, dtype=torch.int64, device=dst.device))
    return dst


def dedup_send_side(layout: EPLayout) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Distinct (destination, token) pairs of this rank: ``(pair_token, pair_send_splits, meta)``.

    ``meta [s*k]`` is in send-buffer order (``layout.send_perm``): for each sent assignment, the index
    of its token's row inside the chunk going to the same destination (what the receiver gets with
    the assignment, to find the row; MoonEP's "repeated destination is encoded, not re-sent").
    """
    s, k, world = layout.tokens, layout.top_k, layout.world_size
    dst = assignment_destinations(layout)
    tok = torch.arange(s, device=dst.device).repeat_interleave(k)
    keys, inverse = torch.unique(dst * max(s, 1) + tok, sorted=True, return_inverse=True)
    pair_dst = keys // max(s, 1)
    splits = torch.bincount(pair_dst, minlength=world)
    first = torch.cumsum(splits, 0) - splits  # first pair row of each destination's chunk
    local = inverse - first[dst]
    return keys % max(s, 1), splits.tolist(), local.index_select(0, layout.send_perm)


def dedup_recv_side(layout: EPLayout, meta_recv: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """From the metadata received with the assignments (``meta_recv [rows]``, receive-buffer order:
    chunks by source rank), ``(pair_recv_splits, expand [rows])`` in expert-row order."""
    world = layout.world_size
    dev = meta_recv.device
    src = torch.repeat_interleave(torch.arange(world, device=dev),
                                  torch.as_tensor(layout.recv_splits, dtype=torch.int64, device=dev))
    per_src = torch.zeros(world, dtype=torch.int64, device=dev)
    if meta_recv.numel():  # rows of a chunk are numbered 0..n-1 and each has an assignment: n = max + 1
        per_src.scatter_reduce_(0, src, meta_recv + 1, reduce="amax")
    first = torch.cumsum(per_src, 0) - per_src
    pair_of_buffer = first[src] + meta_recv
    return per_src.tolist(), pair_of_buffer.index_select(0, layout.recv_perm)


# ---- segments padded for grouped GEMMs ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PaddedLayout:
    """Expert rows with every segment padded to a multiple of ``token_padding`` (K3_SYSTEMS §6.3).

    ``cu_seqlens [G + 1]``: padded segment bounds (each a multiple of ``token_padding``); segment i
    holds its real rows first, then zero fill up to ``cu_seqlens[i + 1]``. ``row_index [rows]``:
    padded position of each unpadded row. ``pad_ranges [n, 2]``: the zero-fill ``[start, end)``
    ranges (segment tails, then the tail after the last segment up to ``padded_rows``).
    ``padded_rows``: the static row count, :func:`padded_rows` of the unpadded count.
    """

    token_padding: int
    padded_rows: int
    cu_seqlens: torch.Tensor
    row_index: torch.Tensor
    pad_ranges: torch.Tensor


def padded_rows(rows: int, max_segments: int, token_padding: int) -> int:
    """Static padded row count: ``rows`` real rows in at most ``max_segments`` non-empty segments, each
    rounded up to a multiple of ``token_padding``, fit in ``rows + min(max_segments, rows) * (p - 1)``
    rows, itself rounded up to a multiple of ``p`` (it depends on ``rows`` only, not on the routing)."""
    p = token_padding
    bound = rows + min(max_segments, rows) * (p - 1)
    return -(-bound // p) * p


def _padded_offsets(cu_seqlens: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu, sizes, cu_pad)``: the int64 offsets of ``cu_seqlens``, each segment's size, and the offsets of the
    segments padded to multiples of ``p`` (tensor ops only, on the device of ``cu_seqlens``)."""
    cu = cu_seqlens.to(torch.int64)
    sizes = cu[1:] - cu[:-1]
    cu_pad = torch.zeros_like(cu)
    cu_pad[1:] = ((sizes + p - 1) // p * p).cumsum(0)
    return cu, sizes, cu_pad


def build_padded(cu_seqlens: torch.Tensor, max_segments: int, token_padding: int) -> PaddedLayout:
    """Pad the segments of ``cu_seqlens [G + 1]`` (unpadded, from 0) to multiples of ``token_padding``."""
    p = token_padding
    cu, sizes, cu_pad = _padded_offsets(cu_seqlens, p)
    rows = int(cu[-1])
    total = padded_rows(rows, max_segments, p)
    if int(cu_pad[-1]) > total:
        raise ValueError(f"cu_seqlens: {int((sizes > 0).sum())} non-empty segments, expected at most "
                         f"max_segments = {max_segments}")
    seg = torch.repeat_interleave(torch.arange(sizes.shape[0], device=cu.device), sizes)
    row_index = torch.arange(rows, device=cu.device) - cu[:-1][seg] + cu_pad[:-1][seg]
    starts, ends = cu_pad[:-1] + sizes, cu_pad[1:]
    keep = ends > starts
    tail = torch.tensor([[int(cu_pad[-1]), total]], dtype=torch.int64, device=cu.device)
    ranges = torch.cat([torch.stack([starts[keep], ends[keep]], 1), tail[tail[:, 1] > tail[:, 0]]])
    return PaddedLayout(token_padding=p, padded_rows=total, cu_seqlens=cu_pad, row_index=row_index,
                        pad_ranges=ranges)


# ---- device layouts for the symmetric heap (issue 48 item 2) --------------------------------------
#
# The heap's receive slots are static: rank s writes its rows for rank d at d's slot rows ``[s * block, ...)``,
# ``block`` a bound every rank knows. So a layout for the heap needs no split sizes on the host: every row is named
# by (peer rank, row in that peer's block), both computed with tensor ops on the device of the routing, and a
# transfer in the other direction (combine, a backward) writes each row back to the block row it was read from.


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceLayout:
    """One rank's token layout for one dispatch over the heap, all on the routing's device (int64 tensors).

    ``dst [s*k]`` / ``rib [s*k]``: the rank that computes assignment ``t * k + j`` and the row of this rank's block
    in that rank's receive slot it is written to (rows of one destination numbered by (segment, assignment), the
    order :func:`build_layout` sends them in). ``src [rows]`` / ``src_rib [rows]``: for each expert row (segment
    major, then source rank, then the source's order: :class:`EPLayout`'s), the source rank and the row of that
    source's block it sits in. ``rows`` is static (``s * k``, see :func:`build_device_layout`), ``cu_seqlens
    [E + B + 1]`` on the device. ``block``: rows per source block (the dispatcher's ``capacity * k``; the dedup
    exchanges of token rows use blocks of ``block // k`` = capacity rows, a bound on one rank's tokens).
    """

    rank: int
    world_size: int
    tokens: int
    top_k: int
    rows: int
    block: int
    dst: torch.Tensor
    rib: torch.Tensor
    src: torch.Tensor
    src_rib: torch.Tensor
    cu_seqlens: torch.Tensor


def segment_table_device(num_experts: int, copies: torch.Tensor) -> torch.Tensor:
    """:func:`segment_table` without a host read (no ``nonzero``): ``seg [R, E]``, -1 where rank d cannot compute e."""
    world, num_slots = copies.shape
    per_rank = num_experts // world
    dev = copies.device
    seg = torch.full((world, num_experts + 1), -1, dtype=torch.int64, device=dev)
    experts = torch.arange(num_experts, device=dev)
    seg[experts // per_rank, experts] = experts
    col = torch.where(copies >= 0, copies, num_experts)  # empty slots write the spare column, dropped below
    seg.scatter_(1, col, (num_experts + torch.arange(num_slots, device=dev)).expand(world, num_slots).contiguous())
    return seg[:, :num_experts]


def build_device_layout(topk_ids: torch.Tensor, counts: torch.Tensor, alloc: torch.Tensor, copies: torch.Tensor,
                        rank: int, block: int) -> DeviceLayout:
    """:func:`build_layout`'s placement of every assignment, as :class:`DeviceLayout`, with tensor ops only.

    ``topk_ids [s, k]``, ``counts [R, E]``, ``alloc [E, R]``, ``copies [R, B]``: int64 on one device. The number of
    rows this rank computes must be known without reading the plan: the caller guarantees it is ``s * k`` (MoonEP
    with ``B >= E / R`` and every rank passing the same ``s``: ``plan.capacity == s * k``). Same rows, same order
    as :func:`build_layout` (the assignment a row carries is the same), so the data moved is bitwise the same.
    """
    world, num_experts = counts.shape
    s, k = topk_ids.shape
    num_segments = num_experts + copies.shape[1]
    dev = counts.device
    counts = counts.to(torch.int64)
    seg = segment_table_device(num_experts, copies)
    off = counts.cumsum(0) - counts  # [R, E]
    cut = alloc.to(dev, torch.int64).cumsum(1)  # [E, R]
    start = cut - alloc.to(dev, torch.int64)
    src_lo, src_hi = off.unsqueeze(1), (off + counts).unsqueeze(1)
    dst_lo, dst_hi = start.t().unsqueeze(0), cut.t().unsqueeze(0)
    n_send = (torch.minimum(src_hi[rank], dst_hi[0]) - torch.maximum(src_lo[rank], dst_lo[0])).clamp_min(0)  # [R, E]
    n_recv = (torch.minimum(src_hi[:, 0], dst_hi[0, rank]) - torch.maximum(src_lo[:, 0], dst_lo[0, rank])).clamp_min(0)

    # send side: the p-th assignment of expert e (token order) goes to the first d with cumsum(n_send[:, e]) > p
    flat = topk_ids.reshape(-1).to(dev)
    n = flat.shape[0]
    ranks = torch.arange(world, device=dev)
    order = torch.argsort(flat, stable=True)
    mine = counts[rank]
    first = mine.cumsum(0) - mine
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(n, device=dev) - first[flat[order]]
    dst = (n_send.cumsum(0)[:, flat] <= pos.unsqueeze(0)).sum(0)
    key = dst * num_segments + seg[dst, flat]
    send_perm = torch.argsort(key, stable=True)
    splits = (dst.unsqueeze(0) == ranks.unsqueeze(1)).sum(1)
    rib = torch.empty_like(flat)
    rib[send_perm] = torch.arange(n, device=dev) - (splits.cumsum(0) - splits)[dst[send_perm]]

    # receive side: per (source, segment) counts, each source's block sorted by segment; expert rows segment major
    has = seg[rank] >= 0
    per_seg = torch.zeros(world, num_segments + 1, dtype=torch.int64, device=dev)
    per_seg.index_add_(1, torch.where(has, seg[rank], num_segments), n_recv * has)
    per_seg = per_seg[:, :num_segments]
    in_block = per_seg.cumsum(1) - per_seg  # [R, G]: first row of segment g in source s's block
    seg_rows = per_seg.sum(0)
    cu = torch.zeros(num_segments + 1, dtype=torch.int64, device=dev)
    cu[1:] = seg_rows.cumsum(0)
    rows = s * k
    r = torch.arange(rows, device=dev)
    g = torch.searchsorted(cu[1:], r, right=True).clamp_max(num_segments - 1)
    i = r - cu[g]
    cs = per_seg.cumsum(0)  # [R, G]
    src = (cs[:, g] <= i.unsqueeze(0)).sum(0).clamp_max(world - 1)
    j = i - (cs - per_seg)[src, g]
    return DeviceLayout(rank=rank, world_size=world, tokens=s, top_k=k, rows=rows, block=block, dst=dst, rib=rib,
                        src=src, src_rib=in_block[src, g] + j, cu_seqlens=cu)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceDedup:
    """:class:`DedupLayout` for the heap, on the device: a token goes once to each rank that computes one of its
    assignments. ``pair_rib [R, s]``: the row of this rank's block in rank d's receive slot token t is written to
    (-1: none of t's assignments is computed on d; rows of one destination numbered in token order).
    ``row_rib [rows]``: for each expert row, the row of its source's block that holds its token."""

    pair_rib: torch.Tensor
    row_rib: torch.Tensor


def dedup_pairs_device(layout: DeviceLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair_rib [R, s], meta [s*k])``: the send side of :class:`DeviceDedup` and, per assignment, its token's
    row in its destination's block (the metadata the receiver gets with the assignment)."""
    s, k, world = layout.tokens, layout.top_k, layout.world_size
    dev = layout.dst.device
    tok = torch.arange(s, device=dev).repeat_interleave(k)
    sent = torch.zeros(world, s, dtype=torch.int64, device=dev)
    sent[layout.dst, tok] = 1
    pair_rib = torch.where(sent > 0, sent.cumsum(1) - 1, -1)
    return pair_rib, pair_rib[layout.dst, tok]


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceWeightLayout:
    """:class:`WeightLayout` for the heap, on the device. ``copies [R, B]`` (expert per slot, -1 empty); this rank
    ``rank`` homes experts ``[rank * E/R, (rank + 1) * E/R)``. Home rank h writes slot j of rank d at d's slot row
    ``h * B + j``. ``filled [B]`` bool on the device."""

    copies: torch.Tensor
    rank: int
    per_rank: int
    num_slots: int
    filled: torch.Tensor

    @property
    def home(self) -> torch.Tensor:
        """``[R, B]``: home rank of each slot's expert (-1 empty)."""
        return torch.where(self.copies >= 0, self.copies // self.per_rank, -1)


def build_device_weight_layout(copies: torch.Tensor, num_experts: int, rank: int) -> DeviceWeightLayout:
    copies = copies.to(torch.int64)
    world, num_slots = copies.shape
    return DeviceWeightLayout(copies=copies, rank=rank, per_rank=num_experts // world, num_slots=num_slots,
                              filled=copies[rank] >= 0)


def build_padded_device(cu_seqlens: torch.Tensor, max_segments: int, token_padding: int, rows: int) -> PaddedLayout:
    """:func:`build_padded` on the device of ``cu_seqlens`` for a known ``rows`` (no host read): the same
    ``cu_seqlens``, ``row_index`` and ``padded_rows``; ``pad_ranges [G + 1, 2]`` keeps one range per segment and the
    tail, empty ones (start == end) included (the count of non-empty ones is routing data)."""
    p = token_padding
    cu, sizes, cu_pad = _padded_offsets(cu_seqlens, p)
    total = padded_rows(rows, max_segments, p)
    r = torch.arange(rows, device=cu.device)
    seg = torch.searchsorted(cu[1:], r, right=True).clamp_max(sizes.shape[0] - 1)
    row_index = r - cu[:-1][seg] + cu_pad[:-1][seg]
    starts = torch.cat([cu_pad[:-1] + sizes, cu_pad[-1:]])
    ends = torch.cat([cu_pad[1:], cu_pad.new_full((1,), total)])
    return PaddedLayout(token_padding=p, padded_rows=total, cu_seqlens=cu_pad, row_index=row_index,
                        pad_ranges=torch.stack([starts, ends], 1))


AnyLayout = EPLayout | DeviceLayout
"""A token layout: the host one (split sizes, for the collectives) or the heap's device one."""
AnyDedup = DedupLayout | DeviceDedup
AnyWeightLayout = WeightLayout | DeviceWeightLayout
