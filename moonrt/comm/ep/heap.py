"""MoonEP over the symmetric heap (issue 48 item 2): the EP transport whose ranks write each other's memory.

:class:`HeapTransport` implements :class:`moonrt.comm.ep.transport.EPTransport` over a
:class:`moonrt.comm.transport.base.SymmetricHeap` (``shm`` for the CPU ranks of one host, ``cuda`` for GPUs). Every
verb is the collective transport's, with one difference: where that calls ``all_to_all_single``, this one calls
:meth:`HeapExchange.exchange_rows`, which *puts* every row straight into its destination's receive slot
(``heap.peer(d)``) and signals; the receiver waits for its peers' signals and reads its slot. So the autograd is the
same functions (:mod:`moonrt.comm.ep.collectives`, :mod:`moonrt.comm.ep.slots`), each backward mirroring its
forward (combine's backward is a dispatch of the gradients, a prefetch's backward puts the slot gradients into the
home rank's slot, which sums them there), and the results equal the collectives' bitwise: the same rows in the
same order reach the same sums.

Receive slots are static: one heap buffer ``[2, R * block, *row]`` per (row shape, dtype, block), allocated once
(a collective allocation, made by every rank on its first call with that key, in the same order since every rank
makes the same calls) and reused every layer and step. Rank ``s`` writes its rows for ``d`` at
``d``'s rows ``[s * block, s * block + n)``: the offset depends on the source rank only, so no rank needs another
rank's counts (no size exchange). ``block`` is a bound every rank knows: for token rows ``capacity * top_k`` (a
rank sends at most its ``s * k <= capacity * k`` assignments to one peer, and a destination returns at most what it
received from that source); for expert weights ``num_slots`` (a home rank fills at most B slots of a peer). The
leading 2 is the parity of the call (as :class:`moonrt.comm.transport.base.PutAllToAll`): a rank one call ahead on
a key has had every peer's signal of the call before, sent after that peer read the other half, so no barrier is
needed per call.

Expert weights for the prefetch are pushed by their home rank into the slot rank's receive slot (the home weights
are parameters of the home rank's model, not heap memory: one copy per prefetch, from the parameter into the
peer's slot; no extra copy of the weights is kept in the heap).

Overlap (DeepEP's ``async_finish``): :meth:`HeapTransport.dispatch_async` runs the dispatch's puts and waits on the
transport's one worker thread and returns a :class:`PendingDispatch` at once; the caller computes what does not need
the rows (the shared experts) and calls :meth:`PendingDispatch.wait` (its :attr:`~PendingDispatch.event` is set
when the rows are in). Until then the caller makes no other call on the heap (its signal counters are this
rank's, not thread safe). The copies release the GIL, so on a rank with more than one core the transfer and the
compute run at once.

Host data: with MoonEP and ``B >= E/R`` the dispatcher hands this transport the device layouts of
:mod:`moonrt.comm.ep.layout` (``DeviceLayout``, ``DeviceDedup``, ``DeviceWeightLayout``: each row named by its peer
and its row in that peer's static slot block, computed with tensor ops); their exchanges
(:meth:`HeapExchange.scatter_rows`: each row written once, straight into its slot row, the mask applied in the copy)
read no split sizes, so a whole MoE layer
makes no host synchronization. Other placements (fewer slots, the baseline: rows follow the routing) and
``MOONRT_DEBUG=1`` use the host layouts and :meth:`HeapExchange.exchange_rows`, as the collectives do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moonrt.comm.ep.layout import AnyDedup, AnyLayout
from moonrt.comm.ep.transport import RowTransport
from moonrt.comm.transport.base import HeapTensor, SymmetricHeap
from moonrt.ops.rows import scatter_rows


class HeapExchange:
    """Variable-row all-to-all by one-sided puts into static receive slots of ``heap`` (see the module docstring).

    ``token_block``: the bound of rows one rank sends another when the caller gives none (``capacity * top_k``).
    :attr:`puts` counts the rows this rank has written into peers' slots (itself included), :attr:`calls` the
    exchanges.
    """

    def __init__(self, heap: SymmetricHeap, token_block: int) -> None:
        if isinstance(token_block, bool) or not isinstance(token_block, int) or token_block < 1:
            raise ValueError(f"token_block = {token_block!r}: expected an integer >= 1 (capacity * top_k)")
        self.heap, self.token_block = heap, token_block
        self.slots: dict[tuple, HeapTensor] = {}
        self._parity: dict[tuple, int] = {}
        self.calls = 0
        self._host_puts = 0
        self._device_puts: torch.Tensor | None = None

    def slot(self, row: tuple[int, ...], dtype: torch.dtype, block: int) -> tuple[HeapTensor, int]:
        """The receive slot of this key (allocated on first use) and the parity of this call."""
        key = (row, dtype, block)
        buf = self.slots.get(key)
        if buf is None:
            buf = self.slots[key] = self.heap.alloc((2, self.heap.world_size * block, *row), dtype)
            self._parity[key] = 0
        parity = self._parity[key]
        self._parity[key] = parity ^ 1
        return buf, parity

    def exchange_rows(self, out_rows: int, send: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      block: int | None, send_index: torch.Tensor | None = None,
                      recv_index: torch.Tensor | None = None) -> torch.Tensor:
        """``send [sum(in_splits), *row]`` -> ``[out_rows, *row]`` (:class:`moonrt.comm.ep.collectives.RowExchange`):
        ``in_splits[d]`` rows put into rank d's slot at ``[rank * block, ...)``, then ``out_splits[s]`` rows read
        from this rank's slot at ``[s * block, ...)``, source-rank order. With ``send_index`` the rows for ``d`` are
        gathered from ``send`` straight into ``d``'s slot; with ``recv_index`` the result is gathered straight out of
        this rank's slot (no staging copy on either side)."""
        heap = self.heap
        R, me = heap.world_size, heap.rank
        block = self.token_block if block is None else block
        if max(in_splits, default=0) > block or max(out_splits, default=0) > block:
            raise RuntimeError(f"heap exchange: {max(max(in_splits), max(out_splits))} rows between two ranks, "
                               f"expected at most block = {block} (the static receive slot)")
        sent = send.shape[0] if send_index is None else send_index.shape[0]
        if sum(out_splits) != out_rows or sum(in_splits) != sent:
            raise RuntimeError(f"heap exchange: splits {in_splits} / {out_splits} do not match {send.shape[0]} sent "
                               f"and {out_rows} received rows")
        if send_index is None:
            send = send.contiguous()
        buf, parity = self.slot(tuple(send.shape[1:]), send.dtype, block)
        starts = [0] * (R + 1)
        for d in range(R):
            starts[d + 1] = starts[d] + in_splits[d]
        for i in range(R):  # start with the next rank: the peers' slots are written in a staggered order
            d = (me + i) % R
            n = in_splits[d]
            if n:
                dst = buf.peer(d)[parity, me * block: me * block + n]
                if send_index is None:
                    dst.copy_(send[starts[d]: starts[d + 1]])
                else:
                    torch.index_select(send, 0, send_index[starts[d]: starts[d + 1]], out=dst)
                self._host_puts += n
            if d != me:
                heap.signal(d)
        for i in range(1, R):
            heap.wait((me - i) % R)
        self.calls += 1
        local = buf.local[parity]
        if recv_index is None:
            out = send.new_empty((out_rows, *send.shape[1:]))
            at = 0
            for s in range(R):
                n = out_splits[s]
                if n:
                    out[at: at + n].copy_(local[s * block: s * block + n])
                    at += n
            return out
        # received position p (source s, its i-th row) sits at slot row s * block + i: one gather out of the slot
        dev = recv_index.device
        counts = torch.tensor(out_splits, dtype=torch.int64, device=dev)
        first = torch.cumsum(counts, 0) - counts
        src = torch.repeat_interleave(torch.arange(R, device=dev), counts)
        slot_row = src * block + torch.arange(out_rows, device=dev) - first[src]
        return local.index_select(0, slot_row.index_select(0, recv_index))


    def scatter_rows(self, send: torch.Tensor, dst_rows: torch.Tensor, read: torch.Tensor, block: int,
                     src_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The device layouts' exchange (:class:`moonrt.comm.ep.layout.DeviceLayout`): no split sizes, no host data.

        ``send [n, *row]``; ``dst_rows [R, m]`` int64 (device): the row of rank d's receive slot that row ``i`` is
        written to (``send[src_rows[d, i]]`` with ``src_rows [R, m]``, else ``send[i]``), ``-1`` for a row not sent
        to d; then ``[read.shape[0], *row]``: this rank's slot rows ``read`` (int64, source s's rows at
        ``[s * block, (s + 1) * block)``). Only the rows sent are written, each straight from its place in ``send``
        into its slot row (:func:`moonrt.ops.rows.scatter_rows`: the mask is applied in the copy, on the device, not
        read on the host)."""
        heap = self.heap
        R, me = heap.world_size, heap.rank
        send = send.contiguous()
        buf, parity = self.slot(tuple(send.shape[1:]), send.dtype, block)
        for i in range(R):
            d = (me + i) % R
            scatter_rows(buf.peer(d)[parity], dst_rows[d], send, None if src_rows is None else src_rows[d])
            if d != me:
                heap.signal(d)
        self._count(dst_rows)
        for i in range(1, R):
            heap.wait((me - i) % R)
        self.calls += 1
        return buf.local[parity].index_select(0, read)

    def _count(self, dst_rows: torch.Tensor) -> None:
        """Add the rows ``dst_rows`` names (>= 0) to :attr:`puts`, on their device (no host read)."""
        sent = (dst_rows >= 0).sum()
        self._device_puts = sent if self._device_puts is None else self._device_puts + sent

    @property
    def puts(self) -> int:
        """Rows this rank has written into the peers' slots (itself included) so far (a host read of the device
        layouts' count: ask outside a timed or sync-counted region)."""
        return self._host_puts + (0 if self._device_puts is None else int(self._device_puts))


