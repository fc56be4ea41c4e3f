"""The all-gather of KCP's fixed-size per-rank summaries, behind a small seam (K3_SYSTEMS §7; issue 48 item 3).

KCP moves one summary per rank and pass: ``[S_ext | M]`` in the forward, ``[a | M]`` in the backward
(both ``[B, H, K, V + K]`` fp32; :mod:`moonrt.comm.cp.kcp`). Every rank needs every rank's summary
(the prefix and suffix merges), and every rank's has the same shape, so the move is an all-gather of static shapes.
Two implementations of :class:`SummaryGather` (STYLE habit 3):

- :class:`CollectiveGather`: ``dist.all_gather`` over the CP group (gloo or NCCL; any group, the reference);
- :class:`HeapGather`: over a :class:`~moonrt.comm.transport.base.SymmetricHeap` (``shm``: CPU ranks of one host).
  Each rank writes its summary into slot ``rank`` of every peer's buffer ``[2, R, *shape]`` (a one-sided copy
  through the peer's view), signals each peer, and waits for every peer's signal; its own buffer then holds all
  ``R`` summaries. The buffer is allocated once per (shape, dtype) on first use (a collective allocation: every rank
  of a CP group makes the same KCP calls in the same order, shapes checked by KCP's metadata exchange first) and
  reused; its two halves alternate by call (the parity of the call on that buffer). A rank one call ahead on a
  buffer has had every peer's signal of the call in between, which each peer sent after reading the other half, so
  no barrier per call. The copy is a plain tensor copy: the result is bitwise the collectives' one.

:func:`build_summary_gather` turns ``parallel.cp_transport`` into one of them (``auto``: the heap when the CP group's
ranks share a host and the tensors are on the CPU, else collectives; ``cuda`` is refused: KCP over torch symmetric
memory is not wired).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moonrt.comm.transport.base import HeapTensor, SymmetricHeap
from moonrt.comm.transport.select import group_hosts, resolve_backend
from moonrt.config.runtime import CP_TRANSPORTS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

FIELD = "parallel.cp_transport"


@runtime_checkable
class SummaryGather(Protocol):
    """All-gather of one same-shaped tensor per rank of a CP group (``world_size`` ranks, this one ``rank``);
    ``name``: the backend's config spelling (``collectives`` or ``shm``)."""

    name: str
    rank: int
    world_size: int

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x [*shape]`` (the same shape and dtype on every rank) -> ``world_size`` tensors ``[*shape]``, rank
        ``r``'s at index ``r`` (this rank's equal to ``x``). New tensors, owned by the caller. Collective."""
        ...

    def close(self) -> None: ...


class CollectiveGather:
    """:class:`SummaryGather` by ``dist.all_gather`` over ``group`` (None: the default group)."""

    name = "collectives"

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        bufs = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(bufs, x.contiguous(), group=self.group)
        return bufs

    def close(self) -> None:
        pass


class HeapGather:
    """:class:`SummaryGather` by one-sided writes into every peer's slot of ``heap`` (module docstring). Owns the
    heap (:meth:`close` closes it) and its buffers: ``buffers[(shape, dtype)]`` is ``[2, R, *shape]`` on every rank."""

    def __init__(self, heap: SymmetricHeap) -> None:
        self.heap = heap
        self.name = heap.name
        self.rank, self.world_size = heap.rank, heap.world_size
        self.buffers: dict[tuple[tuple[int, ...], torch.dtype], HeapTensor] = {}
        self.calls: dict[tuple[tuple[int, ...], torch.dtype], int] = {}

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        heap, R, me = self.heap, self.world_size, self.rank
        key = (tuple(x.shape), x.dtype)
        buf = self.buffers.get(key)
        if buf is None:  # first call with this shape: allocated once on every rank, then reused
            buf = self.buffers[key] = heap.alloc((2, R, *key[0]), x.dtype)
            self.calls[key] = 0
        half = self.calls[key] % 2
        self.calls[key] += 1
        for i in range(R):  # my summary into slot `me` of every rank's buffer, mine included, then its signal
            d = (me + i) % R
            buf.peer(d)[half, me].copy_(x)
            if d != me:
                heap.signal(d)
        for i in range(1, R):
            heap.wait((me - i) % R)
        return list(buf.local[half].clone().unbind(0))

    def close(self) -> None:
        self.buffers.clear()
        self.heap.close()


def resolve_cp_transport(kind: str, hosts: list[str], device_type: str, backend: str = "gloo") -> str:
    """The backend ``parallel.cp_transport = kind`` names for a CP group on ``hosts`` (one per rank) with tensors on
    ``device_type``, the job's process groups on ``backend``: ``shm`` or ``collectives`` (pure; ``ValueError`` in one
    line naming the field otherwise). The heap's rendezvous runs on the CP group itself, so it needs gloo: on any
    other backend ``auto`` is ``collectives`` and ``shm`` is refused."""
    if kind == "cuda":
        raise ValueError(f"{FIELD} = 'cuda': KCP's summary gather over torch symmetric memory is not wired (unproven "
                         "without GPUs); expected auto, shm or collectives")
    if kind not in CP_TRANSPORTS:
        raise ValueError(f"{FIELD} = {kind!r}: expected one of " + ", ".join(CP_TRANSPORTS))
    chosen = resolve_backend(kind, hosts, device_type, field=FIELD, cuda_heap=False)
    if chosen == "shm" and backend != "gloo":
        if kind == "auto":
            return "collectives"
        raise ValueError(f"{FIELD} = 'shm': the CP group runs on {backend}; expected CPU ranks on gloo (the heap's "
                         "rendezvous runs there)")
    return chosen


def build_summary_gather(kind: str, group: ProcessGroup | None, device_type: str = "cpu", *,
                         backend: str | None = None, timeout: timedelta | None = None) -> SummaryGather:
    """The :class:`SummaryGather` ``parallel.cp_transport = kind`` resolves to for the CP ``group`` (collective over
    it: the host names and, for the heap, its rendezvous run on ``group``). ``backend``: the job's process-group
    backend (default: ``group``'s); ``timeout``: bound of the heap's waits (default: the group's)."""
    backend = backend or (dist.get_backend(group) if dist.is_initialized() else "gloo")
    if kind in ("auto", "shm") and device_type == "cpu" and backend == "gloo":
        hosts = group_hosts(group)
    else:  # the collectives, or shm refused on this device or backend, whatever the hosts: no need to ask the peers
        hosts = [socket.gethostname()]
    if resolve_cp_transport(kind, hosts, device_type, backend) == "shm":
        from moonrt.comm.transport.shm import ShmHeap

        return HeapGather(ShmHeap(group, timeout=timeout))
    return CollectiveGather(group)
