"""FP8 batching of the activation manager: FP8 saves of one layer and policy are quantized in one call
(:func:`moonrt.ops.fp8.codec.quantize_many`; for the device tier on the manager's copy thread with
``copy_thread=True``, overlapping the forward, bitwise the same) and, in backward, decoded in one call
(:func:`moonrt.ops.fp8.codec.dequantize_many`). With the copy thread, the first unpack from a batch also starts
decoding there the :data:`AHEAD` batches quantized just before it in the same forward (backward reaches them next,
whatever regions they belong to), so the backward of one layer hides the decode of the next (the CPU decode runs
without the GIL).

:class:`Fp8BatchMixin` is a base of :class:`moonrt.memory.manager.ActivationManager`, which sets the state
it reads in ``__init__``; the per-save path that fills a batch is ``_pack`` (:mod:`.saved_hooks`).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, Packed
from moonrt.memory.entries import _Entry
import moonrt.ops.fp8.codec as fp8


class _Batch:
    """FP8 saves of one layer and policy, quantized together (:func:`moonrt.ops.fp8.codec.quantize_many`) when
    the layer ends, the batch reaches ``fp8_batch_bytes``, the forward ends or backward starts; in backward
    the first unpack decodes every entry of the batch that is at hand in one call."""

    __slots__ = ("backend", "layer", "forward", "seq", "entries", "nbytes", "live", "decoded", "future", "todo",
                 "ahead")

    def __init__(self, backend: Backend, layer: int, forward: int = 0) -> None:
        self.backend = backend
        self.layer = layer
        self.forward = forward
        """The manager's forward count when the batch began: decode-ahead stays within one forward's batches."""
        self.seq = -1
        """Its index in its forward's quantized batches (``Fp8BatchMixin._decodable``), once quantized."""
        self.entries: list[_Entry] = []
        self.nbytes = 0
        self.live = 0
        self.decoded = False
        self.future: Future | None = None
        """Quantization running on the copy thread (device tier): its entries' ``packed.parts`` are filled by
        :meth:`Fp8BatchMixin._quantized` when the first unpack needs them."""
        self.todo: list[_Entry] | None = None
        self.ahead: Future | None = None
        """Decode running ahead on the copy thread (:meth:`Fp8BatchMixin._decode_ahead`); unpacks wait for it."""


