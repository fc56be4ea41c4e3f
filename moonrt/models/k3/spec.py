"""K3's registry record (:data:`K3`, a :class:`~moonrt.models.spec.ModelSpec`): config, presets, build, parameter
count, pipeline layout, LatentMoE options, expert sizes and the memory description (:mod:`moonrt.models.k3.memory`,
:mod:`moonrt.models.k3.memory_trace`).

The functions import torch and the layer modules lazily, so looking K3 up (``moonrt mem-plan`` with the analytic
profile, ``moonrt pp-plan``, a job's config check) stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moonrt.models.k3.model.config import PRESETS, K3Config
from moonrt.models.spec import ModelMemory, ModelSpec

if TYPE_CHECKING:  # types only: the functions below import lazily
    from moonrt.memory.model_memory import JobLayout, ParamSizes, Profile
    from moonrt.memory.plan import RankPlan
    from moonrt.models.k3.model.config import MoEConfig
    from moonrt.models.k3.model.model import K3Model


def _build(cfg: K3Config, options: Mapping[str, Any] | None = None) -> K3Model:
    from moonrt.models.k3.model.model import K3Model

    return K3Model(cfg, _read_options(options))


def _read_options(options: Mapping[str, Any] | None) -> MoEConfig:
    """The job's ``moe:`` mapping -> :class:`~moonrt.models.k3.model.config.MoEConfig` (None: its defaults)."""
    from moonrt.models.k3.model.config import moe_config_from_dict

    return moe_config_from_dict(dict(options) if options is not None else None)


def _param_count(cfg: K3Config) -> int:
    from moonrt.models.k3.model.params import count_params

    return count_params(cfg).total


def _flops_per_token(cfg: K3Config, seq_len: int) -> int:
    from moonrt.models.k3.model.params import flops_per_token

    return flops_per_token(cfg, seq_len)


def _expert_sizes(cfg: K3Config, dtype: str) -> dict[str, int]:
    from moonrt.scheduler.workload import expert_sizes

    return expert_sizes(cfg, dtype)


def _param_sizes(cfg: K3Config) -> ParamSizes:
    from moonrt.models.k3.memory import param_sizes

    return param_sizes(cfg)


def _memory_profile(cfg: K3Config, layout: JobLayout, sdpa: str | None = None) -> Profile:
    from moonrt.models.k3.memory import default_profile

    return default_profile(cfg, layout, sdpa)


def _traced_memory_profile(*args: Any, **kwargs: Any) -> Profile:  # Any: forwarded unchanged (lazy import)
    from moonrt.models.k3.memory_trace import traced_profile_by_kind

    return traced_profile_by_kind(*args, **kwargs)


def _memory_policy(rank_plan: RankPlan) -> dict[str, Any]:
    from moonrt.models.k3.memory import policy_dict

    return policy_dict(rank_plan)


def qat_weights(cfg: K3Config) -> dict[str, tuple[int, ...]]:
    """The weights K3's quantization-aware training fake-quantizes to MXFP4 (and the export packs): in every
    LatentMoE layer the routed experts' ``w_gate [E, F, L]``, ``w_up [E, F, L]``, ``w_down [E, L, F]`` and each
    shared expert's ``gate_proj / up_proj [F, D]``, ``down_proj [D, F]`` (``F = moe_intermediate_size``).

    The release ships the routed experts in MXFP4 (K3_SYSTEMS §1; 98% of the parameters); the shared experts run
    the same GLU GEMMs on every token and are quantized too, so a deployment may run every expert GEMM in MXFP4
    (issue 33). Attention, the latent down/up projections, the router (its top-k choice is sensitive to small
    logit changes), the dense first-layer FFN, embedding and LM head stay in high precision, as released."""
    E, L, D, F = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.hidden_size, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"layers.{i}.moe."
        out.update({p + "experts.w_gate": (E, F, L), p + "experts.w_up": (E, F, L), p + "experts.w_down": (E, L, F)})
        for j in range(cfg.num_shared_experts):
            q = f"{p}shared_experts.{j}."
            out.update({q + "gate_proj.weight": (F, D), q + "up_proj.weight": (F, D), q + "down_proj.weight": (D, F)})
    return out


K3: ModelSpec[K3Config] = ModelSpec(
    name="k3", config_type=K3Config, presets=PRESETS, build=_build, param_count=_param_count,
    pipeline_layout=K3Config.pipeline_layout, describe=lambda cfg: f"pattern {cfg.pattern}",
    read_options=_read_options, expert_sizes=_expert_sizes, flops_per_token=_flops_per_token,
    memory=ModelMemory(param_sizes=_param_sizes, memory_profile=_memory_profile,
                       traced_memory_profile=_traced_memory_profile, memory_policy=_memory_policy),
    qat_weights=qat_weights, train_dtype={"k3": "bf16", "k3_tiny": "fp32"}, qat_block={"k3": 32, "k3_tiny": 8})
"""K3 trains in bf16 (the released weights and the target GPUs); ``k3_tiny`` in fp32, as ``moonrt train`` runs it.
K3 quantizes in the OCP MX spec's blocks of 32 (its reduction axes 3072, 3584 and 7168 are multiples); ``k3_tiny``'s
are its expert FFN width 56, latent 64 and hidden 128 (its recorded figures, benchmarks/RESULTS.md, are of those
widths), whose largest common even divisor is 8: its MX block is 8 (E2M1 codes, E8M0 scales, as the spec, with a
smaller block)."""

__all__ = ["K3", "qat_weights"]
