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
- **Keep regions cost nothing per saved tensor**: the hooks are only on the stack inside modules /
  regions whose policy is not ``keep`` (:mod:`.saved_hooks`). Keep saves are accounted (bytes per region,
  peak) in the first forward (``keep_accounting="first"``, the default; :meth:`ActivationManager.account_keep_next`
  re-arms it) or in every forward (``"every"``, one hook call per keep save); ``accounting.keep_forwards``
  says how many forwards the keep rows cover.

Layout: this module is the facade (construction, module hooks and wrappers, ``with``, ``close``); the manager
is composed of parts, each an object with its own state: ``regions`` (:class:`~.regions.Regions`: region, policy
and layer of a save; :func:`layer_key`), ``hooks`` (:class:`~.saved_hooks.SavedTensorHooks`: pack / unpack /
release per policy; it holds the other parts), ``fp8_batches`` (:class:`~.fp8_batch.Fp8Batcher`: FP8 saves
quantized and decoded per batch), ``copies`` (:class:`~.host_batch.CopyBatcher`: host copies of a layer in one
call, on a background thread), ``prefetcher`` (:class:`~.prefetch.Prefetcher`) and ``recompute``
(:class:`~.recompute.Recompute`: checkpoint wrappers, the anchor); the stored records are in :mod:`.entries`.

Use::

    mgr = ActivationManager(model, policy, remote=client)      # wraps recompute modules
    with mgr:                                                  # saved-tensor hooks active
        loss = model(x).sum()
    loss.backward()
    print(mgr.accounting.summary())
    mgr.close()                                                # unwraps, frees the disk file
"""

from __future__ import annotations

import fnmatch
import functools
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import DiskStore, HostStore, KeepStore, RemoteStore
from moonrt.memory.fp8_batch import Fp8Batcher
from moonrt.memory.host_batch import CopyBatcher
from moonrt.memory.policy import MemoryPolicy
from moonrt.memory.prefetch import Prefetcher
from moonrt.memory.recompute import Recompute
from moonrt.memory.regions import Regions, generalize, layer_key
from moonrt.memory.saved_hooks import SavedTensorHooks
from moonrt.ops.kernels import check_choice

LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
"""Where launchers put the number of ranks on this node (torchrun / ``moonrt launch``, Open MPI, MPICH, SLURM)."""


def idle_cpu() -> bool:
    """Whether this process has a CPU that torch's intra-op threads leave idle: the CPUs it may run on
    (its affinity mask), shared among the node's ranks (the first of :data:`LOCAL_RANKS_ENV` set; 1 when
    none is), number more than ``torch.get_num_threads()``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = next((int(v) for v in (os.environ.get(k, "") for k in LOCAL_RANKS_ENV) if v.isdigit() and int(v) > 0), 1)
    return cpus // ranks > torch.get_num_threads()


def rank_device(model: torch.nn.Module) -> int | None:
    """The CUDA device index this rank computes on, which the manager's worker threads make current when they start
    (:func:`bind_thread`): the device of the model's first CUDA parameter or buffer, else CUDA's current device of
    the constructing thread (``moonrt train`` made ``cuda:LOCAL_RANK`` current) once this process uses CUDA; None
    otherwise (a CPU job on a GPU node makes no CUDA context for its threads)."""
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "cuda":
            return t.device.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def bind_thread(device: int | None) -> None:
    """A worker thread's initializer: make ``device`` its current CUDA device (a new thread starts on device 0, so
    the FP8 quantize/decode and the prefetch of a rank with ``LOCAL_RANK != 0`` would run on another rank's GPU)."""
    if device is not None:
        torch.cuda.set_device(device)


