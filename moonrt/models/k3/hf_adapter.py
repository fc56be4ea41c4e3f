"""State-dict adapter between moonrt's K3 and the released Kimi K3 Hugging Face layout (issue 32 item 1).

:func:`to_hf` maps a ``K3Model.state_dict()`` to the released tensor names and shapes, :func:`from_hf` maps them
back, strictly: a missing or unexpected key, or a shape that is not the config's, is an error naming it. Both
are pure tensor reshuffles (splits, concatenations, unsqueezes, a multiplication by exactly one), so
moonrt -> released -> moonrt is bitwise. :func:`released_shapes` lists every released name with its shape as a
function of the config alone (the full K3 without allocating anything).

Released names (text weights; ``P`` = ``model.layers.{l}``, ``l`` 0-indexed; the multimodal release prefixes every
text key with ``language_model.`` and also holds ``vision_tower.*`` / ``mm_projector.*`` tensors, which
:func:`from_hf` skips and reports). H, K = KDA heads and head dim, W = short conv kernel, D = hidden size,
L = routed_expert_hidden_size, F = moe_intermediate_size, S = num_shared_experts:

================================================  ===========================================  ==================
released name                                     moonrt                                       how
================================================  ===========================================  ==================
``model.embed_tokens.weight``                     ``embed.weight``                             same
``model.norm.weight`` / ``lm_head.weight``        ``norm.weight`` / ``lm_head.weight``         same
``model.output_attn_res_proj.weight [1, D]``      ``attn_res.final_query [D]``                 unsqueeze
``model.output_attn_res_norm.weight [D]``         (folded into the query)                      written as ones
``P.self_attention_res_proj.weight [1, D]``       ``attn_res.queries[2l]``                     unsqueeze
``P.self_attention_res_norm.weight [D]``          (folded)                                     ones
``P.mlp_res_proj.weight`` / ``P.mlp_res_norm``    ``attn_res.queries[2l + 1]`` (folded norm)   as above
``P.input_layernorm.weight``                      ``layers.l.attn_norm.weight``                same
``P.post_attention_layernorm.weight``             ``layers.l.ffn_norm.weight``                 same
``P.self_attn.{q,k,v}_proj.weight [HK, D]``       ``layers.l.attn.qkv_proj.weight``            row split q|k|v
``P.self_attn.{q,k,v}_conv1d.weight [HK, 1, W]``  ``layers.l.attn.conv_weight [3HK, W]``       split, unsqueeze
``P.self_attn.{f_a,f_b,b,g,o}_proj.weight``       ``layers.l.attn.*`` (KDA)                    same
``P.self_attn.A_log [H]``, ``dt_bias [HK]``       ``layers.l.attn.A_log``, ``dt_bias``         same
``P.self_attn.o_norm.weight [K]``                 ``layers.l.attn.o_norm_weight``              same
``P.self_attn.{q_a,q_b,kv_b,g,o}_proj.weight``    ``layers.l.attn.*`` (MLA)                    same
``P.self_attn.kv_a_proj_with_mqa.weight``         ``layers.l.attn.kv_a_proj.weight``           same
``P.self_attn.{q_a,kv_a}_layernorm.weight``       ``layers.l.attn.{q_a,kv_a}_norm.weight``     same
``P.mlp.{gate,up,down}_proj.weight``              ``layers.l.ffn.*`` (dense layers)            same
``P.block_sparse_moe.gate.weight``                ``layers.l.moe.router.weight``               same
``P.block_sparse_moe.gate.e_score_correction_bias``  ``layers.l.moe.router.bias`` (buffer)     same
``P.block_sparse_moe.routed_expert_down_proj``    ``layers.l.moe.down_proj`` (D -> L)          same
``P.block_sparse_moe.routed_expert_up_proj``      ``layers.l.moe.up_proj`` (L -> D)            same
``P.block_sparse_moe.routed_expert_norm.weight``  ``layers.l.moe.norm.weight``                 same
``P.block_sparse_moe.experts.{e}.w1 / w3 [F, L]`` ``layers.l.moe.experts.w_gate / w_up [E,F,L]``  index / stack
``P.block_sparse_moe.experts.{e}.w2 [L, F]``      ``layers.l.moe.experts.w_down [E, L, F]``    index / stack
``P.block_sparse_moe.shared_experts.gate_proj``   ``layers.l.moe.shared_experts.{j}.gate_proj``  concat rows
  (and ``up_proj``) ``[S F, D]``                                                                 (j order)
``P.block_sparse_moe.shared_experts.down_proj``   ``layers.l.moe.shared_experts.{j}.down_proj``  concat columns
  ``[D, S F]``
================================================  ===========================================  ==================

Block AttnRes: the release scores a source ``v`` as ``proj . (norm * v / rms(v))`` with a key-norm weight per
query; moonrt keeps one pseudo-query ``q = proj * norm`` (the product is all the score sees, K3_SYSTEMS §4), so
:func:`to_hf` writes ``proj = q`` with ``norm = 1`` and :func:`from_hf` folds ``q = proj * norm`` (exact for the
ones written here). The release counts these 2 * num_hidden_layers + 1 norms as parameters (K3: 187 * 7168 =
1,340,416 more than moonrt). Layer 0's ``self_attention_res_*`` pair is a placeholder in both: its sub-layer
has one source (the embedding), so no query is read (moonrt keeps ``queries[0]`` for the same reason).

KDA's ``A_log`` is one value per head ``[H]`` (what the released modeling code allocates and reads); public
readers of the released checkpoint describe its stored ``A_log`` as a longer zero-padded buffer of which only the
first H entries are read, so :func:`from_hf` also accepts ``[P]``, ``P > H``, when entries ``H:`` are all zero
(anything else there is a shape error); the public Kimi Linear readers hold it as ``[1, 1, H, 1]`` (broadcast over
``[B, T, H, K]``), which :func:`from_hf` accepts too (any shape whose only dimension above 1 is the per-head one:
:func:`a_log_heads`); :func:`to_hf` writes ``[H]``.

Packed MXFP4 experts (the release's routed experts): ``<name>.weight_packed`` (uint8 ``[rows, cols / 2]``, two
E2M1 codes a byte, element ``2j`` in the low nibble) and ``<name>.weight_scale`` (uint8 E8M0 ``[rows, cols /
block]``, ``2^(s - 127)``) in place of ``<name>.weight``; :func:`from_hf` decodes them (:func:`decode_mxfp4`) in
fp32, :func:`pack_mxfp4` writes them with :mod:`moonrt.ops.mx` (the codec QAT's forward uses).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

import torch

from moonrt.models.k3.model.config import K3Config
from moonrt.ops import mx

MULTIMODAL_PREFIX = "language_model."
"""The multimodal release's prefix of every text key (``language_model.model.layers...``,
``language_model.lm_head.weight``)."""
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
"""Keys of the multimodal release that moonrt's text model has no use for (skipped by :func:`from_hf`)."""

