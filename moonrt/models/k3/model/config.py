"""K3 model configuration, with the field names of the released HF ``config.json`` (K3_SYSTEMS §1).

Two presets: :func:`k3` (the real 2.8T model; used for parameter counting and memory planning,
never instantiated) and :func:`k3_tiny` (a few million parameters with K3's structure and ratios,
trainable on 2 CPU cores). Layer indices in ``linear_attn_config.full_attn_layers`` are 1-indexed
as in the HF file; everything else in moonrt uses 0-indexed layers (:meth:`K3Config.layer_types`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from moonrt.config import check, from_dict
from moonrt.parallel.model import MAX_LAYERS, PipelineLayout  # MAX_LAYERS bounds num_hidden_layers

DT_BIAS_INITS = ("kimi_linear", "zero")
"""The values of :attr:`K3Config.kda_dt_bias_init`."""


def _positive_finite(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, name, value,
              "a finite number > 0")


@dataclasses.dataclass(kw_only=True, slots=True)
class LinearAttnConfig:
    """KDA layers (HF ``linear_attn_config``)."""

    full_attn_layers: list[int]
    """1-indexed layers that are gated MLA; all others are KDA."""
    num_heads: int
    head_dim: int
    """K = V = head_dim per head."""
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True

    def validate(self) -> None:
        check(self.num_heads >= 1, "num_heads", self.num_heads, "an integer >= 1")
        check(self.head_dim >= 1, "head_dim", self.head_dim, "an integer >= 1")
        check(self.short_conv_kernel_size >= 1, "short_conv_kernel_size", self.short_conv_kernel_size,
              "an integer >= 1")
        check(math.isfinite(self.gate_lower_bound) and self.gate_lower_bound < 0, "gate_lower_bound",
              self.gate_lower_bound, "a finite negative number")
        check(len(set(self.full_attn_layers)) == len(self.full_attn_layers), "full_attn_layers",
              self.full_attn_layers, "distinct layer numbers")


@dataclasses.dataclass(kw_only=True, slots=True)
class K3Config:
    """The K3 decoder (HF ``text_config`` field names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    linear_attn_config: LinearAttnConfig
    # gated MLA with NoPE
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # FFN / Stable LatentMoE
    first_k_dense_replace: int = 1
    intermediate_size: int
    """FFN width of the dense layers (the first ``first_k_dense_replace`` layers)."""
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int = 2
    moe_intermediate_size: int
    """FFN width of each routed expert (in the latent space) and of each full-width shared expert."""
    routed_expert_hidden_size: int
    """Latent width of the routed experts (K3: 0.5 * hidden_size)."""
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    hidden_act: Literal["situ", "silu"] = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Block AttnRes, misc
    attn_res_block_size: int
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    kda_dt_bias_init: Literal["kimi_linear", "zero"] = "kimi_linear"
    """moonrt's own field (not in the released ``config.json``): how KDA's ``dt_bias`` starts (K3_SYSTEMS §12; the
    report does not say). ``kimi_linear``: solved so the initial decay is Kimi Linear's ``-A dt``, ``dt ~
    logU(1e-3, 1e-1)`` (``g0`` in [-1.6, -0.001]); ``zero``: ``dt_bias = 0``, ``g0 = gate_lower_bound / 2``."""

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
                     "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                     "attn_res_block_size"):
            value = getattr(self, name)
            check(value >= 1, name, value, "an integer >= 1")
        check(self.num_hidden_layers <= MAX_LAYERS, "num_hidden_layers", self.num_hidden_layers,
              f"an integer <= {MAX_LAYERS} (MAX_LAYERS)")
        check(self.max_position_embeddings >= 1, "max_position_embeddings", self.max_position_embeddings,
              "an integer >= 1")
        _positive_finite(self, ("routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta",
                                "rms_norm_eps", "initializer_range"))
        check(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", self.qk_rope_head_dim, "an integer >= 0")
        check(self.num_shared_experts >= 0, "num_shared_experts", self.num_shared_experts, "an integer >= 0")
        check(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
              self.first_k_dense_replace, f"0 <= value <= num_hidden_layers ({self.num_hidden_layers})")
        check(self.num_experts_per_token + 1 <= self.num_experts, "num_experts_per_token",
              self.num_experts_per_token, f"k + 1 <= num_experts ({self.num_experts}) for Quantile Balancing")
        bad = [i for i in self.linear_attn_config.full_attn_layers if not 1 <= i <= self.num_hidden_layers]
        check(not bad, "linear_attn_config.full_attn_layers", self.linear_attn_config.full_attn_layers,
              f"1-indexed layer numbers in [1, {self.num_hidden_layers}]")
        check(self.mla_use_nope, "mla_use_nope", self.mla_use_nope, "true (K3 MLA carries no rotary)")
        check(self.kda_dt_bias_init in DT_BIAS_INITS, "kda_dt_bias_init", self.kda_dt_bias_init,
              f"one of {', '.join(DT_BIAS_INITS)}")

    # ---- derived structure -------------------------------------------------------------------
    def layer_types(self) -> list[str]:
        """``"kda"`` or ``"mla"`` for each 0-indexed layer."""
        full = set(self.linear_attn_config.full_attn_layers)
        return ["mla" if i + 1 in full else "kda" for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, layer: int) -> bool:
        """Layers ``[0, first_k_dense_replace)`` have a dense FFN; all others are LatentMoE."""
        return layer >= self.first_k_dense_replace

    @property
    def pattern(self) -> str:
        """Layer pattern as a string, one letter per layer: K (KDA) or M (MLA)."""
        return "".join("M" if t == "mla" else "K" for t in self.layer_types())

    def pipeline_layout(self) -> PipelineLayout:
        """The layer stack as the pipeline sees it: ``num_hidden_layers`` layers, streams of ``hidden_size``, AttnRes
        blocks of ``attn_res_block_size`` layers, ``tie_word_embeddings``."""
        return PipelineLayout(num_layers=self.num_hidden_layers, width=self.hidden_size,
                              block_size=self.attn_res_block_size, tied_embeddings=self.tie_word_embeddings)

    @property
    def num_attn_res_blocks(self) -> int:
        """Number of AttnRes blocks (the last one may be partial)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)


def full_attn_layers(num_layers: int, every: int = 4) -> list[int]:
    """1-indexed MLA layers of the 3:1 pattern with a forced final MLA layer."""
    layers = list(range(every, num_layers + 1, every))
    if not layers or layers[-1] != num_layers:
        layers.append(num_layers)
    return layers


def k3() -> K3Config:
    """The released Kimi K3 configuration (2.78T total, ~104B active). Never instantiate it."""
    return K3Config(
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=93,
        linear_attn_config=LinearAttnConfig(
            full_attn_layers=full_attn_layers(93), num_heads=96, head_dim=128,
            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        ),
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        intermediate_size=33792,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        attn_res_block_size=12,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-5,
    )


def k3_tiny() -> K3Config:
    """A few-million-parameter K3 with the real structure (K3_SYSTEMS §1, "scaled test configuration").

    9 layers = KKKM KKKM M (3:1 with a forced final MLA), AttnRes blocks of 4 -> two full blocks
    and a 1-layer partial block; KDA H*K = 192 != D = 128; latent = D/2; expert FFN 56 ~ 6/7 of
    the latent; MLA nope:rope:v = 2:1:2; 16 experts (divisible by EP 2 and 4), top-2.
    """
    return K3Config(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=9,
        linear_attn_config=LinearAttnConfig(
            full_attn_layers=full_attn_layers(9), num_heads=4, head_dim=48,
            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True,
        ),
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        intermediate_size=608,
        num_experts=16,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=56,
        routed_expert_hidden_size=64,
        attn_res_block_size=4,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-5,
    )


PRESETS = {"k3": k3, "k3_tiny": k3_tiny}


@dataclasses.dataclass(kw_only=True, slots=True)
class MoEConfig:
    """LatentMoE options that are not part of the HF model config (job config key ``moe``)."""

    qb_enabled: bool = True
    """Record routing statistics in training forwards and let :meth:`LatentMoE.update_bias` set the bias."""
    qb_estimator: Literal["histogram", "exact"] = "histogram"
    """Quantile estimator: per-expert margin histogram (practical, all-reducible) or exact sort (one rank only)."""
    qb_bins: int = 512
    qb_min: float = -1.0
    """Lower edge of the margin histogram (margins below are clamped into the first bin)."""
    qb_max: float = 1.0
    """Upper edge of the margin histogram (margins above are clamped into the last bin)."""

    def validate(self) -> None:
        check(self.qb_bins >= 1, "qb_bins", self.qb_bins, "an integer >= 1")
        check(self.qb_min < self.qb_max, "qb_min", self.qb_min, f"a number < qb_max ({self.qb_max})")


def moe_config_from_dict(data: dict[str, Any] | None) -> MoEConfig:
    """Build a checked :class:`MoEConfig` from plain data (``None`` -> defaults); raises ConfigError."""
    return from_dict(MoEConfig, data or {})
