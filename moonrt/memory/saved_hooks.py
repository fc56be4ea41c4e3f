"""The saved-tensor hooks of the activation manager: :meth:`SavedTensorHooks.pack` binds every tensor autograd saves
to the storage of its policy (keep: counted once per storage; FP8: pending in a batch of :mod:`.fp8_batch`; host
copies of CPU tensors: in a copy group of :mod:`.host_batch`; host / disk / remote: the whole storage as flat bytes;
deduplicated by storage or view), :meth:`SavedTensorHooks.unpack` rebuilds it in backward, fetching through the
prefetcher (:mod:`.prefetch`); handles release their entries.

The hooks are on the thread's saved-tensor hooks stack only where they have work to do: :meth:`SavedTensorHooks.set`
pushes them when a module / region whose policy is not ``keep`` is entered (the hooks watch the :class:`Regions`,
:mod:`.regions`) and pops them in ``keep`` regions (no Python call per saved tensor there), except in forwards that
account keep saves (the first one by default, see ``keep_accounting``) and around the recompute anchors
(:meth:`SavedTensorHooks.anchored`). It never touches the stack when someone else's hooks are on top (a
checkpoint's, which decide inside their region).

:class:`moonrt.memory.manager.ActivationManager` builds one :class:`SavedTensorHooks` from its parts and starts /
stops it in ``__enter__`` / ``__exit__``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import moonrt.ops.fp8.codec as fp8
from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, Packed, make_backend, storage_bytes
from moonrt.memory.entries import Entry, Handle, KeepEntry, PartEntry
from moonrt.memory.fp8_batch import Fp8Batcher
from moonrt.memory.host_batch import CopyBatcher
from moonrt.memory.policy import MemoryPolicy
from moonrt.memory.prefetch import Prefetcher
from moonrt.memory.regions import Frame, Regions

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
Python object to allocate and track), freed by :meth:`SavedTensorHooks.release`."""