PACKED, SCALE = "_packed", "_scale"

RELEASED_KEY_PATTERNS: tuple[str, ...] = (
    "lm_head.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.output_attn_res_norm.weight",
    "model.output_attn_res_proj.weight",
    "model.layers.N.input_layernorm.weight",
    "model.layers.N.post_attention_layernorm.weight",
    "model.layers.N.self_attention_res_norm.weight",
    "model.layers.N.self_attention_res_proj.weight",
    "model.layers.N.mlp_res_norm.weight",
    "model.layers.N.mlp_res_proj.weight",
    # KDA
    "model.layers.N.self_attn.q_proj.weight",
    "model.layers.N.self_attn.k_proj.weight",
    "model.layers.N.self_attn.v_proj.weight",
    "model.layers.N.self_attn.q_conv1d.weight",
    "model.layers.N.self_attn.k_conv1d.weight",
    "model.layers.N.self_attn.v_conv1d.weight",
    "model.layers.N.self_attn.f_a_proj.weight",
    "model.layers.N.self_attn.f_b_proj.weight",
    "model.layers.N.self_attn.A_log",
    "model.layers.N.self_attn.dt_bias",
    "model.layers.N.self_attn.b_proj.weight",
    "model.layers.N.self_attn.g_proj.weight",  # KDA and MLA
    "model.layers.N.self_attn.o_norm.weight",
    "model.layers.N.self_attn.o_proj.weight",  # KDA and MLA
    # MLA
    "model.layers.N.self_attn.q_a_proj.weight",
    "model.layers.N.self_attn.q_a_layernorm.weight",
    "model.layers.N.self_attn.q_b_proj.weight",
    "model.layers.N.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.N.self_attn.kv_a_layernorm.weight",
    "model.layers.N.self_attn.kv_b_proj.weight",
    # dense FFN
    "model.layers.N.mlp.gate_proj.weight",
    "model.layers.N.mlp.up_proj.weight",
    "model.layers.N.mlp.down_proj.weight",
    # LatentMoE
    "model.layers.N.block_sparse_moe.gate.weight",
    "model.layers.N.block_sparse_moe.gate.e_score_correction_bias",
    "model.layers.N.block_sparse_moe.routed_expert_down_proj.weight",
    "model.layers.N.block_sparse_moe.routed_expert_norm.weight",
    "model.layers.N.block_sparse_moe.routed_expert_up_proj.weight",
    "model.layers.N.block_sparse_moe.shared_experts.gate_proj.weight",
    "model.layers.N.block_sparse_moe.shared_experts.up_proj.weight",
    "model.layers.N.block_sparse_moe.shared_experts.down_proj.weight",
    "model.layers.N.block_sparse_moe.experts.E.w1.weight",
    "model.layers.N.block_sparse_moe.experts.E.w2.weight",
    "model.layers.N.block_sparse_moe.experts.E.w3.weight",
)
"""The 45 text-key patterns of the release (``N`` a layer, ``E`` an expert; packed experts replace ``.weight`` by
``.weight_packed`` + ``.weight_scale``)."""

