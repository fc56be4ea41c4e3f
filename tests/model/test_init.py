"""KDA decay initialization (K3_SYSTEMS §12, issue 32 item 5): the initial log-decay ``g0`` of each
``kda_dt_bias_init`` option, in the model and from a job's config.

``g0`` is the gate at zero gate input (``W_fb W_fa x = 0``): ``g_min * sigmoid(exp(A_log) * dt_bias)``, the decay the
bias alone sets. Computed in float64 so the bounds below are exact up to fp32 storage of the parameters.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonrt.config import ConfigError, from_dict, to_dict
from moonrt.models.k3.model.config import K3Config, k3_tiny
from moonrt.models.k3.model.kda_layer import KDALayer
from moonrt.models.k3.model.model import K3Model

F32_STORE = 4 * torch.finfo(torch.float32).eps
"""Relative error of ``g0`` from storing ``A_log`` and ``dt_bias`` in fp32 (a few roundings through exp, logit)."""


def _config(option: str | None = None, gate_lower_bound: float | None = None) -> K3Config:
    cfg = k3_tiny()
    if gate_lower_bound is not None:
        cfg = dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(
            cfg.linear_attn_config, gate_lower_bound=gate_lower_bound))
    return cfg if option is None else dataclasses.replace(cfg, kda_dt_bias_init=option)


def initial_decay(layer: KDALayer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g0 [H*K], A [H*K])`` in float64: the gate of a zero gate input, and each channel's ``exp(A_log)``."""
    A = layer.A_log.detach().double().exp().repeat_interleave(layer.head_dim)
    g0 = layer.gate_lower_bound * torch.sigmoid(A * layer.dt_bias.detach().double())
    with torch.no_grad():  # the layer's own gate on x = 0 gives the same
        torch.testing.assert_close(layer.double().gate(torch.zeros(1, 1, layer.hidden_size, dtype=torch.float64))
                                   .reshape(-1), g0, rtol=0, atol=0)
    return g0, A


def test_default_is_kimi_linear_decay_minus_A_dt() -> None:
    """Default (``kimi_linear``): ``g0 = -A dt`` with ``dt ~ logU(1e-3, 1e-1)``: ``dt = -g0 / A`` lies in
    [1e-3, 1e-1] for every channel and spreads over that range; so ``g0`` in [-1.6, -0.001]."""
    assert k3_tiny().kda_dt_bias_init == "kimi_linear"
    torch.manual_seed(0)
    g0, A = initial_decay(KDALayer(_config()))
    dt = -g0 / A
    assert dt.min() >= 1e-3 * (1 - F32_STORE) and dt.max() <= 1e-1 * (1 + F32_STORE), (dt.min(), dt.max())
    assert dt.min() < 2e-3 and dt.max() > 5e-2  # 192 log-uniform draws cover the range (seeded)
    assert g0.min() >= -1.6 * (1 + F32_STORE) and g0.max() <= -1e-3 * (1 - F32_STORE)


def test_kimi_linear_decay_is_clamped_inside_a_tight_bound() -> None:
    """With ``g_min = -1`` some ``-A dt`` fall below the bound: those channels start at ``0.9 g_min``."""
    torch.manual_seed(0)
    g0, A = initial_decay(KDALayer(_config(gate_lower_bound=-1.0)))
    assert g0.min() >= -0.9 * (1 + F32_STORE) and g0.max() < 0
    assert (g0 < -0.9 * (1 - F32_STORE)).sum() > 0  # the clamp is hit (seeded)


def test_zero_option_starts_every_channel_at_half_the_bound() -> None:
    """``zero``: ``dt_bias = 0`` exactly, so ``g0 = g_min * sigmoid(0) = g_min / 2`` (-2.5 for K3) in every channel,
    whatever ``A``; the other parameters are drawn as under the default (same random stream)."""
    torch.manual_seed(0)
    layer = KDALayer(_config("zero"))
    assert torch.equal(layer.dt_bias, torch.zeros_like(layer.dt_bias))
    g0, _ = initial_decay(layer)
    assert torch.equal(g0, torch.full_like(g0, -2.5))
    torch.manual_seed(0)
    default = KDALayer(_config())
    for (name, p), q in zip(layer.named_parameters(), default.parameters(), strict=True):
        assert name == "dt_bias" or torch.equal(p, q.double()), name


@pytest.mark.parametrize("option", ["kimi_linear", "zero"])
def test_model_and_job_config_use_the_option(option: str) -> None:
    """Every KDA layer of a K3Model follows the option, and a job's ``model_config`` mapping sets it."""
    cfg = from_dict(K3Config, {**to_dict(_config()), "kda_dt_bias_init": option})
    torch.manual_seed(0)
    model = K3Model(cfg)
    layers = [layer.attn for layer in model.layers if isinstance(layer.attn, KDALayer)]
    assert len(layers) == 6
    for layer in layers:
        g0, _ = initial_decay(layer)
        if option == "zero":
            assert (g0 == -2.5).all()
        else:
            assert g0.min() >= -1.6 * (1 + F32_STORE) and g0.max() <= -1e-3 * (1 - F32_STORE)


def test_bad_option_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"kda_dt_bias_init"):
        from_dict(K3Config, {**to_dict(_config()), "kda_dt_bias_init": "fla"})
    with pytest.raises(ValueError, match=r"^kda_dt_bias_init = 'fla': expected one of"):
        KDALayer(dataclasses.replace(_config(), kda_dt_bias_init="fla"))