class SavedTensorHooks:
    """Pack / unpack / release of saved tensors per policy, for one manager.

    Args:
        policy: the manager's :class:`MemoryPolicy` (``min_bytes``, ``fp8_block``).
        accounting: the manager's accounting; ``lock``: the lock it shares with every entry change.
        stores: tier -> store (:mod:`.backends`), built by the manager from the tiers the policy uses.
        fp8_kernel: the FP8 codec's backend for the ``fp8`` tiers (``kernels.fp8``).
        param_ptrs: the storages of the model's parameters and buffers (never stored: autograd keeps them).
        regions: the manager's :class:`Regions` (the hooks read its innermost frame and watch its pushes / pops).
        fp8_batches, copies, prefetcher: the FP8 batcher, the host copy batcher and the prefetcher.
    """

    def __init__(self, policy: MemoryPolicy, accounting: Accounting, lock: threading.RLock, stores: dict[str, Any],
                 fp8_kernel: str, param_ptrs: set[int], regions: Regions, fp8_batches: Fp8Batcher,
                 copies: CopyBatcher, prefetcher: Prefetcher) -> None:
        self.policy = policy
        self.accounting = accounting
        self.lock = lock
        self.stores = stores
        self.fp8_kernel = fp8_kernel
        self.param_ptrs = param_ptrs
        self.regions = regions
        self.fp8 = fp8_batches
        self.copies = copies
        self.prefetcher = prefetcher
        self.min_bytes = policy.min_bytes
        self.backends: dict[str, Backend] = {}
        self.keep: dict[int, KeepEntry] = {}
        """Storage -> its entry, for saves under ``keep``."""
        self.entries: dict[Any, Entry | PartEntry] = {}
        """Dedupe key -> entry, for every other policy: ``(policy, storage)`` raw, ``(policy, storage, view)`` FP8."""
        self.account_keep = False
        """Whether the current forward accounts ``keep`` saves (hooks on in keep regions too)."""
        self.active = False
        """Inside ``with manager:``."""
        self.on = False
        """Whether the hooks are on the stack now."""
        self.base: tuple[Any, Any] | None = None
        """The stack's top at :meth:`start`: the hooks are pushed only over it."""
        self.marks: list[tuple[int, bool]] = []
        """(frame depth, hooks on before it) per frame whose push switched the hooks."""
        self.anchoring = False
        self.pack_fn = self.pack  # one bound-method object each: the hooks stack is compared by identity
        self.unpack_fn = self.unpack
        self.release_fn = self.release  # bound once: a handle holds it, not a new method object per save
        self.release_keep_fn = self.release_keep
        self.release_part_fn = self.release_part
        regions.watcher = self

    # ---- on / off ------------------------------------------------------------------------------
    def wanted(self, policy: str) -> bool:
        """Whether saves under a frame of ``policy`` need the manager's hooks in the current forward."""
        return policy != "keep" or self.account_keep

    def set(self, on: bool) -> None:
        """Push (``on``) or pop the manager's saved-tensor hooks. Only inside ``with manager:``, and only when
        the stack's top is what it was at :meth:`start` (to push) or the manager's own hooks (to pop): under
        another context's hooks (a non-reentrant checkpoint) nothing changes, as those decide there."""
        if on is self.on or not self.active:
            return
        top = _top_hooks(False)
        if on:
            base = self.base
            if not (top is None and base is None
                    or top is not None and base is not None and top[0] is base[0] and top[1] is base[1]):
                return
            _push_hooks(self.pack_fn, self.unpack_fn)
        else:
            if top is None or top[0] is not self.pack_fn:
                return
            _pop_hooks()
        self.on = on

    def entered(self, depth: int, frame: Frame) -> None:
        """A frame was pushed (:class:`~moonrt.memory.regions.RegionWatcher`): hooks on where its policy needs them."""
        if self.active:
            self.marks.append((depth, self.on))
            self.set(self.wanted(frame.policy))

    def leaving(self, depth: int) -> None:
        """A frame is about to be popped: restore the hooks state of the enclosing frame."""
        marks = self.marks
        if marks and marks[-1][0] == depth:
            self.set(marks.pop()[1])

    def start(self, account_keep: bool) -> None:
        """The start of a forward (``with manager:``); ``account_keep``: account its keep saves."""
        self.account_keep = account_keep
        self.base = _top_hooks(False)
        self.marks = []
        self.on = False
        self.active = True
        self.set(self.wanted(self.regions.frames[-1].policy))

    def stop(self) -> None:
        """The end of a forward: hooks off, pending FP8 batches quantized and copy groups submitted."""
        self.set(False)
        self.active = False
        self.on = False
        self.marks = []
        self.fp8.flush_all()
        self.copies.flush_all()

    @contextmanager
    def anchored(self) -> Iterator[None]:
        """Saves inside are a recompute anchor's (:mod:`.recompute`): stored as ``keep``, label ``recompute``, with
        the hooks on (accounted in every forward, keep regions included)."""
        self.anchoring = True
        hooks_were_on = self.on
        self.set(True)
        try:
            yield
        finally:
            self.set(hooks_were_on)
            self.anchoring = False

    # ---- pack / unpack / release ----------------------------------------------------------------
    def backend(self, policy: str) -> Backend:
        b = self.backends.get(policy)
        if b is None:
            b = self.backends[policy] = make_backend(policy, self.stores, self.policy.fp8_block, self.fp8_kernel)
        return b

    def pack(self, t: torch.Tensor) -> Any:
        t0 = time.perf_counter()
        storage = t.untyped_storage()
        sptr = storage._cdata  # the StorageImpl: unique while alive, also on the meta device
        if sptr in self.param_ptrs:  # autograd keeps the parameter anyway: hand back a detached alias
            self.accounting.parameter_saves += 1
            return t.detach()
        if t.numel() == 0:
            return t.detach()
        frame = self.regions.frames[-1]
        policy = label = frame.policy
        if self.anchoring:
            policy, label = "keep", "recompute"
        elif policy != "keep" and self.min_bytes and t.numel() * t.element_size() < self.min_bytes:
            policy = "keep"
        if policy == "keep":  # no copy, no view record, no weak reference: count the storage once
            region = frame.region
            with self.lock:
                kept = self.keep.get(sptr)
                if kept is not None:
                    kept.refs += 1
                    self.accounting.dedupe_locked(region, label)
                else:
                    n = storage.nbytes()
                    kept = self.keep[sptr] = KeepEntry(sptr, n, region, label)
                    self.accounting.pack_tier_locked(region, label, "device", n, n, time.perf_counter() - t0)
            return Handle(kept, None, t.detach(), self.release_keep_fn)
        layer = frame.layer
        if layer is None:
            layer = self.regions.layer_of(frame)
        region = frame.region
        backend = self.backends.get(policy) or self.backend(policy)
        fp8 = backend.use_fp8 and backend.quantizes(t)
        mxq = backend.use_mx and backend.quantizes(t)
        view = (t.dtype, t.shape, t.stride(), t.storage_offset())  # Size and stride() are tuples already
        key = (policy, sptr, view) if fp8 or mxq else (policy, sptr)
        store = backend.store
        batched = not (fp8 or mxq) and store.batched and t.is_cpu
        with self.lock:  # one critical section per save: the dedupe lookup and, for a batched copy, the insert
            entry = self.entries.get(key)
            if entry is not None and entry.weak is not None and _expired(entry.weak):
                entry = None
            if entry is not None:
                entry.refs += 1
                self.accounting.dedupe_locked(region, label)
                if isinstance(entry, PartEntry):
                    grp = entry.group
                    if grp.storages is not None:  # its group is pending: rebuilt with the copy (a slot)
                        return Handle(entry, view, None, self.release_part_fn, grp.add_view(view, entry.index))
                    return Handle(entry, view, None, self.release_part_fn)
                entry.waiting += 1
                return Handle(entry, view, None, self.release_fn)
            if batched:  # copied with the rest of its layer in one call
                part, slot = self.copies.add_locked(policy, backend, layer, key, storage, view, region, label, t0)
                self.entries[key] = part
                return Handle(part, view, None, self.release_part_fn, slot)
        if fp8:  # pending: quantized with the rest of its batch (layer) in one call
            new = Entry(backend, None, layer, key, storage._weak_ref(), (region, label))
            new.refs = 1
            new.raw = t.detach()
            with self.lock:
                self.entries[key] = new
                self.fp8.add_locked(policy, new, layer, t.numel() * t.element_size())
            self.accounting.pack_s += time.perf_counter() - t0
            return Handle(new, view, None, self.release_fn)
        if mxq:  # MXFP8: quantized now, one entry per view (as FP8)
            packed = backend.pack(t)
            new = Entry(backend, packed, layer, key, storage._weak_ref(), (region, label))
            new.refs = 1
            with self.lock:
                self.entries[new.key] = new
            self.accounting.on_pack_tier(region, label, store.tier, t.numel() * t.element_size(),
                                         packed.tier_bytes[store.tier], time.perf_counter() - t0)
            return Handle(new, view, None, self.release_fn)
        if store.tier == "device":
            packed = backend.pack(t)  # keeps the tensor itself; bytes counted by storage
            packed.tier_bytes = {"device": storage.nbytes()}
            logical = storage.nbytes()
        else:  # the whole storage as flat bytes, straight to the store (already contiguous uint8)
            logical = storage.nbytes()
            store = backend.store
            packed = Packed([store.put(storage_bytes(storage))], _STORAGE_META, t.device, {store.tier: logical})
        new = Entry(backend, packed, layer, key, storage._weak_ref(), (region, label))
        new.refs = 1
        with self.lock:
            self.entries[key] = new
        self.accounting.on_pack_tier(region, label, backend.store.tier, logical, logical, time.perf_counter() - t0)
        return Handle(new, view, packed.parts[0] if backend.store.tier == "device" else None,
                       self.release_fn)

    def release_keep(self, entry: KeepEntry) -> None:
        """Keep entries are never copied: no entry lives beyond its storage (a handle holds the tensor, so
        the storage address cannot be reused while the entry is in ``keep``)."""
        with self.lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self.keep.get(entry.sptr) is entry:
                del self.keep[entry.sptr]
            self.accounting.release_tier_locked("device", entry.nbytes, entry.region, entry.label)

    def release_part(self, entry: PartEntry) -> None:
        """Release a save of a batched host copy: account its part; the group's last one returns the buffer."""
        with self.lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
            _free_weak_ref(entry.weak)
            done = self.copies.release_locked(entry)
        if done is not None:
            self.copies.release_group(done)

    def release(self, entry: Entry) -> None:
        with self.lock:
            entry.refs -= 1
            if entry.refs > 0:
                if entry.waiting > entry.refs:  # (a save released before its unpack: at most refs still wait)
                    entry.waiting = entry.refs
                return
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
            if entry.weak is not None:
                _free_weak_ref(entry.weak)
                entry.weak = None
            entry.parts = None
            entry.future = None
            entry.decoded = None
            batch = entry.batch
            if batch is not None:
                entry.batch = None
                self.fp8.release_locked(batch)
            pending = entry.raw
            entry.raw = None
        region, label = entry.region
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

    def unpack(self, handle: Handle | torch.Tensor) -> torch.Tensor:
        if not isinstance(handle, Handle):  # a parameter (or empty tensor), saved as its detached alias
            return handle
        tensor = handle.tensor
        if tensor is not None:
            return tensor
        t0 = time.perf_counter()
        if self.fp8.pending:
            self.fp8.flush_all()
        if self.copies.pending:
            self.copies.flush_all()
        entry = handle.entry
        assert entry is not None
        if isinstance(entry, PartEntry):  # a batched host copy: the part of the group's buffer (once copied)
            out = self.copies.group_part(entry.group, entry.index, handle.view, handle.slot)
            self.accounting.on_unpack(time.perf_counter() - t0)
            return out
        self.prefetcher.start(entry.layer - 1, self.entries.values())
        packed = entry.packed
        if packed.meta[0] in ("fp8", "mxfp8"):
            batch = entry.batch
            if batch is not None:
                self.fp8.ready(entry, batch)
            out = entry.decoded
            if out is None:
                out = entry.backend.decode(packed, self.prefetcher.parts(entry))
            # several saves of one view (a dedupe) decode once: kept while a live save has not unpacked it yet
            entry.waiting -= 1
            entry.decoded = out if entry.waiting > 0 else None
        else:
            parts = self.prefetcher.parts(entry)
            dtype, shape, stride, offset = handle.view
            flat = parts[0]
            out = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, shape, stride)
        self.accounting.on_unpack(time.perf_counter() - t0)
        return out



__all__ = ["SavedTensorHooks"]
