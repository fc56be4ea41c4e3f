"""The MoE dispatcher seam (K3_SYSTEMS §6.3), owned by the runtime: the protocol a MoE layer calls to move
token-expert assignments to where they are computed and back, and its single-device implementation.

The model (:class:`moonrt.models.k3.model.moe.LatentMoE`) calls a :class:`Dispatcher`; the runtime implements it
with collectives (:class:`moonrt.comm.ep.dispatch.EPDispatcher`: MoonEP's placement or the all-to-all baseline's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One expert's ``(w_gate [F, L], w_up [F, L], w_down [L, F])`` (``nn.Linear`` layout ``[out, in]``)."""


class Experts(Protocol):
    """What a dispatcher reads of a layer's routed experts: this rank holds global experts
    ``first_expert .. first_expert + num_local - 1``."""

    first_expert: int

    @property
    def num_local(self) -> int: ...

    def expert(self, global_id: int) -> ExpertWeights: ...

    def weights(self) -> ExpertWeights: ...


class ShardableExperts(Experts, Protocol):
    """What expert parallelism (:class:`moonrt.comm.ep.parallel.ExpertParallel`) does with a layer's routed experts:
    keeps an EP rank's home slice (:meth:`shard`), sizes its dispatcher by the ``latent`` row width and maps its
    parameters to their single-process rows."""

    latent: int

    def shard(self, first_expert: int, num_local: int) -> None:
        """Keep only experts ``[first_expert, first_expert + num_local)`` (replaces the parameters)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class Dispatcher(Protocol):
    """Moves token-expert assignments to where they are computed and back (K3_SYSTEMS §6.3).

    Shapes: ``s`` tokens of width ``H`` (the latent width L in LatentMoE), top-``k``, ``rows``
    expert rows this rank computes, ``G`` segments (``G = E`` for :class:`LocalDispatcher`;
    ``G = E + B`` for MoonEP: segment ``i < E`` is expert ``i`` (only home experts non-empty),
    segment ``E + j`` is prefetch slot ``j``). Rows outside every segment (padding) must be
    ignored by :meth:`combine`; so must the zero rows a dispatcher may append to a segment to align
    it for grouped GEMMs (MoonEP's ``token_padding``: the expert computes them, combine drops them).

    LatentMoE calls, per forward: ``dispatch`` on the latent ``z``, ``segment_weights``, the grouped
    expert compute (``RoutedExperts.forward`` of :mod:`moonrt.models.k3.model.moe`), multiplies rows by
    ``recv_weights``, then
    ``combine(y, handle, weighted=False)``. An EP dispatcher with a DeepEP-style
    ``prefetch_weights(handle, expert_weights) -> slot tensors [B, ...]`` implements
    ``segment_weights`` in a few lines (experts sharded with ``experts.shard(rank * E // R, E // R)``)::

        def segment_weights(self, handle, experts):
            home = [(experts.first_expert + i, experts.expert(experts.first_expert + i))
                    for i in range(experts.num_local)]
            slots = self.prefetch_weights(handle, experts.weights())
            copies = handle.plan.copies[self.rank].tolist()
            return home + [(self.num_experts + j, tuple(w[j] for w in slots))
                           for j, e in enumerate(copies) if e >= 0]
    """

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``x [s, H]``, ``topk_ids [s, k]`` int64, ``topk_weights [s, k]`` fp32 ->
        ``(recv_x [rows, H], recv_weights [rows] (differentiable in topk_weights),
        cu_seqlens [G + 1] int64 (segment i = rows cu[i]:cu[i+1]), handle)``. Differentiable in x."""
        ...

    def combine(self, y: torch.Tensor, handle: Any, weighted: bool = True) -> torch.Tensor:
        """``y [rows, H]`` -> ``[s, H]``: ``out[t] = sum_j c_tj * y[row(t, j)]`` in token order, with
        ``c = topk_weights`` if ``weighted`` else 1 (LatentMoE weights rows itself, ``weighted=False``)."""
        ...

    def segment_weights(self, handle: Any, experts: Experts) -> list[tuple[int, ExpertWeights]]:
        """``(segment index, weights of the expert computing it)`` for every segment this rank may
        fill. Home experts come from ``experts`` (global id ``experts.first_expert + i`` is local
        ``i``); an EP runtime adds its slot segments with prefetched copies whose gradients it
        returns to the home rank."""
        ...


@dataclasses.dataclass(slots=True)
class LocalHandle:
    """What :meth:`LocalDispatcher.combine` needs: ``token_index [rows]`` int64 (token of each row),
    ``topk_weights [s, k]``, ``order [rows]`` int64 (flat ``t * k + j`` of each row)."""

    token_index: torch.Tensor
    order: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


class LocalDispatcher:
    """Single-device :class:`Dispatcher`: rows sorted by expert (stable, so token order inside a
    segment), ``G = E`` segments, one per expert. Differentiable through plain indexing."""

    def __init__(self, num_experts: int) -> None:
        if not (isinstance(num_experts, int) and num_experts >= 1):
            raise ValueError(f"num_experts = {num_experts!r}: expected an integer >= 1")
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LocalHandle]:
        E = self.num_experts
        if x.dim() != 2:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [s, H]")
        s = x.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != s or topk_ids.dtype != torch.int64:
            raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} {topk_ids.dtype}, expected [s = {s}, k] int64")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights: shape {tuple(topk_weights.shape)}, expected {tuple(topk_ids.shape)}")
        if topk_ids.numel():
            lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()  # one host sync
            if lo < 0 or hi >= E:
                raise ValueError(f"topk_ids: values in [{lo}, {hi}], expected expert ids in [0, {E})")
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_index = order // k
        recv_x = x.index_select(0, token_index)
        recv_w = topk_weights.reshape(-1).index_select(0, order)
        counts = torch.bincount(flat, minlength=E)
        cu = torch.zeros(E + 1, dtype=torch.int64, device=flat.device)
        cu[1:] = torch.cumsum(counts, 0)
        return recv_x, recv_w, cu, LocalHandle(token_index, order, topk_weights, s)

    def combine(self, y: torch.Tensor, handle: LocalHandle, weighted: bool = True) -> torch.Tensor:
        rows = handle.token_index.shape[0]
        if y.dim() != 2 or y.shape[0] != rows:
            raise ValueError(f"y: shape {tuple(y.shape)}, expected [rows = {rows}, H]")
        dt = torch.promote_types(y.dtype, torch.float32)
        rows_y = y.to(dt)
        if weighted:
            w = handle.topk_weights.reshape(-1).index_select(0, handle.order)
            rows_y = rows_y * w.to(dt).unsqueeze(1)
        out = y.new_zeros(handle.num_tokens, y.shape[1], dtype=dt)
        return out.index_add(0, handle.token_index, rows_y).to(y.dtype)

    def segment_weights(self, handle: LocalHandle, experts: Experts) -> list[tuple[int, ExpertWeights]]:
        if experts.num_local != self.num_experts or experts.first_expert != 0:
            raise ValueError(f"LocalDispatcher needs all {self.num_experts} experts, got experts "
                             f"[{experts.first_expert}, {experts.first_expert + experts.num_local})")
        return [(e, experts.expert(e)) for e in range(self.num_experts)]
