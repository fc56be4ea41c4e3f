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

Layout: this module is the facade (construction, module hooks and wrappers, ``with``, ``close``);
the manager's behaviour lives in its bases: :mod:`.saved_hooks` (pack / unpack / release per policy,
prefetch), :mod:`.fp8_batch` (FP8 saves quantized and decoded per batch), :mod:`.host_batch` (host
copies of a layer in one call, on a background thread), :mod:`.regions` (region,
policy and layer of a save; :func:`layer_key`) and :mod:`.recompute` (checkpoint wrappers, the
anchor); the stored records are in :mod:`.entries`.

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
from typing import Any

import torch

from moonrt.memory.accounting import Accounting
from moonrt.memory.backends import Backend, DiskStore, HostStore, KeepStore, RemoteStore
from moonrt.memory.entries import _Entry, _KeepEntry
from moonrt.memory.fp8_batch import Fp8BatchMixin, _Batch
from moonrt.memory.host_batch import CopyBatchMixin, _CopyGroup
from moonrt.memory.policy import MemoryPolicy
from moonrt.memory.recompute import RecomputeMixin
from moonrt.memory.regions import RegionsMixin, _Frame, _generalize, layer_key
from moonrt.memory.saved_hooks import SavedTensorsMixin, _top_hooks
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


class ActivationManager(RegionsMixin, RecomputeMixin, SavedTensorsMixin, Fp8BatchMixin, CopyBatchMixin):
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
        self._decodable: dict[int, list[_Batch | None]] = {}  # forward -> its quantized FP8 batches, in order
        self._forward_id = 0
        self._fp8_batch_bytes = int(fp8_batch_bytes)
        self._copies: dict[str, _CopyGroup] = {}
        self._copy_batch_bytes = int(copy_batch_bytes)
        if copy_thread is None:
            copy_thread = idle_cpu()
        device = rank_device(model)  # the worker threads below start on it
        self._copier: ThreadPoolExecutor | None = (  # copy_thread: the one background copy thread
            ThreadPoolExecutor(1, thread_name_prefix="moonrt-host-copy", initializer=bind_thread, initargs=(device,))
            if copy_thread else None)
        self._min_bytes = self.policy.min_bytes
        self._own_rule: dict[str, str | None] = {}
        self._layer_names: dict[str, str] = {}
        self._layers: dict[str, int] = {}
        self._entries: dict[Any, _Entry] = {}
        self._param_ptrs = {t.untyped_storage()._cdata
                            for t in list(model.parameters()) + list(model.buffers())}
        self._prefetched_layers: set[int] = set()
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="moonrt-prefetch", initializer=bind_thread,
                                         initargs=(device,)) if self.policy.prefetch else None)
        self._keep_accounting = keep_accounting
        self._account_keep_next = True
        self._account_keep_now = False
        self._active = False
        self._hooks_on = False
        self._base_hooks: tuple[Any, Any] | None = None
        self._hook_marks: list[tuple[int, bool]] = []
        self._pack_fn = self._pack  # one bound-method object each: the hooks stack is compared by identity
        self._unpack_fn = self._unpack
        self._release_fn = self._release  # bound once: a handle holds it, not a new method object per save
        self._release_keep_fn = self._release_keep
        self._release_part_fn = self._release_part
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
            self._decodable.clear()
            for grp in self._copies.values():  # never copied: nothing will unpack them
                grp.storages = None
            self._copies.clear()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        host = self._stores.get("host")
        if host is not None:
            host.trim()
        disk = self._stores.get("disk")
        if disk is not None:
            disk.close()

    # ---- hooks ---------------------------------------------------------------------------------
    def __enter__(self) -> ActivationManager:
        if self._active:
            raise RuntimeError("ActivationManager: already entered; expected one 'with manager:' at a time")
        self._prefetched_layers.clear()
        self._account_keep_now = self._account_keep_next or self._keep_accounting == "every"
        self._account_keep_next = False
        self.accounting.forwards += 1
        self._forward_id += 1
        self.accounting.keep_forwards += self._account_keep_now
        self._base_hooks = _top_hooks(False)
        self._hook_marks = []
        self._hooks_on = False
        self._active = True
        self._set_hooks(self._hooks_wanted(self._frames[-1].policy))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._set_hooks(False)
        self._active = False
        self._hooks_on = False
        self._hook_marks = []
        self._flush_all()
        self._flush_all_copies()

    def account_keep_next(self) -> None:
        """Account the ``keep`` saves of the next forward too (per-tensor hooks in keep regions for that
        forward), e.g. to measure a step whose shapes changed."""
        self._account_keep_next = True

    def flush(self) -> None:
        """Send queued remote frees (call after backward; a new forward does it too)."""
        if self.remote is not None:
            self.remote.flush()


__all__ = ["ActivationManager", "idle_cpu", "layer_key"]
