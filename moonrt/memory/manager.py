"""The unified activation manager (K3_SYSTEMS §8).

Every tensor autograd saves for backward goes through ``torch.autograd.graph.saved_tensors_hooks``
and is bound to a storage backend chosen by a :class:`~moonrt.memory.policy.MemoryPolicy` from
the module path (or region name) it was saved in. The model code never calls this module.

- **Keep / FP8 / host / disk / remote and compositions** (:mod:`.backends`).
- **Recompute**: modules matched by ``recompute`` rules (and ``moe_dispatch_only`` /
  ``attnres_checkpoint``) run under non-reentrant ``torch.utils.checkpoint``; their inputs are saved
  through the manager (policy ``keep``, so they are accounted and deduplicated) by an identity
  anchor node. A rule on a parent module makes the recompute span several layers;
  :meth:`ActivationManager.checkpoint` does the same for any function. ``moe_dispatch_only`` on a
  module with a ``routed(z, topk_ids, topk_weights)`` method (LatentMoE) checkpoints only that
  method: the dispatch input is saved (region ``<module>.routed``) and dispatch, experts and combine
  are replayed in backward; modules without ``routed`` are checkpointed whole.
- **Dedupe by storage**: parameters and buffers are never stored (autograd keeps the parameter);
  raw policies store a whole storage once, every view saved from it is rebuilt with ``set_``;
  FP8 entries are shared by identical views.
- **Prefetch**: in backward, the first unpack from layer ``l`` starts fetching every offloaded
  entry of layer ``l - 1`` (forward order) on a background thread; the accounting reports how much
  reload time was hidden.

Use::

    mgr = ActivationManager(model, policy, remote=client)      # wraps recompute modules
    with mgr:                                                  # saved-tensor hooks active
        loss = model(x).sum()
    loss.backward()
    print(mgr.accounting.summary())
    mgr.close()                                                # unwraps, frees the disk file
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import math
import re
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import (
    Backend,
    DiskStore,
    HostStore,
    KeepStore,
    Packed,
    RemoteStore,
    make_backend,
    storage_bytes,
)
from moonrt.memory.policy import MemoryPolicy
from moonrt.ops import fp8


def _generalize(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn`` (for listing known regions)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path)


def layer_key(path: str) -> str:
    """The layer a module path belongs to: the path up to its first numeric component
    (``layers.3.attn.q`` -> ``layers.3``), else its first component."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


