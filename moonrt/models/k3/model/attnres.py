"""Block Attention Residuals (K3_SYSTEMS §4, report §2.2 Eq. 8-10).

A standard residual stream feeds sub-layer ``l`` the plain sum of everything before it. Block AttnRes
feeds it a softmax mix of *sources* instead::

    h_l = sum_i a_{i->l} v_i,    a_{i->l} = softmax_i( w_l . RMSNorm(v_i) )     (fp32 softmax)

with ``w_l [D]`` a learned, input-independent pseudo-query (zero init: a uniform mix at start).

Sources and sub-layers in moonrt (our choice, following the Attention Residuals paper):

- A *sub-layer* is one of the two halves of a decoder layer: the attention sub-layer (KDA or MLA)
  and the FFN sub-layer (dense FFN or LatentMoE). Each has its own pseudo-query, so a model with
  ``L`` decoder layers has ``2 L`` sub-layer queries plus one final-aggregation query.
- Blocks are counted in decoder layers (``attn_res_block_size``, K3: 12): block ``n >= 1`` spans
  decoder layers ``[(n-1) S, n S)``; its representation ``b_n`` is the sum of the outputs of all its
  sub-layers (``2 S`` of them, fewer in a partial last block). ``b_0`` is the token embedding.
- The sub-layer input mixes the finished blocks ``[b_0 .. b_{n-1}]`` and, except for the very first
  sub-layer of a block, the running partial sum ``b_n^partial`` of the current block.
- After the last layer one more pseudo-query aggregates all block representations (the last one may
  be partial) into the final hidden state.

Key normalization is a weightless RMSNorm: a learned per-channel weight ``g`` would be redundant with
the pseudo-query (``w . (g * n) = (w * g) . n``).

:class:`AttnResState` is the stream that crosses decoder layers (and pipeline stages): finished block
representations plus the current partial block. Two ways to compute a sub-layer input are provided:
:func:`mix` (direct softmax) and the two-phase inference form (:func:`inter_block_pass` once per block
over the finished blocks for all of its queries, then :func:`merge_partial` per sub-layer with an
online-softmax merge); they agree to fp32 rounding.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moonrt.ops.precision import fp32_island
from moonrt.parallel.decoder import BlockStream


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype AttnRes scores and mixes in: fp32 for bf16/fp16/fp32 sources, fp64 for fp64 sources.

    Never narrower than fp32 (the fp32 softmax of Eq. 9) and never narrower than the input, so a
    float64 run is a float64 reference of the same code (the tests compare both forms in fp64).
    """
    return torch.promote_types(dtype, torch.float32)


