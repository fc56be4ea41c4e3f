"""FP8 batching of the activation manager: FP8 saves of one layer and policy are quantized in one call
(:func:`moonrt.ops.fp8.codec.quantize_many`; for the device tier on the manager's copy thread with
``copy_thread=True``, overlapping the forward, bitwise the same) and, in backward, decoded in one call
(:func:`moonrt.ops.fp8.codec.dequantize_many`). With the copy thread, the first unpack from a batch also starts
decoding there the :data:`AHEAD` batches quantized just before it in the same forward (backward reaches them next,
whatever regions they belong to), so the backward of one layer hides the decode of the next (the CPU decode runs
without the GIL).

:class:`Fp8Batcher` owns the pending and quantized batches; the saved-tensor hooks (:mod:`.saved_hooks`) hold one,
add each FP8 save to it (:meth:`Fp8Batcher.add_locked`) and ask it to make an entry's bytes ready before an unpack
(:meth:`Fp8Batcher.ready`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import moonrt.ops.fp8.codec as fp8
from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, Packed
from moonrt.memory.entries import Entry


class Fp8Batch:
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
        """Its index in its forward's quantized batches (``Fp8Batcher.decodable``), once quantized."""
        self.entries: list[Entry] = []
        self.nbytes = 0
        self.live = 0
        self.decoded = False
        self.future: Future | None = None
        """Quantization running on the copy thread (device tier): its entries' ``packed.parts`` are filled by
        :meth:`Fp8Batcher.quantized` when the first unpack needs them."""
        self.todo: list[Entry] | None = None
        self.ahead: Future | None = None
        """Decode running ahead on the copy thread (:meth:`Fp8Batcher.decode_ahead`); unpacks wait for it."""