RELEASE_FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
"""Released tensors stored in F32 (every other text tensor is BF16, the routed experts MXFP4)."""

ROUTED_EXPERT = re.compile(r"(?:.*\.)?model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight")
"""The tensors the release packs in MXFP4 (its ``quantization_config`` scope: routed experts only)."""


def key_pattern(name: str) -> str:
    """A released key with its layer and expert numbers replaced by ``N`` and ``E`` (``RELEASED_KEY_PATTERNS``)."""
    name = re.sub(r"\.layers\.\d+\.", ".layers.N.", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", name)


# ---- shapes from the config ----------------------------------------------------------------------------------
def released_shapes(cfg: K3Config) -> dict[str, tuple[int, ...]]:
    """Every released text tensor (no prefix, experts unpacked) -> its shape, from ``cfg`` alone, in file order."""
    D, lac = cfg.hidden_size, cfg.linear_attn_config
    H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    L, F, E, S = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_shared_experts
    hn, hr, hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    nh = cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i, kind in enumerate(cfg.layer_types()):
        p = f"model.layers.{i}."
        out |= {p + "self_attention_res_norm.weight": (D,), p + "self_attention_res_proj.weight": (1, D),
                p + "input_layernorm.weight": (D,)}
        a = p + "self_attn."
        if kind == "kda":
            for x in "qkv":
                out |= {a + f"{x}_proj.weight": (H * K, D), a + f"{x}_conv1d.weight": (H * K, 1, W)}
            out |= {a + "f_a_proj.weight": (K, D), a + "f_b_proj.weight": (H * K, K), a + "A_log": (H,),
                    a + "dt_bias": (H * K,), a + "b_proj.weight": (H, D), a + "g_proj.weight": (H * K, D),
                    a + "o_norm.weight": (K,), a + "o_proj.weight": (D, H * K)}
        else:
            out |= {a + "q_a_proj.weight": (cfg.q_lora_rank, D), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                    a + "q_b_proj.weight": (nh * (hn + hr), cfg.q_lora_rank),
                    a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + hr, D),
                    a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                    a + "kv_b_proj.weight": (nh * (hn + hv), cfg.kv_lora_rank)}
            if cfg.mla_use_output_gate:
                out[a + "g_proj.weight"] = (nh * hv, D)
            out[a + "o_proj.weight"] = (D, nh * hv)
        out |= {p + "mlp_res_norm.weight": (D,), p + "mlp_res_proj.weight": (1, D),
                p + "post_attention_layernorm.weight": (D,)}
        if not cfg.is_moe_layer(i):
            I = cfg.intermediate_size  # noqa: E741
            out |= {p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                    p + "mlp.down_proj.weight": (D, I)}
            continue
        m = p + "block_sparse_moe."
        out |= {m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                m + "routed_expert_down_proj.weight": (L, D)}
        if cfg.latent_moe_use_norm:
            out[m + "routed_expert_norm.weight"] = (L,)
        out[m + "routed_expert_up_proj.weight"] = (D, L)
        if S:
            out |= {m + "shared_experts.gate_proj.weight": (S * F, D), m + "shared_experts.up_proj.weight": (S * F, D),
                    m + "shared_experts.down_proj.weight": (D, S * F)}
        for e in range(E):
            x = f"{m}experts.{e}."
            out |= {x + "w1.weight": (F, L), x + "w2.weight": (L, F), x + "w3.weight": (F, L)}
    out |= {"model.output_attn_res_norm.weight": (D,), "model.output_attn_res_proj.weight": (1, D),
            "model.norm.weight": (D,), "lm_head.weight": (cfg.vocab_size, D)}
    return out


