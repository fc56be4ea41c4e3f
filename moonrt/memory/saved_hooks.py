"""The saved-tensor hooks of the activation manager: ``_pack`` binds every tensor autograd saves to the
storage of its policy (keep: counted once per storage; FP8: pending in a batch of :mod:`.fp8_batch`;
host / disk / remote: the whole storage as flat bytes; deduplicated by storage or view), ``_unpack``
rebuilds it in backward, fetching through the background prefetcher; handles release their entries.

The hooks are on the thread's saved-tensor hooks stack only where they have work to do: ``_set_hooks``
pushes them when a module / region whose policy is not ``keep`` is entered and pops them in ``keep``
regions (no Python call per saved tensor there), except in forwards that account keep saves (the first
one by default, see ``keep_accounting``) and around the recompute anchors. It never touches the stack
when someone else's hooks are on top (a checkpoint's, which decide inside their region).

:class:`SavedTensorsMixin` is a base of :class:`moonrt.memory.manager.ActivationManager`, which sets the
state it reads in ``__init__`` and starts the hooks in ``__enter__``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, Packed, make_backend, storage_bytes
from moonrt.memory.entries import _Entry, _Handle, _KeepEntry, _PartEntry
from moonrt.memory.fp8_batch import _Batch
from moonrt.memory.host_batch import _CopyGroup
from moonrt.memory.policy import MemoryPolicy
import moonrt.ops.fp8.codec as fp8

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""The thread-local saved-tensor hooks stack that ``torch.autograd.graph.saved_tensors_hooks`` pushes to."""
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_STORAGE_META = ("raw", None, torch.uint8)
"""``Packed.meta`` of a whole storage stored as flat bytes (one shared tuple: unpack rebuilds the saved view
from the handle's ``view``)."""
_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref
"""An entry's ``weak`` is the raw weak reference of its source storage (``storage._weak_ref()``: an int, no
Python object to allocate and track), freed by ``_release``."""


