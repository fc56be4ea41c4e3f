"""Model registry of the job layer: how a job gets a model client and what the runtime needs to know about it.

A :class:`ModelSpec` (like torchtitan's ``ModelSpec``) is one record per model family: its config presets,
its build function, its parameter counts, and the memory description the planner takes instead of
importing the model (:class:`~moonrt.memory.model_memory.ParamSizes` per part, a per-layer
:class:`~moonrt.memory.model_memory.Profile` of saved activations, and how a planned class choice maps
to the model's module paths in a memory policy). Jobs look the model up here (``moonrt mem-plan``
does, and ``moonrt train`` through :func:`moonrt.jobs.train.assemble.build_model`); the runtime never imports ``moonrt.models.k3.model``
(docs/ARCHITECTURE.md §1). Parallelizing needs no entry: the parallel parts reach the model through
the seams and the small duck-typed surface described there (``moe_layers()``, the stage API).

The K3 record's functions import torch and the layer modules lazily, so ``moonrt mem-plan`` with the
analytic profile stays light.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from moonrt.models.k3.model.config import PRESETS as K3_PRESETS


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a job needs to build a model family and to plan its memory.

    Callables take the family's config object (``cfg``); the memory planner reads that config only
    through the structural fields it documents (``num_hidden_layers``, ``num_experts``,
    ``num_experts_per_token``, ``hidden_size``, ``routed_expert_hidden_size``).
    """

    name: str
    presets: Mapping[str, Callable[[], Any]]
    """Preset name -> config factory (``moonrt mem-plan --model``, ``moonrt train --model``)."""
    build: Callable[[Any, Mapping[str, Any] | None], Any]
    """``build(cfg, options)`` -> a single-device ``nn.Module`` (``options``: the job's model options, e.g.
    K3's ``moe`` mapping; None for the defaults)."""
    param_count: Callable[[Any], int]
    """Total parameters of ``build(cfg)`` computed from the config alone (no instantiation)."""
    param_sizes: Callable[[Any], Any]
    """``cfg`` -> :class:`~moonrt.memory.model_memory.ParamSizes` (parameters per decoder layer, embedding, head)."""
    memory_profile: Callable[..., Any]
    """``(cfg, layout, sdpa=None)`` -> analytic :class:`~moonrt.memory.model_memory.Profile` at a
    :class:`~moonrt.memory.model_memory.JobLayout` (``sdpa``: ``"math"`` / ``"fused"``, None: by dtype)."""
    traced_memory_profile: Callable[..., Any]
    """``(cfg, dtype, seq_tokens, batch, cp, probe_tokens, max_experts)`` -> a Profile measured by running each
    layer kind under the activation manager."""
    memory_policy: Callable[[Any], dict]
    """A :class:`~moonrt.memory.plan.RankPlan` -> the :class:`~moonrt.memory.policy.MemoryPolicy` YAML data
    of its class choice, as rules on the model's module paths."""
    train_dtype: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Preset name -> the dtype (``"bf16"`` / ``"fp32"``) its parameters and activations are trained in, what a
    memory plan assumes unless told otherwise (``moonrt mem-plan --dtype``); a preset not listed: ``"fp32"``."""


def _k3_build(cfg: Any, options: Mapping[str, Any] | None = None) -> Any:
    from moonrt.models.k3.model.model import K3Model
    from moonrt.models.k3.model.moe import moe_config_from_dict

    return K3Model(cfg, moe_config_from_dict(dict(options) if options is not None else None))


def _k3_param_count(cfg: Any) -> int:
    from moonrt.models.k3.model.params import count_params

    return count_params(cfg).total


def _k3_param_sizes(cfg: Any) -> Any:
    from moonrt.models.k3.memory import param_sizes

    return param_sizes(cfg)


def _k3_memory_profile(cfg: Any, layout: Any, sdpa: str | None = None) -> Any:
    from moonrt.models.k3.memory import default_profile

    return default_profile(cfg, layout, sdpa)


def _k3_traced_memory_profile(*args: Any, **kwargs: Any) -> Any:
    from moonrt.models.k3.memory_trace import traced_profile_by_kind

    return traced_profile_by_kind(*args, **kwargs)


def _k3_memory_policy(rank_plan: Any) -> dict:
    from moonrt.models.k3.memory import policy_dict

    return policy_dict(rank_plan)


K3 = ModelSpec(name="k3", presets=K3_PRESETS, build=_k3_build, param_count=_k3_param_count,
               param_sizes=_k3_param_sizes, memory_profile=_k3_memory_profile,
               traced_memory_profile=_k3_traced_memory_profile, memory_policy=_k3_memory_policy,
               train_dtype={"k3": "bf16", "k3_tiny": "fp32"})
"""K3 trains in bf16 (the released weights and the target GPUs); ``k3_tiny`` in fp32, as ``moonrt train`` runs it."""

MODELS: dict[str, ModelSpec] = {"k3": K3}
"""Every registered model family by name."""


def presets() -> dict[str, ModelSpec]:
    """Every preset name of every registered family -> its :class:`ModelSpec` (registry order)."""
    out: dict[str, ModelSpec] = {}
    for spec in MODELS.values():
        for name in spec.presets:
            if name in out:
                raise ValueError(f"preset {name!r}: defined by both {out[name].name!r} and {spec.name!r}")
            out[name] = spec
    return out


def from_preset(name: str) -> tuple[ModelSpec, Any]:
    """The :class:`ModelSpec` defining preset ``name`` and the preset's config; ValueError naming the presets."""
    table = presets()
    if name not in table:
        raise ValueError(f"model = {name!r}: expected one of {', '.join(table)}")
    spec = table[name]
    return spec, spec.presets[name]()


__all__ = ["K3", "MODELS", "ModelSpec", "from_preset", "presets"]