class _Anchor(torch.autograd.Function):
    """Identity whose backward is identity; it saves its inputs so the manager sees (and accounts)
    the inputs a checkpointed region keeps."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class _Entry:
    """One stored unit (a storage for raw policies, a view for FP8), shared by deduplicated saves.

    An FP8 entry is first *pending* (``raw`` holds the tensor, ``packed`` is None) until its batch is
    quantized in one call; ``decoded`` holds its tensor when a batched decode ran ahead of its unpack."""

    __slots__ = ("backend", "packed", "refs", "layer", "future", "parts", "key", "weak", "region", "raw", "batch",
                 "decoded", "__weakref__")

    def __init__(self, backend: Backend, packed: Packed | None, layer: int, key: Any, weak: Any) -> None:
        self.backend = backend
        self.packed = packed
        self.refs = 0
        self.layer = layer
        self.future: Future | None = None
        self.parts: list[torch.Tensor] | None = None
        self.key = key
        self.weak = weak
        self.region: tuple[str, str] | None = None
        self.raw: torch.Tensor | None = None
        self.batch: _Batch | None = None
        self.decoded: torch.Tensor | None = None


class _KeepEntry:
    """A storage saved under ``keep``: only counted (bytes once per storage), never copied."""

    __slots__ = ("sptr", "nbytes", "refs", "region", "label")

    def __init__(self, sptr: int, nbytes: int, region: str, label: str) -> None:
        self.sptr = sptr
        self.nbytes = nbytes
        self.refs = 1
        self.region = region
        self.label = label


class _Batch:
    """FP8 saves of one layer and policy, quantized together (:func:`moonrt.ops.fp8.quantize_many`) when
    the layer ends, the batch reaches ``fp8_batch_bytes``, the forward ends or backward starts; in backward
    the first unpack decodes every entry of the batch that is at hand in one call."""

    __slots__ = ("backend", "layer", "entries", "nbytes", "live", "decoded")

    def __init__(self, backend: Backend, layer: int) -> None:
        self.backend = backend
        self.layer = layer
        self.entries: list[_Entry] = []
        self.nbytes = 0
        self.live = 0
        self.decoded = False


class _Frame:
    """What a save inside an active module/region resolves to: region name, policy, layer, whether a rule
    decided it (inherited by children) and the layer index (assigned on first use)."""

    __slots__ = ("region", "policy", "layer_name", "decided", "layer")

    def __init__(self, region: str, policy: str, layer_name: str, decided: bool) -> None:
        self.region = region
        self.policy = policy
        self.layer_name = layer_name
        self.decided = decided
        self.layer: int | None = None


class _Handle:
    """What autograd holds instead of a saved tensor; releases its entry when autograd drops it
    (``__del__``: much cheaper per saved tensor than a ``weakref.finalize``)."""

    __slots__ = ("entry", "view", "tensor", "release", "__weakref__")

    def __init__(self, entry: Any, view: Any, tensor: torch.Tensor | None = None,
                 release: Any = None) -> None:
        self.entry = entry
        self.view = view
        self.tensor = tensor
        self.release = release

    def __del__(self) -> None:
        if self.release is not None:
            try:
                self.release(self.entry)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to account
                pass


class ActivationManager:
    """Saved-tensor storage policies for one model (K3_SYSTEMS §8). See the module docstring.

    Args:
        model: the module whose forward runs inside ``with manager:``; module paths are
            ``model.named_modules()`` names.
        policy: the :class:`MemoryPolicy` (rules by module path / region name).
        remote: a :class:`moonrt.memory.remote.RemoteClient` when any rule uses a remote policy.
        fp8_batch_bytes: FP8 saves of a layer are quantized together once this many input bytes are
            pending (or the layer / forward ends): the most raw bytes held beyond their FP8 copy.
    """

    def __init__(self, model: torch.nn.Module, policy: MemoryPolicy | None = None, remote: Any = None,
                 fp8_batch_bytes: int = 64 * 2**20) -> None:
        self.model = model
        self.policy = policy or MemoryPolicy()
        self.policy.validate()
        self._lock = threading.RLock()
        self.accounting = Accounting(lock=self._lock)  # one lock for the entries and the counters
        self.remote = remote
        self._stores: dict[str, Any] = {"keep": KeepStore()}
        used = self.policy.tiers_used()
        if "host" in used:
            self._stores["host"] = HostStore()
        if "disk" in used:
            # a new unnamed file of this process in the disk_path directory (never an existing file)
            self._stores["disk"] = DiskStore(self.policy.disk_path or None, self.policy.disk_capacity_mib * 2**20)
        if "remote" in used:
            if remote is None:
                raise ValueError("memory policy uses a remote policy but no remote client was given "
                                 "(ActivationManager(..., remote=RemoteClient(peer, group)))")
            self._stores["remote"] = RemoteStore(remote)
        self._backends: dict[str, Backend] = {}
        self._keep_backend: Backend | None = None
        self._stack: list[str] = []
        # per active module/region: (region, policy, layer name, a rule decided), so a save reads the
        # innermost frame instead of matching rules (the resolution changes only on enter/exit)
        self._root = _Frame("<root>", self.policy.default, "<root>", False)
        self._frames: list[_Frame] = [self._root]
        self._frame_cache: dict[tuple[str, int], _Frame] = {}
        self._keep: dict[int, _KeepEntry] = {}
        self._pending: dict[str, _Batch] = {}
        self._fp8_batch_bytes = int(fp8_batch_bytes)
        self._min_bytes = self.policy.min_bytes
        self._own_rule: dict[str, str | None] = {}
        self._layer_names: dict[str, str] = {}
        self._layers: dict[str, int] = {}
        self._entries: dict[Any, _Entry] = {}
        self._param_ptrs = {t.untyped_storage()._cdata
                            for t in list(model.parameters()) + list(model.buffers())}
        self._prefetched_layers: set[int] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moonrt-prefetch") if self.policy.prefetch else None
        self._hooks_ctx: Any = None
        self._anchoring = False
        self._handles: list[Any] = []
        self._wrapped: list[torch.nn.Module] = []
        self._wrapped_methods: list[tuple[torch.nn.Module, str]] = []
        self.known_regions = self._attach()

    # ---- setup ---------------------------------------------------------------------------------
    def _attach(self) -> list[str]:
        names = {}
        for name, mod in self.model.named_modules():
            if not name:
                continue
            names[name] = getattr(mod, "memory_region", None)
            self._handles.append(mod.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(mod.register_forward_hook(functools.partial(self._exit, name), always_call=True))
        self._module_regions = {n: r for n, r in names.items() if r}
        known = sorted({_generalize(n) for n in names} | {r for r in names.values() if r})
        ckpt = {r.match for r in self.policy.rules if r.policy == "recompute"}
        ckpt |= set(self.policy.moe_dispatch_only) | set(self.policy.attnres_checkpoint)
        patterns = [r.match for r in self.policy.rules] + list(self.policy.moe_dispatch_only) + list(
            self.policy.attnres_checkpoint)
        def method_exists(pat: str) -> bool:
            owner, _, meth = pat.rpartition(".")
            mod = dict(self.model.named_modules()).get(owner)
            return mod is not None and callable(getattr(mod, meth, None)) and meth not in mod._modules

        for pat in patterns:
            if method_exists(pat):
                continue
            if not any(fnmatch.fnmatchcase(n, pat) or (r and fnmatch.fnmatchcase(r, pat)) for n, r in names.items()):
                warnings.warn(f"memory policy pattern {pat!r} matches no module or region of the model; "
                              f"known regions: {', '.join(known)}", stacklevel=3)
        modules = dict(self.model.named_modules())
        whole = ckpt - set(self.policy.moe_dispatch_only)
        for name, mod in modules.items():
            region = names.get(name)

            def hit(pats: set[str] | list[str], name: str = name, region: str | None = region) -> bool:
                return any(fnmatch.fnmatchcase(name, p) or bool(region and fnmatch.fnmatchcase(region, p))
                           for p in pats)

            if not name:
                continue
            routed = getattr(mod, "routed", None)
            if hit(self.policy.moe_dispatch_only) and callable(routed) and not isinstance(routed, torch.nn.Module) \
                    and not hit(whole):
                self._wrap_routed(mod, f"{name}.routed")  # only the dispatch input is saved
                known.append(f"{_generalize(name)}.routed")
            elif hit(ckpt):
                self._wrap_checkpoint(mod)
        # "module.method" patterns: a region around a method call (e.g. ``attn_res.sublayer_input``)
        for pat in dict.fromkeys(patterns):
            owner, _, meth = pat.rpartition(".")
            mod = modules.get(owner)
            fn = getattr(mod, meth, None) if mod is not None and meth not in mod._modules else None
            if callable(fn) and not isinstance(fn, torch.nn.Module):
                self._wrap_method(mod, meth, pat, pat in ckpt)
                known.append(pat)
        return known

    def _wrap_method(self, mod: torch.nn.Module, meth: str, region: str, recompute: bool) -> None:
        """Mark calls of ``mod.meth`` as region ``region``; with ``recompute`` run them checkpointed.

        Checkpointed calls get shallow copies of dataclass arguments (list fields copied), so a state
        object the caller mutates later (e.g. the AttnRes stream) is replayed as it was.
        """
        inner = getattr(mod, meth)

        def tagged(*args: Any, **kwargs: Any) -> Any:
            with self.region(region):
                return inner(*args, **kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not (recompute and torch.is_grad_enabled()):
                return tagged(*args, **kwargs)
            frozen = []
            for a in args:
                if dataclasses.is_dataclass(a) and not isinstance(a, type):
                    a = copy.copy(a)
                    for f in dataclasses.fields(a):
                        v = getattr(a, f.name)
                        if isinstance(v, list):
                            setattr(a, f.name, list(v))
                frozen.append(a)
            return checkpoint(tagged, *self._anchor(frozen), use_reentrant=False, **kwargs)

        setattr(mod, meth, call)
        self._wrapped_methods.append((mod, meth))

    def _wrap_routed(self, mod: torch.nn.Module, region: str) -> None:
        """``moe_dispatch_only`` on a module with a ``routed(z, topk_ids, topk_weights)`` method (the
        LatentMoE routed path): checkpoint that method, so its saved inputs are exactly the dispatch
        input ``z [N, L]``, ``topk_ids [N, k]``, ``topk_weights [N, k]`` (accounted in region
        ``region``, label ``recompute``) and backward replays dispatch, experts and combine (K3_SYSTEMS
        §8). Router, down-projection, shared experts and norm/up-projection run outside it and save
        under their own policies; the router is not replayed, so routing is counted once."""
        inner = mod.routed

        def tagged(*args: Any, **kwargs: Any) -> Any:
            with self.region(region):
                return inner(*args, **kwargs)

        def routed(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return tagged(*args, **kwargs)
            with self.region(region):
                anchored = self._anchor(args, floating_only=False)
            return checkpoint(tagged, *anchored, use_reentrant=False, **kwargs)

        mod.routed = routed
        self._wrapped_methods.append((mod, "routed"))

    def _wrap_checkpoint(self, mod: torch.nn.Module) -> None:
        inner = mod.forward
        recorders = [m for m in mod.modules() if isinstance(getattr(m, "record_routing", None), bool)]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            calls = [0]

            def run(*a: Any, **kw: Any) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    return inner(*a, **kw)
                # the replay in backward: MoE layers must not count their routing twice
                saved = [m.record_routing for m in recorders]
                for m in recorders:
                    m.record_routing = False
                try:
                    return inner(*a, **kw)
                finally:
                    for m, v in zip(recorders, saved):
                        m.record_routing = v

            return checkpoint(run, *self._anchor(args), use_reentrant=False, **kwargs)

        mod.forward = forward
        self._wrapped.append(mod)

    def close(self) -> None:
        """Remove hooks and wrappers, stop the prefetcher, close (and so free) the disk file."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._wrapped:
            del mod.forward
        self._wrapped.clear()
        for mod, meth in self._wrapped_methods:
            delattr(mod, meth)
        self._wrapped_methods.clear()
        with self._lock:
            for batch in self._pending.values():  # never quantized: nothing will unpack them
                for e in batch.entries:
                    e.raw = None
            self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        host = self._stores.get("host")
        if host is not None:
            host.trim()
        disk = self._stores.get("disk")
        if disk is not None:
            disk.close()

    # ---- regions -------------------------------------------------------------------------------
    def _rule_of(self, name: str) -> str | None:
        """Policy of the first non-recompute rule matching module/region ``name`` (or its
        ``memory_region``), else None. Cached: names repeat every step."""
        try:
            return self._own_rule[name]
        except KeyError:
            pass
        mod_region = self._module_regions.get(name)
        own = None
        for rule in self.policy.rules:
            if rule.policy != "recompute" and (fnmatch.fnmatchcase(name, rule.match) or (
                    mod_region and fnmatch.fnmatchcase(mod_region, rule.match))):
                own = rule.policy
                break
        self._own_rule[name] = own
        return own

    def _push(self, name: str) -> None:
        self._stack.append(name)
        parent = self._frames[-1]
        key = (name, id(parent))
        frame = self._frame_cache.get(key)
        if frame is None:
            own = self._rule_of(name)
            lk = self._layer_names.get(name)
            if lk is None:
                lk = self._layer_names[name] = layer_key(name)
            if own is not None:
                frame = _Frame(name, own, lk, True)
            elif parent.decided:
                frame = _Frame(parent.region, parent.policy, lk, True)
            else:
                frame = _Frame(name, self.policy.default, lk, False)
            self._frame_cache[key] = frame  # frames are never dropped, so the parent's id stays unique
        self._frames.append(frame)

    def _pop(self) -> None:
        self._stack.pop()
        self._frames.pop()

    def _enter(self, name: str, mod: torch.nn.Module, args: Any) -> None:
        self._push(name)

    def _exit(self, name: str, mod: torch.nn.Module, args: Any, out: Any) -> None:
        if self._stack and self._stack[-1] == name:
            self._pop()

    @contextmanager
    def region(self, name: str):
        """Mark a named region (for code outside modules, e.g. a pipeline stage executor)."""
        self._push(name)
        try:
            yield
        finally:
            self._pop()

    def checkpoint(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Function-level recompute (non-reentrant); may span several layers."""
        if torch.is_grad_enabled():
            args = self._anchor(args)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def _anchor(self, args: Any, floating_only: bool = True) -> list[Any]:
        """Pass the floating (or, with ``floating_only=False``, all) tensor arguments of a recompute
        region through :class:`_Anchor`, so the inputs the checkpoint keeps are saved (policy label
        ``recompute``, stored as ``keep``)."""
        args = list(args)
        idx = [i for i, a in enumerate(args)
               if isinstance(a, torch.Tensor) and (a.is_floating_point() or not floating_only)]
        if idx:
            self._anchoring = True
            try:
                anchored = _Anchor.apply(*[args[i] for i in idx])
            finally:
                self._anchoring = False
            for i, t in zip(idx, anchored):
                args[i] = t
        return args

    def resolve(self, stack: list[str] | None = None) -> tuple[str, str]:
        """``(region, policy)`` for a save under module stack ``stack`` (innermost last)."""
        stack = self._stack if stack is None else stack
        for name in reversed(stack):
            mod_region = self._module_regions.get(name)
            for rule in self.policy.rules:
                if rule.policy == "recompute":
                    continue
                hit = fnmatch.fnmatchcase(name, rule.match)
                if hit or (mod_region and fnmatch.fnmatchcase(mod_region, rule.match)):
                    return name, rule.policy
        return (stack[-1] if stack else "<root>"), self.policy.default

    def _backend(self, policy: str) -> Backend:
        b = self._backends.get(policy)
        if b is None:
            b = self._backends[policy] = make_backend(policy, self._stores, self.policy.fp8_block)
        return b

    # ---- hooks ---------------------------------------------------------------------------------
    def __enter__(self) -> ActivationManager:
        self._prefetched_layers.clear()
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks_ctx.__exit__(*exc)
        self._hooks_ctx = None
        self._flush_all()

    def _layer_of(self, frame: _Frame) -> int:
        layer = frame.layer
        if layer is None:
            with self._lock:
                layer = frame.layer = self._layers.setdefault(frame.layer_name, len(self._layers))
        return layer

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
            return _Handle(entry, None, t.detach(), self._release_keep)
        layer = self._layer_of(frame)
        region = frame.region
        backend = self._backend(policy)
        fp8 = backend.quantizes(t)
        view = (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        key = (policy, sptr, view) if fp8 else (policy, sptr)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.weak is not None and entry.weak.expired():
                entry = None
            if entry is not None:
                entry.refs += 1
                self.accounting.on_dedupe(region, label)
                return _Handle(entry, view, None, self._release)
        if fp8:  # pending: quantized with the rest of its batch (layer) in one call
            entry = _Entry(backend, None, layer, key, StorageWeakRef(storage))
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
                    batch = self._pending[policy] = _Batch(backend, layer)
                batch.entries.append(entry)
                batch.live += 1
                batch.nbytes += t.numel() * t.element_size()
                entry.batch = batch
                if batch.nbytes >= self._fp8_batch_bytes:
                    self._flush(policy)
            self.accounting.pack_s += time.perf_counter() - t0
            return _Handle(entry, view, None, self._release)
        if backend.store.tier == "device":
            packed = backend.pack(t)  # keeps the tensor itself; bytes counted by storage
            packed.tier_bytes = {"device": storage.nbytes()}
            logical = storage.nbytes()
        else:  # the whole storage as flat bytes, straight to the store (already contiguous uint8)
            logical = storage.nbytes()
            store = backend.store
            packed = Packed([store.put(storage_bytes(t))], ("raw", (logical,), torch.uint8), t.device,
                            {store.tier: logical})
        entry = _Entry(backend, packed, layer, key, StorageWeakRef(storage))
        entry.refs = 1
        entry.region = (region, label)
        with self._lock:
            self._entries[key] = entry
        self.accounting.on_pack_tier(region, label, backend.store.tier, logical, logical, time.perf_counter() - t0)
        return _Handle(entry, view, packed.parts[0] if backend.store.tier == "device" else None, self._release)

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
        quantized = fp8.quantize_many([e.raw for e in todo], backend.block)
        for e, (payload, scales) in zip(todo, quantized):
            raw = e.raw
            e.packed = backend.store_quantized(tuple(raw.shape), raw.dtype, raw.device, payload, scales)
            e.raw = None
        dt = (time.perf_counter() - t0) / len(todo)
        tier = backend.store.tier
        for e in todo:
            region, label = e.region
            nbytes = e.packed.tier_bytes[tier]
            meta = e.packed.meta
            logical = math.prod(meta[1]) * meta[2].itemsize
            self.accounting.on_pack_tier(region, label, tier, logical, nbytes, dt)

    def _flush_all(self) -> None:
        if self._pending:
            with self._lock:
                for policy in list(self._pending):
                    self._flush(policy)

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

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            entry.parts = None
            entry.future = None
            entry.decoded = None
            batch = entry.batch
            if batch is not None:
                entry.batch = None
                batch.live -= 1
                if batch.live == 0:
                    batch.entries = []  # no entry left to decode: drop the references
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

    def _unpack(self, handle: _Handle | torch.Tensor) -> torch.Tensor:
        if handle.__class__ is not _Handle:  # a parameter (or empty tensor), saved as its detached alias
            return handle
        tensor = handle.tensor
        if tensor is not None:
            return tensor
        t0 = time.perf_counter()
        if self._pending:
            self._flush_all()
        entry = handle.entry
        assert entry is not None
        self._start_prefetch(entry.layer - 1)
        packed = entry.packed
        if packed.meta[0] == "fp8":
            batch = entry.batch
            if entry.decoded is None and batch is not None and not batch.decoded:
                self._decode_batch(batch)
            out = entry.decoded
            if out is not None:
                entry.decoded = None  # a later unpack of the same entry decodes again
            else:
                out = entry.backend.decode(packed, self._parts(entry))
        else:
            parts = self._parts(entry)
            dtype, shape, stride, offset = handle.view
            flat = parts[0]
            out = torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), offset, shape, stride)
        self.accounting.on_unpack(time.perf_counter() - t0)
        return out

    def flush(self) -> None:
        """Send queued remote frees (call after backward; a new forward does it too)."""
        if self.remote is not None:
            self.remote.flush()


__all__ = ["ActivationManager", "layer_key"]