class ActivationManager:
    """Saved-tensor storage policies for one model (K3_SYSTEMS §8). See the module docstring.

    Args:
        model: the module whose forward runs inside ``with manager:``; module paths are
            ``model.named_modules()`` names.
        policy: the :class:`MemoryPolicy` (rules by module path / region name).
        remote: a :class:`moonrt.memory.remote.RemoteClient` when any rule uses a remote policy.
        fp8_batch_bytes: FP8 saves of a layer are quantized together once this many input bytes are
            pending (or the layer / forward ends): the most raw bytes held beyond their FP8 copy.
        keep_accounting: ``"first"``: saves under ``keep`` are accounted in the first forward only (later
            forwards run keep regions without saved-tensor hooks); ``"every"``: in every forward.
        copy_batch_bytes: host saves of CPU tensors are copied per layer in one call (:mod:`.host_batch`),
            or once this many bytes are pending: the most source bytes held until their copy is submitted.
        copy_thread: run those copies (and device-tier FP8 quantization) on a background thread, overlapping
            the forward (backward waits for them), as a CUDA copy stream would. ``None`` (the default): on
            when this process has a CPU its compute threads leave idle (:func:`idle_cpu`), where it hides
            the copy (benchmarks/RESULTS.md); without one the thread would only compete with the forward.
        fp8_kernel: the FP8 codec's backend for the ``fp8`` tiers (``kernels.fp8``: auto, torch, numba, triton;
            :mod:`moonrt.ops.kernels`); every backend stores the same bits.
    """

    def __init__(self, model: torch.nn.Module, policy: MemoryPolicy | None = None, remote: Any = None,
                 fp8_batch_bytes: int = 64 * 2**20, keep_accounting: str = "first",
                 copy_batch_bytes: int = 64 * 2**20, copy_thread: bool | None = None, fp8_kernel: str = "auto") -> None:
        if keep_accounting not in ("first", "every"):
            raise ValueError(f"keep_accounting = {keep_accounting!r}: expected 'first' or 'every'")
        self._fp8_kernel = check_choice("fp8", fp8_kernel)  # the FP8 codec's backend (kernels.fp8)
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
        if copy_thread is None:
            copy_thread = idle_cpu()
        device = rank_device(model)  # the worker threads below start on it
        self._copier: ThreadPoolExecutor | None = (  # copy_thread: the one background copy thread
            ThreadPoolExecutor(1, thread_name_prefix="moonrt-host-copy", initializer=bind_thread, initargs=(device,))
            if copy_thread else None)
        pool = (ThreadPoolExecutor(1, thread_name_prefix="moonrt-prefetch", initializer=bind_thread, initargs=(device,))
                if self.policy.prefetch else None)
        self.prefetcher = Prefetcher(self._lock, self.accounting, pool)
        self.fp8_batches = Fp8Batcher(self._lock, self.accounting, self._copier, self._fp8_kernel, fp8_batch_bytes,
                                      self.prefetcher.parts)
        self.copies = CopyBatcher(self._lock, self.accounting, self._copier, copy_batch_bytes)
        module_names = {name: getattr(mod, "memory_region", None) for name, mod in model.named_modules() if name}
        self.regions = Regions(self.policy, {n: r for n, r in module_names.items() if r}, self._lock)
        param_ptrs = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
        self.hooks = SavedTensorHooks(self.policy, self.accounting, self._lock, self._stores, self._fp8_kernel,
                                      param_ptrs, self.regions, self.fp8_batches, self.copies, self.prefetcher)
        if type(self)._pack is not ActivationManager._pack:  # a subclass observes the saves: push its _pack
            self.hooks.pack_fn = self._pack
        self.recompute = Recompute(self.regions, self.hooks)
        self._keep_accounting = keep_accounting
        self._account_keep_next = True
        self._handles: list[Any] = []
        self.known_regions = self._attach(module_names)

    # ---- setup ---------------------------------------------------------------------------------
    def _attach(self, names: dict[str, str | None]) -> list[str]:
        """Register the module hooks that push / pop regions, wrap what the policy recomputes; returns the known
        regions (``names``: module path -> its ``memory_region`` or None, the root module left out)."""
        enter, exit_ = self.regions.enter, self.regions.exit
        for name, mod in self.model.named_modules():
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(functools.partial(enter, name)))
            self._handles.append(mod.register_forward_hook(functools.partial(exit_, name), always_call=True))
        known = sorted({generalize(n) for n in names} | {r for r in names.values() if r})
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
                self.recompute.wrap_routed(mod, f"{name}.routed")  # only the dispatch input is saved
                known.append(f"{generalize(name)}.routed")
            elif hit(ckpt):
                self.recompute.wrap_checkpoint(mod)
        # "module.method" patterns: a region around a method call (e.g. ``attn_res.sublayer_input``)
        for pat in dict.fromkeys(patterns):
            owner, _, meth = pat.rpartition(".")
            mod = modules.get(owner)
            fn = getattr(mod, meth, None) if mod is not None and meth not in mod._modules else None
            if callable(fn) and not isinstance(fn, torch.nn.Module):
                self.recompute.wrap_method(mod, meth, pat, pat in ckpt)
                known.append(pat)
        return known

    def close(self) -> None:
        """Remove hooks and wrappers, stop the prefetcher, close (and so free) the disk file."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.recompute.unwrap()
        self.fp8_batches.close()
        self.copies.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = self.fp8_batches.copier = self.copies.copier = None
        self.prefetcher.close()
        host = self._stores.get("host")
        if host is not None:
            host.trim()
        disk = self._stores.get("disk")
        if disk is not None:
            disk.close()

    # ---- regions, recompute ----------------------------------------------------------------------
    def region(self, name: str) -> AbstractContextManager[None]:
        """Mark a named region (for code outside modules, e.g. a pipeline stage executor)."""
        return self.regions.region(name)

    def resolve(self, stack: list[str] | None = None) -> tuple[str, str]:
        """``(region, policy)`` for a save under module stack ``stack`` (innermost last; default: the active one)."""
        return self.regions.resolve(stack)

    def checkpoint(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Function-level recompute (non-reentrant); may span several layers."""
        return self.recompute.checkpoint(fn, *args, **kwargs)

    # ---- hooks ---------------------------------------------------------------------------------
    def __enter__(self) -> ActivationManager:
        if self.hooks.active:
            raise RuntimeError("ActivationManager: already entered; expected one 'with manager:' at a time")
        self.prefetcher.new_forward()
        account_keep = self._account_keep_next or self._keep_accounting == "every"
        self._account_keep_next = False
        self.accounting.forwards += 1
        self.fp8_batches.new_forward()
        self.accounting.keep_forwards += account_keep
        self.hooks.start(account_keep)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hooks.stop()

    def account_keep_next(self) -> None:
        """Account the ``keep`` saves of the next forward too (per-tensor hooks in keep regions for that
        forward), e.g. to measure a step whose shapes changed."""
        self._account_keep_next = True

    def flush(self) -> None:
        """Send queued remote frees (call after backward; a new forward does it too)."""
        if self.remote is not None:
            self.remote.flush()


    # ---- the parts' state under the names of the former mixin layout (read by tests) -----------------
    @property
    def _pool(self) -> ThreadPoolExecutor | None:
        """The prefetch thread (``prefetcher.pool``)."""
        return self.prefetcher.pool

    @property
    def _entries(self) -> dict[Any, Any]:
        """The live stored entries by dedupe key (``hooks.entries``)."""
        return self.hooks.entries

    @property
    def _decodable(self) -> dict[int, Any]:
        """The FP8 decode-ahead candidates per forward (``fp8_batches.decodable``)."""
        return self.fp8_batches.decodable

    def _pack(self, t: torch.Tensor) -> Any:
        """The pack hook (:meth:`SavedTensorHooks.pack`). A subclass that overrides it (to log the saves, say) has
        its override pushed instead, so it sees every save; the manager's own pushes ``hooks.pack`` directly."""
        return self.hooks.pack(t)

    @property
    def _pack_fn(self) -> Any:
        """The pack hook the manager pushes (``hooks.pack_fn``); settable, to observe the saves."""
        return self.hooks.pack_fn

    @_pack_fn.setter
    def _pack_fn(self, fn: Any) -> None:
        self.hooks.pack_fn = fn

    @property
    def _group_part(self) -> Any:
        """How an unpack rebuilds a batched host save (``copies.group_part``); settable, to observe it."""
        return self.copies.group_part

    @_group_part.setter
    def _group_part(self, fn: Any) -> None:
        self.copies.group_part = fn  # type: ignore[method-assign]


__all__ = ["ActivationManager", "idle_cpu", "layer_key"]
