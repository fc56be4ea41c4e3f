"""The ``cuda`` symmetric heap: torch symmetric memory (``torch.distributed._symmetric_memory``, its CUDA or
NVSHMEM backend) for the GPUs of one NVLink domain.

Written to the same protocol as :mod:`moonrt.comm.transport.shm` and NOT PROVEN: this project has tested it on no
GPU. What only GPUs can prove: that ``rendezvous`` maps the peers' buffers (P2P / NVLink), that ``put_signal`` /
``wait_signal`` order the device copies before them on the current stream as the protocol says, and the bandwidth.
torch symmetric memory is imported when the heap is built (a missing or CPU-only build: one line).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moonrt.comm.transport.base import HeapTensor, PutAllToAll

if TYPE_CHECKING:  # the handle type of torch symmetric memory (CUDA builds; imported when the heap is built)
    from torch._C._distributed_c10d import _SymmetricMemory


class CudaHeap:
    """:class:`~moonrt.comm.transport.base.SymmetricHeap` over torch symmetric memory for the ranks of ``group``
    (None: the default group), on this rank's current CUDA device. Collective to build and to :meth:`alloc`.
    Signals are the symmetric memory's signal pads (channel 0 of a small control allocation); waits are bounded by
    ``timeout`` (default: the default process-group timeout)."""

    name = "cuda"
    one_sided = True

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: timedelta | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("cuda heap: no CUDA device: expected GPUs (parallel.ep_transport = shm serves CPU "
                               "ranks of one host)")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as exc:
            raise RuntimeError(f"cuda heap: torch symmetric memory is missing ({exc}): expected a CUDA build of "
                               "torch >= 2.5") from None
        self._symm = symm_mem
        pg = group if group is not None else dist.group.WORLD
        self.group, self.group_name = group, pg.group_name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._timeout_ms = int((timeout or dist.default_pg_timeout).total_seconds() * 1000)
        self._handles: list = []
        self._ctrl = self._rendezvous((1,), torch.int32)[1]
        self._puts = PutAllToAll(self)

    def _rendezvous(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[HeapTensor, _SymmetricMemory]:
        local = self._symm.empty(*shape, dtype=dtype, device=self.device)
        local.zero_()
        handle = self._symm.rendezvous(local, self.group_name)
        self._handles.append((local, handle))
        views = [local if r == self.rank else handle.get_buffer(r, tuple(shape), dtype)
                 for r in range(self.world_size)]
        handle.barrier(channel=0, timeout_ms=self._timeout_ms)  # every rank zeroed before any peer writes
        return HeapTensor(views, self.rank), handle

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> HeapTensor:
        return self._rendezvous(tuple(int(n) for n in shape), dtype)[0]

    def signal(self, peer: int) -> None:
        self._ctrl.put_signal(peer, channel=0, timeout_ms=self._timeout_ms)

    def wait(self, peer: int) -> None:
        self._ctrl.wait_signal(peer, channel=0, timeout_ms=self._timeout_ms)

    def barrier(self) -> None:
        self._ctrl.barrier(channel=0, timeout_ms=self._timeout_ms)

    def all_to_all_v(self, x: torch.Tensor, counts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self._puts.all_to_all_v(x, counts)

    def close(self) -> None:
        self._puts.staging.clear()
        self._handles.clear()
