"""Parameter counts of a K3 model from its config alone (K3_SYSTEMS §1): total and active per token.

The formulas mirror the modules exactly (a test checks ``count_params(k3_tiny()).total ==
sum(p.numel() for p in K3Model(k3_tiny()).parameters())``), so they also count the real ``k3``
without instantiating it: 2.78T total, ~104.2B active.

**Active per token** = the parameters whose values enter the computation of one token's output:

- every parameter of attention (KDA and MLA), dense FFN, shared experts, router, latent
  down/up projections and norms, Block AttnRes pseudo-queries, final norm and LM head;
- of the routed experts only the ``num_experts_per_token`` selected ones (``k / E`` of them);
- **not** the input embedding table: a token reads one row of it (a lookup, no matmul), which is the
  convention behind the report's 104.2B (counting the whole table would add ``vocab * D`` = 1.17B).
  With tied embeddings the table is the LM head and counts once, as active.

Router selection biases are buffers (no gradient), not parameters, and are not counted.

**Model FLOPs per token** (:func:`flops_per_token`, what MFU divides by the hardware peak) follow the PaLM /
Megatron estimate: ``6 x active`` for the matmuls of forward and backward, plus the attention products that no
parameter counts (below).
"""

from __future__ import annotations

import dataclasses

from moonrt.models.k3.model.config import K3Config


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """``total`` and ``active`` (per token) parameter counts, and ``by_part`` (total per component)."""

    total: int
    active: int
    by_part: dict[str, int]

    def table(self) -> str:
        """A readable breakdown, one component per line (exact counts)."""
        rows = [f"{name:<26} {n:>19,}" for name, n in self.by_part.items()]
        rows += [f"{'total':<26} {self.total:>19,}", f"{'active per token':<26} {self.active:>19,}"]
        return "\n".join(rows)


def kda_params(c: K3Config) -> int:
    """One KDA attention sub-layer (``moonrt.models.k3.model.kda_layer.KDALayer``), K3_SYSTEMS §2."""
    la = c.linear_attn_config
    d, h, hd = c.hidden_size, la.num_heads, la.head_dim
    hk = h * hd
    qkv = 3 * d * hk  # q, k, v projections (K = V = head_dim)
    conv = 3 * hk * la.short_conv_kernel_size  # depthwise causal conv on q, k, v (no bias)
    beta = d * h  # beta = sigmoid(W_b x), one per head
    decay = d * hd + hd * hk + h + hk  # low-rank f (D -> V -> H*K), A_log [H], dt_bias [H*K]
    out_gate = d * hk  # full-rank output gate D -> H*V
    o_norm = hd  # per-head RMSNorm weight (shared by heads)
    o_proj = hk * d
    return qkv + conv + beta + decay + out_gate + o_norm + o_proj


def mla_params(c: K3Config) -> int:
    """One gated MLA attention sub-layer (:class:`moonrt.models.k3.model.mla.GatedMLA`), K3_SYSTEMS §3."""
    d, h = c.hidden_size, c.num_attention_heads
    q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * h * (
        c.qk_nope_head_dim + c.v_head_dim)
    gate = d * h * c.v_head_dim if c.mla_use_output_gate else 0
    return q + kv + gate + h * c.v_head_dim * d


def glu_params(dim: int, hidden: int) -> int:
    """A gated FFN (gate, up, down; no biases)."""
    return 3 * dim * hidden


def routed_expert_params(c: K3Config) -> int:
    """One routed expert: a GLU FFN in the latent space (latent -> moe_intermediate_size -> latent)."""
    return glu_params(c.routed_expert_hidden_size, c.moe_intermediate_size)


def moe_dense_params(c: K3Config) -> int:
    """The always-active part of one LatentMoE layer: router, latent down/up, latent norm, shared experts."""
    d, lat = c.hidden_size, c.routed_expert_hidden_size
    router = d * c.num_experts
    down_up = 2 * d * lat + (lat if c.latent_moe_use_norm else 0)
    shared = c.num_shared_experts * glu_params(d, c.moe_intermediate_size)
    return router + down_up + shared


def count_params(c: K3Config) -> ParamCounts:
    """Total and active-per-token parameters of :class:`moonrt.models.k3.model.model.K3Model` for config ``c``."""
    d, n_layers = c.hidden_size, c.num_hidden_layers
    types = c.layer_types()
    n_moe = sum(c.is_moe_layer(i) for i in range(n_layers))
    embed = c.vocab_size * d
    lm_head = 0 if c.tie_word_embeddings else c.vocab_size * d
    parts = {
        "embedding": embed,
        "kda_attention": types.count("kda") * kda_params(c),
        "mla_attention": types.count("mla") * mla_params(c),
        "dense_ffn": (n_layers - n_moe) * glu_params(d, c.intermediate_size),
        "moe_shared_router_latent": n_moe * moe_dense_params(c),
        "moe_routed_experts": n_moe * c.num_experts * routed_expert_params(c),
        "norms": 2 * d * n_layers + d,
        "attn_res": (2 * n_layers + 1) * d,
        "lm_head": lm_head,
    }
    total = sum(parts.values())
    inactive_routed = n_moe * (c.num_experts - c.num_experts_per_token) * routed_expert_params(c)
    inactive_embed = embed if not c.tie_word_embeddings else 0
    return ParamCounts(total=total, active=total - inactive_routed - inactive_embed, by_part=parts)


def flops_per_token(c: K3Config, seq_len: int) -> int:
    """Training FLOPs (forward + backward, 2 per multiply-add, backward 2x forward) per token at ``seq_len``.

    ``6 x active`` (every active weight in one multiply-add forward, two backward: PaLM appendix B, Megatron's
    ``6N``) plus the attention products no parameter counts, forward ``F`` times 3:

    - MLA (softmax over the context, PaLM's non-causal convention: every query against all ``T`` keys):
      ``F = 2 T H (dk + dv)`` with ``dk = qk_nope_head_dim + qk_rope_head_dim``, ``dv = v_head_dim``; for
      ``dk = dv = Q`` this is PaLM's ``12 L H Q T`` term;
    - KDA (K3_SYSTEMS §2.1, the recurrent form's three ``K x V`` products per head: ``S^T k``, the rank-one
      update ``k (v - S^T k)^T``, the read ``S^T q``): ``F = 6 H K V``, independent of ``T``.

    Element-wise work (norms, gates, decay, softmax, the conv) is not counted, as in the estimates cited.
    """
    la = c.linear_attn_config
    types = c.layer_types()
    dk, dv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    mla = types.count("mla") * 2 * seq_len * c.num_attention_heads * (dk + dv)
    kda = types.count("kda") * 6 * la.num_heads * la.head_dim * la.head_dim
    return 6 * count_params(c).active + 3 * (mla + kda)
