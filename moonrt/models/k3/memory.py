"""K3's memory description for the memory planner: parameter sizes, saved-activation profiles of
moonrt's K3 layers and the policy YAML of a plan (K3_SYSTEMS §8, §10; formulas in docs/MEMORY_MODEL.md).

The planner (:mod:`moonrt.memory.plan`, :mod:`moonrt.memory.model_memory`) is model-agnostic: it takes
per-part parameter counts (:class:`~moonrt.memory.model_memory.ParamSizes`) and a per-layer activation
profile (:class:`~moonrt.memory.model_memory.Profile`) from its caller and answers with a storage policy per
saved-tensor class. This job-layer module is what the K3 record of :mod:`moonrt.models` points at:
:func:`param_sizes` (from the K3 parameter table :mod:`moonrt.models.k3.model.params`), :func:`analytic_profile` /
:func:`default_profile` (per-term formulas of what moonrt's K3 layers save for backward),
:func:`kernel_profile` ([derived] estimate for fused GPU kernels), :func:`layer_specs` (which classes each
decoder layer holds; AttnRes is counted per mixed source) and :func:`policy_dict` (a rank's class choice
as :class:`~moonrt.memory.policy.MemoryPolicy` rules on K3's module paths, :func:`layer_class_patterns`).
The traced profiles (layers run under the activation manager) are in :mod:`moonrt.models.k3.memory_trace`.

Bytes per class are ``lin * T + const`` for ``T`` tokens of one micro-batch on one rank (``quad`` is
folded into ``lin`` at the planned sequence length: the profile is built for one layout). ``a`` is the
activation element size (2 for bf16, 4 for fp32); tensors the layers compute in fp32 (decays, KDA chunk
intermediates, attention, SiTU-GLU, softmaxes, norms) are 4 bytes whatever ``a`` is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import moonrt.ops.fp8.codec as fp8mod
from moonrt.memory.model_memory import JobLayout, LayerSpec, ParamSizes, Profile, SavedClass
from moonrt.memory.plan import RankPlan
from moonrt.models.k3.model import params as mp
from moonrt.models.k3.model.config import K3Config
from moonrt.ops.kda.terms import SUB_TILE  # the fast path's sub-tile (log-decays >= -5, K3's gate range)

CHUNK = 64
"""KDA chunk size of :func:`moonrt.ops.kda.kda_chunk` (its default)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Term:
    """One saved tensor (or family) of a class: ``per_token`` bytes, ``const`` bytes per layer instance,
    ``width`` the last dimension of the saved view (sets its FP8 size; 0 = never quantized)."""

    name: str
    per_token: float
    width: int = 0
    const: float = 0.0
    fp32: bool = False
    """Stored in fp32 (4 bytes per element) whatever the activation dtype."""


