"""Token and expert-weight movement of expert parallelism: layouts and differentiable all-to-alls.

The part of MoonEP (K3_SYSTEMS §6.3) that both EP dispatchers share: given the ``[R, E]`` routing
counts of the whole EP group and a placement (``alloc [E, R]``: assignments of expert e computed on
rank r; ``copies [R, B]``: expert held in each slot), every rank computes its own send and receive
layout locally, with no further communication:

- Per expert e the assignments are ordered by (source rank, position), where position is the
  assignment's index among this source rank's assignments of e in token order (``t * k + j``).
- The destination ranks split that order in rank order: rank d takes global positions
  ``[cut[e, d] - alloc[e, d], cut[e, d])`` with ``cut = alloc.cumsum(1)``.
- On a destination, rows are grouped by segment: segment e < E is home expert e, segment E + j is
  slot j; inside a segment rows are ordered by (source rank, position). ``cu_seqlens [E+B+1]``
  bounds the segments.

:class:`EPLayout` holds the permutations and split sizes; :func:`to_rows` / :func:`from_rows` move
per-assignment values to the expert rows and back (each is the other's adjoint), and
:class:`WeightLayout` with :func:`send_weights` / :func:`return_weight_grads` moves expert weights
from home ranks into slots and their gradients back. Nothing here knows about autograd; the
dispatchers (``moonep_dispatch.py``, ``ep_alltoall.py``) wrap these in ``torch.autograd.Function``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


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
    seg = torch.full((world, num_experts), -1, dtype=torch.int64)
    experts = torch.arange(num_experts)
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
    counts = counts.to(torch.int64).cpu()
    alloc = alloc.to(torch.int64).cpu()
    copies = copies.to(torch.int64).cpu()
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
    flat = topk_ids.reshape(-1).cpu()
    order = torch.argsort(flat, stable=True)
    dst = torch.empty_like(flat)
    dst[order] = torch.repeat_interleave(torch.arange(world).repeat(num_experts), n_send.t().reshape(-1))
    key = dst * num_segments + seg[dst, flat]
    send_perm = torch.argsort(key, stable=True)
    send_splits = torch.bincount(dst, minlength=world)

    # Receive side: each source's chunk is sorted by segment; regroup segment-major.
    mine = seg[rank] >= 0
    per_seg = torch.zeros(world, num_segments, dtype=torch.int64)
    per_seg[:, seg[rank, mine]] = n_recv[:, mine]
    seg_ids = torch.arange(num_segments).repeat(world)
    seg_of_recv = torch.repeat_interleave(seg_ids, per_seg.reshape(-1))
    recv_perm = torch.argsort(seg_of_recv, stable=True)
    rows = int(per_seg.sum())
    cu = torch.zeros(num_segments + 1, dtype=torch.int64)
    cu[1:] = per_seg.sum(0).cumsum(0)
    return EPLayout(
        rank=rank, world_size=world, tokens=s, top_k=k, rows=rows,
        send_perm=send_perm, send_inv=torch.argsort(send_perm), recv_perm=recv_perm,
        recv_inv=torch.argsort(recv_perm), send_splits=send_splits.tolist(),
        recv_splits=per_seg.sum(1).tolist(), cu_seqlens=cu,
    )


def _all_to_all(
    out_rows: int, send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    send = send.contiguous()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return send.clone()
    out = send.new_empty((out_rows, *send.shape[1:]))
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
    return out


def to_rows(values: torch.Tensor, layout: EPLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Move per-assignment values ``[s*k, C]`` (order ``t * k + j``) to this rank's expert rows ``[rows, C]``."""
    send = values.index_select(0, layout.send_perm.to(values.device))
    recv = _all_to_all(layout.rows, send, layout.recv_splits, layout.send_splits, group)
    return recv.index_select(0, layout.recv_perm.to(values.device))


