"""Pure-PyTorch single-process reference of expert-parallel dispatch + expert compute + combine.

The oracle every EP test and benchmark checks first (DeepEP's ``utils/refs.py`` habit, STYLE habit 3).
Written from the definitions of K3_SYSTEMS §5.1 and §6.3 with plain loops, sharing no code with
:mod:`moonrt.comm.ep_transport`:

- :func:`moe_reference`: ``out[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` for every rank's
  tokens, with the full ``[E, ...]`` expert weights (summed in fp32, j ascending, like combine).
- :func:`rows_reference`: which (source rank, token, j) each destination rank's expert rows hold,
  in order, under a placement (per expert: (source rank, position) order cut over destination ranks
  ``0..R-1`` by ``alloc``; on a destination, segments home experts then slots).
- :func:`grouped_expert_forward`: run one expert per row segment (the "grouped GEMM" that follows
  a dispatch), and :func:`situ_glu_expert`, the latent SiTU-GLU expert used by tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moonrt.ops.glu import situ_glu

ExpertFn = Callable[..., torch.Tensor]
"""``expert_fn(x [n, H], *weights_of_one_expert) -> [n, H]``."""


def situ_glu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                    beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """One routed expert in the latent space (K3_SYSTEMS §5.2): SiTU-GLU in fp32.

    ``x [n, H]``, ``w_gate [F, H]``, ``w_up [F, H]``, ``w_down [H, F]`` -> ``[n, H]`` in x's dtype.
    """
    h = situ_glu((x @ w_gate.t()).float(), (x @ w_up.t()).float(), beta, linear_beta)
    return h.to(x.dtype) @ w_down.t()


def grouped_expert_forward(x: torch.Tensor, cu_seqlens: torch.Tensor, weights: Sequence[torch.Tensor],
                           expert_fn: ExpertFn = situ_glu_expert) -> torch.Tensor:
    """Rows ``x [n, H]`` grouped by segment (``cu_seqlens [G+1]``) -> ``[n, H]``, segment i through expert i.

    ``weights``: each ``[G, *shape]``; segment i uses ``w[i]`` of every tensor. Empty segments are
    skipped (a loop, not a fused grouped GEMM: this is the readable version).
    """
    outs = []
    cu = cu_seqlens.tolist()
    per_expert = [w.unbind(0) for w in weights]  # one gradient stack per tensor, not one per segment
    for i in range(len(cu) - 1):
        if cu[i + 1] > cu[i]:
            outs.append(expert_fn(x[cu[i]:cu[i + 1]], *(w[i] for w in per_expert)))
    return torch.cat(outs) if outs else x[:0].clone()


def moe_reference(xs: Sequence[torch.Tensor], topk_ids: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor],
                  expert_weights: Sequence[torch.Tensor], expert_fn: ExpertFn = situ_glu_expert) -> list[torch.Tensor]:
    """Reference MoE output of every rank: ``xs[r] [s_r, H]``, ``topk_ids[r] [s_r, k]`` int64,
    ``topk_weights[r] [s_r, k]`` float, ``expert_weights`` each ``[E, *shape]`` -> ``[s_r, H]`` per rank.

    Differentiable in every input (the oracle for gradients, too).
    """
    outs = []
    for x, ids, w in zip(xs, topk_ids, topk_weights):
        s, k = ids.shape
        y = x.new_zeros(s, k, x.shape[1])
        for e in torch.unique(ids).tolist():
            t, j = (ids == e).nonzero(as_tuple=True)
            y = y.index_put((t, j), expert_fn(x[t], *(ew[e] for ew in expert_weights)))
        outs.append(torch.einsum("skh,sk->sh", y.float(), w.float()).to(x.dtype))
    return outs


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
