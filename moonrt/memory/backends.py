"""Storage backends for tensors saved for backward (K3_SYSTEMS §8, "one abstraction").

Two layers:

- A **store** keeps a flat byte tensor somewhere and gives it back on the device it came from:
  :class:`KeepStore` (the compute device), :class:`HostStore` (host memory; from a CUDA source pinned and
  copied on a dedicated copy stream with events, :mod:`.copy_streams`; from a CPU source the same calls,
  synchronous), :class:`DiskStore` (one unnamed file per process in the policy's ``disk_path`` directory,
  its capacity reserved up front, the NVMe tier) and :class:`RemoteStore` (another rank's memory through
  :mod:`moonrt.memory.remote`).
- A **codec** turns a tensor into the byte tensors handed to the store: raw (bytes as they are), ``fp8``
  (1x128 block-wise E4M3 payload + fp32 scales, :mod:`moonrt.ops.fp8.codec`, quantized per layer batch) or ``mxfp8``
  (OCP MXFP8: E4M3 codes with one E8M0 scale byte per 32 elements along the last axis, ``floor`` scales,
  :mod:`moonrt.ops.mx`, quantized at the save: the format QAT's activations use, 33 bytes per 32 elements).

A :class:`Backend` is ``codec + store``; compositions are spelled ``"fp8+host"``, ``"mxfp8+host"``...
(:func:`parse_policy`). Recompute is not a backend: the manager runs it as non-reentrant
checkpointing. Every record knows its bytes per tier so the accounting can report them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from moonrt.config import ConfigError
from moonrt.memory.copy_streams import SYNC, CudaStreams, Streams, pin_host
import moonrt.ops.fp8.codec as fp8
from moonrt.ops import mx

TIERS = ("device", "host", "disk", "remote")
STORE_NAMES = ("keep", "host", "disk", "remote")
POLICIES = ("keep", "recompute", "fp8", "host", "disk", "remote", "fp8+host", "fp8+disk", "fp8+remote", "mxfp8",
            "mxfp8+host")
"""Every policy name the manager and the planner accept."""

MX_BLOCK = 32
"""Elements per E8M0 scale of the ``mxfp8`` codec (the OCP MX block), along a saved tensor's last axis."""


def policy_codec(name: str) -> str:
    """``"raw"``, ``"fp8"`` or ``"mxfp8"``: the codec of a policy name of :data:`POLICIES`."""
    head = name.split("+")[0]
    return head if head in ("fp8", "mxfp8") else "raw"


def parse_policy(name: str, field: str = "policy") -> tuple[bool, str]:
    """``"fp8+host"`` -> ``(True, "host")``; ``"recompute"`` -> ``(False, "recompute")``; the ``mxfp8`` policies
    -> ``(False, store)`` (their codec: :func:`policy_codec`).

    Raises ValueError naming ``field``, the value and the known policies.
    """
    if name not in POLICIES:
        raise ValueError(f"{field} = {name!r}: unknown policy; expected one of {', '.join(POLICIES)}")
    if name in ("fp8", "mxfp8"):
        return name == "fp8", "keep"
    if name.startswith(("fp8+", "mxfp8+")):
        return name.startswith("fp8+"), name.split("+", 1)[1]
    return False, name


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n]`` uint8 view of a contiguous tensor's bytes (no copy when already contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """``[storage nbytes]`` uint8 tensor aliasing all of ``storage`` (a ``t.untyped_storage()``: every view of it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# ---------------------------------------------------------------------------------------------
# Stores: flat uint8 tensors in, the same bytes out


class Store(Protocol):
    tier: str
    prefetch: bool
    batched: bool
    """Whether the store has ``put_many(datas, sizes) -> (buffer, views)`` (several CPU parts, one buffer)."""

    def put(self, data: torch.Tensor) -> Any:
        """Store ``[n]`` uint8 ``data``; returns a record. The caller may reuse ``data`` afterwards."""

    def get(self, record: Any, device: torch.device) -> torch.Tensor:
        """The stored bytes as ``[n]`` uint8 on ``device``. Thread-safe (called by the prefetcher)."""

    def free(self, record: Any) -> None:
        """Release the record's space."""


