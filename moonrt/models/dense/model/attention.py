"""Causal multi-head softmax attention of the dense decoder, with optional rotary positions.

Per token ``x [D]``: ``q = W_q x`` (``D -> H * hd``), ``[k | v] = W_kv x`` (``D -> 2 H hd``: all key heads,
then all value heads), rotary embedding (HF rotate-half layout, base ``rope_theta``) on ``q`` and ``k`` at
their positions, softmax attention per head with scale ``hd ** -0.5`` in fp32 (fp64 for fp64 inputs), then
``W_o`` (``H * hd -> D``). No biases.

Context parallelism (the seam ``ctx.gather_sequence``, ``moonrt.parallel.context``): the per-token
``[k | v]`` (before rotary: positions are only known after the gather) is the one tensor gathered; the
queries stay local at global positions ``offset + arange(T)``, keys at ``arange(S)``, and a query attends to
keys at positions ``<=`` its own. Rotary depends on the global positions only, so a slice computes exactly
what the whole sequence computes for its queries.

Packed documents (``packing``): any object with the interface of K3's ``DocumentPacking`` (:class:`Packing`):
a block-diagonal causal mask (``packing.attention_mask()``), rotary positions restarting at 0 in each
document (``packing.positions``), single-device context only (``packing.check_context``). Each document's
outputs are then those of the document run alone.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moonrt.parallel.blocks import MatrixBlocks
from moonrt.parallel.context import LOCAL, AttentionContext

from .config import DenseConfig


class Packing(Protocol):
    """What attention reads of a document packing (K3's ``DocumentPacking`` satisfies it)."""

    positions: torch.Tensor
    """``[B, T]`` int64: each token's position within its document."""

    def check(self, B: int, T: int, what: str = "packing") -> None:
        """Raise ValueError unless the packing describes a ``[B, T]`` batch."""

    def check_context(self, ctx: AttentionContext) -> None:
        """Raise ValueError unless ``ctx`` is the single-device context."""

    def attention_mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool, True = attend (causal within each document)."""


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [B, S, H, hd]`` (hd even) at ``positions`` ``[S]`` or ``[B, S]``.

    Pair ``j`` (channels ``j`` and ``j + hd/2``) turns by ``pos * theta ** (-2 j / hd)``; angles and their
    cos / sin in float64, then ``x.dtype``. Returns ``[B, S, H, hd]`` in ``x.dtype``.
    """
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / x.shape[-1])
    angles = positions.to(device=x.device, dtype=torch.float64).unsqueeze(-1) * inv  # [.., S, half]
    cos, sin = angles.cos().to(x.dtype).unsqueeze(-2), angles.sin().to(x.dtype).unsqueeze(-2)  # [.., S, 1, half]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    """One attention sub-layer (no residual, no input norm: the decoder layer owns those).

    Parameters (stable names): ``q_proj.weight [H hd, D]``, ``kv_proj.weight [2 H hd, D]`` (rows: key heads,
    then value heads), ``o_proj.weight [D, H hd]``; each ~ N(0, ``initializer_range``).
    """

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.scale = c.head_dim ** -0.5
        d, inner = c.hidden_size, c.num_attention_heads * c.head_dim
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.kv_proj = nn.Linear(d, 2 * inner, bias=False)
        self.o_proj = nn.Linear(inner, d, bias=False)
        for lin in (self.q_proj, self.kv_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=c.initializer_range)

    def matrix_blocks(self) -> dict[str, MatrixBlocks]:
        """Per-Head Muon blocks (K3 report §2.7, as K3 declares its Q/K/V): ``q_proj`` one ``[hd, D]`` block per
        query head, ``kv_proj`` one per key head then one per value head (``2 H`` blocks). ``o_proj`` stays one
        whole matrix, as K3's output projections do."""
        return {"q_proj.weight": MatrixBlocks(head_dim=self.head_dim),
                "kv_proj.weight": MatrixBlocks(head_dim=self.head_dim)}

    def forward(self, x: torch.Tensor, ctx: AttentionContext = LOCAL, packing: Packing | None = None) -> torch.Tensor:
        """``x [B, T, D]`` (this rank's slice of the sequence) -> ``[B, T, D]`` in ``x.dtype``.

        ``ctx.gather_sequence`` returns ``[k | v]`` of every token up to the end of this slice
        (``[B, S, 2 H hd]``, ``S >= offset + T``) and the slice's offset.
        """
        D = self.q_proj.in_features
        if x.dim() != 3 or x.shape[-1] != D:
            raise ValueError(f"x shape {tuple(x.shape)}: expected [B, T, {D}]")
        b, t, _ = x.shape
        h, hd = self.num_heads, self.head_dim
        if packing is not None:
            packing.check(b, t, "packing")
            packing.check_context(ctx)
        q = self.q_proj(x).view(b, t, h, hd)
        kv, offset = ctx.gather_sequence(self.kv_proj(x))
        if kv.dim() != 3 or kv.shape[0] != b or kv.shape[2] != 2 * h * hd:
            raise ValueError(f"gathered [k | v] shape {tuple(kv.shape)}: expected [{b}, S, {2 * h * hd}]")
        s = kv.shape[1]
        if s < offset + t:
            raise ValueError(f"gathered sequence length {s} < offset {offset} + local length {t}")
        k, v = kv.view(b, s, 2, h, hd).unbind(2)
        dt = torch.promote_types(x.dtype, torch.float32)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        q_pos = torch.arange(t, device=x.device) + offset
        k_pos = torch.arange(s, device=x.device)
        if self.rope_theta is not None:
            qp, kp = (packing.positions, packing.positions) if packing is not None else (q_pos, k_pos)
            q, k = rotary(q, qp, self.rope_theta), rotary(k, kp, self.rope_theta)
        mask, causal = None, False
        if packing is not None:
            mask = packing.attention_mask()  # [B, 1, T, T]: causal within each document
        elif offset == 0 and s == t:
            causal = True
        else:
            mask = k_pos[None, :] <= q_pos[:, None]  # [T, S] True = attend
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal, scale=self.scale)  # [B, H, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, h * hd).to(x.dtype))


__all__ = ["CausalSelfAttention", "Packing", "rotary"]
