"""Stable LatentMoE: sigmoid router, latent SiTU-GLU experts, dispatcher seam (K3_SYSTEMS §5, §6.3).

K3 report §2.3, Eq. 11::

    z = W_down x                                           (D -> latent L)
    u = sum over the top-k routed experts i of p_i * Expert_i(z)          (L -> L, SiTU-GLU, fp32)
    y = sum_j Shared_j(x) + W_up RMSNorm(u)                (L -> D; shared experts are full width)

Routing: ``s = sigmoid(x W_r^T)`` in fp32; experts chosen by top-k of ``s + bias`` (``bias`` is a
buffer set by Quantile Balancing, :mod:`moonrt.models.k3.model.balance`; it gets no gradient and never enters
the gate values); gate values ``p = s_sel / sum(s_sel) * routed_scaling_factor``.

Expert parallelism plugs in through the runtime's seam :class:`moonrt.parallel.dispatch.Dispatcher` (DeepEP
style): ``LatentMoE.dispatcher`` defaults to :class:`LocalDispatcher` (one device, all experts) and a runtime
may replace it (the MoonEP dispatcher), after :meth:`RoutedExperts.shard` has cut the experts down to the
rank's home slice. The model itself never touches a process group: cross-rank sums of routing statistics
go through an ``all_reduce`` callable passed to :meth:`LatentMoE.update_bias`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moonrt.models.k3.model.balance import AllReduce, MarginHistogram, maxvio, qb_bias_from_margins, qb_margins
from moonrt.models.k3.model.config import K3Config, MoEConfig
from moonrt.models.k3.model.ffn import shared_expert
from moonrt.models.k3.model.norm import RMSNorm
from moonrt.ops.glu import Activation
from moonrt.ops.grouped import grouped_glu_experts
from moonrt.ops.precision import fp32_island
from moonrt.ops.qat import QATScheme
from moonrt.parallel.blocks import MatrixBlocks
from moonrt.parallel.dispatch import Dispatcher, ExpertWeights, LocalDispatcher


# ---- router and experts ----------------------------------------------------------------------------
class Router(nn.Module):
    """Sigmoid router with a selection-only bias (K3_SYSTEMS §5.3).

    Parameters: ``weight [E, D]``. Buffer: ``bias [E]`` fp32 (Quantile Balancing; no gradient).
    """

    bias: torch.Tensor  # the registered buffer (declared for the type checker: buffers are reached by __getattr__)

    def __init__(self, dim: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k!r}: expected 1 <= top_k <= num_experts ({num_experts})")
        self.num_experts, self.top_k, self.scaling = num_experts, top_k, float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))

    @fp32_island  # router logits, sigmoid and top-k in fp32 under a bf16 autocast region
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, D]`` -> ``(topk_ids [N, k] int64, topk_weights [N, k] fp32, scores [N, E] fp32)``
        (fp64 for fp64 input).

        ``topk_weights`` rows sum to ``routed_scaling_factor``; they are the unbiased scores of the
        experts selected on ``scores + bias``, so the bias changes the choice but not the values.
        """
        dt = torch.promote_types(x.dtype, torch.float32)
        scores = torch.sigmoid(x.to(dt) @ self.weight.to(dt).t())
        ids = torch.topk(scores.detach() + self.bias.to(dt), self.top_k, dim=-1).indices
        sel = scores.gather(1, ids)
        return ids, sel / sel.sum(-1, keepdim=True) * self.scaling, scores


