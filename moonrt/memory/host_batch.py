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
from moonrt.memory.backends import Backend


class _CopyGroup:
    """Saves of one layer and policy copied together. ``datas[i]`` (the source bytes, ``[sizes[i]]`` uint8)
    until submitted; then ``future`` until its result ``(buf, views)`` is taken by the first waiter."""

    __slots__ = ("backend", "layer", "datas", "sizes", "nbytes", "live", "future", "buf", "views")

    def __init__(self, backend: Backend, layer: int) -> None:
        self.backend = backend
        self.layer = layer
        self.datas: list[torch.Tensor] | None = []
        self.sizes: list[int] = []
        self.nbytes = 0
        self.live = 0
        self.future: Future | None = None
        self.buf: torch.Tensor | None = None
        self.views: list[torch.Tensor] | None = None


def _copy(store: Any, datas: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return store.put_many(datas, sizes)


class CopyBatchMixin:
    """Submit pending copy groups (``_flush_copies``, ``_flush_all_copies``), wait for one (``_group_views``)
    and free a group whose entries are all released (``_release_group``)."""

    _lock: threading.RLock
    accounting: Accounting
    _copies: dict[str, _CopyGroup]
    _copier: ThreadPoolExecutor | None

    def _flush_copies(self, policy: str) -> None:
        """Submit the pending copy group of ``policy`` (caller holds the lock)."""
        grp = self._copies.pop(policy, None)
        if grp is None:
            return
        datas, grp.datas = grp.datas, None
        if not datas or grp.live == 0:  # every save already released: nothing to copy
            return
        store = grp.backend.store
        if self._copier is not None:  # copy_thread=True
            grp.future = self._copier.submit(_copy, store, datas, grp.sizes)
        else:
            grp.future = Future()
            try:
                grp.future.set_result(_copy(store, datas, grp.sizes))
            except BaseException as exc:  # noqa: BLE001 - raised where the copy is needed (unpack)
                grp.future.set_exception(exc)

    def _flush_all_copies(self) -> None:
        if self._copies:
            with self._lock:
                for policy in list(self._copies):
                    self._flush_copies(policy)

    def _group_views(self, grp: _CopyGroup) -> list[torch.Tensor]:
        """The copied parts of ``grp`` (waits for its copy; raises the copy's error)."""
        views = grp.views
        if views is not None:
            return views
        fut = grp.future
        if fut is None:  # still pending (an unpack inside the forward that saved it): submit it now
            with self._lock:
                for policy, g in list(self._copies.items()):
                    if g is grp:
                        self._flush_copies(policy)
            fut = grp.future
            assert fut is not None
        w0 = time.perf_counter()
        buf, views = fut.result()
        waited = time.perf_counter() - w0
        with self._lock:
            if grp.views is None:
                grp.buf, grp.views, grp.future = buf, views, None
                self.accounting.exposed_s += waited
            views = grp.views
        assert views is not None
        return views

    def _release_group(self, grp: _CopyGroup) -> None:
        """Hand ``grp``'s buffer back to its store (its last entry was released; caller does not hold the lock)."""
        if grp.future is None and grp.views is None:  # never submitted (or dropped): nothing was copied
            return
        try:
            self._group_views(grp)
        except Exception:  # noqa: BLE001 - the copy failed: no buffer to return (the unpack raised it)
            return
        with self._lock:
            buf, grp.buf, grp.views = grp.buf, None, None
        if buf is not None:
            grp.backend.store.free(buf)


__all__: list[str] = []
