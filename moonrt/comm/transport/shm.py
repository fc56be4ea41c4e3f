"""The ``shm`` symmetric heap: the CPU ranks of one host write each other's buffers in POSIX shared memory.

Every allocation is one segment under ``/dev/shm`` holding every rank's buffer side by side (64-byte aligned),
mapped into every rank of the group (``mmap``; tensors by ``torch.frombuffer``, so a peer's buffer is a plain tensor
view). Rendezvous goes through the group's own process group (gloo): the group's rank 0 draws a nonce, every rank
learns the segment names from it (``moonrt-<job>-<nonce>-<n>``, ``<job>`` a digest of the job identity rank 0
published in the job's store, :data:`moonrt.cluster.store.IDENTITY_KEY`), rank 0 creates each segment exclusively
(``O_EXCL``, mode 0600: the job's memory is its user's alone), the others open it, and once every rank has mapped it
every rank unlinks it (the first succeeds). From then on the memory lives only in the mappings: a job that exits,
is terminated or is killed leaves nothing in ``/dev/shm``. A rank that fails between creation and mapping unlinks
the name too (every rank knows it), so even a rank 0 killed in that window leaves nothing once the others notice.

Signals (issue 48 item 1) are counters in a control segment: cell ``sig[d, s]`` is written only by rank ``s`` (the
number of signals it sent ``d``) and ``bar[r]`` only by rank ``r`` (its barrier generation), so no atomic read-modify-
write is needed. A signal is ordered after the writes before it by a fence (:func:`_fence`; x86-64 orders stores
anyway, TSO), a wait before the reads after it. The cells are 32-bit counters (compared modulo 2^32) so that a
wait can sleep on them: on Linux a waiter yields a few times and then sleeps in ``futex(FUTEX_WAIT)`` on the cell
(shared, not private: the cell is in a mapping every rank shares), and a signal wakes it (``FUTEX_WAKE``) right after
the store, so with more ranks than cores a waiting rank gives its core to the peer it waits for, and wakes within
the kernel's wake-up latency instead of a polling interval (gloo's blocking receive, without the socket). Elsewhere
waits poll (yielding, then sleeping up to 1 ms). Waits are bounded by the group's collective timeout and look at
the peers' processes every 0.2 s: a peer that died (gone, a zombie, or its pid reused) is named in one line
(:class:`PeerDied`) instead of waiting out the timeout.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moonrt.cluster.store import IDENTITY_KEY, job_identity
from moonrt.comm.transport.base import HeapTensor, PutAllToAll

SHM_DIR = Path("/dev/shm")
ALIGN = 64
_PROBE_S = 0.2
_LOCK = threading.Lock()


class PeerDied(RuntimeError):
    """A rank of the heap's group died while this one waited for it."""


class WaitTimeout(RuntimeError):
    """A wait on the heap outlived the group's collective timeout."""


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The collective timeout of ``group`` (None: the default group), as its CPU backend was built with."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def _job_digest() -> str:
    """12 hex digits naming this job: the identity rank 0 published in the job's store, else the launcher's."""
    identity = None
    try:
        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # init_process_group prefixes the job's store ("default_pg")
            store = store.underlying_store
        if store.check([IDENTITY_KEY]):
            identity = store.get(IDENTITY_KEY).decode(errors="replace")
    except (AttributeError, RuntimeError, ValueError):
        pass
    identity = identity or job_identity() or "no identity"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``; None elsewhere or when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``) still runs: not gone, not a zombie, its pid not reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat.rpartition(")")[2].split()
    return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)