class RoutedExperts(nn.Module):
    """Stacked latent experts (K3_SYSTEMS §5.1-5.2), SiTU-GLU computed in (at least) fp32.

    Parameters: ``w_gate [E_local, F, L]``, ``w_up [E_local, F, L]``, ``w_down [E_local, L, F]``;
    local expert ``i`` is global expert ``first_expert + i``. Holds all ``E`` experts until
    :meth:`shard` keeps only an EP rank's home slice.

    ``qat`` (plain attribute, None until :meth:`moonrt.models.k3.model.model.K3Model.enable_qat`): the grouped
    GEMMs read MXFP4 weights and MXFP8 inputs (:func:`moonrt.ops.grouped.grouped_glu_experts`).
    """

    def __init__(self, num_experts: int, latent: int, hidden: int, act: Activation = "situ", beta: float = 4.0,
                 linear_beta: float = 25.0, init_std: float = 0.02) -> None:
        super().__init__()
        self.num_experts, self.latent, self.hidden = num_experts, latent, hidden
        self.act, self.beta, self.linear_beta = act, float(beta), float(linear_beta)
        self.first_expert = 0
        self.qat: QATScheme | None = None
        self.w_gate = nn.Parameter(torch.randn(num_experts, hidden, latent) * init_std)
        self.w_up = nn.Parameter(torch.randn(num_experts, hidden, latent) * init_std)
        self.w_down = nn.Parameter(torch.randn(num_experts, latent, hidden) * init_std)

    @property
    def num_local(self) -> int:
        return self.w_gate.shape[0]

    def matrix_blocks(self) -> dict[str, MatrixBlocks]:
        """Optimizer blocks: one matrix per expert (Per-Head Muon orthogonalizes experts separately)."""
        return {name: MatrixBlocks(stack_dims=1) for name in ("w_gate", "w_up", "w_down")}

    def weights(self) -> ExpertWeights:
        """The stacked ``(w_gate, w_up, w_down)``, each ``[E_local, ...]`` (what an EP runtime prefetches)."""
        return self.w_gate, self.w_up, self.w_down

    def expert(self, global_id: int) -> ExpertWeights:
        """Weights of home expert ``global_id``; ValueError if this module does not hold it."""
        i = global_id - self.first_expert
        if not 0 <= i < self.num_local:
            raise ValueError(f"expert {global_id}: not held here, expected an id in "
                             f"[{self.first_expert}, {self.first_expert + self.num_local})")
        return self.w_gate[i], self.w_up[i], self.w_down[i]

    def shard(self, first_expert: int, num_local: int) -> None:
        """Keep only experts ``[first_expert, first_expert + num_local)`` (an EP rank's home slice).

        Replaces the parameters by copies of the slice: build the optimizer after sharding."""
        if not (0 <= first_expert and num_local >= 1 and first_expert + num_local <= self.num_local
                and self.first_expert == 0 and self.num_local == self.num_experts):
            raise ValueError(f"shard({first_expert}, {num_local}): expected a slice of the {self.num_experts} "
                             f"experts of an unsharded module (holding [{self.first_expert}, "
                             f"{self.first_expert + self.num_local}))")
        sl = slice(first_expert, first_expert + num_local)
        with torch.no_grad():
            self.w_gate = nn.Parameter(self.w_gate[sl].clone())
            self.w_up = nn.Parameter(self.w_up[sl].clone())
            self.w_down = nn.Parameter(self.w_down[sl].clone())
        self.first_expert = first_expert

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor,
                segments: Sequence[tuple[int, ExpertWeights]]) -> torch.Tensor:
        """Grouped expert compute: rows ``x [rows, L]`` grouped by ``cu_seqlens [G + 1]``; segment ``i``
        runs through the weights ``segments`` gives for ``i``. Returns ``[rows, L]`` in
        ``promote(x.dtype, float32)``; rows outside every segment are 0
        (:func:`moonrt.ops.grouped.grouped_glu_experts`, which states the dtype rule)."""
        groups = cu_seqlens.shape[0] - 1
        per_segment: list[list[torch.Tensor | None]] = [[None] * groups for _ in range(3)]
        for i, weights in segments:
            if 0 <= i < groups:
                for slot, w in zip(per_segment, weights):
                    slot[i] = w
        w_gate, w_up, w_down = per_segment
        return grouped_glu_experts(x, cu_seqlens, w_gate, w_up, w_down, act=self.act, beta=self.beta,
                                   linear_beta=self.linear_beta, qat=self.qat)


# ---- the layer -------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class RoutingStats:
    """What :meth:`LatentMoE.update_bias` saw: ``local_counts [E]`` int64 (this rank, since the last
    update), ``counts [E]`` int64 (summed over ranks), ``maxvio`` of ``counts``, ``bias [E]`` (new)."""

    local_counts: torch.Tensor
    counts: torch.Tensor
    maxvio: float
    bias: torch.Tensor