def rms_keys(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm of sources ``v [..., D]`` -> keys ``[..., D]`` in :func:`compute_dtype`."""
    v = v.to(compute_dtype(v.dtype))
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


@fp32_island
def mix(query: torch.Tensor, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """Direct AttnRes mix (Eq. 8-9).

    ``query [D]`` (a pseudo-query), ``sources``: N tensors ``[B, T, D]`` -> ``[B, T, D]`` in the
    sources' dtype; logits and softmax in :func:`compute_dtype` (fp32, fp64 for fp64 sources).
    """
    if not sources:
        raise ValueError("AttnRes mix needs at least one source")
    if len(sources) == 1:
        return sources[0]
    v = torch.stack(sources, dim=0)  # [N, B, T, D]
    keys = rms_keys(v, eps)
    logits = keys @ query.to(keys.dtype)  # [N, B, T]
    a = torch.softmax(logits, dim=0)
    return (a.unsqueeze(-1) * v.to(keys.dtype)).sum(0).to(sources[0].dtype)


@dataclasses.dataclass
class OnlineSoftmax:
    """Partial softmax-weighted sums for Q queries (the running state of the two-phase form).

    ``m [Q, B, T]`` running max of logits, ``l [Q, B, T]`` running sum of ``exp(logit - m)``,
    ``acc [Q, B, T, D]`` running sum of ``exp(logit - m) * v``; all in :func:`compute_dtype` (fp32 or fp64).
    """

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor


@fp32_island
def inter_block_pass(queries: torch.Tensor, finished: list[torch.Tensor], eps: float) -> OnlineSoftmax:
    """Phase 1: score the N finished blocks for all Q queries of a block in one batched pass.

    ``queries [Q, D]``, ``finished``: N >= 1 tensors ``[B, T, D]`` -> :class:`OnlineSoftmax` over them.
    """
    v = torch.stack(finished, dim=0)  # [N, B, T, D]
    v = v.to(compute_dtype(v.dtype))
    keys = rms_keys(v, eps)
    logits = torch.einsum("nbtd,qd->qnbt", keys, queries.to(keys.dtype))  # [Q, N, B, T]
    m = logits.amax(dim=1)
    p = torch.exp(logits - m.unsqueeze(1))
    return OnlineSoftmax(m=m, l=p.sum(1), acc=torch.einsum("qnbt,nbtd->qbtd", p, v))


@fp32_island
def merge_partial(state: OnlineSoftmax, index: int, partial: torch.Tensor | None, query: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Phase 2: merge the intra-block partial sum into query ``index``'s phase-1 state (online softmax).

    ``partial [B, T, D]`` or None (first sub-layer of the block), ``query [D]`` (must be
    ``queries[index]`` of phase 1) -> the sub-layer input ``[B, T, D]`` in the partial's (or the compute) dtype.
    """
    m, l, acc = state.m[index], state.l[index], state.acc[index]
    if partial is None:
        return acc / l.unsqueeze(-1)
    keys = rms_keys(partial, eps)
    s = keys @ query.to(keys.dtype)  # [B, T]
    m_new = torch.maximum(m, s)
    c_old, c_new = torch.exp(m - m_new), torch.exp(s - m_new)
    out = (acc * c_old.unsqueeze(-1) + c_new.unsqueeze(-1) * partial.to(keys.dtype)) / (l * c_old + c_new).unsqueeze(-1)
    return out.to(partial.dtype)


@dataclasses.dataclass
class AttnResState(BlockStream):
    """The residual stream between decoder layers: what a pipeline stage boundary carries (:class:`BlockStream`).

    ``blocks``: finished block representations ``[B, T, D]`` (``blocks[0]`` is the embedding);
    ``partial``: the running sum ``[B, T, D]`` of the current block's sub-layer outputs, or None at a
    block boundary; ``inter``: the phase-1 state of the current block in two-phase mode (else None).
    """

    inter: OnlineSoftmax | None = None

    def close_block(self) -> None:
        """End of a block: the partial sum becomes a finished block representation; the phase-1 state ends."""
        super().close_block()
        self.inter = None


class BlockAttnRes(nn.Module):
    """Pseudo-queries of Block AttnRes for a decoder of ``num_layers`` layers.

    ``queries [2 * num_layers, D]`` (row ``2 l`` before layer ``l``'s attention sub-layer, row
    ``2 l + 1`` before its FFN/MoE sub-layer) and ``final_query [D]``; both zero-initialized.
    """

    def __init__(self, dim: int, num_layers: int, block_size: int, eps: float) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size = {block_size}: expected an integer >= 1")
        self.num_layers = num_layers
        self.block_size = block_size
        self.eps = eps
        self.queries = nn.Parameter(torch.zeros(2 * num_layers, dim))
        self.final_query = nn.Parameter(torch.zeros(dim))

    # ---- block structure (pipeline stages cut between layers) ----------------------------------
    def block_of(self, layer: int) -> int:
        """1-based block index of decoder ``layer`` (block 0 is the embedding)."""
        return layer // self.block_size + 1

    def is_block_start(self, layer: int) -> bool:
        return layer % self.block_size == 0

    def is_block_end(self, layer: int) -> bool:
        return (layer + 1) % self.block_size == 0 or layer == self.num_layers - 1

    def block_ranges(self) -> list[range]:
        """Decoder-layer range of each block 1..N (the last one may be partial)."""
        s, n = self.block_size, self.num_layers
        return [range(i, min(i + s, n)) for i in range(0, n, s)]

    # ---- computation ----------------------------------------------------------------------------
    def begin_layer(self, layer: int, state: AttnResState, two_phase: bool) -> None:
        """Called before decoder ``layer``: at a block start in two-phase mode, run phase 1."""
        if two_phase and self.is_block_start(layer):
            rows = self.block_ranges()[self.block_of(layer) - 1]
            q = self.queries[2 * rows.start: 2 * rows.stop]
            state.inter = inter_block_pass(q, state.blocks, self.eps)

    def sublayer_input(self, layer: int, which: int, state: AttnResState, two_phase: bool) -> torch.Tensor:
        """Input ``[B, T, D]`` of sub-layer ``which`` (0 attention, 1 FFN) of decoder ``layer``."""
        idx = 2 * layer + which
        if two_phase:
            if state.inter is None:
                raise ValueError(f"layer {layer}: two-phase AttnRes needs begin_layer() at the block start")
            start = self.block_ranges()[self.block_of(layer) - 1].start
            out = merge_partial(state.inter, idx - 2 * start, state.partial, self.queries[idx], self.eps)
            return out.to(state.blocks[0].dtype)
        return mix(self.queries[idx], state.sources(), self.eps)

    def end_layer(self, layer: int, state: AttnResState) -> None:
        if self.is_block_end(layer):
            state.close_block()

    def final(self, state: AttnResState) -> torch.Tensor:
        """Final aggregation over all block representations (after the last layer): ``[B, T, D]``."""
        return mix(self.final_query, state.sources(), self.eps)