class Fp8Batcher:
    """The FP8 batches of one manager: pending ones by policy (quantized in one call by :meth:`flush`), the
    quantized ones of each forward (decode-ahead candidates), and the decode of a batch ahead of its unpacks.

    Args:
        lock: the manager's lock (every entry and batch field is changed under it); the accounting shares it.
        accounting: the manager's :class:`~moonrt.memory.accounting.Accounting`.
        copier: the manager's copy thread, or None (quantize / decode inline, no decode-ahead).
        kernel: the FP8 codec's backend for batched decode (``kernels.fp8``).
        batch_bytes: a pending batch is quantized once this many input bytes are pending.
        parts: an entry's stored parts on the compute device (:meth:`moonrt.memory.prefetch.Prefetcher.parts`).
    """

    def __init__(self, lock: threading.RLock, accounting: Accounting, copier: ThreadPoolExecutor | None,
                 kernel: str, batch_bytes: int, parts: Callable[[Entry], list[torch.Tensor]]) -> None:
        self.lock = lock
        self.accounting = accounting
        self.copier = copier
        self.kernel = kernel
        self.batch_bytes = int(batch_bytes)
        self.parts = parts
        self.pending: dict[str, Fp8Batch] = {}
        self.decodable: dict[int, list[Fp8Batch | None]] = {}
        """Forward -> its quantized FP8 batches, in order (only with a copy thread: decode-ahead candidates)."""
        self.forward = 0
        """The forwards begun (:meth:`new_forward`): a batch records the one it began in."""

    def new_forward(self) -> None:
        self.forward += 1

    def add_locked(self, policy: str, entry: Entry, layer: int, nbytes: int) -> None:
        """Put the pending ``entry`` (``raw`` set, ``nbytes`` input bytes) in ``policy``'s batch of ``layer``: a
        batch of another layer is quantized first, and the batch once it holds ``batch_bytes`` (caller holds the
        lock)."""
        batch = self.pending.get(policy)
        if batch is not None and batch.layer != layer:
            self.flush(policy)
            batch = None
        if batch is None:
            batch = self.pending[policy] = Fp8Batch(entry.backend, layer, self.forward)
        batch.entries.append(entry)
        batch.live += 1
        batch.nbytes += nbytes
        entry.batch = batch
        if batch.nbytes >= self.batch_bytes:
            self.flush(policy)

    def release_locked(self, batch: Fp8Batch) -> None:
        """One entry of ``batch`` was released (caller holds the lock); the last one drops the batch."""
        batch.live -= 1
        if batch.live == 0:
            batch.entries = []  # no entry left to decode: drop the references
            self.forget(batch)

    def ready(self, entry: Entry, batch: Fp8Batch) -> None:
        """Before unpacking ``entry`` of ``batch``: wait for the batch's quantization, and decode the batch (and, with
        the copy thread, queue the next batches' decode there) unless a decode ran or runs already."""
        if batch.future is not None:
            self.quantized(batch)
        if batch.ahead is not None:  # decoding on the copy thread: queue the next layer's, then wait
            self.decode_ahead(batch)
            self.wait_ahead(batch)
        elif entry.decoded is None and not batch.decoded:  # the first unpack of a batch decodes it
            if self.copier is not None:
                self.decode_ahead(batch)  # and the next layer's batches on the copy thread
            self.decode_batch(batch)

    def close(self) -> None:
        """Drop the pending batches (never quantized: nothing will unpack them) and the decode-ahead lists."""
        with self.lock:
            for batch in self.pending.values():
                for e in batch.entries:
                    e.raw = None
            self.pending.clear()
            self.decodable.clear()

    def flush(self, policy: str) -> None:
        """Quantize the pending FP8 batch of ``policy`` in one call and store every entry (caller holds the lock)."""
        batch = self.pending.pop(policy, None)
        if batch is None:
            return
        t0 = time.perf_counter()
        todo = [e for e in batch.entries if e.raw is not None]
        if not todo:
            return
        if self.copier is not None:  # a candidate for decode-ahead in backward
            batches = self.decodable.setdefault(batch.forward, [])
            batch.seq = len(batches)
            batches.append(batch)
        backend = batch.backend
        raws = [e.raw for e in todo]
        on_thread = self.copier is not None and backend.store.tier == "device"
        if on_thread:  # on the copy thread, bitwise the same
            batch.todo = todo
            block = backend.block
            for e, raw in zip(todo, raws):  # parts filled by quantized(); bytes known from the shape
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
            batch.future = self.copier.submit(fp8.quantize_many, raws, backend.block,  # type: ignore[union-attr]
                                               kernel=backend.kernel)

    def flush_all(self) -> None:
        if self.pending:
            with self.lock:
                for policy in list(self.pending):
                    self.flush(policy)

    def quantized(self, batch: Fp8Batch) -> None:
        """Wait for ``batch``'s quantization on the copy thread and fill its entries' parts (raises its error)."""
        fut = batch.future
        if fut is None:
            return
        quantized = fut.result()
        with self.lock:
            if batch.future is not fut:
                return
            for e, (payload, scales) in zip(batch.todo or (), quantized):
                e.packed.parts = [payload, scales]
            batch.future = batch.todo = None

    def decode_batch(self, batch: Fp8Batch) -> None:
        """Decode, in one call, every live entry of ``batch`` whose bytes are at hand without waiting (device
        tier, host without CUDA, or already prefetched); each unpack then takes its tensor."""
        with self.lock:
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
            payload, scales = e.backend.quantized_parts(e.packed, self.parts(e))
            items.append((payload, scales, e.packed.meta[1], e.packed.meta[2]))
        outs = fp8.dequantize_many(items, kernel=self.kernel)
        with self.lock:
            for e, out in zip(todo, outs):
                if e.refs > 0:  # (on the copy thread, an entry may have been released meanwhile)
                    e.decoded = out

    def decode_ahead(self, batch: Fp8Batch) -> None:
        """Start decoding, on the copy thread, the :data:`AHEAD` live batches quantized before ``batch`` in its
        forward that are not decoded or queued yet: the next the backward reaches. Their unpacks wait for it
        (:meth:`wait_ahead`)."""
        with self.lock:
            batches = self.decodable.get(batch.forward)
            if not batches or batch.seq < 0:
                return
            todo = []
            for b in reversed(batches[max(0, batch.seq - AHEAD):batch.seq]):
                if b is not None and b.live > 0 and not b.decoded and b.ahead is None:
                    todo.append(b)
            for b in todo:
                b.ahead = self.copier.submit(self.decode_on_thread, b)  # type: ignore[union-attr]

    def decode_on_thread(self, b: Fp8Batch) -> None:
        self.quantized(b)  # queued earlier on this same thread: already done
        self.decode_batch(b)

    def wait_ahead(self, batch: Fp8Batch) -> None:
        """Wait for ``batch``'s decode on the copy thread (raises its error)."""
        fut = batch.ahead
        if fut is not None:
            w0 = time.perf_counter()
            fut.result()
            self.accounting.exposed_s += time.perf_counter() - w0
            batch.ahead = None

    def forget(self, batch: Fp8Batch) -> None:
        """Drop ``batch`` from the decode-ahead candidates (its last entry was released; caller holds the lock);
        a forward's list goes once all of its batches are released."""
        batches = self.decodable.get(batch.forward)
        if batches is not None and 0 <= batch.seq < len(batches) and batches[batch.seq] is batch:
            batches[batch.seq] = None
            if not any(batches):
                del self.decodable[batch.forward]


AHEAD = 2
"""Batches decoded ahead on the copy thread per first unpack of a batch (the decoded tensors live that much earlier)."""


__all__ = ["AHEAD", "Fp8Batch", "Fp8Batcher"]
