"""The model registry (moonrt/models/__init__.py): how jobs get K3 and the memory planner's description of it."""

from __future__ import annotations

import dataclasses

import pytest

from moonrt import models
from moonrt.config import ConfigError, ParallelConfig
from moonrt.memory.model_memory import JobLayout, ParamSizes, Profile
from moonrt.models.k3.model.config import k3_tiny


def test_presets_resolve_to_the_k3_record():
    assert list(models.presets()) == ["k3", "k3_tiny"]
    spec, cfg = models.from_preset("k3_tiny")
    assert spec is models.MODELS["k3"] and cfg == k3_tiny()
    with pytest.raises(ValueError, match="model = 'nope': expected one of k3, k3_tiny"):
        models.from_preset("nope")


def test_a_preset_defined_twice_is_named(monkeypatch):
    twin = dataclasses.replace(models.K3, name="twin")
    monkeypatch.setitem(models.MODELS, "twin", twin)
    with pytest.raises(ValueError, match="preset 'k3': defined by both 'k3' and 'twin'"):
        models.presets()


def test_build_and_param_count_agree_on_k3_tiny():
    model = models.K3.build(k3_tiny(), None)
    assert sum(p.numel() for p in model.parameters()) == models.K3.param_count(k3_tiny())
    with pytest.raises(ConfigError, match="qb_binz: unknown key in MoEConfig"):  # options reach the model
        models.K3.build(k3_tiny(), {"qb_binz": 64})


def test_memory_description_is_the_planner_types():
    cfg = k3_tiny()
    layout = JobLayout(parallel=ParallelConfig(), seq_len=256, act_bytes=4)
    sizes = models.K3.param_sizes(cfg)
    prof = models.K3.memory_profile(cfg, layout)
    assert isinstance(sizes, ParamSizes) and isinstance(prof, Profile)
    assert len(prof.layers) == cfg.num_hidden_layers and set(prof.head) <= set(prof.classes)