def released_count(cfg: K3Config) -> int:
    """How many tensors :func:`released_shapes` lists for ``cfg`` (experts unpacked), counted without listing the
    routed experts (``3 * num_experts`` per MoE layer): a bound checked before any per-tensor structure is made."""
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    one = dataclasses.replace(cfg, num_experts=0)  # no validation on replace: the shapes of the rest
    return len(released_shapes(one)) + 3 * n_moe * cfg.num_experts


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""safetensors dtypes a released weight may have (the release: BF16 and F32); read into moonrt's fp32 model."""
PACKED_DTYPE = "U8"
"""safetensors dtype of an MXFP4 pair (``weight_packed`` codes and ``weight_scale`` E8M0 scales)."""


class LayoutError(ValueError):
    """A released tensor set that does not match the config (:func:`check_layout`); ``key`` is the tensor named
    (None: a key that is absent)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def a_log_heads(shape: tuple[int, ...]) -> int | None:
    """The per-head length of a stored KDA ``A_log`` of ``shape``: ``[P]`` and the Kimi Linear readers'
    ``[1, 1, P, 1]`` (any shape with one dimension above 1, or all 1) give ``P``; None: not a per-head vector."""
    big = [n for n in shape if n != 1]
    if not shape or len(big) > 1:
        return None
    return big[0] if big else 1


def check_layout(meta: Mapping[str, tuple[str, tuple[int, ...]]], cfg: K3Config, prefix: str = "") -> None:
    """Check the headers ``meta`` (name -> (safetensors dtype, shape); vision keys dropped, :func:`split_prefix`)
    against the released layout of ``cfg`` before any tensor is read: every name of :func:`released_shapes`
    (``prefix``-ed) present as a float tensor (:data:`FLOAT_DTYPES`) of its shape, or as an MXFP4 ``_packed`` /
    ``_scale`` pair (uint8, ``[..., n / 2]`` and ``[..., n / block]`` with ``block`` dividing ``n``), and no other
    name. :class:`LayoutError` naming the first key that does not match (the same wording as :func:`from_hf`)."""
    want = released_shapes(cfg)
    if stray := sorted(k for k in meta if not k.startswith(prefix)):
        raise LayoutError(f"unexpected key {stray[0]!r} ({len(stray)} keys without the prefix {prefix!r})", stray[0])
    seen: set[str] = set()
    for k, shape in want.items():
        name = prefix + k
        if name in meta:
            seen.add(name)
            dtype, got = meta[name]
            if dtype not in FLOAT_DTYPES:
                raise LayoutError(f"{name}: dtype {dtype}: expected a floating-point weight ({', '.join(FLOAT_DTYPES)}"
                                  "; the release stores BF16 and F32); not converted", name)
            heads = a_log_heads(got) if k.endswith(".self_attn.A_log") else None
            padded = heads is not None and heads >= shape[0]  # [P >= H] or [1, 1, P, 1]: see from_hf
            if got != shape and not padded:
                raise LayoutError(f"{name}: shape {got}: expected {shape} (from the config)", name)
            continue
        packed, scale = name + PACKED, name + SCALE
        if packed not in meta and scale not in meta:
            missing = sum(prefix + m not in meta and prefix + m + PACKED not in meta for m in want)
            raise LayoutError(f"missing key {name!r} ({missing} released keys of this config missing)")
        for part in (packed, scale):
            if part not in meta:
                other = scale if part == packed else packed
                raise LayoutError(f"{other!r}: no {part!r} (an MXFP4 weight needs both)", other)
            if meta[part][0] != PACKED_DTYPE:
                raise LayoutError(f"{part}: dtype {meta[part][0]}: expected {PACKED_DTYPE} (packed MXFP4)", part)
        seen |= {packed, scale}
        (_, p), (_, q) = meta[packed], meta[scale]
        n = shape[-1]
        if n % 2 or p != (*shape[:-1], n // 2):
            raise LayoutError(f"{packed}: shape {p}: expected {(*shape[:-1], n // 2)} (two MXFP4 codes a byte of "
                              f"{shape})", packed)
        if len(q) != len(shape) or q[:-1] != shape[:-1] or q[-1] < 1 or n % q[-1]:
            raise LayoutError(f"{scale}: shape {q}: expected {(*shape[:-1], 'n / block')} with the block dividing "
                              f"{n} (scales of {shape})", scale)
    if extra := sorted(set(meta) - seen):
        raise LayoutError(f"unexpected key {extra[0]!r} ({len(extra)} keys this config does not have)", extra[0])


# ---- moonrt -> released --------------------------------------------------------------------------------------
_SAME_KDA = {"f_a_proj.weight": "f_a_proj.weight", "f_b_proj.weight": "f_b_proj.weight", "A_log": "A_log",
             "dt_bias": "dt_bias", "b_proj.weight": "b_proj.weight", "g_proj.weight": "g_proj.weight",
             "o_norm_weight": "o_norm.weight", "o_proj.weight": "o_proj.weight"}
_SAME_MLA = {"q_a_proj.weight": "q_a_proj.weight", "q_a_norm.weight": "q_a_layernorm.weight",
             "q_b_proj.weight": "q_b_proj.weight", "kv_a_proj.weight": "kv_a_proj_with_mqa.weight",
             "kv_a_norm.weight": "kv_a_layernorm.weight", "kv_b_proj.weight": "kv_b_proj.weight",
             "g_proj.weight": "g_proj.weight", "o_proj.weight": "o_proj.weight"}
_SAME_MOE = {"router.weight": "gate.weight", "router.bias": "gate.e_score_correction_bias",
             "down_proj.weight": "routed_expert_down_proj.weight", "norm.weight": "routed_expert_norm.weight",
             "up_proj.weight": "routed_expert_up_proj.weight"}
_EXPERT_W = (("w_gate", "w1"), ("w_down", "w2"), ("w_up", "w3"))
_GLU = ("gate_proj", "up_proj", "down_proj")


def _ones(like: torch.Tensor) -> torch.Tensor:
    return torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)


def to_hf(state: Mapping[str, torch.Tensor], cfg: K3Config, prefix: str = "") -> dict[str, torch.Tensor]:
    """The released tensors (names prefixed by ``prefix``: ``""`` text-only, :data:`MULTIMODAL_PREFIX` the
    multimodal layout) of a moonrt ``K3Model.state_dict()`` ``state`` for config ``cfg``, experts unpacked, in
    the dtypes of ``state``. KeyError naming a moonrt tensor ``state`` lacks; every tensor of ``state`` is used
    (ValueError naming any left over)."""
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"moonrt state dict: no {name!r} (expected a K3Model.state_dict() of this config)")
        used.add(name)
        return state[name]

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": get("embed.weight")}
    q = get("attn_res.queries")
    H, K = cfg.linear_attn_config.num_heads, cfg.linear_attn_config.head_dim
    for i, kind in enumerate(cfg.layer_types()):
        p, s = f"model.layers.{i}.", f"layers.{i}."
        out |= {p + "self_attention_res_norm.weight": _ones(q), p + "self_attention_res_proj.weight": q[2 * i][None],
                p + "input_layernorm.weight": get(s + "attn_norm.weight")}
        a = p + "self_attn."
        if kind == "kda":
            qkv, conv = get(s + "attn.qkv_proj.weight"), get(s + "attn.conv_weight")
            for j, x in enumerate("qkv"):
                rows = slice(j * H * K, (j + 1) * H * K)
                out |= {a + f"{x}_proj.weight": qkv[rows], a + f"{x}_conv1d.weight": conv[rows].unsqueeze(1)}
            out |= {a + hf: get(s + "attn." + mine) for mine, hf in _SAME_KDA.items()}
        else:
            out |= {a + hf: get(s + "attn." + mine) for mine, hf in _SAME_MLA.items()
                    if mine != "g_proj.weight" or cfg.mla_use_output_gate}
        out |= {p + "mlp_res_norm.weight": _ones(q), p + "mlp_res_proj.weight": q[2 * i + 1][None],
                p + "post_attention_layernorm.weight": get(s + "ffn_norm.weight")}
        if not cfg.is_moe_layer(i):
            out |= {p + f"mlp.{w}.weight": get(s + f"ffn.{w}.weight") for w in _GLU}
            continue
        m, sm = p + "block_sparse_moe.", s + "moe."
        out |= {m + hf: get(sm + mine) for mine, hf in _SAME_MOE.items()
                if mine != "norm.weight" or cfg.latent_moe_use_norm}
        if cfg.num_shared_experts:
            parts = {w: [get(f"{sm}shared_experts.{j}.{w}.weight") for j in range(cfg.num_shared_experts)]
                     for w in _GLU}
            out |= {m + "shared_experts.gate_proj.weight": torch.cat(parts["gate_proj"], 0),
                    m + "shared_experts.up_proj.weight": torch.cat(parts["up_proj"], 0),
                    m + "shared_experts.down_proj.weight": torch.cat(parts["down_proj"], 1)}
        stacked = {hf: get(f"{sm}experts.{mine}") for mine, hf in _EXPERT_W}
        for e in range(cfg.num_experts):
            out |= {f"{m}experts.{e}.{hf}.weight": w[e] for hf, w in stacked.items()}
    out |= {"model.output_attn_res_norm.weight": _ones(q),
            "model.output_attn_res_proj.weight": get("attn_res.final_query")[None],
            "model.norm.weight": get("norm.weight"), "lm_head.weight": get("lm_head.weight")}
    if left := sorted(set(state) - used):
        raise ValueError(f"moonrt state dict: {left[0]!r} has no released name ({len(left)} such tensors); expected "
                         "a K3Model.state_dict() of this config")
    order = released_shapes(cfg)
    return {prefix + k: out[k].contiguous() for k in order}


# ---- MXFP4 ---------------------------------------------------------------------------------------------------
def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """fp32 ``[rows, cols]`` from ``packed`` uint8 ``[rows, cols / 2]`` and E8M0 ``scales`` uint8 ``[rows, cols /
    block]`` (module docstring); ValueError naming ``name`` for dtypes or shapes that do not pair."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: weight_packed {packed.dtype} / weight_scale {scales.dtype}: expected uint8 both")
    cols = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] == 0 or cols % scales.shape[-1]:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scales.shape)}: "
                         "expected [..., n / 2] and [..., n / block] with block dividing n")
    shape = torch.Size([*packed.shape[:-1], cols])
    return mx.MXQuantized(packed, scales, "mxfp4", len(shape) - 1, cols // scales.shape[-1], shape).dequantize(
        torch.float32)


