"""FP8 batching of the activation manager: FP8 saves of one layer and policy are quantized in one call
(:func:`moonrt.ops.fp8.quantize_many`; for the device tier on the manager's copy thread with
``copy_thread=True``, overlapping the forward, bitwise the same) and, in backward, decoded in one call
(:func:`moonrt.ops.fp8.dequantize_many`).

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
from moonrt.ops import fp8


class _Batch:
    """FP8 saves of one layer and policy, quantized together (:func:`moonrt.ops.fp8.quantize_many`) when
    the layer ends, the batch reaches ``fp8_batch_bytes``, the forward ends or backward starts; in backward
    the first unpack decodes every entry of the batch that is at hand in one call."""

    __slots__ = ("backend", "layer", "entries", "nbytes", "live", "decoded", "future", "todo")

    def __init__(self, backend: Backend, layer: int) -> None:
        self.backend = backend
        self.layer = layer
        self.entries: list[_Entry] = []
        self.nbytes = 0
        self.live = 0
        self.decoded = False
        self.future: Future | None = None
        """Quantization running on the copy thread (device tier): its entries' ``packed.parts`` are filled by
        :meth:`Fp8BatchMixin._quantized` when the first unpack needs them."""
        self.todo: list[_Entry] | None = None


class Fp8BatchMixin:
    """Quantize pending FP8 batches (``_flush``, ``_flush_all``) and decode a batch ahead of its unpacks
    (``_decode_batch``, which fetches through ``_parts`` of :class:`~moonrt.memory.saved_hooks.SavedTensorsMixin`)."""

    _lock: threading.RLock
    accounting: Accounting
    _pending: dict[str, _Batch]
    _copier: ThreadPoolExecutor | None

    def _flush(self, policy: str) -> None:
        """Quantize the pending FP8 batch of ``policy`` in one call and store every entry (caller holds the lock)."""
        batch = self._pending.pop(policy, None)
        if batch is None:
            return
        t0 = time.perf_counter()
        todo = [e for e in batch.entries if e.raw is not None]
        if not todo:
            return
        backend = batch.backend
        raws = [e.raw for e in todo]
        if self._copier is not None and backend.store.tier == "device":  # on the copy thread, bitwise the same
            batch.future = self._copier.submit(fp8.quantize_many, raws, backend.block)
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
            quantized = fp8.quantize_many(raws, backend.block)
            for e, (payload, scales) in zip(todo, quantized):
                raw = e.raw
                e.packed = backend.store_quantized(tuple(raw.shape), raw.dtype, raw.device, payload, scales)
                e.raw = None
        del raws
        dt = (time.perf_counter() - t0) / len(todo)
        tier = backend.store.tier
        pack_tier = self.accounting.pack_tier_locked  # the caller holds the lock the accounting shares
        for e in todo:
            region, label = e.region
            nbytes = e.packed.tier_bytes[tier]
            meta = e.packed.meta
            logical = math.prod(meta[1]) * meta[2].itemsize
            pack_tier(region, label, tier, logical, nbytes, dt)

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
        for e, out in zip(todo, fp8.dequantize_many(items)):
            e.decoded = out


__all__: list[str] = []
