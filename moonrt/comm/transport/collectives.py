"""The ``collectives`` transport: today's path (gloo on CPU, NCCL on GPUs), for groups that span hosts and as the
reference every heap backend is tested against (STYLE habit 3)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from moonrt.comm.transport.base import check_counts


class CollectivesTransport:
    """:class:`~moonrt.comm.transport.base.Transport` over the torch.distributed collectives of ``group`` (None: the
    default group; without an initialized process group, one rank and local copies). Not one-sided: no heap."""

    name = "collectives"
    one_sided = False

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0

    def all_to_all_v(self, x: torch.Tensor, counts: Sequence[Sequence[int]]) -> torch.Tensor:
        send, recv = check_counts(counts, self.world_size, self.rank, x.shape[0])
        if self.world_size == 1:
            return x.clone()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        pass
