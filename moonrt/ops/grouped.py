"""Routed experts as tensor math (K3_SYSTEMS §5.1-5.2): one GLU expert, the grouped-expert op and the
MoE reference, written once for the model and the expert-parallel runtime.

- :func:`glu_expert`: one expert ``down(act(x W_g^T, x W_u^T))`` on rows ``x [n, H]``.
- :func:`grouped_glu_experts`: rows sorted by expert and bounded by ``cu_seqlens [G + 1]``, segment
  ``i`` through expert ``i`` of stacked ``[G, ...]`` weights (the "grouped GEMM" that follows a
  dispatch). Used by ``RoutedExperts.forward`` (:mod:`moonrt.model.moe`, every dispatcher) and by
  the MoonEP tests and benchmarks on home and slot rows.
- :func:`moe_reference`: ``out[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` with all ``E``
  experts and no dispatcher, the oracle of the local MoE layer and of MoonEP dispatch / combine.

Dtype rule (all three): compute in ``dt = promote(x.dtype, float32)``: inputs and weights are cast
to ``dt``, both matmuls and the GLU run in ``dt`` (bf16 / fp16 experts compute in fp32, fp64 stays
fp64), and expert outputs are returned in ``dt``. :func:`moe_reference` sums the k weighted expert
outputs in ``dt`` with j ascending and casts the sum to ``x.dtype`` once.

Shapes: ``H`` the expert input/output width (the latent width L in LatentMoE), ``F`` the expert
FFN width; weights in ``nn.Linear`` layout: ``w_gate [F, H]``, ``w_up [F, H]``, ``w_down [H, F]``
per expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moonrt.ops.glu import Activation, glu_activation

StackedWeight = torch.Tensor | Sequence[torch.Tensor | None]
"""One expert tensor for every segment: a ``[G, ...]`` stack, or a length-G sequence of per-expert
tensors (views of different stacks, e.g. home experts and prefetched slots; ``None`` for a segment
that has no expert here and must be empty)."""


def glu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               act: Activation = "situ", beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """One GLU expert: ``x [n, H]``, ``w_gate [F, H]``, ``w_up [F, H]``, ``w_down [H, F]`` -> ``[n, H]``.

    Computed in ``promote(x.dtype, float32)`` and returned in it (module docstring); ``act`` is
    ``"situ"`` (SiTU-GLU with caps ``beta``, ``linear_beta``) or ``"silu"`` (SwiGLU).
    """
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt)
    h = glu_activation(x @ w_gate.to(dt).t(), x @ w_up.to(dt).t(), act, beta, linear_beta)
    return h.to(dt) @ w_down.to(dt).t()


def _per_segment(w: StackedWeight, groups: int, name: str) -> Sequence[torch.Tensor | None]:
    if isinstance(w, torch.Tensor):
        if w.dim() < 1 or w.shape[0] != groups:
            raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [G = {groups}, ...] (one expert per segment)")
        return w.unbind(0)  # one gradient node for the stack, not one full-size gradient per segment
    if len(w) != groups:
        raise ValueError(f"{name}: {len(w)} per-segment tensors, expected G = {groups} (one per segment)")
    return w


def grouped_glu_experts(x: torch.Tensor, cu_seqlens: torch.Tensor, w_gate: StackedWeight, w_up: StackedWeight,
                        w_down: StackedWeight, act: Activation = "situ", beta: float = 4.0,
                        linear_beta: float = 25.0) -> torch.Tensor:
    """Grouped expert compute: rows ``x [rows, H]`` grouped by ``cu_seqlens [G + 1]`` (int64,
    non-decreasing, within ``[0, rows]``); rows ``cu[i]:cu[i + 1]`` run through expert ``i``:
    ``glu_expert(rows, w_gate[i], w_up[i], w_down[i])``.

    Weights: ``[G, F, H]``, ``[G, F, H]``, ``[G, H, F]`` stacks or per-segment sequences
    (:data:`StackedWeight`). Returns ``[rows, H]`` in ``promote(x.dtype, float32)``; rows outside
    every segment (padding) are 0. Empty segments are skipped: a loop over the non-empty segments
    (the readable grouped GEMM; a fused kernel would replace this function). Differentiable in
    ``x`` and every weight used.
    """
    bounds = cu_seqlens.tolist()
    rows = x.shape[0]
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [rows, H]")
    if not bounds or bounds[0] < 0 or bounds[-1] > rows or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: {bounds[:8]}..., expected non-decreasing bounds within [0, {rows}]")
    groups = len(bounds) - 1
    ws = [_per_segment(w, groups, name) for w, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down"))]
    dt = torch.promote_types(x.dtype, torch.float32)
    width = x.shape[1]
    pieces, pos = [], 0
    for i in range(groups):
        a, b = bounds[i], bounds[i + 1]
        if b == a:
            continue
        g, u, d = (w[i] for w in ws)
        if g is None or u is None or d is None:
            raise ValueError(f"segment {i} has {b - a} rows but no expert weights were given for it")
        if a > pos:
            pieces.append(x.new_zeros(a - pos, width, dtype=dt))
        pieces.append(glu_expert(x[a:b], g, u, d, act, beta, linear_beta))
        pos = b
    if pos < rows:
        pieces.append(x.new_zeros(rows - pos, width, dtype=dt))
    return torch.cat(pieces) if pieces else x.new_zeros(0, width, dtype=dt)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, act: Activation = "situ", beta: float = 4.0,
                  linear_beta: float = 25.0) -> torch.Tensor:
    """Reference routed-expert mixture: ``out[t] = sum_j topk_weights[t, j] * Expert_{topk_ids[t, j]}(x[t])``.

    Args:
        x: ``[s, H]`` float tokens.
        topk_ids: ``[s, k]`` int64 expert ids in ``[0, E)``.
        topk_weights: ``[s, k]`` float gate values.
        w_gate, w_up, w_down: all ``E`` experts, ``[E, F, H]``, ``[E, F, H]``, ``[E, H, F]``.

    Returns ``[s, H]`` in ``x.dtype``: each expert on its tokens with :func:`glu_expert`, the k
    weighted outputs summed in ``promote(x.dtype, float32)`` (j ascending), one cast at the end.
    Plain indexing and a loop over the experts used, sharing no code with any dispatcher; differentiable
    in every input (the oracle for gradients too).
    """
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe_reference: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}; expected [s, H], [s, k], [s, k]")
    dt = torch.promote_types(x.dtype, torch.float32)
    s, k = topk_ids.shape
    y = x.new_zeros(s, k, x.shape[1], dtype=dt)
    for e in torch.unique(topk_ids).tolist():
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        y = y.index_put((t, j), glu_expert(x[t], w_gate[e], w_up[e], w_down[e], act, beta, linear_beta))
    w = topk_weights.to(dt)
    out = y[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j:j + 1]
    return out.to(x.dtype)
