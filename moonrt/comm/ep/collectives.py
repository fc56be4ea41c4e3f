"""Expert-parallel collectives and their autograd (K3_SYSTEMS §6.3): tokens to expert rows and back,
home expert weights into slots and their gradients back.

:func:`to_rows` / :func:`from_rows` move per-assignment values to this rank's expert rows and back
with one all-to-all each (each is the other's adjoint) under an :class:`~moonrt.comm.ep.layout.EPLayout`;
:func:`send_weights` / :func:`return_weight_grads` move flattened expert weights into slots and sum
slot gradients back into the home experts under a :class:`~moonrt.comm.ep.layout.WeightLayout`.
:func:`dispatch_tokens` and :func:`combine_tokens` are the differentiable dispatch and combine the
dispatcher's collective transport (``ep_transport.py``) calls: the backward of one is the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moonrt.comm.ep.layout import (
    AnyDedup,
    AnyLayout,
    AnyWeightLayout,
    DedupLayout,
    DeviceDedup,
    DeviceLayout,
    DeviceWeightLayout,
    EPLayout,
    dedup_pairs_device,
    dedup_recv_side,
    dedup_send_side,
)
from moonrt.ops.precision import at_least_fp32, no_autocast


@runtime_checkable
class RowExchange(Protocol):
    """What moves rows between the EP ranks when it is not a process group: the symmetric heap's one-sided puts
    (:class:`moonrt.comm.ep.heap.HeapExchange`). Passed where the functions below take ``group``.

    ``exchange_rows(out_rows, send [n, *row], out_splits, in_splits, block, send_index, recv_index)``: ``send``'s
    rows go to the ranks in order, ``in_splits[d]`` of them to rank ``d``; returns ``[out_rows, *row]``,
    ``out_splits[s]`` rows from rank ``s``, in rank order (``all_to_all_single``'s result, bitwise). ``block``: the
    most rows one rank sends another in this call, the same on every rank (None: the exchange's bound for token
    rows). ``send_index`` (int64): the rows sent are ``send[send_index]`` (gathered on the way out);
    ``recv_index``: the result is ``received[recv_index]`` (gathered on the way in); None: as they are."""

    def exchange_rows(self, out_rows: int, send: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      block: int | None, send_index: torch.Tensor | None = None,
                      recv_index: torch.Tensor | None = None) -> torch.Tensor: ...

    def scatter_rows(self, send: torch.Tensor, dst_rows: torch.Tensor, read: torch.Tensor, block: int,
                     src_rows: torch.Tensor | None = None) -> torch.Tensor: ...


Mover = dist.ProcessGroup | RowExchange | None
"""A process group (None: the default group) or a :class:`RowExchange`."""


def _all_to_all(
    out_rows: int, send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Mover,
    block: int | None = None,
) -> torch.Tensor:
    send = send.contiguous()
    if isinstance(group, RowExchange):
        return group.exchange_rows(out_rows, send, out_splits, in_splits, block)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return send.clone()
    out = send.new_empty((out_rows, *send.shape[1:]))
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
    return out


def _gather_exchange(out_rows: int, values: torch.Tensor, send_index: torch.Tensor, out_splits: list[int],
                     in_splits: list[int], group: Mover, recv_index: torch.Tensor) -> torch.Tensor:
    """``_all_to_all`` of ``values[send_index]``, then ``[recv_index]`` of the result; a :class:`RowExchange` does
    both gathers on the way (rows gathered straight into the peers' receive slots and out of this rank's)."""
    send_index, recv_index = send_index.to(values.device), recv_index.to(values.device)
    if isinstance(group, RowExchange):
        return group.exchange_rows(out_rows, values, out_splits, in_splits, None, send_index, recv_index)
    recv = _all_to_all(out_rows, values.index_select(0, send_index), out_splits, in_splits, group)
    return recv.index_select(0, recv_index)


def _device_exchange(group: Mover) -> RowExchange:
    if not isinstance(group, RowExchange):
        raise TypeError(f"a device layout moves rows over a symmetric heap exchange, got {type(group).__name__}")
    return group


def _dst_rows(dst: torch.Tensor, rib: torch.Tensor, layout: DeviceLayout) -> torch.Tensor:
    """``[R, n]``: row ``rank * block + rib[i]`` of rank ``dst[i]``'s slot, -1 for the other ranks."""
    ranks = torch.arange(layout.world_size, device=dst.device).unsqueeze(1)
    return torch.where(ranks == dst.unsqueeze(0), layout.rank * layout.block + rib.unsqueeze(0), -1)


def to_rows(values: torch.Tensor, layout: AnyLayout, group: Mover) -> torch.Tensor:
    """Move per-assignment values ``[s*k, C]`` (order ``t * k + j``) to this rank's expert rows ``[rows, C]``."""
    if isinstance(layout, DeviceLayout):
        return _device_exchange(group).scatter_rows(values, _dst_rows(layout.dst, layout.rib, layout),
                                                    layout.src * layout.block + layout.src_rib, layout.block)
    return _gather_exchange(layout.rows, values, layout.send_perm, layout.recv_splits, layout.send_splits, group,
                            layout.recv_perm)


def from_rows(rows: torch.Tensor, layout: AnyLayout, group: Mover) -> torch.Tensor:
    """Adjoint of :func:`to_rows`: expert rows ``[rows, C]`` back to per-assignment values ``[s*k, C]``."""
    if isinstance(layout, DeviceLayout):  # each row goes back to the block row it came from
        return _device_exchange(group).scatter_rows(rows, _dst_rows(layout.src, layout.src_rib, layout),
                                                    layout.dst * layout.block + layout.rib, layout.block)
    return _gather_exchange(layout.tokens * layout.top_k, rows, layout.recv_inv, layout.send_splits,
                            layout.recv_splits, group, layout.send_inv)


# ---- expert weights into slots --------------------------------------------------------------------


def send_weights(
    flat_home: torch.Tensor, layout: AnyWeightLayout, group: Mover, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``flat_home [E/R, P]`` (this rank's home experts, flattened) -> ``[B, P]`` slot weights.

    Empty slots are zero. ``out`` (a ``[B, P]`` slot-pool buffer) is written in place if given.
    """
    if isinstance(layout, DeviceWeightLayout):  # home rank h writes slot j of rank d at d's row h * B + j
        B, me, per, dev = layout.num_slots, layout.rank, layout.per_rank, flat_home.device
        copies, home = layout.copies.to(dev), layout.home.to(dev)
        local = (copies - me * per).clamp(0, per - 1)  # [R, B]: the home row of each slot this rank homes
        j = torch.arange(B, device=dev)
        dst_rows = torch.where(home == me, me * B + j, -1)  # only the slots this rank homes are written
        recv = _device_exchange(group).scatter_rows(flat_home, dst_rows, home[me].clamp_min(0) * B + j, B, local)
        filled = layout.filled.to(dev).unsqueeze(1)
        if out is None:
            return torch.where(filled, recv, 0)
        out.copy_(torch.where(filled, recv, 0))
        return out
    send = flat_home.index_select(0, layout.send_local.to(flat_home.device))
    recv = _all_to_all(len(layout.recv_slot), send, layout.recv_splits, layout.send_splits, group,
                       block=layout.num_slots)
    if out is None:
        out = flat_home.new_zeros(layout.num_slots, flat_home.shape[1])
    else:
        out.zero_()
    out.index_copy_(0, layout.recv_slot.to(out.device), recv)
    return out


def return_weight_grads(
    grad_slots: torch.Tensor, num_home: int, layout: AnyWeightLayout, group: Mover
) -> torch.Tensor:
    """Adjoint of :func:`send_weights`: ``grad_slots [B, P]`` -> summed home gradients ``[E/R, P]``."""
    if isinstance(layout, DeviceWeightLayout):  # slot j of rank me goes back to its home h at h's row me * B + j
        B, me, per, dev = layout.num_slots, layout.rank, layout.per_rank, grad_slots.device
        copies, home = layout.copies.to(dev), layout.home.to(dev)
        ranks = torch.arange(copies.shape[0], device=dev)
        dst_rows = torch.where(ranks.unsqueeze(1) == home[me].unsqueeze(0), me * B + torch.arange(B, device=dev), -1)
        recv = _device_exchange(group).scatter_rows(grad_slots, dst_rows, torch.arange(copies.numel(), device=dev), B)
        out = grad_slots.new_zeros(num_home + 1, grad_slots.shape[1])  # the last row takes the other homes' slots
        out.index_add_(0, torch.where(home == me, copies - me * per, num_home).reshape(-1), recv)
        return out[:num_home]
    send = grad_slots.index_select(0, layout.recv_slot.to(grad_slots.device))
    recv = _all_to_all(len(layout.send_local), send, layout.send_splits, layout.recv_splits, group,
                       block=layout.num_slots)
    out = grad_slots.new_zeros(num_home, grad_slots.shape[1])
    out.index_add_(0, layout.send_local.to(out.device), recv)
    return out


# ---- differentiable versions ----------------------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, layout, group):
        s, k = layout.tokens, layout.top_k
        x_a = x.unsqueeze(1).expand(s, k, x.shape[1]).reshape(s * k, x.shape[1])
        w_a = weights.reshape(s * k, 1)
        ctx.layout, ctx.group = layout, group
        if x.dtype == weights.dtype:  # one all-to-all carries both
            rows = to_rows(torch.cat([x_a, w_a], dim=1), layout, group)
            return rows[:, :-1].contiguous(), rows[:, -1].contiguous()
        return to_rows(x_a, layout, group), to_rows(w_a, layout, group).squeeze(1)  # weights keep their dtype

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        layout, group = ctx.layout, ctx.group
        s, k = layout.tokens, layout.top_k
        if grad_x.dtype == grad_w.dtype:
            g_a = from_rows(torch.cat([grad_x, grad_w.unsqueeze(1)], dim=1), layout, group).view(s, k, -1)
            gx_a, gw = g_a[:, :, :-1], g_a[:, :, -1]
        else:
            gx_a = from_rows(grad_x, layout, group).view(s, k, -1)
            gw = from_rows(grad_w.unsqueeze(1), layout, group).view(s, k)
        return at_least_fp32(gx_a).sum(1).to(grad_x.dtype), gw, None, None


def _compute_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The combine's arithmetic dtype: fp32 for bf16 / fp32 operands, fp64 when either is fp64 (never narrowed)."""
    return torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)


class _Combine(torch.autograd.Function):
    @staticmethod
    @no_autocast  # the weighted sum of the k expert outputs in fp32 or fp64 (einsum would round to bf16 in autocast)
    def forward(ctx, y, weights, layout, group, refill, *deps):
        s, k = layout.tokens, layout.top_k
        ctx.num_deps, ctx.refill = len(deps), refill
        y_a = from_rows(y, layout, group).view(s, k, y.shape[1])
        dt = _compute_dtype(y, weights)
        out = torch.einsum("skh,sk->sh", y_a.to(dt), weights.to(dt)).to(y.dtype)
        ctx.save_for_backward(y_a, weights)
        ctx.layout, ctx.group = layout, group
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, grad_out):
        y_a, weights = ctx.saved_tensors
        if ctx.refill is not None:  # the expert backward of this layer reads the shared slot pool next
            ctx.refill()
        s, k = ctx.layout.tokens, ctx.layout.top_k
        dt = _compute_dtype(grad_out, weights)
        g32 = grad_out.to(dt)
        g_ya = (g32.unsqueeze(1) * weights.to(dt).unsqueeze(2)).to(y_a.dtype).reshape(s * k, -1)
        grad_y = to_rows(g_ya, ctx.layout, ctx.group)
        grad_w = torch.einsum("sh,skh->sk", g32, y_a.to(dt)).to(weights.dtype)
        return (grad_y, grad_w, None, None, None) + (None,) * ctx.num_deps


def dispatch_tokens(
    x: torch.Tensor, weights: torch.Tensor, layout: AnyLayout, group: Mover
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable dispatch: ``x [s, H]``, ``weights [s, k]`` -> ``(rows [rows, H], row_weights [rows])``.

    Row r carries the token and top-k weight of the assignment placed there by ``layout``. Backward
    is a combine: each token's gradient is the sum of its k rows' gradients, in token order.
    """
    return _Dispatch.apply(x, weights, layout, group)


def combine_tokens(
    y: torch.Tensor, weights: torch.Tensor, layout: AnyLayout, group: Mover,
    deps: tuple[torch.Tensor, ...] = (), refill: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Differentiable combine: expert outputs ``y [rows, H]`` -> ``[s, H]``.

    ``out[t] = sum_j weights[t, j] * y[row(t, j)]``, summed on the source rank in fp32 (j
    ascending). Backward is a dispatch of ``weights * grad_out``; the gradient of
    ``weights [s, k]`` is ``<grad_out[t], y[row(t, j)]>``.

    ``deps``: the dispatch's rows and the prefetched slot weights. They get no gradient from here,
    but being inputs makes the dispatch and prefetch backward (each a collective) run on every rank,
    in the same order, even on a rank whose expert compute did not touch them (no slot rows).
    ``refill`` (a :class:`moonrt.comm.ep.slots.SlotRefill`): re-prefetches this layer's slots into a shared
    :class:`SlotPool` first thing in
    backward (K3_SYSTEMS §6.3), before the expert backward reads them.
    """
    return _Combine.apply(y, weights, layout, group, refill, *deps)


# ---- one row per (token, destination rank) --------------------------------------------------------


def build_dedup(layout: AnyLayout, group: Mover,
                device: torch.device | None = None) -> AnyDedup:
    """This rank's :class:`~moonrt.comm.ep.layout.DedupLayout`: one all-to-all of int64 metadata (one per
    assignment, under ``layout``'s splits) on ``device`` (the data's: the EP group's backend), so every
    receiver learns which of its assignment rows share a token. Host tensors are returned. For a
    :class:`~moonrt.comm.ep.layout.DeviceLayout` the same exchange of metadata gives a
    :class:`~moonrt.comm.ep.layout.DeviceDedup` on the layout's device."""
    if isinstance(layout, DeviceLayout):
        pair_rib, meta = dedup_pairs_device(layout)
        return DeviceDedup(pair_rib=pair_rib, row_rib=to_rows(meta.unsqueeze(1), layout, group).squeeze(1))
    pair_token, send_splits, meta = dedup_send_side(layout)
    recv = _all_to_all(layout.rows, meta.to(device), layout.recv_splits, layout.send_splits, group).cpu()
    recv_splits, expand = dedup_recv_side(layout, recv)
    return DedupLayout(pair_token=pair_token, pair_send_splits=send_splits, pair_recv_splits=recv_splits,
                       expand=expand)


def _pairs_to_rows(values: torch.Tensor, layout: AnyLayout, dd: AnyDedup,
                   group: Mover) -> torch.Tensor:
    """Per-token values ``[s, C]`` -> expert rows ``[rows, C]``, one transfer per (token, destination)."""
    if isinstance(layout, DeviceLayout) and isinstance(dd, DeviceDedup):  # at most capacity tokens per peer
        pb = layout.block // layout.top_k
        dst_rows = torch.where(dd.pair_rib >= 0, layout.rank * pb + dd.pair_rib, -1)
        return _device_exchange(group).scatter_rows(values, dst_rows, layout.src * pb + dd.row_rib, pb)
    assert isinstance(layout, EPLayout) and isinstance(dd, DedupLayout)
    return _gather_exchange(sum(dd.pair_recv_splits), values, dd.pair_token, dd.pair_recv_splits,
                            dd.pair_send_splits, group, dd.expand)


def _rows_to_pairs(rows: torch.Tensor, layout: AnyLayout, dd: AnyDedup, group: Mover,
                   dtype: torch.dtype) -> torch.Tensor:
    """Adjoint of :func:`_pairs_to_rows`: expert rows ``[rows, C]`` -> per-token sums ``[s, C]``.

    Rows of one (token, destination) are summed on the destination in fp32 (at least) and sent once,
    rounded to ``dtype``; the source sums its token's destinations in fp32 and rounds to ``dtype``."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    if isinstance(layout, DeviceLayout) and isinstance(dd, DeviceDedup):  # pairs named by their slot rows
        R, s = layout.world_size, layout.tokens
        block = layout.block // layout.top_k  # pair rows: at most capacity per (source, destination)
        dev = rows.device
        at = layout.src * block + dd.row_rib  # the pair row of each expert row: source s's pairs at s * block
        pairs = rows.new_zeros(R * block, rows.shape[1], dtype=acc)
        pairs.index_add_(0, at, rows.to(acc))
        used = torch.zeros(R * block, dtype=torch.bool, device=dev)
        used[at] = True
        j = torch.arange(block, device=dev)
        # pair row s * block + i goes back to source s's slot row me * block + i, only the pairs this rank holds
        dst_rows = torch.where(used.view(R, block), layout.rank * block + j, -1)
        src_rows = torch.arange(R * block, device=dev).view(R, block)
        ranks = torch.arange(R, device=dev).unsqueeze(1)
        read = (ranks * block + dd.pair_rib.clamp_min(0)).reshape(-1)  # destination major
        back = _device_exchange(group).scatter_rows(pairs.to(dtype), dst_rows, read, block, src_rows)
        tok = torch.where(dd.pair_rib >= 0, torch.arange(s, device=dev), s).reshape(-1)
        out = rows.new_zeros(s + 1, rows.shape[1], dtype=acc)  # the last row takes the pairs never sent
        out.index_add_(0, tok, back.to(acc))
        return out[:s].to(dtype)
    assert isinstance(layout, EPLayout) and isinstance(dd, DedupLayout)
    pairs = rows.new_zeros(sum(dd.pair_recv_splits), rows.shape[1], dtype=acc)
    pairs.index_add_(0, dd.expand.to(rows.device), rows.to(acc))
    back = _all_to_all(dd.pairs_sent, pairs.to(dtype), dd.pair_send_splits, dd.pair_recv_splits, group)
    out = rows.new_zeros(layout.tokens, rows.shape[1], dtype=acc)
    out.index_add_(0, dd.pair_token.to(rows.device), back.to(acc))
    return out.to(dtype)


class _DedupDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, layout, dd, group):
        ctx.layout, ctx.dd, ctx.group = layout, dd, group
        rows_x = _pairs_to_rows(x, layout, dd, group)
        rows_w = to_rows(weights.reshape(-1, 1), layout, group).squeeze(1)  # weights stay per assignment
        return rows_x, rows_w

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        layout, dd, group = ctx.layout, ctx.dd, ctx.group
        gx = _rows_to_pairs(grad_x, layout, dd, group, grad_x.dtype)
        gw = from_rows(grad_w.unsqueeze(1), layout, group).view(layout.tokens, layout.top_k)
        return gx, gw, None, None, None


class _DedupCombine(torch.autograd.Function):
    @staticmethod
    @no_autocast
    def forward(ctx, y, layout, dd, group, refill, dtype, *deps):
        ctx.layout, ctx.dd, ctx.group, ctx.refill, ctx.num_deps = layout, dd, group, refill, len(deps)
        ctx.dtype = y.dtype
        ctx.save_for_backward(*deps[:1])
        return _rows_to_pairs(y, layout, dd, group, dtype)

    @staticmethod
    @no_autocast
    def backward(ctx, grad_out):
        # Unpack first: under activation recomputation (non-reentrant checkpoint) that replays this layer's
        # forward, whose prefetch rewrites the shared slot pool; the refill below must come after it.
        ctx.saved_tensors  # noqa: B018
        if ctx.refill is not None:  # the expert backward of this layer reads the shared slot pool next
            ctx.refill()
        grad_y = _pairs_to_rows(grad_out, ctx.layout, ctx.dd, ctx.group).to(ctx.dtype)
        return (grad_y, None, None, None, None, None) + (None,) * ctx.num_deps


def dispatch_tokens_dedup(
    x: torch.Tensor, weights: torch.Tensor, layout: AnyLayout, dd: AnyDedup, group: Mover
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dispatch_tokens` sending each token once per destination rank (``dd``): the same
    ``(rows [rows, H], row_weights [rows])``. Two all-to-alls: the token rows (``dd``'s pairs) and
    the router weights (one per assignment). Backward: each destination sums its rows of a token in
    fp32 and returns one row per token (rounded to the gradient's dtype); the source sums them in fp32."""
    return _DedupDispatch.apply(x, weights, layout, dd, group)


def combine_tokens_dedup(
    y: torch.Tensor, layout: AnyLayout, dd: AnyDedup, group: Mover,
    deps: tuple[torch.Tensor, ...] = (), refill: Callable[[], None] | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Unweighted combine with one return row per (token, destination): ``out[t] = sum of t's rows``.

    Each destination sums a token's rows in fp32 and sends the sum once, rounded to ``dtype`` (default
    ``y.dtype``; the output's dtype and the wire's, the gradient travels in it too); the
    source sums its destinations' rows in fp32 and rounds once more (for fp32 / fp64 ``y`` that equals
    the per-assignment combine up to summation order; bf16 adds one rounding per destination).
    Weighting, if any, is done on the rows before (the dispatcher multiplies by its ``row_weights``).
    ``deps`` / ``refill``: as :func:`combine_tokens`.
    """
    return _DedupCombine.apply(y, layout, dd, group, refill, y.dtype if dtype is None else dtype, *deps)