class KeepStore:
    """Keeps the tensor itself on the compute device (no copy)."""

    batched = False
    tier = "device"
    prefetch = False
    """Whether ``get`` moves bytes (worth starting early in backward)."""

    def put(self, data: torch.Tensor) -> Any:
        return data

    def get(self, record: Any, device: torch.device) -> torch.Tensor:
        return record

    def free(self, record: Any) -> None:
        pass


class HostStore:
    """Host memory: the bytes copied into a host buffer, brought back to the source's device by ``get``.

    Copies follow the copy-stream protocol of :mod:`moonrt.memory.copy_streams`: from a CUDA source into a
    pinned buffer (:func:`~moonrt.memory.copy_streams.pin_host`) on the device's dedicated copy stream, with an
    event the restore waits on, so the compute stream is not blocked; from a CPU source the same calls run
    synchronously (:data:`~moonrt.memory.copy_streams.SYNC`) into a pageable buffer. ``streams`` replaces the
    per-device choice (a stand-in that records the protocol, in the tests).

    Freed buffers go to a pool keyed by byte size and pinning and are reused by later ``put`` calls of the same
    size (the saved tensors of a training step repeat every step), so a steady-state step allocates no host
    memory: no allocator calls, no page faults on fresh pages, no pinned registration. A buffer freed after an
    asynchronous copy carries an event recorded on the copy stream at ``free``; the ``put`` that reuses it makes
    the copy stream wait on it first. For a CPU target, ``get`` hands out the buffer itself (zero copy); a buffer
    is only pooled again once no tensor outside the pool references its storage. :meth:`trim` releases the pool.
    """

    tier = "host"

    def __init__(self, streams: Streams | None = None) -> None:
        self._streams = streams
        self._cuda: CudaStreams | None = None
        # without CUDA (or a stand-in), host memory is the compute memory: get is free, nothing to start early
        self.prefetch = torch.cuda.is_available() or (streams is not None and not streams.synchronous)
        self._pool: dict[tuple[int, bool], list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()
        self.pooled_bytes = 0
        self.reused = 0

    def streams_for(self, device: torch.device) -> Streams:
        """The streams a copy from or to ``device`` runs on: the injected ones, CUDA's for a CUDA device, else
        the synchronous :data:`~moonrt.memory.copy_streams.SYNC`."""
        if self._streams is not None:
            return self._streams
        if device.type == "cuda":
            if self._cuda is None:
                self._cuda = CudaStreams()
            return self._cuda
        return SYNC

    def _take(self, n: int, pinned: bool) -> tuple[torch.Tensor, Any]:
        """A host buffer of ``n`` bytes (pooled, with the event its last copy's reads end at, or new)."""
        with self._lock:
            free = self._pool.get((n, pinned))
            if free:
                self.pooled_bytes -= n
                self.reused += 1
                return free.pop()
        return torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pinned), None

    def put(self, data: torch.Tensor) -> Any:
        device = data.device
        streams = self.streams_for(device)
        buf, ready = self._take(data.numel(), pin_host(device))
        copy = streams.copy_stream(device)
        copy.wait_stream(streams.current_stream(device))  # the source's producer was issued before this put
        if ready is not None:  # a reused buffer: its last reads (a restore) end first
            copy.wait_event(ready)
        with streams.use(copy):
            streams.copy_(buf, data)
            streams.record_stream(data, copy)
            event = streams.new_event()
            event.record(copy)
        if streams.synchronous:
            return buf  # the record is the buffer (no tuple kept alive per saved tensor)
        return buf, event, device

    batched = True
    """Whether :meth:`put_many` exists: the manager then copies a layer's saves of CPU tensors in one call."""
    ALIGN = 64
    """Byte alignment of each part in a :meth:`put_many` buffer (a multiple of every dtype's size)."""

    def put_many(self, datas: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy several CPU ``[sizes[i]]`` uint8 tensors into one pooled host buffer, each part at a multiple
        of :data:`ALIGN` bytes, with one ``torch._foreach_copy_`` call (bitwise copies, synchronous).

        Returns ``(buffer [total] uint8, [view_i [sizes[i]] of buffer])``; free the buffer with :meth:`free`
        once no view is needed (the views alias it: it is pooled again only when none is left).
        """
        align = self.ALIGN
        split: list[int] = []
        total = 0
        for n in sizes:
            pad = -n % align
            split.append(n)
            split.append(pad)
            total += n + pad
        buf, _ = self._take(total, pinned=False)  # pageable buffers were only ever read synchronously
        views = list(buf.split(split)[::2])
        torch._foreach_copy_(views, datas)
        return buf, views

    def get(self, record: Any, device: torch.device) -> torch.Tensor:
        """The bytes on ``device`` (the source's): a synchronous record's buffer itself on the host; else copied
        on the copy stream after the offload's event, the compute stream ordered after the copy."""
        if record.__class__ is not tuple:
            return record if device.type == "cpu" else SYNC.to(record, device)
        buf, event, _ = record
        streams = self.streams_for(device)
        copy = streams.copy_stream(device)
        with streams.use(copy):
            copy.wait_event(event)  # the offload's bytes are in ``buf``
            out = streams.to(buf, device)
        compute = streams.current_stream(device)
        compute.wait_stream(copy)
        streams.record_stream(out, compute)
        return out

    def free(self, record: Any) -> None:
        if record.__class__ is tuple:
            buf, _, device = record
            pinned = pin_host(device)
            streams = self.streams_for(device)
            ready = streams.new_event()  # after every copy issued so far on the copy stream: the restore's too
            ready.record(streams.copy_stream(device))
        else:
            buf, ready, pinned = record, None, False
        # reusable when nothing but ``buf`` holds the storage (a CPU ``get`` hands out aliasing views; the
        # storage object made for the query holds one more reference)
        if _USE_COUNT is None or _USE_COUNT(buf.untyped_storage()._cdata) > 2:
            return
        n = buf.numel()
        with self._lock:
            self._pool.setdefault((n, pinned), []).append((buf, ready))
            self.pooled_bytes += n

    def trim(self) -> None:
        """Release every pooled buffer."""
        with self._lock:
            self._pool.clear()
            self.pooled_bytes = 0


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""Reference count of a StorageImpl (used to recycle host buffers only when nothing aliases them)."""


_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _free_bytes(directory: Path) -> int | str:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (``"unknown"`` if not stated)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return "unknown"
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, size: int) -> None:
    """Allocate every block of ``[0, size)`` of ``fd`` now (OSError with ``ENOSPC`` when they do not fit)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        fallocate(fd, 0, size)
        return
    zeros = bytes(1 << 20)  # no posix_fallocate (macOS): write the zeros
    for off in range(0, size, len(zeros)):
        _pwrite_all(fd, memoryview(zeros)[: min(len(zeros), size - off)], off)


_PREADV = getattr(os, "preadv", None)
"""Reads straight into the result tensor (``os.pread``, one more copy, where the platform lacks it)."""


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        done = os.pwrite(fd, buf, offset)
        buf, offset = buf[done:], offset + done


class DiskStore:
    """One file per store (the NVMe tier) of ``capacity`` bytes, all of them reserved when it is created.

    ``directory`` is a directory (created if missing; never a file): every store, i.e. every rank
    and process, creates its **own new** file in it with :func:`tempfile.TemporaryFile`
    (``O_TMPFILE`` on Linux, else ``mkstemp``'s ``O_CREAT | O_EXCL`` followed by ``unlink``), so an
    existing file is never opened, truncated or removed, two ranks given the same directory never
    share a file, and the file has no name while it is used: the kernel frees it when the last
    descriptor closes -- on :meth:`close`, on normal exit and on any death of the process
    (SIGTERM, SIGINT, SIGKILL, OOM kill) -- so no signal handler is needed and nothing is left behind.

    Space: the whole capacity is allocated on creation (``posix_fallocate``), so a filesystem that cannot hold
    it is refused at once with :class:`~moonrt.config.ConfigError` ``"disk tier: no space left on DIR: need X
    bytes, free Y bytes"`` (the file closed, i.e. gone) instead of failing later. Bytes move with ``pwrite`` /
    ``preadv``, not through a memory map: a page of a map that the filesystem cannot back when written (a sparse
    file on a full disk) kills the process with SIGBUS and no message, while a write that finds no space (a
    copy-on-write filesystem can run out even inside reserved blocks) raises the same ConfigError.

    First-fit allocation over 64-byte aligned extents; freed extents are merged. ``get`` returns a
    copy, so the extent can be reused right after ``free``.
    """

    batched = False
    tier = "disk"
    prefetch = True
    ALIGN = 64

    def __init__(self, directory: str | Path | None, capacity: int, field: str = "disk_path") -> None:
        if capacity <= 0:
            raise ValueError(f"disk capacity = {capacity}: expected a positive number of bytes")
        self.directory = Path(directory) if directory else Path(tempfile.gettempdir())
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"{field} = {str(directory)!r}: an existing file, not a directory; expected a "
                              "directory in which each process creates its own offload file (existing files "
                              "are never overwritten)")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._file = tempfile.TemporaryFile(dir=self.directory, prefix=f"moonrt-offload-{os.getpid()}-",
                                                suffix=".bin")
        except OSError as exc:
            raise ConfigError(f"{field} = {str(directory)!r}: cannot create an offload file there "
                              f"({exc.strerror or exc}); expected a writable directory") from None
        self.capacity = int(capacity)
        self._fd = self._file.fileno()
        try:
            _reserve(self._fd, self.capacity)
        except OSError as exc:
            self._file.close()  # unnamed: the kernel frees whatever was allocated
            if exc.errno in _NO_SPACE:
                raise self._no_space(self.capacity) from None
            raise ConfigError(f"{field} = {str(directory)!r}: cannot reserve {self.capacity} bytes for the disk "
                              f"tier there ({exc.strerror or exc})") from None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._lock = threading.Lock()
        self.used = 0
        self.closed = False

    def _no_space(self, need: int) -> ConfigError:
        return ConfigError(f"disk tier: no space left on {self.directory}: need {need} bytes, free "
                           f"{_free_bytes(self.directory)} bytes (memory policy disk_path / disk_capacity_mib)")

    def _alloc(self, n: int) -> int:
        size = max(self.ALIGN, -(-n // self.ALIGN) * self.ALIGN)
        for i, (off, avail) in enumerate(self._free):
            if avail >= size:
                self._free[i] = (off + size, avail - size)
                if avail == size:
                    del self._free[i]
                self.used += size
                return off
        raise ValueError(f"disk store in {str(self.directory)!r}: capacity = {self.capacity} bytes exhausted "
                         f"({self.used} used, {n} requested); raise disk_capacity_mib in the memory policy")

    def put(self, data: torch.Tensor) -> Any:
        n = data.numel()
        with self._lock:
            off = self._alloc(n)
        try:
            # the disk tier's host copy (from a device source: one synchronous device -> host copy)
            _pwrite_all(self._fd, memoryview(data.to("cpu").contiguous().numpy()).cast("B"), off)
        except OSError as exc:
            self.free((off, n))
            if exc.errno in _NO_SPACE:
                raise self._no_space(n) from None
            raise
        return off, n

    def get(self, record: Any, device: torch.device) -> torch.Tensor:
        off, n = record
        out = torch.empty(n, dtype=torch.uint8, device="cpu")
        buf = memoryview(out.numpy())
        done = 0
        while done < n:
            if _PREADV is not None:
                got = _PREADV(self._fd, [buf[done:]], off + done)
            else:
                chunk = os.pread(self._fd, n - done, off + done)
                got = len(chunk)
                buf[done:done + got] = chunk
            if got == 0:
                raise OSError(errno.EIO, f"disk tier: short read from the offload file in {self.directory}")
            done += got
        return out.to(device)  # back on the device the bytes came from

    def free(self, record: Any) -> None:
        off, n = record
        size = max(self.ALIGN, -(-n // self.ALIGN) * self.ALIGN)
        with self._lock:
            self.used -= size
            self._free.append((off, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged

    def close(self) -> None:
        """Close the file (the kernel frees its blocks; it never had a lasting name)."""
        if self.closed:
            return
        self.closed = True
        self._file.close()


class RemoteStore:
    """Another rank's memory, through a :class:`moonrt.memory.remote.RemoteClient` (bytes travel on the channel's
    device, :func:`moonrt.memory.remote.channel_device`; ``get`` returns them on the device they came from)."""

    batched = False
    tier = "remote"
    prefetch = True

    def __init__(self, client: Any) -> None:
        self.client = client

    def put(self, data: torch.Tensor) -> Any:
        return self.client.put(data), data.numel()

    def get(self, record: Any, device: torch.device) -> torch.Tensor:
        key, n = record
        return self.client.get(key, n).to(device)

    def free(self, record: Any) -> None:
        self.client.free(record[0])


# ---------------------------------------------------------------------------------------------
# Backends: codec + store


@dataclasses.dataclass(slots=True)
class Packed:
    """One stored tensor (or storage). ``parts``: store records; ``meta``: what the codec needs back."""

    parts: list[Any]
    meta: Any
    device: torch.device
    tier_bytes: dict[str, int]


class Backend:
    """``codec + store``: ``pack(t) -> Packed``, ``unpack(Packed) -> t`` (bitwise equal unless FP8)."""

    def __init__(self, store: Store, use_fp8: bool = False, block: int = 128, use_mx: bool = False,
                 kernel: str = "auto") -> None:
        self.store = store
        self.use_fp8 = use_fp8
        self.use_mx = use_mx and not use_fp8
        self.block = block
        self.kernel = kernel  # the FP8 codec's backend (kernels.fp8; moonrt.ops.kernels)
        codec = "fp8+" if use_fp8 else ("mxfp8+" if self.use_mx else "")
        self.name = codec + ("keep" if store.tier == "device" else store.tier)
        if self.name in ("fp8+keep", "mxfp8+keep"):
            self.name = self.name[:-5]

    def quantizes(self, t: torch.Tensor) -> bool:
        """FP8 applies to floating tensors wider than one byte whose tiles are smaller than the raw
        bytes (a ``[N, 1]`` statistic padded to 128-wide tiles would grow, so it stays raw); MXFP8 to floating
        tensors wider than one byte whose last axis is a multiple of :data:`MX_BLOCK` (others stay raw)."""
        if not ((self.use_fp8 or self.use_mx) and t.is_floating_point() and t.element_size() > 1 and t.dim() >= 1
                and t.numel() > 0):
            return False
        if self.use_mx:
            return t.shape[-1] % MX_BLOCK == 0
        return fp8.stored_bytes(t.shape, self.block) < t.numel() * t.element_size()

    def pack(self, t: torch.Tensor) -> Packed:
        """Store ``t`` (any shape/dtype, contiguous or not). Raw codec: the bytes of ``t``."""
        with torch.no_grad():
            if self.use_mx and self.quantizes(t):
                q = mx.quantize(t, "mxfp8_e4m3", axis=-1, block=MX_BLOCK, scale_mode="floor")
                meta = ("mxfp8", tuple(t.shape), t.dtype)
                datas = [q.codes, q.scales]
                if self.store.tier == "device":
                    return Packed(datas, meta, t.device, {"device": q.nbytes})
                datas = [as_bytes(d) for d in datas]
            elif self.quantizes(t):
                return self.store_quantized(tuple(t.shape), t.dtype, t.device,
                                            *fp8.quantize(t, self.block, kernel=self.kernel))
            else:
                datas = [as_bytes(t) if self.store.tier != "device" else t.detach()]  # detach: no grad_fn cycle
                meta = ("raw", tuple(t.shape), t.dtype)
            parts = [self.store.put(d) for d in datas]
        nbytes = sum(d.numel() * d.element_size() for d in datas)
        return Packed(parts, meta, t.device, {self.store.tier: nbytes})

    def store_quantized(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        payload: torch.Tensor, scales: torch.Tensor) -> Packed:
        """Store an already quantized tensor of ``shape``/``dtype``: ``payload [M, nb * block]`` E4M3 and
        ``scales [M, nb]`` fp32 from :func:`moonrt.ops.fp8.codec.quantize` (or one entry of ``quantize_many``)."""
        nbytes = payload.numel() + 4 * scales.numel()
        meta = ("fp8", shape, dtype, tuple(scales.shape))
        if self.store.tier == "device":  # kept as they are (quantized_parts views them back): no byte views
            return Packed([payload, scales], meta, device, {"device": nbytes})
        parts = [self.store.put(as_bytes(payload)), self.store.put(as_bytes(scales))]
        return Packed(parts, meta, device, {self.store.tier: nbytes})

    def quantized_parts(self, packed: Packed, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload [M, nb * block] E4M3, scales [M, nb] fp32)`` of an FP8 record from its fetched parts."""
        sshape = packed.meta[3]
        return parts[0].view(fp8.E4M3).view(sshape[0], -1), parts[1].view(torch.float32).view(sshape)

    def fetch(self, packed: Packed) -> list[torch.Tensor]:
        """Bring the stored parts back to the compute device (the prefetcher calls this early)."""
        return [self.store.get(p, packed.device) for p in packed.parts]

    def decode(self, packed: Packed, parts: list[torch.Tensor]) -> torch.Tensor:
        """Rebuild the tensor from fetched parts."""
        if packed.meta[0] == "fp8":
            return fp8.dequantize(*self.quantized_parts(packed, parts), packed.meta[1], packed.meta[2],
                                  kernel=self.kernel)
        if packed.meta[0] == "mxfp8":
            _, shape, dtype = packed.meta
            scales = shape[:-1] + (shape[-1] // MX_BLOCK,)
            q = mx.MXQuantized(parts[0].view(shape), parts[1].view(scales), "mxfp8_e4m3", len(shape) - 1, MX_BLOCK,
                               torch.Size(shape))
            return q.dequantize(dtype)
        _, shape, dtype = packed.meta
        if self.store.tier == "device":
            return parts[0]
        return parts[0].view(dtype).view(shape)

    def unpack(self, packed: Packed) -> torch.Tensor:
        return self.decode(packed, self.fetch(packed))

    def free(self, packed: Packed) -> None:
        for p in packed.parts:
            self.store.free(p)


def make_backend(policy: str, stores: dict[str, Store], block: int = 128, kernel: str = "auto") -> Backend:
    """The backend of a storage policy (not ``recompute``) over the given stores (by store name); ``kernel``: the
    FP8 codec's backend (:mod:`moonrt.ops.kernels`)."""
    use_fp8, store = parse_policy(policy)
    if store == "recompute":
        raise ValueError("policy = 'recompute' has no storage backend; the manager checkpoints it")
    if store not in stores:
        raise ValueError(f"policy = {policy!r}: no {store!r} store configured (have {', '.join(sorted(stores))})")
    return Backend(stores[store], use_fp8=use_fp8, block=block, use_mx=policy_codec(policy) == "mxfp8",
                   kernel=kernel)


__all__ = [
    "Backend",
    "DiskStore",
    "HostStore",
    "KeepStore",
    "MX_BLOCK",
    "POLICIES",
    "Packed",
    "RemoteStore",
    "STORE_NAMES",
    "Store",
    "TIERS",
    "as_bytes",
    "make_backend",
    "parse_policy",
    "policy_codec",
    "storage_bytes",
]