class SavedTensorsMixin:
    """Pack / unpack / release of saved tensors per policy, and the prefetch of offloaded entries."""

    policy: MemoryPolicy
    accounting: Accounting
    _lock: threading.RLock
    _stores: dict[str, Any]
    _backends: dict[str, Backend]
    _fp8_kernel: str
    _keep: dict[int, _KeepEntry]
    _entries: dict[Any, _Entry]
    _pending: dict[str, _Batch]
    _forward_id: int
    _forget_batch: Any
    _decode_ahead: Any
    _wait_ahead: Any
    _copies: dict[str, _CopyGroup]
    _copy_batch_bytes: int
    _flush_copies: Any
    _flush_all_copies: Any
    _group_part: Any
    _release_group: Any
    _quantized: Any
    _fp8_batch_bytes: int
    _min_bytes: int
    _param_ptrs: set[int]
    _prefetched_layers: set[int]
    _pool: ThreadPoolExecutor | None
    _anchoring: bool
    _active: bool
    _account_keep_now: bool
    _hooks_on: bool
    _base_hooks: tuple[Any, Any] | None
    _pack_fn: Any
    _unpack_fn: Any
    _release_fn: Any
    _release_keep_fn: Any
    _release_part_fn: Any

    def _hooks_wanted(self, policy: str) -> bool:
        """Whether saves under a frame of ``policy`` need the manager's hooks in the current forward."""
        return policy != "keep" or self._account_keep_now

    def _set_hooks(self, on: bool) -> None:
        """Push (``on``) or pop the manager's saved-tensor hooks. Only inside ``with manager:``, and only when
        the stack's top is what it was at ``__enter__`` (to push) or the manager's own hooks (to pop): under
        another context's hooks (a non-reentrant checkpoint) nothing changes, as those decide there."""
        if on is self._hooks_on or not self._active:
            return
        top = _top_hooks(False)
        if on:
            base = self._base_hooks
            if not (top is None and base is None
                    or top is not None and base is not None and top[0] is base[0] and top[1] is base[1]):
                return
            _push_hooks(self._pack_fn, self._unpack_fn)
        else:
            if top is None or top[0] is not self._pack_fn:
                return
            _pop_hooks()
        self._hooks_on = on

    def _backend(self, policy: str) -> Backend:
        b = self._backends.get(policy)
        if b is None:
            b = self._backends[policy] = make_backend(policy, self._stores, self.policy.fp8_block, self._fp8_kernel)
        return b

    def _pack(self, t: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        storage = t.untyped_storage()
        sptr = storage._cdata  # the StorageImpl: unique while alive, also on the meta device
        if sptr in self._param_ptrs:  # autograd keeps the parameter anyway: hand back a detached alias
            self.accounting.parameter_saves += 1
            return t.detach()
        if t.numel() == 0:
            return t.detach()
        frame = self._frames[-1]
        policy = label = frame.policy
        if self._anchoring:
            policy, label = "keep", "recompute"
        elif policy != "keep" and self._min_bytes and t.numel() * t.element_size() < self._min_bytes:
            policy = "keep"
        if policy == "keep":  # no copy, no view record, no weak reference: count the storage once
            region = frame.region
            with self._lock:
                entry = self._keep.get(sptr)
                if entry is not None:
                    entry.refs += 1
                    self.accounting.dedupe_locked(region, label)
                else:
                    n = storage.nbytes()
                    entry = self._keep[sptr] = _KeepEntry(sptr, n, region, label)
                    self.accounting.pack_tier_locked(region, label, "device", n, n, time.perf_counter() - t0)
            return _Handle(entry, None, t.detach(), self._release_keep_fn)
        layer = frame.layer
        if layer is None:
            layer = self._layer_of(frame)
        region = frame.region
        backend = self._backends.get(policy) or self._backend(policy)
        fp8 = backend.use_fp8 and backend.quantizes(t)
        mxq = backend.use_mx and backend.quantizes(t)
        view = (t.dtype, t.shape, t.stride(), t.storage_offset())  # Size and stride() are tuples already
        key = (policy, sptr, view) if fp8 or mxq else (policy, sptr)
        store = backend.store
        batched = not (fp8 or mxq) and store.batched and t.is_cpu
        with self._lock:  # one critical section per save: the dedupe lookup and, for a batched copy, the insert
            entry = self._entries.get(key)
            if entry is not None and entry.weak is not None and _expired(entry.weak):
                entry = None
            if entry is not None:
                entry.refs += 1
                self.accounting.dedupe_locked(region, label)
                if entry.__class__ is _PartEntry:
                    grp = entry.group
                    if grp.storages is not None:  # its group is pending: rebuilt with the copy (a slot)
                        grp.views.append(view)
                        grp.parts.append(entry.index)
                        return _Handle(entry, view, None, self._release_part_fn, len(grp.views) - 1)
                    return _Handle(entry, view, None, self._release_part_fn)
                entry.waiting += 1
                return _Handle(entry, view, None, self._release_fn)
            if batched:  # copied with the rest of its layer in one call
                grp = self._copies.get(policy)
                if grp is not None and grp.layer != layer:
                    self._flush_copies(policy)
                    grp = None
                if grp is None:
                    grp = self._copies[policy] = _CopyGroup(backend, layer)
                n = storage.nbytes()
                tier = store.tier
                entry = self._entries[key] = _PartEntry(key, storage._weak_ref(), region, label, tier, grp,
                                                        len(grp.sizes), layer, backend)
                grp.storages.append(storage)  # type: ignore[union-attr]
                grp.sizes.append(n)
                views = grp.views
                views.append(view)
                grp.parts.append(entry.index)
                grp.live += 1
                grp.nbytes += n
                self.accounting.pack_tier_locked(region, label, tier, n, n, time.perf_counter() - t0)
                if grp.nbytes >= self._copy_batch_bytes:
                    self._flush_copies(policy)
                return _Handle(entry, view, None, self._release_part_fn, len(views) - 1)
        if fp8:  # pending: quantized with the rest of its batch (layer) in one call
            entry = _Entry(backend, None, layer, key, storage._weak_ref())
            entry.refs = 1
            entry.region = (region, label)
            entry.raw = t.detach()
            with self._lock:
                self._entries[key] = entry
                batch = self._pending.get(policy)
                if batch is not None and batch.layer != layer:
                    self._flush(policy)
                    batch = None
                if batch is None:
                    batch = self._pending[policy] = _Batch(backend, layer, self._forward_id)
                batch.entries.append(entry)
                batch.live += 1
                batch.nbytes += t.numel() * t.element_size()
                entry.batch = batch
                if batch.nbytes >= self._fp8_batch_bytes:
                    self._flush(policy)
            self.accounting.pack_s += time.perf_counter() - t0
            return _Handle(entry, view, None, self._release_fn)
        if mxq:  # MXFP8: quantized now, one entry per view (as FP8)
            packed = backend.pack(t)
            entry = _Entry(backend, packed, layer, key, storage._weak_ref())
            entry.refs = 1
            entry.region = (region, label)
            with self._lock:
                self._entries[entry.key] = entry
            self.accounting.on_pack_tier(region, label, store.tier, t.numel() * t.element_size(),
                                         packed.tier_bytes[store.tier], time.perf_counter() - t0)
            return _Handle(entry, view, None, self._release_fn)
        if store.tier == "device":
            packed = backend.pack(t)  # keeps the tensor itself; bytes counted by storage
            packed.tier_bytes = {"device": storage.nbytes()}
            logical = storage.nbytes()
        else:  # the whole storage as flat bytes, straight to the store (already contiguous uint8)
            logical = storage.nbytes()
            store = backend.store
            packed = Packed([store.put(storage_bytes(storage))], _STORAGE_META, t.device, {store.tier: logical})
        entry = _Entry(backend, packed, layer, key, storage._weak_ref())
        entry.refs = 1
        entry.region = (region, label)
        with self._lock:
            self._entries[key] = entry
        self.accounting.on_pack_tier(region, label, backend.store.tier, logical, logical, time.perf_counter() - t0)
        return _Handle(entry, view, packed.parts[0] if backend.store.tier == "device" else None,
                       self._release_fn)

    def _release_keep(self, entry: _KeepEntry) -> None:
        """Keep entries are never copied: no entry lives beyond its storage (a handle holds the tensor, so
        the storage address cannot be reused while the entry is in ``_keep``)."""
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._keep.get(entry.sptr) is entry:
                del self._keep[entry.sptr]
            self.accounting.release_tier_locked("device", entry.nbytes, entry.region, entry.label)

    def _release_part(self, entry: _PartEntry) -> None:
        """Release a save of a batched host copy: account its part; the group's last one returns the buffer."""
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            _free_weak_ref(entry.weak)
            grp = entry.group
            entry.group = None
            grp.live -= 1
            self.accounting.release_tier_locked(entry.tier, grp.sizes[entry.index], entry.region, entry.label)
        if grp.live == 0:
            self._release_group(grp)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                if entry.waiting > entry.refs:  # (a save released before its unpack: at most refs still wait)
                    entry.waiting = entry.refs
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if entry.weak is not None:
                _free_weak_ref(entry.weak)
                entry.weak = None
            entry.parts = None
            entry.future = None
            entry.decoded = None
            batch = entry.batch
            if batch is not None:
                entry.batch = None
                batch.live -= 1
                if batch.live == 0:
                    batch.entries = []  # no entry left to decode: drop the references
                    self._forget_batch(batch)
            pending = entry.raw
            entry.raw = None
        region, label = entry.region or (None, None)
        if pending is not None:  # released before its batch was quantized: account what it would have stored
            tier = entry.backend.store.tier
            stored = fp8.stored_bytes(pending.shape if pending.dim() else (1,), entry.backend.block)
            self.accounting.on_pack_tier(region, label, tier, pending.numel() * pending.element_size(), stored, 0.0)
            self.accounting.on_release_tier(tier, stored, region, label)
            return
        if entry.packed is None:  # dropped unquantized by close()
            return
        entry.backend.free(entry.packed)
        self.accounting.on_release(entry.packed.tier_bytes, region, label)

    def _fetch(self, entry: _Entry) -> tuple[list[torch.Tensor], float]:
        t0 = time.perf_counter()
        parts = entry.backend.fetch(entry.packed)
        return parts, time.perf_counter() - t0

    def _start_prefetch(self, layer: int) -> None:
        if self._pool is None or layer < 0 or layer in self._prefetched_layers:
            return
        self._prefetched_layers.add(layer)
        with self._lock:
            todo = [e for e in self._entries.values()
                    if e.layer == layer and e.backend.store.prefetch and e.future is None and e.parts is None
                    and e.packed is not None]
            for e in todo:
                e.future = self._pool.submit(self._fetch, e)

    def _parts(self, entry: _Entry) -> list[torch.Tensor]:
        """The entry's stored parts on the compute device (from the prefetcher, or fetched now)."""
        if entry.backend.store.tier == "device":
            return entry.backend.fetch(entry.packed)
        with self._lock:
            parts, fut = entry.parts, entry.future
        if parts is None:
            if fut is not None:
                w0 = time.perf_counter()
                parts, dt = fut.result()
                # waited time counts as exposed, at most the fetch's own duration
                self.accounting.on_fetch(dt, min(dt, time.perf_counter() - w0), prefetched=True)
            else:
                parts, dt = self._fetch(entry)
                self.accounting.on_fetch(dt, dt, prefetched=False)
            with self._lock:
                entry.parts, entry.future = parts, None
        return parts

    def _unpack(self, handle: _Handle | torch.Tensor) -> torch.Tensor:
        if handle.__class__ is not _Handle:  # a parameter (or empty tensor), saved as its detached alias
            return handle
        tensor = handle.tensor
        if tensor is not None:
            return tensor
        t0 = time.perf_counter()
        if self._pending:
            self._flush_all()
        if self._copies:
            self._flush_all_copies()
        entry = handle.entry
        assert entry is not None
        if entry.__class__ is _PartEntry:  # a batched host copy: the part of the group's buffer (once copied)
            out = self._group_part(entry.group, entry.index, handle.view, handle.slot)
            self.accounting.on_unpack(time.perf_counter() - t0)
            return out
        self._start_prefetch(entry.layer - 1)
        packed = entry.packed
        if packed.meta[0] in ("fp8", "mxfp8"):
            batch = entry.batch
            if batch is not None:
                if batch.future is not None:
                    self._quantized(batch)
                if batch.ahead is not None:  # decoding on the copy thread: queue the next layer's, then wait
                    self._decode_ahead(batch)
                    self._wait_ahead(batch)
                elif entry.decoded is None and not batch.decoded:  # the first unpack of a batch decodes it
                    if self._copier is not None:
                        self._decode_ahead(batch)  # and the next layer's batches on the copy thread
                    self._decode_batch(batch)
            out = entry.decoded
            if out is None:
                out = entry.backend.decode(packed, self._parts(entry))
            # several saves of one view (a dedupe) decode once: kept while a live save has not unpacked it yet
            entry.waiting -= 1
            entry.decoded = out if entry.waiting > 0 else None
        else:
            parts = self._parts(entry)
            dtype, shape, stride, offset = handle.view
            flat = parts[0]
            out = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, shape, stride)
        self.accounting.on_unpack(time.perf_counter() - t0)
        return out


__all__: list[str] = []