class LatentMoE(nn.Module):
    """Stable LatentMoE layer (K3_SYSTEMS §5.1, Eq. 11), ``forward(x [B, T, D]) -> [B, T, D]``.

    Submodules: ``router`` (:class:`Router`), ``down_proj`` (D -> L), ``experts``
    (:class:`RoutedExperts`), ``norm`` (RMSNorm(L), if ``latent_moe_use_norm``), ``up_proj`` (L -> D),
    ``shared_experts`` (``num_shared_experts`` x GLUFFN(D, moe_intermediate_size)).
    ``dispatcher`` (a plain attribute, not a submodule) is :class:`LocalDispatcher` until a runtime
    replaces it. Routing statistics: ``last_counts [E]`` int64 (the last forward), ``step_counts [E]``
    (since the last :meth:`update_bias`), QB margins (training forwards only, when ``qb_enabled``).
    A forward re-run for activation recomputation records twice: set ``record_routing = False`` for it.
    """

    last_counts: torch.Tensor  # registered buffers, declared for the type checker (reached by __getattr__)
    step_counts: torch.Tensor

    def __init__(self, config: K3Config, moe_config: MoEConfig | None = None) -> None:
        super().__init__()
        self.config, self.moe_config = config, moe_config or MoEConfig()
        self.moe_config.validate()
        D, L, E = config.hidden_size, config.routed_expert_hidden_size, config.num_experts
        self.num_experts, self.top_k = E, config.num_experts_per_token
        self.router = Router(D, E, self.top_k, config.routed_scaling_factor)
        nn.init.normal_(self.router.weight, std=config.initializer_range)
        self.down_proj = nn.Linear(D, L, bias=False)
        self.up_proj = nn.Linear(L, D, bias=False)
        for lin in (self.down_proj, self.up_proj):
            nn.init.normal_(lin.weight, std=config.initializer_range)
        self.experts = RoutedExperts(E, L, config.moe_intermediate_size, config.hidden_act,
                                     config.activation_situ_beta, config.activation_situ_linear_beta,
                                     config.initializer_range)
        self.norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.shared_experts = nn.ModuleList(shared_expert(config) for _ in range(config.num_shared_experts))
        self.dispatcher: Dispatcher = LocalDispatcher(E)
        self.overlap_shared = True
        """With a dispatcher that ``overlaps`` (MoonEP on the symmetric heap): compute the shared experts while the
        dispatch moves the rows (``dispatch_async``), unless :meth:`routed` is checkpointed by the activation
        manager (then the dispatch stays inside the checkpoint, in order). Bitwise the same result either way."""
        self.record_routing = True
        # routing counts on the model's device (buffers: moved with it; not checkpointed), updated in place
        self.register_buffer("last_counts", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("step_counts", torch.zeros(E, dtype=torch.int64), persistent=False)
        self._histogram: MarginHistogram | None = None
        self._margins: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]`` (any float dtype) -> ``[B, T, D]`` same dtype."""
        if x.dim() != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"LatentMoE: input shape {tuple(x.shape)}, expected [B, T, {self.config.hidden_size}]")
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)
        topk_ids, topk_weights, scores = self.router(x2)
        self._record(topk_ids, scores)
        z = self.down_proj(x2)
        shared: list[torch.Tensor] | None = None
        if self.overlap_shared and getattr(self.dispatcher, "overlaps", False) and "routed" not in self.__dict__:
            # the rows move on the transport's worker while this thread computes the shared experts (DeepEP's
            # async_finish); with routed checkpointed by the activation manager (an instance attribute) the
            # dispatch stays inside the checkpoint, in order
            pending = self.dispatcher.dispatch_async(z, topk_ids, topk_weights)  # type: ignore[attr-defined]
            shared = [expert(x2) for expert in self.shared_experts]
            u = self.routed_rows(z, *pending.wait())
        else:
            u = self.routed(z, topk_ids, topk_weights)
        if self.norm is not None:
            u = self.norm(u)
        out = self.up_proj(u)
        for i, expert in enumerate(self.shared_experts):  # summed in the same order either way (bitwise)
            out = out + (expert(x2) if shared is None else shared[i])
        return out.view(B, T, D)

    def routed(self, z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed path of Eq. 11: dispatch -> segment weights -> expert compute -> weighting -> combine.

        ``z [N, L]`` latent tokens (``down_proj`` output), ``topk_ids [N, k]`` int64,
        ``topk_weights [N, k]`` fp32 gate values -> ``u [N, L]`` (dtype of ``z``),
        ``u_t = sum_j p_tj * Expert_{ids_tj}(z_t)``. Its three arguments are the dispatch input: the
        activation manager's ``moe_dispatch_only`` checkpoints this method, so backward replays the
        dispatch (a collective under EP) from them (K3_SYSTEMS §8). Router statistics are recorded
        outside it, so a replay never counts routing twice.
        """
        return self.routed_rows(z, *self.dispatcher.dispatch(z, topk_ids, topk_weights))

    def routed_rows(self, z: torch.Tensor, recv_z: torch.Tensor, recv_w: torch.Tensor, cu_seqlens: torch.Tensor,
                    handle: Any) -> torch.Tensor:
        """:meth:`routed` after its dispatch: segment weights -> expert compute -> weighting -> combine."""
        segments = self.dispatcher.segment_weights(handle, self.experts)
        y = self.experts(recv_z, cu_seqlens, segments)
        y = (y * recv_w.to(y.dtype).unsqueeze(1)).to(z.dtype)
        return self.dispatcher.combine(y, handle, weighted=False)

    # ---- Quantile Balancing ---------------------------------------------------------------------
    def _record(self, topk_ids: torch.Tensor, scores: torch.Tensor) -> None:
        with torch.no_grad():
            counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
            self.last_counts.copy_(counts)
            if not self.record_routing:
                return
            self.step_counts.add_(counts)
            mc = self.moe_config
            if not (self.training and mc.qb_enabled):
                return
            margins = qb_margins(scores, self.router.bias, self.top_k)
            if mc.qb_estimator == "exact":
                self._margins.append(margins)
            else:
                if self._histogram is None:
                    self._histogram = MarginHistogram(self.num_experts, mc.qb_bins, mc.qb_min, mc.qb_max,
                                                      device=margins.device)
                self._histogram.add(margins)

    @torch.no_grad()
    def update_bias(self, all_reduce: AllReduce | None = None) -> RoutingStats:
        """Quantile Balancing step (K3_SYSTEMS §5.3, Eq. 12-14) from the statistics since the last call.

        Args:
            all_reduce: sums a tensor in place across data-parallel ranks (supplied by the runtime;
                ``None`` on one process). Called exactly once per call on every rank: on an int64
                ``[E, bins + 1]`` tensor (histogram + routing counts) with the histogram estimator,
                on an int64 ``[E + 1]`` tensor (counts + rank count) with the exact one or QB off.

        Sets ``router.bias`` (unless QB is off or no training forward was recorded), clears the
        statistics, and returns :class:`RoutingStats`. The exact estimator keeps every margin and
        cannot combine ranks: with more than one rank it raises ValueError and leaves bias and
        statistics untouched (use ``qb_estimator = 'histogram'``).
        """
        mc = self.moe_config
        local = self.step_counts.clone()
        new_bias = None
        if mc.qb_enabled and mc.qb_estimator == "histogram":
            hist = self._histogram
            if hist is None:  # no training forward yet: still join the collective with zeros
                hist = MarginHistogram(self.num_experts, mc.qb_bins, mc.qb_min, mc.qb_max,
                                       device=self.router.bias.device)
            packed = torch.cat([hist.counts, local.to(hist.counts.device).unsqueeze(1)], dim=1)
            packed = _reduce(packed, all_reduce)
            # the step's statistics (maxvio) and the histogram's token count, read on the host in one copy
            host = torch.cat([packed[:, -1], packed[0, :-1].sum(0, keepdim=True)]).cpu()
            counts, tokens = host[:-1], int(host[-1])
            hist.counts.copy_(packed[:, :-1])
            if tokens > 0:
                new_bias = hist.bias(self.top_k, num_tokens=tokens)
        else:
            packed = torch.cat([local, torch.ones(1, dtype=torch.int64, device=local.device)])
            packed = _reduce(packed, all_reduce)
            counts, ranks = packed[:-1].cpu(), int(packed[-1])
            if mc.qb_enabled and self._margins:
                if ranks > 1:
                    raise ValueError(f"qb_estimator = 'exact' with {ranks} data-parallel ranks: margins of "
                                     "several ranks cannot be combined; expected qb_estimator = 'histogram'")
                new_bias = qb_bias_from_margins(torch.cat(self._margins), self.top_k)
        if new_bias is not None:
            self.router.bias.copy_(new_bias.to(self.router.bias))
        self._reset_stats()
        return RoutingStats(local_counts=local, counts=counts, maxvio=maxvio(counts),
                            bias=self.router.bias.detach().clone())

    def _reset_stats(self) -> None:
        self.step_counts.zero_()
        self._margins = []
        if self._histogram is not None:
            self._histogram.reset()


def _reduce(t: torch.Tensor, all_reduce: AllReduce | None) -> torch.Tensor:
    if all_reduce is None:
        return t
    out = all_reduce(t)
    return t if out is None else out

