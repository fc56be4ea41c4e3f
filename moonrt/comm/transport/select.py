"""``parallel.ep_transport`` -> a transport backend for one group (issue 48 item 1).

:func:`resolve_backend` is the pure choice (STYLE habit 2): ``auto`` is the heap when the group is on one host
(``shm`` for CPU ranks, ``cuda`` for GPUs with torch symmetric memory), else ``collectives``; an explicit ``shm``
for a group spanning hosts, or for GPU tensors, and ``cuda`` without GPUs, are one-line ``ValueError``s.
:func:`build_transport` makes it (collective over the group).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from moonrt.comm.transport.base import BACKENDS, Transport
from moonrt.comm.transport.collectives import CollectivesTransport


def resolve_backend(kind: str, hosts: Sequence[str], device_type: str, *, field: str = "parallel.ep_transport",
                    cuda_heap: bool = True) -> str:
    """The backend ``kind`` names for a group whose ranks run on ``hosts`` (one entry per rank) with tensors on
    ``device_type`` (``cpu`` or ``cuda``); ``cuda_heap``: whether torch symmetric memory is usable here."""
    if kind not in BACKENDS:
        raise ValueError(f"{field} = {kind!r}: expected one of " + ", ".join(BACKENDS))
    spread = sorted(set(hosts))
    if kind == "auto":
        if len(spread) > 1:
            return "collectives"
        if device_type == "cpu":
            return "shm"
        return "cuda" if device_type == "cuda" and cuda_heap else "collectives"
    if kind in ("shm", "cuda") and len(spread) > 1:
        raise ValueError(f"{field} = {kind!r}: the group's ranks are on {len(spread)} hosts ({', '.join(spread)}); "
                         "expected auto or collectives for a group spanning hosts (the heap is one host's memory)")
    if kind == "shm" and device_type != "cpu":
        raise ValueError(f"{field} = 'shm': the tensors are on {device_type}; expected CPU ranks (cuda serves GPUs)")
    if kind == "cuda" and device_type != "cuda":
        raise ValueError(f"{field} = 'cuda': the tensors are on {device_type}; expected GPUs (shm serves CPU ranks)")
    return kind


def group_hosts(group: dist.ProcessGroup | None) -> list[str]:
    """The host name of every rank of ``group``, in group-rank order (collective over ``group``)."""
    import socket

    if not dist.is_initialized():
        return [socket.gethostname()]
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


def build_transport(kind: str, group: dist.ProcessGroup | None, device_type: str = "cpu", *,
                    timeout: timedelta | None = None) -> Transport:
    """The transport ``kind`` resolves to for ``group`` (collective over it); one rank: the collectives' local
    copies."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        resolve_backend(kind, ["localhost"], device_type)
        return CollectivesTransport(group)
    cuda_heap = device_type == "cuda" and torch.cuda.is_available()
    backend = resolve_backend(kind, group_hosts(group), device_type, cuda_heap=cuda_heap)
    if backend == "shm":
        from moonrt.comm.transport.shm import ShmHeap

        return ShmHeap(group, timeout=timeout)
    if backend == "cuda":
        from moonrt.comm.transport.cuda import CudaHeap

        return CudaHeap(group, timeout=timeout)
    return CollectivesTransport(group)