class Fp8BatchMixin:
    """Quantize pending FP8 batches (``_flush``, ``_flush_all``) and decode a batch ahead of its unpacks
    (``_decode_batch``, which fetches through ``_parts`` of :class:`~moonrt.memory.saved_hooks.SavedTensorsMixin`)."""

    _lock: threading.RLock
    accounting: Accounting
    _pending: dict[str, _Batch]
    _decodable: dict[int, list[_Batch | None]]
    _copier: ThreadPoolExecutor | None
    _fp8_kernel: str

    def _flush(self, policy: str) -> None:
        """Quantize the pending FP8 batch of ``policy`` in one call and store every entry (caller holds the lock)."""
        batch = self._pending.pop(policy, None)
        if batch is None:
            return
        t0 = time.perf_counter()
        todo = [e for e in batch.entries if e.raw is not None]
        if not todo:
            return
        if self._copier is not None:  # a candidate for decode-ahead in backward
            batches = self._decodable.setdefault(batch.forward, [])
            batch.seq = len(batches)
            batches.append(batch)
        backend = batch.backend
        raws = [e.raw for e in todo]
        on_thread = self._copier is not None and backend.store.tier == "device"
        if on_thread:  # on the copy thread, bitwise the same
            batch.todo = todo
            block = backend.block
            for e, raw in zip(todo, raws):  # parts filled by _quantized; bytes known from the shape
                shape = tuple(raw.shape) or (1,)
                m = math.prod(shape[:-1])
                nb = -(-shape[-1] // block)
                meta = ("fp8", tuple(raw.shape), raw.dtype, (m, nb))
                e.packed = Packed([None, None], meta, raw.device, {"device": m * nb * block + 4 * m * nb})
                e.raw = None
        else:
            quantized = fp8.quantize_many(raws, backend.block, kernel=backend.kernel)
            for e, (payload, scales) in zip(todo, quantized):
                raw = e.raw
                e.packed = backend.store_quantized(tuple(raw.shape), raw.dtype, raw.device, payload, scales)
                e.raw = None
        dt = (time.perf_counter() - t0) / len(todo)
        tier = backend.store.tier
        pack_tier = self.accounting.pack_tier_locked  # the caller holds the lock the accounting shares
        for e in todo:
            region, label = e.region
            nbytes = e.packed.tier_bytes[tier]
            meta = e.packed.meta
            logical = math.prod(meta[1]) * meta[2].itemsize
            pack_tier(region, label, tier, logical, nbytes, dt)
        if on_thread:  # submitted last: the forward's thread then returns to compute (GIL released) at once
            batch.future = self._copier.submit(fp8.quantize_many, raws, backend.block,  # type: ignore[union-attr]
                                               kernel=backend.kernel)

    def _flush_all(self) -> None:
        if self._pending:
            with self._lock:
                for policy in list(self._pending):
                    self._flush(policy)

    def _quantized(self, batch: _Batch) -> None:
        """Wait for ``batch``'s quantization on the copy thread and fill its entries' parts (raises its error)."""
        fut = batch.future
        if fut is None:
            return
        quantized = fut.result()
        with self._lock:
            if batch.future is not fut:
                return
            for e, (payload, scales) in zip(batch.todo or (), quantized):
                e.packed.parts = [payload, scales]
            batch.future = batch.todo = None

    def _decode_batch(self, batch: _Batch) -> None:
        """Decode, in one call, every live entry of ``batch`` whose bytes are at hand without waiting (device
        tier, host without CUDA, or already prefetched); each unpack then takes its tensor."""
        with self._lock:
            if batch.decoded:
                return
            batch.decoded = True
            todo = [e for e in batch.entries
                    if e.refs > 0 and e.packed is not None and e.decoded is None
                    and (not e.backend.store.prefetch or e.parts is not None)]
        if len(todo) < 2:
            return
        items = []
        for e in todo:
            payload, scales = e.backend.quantized_parts(e.packed, self._parts(e))
            items.append((payload, scales, e.packed.meta[1], e.packed.meta[2]))
        outs = fp8.dequantize_many(items, kernel=self._fp8_kernel)
        with self._lock:
            for e, out in zip(todo, outs):
                if e.refs > 0:  # (on the copy thread, an entry may have been released meanwhile)
                    e.decoded = out

    def _decode_ahead(self, batch: _Batch) -> None:
        """Start decoding, on the copy thread, the :data:`AHEAD` live batches quantized before ``batch`` in its
        forward that are not decoded or queued yet: the next the backward reaches. Their unpacks wait for it
        (:meth:`_wait_ahead`)."""
        with self._lock:
            batches = self._decodable.get(batch.forward)
            if not batches or batch.seq < 0:
                return
            todo = []
            for b in reversed(batches[max(0, batch.seq - AHEAD):batch.seq]):
                if b is not None and b.live > 0 and not b.decoded and b.ahead is None:
                    todo.append(b)
            for b in todo:
                b.ahead = self._copier.submit(self._decode_on_thread, b)  # type: ignore[union-attr]

    def _decode_on_thread(self, b: _Batch) -> None:
        self._quantized(b)  # queued earlier on this same thread: already done
        self._decode_batch(b)

    def _wait_ahead(self, batch: _Batch) -> None:
        """Wait for ``batch``'s decode on the copy thread (raises its error)."""
        fut = batch.ahead
        if fut is not None:
            w0 = time.perf_counter()
            fut.result()
            self.accounting.exposed_s += time.perf_counter() - w0
            batch.ahead = None

    def _forget_batch(self, batch: _Batch) -> None:
        """Drop ``batch`` from the decode-ahead candidates (its last entry was released; caller holds the lock);
        a forward's list goes once all of its batches are released."""
        batches = self._decodable.get(batch.forward)
        if batches is not None and 0 <= batch.seq < len(batches) and batches[batch.seq] is batch:
            batches[batch.seq] = None
            if not any(batches):
                del self._decodable[batch.forward]


AHEAD = 2
"""Batches decoded ahead on the copy thread per first unpack of a batch (the decoded tensors live that much earlier)."""


__all__: list[str] = []