def _chunk_geometry(t: int, chunk: int = CHUNK) -> tuple[int, int, int]:
    """``(C, N, n_sub)`` of :func:`kda_chunk` for a sequence of ``t`` tokens."""
    C = min(chunk, t if t <= SUB_TILE else -(-t // SUB_TILE) * SUB_TILE)
    return C, -(-t // C), max(1, C // SUB_TILE) if C > SUB_TILE else 1


def class_terms(cfg: Any, a: int, seq_tokens: int, batch: int = 1, gathered: int | None = None,
                sdpa: str = "math") -> dict[str, list[Term]]:
    """Saved-tensor terms of each class of moonrt's K3 layers (formulas: docs/MEMORY_MODEL.md).

    Args:
        cfg: a K3 config (HF field names).
        a: activation element bytes (2 bf16, 4 fp32).
        seq_tokens: tokens of one sequence on this rank (``seq_len / cp``).
        batch: sequences per micro-batch.
        gathered: key/value length an MLA layer attends over (``seq_len`` on the last CP rank,
            the worst case); default ``seq_tokens``.
        sdpa: ``"math"`` (CPU: the ``[H, T, S]`` fp32 probabilities are saved) or ``"fused"``
            (flash / memory-efficient kernels: output and log-sum-exp; [derived], not traced).
    """
    f32 = a == 4
    t = seq_tokens
    S = gathered or t
    la = cfg.linear_attn_config
    D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
    V, HK, HV = K, H * K, H * K
    W, ks = 2 * HK + HV, la.short_conv_kernel_size
    C, N, _ = _chunk_geometry(t)
    pad = N * C / t
    per_seq = 1.0 / t  # a per-sequence quantity spread over its tokens

    kda = [
        Term("input (qkv_proj, b/f_a/g_proj)", D * a, D),
        Term("conv input [3HK, T + kernel - 1]", W * a * (1 + (ks - 1) * per_seq), 0),
        Term("conv output (SiLU input)", W * a, W), Term("q|k|v (SiLU output)", W * a, W),
        Term("q, k L2 rsqrt", 2 * H * a), Term("beta = sigmoid", 4 * H, fp32=True),
        Term("f_a output", K * a, K), Term("gate pre-sigmoid + sigmoid", 8 * HK, HK, fp32=True),
        # chunk form (moonrt.ops.kda.autograd.ChunkKDA, compute dtype fp32): it saves its chunked inputs (per
        # padded token) and the state entering each chunk, and recomputes the chunk terms in backward
        Term("q, k, g chunks", 12 * HK * pad, K, fp32=True),
        Term("v chunks", 4 * HV * pad, V, fp32=True),
        Term("beta chunks", 4 * H * pad, fp32=True),
        Term("state entering each chunk (K x V)", N * 4 * H * K * V * per_seq, V, fp32=True),
        Term("KDA output (fp32 copy)", 4 * HV * (pad if f32 else 1), V, fp32=True),
        Term("output RMSNorm rsqrt", 4 * H, fp32=True),
        Term("normed x weight (gate-mul input), gate sigmoid", 8 * HV, V, fp32=True),
        Term("o_proj input", HV * a, HV),
        Term("decay constants", 0, 0, 4 * H + 4 * HK),
    ]
    ql, kvl, rope, nope, Hm, Vm = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                                   cfg.num_attention_heads, cfg.v_head_dim)
    qk = nope + rope
    g = S / t
    mla = [
        Term("input (q_a, kv_a, g_proj)", D * a, D),
        Term("q_a RMSNorm input", ql * a, ql), Term("q_a RMSNorm reciprocal RMS", 4, fp32=True),
        Term("q_b input", ql * a, ql),
        Term("kv_a RMSNorm input (a view of the whole kv_a output)", (kvl + rope) * a, kvl),
        Term("kv_a RMSNorm reciprocal RMS", 4, fp32=True),
        Term("kv_b input (gathered latent)", (kvl + rope) * a * g, kvl + rope),
        Term("q (fp32)", 4 * Hm * qk, qk, fp32=True), Term("k (fp32, gathered)", 4 * Hm * qk * g, qk, fp32=True),
        Term("v (fp32, gathered)", 4 * Hm * ((nope + Vm) if f32 and batch == 1 else Vm) * g, Vm, fp32=True),
        Term("attention probabilities [H, T, S]" if sdpa == "math" else "attention output + lse",
             4 * Hm * S if sdpa == "math" else 4 * Hm * Vm + 4 * Hm, S if sdpa == "math" else Vm, fp32=True),
        Term("gate sigmoid, gated output", 8 * Hm * Vm, Vm, fp32=True),
        Term("o_proj input", Hm * Vm * a, Hm * Vm),
    ]
    E, k, L, F, ns, I_ = (cfg.num_experts, cfg.num_experts_per_token, cfg.routed_expert_hidden_size,
                          cfg.moe_intermediate_size, cfg.num_shared_experts, cfg.intermediate_size)
    moe = [
        Term("router input (fp32)", D * a if f32 else 4 * D, D, fp32=not f32),
        Term("router scores sigmoid [E]", 4 * E, E, fp32=True),
        Term("top-k ids, selected scores, their sum", 8 * k + 4 * k + 4),
        Term("down_proj input", 0 if f32 else D * a, D),
        Term("dispatch indices (token_index, order)", 16 * k),
        Term("expert input rows per assignment", k * L * a, L),
        Term("expert GLU output + its 2 derivative factors per assignment", 12 * k * F, F, fp32=True),
        Term("combine: row weights, expert outputs, weighted rows", 4 * k + 8 * k * L, L, fp32=True),
        Term("latent RMSNorm input", L * a, L), Term("latent RMSNorm reciprocal RMS", 4, fp32=True),
        Term("up_proj input", L * a, L),
        Term("shared experts: GLU derivative factors + down input", ns * (8 * F + F * a), F),
        Term("router weight (fp32 copy)", 0, 0, 0 if f32 else 4 * E * D),
    ]
    ffn = [Term("input", D * a, D), Term("GLU derivative factors (2 x [I])", 8 * I_, I_, fp32=True),
           Term("down_proj input", I_ * a, I_)]
    norm = [Term("input", D * a, D), Term("reciprocal RMS", 4, fp32=True)]
    attn_res = [Term("source (stacked) + RMS keys", (8 if f32 else 12) * D, D, fp32=True),
                Term("rsqrt + softmax weight", 8, fp32=True),
                Term("pseudo-query (fp32 copy, ~2 sources per mix)", 0, 0, 0 if f32 else 2 * D)]
    head = [*norm, Term("lm_head input", D * a, D), Term("targets (int64)", 8),
            Term("log-softmax of the fp32 logits", 4 * cfg.vocab_size, cfg.vocab_size, 4.0, fp32=True)]
    embed = [Term("token ids (int64)", 8)]
    return {"norm": norm, "kda.attn": kda, "mla.attn": mla, "moe": moe, "ffn": ffn, "attn_res": attn_res,
            "head": head, "embed": embed}


def attn_res_sources(cfg: Any, layer: int, which: int) -> int:
    """Sources the AttnRes mix before sub-layer ``which`` of decoder ``layer`` saves for (0 if it only
    passes its single source through): finished blocks incl. the embedding, plus the partial block."""
    S = cfg.attn_res_block_size
    n = layer // S + 1 + (1 if which == 1 or layer % S else 0)
    return 0 if n == 1 else n


def layer_specs(cfg: Any) -> tuple[tuple[LayerSpec, ...], tuple[str, ...], tuple[str, ...]]:
    """Classes of each decoder layer, of the head and of the embedding; ``attn_res`` once per source."""
    layers = []
    for i, t in enumerate(cfg.layer_types()):
        ffn = "moe" if cfg.is_moe_layer(i) else "ffn"
        res = ("attn_res",) * (attn_res_sources(cfg, i, 0) + attn_res_sources(cfg, i, 1))
        layers.append(LayerSpec(i, ("norm", f"{t}.attn", "norm", ffn, *res)))
    final = 1 + cfg.num_attn_res_blocks
    return tuple(layers), ("head",) + ("attn_res",) * (final if final > 1 else 0), ("embed",)


def _recompute_input(name: str, cfg: Any, a: int) -> float:
    """Bytes per token a checkpointed region keeps: its input (``D * a``; AttnRes sources stay resident)."""
    return {"attn_res": 0.0, "embed": 8.0}.get(name, cfg.hidden_size * a)


def analytic_profile(cfg: Any, act_bytes: int, seq_tokens: int, batch: int = 1, cp: int = 1,
                     sdpa: str = "math") -> Profile:
    """Profile of moonrt's K3 layers from the formulas of :func:`class_terms` (per token at this layout)."""
    if sdpa not in ("math", "fused"):
        raise ValueError(f"sdpa = {sdpa!r}: expected 'math' or 'fused'")
    terms = class_terms(cfg, act_bytes, seq_tokens, batch, seq_tokens * cp, sdpa)
    flops = kernel_profile(cfg, act_bytes).classes
    classes = {}
    for name, ts in terms.items():
        lin = sum(t.per_token for t in ts)
        q = sum(min(t.per_token, t.per_token / (4 if t.fp32 else act_bytes) / t.width
                    * fp8mod.stored_bytes((1, t.width))) if t.width > 0 else t.per_token for t in ts)
        const = sum(t.const for t in ts)
        f = flops.get(name)
        fl = 8.0 * cfg.hidden_size if name == "attn_res" else (f.flops_lin if f else 0.0)  # per source
        classes[name] = SavedClass(name, lin, 0.0, q, 0.0, _recompute_input(name, cfg, act_bytes), fl,
                                   f.flops_quad if f else 0.0, const, const)
    layers, head, embed = layer_specs(cfg)
    return Profile(classes, layers, head, embed)


def default_profile(cfg: Any, layout: JobLayout, sdpa: str | None = None) -> Profile:
    """:func:`analytic_profile` for a :class:`~moonrt.memory.model_memory.JobLayout`: activation bytes
    ``layout.act_bytes``, one sequence slice of ``seq_len / cp`` tokens, ``micro_batch_size`` sequences;
    attention ``sdpa`` defaults to ``"math"`` in fp32 (the CPU path) and ``"fused"`` in bf16 (GPU kernels)."""
    sdpa = sdpa or ("math" if layout.act_bytes == 4 else "fused")
    cp = layout.parallel.cp
    return analytic_profile(cfg, layout.act_bytes, layout.seq_len // cp, layout.micro_batch_size, cp, sdpa)


def param_sizes(cfg: K3Config) -> ParamSizes:
    """Per-layer parameter counts of a K3 model from the K3 parameter table (:mod:`moonrt.models.k3.model.params`):
    each decoder layer holds its KDA or MLA attention, 2 RMSNorms + 2 AttnRes pseudo-queries (``4 D``) and
    a dense GLU FFN or a LatentMoE's always-active part plus routed experts; the last stage holds the LM
    head + final norm and AttnRes query (nothing with tied embeddings)."""
    D = cfg.hidden_size
    attn = {"kda": mp.kda_params(cfg), "mla": mp.mla_params(cfg)}
    moe, ffn, expert = mp.moe_dense_params(cfg), mp.glu_params(D, cfg.intermediate_size), mp.routed_expert_params(cfg)
    types = cfg.layer_types()
    return ParamSizes(
        layers=tuple(attn[t] + 4 * D + (moe if cfg.is_moe_layer(i) else ffn) for i, t in enumerate(types)),
        expert=tuple(expert if cfg.is_moe_layer(i) else 0 for i in range(len(types))),
        embed=cfg.vocab_size * D, lm_head=0 if cfg.tie_word_embeddings else cfg.vocab_size * D + 2 * D,
        qat_layers=tuple(cfg.num_shared_experts * mp.glu_params(D, cfg.moe_intermediate_size)
                         if cfg.is_moe_layer(i) else 0 for i in range(len(types))),
        qat_experts=True)  # what moonrt.models.k3.spec.qat_weights declares: shared and routed experts


def _fp8_lin(elems: float, width: int, act_bytes: int) -> float:
    """FP8 bytes per token of ``elems`` elements per token stored in rows of ``width``."""
    rows = elems / width
    return rows * fp8mod.stored_bytes((1, width)) if act_bytes > 1 else elems * act_bytes


def kernel_profile(cfg: Any, act_bytes: int = 2, chunk: int = 64) -> Profile:
    """[derived] saved bytes of K3 layers with fused kernels (what a GPU K3 run saves).

    Per token (a = ``act_bytes``): norms save input + fp32 rstd; KDA saves the normed input, pre- and
    post-conv q|k|v, fp32 decay ``g`` and ``beta``, the gate-rank input, kernel output, output-gate and
    o_proj inputs (the kernel recomputes chunk states); MLA saves the normed input, LoRA
    intermediates, per-head q, k, v, the fp32 output + lse (flash style), gate and o_proj inputs;
    LatentMoE saves the input, fp32 router scores, latent ``z``, per routed copy the expert input,
    gate/up/activation outputs and output, the combined latent and its norm, the shared experts'
    intermediates; AttnRes saves the normed sources it mixes; the head saves its input and the
    fp32 logits. Recompute keeps the region input (``D * a``); FLOPs are 2 per multiply-add. For
    LatentMoE, ``recompute`` is the whole-layer checkpoint (a ``recompute`` rule on ``layers.i.moe``);
    the ``moe_dispatch_only`` option (routed path only, saving ``z, ids, weights``) is not a class
    policy of the planner.
    """
    a = act_bytes
    la = cfg.linear_attn_config
    D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
    HK = H * K
    Hm = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    V = cfg.v_head_dim
    L, F, k, E = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token, cfg.num_experts
    ns, I = cfg.num_shared_experts, cfg.intermediate_size

    def cls(name: str, wide: list[tuple[float, int]], fp32: float, rec: float, flops: float, fq: float = 0.0):
        lin = sum(n for n, _ in wide) * a + fp32
        lin8 = sum(_fp8_lin(n, w, a) for n, w in wide) + fp32
        return SavedClass(name, lin, 0.0, lin8, 0.0, rec, flops, fq)

    norm = cls("norm", [(D, D)], 4, D * a, 4 * D)
    kda_params = 3 * D * HK + D * H + D * K + K * HK + 2 * D * HK
    kda = cls("kda.attn", [(D, D), (3 * HK, HK), (3 * HK, HK), (K, K), (HK, HK), (HK, HK), (HK, HK)],
              HK * 4 + H * 4 + H * 4, D * a, 2 * kda_params + 2 * (2 * HK * K + 2 * chunk * HK))
    mla_params = D * cfg.q_lora_rank + cfg.q_lora_rank * Hm * qk + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) \
        + cfg.kv_lora_rank * Hm * (cfg.qk_nope_head_dim + V) + 2 * D * Hm * V
    mla = cls("mla.attn", [(D, D), (2 * cfg.q_lora_rank, cfg.q_lora_rank),
                           (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                           (cfg.kv_lora_rank, cfg.kv_lora_rank), (2 * Hm * qk, qk), (Hm * V, V), (2 * Hm * V, V)],
              Hm * V * 4 + Hm * 4 + 8, D * a, 2 * mla_params, 2 * Hm * (qk + V))  # causal: T^2/2 pairs
    moe = cls("moe", [(D, D), (L, L), (k * L, L), (k * 2 * F, F), (k * F, F), (k * L, L), (2 * L, L),
                      (ns * 3 * F, F)], E * 4 + k * 12 + 4, D * a,
              2 * (D * E + 2 * D * L + k * 3 * L * F + ns * 3 * D * F))
    ffn = cls("ffn", [(D, D), (3 * I, I)], 0, D * a, 2 * 3 * D * I)
    nsrc = max(2, cfg.num_attn_res_blocks // 2 + 1)  # average sources a sub-layer mixes [derived]
    attn_res = SavedClass("attn_res", nsrc * D * a + nsrc * 4, 0.0, nsrc * _fp8_lin(D, D, a) + nsrc * 4, 0.0,
                          0.0, 2 * 4 * nsrc * D)
    head = cls("head", [(2 * D, D)], cfg.vocab_size * 4 + 4, D * a, 2 * D * cfg.vocab_size)
    classes = {c.name: c for c in (norm, kda, mla, moe, ffn, attn_res, head)}
    layers = []
    for i, t in enumerate(cfg.layer_types()):
        ffn_cls = "moe" if cfg.is_moe_layer(i) else "ffn"
        layers.append(LayerSpec(i, ("norm", f"{t}.attn", "norm", ffn_cls, "attn_res", "attn_res")))
    return Profile(classes, tuple(layers), ("head", "attn_res"))


def layer_class_patterns(name: str, layer: int) -> list[str]:
    """Manager patterns (module paths / regions) of class ``name`` in decoder ``layer``."""
    return {
        "norm": [f"layers.{layer}.attn_norm", f"layers.{layer}.ffn_norm"],
        "kda.attn": [f"layers.{layer}.attn"],
        "mla.attn": [f"layers.{layer}.attn"],
        "moe": [f"layers.{layer}.moe"],
        "ffn": [f"layers.{layer}.ffn"],
        "attn_res": ["attn_res.sublayer_input"],
        "head": ["norm", "lm_head"],
    }[name]


def policy_dict(r: RankPlan) -> dict[str, Any]:
    """The :class:`~moonrt.memory.policy.MemoryPolicy` YAML data of one rank's choice (K3 module paths;
    an AttnRes ``recompute`` becomes the policy's ``attnres_checkpoint`` regions)."""
    rules: list[dict] = []
    attnres: list[str] = []
    for name, pol in sorted(r.choice.items()):
        if pol == "keep":
            continue
        layers = r.class_layers.get(name, r.layers)
        pats: list[str] = []
        if name in ("head", "attn_res", "embed"):
            pats = {"head": ["norm", "lm_head"], "attn_res": ["attn_res.sublayer_input"], "embed": ["embed"]}[name]
        else:
            for i in layers:
                pats += layer_class_patterns(name, i)
        if pol == "recompute" and name == "attn_res":
            attnres += ["attn_res.sublayer_input", "attn_res.final"]
        else:
            rules += [{"match": pt, "policy": pol} for pt in pats]
    out: dict[str, Any] = {"default": "keep", "rules": rules}
    if attnres:
        out["attnres_checkpoint"] = attnres
    return out


__all__ = ["Term", "analytic_profile", "attn_res_sources", "class_terms", "default_profile", "kernel_profile",
           "layer_class_patterns", "layer_specs", "param_sizes", "policy_dict"]
