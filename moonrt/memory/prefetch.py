"""The prefetcher of the activation manager: in backward, the first unpack from layer ``l`` starts fetching every
offloaded entry of layer ``l - 1`` (forward order) on a background thread; an unpack takes its entry's parts from
there (or fetches them inline) and the accounting records how much reload time backward waited for.

The saved-tensor hooks (:mod:`.saved_hooks`) hold one :class:`Prefetcher`; the FP8 batcher (:mod:`.fp8_batch`)
fetches the parts of a batch it decodes through :meth:`Prefetcher.parts`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.entries import Entry, PartEntry


class Prefetcher:
    """Fetches offloaded entries back to the compute device, a layer ahead of backward on its own thread.

    Args:
        lock: the manager's lock (an entry's ``parts`` / ``future`` change under it).
        accounting: the manager's accounting (fetch time, time exposed to backward).
        pool: the one prefetch thread, or None (``MemoryPolicy.prefetch`` off: every fetch inline).
    """

    def __init__(self, lock: threading.RLock, accounting: Accounting, pool: ThreadPoolExecutor | None) -> None:
        self.lock = lock
        self.accounting = accounting
        self.pool = pool
        self.started: set[int] = set()
        """Layers whose prefetch began in this backward (cleared by :meth:`new_forward`)."""

    def new_forward(self) -> None:
        self.started.clear()

    @staticmethod
    def fetch(entry: Entry) -> tuple[list[torch.Tensor], float]:
        """``entry``'s stored parts on its device, and the seconds the fetch took."""
        t0 = time.perf_counter()
        assert entry.packed is not None, "a pending FP8 entry is quantized (flush_all) before any fetch"
        parts = entry.backend.fetch(entry.packed)
        return parts, time.perf_counter() - t0

    def start(self, layer: int, entries: Iterable[Entry | PartEntry]) -> None:
        """Start fetching, on the prefetch thread, the entries of ``layer`` among ``entries`` (the hooks' live
        entries) whose store prefetches and that are neither fetched nor fetching; once per layer and backward.
        (A :class:`PartEntry`, a batched host copy, is fetched with its group, never here.)"""
        if self.pool is None or layer < 0 or layer in self.started:
            return
        self.started.add(layer)
        with self.lock:
            todo = [e for e in entries
                    if isinstance(e, Entry) and e.layer == layer and e.backend.store.prefetch and e.future is None
                    and e.parts is None and e.packed is not None]
            for e in todo:
                e.future = self.pool.submit(self.fetch, e)

    def parts(self, entry: Entry) -> list[torch.Tensor]:
        """The entry's stored parts on the compute device (from the prefetcher, or fetched now)."""
        assert entry.packed is not None, "a pending FP8 entry is quantized (flush_all) before any fetch"
        if entry.backend.store.tier == "device":
            return entry.backend.fetch(entry.packed)
        with self.lock:
            parts, fut = entry.parts, entry.future
        if parts is None:
            if fut is not None:
                w0 = time.perf_counter()
                parts, dt = fut.result()
                # waited time counts as exposed, at most the fetch's own duration
                self.accounting.on_fetch(dt, min(dt, time.perf_counter() - w0), prefetched=True)
            else:
                parts, dt = self.fetch(entry)
                self.accounting.on_fetch(dt, dt, prefetched=False)
            with self.lock:
                entry.parts, entry.future = parts, None
        return parts

    def close(self) -> None:
        """Stop the prefetch thread (waits for the fetches it runs)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


__all__ = ["Prefetcher"]
