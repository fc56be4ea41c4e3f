"""The transport seam: what moves tensors between the ranks of one group, and the symmetric heap (issue 48).

Two protocols. :class:`Transport` is what every backend implements (the collectives of today as well): an
all-to-all of variable row counts and a barrier. :class:`SymmetricHeap` adds the one-sided verbs a heap backend
has: :meth:`~SymmetricHeap.alloc` the same-shaped buffer on every rank of the group (a collective call),
:meth:`HeapTensor.peer` a tensor view of any rank's buffer (plain torch ops read and write it), and
:meth:`~SymmetricHeap.signal` / :meth:`~SymmetricHeap.wait` per peer (monotone counters: ``wait(src)`` returns once
``src`` has signalled this rank one more time than the waits before it consumed).

Backends: :mod:`moonrt.comm.transport.shm` (CPU ranks of one host, POSIX shared memory),
:mod:`moonrt.comm.transport.cuda` (torch symmetric memory, GPUs of one NVLink domain; not proven without GPUs),
:mod:`moonrt.comm.transport.collectives` (gloo/NCCL, the reference every other backend is tested against).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from moonrt.config.runtime import EP_TRANSPORTS

BACKENDS = EP_TRANSPORTS
"""The spellings of ``parallel.ep_transport`` (``auto``: the heap when the group is on one host)."""


def check_counts(counts: Sequence[Sequence[int]], world_size: int, rank: int, rows: int) -> tuple[list[int],
                                                                                                   list[int]]:
    """``counts[s][d]``: the rows rank ``s`` sends rank ``d`` (every rank passes the same ``[R][R]`` matrix).
    Returns this rank's ``(send, recv)`` row counts; ``ValueError`` (one line) when the matrix is not ``R x R`` of
    integers >= 0 or this rank's send row does not add up to ``rows`` (the rows of its input)."""
    if len(counts) != world_size or any(len(row) != world_size for row in counts):
        raise ValueError(f"counts: expected a {world_size} x {world_size} matrix (rows sent by rank s to rank d)")
    if any(not isinstance(c, int) or c < 0 for row in counts for c in row):
        raise ValueError("counts: expected integers >= 0")
    send = list(counts[rank])
    if sum(send) != rows:
        raise ValueError(f"counts[{rank}] sums to {sum(send)}: expected the {rows} rows of this rank's input")
    return send, [counts[s][rank] for s in range(world_size)]


@runtime_checkable
class Transport(Protocol):
    """Moves tensors between the ``world_size`` ranks of one group (this one ``rank``); ``name`` is the backend's
    config spelling, ``one_sided`` whether it is a :class:`SymmetricHeap`."""

    name: str
    rank: int
    world_size: int
    one_sided: bool

    def all_to_all_v(self, x: torch.Tensor, counts: Sequence[Sequence[int]]) -> torch.Tensor:
        """``x [sum(counts[rank]), *row]`` (rows for rank 0 first, then rank 1, ...) -> ``[sum_s counts[s][rank],
        *row]`` (rows from rank 0 first): ``all_to_all_single`` with the split sizes of the ``[R][R]`` matrix
        ``counts`` (the same on every rank). A new tensor, owned by the caller."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class HeapTensor:
    """One symmetric allocation: ``views[r]`` is rank ``r``'s buffer ``[*shape]`` of ``dtype``, mapped into this
    process. :attr:`local` is this rank's; :meth:`peer` any rank's. The heap owns the memory: the views are valid
    until :meth:`SymmetricHeap.close`."""

    def __init__(self, views: list[torch.Tensor], rank: int) -> None:
        self.views, self.rank = views, rank

    @property
    def local(self) -> torch.Tensor:
        return self.views[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        if not 0 <= rank < len(self.views):
            raise ValueError(f"rank = {rank}: expected 0 <= rank < {len(self.views)} (the heap's group)")
        return self.views[rank]


@runtime_checkable
class SymmetricHeap(Transport, Protocol):
    """A :class:`Transport` whose ranks write each other's memory (``one_sided`` True)."""

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> HeapTensor:
        """The same ``[*shape]`` buffer of ``dtype`` on every rank of the group (collective: every rank calls it,
        in the same order, with the same arguments). Zero-filled."""
        ...

    def signal(self, peer: int) -> None:
        """Tell ``peer`` that this rank's writes so far are visible (they are ordered before the signal)."""
        ...

    def wait(self, peer: int) -> None:
        """Return once ``peer`` has signalled this rank once more than the waits before this one consumed; writes
        ``peer`` made before that signal are visible after it. Bounded by the group's collective timeout; a peer
        that died is named."""
        ...


class PutAllToAll:
    """:meth:`Transport.all_to_all_v` on a :class:`SymmetricHeap` by puts: each rank copies its rows for rank ``d``
    straight into ``d``'s staging buffer (after the rows of the ranks before it) and signals ``d``; each rank waits
    for every peer's signal and copies its rows out. The staging buffer ``[2, capacity, *row]`` is double (the
    parity of the call): a rank one call ahead has had every peer's signal of the call before, so every peer has
    finished reading the other half; no barrier per call. It grows (a collective allocation) when a call needs more
    rows; every rank sees the same ``counts``, so they grow together."""

    def __init__(self, heap: SymmetricHeap) -> None:
        self.heap = heap
        self.staging: dict[tuple, HeapTensor] = {}
        self.calls: dict[tuple, int] = {}

    def all_to_all_v(self, x: torch.Tensor, counts: Sequence[Sequence[int]]) -> torch.Tensor:
        heap = self.heap
        R, me = heap.world_size, heap.rank
        send, recv = check_counts(counts, R, me, x.shape[0])
        row = tuple(x.shape[1:])
        need = max(sum(counts[s][d] for s in range(R)) for d in range(R))
        key = (row, x.dtype, x.device)
        buf = self.staging.get(key)
        if buf is None or buf.local.shape[1] < need:
            cap = max(need, 2 * buf.local.shape[1] if buf is not None else 1)
            self.staging.pop(key, None)
            buf = self.staging[key] = heap.alloc((2, cap, *row), x.dtype)
            self.calls[key] = 0
        parity = self.calls[key] % 2
        self.calls[key] += 1
        x = x.contiguous()
        src = [0] * (R + 1)
        for d in range(R):
            src[d + 1] = src[d] + send[d]
        for i in range(R):
            d = (me + i) % R
            at = sum(counts[s][d] for s in range(me))
            if send[d]:
                buf.peer(d)[parity, at: at + send[d]].copy_(x[src[d]: src[d + 1]])
            if d != me:
                heap.signal(d)
        for i in range(1, R):
            heap.wait((me - i) % R)
        return buf.local[parity, : sum(recv)].clone()