def pack_mxfp4(tensors: Mapping[str, torch.Tensor], block: int = 32, scale_mode: str = "floor"
               ) -> dict[str, torch.Tensor]:
    """``tensors`` with every routed expert (:data:`ROUTED_EXPERT`) replaced by its ``weight_packed`` /
    ``weight_scale`` pair (blocks of ``block`` along the last axis, :func:`moonrt.ops.mx.quantize`; the values
    QAT's forward decodes with the same ``block`` and ``scale_mode``), in the same order."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not ROUTED_EXPERT.fullmatch(name):
            out[name] = t
            continue
        if t.shape[-1] % block:
            raise ValueError(f"{name}: {t.shape[-1]} columns: expected a multiple of the MXFP4 block {block}")
        q = mx.quantize(t, "mxfp4", axis=-1, block=block, scale_mode=scale_mode)
        out[name + PACKED], out[name + SCALE] = q.codes, q.scales
    return out


def release_dtypes(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in the dtypes the release stores: F32 for :data:`RELEASE_FP32_SUFFIXES`, BF16 for every other
    floating tensor (packed MXFP4 pairs, uint8, unchanged)."""
    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return t.to(torch.float32 if name.endswith(RELEASE_FP32_SUFFIXES) else torch.bfloat16)

    return {k: cast(k, v) for k, v in tensors.items()}


