"""Parameter counts from the config (K3_SYSTEMS §1): exact for k3_tiny, 2.78T / ~104.2B for k3."""

from __future__ import annotations

import dataclasses

import pytest

from moonrt.models.k3.model.config import k3, k3_tiny
from moonrt.models.k3.model.params import count_params, kda_params, mla_params, routed_expert_params


def test_k3_totals_match_the_report() -> None:
    c = count_params(k3())
    assert c.total == pytest.approx(2.78e12, rel=0.01)
    assert c.active == pytest.approx(104.2e9, rel=0.01)
    assert sum(c.by_part.values()) == c.total
    # routed experts dominate the total; only k/E of them are active
    assert c.by_part["moe_routed_experts"] / c.total > 0.97


def test_k3_tiny_count_equals_instantiated_model() -> None:
    from moonrt.models.k3.model.model import K3Model

    for cfg in (k3_tiny(), dataclasses.replace(k3_tiny(), tie_word_embeddings=True, first_k_dense_replace=2)):
        model = K3Model(cfg)
        counts = count_params(cfg)
        assert counts.total == sum(p.numel() for p in model.parameters())
        assert counts.by_part["kda_attention"] == sum(
            p.numel() for layer in model.layers if layer.kind == "kda" for p in layer.attn.parameters())
        assert counts.by_part["mla_attention"] == sum(
            p.numel() for layer in model.layers if layer.kind == "mla" for p in layer.attn.parameters())


def test_active_definition() -> None:
    c = k3_tiny()
    counts = count_params(c)
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    inactive = n_moe * (c.num_experts - c.num_experts_per_token) * routed_expert_params(c)
    assert counts.total - counts.active == inactive + c.vocab_size * c.hidden_size
    assert kda_params(c) > 0 and mla_params(c) > 0