_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared futexes (no FUTEX_PRIVATE_FLAG): the cells are in a shared mapping
_SPINS = 32
"""Yields before a waiter sleeps on its cell's futex."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex() -> Callable[..., int] | None:
    """``syscall(SYS_futex, ...)`` through libc (ctypes releases the GIL for the call), or None off Linux x86-64 /
    aarch64 (waits poll there)."""
    number = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long

    def futex(address: int, op: int, value: int, timeout: _Timespec | None) -> int:
        return fn(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_int(op), ctypes.c_int(value),
                  None if timeout is None else ctypes.byref(timeout), None, ctypes.c_int(0))

    return futex


_FUTEX_CALL = _futex()


def _reached(value: int, want: int) -> bool:
    """Whether 32-bit counter ``value`` has reached ``want`` (both modulo 2^32; counters move forward by less than
    2^31 between two looks)."""
    return (int(value) - want) & 0xFFFFFFFF < 0x80000000


def _fence() -> None:
    """A full memory fence for the Python thread: a lock's release followed by an acquire (RCsc on aarch64; on
    x86-64 the store order needs none)."""
    _LOCK.acquire()
    _LOCK.release()
    _LOCK.acquire()
    _LOCK.release()


class ShmHeap:
    """:class:`~moonrt.comm.transport.base.SymmetricHeap` over POSIX shared memory for the ranks of ``group`` (None:
    the default group), which must all be on one host (``ValueError`` naming the hosts otherwise; ``host`` overrides
    this rank's host name). Building it is collective over ``group`` (a gloo group); so is :meth:`alloc`.
    ``timeout``: bound of every wait (default: the group's collective timeout)."""

    name = "shm"
    one_sided = True

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None,
                 host: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("shm heap: expected torch.distributed initialized (the group's ranks rendezvous there)")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.timeout = (timeout or group_timeout(group)).total_seconds()
        me = (host or socket.gethostname(), os.getpid(), _start_time(os.getpid()))
        peers: list = [None] * self.world_size
        dist.all_gather_object(peers, me, group=group)
        hosts = sorted({p[0] for p in peers})
        if len(hosts) > 1:
            raise ValueError(f"shm heap: the group's {self.world_size} ranks are on {len(hosts)} hosts "
                             f"({', '.join(hosts)}): expected one host (shared memory); the collectives transport "
                             "serves groups spanning hosts")
        self._peers: list[tuple[str, int, str | None]] = peers
        if not SHM_DIR.is_dir():
            raise RuntimeError(f"shm heap: {SHM_DIR} is missing: expected POSIX shared memory (Linux)")
        names = [f"moonrt-{_job_digest()}-{secrets.token_hex(6)}" if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=self._global(0), group=group)
        self._prefix: str = names[0]
        self._seq = 0
        self._keep: list[mmap.mmap] = []
        R = self.world_size
        self._map(4 * (R * R + R))
        # the cells (rank 0's block of the control segment, at offset 0) through a numpy view of the mapping: plain
        # loads and stores, not tensor ops (``int()`` of a tensor is what tests/host_syncs.py counts as a host
        # synchronization); uint32, so a futex can sleep on one
        cells = np.frombuffer(self._keep[-1], dtype=np.uint32, count=R * R + R)
        self._cells = cells  # flat: sig[d, s] at d * R + s (written by s only), bar[r] at R * R + r (by r only)
        self._sig_np, self._bar_np = cells[: R * R].reshape(R, R), cells[R * R:]
        self._cells_at: int = cells.ctypes.data
        self._sent, self._seen, self._gen = [0] * R, [0] * R, 0
        self._puts = PutAllToAll(self)

    # ---- allocation -------------------------------------------------------------------------------
    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _map(self, per_rank: int) -> list[torch.Tensor]:
        """Map one new segment of ``world_size`` aligned blocks of ``per_rank`` bytes; the blocks as uint8 tensors."""
        stride = -(-max(per_rank, 1) // ALIGN) * ALIGN
        size = stride * self.world_size
        path = SHM_DIR / f"{self._prefix}-{self._seq}"
        self._seq += 1
        try:
            if self.rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC here, not a SIGBUS on first touch
                except OSError as exc:
                    os.close(fd)
                    raise RuntimeError(f"shm heap: {SHM_DIR} has no room for {size:,} bytes ({exc.strerror}): "
                                       f"expected a larger /dev/shm (docker: --shm-size)") from None
                os.close(fd)
            dist.barrier(group=self.group)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            dist.barrier(group=self.group)  # every rank has mapped it
        finally:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        self._keep.append(mm)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        return [whole[r * stride: r * stride + per_rank] for r in range(self.world_size)]

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> HeapTensor:
        shape = tuple(int(n) for n in shape)
        numel = 1
        for n in shape:
            numel *= n
        blocks = self._map(numel * dtype.itemsize)
        return HeapTensor([b.view(dtype).view(shape) for b in blocks], self.rank)

    def close(self) -> None:
        """Drop this rank's mappings (they unmap once no view of them is left; the segments were unlinked at
        allocation, so the memory is gone when every rank has closed or exited)."""
        self._puts.staging.clear()
        self._keep.clear()

    # ---- signals ----------------------------------------------------------------------------------
    def _sleep(self, cell: int, seen: int, until: float) -> None:
        """Sleep on control cell ``cell`` (its index) while it still holds ``seen``, until woken or ``until``
        (monotonic seconds) at the latest; without futexes, a short poll interval."""
        if _FUTEX_CALL is None:
            time.sleep(1e-4)
            return
        left = max(until - time.monotonic(), 1e-4)
        _FUTEX_CALL(self._cells_at + 4 * cell, _FUTEX_WAIT, ctypes.c_int32(seen).value,
                    _Timespec(int(left), int((left % 1) * 1e9)))

    def _wake(self, cell: int) -> None:
        if _FUTEX_CALL is not None:
            _FUTEX_CALL(self._cells_at + 4 * cell, _FUTEX_WAKE, 0x7FFFFFFF, None)

    def _spin(self, cells: Sequence[int], want: int, peers: Sequence[int], what: str) -> None:
        """Wait until every control cell of ``cells`` (flat indices) has reached ``want`` (modulo 2^32)."""
        flat = self._cells
        pending = [c for c in cells if not _reached(flat[c], want)]
        if not pending:
            return
        start = time.monotonic()
        probe, k = start + _PROBE_S, 0
        while pending:
            k += 1
            if k <= _SPINS:
                os.sched_yield()
            else:
                seen = int(flat[pending[0]])
                if not _reached(seen, want):
                    self._sleep(pending[0], seen, probe)
            pending = [c for c in pending if not _reached(flat[c], want)]
            now = time.monotonic()
            if pending and now >= probe:
                probe = now + _PROBE_S
                for p in peers:
                    host, pid, begun = self._peers[p]
                    if not _alive(pid, begun):
                        pending = [c for c in pending if not _reached(flat[c], want)]
                        if pending:
                            raise PeerDied(f"shm heap: rank {self._global(p)} (pid {pid} on {host}) died while rank "
                                           f"{self._global(self.rank)} waited for its {what}")
                if now - start > self.timeout:
                    raise WaitTimeout(f"shm heap: rank {self._global(self.rank)} waited {self.timeout:g} s (the "
                                      f"collective timeout) for {what} of rank(s) "
                                      + ", ".join(str(self._global(p)) for p in peers))

    def signal(self, peer: int) -> None:
        _fence()
        self._sent[peer] += 1
        self._sig_np[peer, self.rank] = self._sent[peer] & 0xFFFFFFFF
        self._wake(peer * self.world_size + self.rank)

    def wait(self, peer: int) -> None:
        self._seen[peer] += 1
        self._spin([self.rank * self.world_size + peer], self._seen[peer] & 0xFFFFFFFF, [peer], "signal")
        _fence()

    def barrier(self) -> None:
        self._gen += 1
        gen = self._gen & 0xFFFFFFFF
        R = self.world_size
        _fence()
        self._bar_np[self.rank] = gen
        self._wake(R * R + self.rank)
        others = [r for r in range(R) if r != self.rank]
        self._spin([R * R + r for r in others], gen, others, "barrier")
        _fence()

    # ---- all-to-all -------------------------------------------------------------------------------
    def all_to_all_v(self, x: torch.Tensor, counts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._puts.all_to_all_v(x, counts)
