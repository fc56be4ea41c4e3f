"""The dense baseline's registry record (:data:`DENSE`, a :class:`~moonrt.models.spec.ModelSpec`): config, presets,
build, parameter count, pipeline layout and model FLOPs per token. No MoE options, no routed experts, no memory
description (``moonrt mem-plan`` refuses it with a clear error; ``moonrt train`` does not need one).

The build imports torch and the layers lazily, so looking the family up stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from moonrt.models.dense.model.config import PRESETS, DenseConfig
from moonrt.models.spec import ModelSpec

if TYPE_CHECKING:  # types only: the build imports lazily
    from moonrt.models.dense.model.model import DenseModel


def _build(cfg: DenseConfig, options: Mapping[str, Any] | None = None) -> DenseModel:
    from moonrt.models.dense.model.model import DenseModel

    return DenseModel(cfg)  # options: always None (read_options is None: the job refuses a non-null moe:)


def _param_count(cfg: DenseConfig) -> int:
    from moonrt.models.dense.model.params import count_params

    return count_params(cfg).total


def _flops_per_token(cfg: DenseConfig, seq_len: int) -> int:
    from moonrt.models.dense.model.params import flops_per_token

    return flops_per_token(cfg, seq_len)


def _describe(cfg: DenseConfig) -> str:
    pos = "NoPE" if cfg.rope_theta is None else "rotary"
    return f"dense, {cfg.num_hidden_layers} layers x {cfg.num_attention_heads} heads, {pos}"


DENSE: ModelSpec[DenseConfig] = ModelSpec(
    name="dense", config_type=DenseConfig, presets=PRESETS, build=_build, param_count=_param_count,
    pipeline_layout=DenseConfig.pipeline_layout, describe=_describe,
    flops_per_token=_flops_per_token)
"""The dense baseline (softmax attention + SwiGLU), trained in fp32 like ``k3_tiny``."""

__all__ = ["DENSE"]
