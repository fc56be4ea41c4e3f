"""Pure-PyTorch single-process reference of the expert-parallel row layout (K3_SYSTEMS §6.3).

The oracle the EP tests check the dispatcher's rows against (DeepEP's ``utils/refs.py`` habit,
STYLE habit 3), written from the definition with plain loops and sharing no code with the layout
math of :mod:`moonrt.comm.ep.layout`:

- :func:`rows_reference`: which (source rank, token, j) each destination rank's expert rows hold,
  in order, under a placement (per expert: (source rank, position) order cut over destination ranks
  ``0..R-1`` by ``alloc``; on a destination, segments home experts then slots).

The numeric references live in the ops layer, shared with the model: the MoE output oracle is
:func:`moonrt.ops.grouped.moe_reference` (``out[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` with
the full ``[E, ...]`` expert weights), and the expert compute on dispatched rows is
:func:`moonrt.ops.grouped.grouped_glu_experts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rows_reference(topk_ids: Sequence[torch.Tensor], alloc: torch.Tensor, copies: torch.Tensor,
                   rank: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The expert rows of destination ``rank``: ``(rows, cu_seqlens)``.

    ``rows``: list of ``(source rank, token, j)`` in row order; ``cu_seqlens``: ``E + B + 1`` segment
    bounds. ``topk_ids[r] [s_r, k]`` int64, ``alloc [E, R]``, ``copies [R, B]`` (-1 = empty slot).
    """
    E, R = alloc.shape
    B = copies.shape[1]
    per_rank = E // R
    segments: list[list[tuple[int, int, int]]] = [[] for _ in range(E + B)]
    for e in range(E):
        order = []
        for src, ids in enumerate(topk_ids):
            for t, j in ((ids == e).nonzero().tolist()):
                order.append((src, t, j))  # position order = token order, then j
        lo = sum(int(alloc[e, d]) for d in range(rank))
        mine = order[lo:lo + int(alloc[e, rank])]
        if not mine:
            continue
        if e // per_rank == rank:
            segments[e].extend(mine)
        else:
            slot = copies[rank].tolist().index(e)  # raises if the placement is inconsistent
            segments[E + slot].extend(mine)
    rows = [r for seg in segments for r in seg]
    cu = [0]
    for seg in segments:
        cu.append(cu[-1] + len(seg))
    return rows, cu