class PendingDispatch:
    """A dispatch in flight on the transport's worker thread (:meth:`HeapTransport.dispatch_async`).

    :attr:`event` is set once the rows are in this rank's memory; :meth:`wait` blocks until then and returns what
    :meth:`HeapTransport.dispatch` returns (re-raising the worker's error: a dead peer is named there too)."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.event = threading.Event()
        future.add_done_callback(lambda _: self.event.set())

    def wait(self) -> Any:
        return self.future.result()


class HeapTransport(RowTransport):
    """:class:`moonrt.comm.ep.transport.EPTransport` over a symmetric heap of the EP group (issue 48 item 2).

    Args:
        heap: the group's :class:`SymmetricHeap` (``ShmHeap`` / ``CudaHeap``; the caller owns and closes it).
        capacity: S, the most tokens a rank passes per MoE call (the dispatchers' ``capacity``).
        top_k: k (the largest of the layers sharing this transport).

    Receive slots grow with nothing: their size follows from ``capacity * top_k`` rows per peer (token rows) and
    ``num_slots`` rows per peer (expert weights).
    """

    device_layouts = True
    """The dispatcher may hand this transport :mod:`moonrt.comm.ep.layout`'s device layouts (no host data)."""

    def __init__(self, heap: SymmetricHeap, capacity: int, top_k: int) -> None:
        for name, value in (("capacity", capacity), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected an integer >= 1")
        self.heap = heap
        self.world_size, self.rank = heap.world_size, heap.rank
        self.exchange = self.mover = HeapExchange(heap, capacity * top_k)
        self._worker: ThreadPoolExecutor | None = None

    def all_gather(self, row: torch.Tensor) -> torch.Tensor:
        R = self.world_size
        if R == 1:
            return row
        send = row.reshape(1, -1).expand(R, row.numel())
        return self.exchange.exchange_rows(R, send, [1] * R, [1] * R, 1).reshape(-1)

    def dispatch_async(self, x: torch.Tensor, weights: torch.Tensor, layout: AnyLayout,
                       dedup: AnyDedup | None) -> PendingDispatch:
        """:meth:`dispatch` on the worker thread (the same autograd, the same result bitwise); returns at once.
        Grad mode is the caller's; make no other heap call before :meth:`PendingDispatch.wait`."""
        return self.submit(lambda: self.dispatch(x, weights, layout, dedup))

    def submit(self, fn: Callable[[], Any]) -> PendingDispatch:
        """Run ``fn`` (heap calls: a dispatcher's whole dispatch) on the transport's one worker thread under the
        caller's grad mode; returns at once. Make no other heap call before :meth:`PendingDispatch.wait`."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moonrt-ep-heap")
        grad = torch.is_grad_enabled()

        def run() -> Any:
            with torch.set_grad_enabled(grad):
                return fn()

        return PendingDispatch(self._worker.submit(run))

    def close(self) -> None:
        """Stop the worker thread (the heap is the caller's to close)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
