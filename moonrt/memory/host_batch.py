"""Batched host copies of the activation manager: the saves of CPU tensors under a policy whose store has
``put_many`` (:class:`~moonrt.memory.backends.HostStore`) are collected per layer and policy and copied in
one call into one pooled buffer (:meth:`HostStore.put_many`); with ``copy_thread=True`` on a background thread, like a
CUDA side stream: the copy of layer ``l`` runs while the forward computes layer ``l + 1``.

A pending save holds its source storage until its group is copied; the group is submitted when the layer
ends, it reaches ``copy_batch_bytes``, the forward ends or backward starts. An unpack waits for its group's
copy (errors of the copy surface there, in backward). The copies are bitwise: gradients equal the
no-manager run's. The buffer goes back to the store's pool when the group's last entry is released.

:class:`CopyBatcher` owns the pending groups; the saved-tensor hooks (:mod:`.saved_hooks`) hold one, add each
batched save to it (:meth:`CopyBatcher.add_locked`) and rebuild a saved tensor from its group
(:meth:`CopyBatcher.group_part`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, storage_bytes
from moonrt.memory.entries import PartEntry


class CopyGroup:
    """Saves of one layer and policy copied together. ``storages[i]`` (the source storage, ``sizes[i]`` bytes)
    until submitted; ``views[k]`` / ``parts[k]``: the view ``(dtype, shape, stride, offset)`` and part index of
    save ``k`` made while the group was pending (a handle's ``slot``). Once submitted, ``future`` until its result
    ``(buf, starts, outs, typed)`` is taken by the first waiter: the buffer, each part's byte offset in its
    storage, ``outs[k]``, save ``k`` rebuilt on the buffer (made with the copy, on the copy thread when there is
    one: an unpack only picks it), and ``typed``, the buffer's views per dtype (reused for a later save of a part)."""

    __slots__ = ("backend", "layer", "storages", "sizes", "views", "parts", "nbytes", "live", "future", "buf",
                 "starts", "outs", "typed")

    def __init__(self, backend: Backend, layer: int) -> None:
        self.backend = backend
        self.layer = layer
        self.storages: list[torch.UntypedStorage] | None = []
        self.sizes: list[int] = []
        self.views: list[tuple[Any, ...]] = []
        self.parts: list[int] = []
        self.nbytes = 0
        self.live = 0
        self.future: Future | None = None
        self.buf: torch.Tensor | None = None
        self.starts: list[int] | None = None
        self.outs: list[torch.Tensor] | None = None
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def add_view(self, view: tuple[Any, ...], index: int) -> int:
        """Record a save ``view`` of part ``index`` made while the group is pending; returns its slot."""
        self.views.append(view)
        self.parts.append(index)
        return len(self.views) - 1


def _copy(store: Any, storages: list[torch.UntypedStorage], sizes: list[int], views: list[tuple[Any, ...]],
          parts: list[int]) -> tuple[torch.Tensor, list[int], list[torch.Tensor], dict[torch.dtype, torch.Tensor]]:
    """Copy the storages into one pooled buffer (:meth:`HostStore.put_many`); returns it, each part's byte
    offset in the buffer's storage, each save's view ``views[k]`` of part ``parts[k]`` on the buffer and the
    buffer's per-dtype views made for them. The byte views of the sources and the saved views are made here (on
    the copy thread when there is one), not in the forward's pack hook or the backward's unpack."""
    datas = [storage_bytes(s) for s in storages]
    buf, copies = store.put_many(datas, sizes)
    starts = [v.storage_offset() for v in copies]
    typed: dict[torch.dtype, torch.Tensor] = {}
    outs = [_part_view(buf, typed, starts[part], view) for part, view in zip(parts, views)]
    return buf, starts, outs, typed


def _part_view(buf: torch.Tensor, typed: dict[torch.dtype, torch.Tensor], start: int, view: tuple[Any, ...]
               ) -> torch.Tensor:
    """The saved tensor ``view = (dtype, shape, stride, offset)`` of the part at byte ``start`` of ``buf``: a strided
    view of ``buf`` typed as ``dtype`` (``typed`` caches those; parts start at :data:`HostStore.ALIGN`-byte
    offsets, a multiple of every dtype's size)."""
    dtype, shape, stride, offset = view
    tv = typed.get(dtype)
    if tv is None:
        tv = typed[dtype] = buf.view(dtype)
    return tv.as_strided(shape, stride, start // dtype.itemsize + offset)


class CopyBatcher:
    """The batched host copies of one manager: the pending group per policy, submitted as one copy (on the copy
    thread when there is one), the wait for a group's copy and the return of its buffer.

    Args:
        lock: the manager's lock (every group field is changed under it); the accounting shares it.
        accounting: the manager's :class:`~moonrt.memory.accounting.Accounting`.
        copier: the manager's copy thread, or None (copies inline).
        batch_bytes: a pending group is submitted once it holds this many source bytes.
    """

    def __init__(self, lock: threading.RLock, accounting: Accounting, copier: ThreadPoolExecutor | None,
                 batch_bytes: int) -> None:
        self.lock = lock
        self.accounting = accounting
        self.copier = copier
        self.batch_bytes = int(batch_bytes)
        self.pending: dict[str, CopyGroup] = {}

    def add_locked(self, policy: str, backend: Backend, layer: int, key: Any, storage: torch.UntypedStorage,
                   view: tuple[Any, ...], region: str, label: str, t0: float) -> tuple[PartEntry, int]:
        """Add a save of ``storage`` (``view`` of it; dedupe key ``key``) to ``policy``'s pending group of ``layer``
        (a group of another layer is submitted first; the group once it holds ``batch_bytes``). Returns its new
        entry and the save's slot (caller holds the lock; ``t0``: when the save began)."""
        grp = self.pending.get(policy)
        if grp is not None and grp.layer != layer:
            self.flush(policy)
            grp = None
        if grp is None:
            grp = self.pending[policy] = CopyGroup(backend, layer)
        n = storage.nbytes()
        entry = PartEntry(key, storage._weak_ref(), region, label, backend.store.tier, grp, len(grp.sizes), layer,
                          backend)
        grp.storages.append(storage)  # type: ignore[union-attr]
        grp.sizes.append(n)
        slot = grp.add_view(view, entry.index)
        grp.live += 1
        grp.nbytes += n
        self.accounting.pack_tier_locked(region, label, entry.tier, n, n, time.perf_counter() - t0)
        if grp.nbytes >= self.batch_bytes:
            self.flush(policy)
        return entry, slot

    def release_locked(self, entry: PartEntry) -> CopyGroup | None:
        """The last save of ``entry`` was released (caller holds the lock): account its part; returns its group when
        that was the group's last live part (then the caller, without the lock, hands :meth:`release_group` it)."""
        grp = entry.group
        entry.group = None
        grp.live -= 1
        self.accounting.release_tier_locked(entry.tier, grp.sizes[entry.index], entry.region, entry.label)
        return grp if grp.live == 0 else None

    def close(self) -> None:
        """Drop the pending groups (never copied: nothing will unpack them)."""
        with self.lock:
            for grp in self.pending.values():
                grp.storages = None
            self.pending.clear()

    def flush(self, policy: str) -> None:
        """Submit the pending copy group of ``policy`` (caller holds the lock)."""
        grp = self.pending.pop(policy, None)
        if grp is None:
            return
        storages, grp.storages = grp.storages, None
        if not storages or grp.live == 0:  # every save already released: nothing to copy
            return
        store = grp.backend.store
        if self.copier is not None:  # copy_thread=True
            grp.future = self.copier.submit(_copy, store, storages, grp.sizes, grp.views, grp.parts)
        else:
            grp.future = Future()
            try:
                grp.future.set_result(_copy(store, storages, grp.sizes, grp.views, grp.parts))
            except BaseException as exc:  # noqa: BLE001 - raised where the copy is needed (unpack)
                grp.future.set_exception(exc)

    def flush_all(self) -> None:
        if self.pending:
            with self.lock:
                for policy in list(self.pending):
                    self.flush(policy)

    def group_outs(self, grp: CopyGroup) -> list[torch.Tensor]:
        """``grp``'s saves rebuilt on its buffer, by slot (waits for its copy; raises the copy's error)."""
        outs = grp.outs
        if outs is not None:
            return outs
        fut = grp.future
        if fut is None:  # still pending (an unpack inside the forward that saved it): submit it now
            with self.lock:
                for policy, g in list(self.pending.items()):
                    if g is grp:
                        self.flush(policy)
            fut = grp.future
            assert fut is not None
        w0 = time.perf_counter()
        buf, starts, outs, typed = fut.result()
        waited = time.perf_counter() - w0
        with self.lock:
            if grp.outs is None:
                grp.buf, grp.starts, grp.outs, grp.typed, grp.future = buf, starts, outs, typed, None
                self.accounting.exposed_s += waited
            outs = grp.outs
        assert outs is not None
        return outs

    def group_part(self, grp: CopyGroup, index: int, view: tuple[Any, ...], slot: int) -> torch.Tensor:
        """Part ``index`` of ``grp`` as the saved tensor ``view``: the one made with the copy for a save with a
        ``slot`` (made while the group was pending), else :func:`_part_view` of the buffer."""
        outs = grp.outs or self.group_outs(grp)
        if slot >= 0:
            return outs[slot]
        assert grp.buf is not None and grp.starts is not None
        return _part_view(grp.buf, grp.typed, grp.starts[index], view)

    def release_group(self, grp: CopyGroup) -> None:
        """Hand ``grp``'s buffer back to its store (its last entry was released; caller does not hold the lock)."""
        if grp.future is None and grp.outs is None:  # never submitted (or dropped): nothing was copied
            return
        try:
            self.group_outs(grp)
        except Exception:  # noqa: BLE001 - the copy failed: no buffer to return (the unpack raised it)
            return
        with self.lock:
            buf, grp.buf, grp.starts, grp.outs = grp.buf, None, None, None
            grp.typed.clear()
        if buf is not None:
            grp.backend.store.free(buf)


__all__ = ["CopyBatcher", "CopyGroup"]
