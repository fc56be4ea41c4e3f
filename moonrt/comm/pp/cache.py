"""Block AttnRes state of a pipeline rank: which blocks cross each hop, and the per-micro-batch block cache
(K3_SYSTEMS §4, §9).

Block ids and the blocks each hop carries are :func:`moonrt.scheduler.attnres_comm.hop_plan`'s: block 0
is the token embedding (produced by stage 0); block ``n >= 1`` is completed at the end of decoder layer
``n * block_size - 1`` (or at the last layer, for a partial last block) by the stage that runs it. A
stage ``s`` running ``layers[s]`` starts with :func:`blocks_before` completed blocks and, when its first
layer is not a block start, the open partial block (the only tensor a hop carries that is not a block).

:class:`BlockCache` is one scope of block representations and their gradient buffers: in ``cached`` mode
one per (rank, micro-batch), shared by the rank's virtual stages; in ``naive`` mode one per (stage,
micro-batch) (every hop then carries every completed block, the baseline). A block is stored once per
scope (the stages' autograd inputs are aliasing views of it, :meth:`BlockCache.leaf`); the gradients of
all its local uses and of its downstream hops accumulate in one buffer, which goes upstream once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from moonrt.scheduler.attnres_comm import hop_plan


def blocks_before(start_layer: int, block_size: int) -> int:
    """Completed blocks (the embedding included) before decoder layer ``start_layer``."""
    return 1 + start_layer // block_size


@dataclasses.dataclass(frozen=True, slots=True)
class BlockPlan:
    """Per stage: ``layers``, ``n_in`` (completed blocks at its start), ``produced`` ids, ``partial_in`` (a
    block is open at its first layer); per forward hop ``s -> s+1``: ``sends[s]``, the block ids it carries
    (the hop plan's; empty for a same-rank hop and for the last stage)."""

    layers: tuple[range, ...]
    n_in: tuple[int, ...]
    produced: tuple[tuple[int, ...], ...]
    partial_in: tuple[bool, ...]
    sends: tuple[tuple[int, ...], ...]
    mode: str

    @property
    def num_stages(self) -> int:
        return len(self.layers)


def block_plan(layers: Sequence[range], block_size: int, rank_of: Callable[[int], int], mode: str) -> BlockPlan:
    """The :class:`BlockPlan` of ``layers`` (contiguous ranges covering every layer) placed by ``rank_of``,
    from :func:`moonrt.scheduler.attnres_comm.hop_plan` (``mode``: cached or naive)."""
    if mode not in ("cached", "naive"):
        raise ValueError(f"attn_res_comm = {mode!r}: expected cached or naive")
    hops = hop_plan(layers, block_size, rank_of, mode)
    ranges = tuple(layers)
    n_in = tuple(blocks_before(r.start, block_size) if s else 0 for s, r in enumerate(ranges))
    partial_in = tuple(s > 0 and r.start % block_size != 0 for s, r in enumerate(ranges))
    sends = tuple(tuple(x) for x in hops.sends) + ((),)
    return BlockPlan(ranges, n_in, tuple(hops.produced), partial_in, sends, mode)


class BlockCache:
    """Block representations of one scope (a rank's micro-batch, or one stage's in naive mode).

    ``data[b]`` ``[B, T, D]``: the block as produced (a graph tensor) or received (a plain tensor);
    ``grad[b]``: its accumulated gradient (one buffer per block). :meth:`leaf` hands a stage an
    aliasing, grad-requiring view, so the storage is held once whatever the number of local uses.
    """

    def __init__(self) -> None:
        self.data: dict[int, torch.Tensor] = {}
        self.grad: dict[int, torch.Tensor] = {}
        self.peak = 0

    def put(self, block: int, t: torch.Tensor) -> None:
        if block in self.data:
            raise RuntimeError(f"block {block}: already held in this cache (each block is stored once per rank)")
        self.data[block] = t
        self.peak = max(self.peak, len(self.data))

    def leaf(self, block: int) -> torch.Tensor:
        """An autograd input for one local use of ``block`` (shares the cached storage)."""
        if block not in self.data:
            raise RuntimeError(f"block {block}: not in the cache (never received or produced on this rank)")
        return self.data[block].detach().requires_grad_(True)

    def add_grad(self, block: int, g: torch.Tensor) -> None:
        """Accumulate one use's gradient ``[B, T, D]`` into the block's buffer."""
        if block in self.grad:
            self.grad[block].add_(g)
        else:
            self.grad[block] = g.clone()

    def grad_or_zeros(self, block: int) -> torch.Tensor:
        g = self.grad.get(block)
        return g if g is not None else torch.zeros_like(self.data[block])

    def drop(self, block: int) -> None:
        """Free the block and its gradient buffer (after the backward of its last local use)."""
        self.data.pop(block, None)
        self.grad.pop(block, None)

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.data.values()}


__all__ = ["BlockCache", "BlockPlan", "block_plan", "blocks_before"]
