"""Plain all-to-all expert parallelism: the baseline without balancing (K3_SYSTEMS §6.3, §6.4).

Every token-expert assignment goes to the expert's home rank (rank h homes experts
``[h*E/R, (h+1)*E/R)``); there are no slots and no weight copies. A rank receives as many rows as
its home experts were chosen, so under skewed routing the hottest rank computes far more than
``s * k`` rows and the whole group waits for it. Same verbs and validation as
:class:`moonrt.comm.ep.dispatch.MoonEPDispatcher`: it is that class with the placement of the
no-redundancy policy (:func:`moonrt.scheduler.baselines.no_redundancy`), so benchmarks swap one for
the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moonrt.comm.ep.dispatch import MoonEPDispatcher
from moonrt.comm.ep.slots import SlotPool
from moonrt.scheduler.baselines import no_redundancy
from moonrt.scheduler.placement import Placement


class AllToAllDispatcher(MoonEPDispatcher):
    """Unbalanced EP dispatch / combine: tokens to their experts' home ranks.

    ``dispatch`` returns ``cu_seqlens [E+1]`` and a routing-dependent number of rows;
    ``prefetch_weights`` returns empty ``[0, *shape]`` slot tensors (there are no slots).
    """

    def __init__(self, group: dist.ProcessGroup | None, capacity: int, hidden: int, top_k: int,
                 num_experts: int, num_slots: int | None = None, *, pool: SlotPool | None = None,
                 dedup: bool = True, token_padding: int = 1) -> None:
        super().__init__(group, capacity, hidden, top_k, num_experts, num_slots=0, pool=None, dedup=dedup,
                         token_padding=token_padding)

    def plan_on_device(self, counts: torch.Tensor) -> None:
        """The no-redundancy placement is made on the host (:meth:`place`)."""
        return None

    def place(self, counts: torch.Tensor, total_tokens: int | None) -> tuple[object, Placement]:
        """The no-redundancy policy's placement for ``counts [R, E]`` (every assignment on its
        expert's home rank, no slots; ``capacity[r]`` = load of rank r's home experts)."""
        world, num_experts = counts.shape
        placement = no_redundancy(num_experts, world).placement(counts.sum(0).numpy()).to_torch()
        return placement, placement
