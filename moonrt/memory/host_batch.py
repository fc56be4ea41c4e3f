"""Batched host copies of the activation manager: the saves of CPU tensors under a policy whose store has
``put_many`` (:class:`~moonrt.memory.backends.HostStore`) are collected per layer and policy and copied in
one call into one pooled buffer (:meth:`HostStore.put_many`); with ``copy_thread=True`` on a background thread, like a
CUDA side stream: the copy of layer ``l`` runs while the forward computes layer ``l + 1``.

A pending save holds its source storage until its group is copied; the group is submitted when the layer
ends, it reaches ``copy_batch_bytes``, the forward ends or backward starts. An unpack waits for its group's
copy (errors of the copy surface there, in backward). The copies are bitwise: gradients equal the
no-manager run's. The buffer goes back to the store's pool when the group's last entry is released.

:class:`CopyBatchMixin` is a base of :class:`moonrt.memory.manager.ActivationManager`, which sets the state
it reads in ``__init__``; the per-save path that fills a group is ``_pack`` (:mod:`.saved_hooks`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, storage_bytes


class _CopyGroup:
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


class CopyBatchMixin:
    """Submit pending copy groups (``_flush_copies``, ``_flush_all_copies``), wait for one (``_group_outs``),
    rebuild a saved tensor from its part (``_group_part``) and free a group whose entries are all released
    (``_release_group``)."""

    _lock: threading.RLock
    accounting: Accounting
    _copies: dict[str, _CopyGroup]
    _copier: ThreadPoolExecutor | None

    def _flush_copies(self, policy: str) -> None:
        """Submit the pending copy group of ``policy`` (caller holds the lock)."""
        grp = self._copies.pop(policy, None)
        if grp is None:
            return
        storages, grp.storages = grp.storages, None
        if not storages or grp.live == 0:  # every save already released: nothing to copy
            return
        store = grp.backend.store
        if self._copier is not None:  # copy_thread=True
            grp.future = self._copier.submit(_copy, store, storages, grp.sizes, grp.views, grp.parts)
        else:
            grp.future = Future()
            try:
                grp.future.set_result(_copy(store, storages, grp.sizes, grp.views, grp.parts))
            except BaseException as exc:  # noqa: BLE001 - raised where the copy is needed (unpack)
                grp.future.set_exception(exc)

    def _flush_all_copies(self) -> None:
        if self._copies:
            with self._lock:
                for policy in list(self._copies):
                    self._flush_copies(policy)

    def _group_outs(self, grp: _CopyGroup) -> list[torch.Tensor]:
        """``grp``'s saves rebuilt on its buffer, by slot (waits for its copy; raises the copy's error)."""
        outs = grp.outs
        if outs is not None:
            return outs
        fut = grp.future
        if fut is None:  # still pending (an unpack inside the forward that saved it): submit it now
            with self._lock:
                for policy, g in list(self._copies.items()):
                    if g is grp:
                        self._flush_copies(policy)
            fut = grp.future
            assert fut is not None
        w0 = time.perf_counter()
        buf, starts, outs, typed = fut.result()
        waited = time.perf_counter() - w0
        with self._lock:
            if grp.outs is None:
                grp.buf, grp.starts, grp.outs, grp.typed, grp.future = buf, starts, outs, typed, None
                self.accounting.exposed_s += waited
            outs = grp.outs
        assert outs is not None
        return outs

    def _group_part(self, grp: _CopyGroup, index: int, view: tuple[Any, ...], slot: int) -> torch.Tensor:
        """Part ``index`` of ``grp`` as the saved tensor ``view``: the one made with the copy for a save with a
        ``slot`` (made while the group was pending), else :func:`_part_view` of the buffer."""
        outs = grp.outs or self._group_outs(grp)
        if slot >= 0:
            return outs[slot]
        assert grp.buf is not None and grp.starts is not None
        return _part_view(grp.buf, grp.typed, grp.starts[index], view)

    def _release_group(self, grp: _CopyGroup) -> None:
        """Hand ``grp``'s buffer back to its store (its last entry was released; caller does not hold the lock)."""
        if grp.future is None and grp.outs is None:  # never submitted (or dropped): nothing was copied
            return
        try:
            self._group_outs(grp)
        except Exception:  # noqa: BLE001 - the copy failed: no buffer to return (the unpack raised it)
            return
        with self._lock:
            buf, grp.buf, grp.starts, grp.outs = grp.buf, None, None, None
            grp.typed.clear()
        if buf is not None:
            grp.backend.store.free(buf)


__all__: list[str] = []
