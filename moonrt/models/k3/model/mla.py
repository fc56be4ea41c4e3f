"""Gated multi-head latent attention with NoPE (K3_SYSTEMS §3, report §2.1 Eq. 7).

Per token ``x [D]``:

- queries: ``q = W_qb RMSNorm(W_qa x)`` (``D -> q_lora_rank -> H * (nope + rope)``);
- compressed latent: ``W_kva x = [c | k_r]`` with ``c [kv_lora_rank]`` (RMSNorm applied) and the
  shared "rope" key slice ``k_r [qk_rope_head_dim]``. K3 uses NoPE: the "rope" slice carries **no**
  rotary embedding; it is a key slice shared by all heads;
- keys and values per head from the latent: ``[k_nope | v] = W_kvb c`` (``kv_lora_rank -> H * (nope + v)``),
  ``k_h = [k_nope_h | k_r]``;
- causal softmax attention per head with scale ``(nope + rope) ** -0.5``, computed in at least fp32
  (under ``--dtype bf16`` torch's SDPA is on autocast's bf16 list: bf16 inputs, softmax accumulated in fp32, as
  FlashAttention does);
- full-rank sigmoid output gate ``o = sigmoid(W_g x) * o~`` (``D -> H * v``), then ``W_o`` (``H * v -> D``).

Context parallelism: the latent ``[RMSNorm(c) | k_r]`` (``kv_lora_rank + qk_rope_head_dim`` values
per token, the smallest thing that determines every key and value) goes through
``ctx.gather_sequence``; queries stay local and are masked causally by their global positions
``offset + arange(T)``. The module holds no process state.

Packed documents (``packing``, :mod:`moonrt.parallel.packing`): a block-diagonal causal mask, so a query
attends only to earlier keys of its own document (NoPE: no positions to restart).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moonrt.models.k3.model.config import K3Config
from moonrt.models.k3.model.norm import RMSNorm
from moonrt.ops.precision import at_least_fp32
from moonrt.parallel.blocks import MatrixBlocks
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.packing import DocumentPacking


class GatedMLA(nn.Module):
    """One gated NoPE MLA attention sub-layer (no residual, no input norm: the decoder layer owns those).

    Parameters (names are stable; memory policies and checkpoints match them):
    ``q_a_proj [q_lora, D]``, ``q_a_norm``, ``q_b_proj [H*(nope+rope), q_lora]``,
    ``kv_a_proj [kv_lora+rope, D]``, ``kv_a_norm``, ``kv_b_proj [H*(nope+v), kv_lora]``,
    ``g_proj [H*v, D]`` (output gate), ``o_proj [D, H*v]``. No biases.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.nope = c.qk_nope_head_dim
        self.rope = c.qk_rope_head_dim
        self.v_dim = c.v_head_dim
        self.kv_lora = c.kv_lora_rank
        self.use_gate = c.mla_use_output_gate
        self.scale = (self.nope + self.rope) ** -0.5
        d, h = c.hidden_size, self.num_heads
        self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, h * (self.nope + self.rope), bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, h * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, h * self.v_dim, bias=False) if self.use_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        for lin in (self.q_a_proj, self.q_b_proj, self.kv_a_proj, self.kv_b_proj, self.g_proj, self.o_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=c.initializer_range)

    def matrix_blocks(self) -> dict[str, MatrixBlocks]:
        """Optimizer blocks (K3 report §2.7): the up-projections per head. ``q_b_proj``: one ``[nope + rope,
        q_lora]`` query block per head; ``kv_b_proj``'s rows are ``[k_nope_h | v_h]`` per head: one block per
        head's keys and one per its values when ``nope == v``, else one ``[nope + v, kv_lora]`` block per head."""
        kv = self.nope if self.nope == self.v_dim else self.nope + self.v_dim
        return {"q_b_proj.weight": MatrixBlocks(head_dim=self.nope + self.rope),
                "kv_b_proj.weight": MatrixBlocks(head_dim=kv)}

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """Compressed per-token latent ``x [B, T, D]`` -> ``[B, T, kv_lora_rank + qk_rope_head_dim]``.

        ``[RMSNorm(c) | k_r]``: what context parallelism all-gathers (no rotary on ``k_r``: NoPE).
        """
        ckv = self.kv_a_proj(x)
        c, k_r = ckv.split([self.kv_lora, self.rope], dim=-1)
        return torch.cat([self.kv_a_norm(c), k_r], dim=-1)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]`` -> ``q [B, T, H, nope + rope]``."""
        b, t, _ = x.shape
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(b, t, self.num_heads, self.nope + self.rope)

    def keys_values(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [B, S, kv_lora + rope]`` -> ``k [B, S, H, nope + rope]``, ``v [B, S, H, v]``."""
        b, s, _ = latent.shape
        c, k_r = latent.split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(b, s, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_r.unsqueeze(2).expand(b, s, self.num_heads, self.rope)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, ctx: AttentionContext = LOCAL,
                packing: DocumentPacking | None = None) -> torch.Tensor:
        """``x [B, T, D]`` (this rank's slice of the sequence) -> ``[B, T, D]`` in ``x.dtype``.

        ``ctx.gather_sequence`` returns the latent of all tokens up to the end of this slice and the
        slice's offset; query ``t`` sits at global position ``offset + t`` and attends to key
        positions ``<= offset + t``; with ``packing`` (single-device context) only those of its own document.
        """
        if x.dim() != 3 or x.shape[-1] != self.q_a_proj.in_features:
            raise ValueError(f"x shape {tuple(x.shape)}: expected [B, T, {self.q_a_proj.in_features}]")
        b, t, _ = x.shape
        if packing is not None:
            packing.check(b, t, "packing")
            packing.check_context(ctx)
        q = self.queries(x)
        latent_full, offset = ctx.gather_sequence(self.latent(x))
        k, v = self.keys_values(latent_full)
        s = k.shape[1]
        if s < offset + t:
            raise ValueError(f"gathered sequence length {s} < offset {offset} + local length {t}")
        q_pos = torch.arange(t, device=x.device) + offset
        k_pos = torch.arange(s, device=x.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [T, S] True = attend
        if packing is not None:
            mask = packing.attention_mask()  # [B, 1, T, T]: causal within each document
        o = F.scaled_dot_product_attention(
            at_least_fp32(q).transpose(1, 2), at_least_fp32(k).transpose(1, 2), at_least_fp32(v).transpose(1, 2),
            attn_mask=mask, scale=self.scale,
        )  # [B, H, T, V] fp32 (fp64 for an fp64 model)
        o = o.transpose(1, 2).reshape(b, t, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            o = torch.sigmoid(at_least_fp32(self.g_proj(x))) * o
        return self.o_proj(o.to(x.dtype))