def from_rows(rows: torch.Tensor, layout: EPLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Adjoint of :func:`to_rows`: expert rows ``[rows, C]`` back to per-assignment values ``[s*k, C]``."""
    recv = rows.index_select(0, layout.recv_inv.to(rows.device))
    send = _all_to_all(layout.tokens * layout.top_k, recv, layout.send_splits, layout.recv_splits, group)
    return send.index_select(0, layout.send_inv.to(rows.device))


# ---- expert weights into slots --------------------------------------------------------------------


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
    copies = copies.to(torch.int64).cpu()
    world, num_slots = copies.shape
    per_rank = num_experts // world
    home = torch.where(copies >= 0, copies // per_rank, -1)  # [R, B]
    send_d, send_j = (home == rank).nonzero(as_tuple=True)  # row-major: ordered by (d, j)
    send_local = copies[send_d, send_j] - rank * per_rank
    mine = home[rank]
    slots = torch.arange(num_slots)
    recv_slot = torch.cat([slots[mine == h] for h in range(world)])
    return WeightLayout(
        send_local=send_local, recv_slot=recv_slot,
        send_splits=torch.bincount(send_d, minlength=world).tolist(),
        recv_splits=[int((mine == h).sum()) for h in range(world)],
        num_slots=num_slots, filled=mine >= 0,
    )


def send_weights(
    flat_home: torch.Tensor, layout: WeightLayout, group: dist.ProcessGroup | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``flat_home [E/R, P]`` (this rank's home experts, flattened) -> ``[B, P]`` slot weights.

    Empty slots are zero. ``out`` (a ``[B, P]`` slot-pool buffer) is written in place if given.
    """
    send = flat_home.index_select(0, layout.send_local.to(flat_home.device))
    recv = _all_to_all(len(layout.recv_slot), send, layout.recv_splits, layout.send_splits, group)
    if out is None:
        out = flat_home.new_zeros(layout.num_slots, flat_home.shape[1])
    else:
        out.zero_()
    out.index_copy_(0, layout.recv_slot.to(out.device), recv)
    return out


def return_weight_grads(
    grad_slots: torch.Tensor, num_home: int, layout: WeightLayout, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Adjoint of :func:`send_weights`: ``grad_slots [B, P]`` -> summed home gradients ``[E/R, P]``."""
    send = grad_slots.index_select(0, layout.recv_slot.to(grad_slots.device))
    recv = _all_to_all(len(layout.send_local), send, layout.send_splits, layout.recv_splits, group)
    out = grad_slots.new_zeros(num_home, grad_slots.shape[1])
    out.index_add_(0, layout.send_local.to(out.device), recv)
    return out


# ---- differentiable versions ----------------------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, layout, group):  # type: ignore[override]
        s, k = layout.tokens, layout.top_k
        x_a = x.unsqueeze(1).expand(s, k, x.shape[1]).reshape(s * k, x.shape[1])
        w_a = weights.reshape(s * k, 1)
        ctx.layout, ctx.group = layout, group
        if x.dtype == weights.dtype:  # one all-to-all carries both
            rows = to_rows(torch.cat([x_a, w_a], dim=1), layout, group)
            return rows[:, :-1].contiguous(), rows[:, -1].contiguous()
        return to_rows(x_a, layout, group), to_rows(w_a, layout, group).squeeze(1)  # weights keep their dtype

    @staticmethod
    def backward(ctx, grad_x, grad_w):  # type: ignore[override]
        layout, group = ctx.layout, ctx.group
        s, k = layout.tokens, layout.top_k
        if grad_x.dtype == grad_w.dtype:
            g_a = from_rows(torch.cat([grad_x, grad_w.unsqueeze(1)], dim=1), layout, group).view(s, k, -1)
            gx_a, gw = g_a[:, :, :-1], g_a[:, :, -1]
        else:
            gx_a = from_rows(grad_x, layout, group).view(s, k, -1)
            gw = from_rows(grad_w.unsqueeze(1), layout, group).view(s, k)
        return gx_a.float().sum(1).to(grad_x.dtype), gw, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, layout, group, refill, *deps):  # type: ignore[override]
        s, k = layout.tokens, layout.top_k
        ctx.num_deps, ctx.refill = len(deps), refill
        y_a = from_rows(y, layout, group).view(s, k, y.shape[1])
        out = torch.einsum("skh,sk->sh", y_a.float(), weights.float()).to(y.dtype)
        ctx.save_for_backward(y_a, weights)
        ctx.layout, ctx.group = layout, group
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        y_a, weights = ctx.saved_tensors
        if ctx.refill is not None:  # the expert backward of this layer reads the shared slot pool next
            ctx.refill()
        s, k = ctx.layout.tokens, ctx.layout.top_k
        g32 = grad_out.float()
        g_ya = (g32.unsqueeze(1) * weights.float().unsqueeze(2)).to(y_a.dtype).reshape(s * k, -1)
        grad_y = to_rows(g_ya, ctx.layout, ctx.group)
        grad_w = torch.einsum("sh,skh->sk", g32, y_a.float()).to(weights.dtype)
        return (grad_y, grad_w, None, None, None) + (None,) * ctx.num_deps


def dispatch_tokens(
    x: torch.Tensor, weights: torch.Tensor, layout: EPLayout, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable dispatch: ``x [s, H]``, ``weights [s, k]`` -> ``(rows [rows, H], row_weights [rows])``.

    Row r carries the token and top-k weight of the assignment placed there by ``layout``. Backward
    is a combine: each token's gradient is the sum of its k rows' gradients, in token order.
    """
    return _Dispatch.apply(x, weights, layout, group)


def combine_tokens(
    y: torch.Tensor, weights: torch.Tensor, layout: EPLayout, group: dist.ProcessGroup | None,
    deps: tuple[torch.Tensor, ...] = (), refill: SlotRefill | None = None,
) -> torch.Tensor:
    """Differentiable combine: expert outputs ``y [rows, H]`` -> ``[s, H]``.

    ``out[t] = sum_j weights[t, j] * y[row(t, j)]``, summed on the source rank in fp32 (j
    ascending). Backward is a dispatch of ``weights * grad_out``; the gradient of
    ``weights [s, k]`` is ``<grad_out[t], y[row(t, j)]>``.

    ``deps``: the dispatch's rows and the prefetched slot weights. They get no gradient from here,
    but being inputs makes the dispatch and prefetch backward (each a collective) run on every rank,
    in the same order, even on a rank whose expert compute did not touch them (no slot rows).
    ``refill``: re-prefetches this layer's slots into a shared :class:`SlotPool` first thing in
    backward (K3_SYSTEMS §6.3), before the expert backward reads them.
    """
    return _Combine.apply(y, weights, layout, group, refill, *deps)


class SlotPool:
    """One ``[B, P]`` buffer of prefetched expert weights, shared by every layer's dispatcher (§6.3).

    ``P`` is the number of elements of one expert's weights (all tensors flattened). Slot tensors
    handed out by a prefetch are views of the buffer and stay valid until the next prefetch. The
    buffer is written outside autograd's version tracking; instead each layer's combine backward
    re-prefetches its copies (:class:`SlotRefill`) right before that layer's expert backward reads
    them, and the prefetch backward checks that the pool still holds its layer's copies (``owner``),
    so an overwrite in between is a RuntimeError, never wrong gradients.
    """

    def __init__(self, num_slots: int, numel_per_expert: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(num_slots, numel_per_expert, dtype=dtype, device=device)
        self.owner: object | None = None
        """Token of the prefetch whose copies the buffer holds now."""


class SlotRefill:
    """Re-prefetch one layer's slot copies into the shared pool (called by that layer's combine backward)."""

    def __init__(self, pool: SlotPool, home: tuple[torch.Tensor, ...], layout: WeightLayout,
                 group: dist.ProcessGroup | None, token: object) -> None:
        self.pool, self.home, self.layout, self.group, self.token = pool, home, layout, group, token

    def __call__(self) -> None:
        n = self.home[0].shape[0]
        flat = torch.cat([w.detach().reshape(n, w[0].numel()) for w in self.home], dim=1)
        send_weights(flat, self.layout, self.group, out=self.pool.buffer.data)
        self.pool.owner = self.token


class _FetchSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, group, pool, shapes, dep, *home):  # type: ignore[override]
        num_home = home[0].shape[0]
        flat = torch.cat([w.detach().reshape(num_home, w[0].numel()) for w in home], dim=1)
        ctx.pool = pool
        if pool is not None:  # write around version tracking: see SlotPool
            slots = send_weights(flat, layout, group, out=pool.buffer.data)
            ctx.token = pool.owner = object()
        else:
            slots = send_weights(flat, layout, group)
        ctx.layout, ctx.group, ctx.num_home = layout, group, num_home
        ctx.sizes = [w[0].numel() for w in home]
        return tuple(t.view(layout.num_slots, *shape) for t, shape in
                     zip(slots.split(ctx.sizes, dim=1), shapes))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        if ctx.pool is not None and ctx.pool.owner is not ctx.token:
            raise RuntimeError("MoonEP slot pool was overwritten by another layer's prefetch before this layer's "
                               "expert backward ran: combine must re-prefetch (pass the handle's refill)")
        g = torch.cat([gr.reshape(ctx.layout.num_slots, n) for gr, n in zip(grads, ctx.sizes)], dim=1)
        home = return_weight_grads(g, ctx.num_home, ctx.layout, ctx.group)
        out = [t.reshape(ctx.num_home, *gr.shape[1:]) for t, gr in zip(home.split(ctx.sizes, dim=1), grads)]
        return (None, None, None, None, None, *out)


def fetch_slot_weights(
    home: tuple[torch.Tensor, ...], layout: WeightLayout, group: dist.ProcessGroup | None,
    pool: SlotPool | None = None, dep: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], SlotRefill | None]:
    """Differentiable prefetch: home expert weights (each ``[E/R, *shape]``) -> slot weights ``[B, *shape]``.

    Backward sends each slot's gradient back to its home rank and sums it into the home weight's
    gradient (so slot gradients never appear as parameters). With a shared ``pool`` the slots are
    views of its buffer and the returned :class:`SlotRefill` must run before their backward (pass it
    to :func:`combine_tokens`); without one they are fresh tensors and the refill is None. ``dep``
    (the dispatched rows) orders the backward: the prefetch's collective runs before the dispatch's.
    """
    shapes = tuple(tuple(w.shape[1:]) for w in home)
    slots = _FetchSlots.apply(layout, group, pool, shapes, dep, *home)
    refill = None if pool is None else SlotRefill(pool, tuple(home), layout, group, pool.owner)
    return slots, refill
