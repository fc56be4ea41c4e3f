"""The KDA token mixer of a K3 decoder layer (K3_SYSTEMS §2.1-2.2), with incremental-decoding state.

Per token x (width D), with H heads of K = V = ``linear_attn_config.head_dim``::

    q | k | v = SiLU(causal depthwise conv(W_qkv x))          (kernel short_conv_kernel_size)
    q, k      = q / sqrt(sum q^2 + 1e-6), same for k             (per head)
    beta      = sigmoid(W_b x)                                   [H]
    g         = gate_lower_bound * sigmoid(exp(A_log) * (W_fb W_fa x + dt_bias))   [H, K], in (g_min, 0)
    o         = KDA(q, k, v, g, beta)                            (through the attention context)
    y         = W_o [RMSNorm(o_h) * sigmoid(W_g x)_h for each head h]

The layer never talks to process groups: the short conv's left context comes from ``ctx.conv_prefix`` and
the KDA op from ``ctx.kda`` (moonrt/parallel/context.py), which context parallelism overrides (K3_SYSTEMS §7).

Packed documents (``packing``, :mod:`moonrt.parallel.packing`): the short conv takes no tap from an earlier
document and the KDA state restarts at each document start (``cu_seqlens`` over the flattened batch).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from moonrt.models.k3.model.config import DT_BIAS_INITS, K3Config
from moonrt.ops.kda import MIN_LOG_DECAY
from moonrt.ops.precision import at_least_fp32
from moonrt.ops.rmsnorm import rms_norm
from moonrt.parallel.blocks import MatrixBlocks
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.packing import DocumentPacking


@dataclasses.dataclass(slots=True)
class KDACache:
    """Inference state of one KDA layer for incremental decoding; :meth:`KDALayer.forward` updates it in place.

    Owned by the caller (one per layer and sequence batch). Stored tensors are detached.
    """

    conv: torch.Tensor
    """``[B, kernel - 1, 2*H*K + H*V]``: the last pre-conv q|k|v projections (the short conv's left context)."""
    state: torch.Tensor
    """``[B, H, K, V]`` in ``promote(dtype, float32)`` (fp32; fp64 for an fp64 model): the KDA state S after the
    last token seen."""
    tokens: int = 0
    """Tokens consumed so far."""

    @classmethod
    def empty(cls, config: K3Config, batch_size: int, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> KDACache:
        """A cache for a fresh sequence: zero conv context (causal padding, ``dtype``) and zero state (``dtype``
        promoted to at least fp32: pass the model's dtype, e.g. ``torch.float64`` for an fp64 model)."""
        lac = config.linear_attn_config
        H, K = lac.num_heads, lac.head_dim
        conv = torch.zeros(batch_size, lac.short_conv_kernel_size - 1, 3 * H * K, device=device, dtype=dtype)
        state_dtype = torch.promote_types(dtype, torch.float32)
        return cls(conv=conv, state=torch.zeros(batch_size, H, K, K, device=device, dtype=state_dtype))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dim (K3_SYSTEMS §2.1)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class KDALayer(nn.Module):
    """Kimi Delta Attention token mixer (K3_SYSTEMS §2.1-2.2): ``[B, T, D] -> [B, T, D]``.

    Parameters (H = ``num_heads``, K = V = ``head_dim``, D = ``hidden_size``):
        qkv_proj ``[2HK + HV, D]``, conv_weight ``[2HK + HV, kernel]`` (depthwise), b_proj ``[H, D]``,
        f_a_proj ``[K, D]`` and f_b_proj ``[HK, K]`` (low-rank gate input), A_log ``[H]``, dt_bias ``[HK]``,
        g_proj ``[HV, D]`` (full-rank output gate), o_norm_weight ``[V]``, o_proj ``[D, HV]``.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        lac = config.linear_attn_config
        self.config = config
        self.hidden_size = D = config.hidden_size
        self.num_heads = H = lac.num_heads
        self.head_dim = K = lac.head_dim
        self.kernel_size = lac.short_conv_kernel_size
        self.gate_lower_bound = lac.gate_lower_bound
        self.eps = config.rms_norm_eps
        self.key_dim = H * K
        self.value_dim = H * K
        width = 2 * self.key_dim + self.value_dim
        self.qkv_proj = nn.Linear(D, width, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(width, self.kernel_size))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, self.key_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(self.key_dim))
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]
        self.dt_bias._no_weight_decay = True  # type: ignore[attr-defined]
        if not MIN_LOG_DECAY <= self.gate_lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound = {self.gate_lower_bound}: expected a value in "
                             f"[{MIN_LOG_DECAY}, 0) (the chunked KDA kernel's decay range, K3_SYSTEMS §2.2)")
        if config.kda_dt_bias_init not in DT_BIAS_INITS:
            raise ValueError(f"kda_dt_bias_init = {config.kda_dt_bias_init!r}: expected one of {DT_BIAS_INITS}")
        if not lac.use_full_rank_gate:
            raise ValueError("linear_attn_config.use_full_rank_gate = False: expected True (K3's KDA output gate "
                             "is one full-rank D -> H*V projection)")
        self.g_proj = nn.Linear(D, self.value_dim, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)
        self.reset_parameters()

    def matrix_blocks(self) -> dict[str, MatrixBlocks]:
        """Optimizer blocks: ``qkv_proj`` per head of q, of k and of v (3H blocks of ``[K, D]``, K3 report §2.7)."""
        return {"qkv_proj.weight": MatrixBlocks(head_dim=self.head_dim)}

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Linear weights ~ N(0, initializer_range); conv as ``nn.Conv1d``; A_log as Kimi Linear; dt_bias by
        ``config.kda_dt_bias_init`` (the K3 report specifies none of these, K3_SYSTEMS §12).

        Kimi Linear (fla) draws ``A = exp(A_log) ~ U(1, 16)`` per head and ``dt ~ logU(1e-3, 1e-1)`` per channel,
        starting at the decay ``g = -A * dt``. ``kimi_linear`` (default): ``dt_bias`` is solved so K3's sigmoid gate
        starts at the same decay, ``g_min * sigmoid(A * dt_bias) = -A * dt`` (clamped to 0.9 * |g_min|), so
        ``g0`` lies in [-1.6, -0.001] (a memory of ~1 to ~1000 tokens). ``zero``: ``dt_bias = 0``, so every channel
        starts at ``g0 = g_min / 2`` (-2.5 for K3: ``alpha = 0.08`` per token). Both draw the same random numbers
        (the other parameters do not depend on the option).
        """
        std = self.config.initializer_range
        for lin in (self.qkv_proj, self.b_proj, self.f_a_proj, self.f_b_proj, self.g_proj, self.o_proj):
            lin.weight.normal_(0.0, std, generator=generator)
        bound = 1.0 / math.sqrt(self.kernel_size)  # nn.Conv1d default for a depthwise kernel (fan_in = kernel)
        self.conv_weight.uniform_(-bound, bound, generator=generator)
        A = torch.empty(self.num_heads).uniform_(1.0, 16.0, generator=generator)
        self.A_log.copy_(A.log())
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.empty(self.key_dim).uniform_(lo, hi, generator=generator))
        g0 = (-A.repeat_interleave(self.head_dim) * dt).clamp(min=0.9 * self.gate_lower_bound)
        if self.config.kda_dt_bias_init == "zero":
            self.dt_bias.zero_()
        else:
            self.dt_bias.copy_(torch.logit(g0 / self.gate_lower_bound) / A.repeat_interleave(self.head_dim))
        self.o_norm_weight.fill_(1.0)

    # ---- pieces -----------------------------------------------------------------------------------------
    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log-decay ``g [B, T, H, K]`` in ``(gate_lower_bound, 0)`` from ``x [B, T, D]`` (K3_SYSTEMS §2.2), in
        ``promote(dtype, float32)`` of its inputs: fp32 for bf16/fp32, fp64 for an fp64 model.

        (In fp32 a saturated sigmoid reaches the closed bounds exactly.)
        """
        B, T, _ = x.shape
        f = at_least_fp32(self.f_b_proj(self.f_a_proj(x)))  # [B, T, H*K]
        A = at_least_fp32(self.A_log).exp().repeat_interleave(self.head_dim)  # [H*K]
        g = self.gate_lower_bound * torch.sigmoid(A * (f + at_least_fp32(self.dt_bias)))
        return g.view(B, T, self.num_heads, self.head_dim)

    def _short_conv(self, x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU: ``x [B, T, C]``, left context ``prefix [B, kernel-1, C]`` -> ``[B, T, C]``."""
        xp = torch.cat([prefix.to(x.dtype), x], dim=1).transpose(1, 2)  # [B, C, kernel - 1 + T]
        y = F.conv1d(xp, self.conv_weight.to(x.dtype)[:, None, :], groups=xp.shape[1])  # [B, C, T]
        return F.silu(y.transpose(1, 2))

    def _short_conv_packed(self, x: torch.Tensor, packing: DocumentPacking) -> torch.Tensor:
        """:meth:`_short_conv` of packed documents: ``x [B, T, C]`` -> ``[B, T, C]``; tap ``j`` (token ``t - j``)
        contributes only when that token is in ``t``'s document (fla's ``causal_conv1d`` with ``seq_idx``)."""
        w = self.conv_weight.to(x.dtype)  # [C, W]; conv1d pairs w[:, W - 1 - j] with token t - j
        W, T = self.kernel_size, x.shape[1]
        y = x * w[:, W - 1]
        for j in range(1, min(W, T + 1)):
            shifted = F.pad(x, (0, 0, j, 0))[:, :T]  # token t - j (zeros before the row)
            y = y + torch.where(packing.conv_valid(j), shifted, 0.0) * w[:, W - 1 - j]
        return F.silu(y)

    def _check_cache(self, cache: KDACache, x: torch.Tensor) -> None:
        B = x.shape[0]
        conv_shape = (B, self.kernel_size - 1, 2 * self.key_dim + self.value_dim)
        if tuple(cache.conv.shape) != conv_shape:
            raise ValueError(f"cache.conv.shape = {tuple(cache.conv.shape)}: expected {conv_shape}")
        state_shape = (B, self.num_heads, self.head_dim, self.head_dim)
        if tuple(cache.state.shape) != state_shape:
            raise ValueError(f"cache.state.shape = {tuple(cache.state.shape)}: expected {state_shape}")
        state_dtype = torch.promote_types(x.dtype, torch.float32)
        if cache.state.dtype != state_dtype:
            raise ValueError(f"cache.state.dtype = {cache.state.dtype}: expected {state_dtype} (promote(x.dtype, "
                             f"float32); KDACache.empty(..., dtype=x.dtype))")

    def forward(self, x: torch.Tensor, ctx: AttentionContext = LOCAL, cache: KDACache | None = None,
                packing: DocumentPacking | None = None) -> torch.Tensor:
        """Mix tokens: ``x [B, T, D]`` -> ``[B, T, D]`` (same dtype).

        Args:
            x: ``[B, T, D]`` this rank's (or step's) tokens.
            ctx: attention context; supplies the conv halo (``conv_prefix``) and the KDA op (``kda``).
            cache: incremental decoding. When given, it replaces the context's halo and initial state, and is
                updated in place with the new conv tail and the KDA state after the last token.
            packing: documents packed in ``x`` (single-device context, no cache): no token mixes across them.
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x.shape = {tuple(x.shape)}: expected [B, T, {self.hidden_size}]")
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if cache is not None:
            self._check_cache(cache, x)
        if packing is not None:
            packing.check(B, T, "packing")
            packing.check_context(ctx)
            if cache is not None:
                raise ValueError("packing with a KDACache: expected one of them (decoding runs one sequence per row)")
        pre = self.qkv_proj(x)  # [B, T, 2HK + HV] pre-conv projections
        if packing is not None:
            qkv = self._short_conv_packed(pre, packing)
        else:
            prefix = cache.conv if cache is not None else ctx.conv_prefix(pre, self.kernel_size - 1)
            qkv = self._short_conv(pre, prefix)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(B, T, H, K))
        k = l2_normalize(k.reshape(B, T, H, K))
        v = v.reshape(B, T, H, K)
        beta = torch.sigmoid(at_least_fp32(self.b_proj(x)))  # [B, T, H]
        g = self.gate(x)  # [B, T, H, K] fp32 (fp64 for an fp64 model)
        if packing is not None:  # the rows laid end to end: [1, B*T, ...], documents at cu_seqlens
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            o, S = ctx.kda(*flat, cu_seqlens=packing.cu_seqlens)
            o = o.view(B, T, *o.shape[2:])
        else:
            o, S = ctx.kda(q, k, v, g, beta, initial_state=None if cache is None else cache.state,
                           output_final_state=cache is not None)
        if cache is not None:
            tail = torch.cat([cache.conv.to(pre.dtype), pre], dim=1)[:, -(self.kernel_size - 1):] \
                if self.kernel_size > 1 else cache.conv
            cache.conv = tail.detach().to(cache.conv.dtype)
            cache.state = at_least_fp32(S.detach())
            cache.tokens += T
        o = at_least_fp32(o)
        o = rms_norm(o, self.o_norm_weight, self.eps)  # per head, fp32 (fp64 stays); one autograd node
        o = o * torch.sigmoid(at_least_fp32(self.g_proj(x)).view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, self.value_dim).to(x.dtype))


__all__ = ["KDACache", "KDALayer", "l2_normalize"]