# ---- released -> moonrt --------------------------------------------------------------------------------------
def split_prefix(names: Iterable[str]) -> tuple[str, list[str]]:
    """``(prefix, skipped)``: the text-key prefix of a released key set (``""`` or :data:`MULTIMODAL_PREFIX`) and
    its vision keys (:data:`VISION_PREFIXES`), which moonrt's text model skips."""
    names = list(names)
    prefix = MULTIMODAL_PREFIX if any(n.startswith(MULTIMODAL_PREFIX) for n in names) else ""
    return prefix, sorted(n for n in names if n.startswith(VISION_PREFIXES))


def unpack(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every ``<name>_packed`` / ``<name>_scale`` pair decoded into ``<name>`` (fp32); ValueError
    naming a packed tensor without its scale (or the reverse)."""
    out = {k: v for k, v in tensors.items() if not k.endswith((PACKED, SCALE))}
    for k in tensors:
        if k.endswith(PACKED):
            base = k[: -len(PACKED)]
            if base + SCALE not in tensors:
                raise ValueError(f"{k!r}: no {base + SCALE!r} (an MXFP4 weight needs both)")
            out[base] = decode_mxfp4(tensors[k], tensors[base + SCALE], base)
        elif k.endswith(SCALE) and k[: -len(SCALE)] + PACKED not in tensors:
            raise ValueError(f"{k!r}: no {k[: -len(SCALE)] + PACKED!r} (an MXFP4 weight needs both)")
    return out


def from_hf(tensors: Mapping[str, torch.Tensor], cfg: K3Config, prefix: str = "") -> dict[str, torch.Tensor]:
    """A moonrt ``K3Model.state_dict()`` from released tensors (text keys prefixed by ``prefix``; vision keys
    must have been dropped, :func:`split_prefix`; packed experts decoded, :func:`unpack`). Strict: ValueError
    naming the first missing key, unexpected key or wrong shape (expected: :func:`released_shapes` of ``cfg``)."""
    want = released_shapes(cfg)
    have = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if stray := sorted(k for k in tensors if not k.startswith(prefix)):
        raise ValueError(f"unexpected key {stray[0]!r} ({len(stray)} keys without the prefix {prefix!r})")
    if missing := [k for k in want if k not in have]:
        raise ValueError(f"missing key {prefix + missing[0]!r} ({len(missing)} released keys of this config missing)")
    if extra := sorted(set(have) - set(want)):
        raise ValueError(f"unexpected key {prefix + extra[0]!r} ({len(extra)} keys this config does not have)")
    for k, shape in want.items():
        t = have[k]
        stored = tuple(t.shape)
        if k.endswith(".self_attn.A_log") and t.dim() != 1 and a_log_heads(stored) is not None:
            t = have[k] = t.reshape(-1)  # the Kimi Linear readers' [1, 1, H, 1] (module docstring)
        if k.endswith(".self_attn.A_log") and t.dim() == 1 and t.shape[0] > shape[0] and not t[shape[0]:].any():
            have[k] = t[: shape[0]]  # a zero-padded per-head buffer (module docstring): the first H entries are read
        elif tuple(t.shape) != shape:
            raise ValueError(f"{prefix + k}: shape {stored}: expected {shape} (from the config)")

    def fold(p: str) -> torch.Tensor:  # the AttnRes pair -> moonrt's pseudo-query proj * norm
        proj, norm = have[p + "_proj.weight"][0], have[p + "_norm.weight"]
        dt = torch.promote_types(torch.promote_types(proj.dtype, norm.dtype), torch.float32)
        return proj.to(dt) * norm.to(dt)

    out: dict[str, torch.Tensor] = {"embed.weight": have["model.embed_tokens.weight"]}
    queries = []
    for i, kind in enumerate(cfg.layer_types()):
        p, s = f"model.layers.{i}.", f"layers.{i}."
        queries += [fold(p + "self_attention_res"), fold(p + "mlp_res")]
        out |= {s + "attn_norm.weight": have[p + "input_layernorm.weight"],
                s + "ffn_norm.weight": have[p + "post_attention_layernorm.weight"]}
        a = p + "self_attn."
        if kind == "kda":
            out[s + "attn.qkv_proj.weight"] = torch.cat([have[a + f"{x}_proj.weight"] for x in "qkv"], 0)
            out[s + "attn.conv_weight"] = torch.cat([have[a + f"{x}_conv1d.weight"][:, 0] for x in "qkv"], 0)
            out |= {s + "attn." + mine: have[a + hf] for mine, hf in _SAME_KDA.items()}
        else:
            out |= {s + "attn." + mine: have[a + hf] for mine, hf in _SAME_MLA.items() if a + hf in have}
        if not cfg.is_moe_layer(i):
            out |= {s + f"ffn.{w}.weight": have[p + f"mlp.{w}.weight"] for w in _GLU}
            continue
        m, sm = p + "block_sparse_moe.", s + "moe."
        out |= {sm + mine: have[m + hf] for mine, hf in _SAME_MOE.items() if m + hf in have}
        F, S = cfg.moe_intermediate_size, cfg.num_shared_experts
        for w in _GLU:
            if S:
                parts = have[f"{m}shared_experts.{w}.weight"].split(F, dim=1 if w == "down_proj" else 0)
                out |= {f"{sm}shared_experts.{j}.{w}.weight": parts[j] for j in range(S)}
        for mine, hf in _EXPERT_W:
            out[f"{sm}experts.{mine}"] = torch.stack([have[f"{m}experts.{e}.{hf}.weight"]
                                                      for e in range(cfg.num_experts)])
    out["attn_res.queries"] = torch.stack(queries)
    out["attn_res.final_query"] = fold("model.output_attn_res")
    out |= {"norm.weight": have["model.norm.weight"], "lm_head.weight": have["lm_head.weight"]}
    return {k: v.contiguous() for k, v in out.items()}


__all__ = ["FLOAT_DTYPES", "MULTIMODAL_PREFIX", "PACKED_DTYPE", "RELEASED_KEY_PATTERNS", "RELEASE_FP32_SUFFIXES",
           "ROUTED_EXPERT", "VISION_PREFIXES", "LayoutError", "a_log_heads", "check_layout", "decode_mxfp4", "from_hf",
           "key_pattern",
           "pack_mxfp4", "release_dtypes", "released_count", "released_shapes", "split_prefix", "to_hf", "unpack"]
