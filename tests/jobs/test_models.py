"""The model registry (moonrt/models/__init__.py) and its records (moonrt/models/spec.py, moonrt/models/k3/spec.py):
how jobs get K3, read its config and options, and the memory planner's description of it."""

from __future__ import annotations

import dataclasses

import pytest

from moonrt import models
from moonrt.config import ConfigError, ParallelConfig, from_dict, to_dict
from moonrt.jobs.train.config import JobConfig
from moonrt.memory.model_memory import JobLayout, ParamSizes, Profile
from moonrt.models.k3.model.config import K3Config, k3_tiny
from moonrt.models.k3.spec import K3
from moonrt.models.spec import ModelSpec
from moonrt.parallel.model import PipelineLayout


def test_presets_resolve_to_their_family_record():
    from moonrt.models.dense.model.config import dense_tiny
    from moonrt.models.dense.spec import DENSE

    assert list(models.presets()) == ["k3", "k3_tiny", "dense_tiny"]
    assert models.families() == {"k3": K3, "dense": DENSE} and models.family("k3") is K3
    spec, cfg = models.from_preset("k3_tiny")
    assert spec is K3 and cfg == k3_tiny()
    spec, cfg = models.from_preset("dense_tiny")
    assert spec is DENSE and cfg == dense_tiny()
    with pytest.raises(ValueError, match="model = 'nope': expected one of k3, k3_tiny, dense_tiny"):
        models.from_preset("nope")
    with pytest.raises(ValueError, match="model family 'nope': expected one of k3, dense"):
        models.family("nope")


def test_a_preset_defined_twice_is_named(monkeypatch):
    twin = dataclasses.replace(K3, name="twin")
    monkeypatch.setitem(models.MODELS, "twin", lambda: twin)
    with pytest.raises(ValueError, match="preset 'k3': defined by both 'k3' and 'twin'"):
        models.presets()


def test_a_record_under_another_name_is_named(monkeypatch):
    monkeypatch.setitem(models.MODELS, "other", lambda: K3)
    with pytest.raises(ValueError, match=r"MODELS\['other'\]: its spec is named 'k3'; expected 'other'"):
        models.families()


def test_build_and_param_count_agree_on_k3_tiny():
    model = K3.build(k3_tiny(), None)
    assert sum(p.numel() for p in model.parameters()) == K3.param_count(k3_tiny())
    assert K3.pipeline_layout(k3_tiny()) == model.pipeline_layout()
    assert isinstance(K3.pipeline_layout(k3_tiny()), PipelineLayout)
    with pytest.raises(ConfigError, match="qb_binz: unknown key in MoEConfig"):  # options reach the model
        K3.build(k3_tiny(), {"qb_binz": 64})


def test_config_and_options_are_read_through_the_spec():
    assert K3.config_type is K3Config and K3.config_from_dict(to_dict(k3_tiny())) == k3_tiny()
    with pytest.raises(ConfigError, match="hidden_sise: unknown key in K3Config"):
        K3.config_from_dict({**to_dict(k3_tiny()), "hidden_sise": 8})
    assert K3.options_from_dict(None) == K3.options_from_dict({})
    assert K3.expert_sizes(k3_tiny(), "fp32")["bytes_per_elem"] == 4
    bare = dataclasses.replace(K3, name="bare", read_options=None, memory=None, expert_sizes=None)
    assert bare.options_from_dict(None) is None
    with pytest.raises(ConfigError, match=r"moe = \{'qb_bins': 8\}: expected null \(model family 'bare' takes no"):
        bare.options_from_dict({"qb_bins": 8})
    with pytest.raises(ValueError, match="model family 'bare' has no memory description"):
        bare.memory_description()


def test_job_model_config_resolves_through_the_spec_and_round_trips():
    data = to_dict(k3_tiny())
    data["vocab_size"] = 1024
    job = from_dict(JobConfig, {"model_config": data})
    assert isinstance(job.model_config, K3Config) and job.model_cfg().vocab_size == 1024
    assert job.model_spec() is K3
    again = from_dict(JobConfig, to_dict(job))  # config.yaml of a run, or a checkpoint's stored config
    assert to_dict(again) == to_dict(job) and again.model_cfg() == job.model_cfg()
    want = r"^model = 'gpt9': expected a registered model preset: one of k3, k3_tiny, dense_tiny"
    with pytest.raises(ConfigError, match=want):
        from_dict(JobConfig, {"model": "gpt9"})
    with pytest.raises(ConfigError, match=r"^model_config = 3: expected a mapping of K3Config fields"):
        from_dict(JobConfig, {"model_config": 3})
    with pytest.raises(ConfigError, match=r"^model_config.hidden_size = 0: expected"):
        from_dict(JobConfig, {"model_config": {**to_dict(k3_tiny()), "hidden_size": 0}})
    with pytest.raises(ConfigError, match=r"^moe.qb_binz: unknown key in MoEConfig"):
        from_dict(JobConfig, {"moe": {"qb_binz": 3}})


def test_memory_description_is_the_planner_types():
    cfg = k3_tiny()
    layout = JobLayout(parallel=ParallelConfig(), seq_len=256, act_bytes=4)
    memory = K3.memory_description()
    sizes = memory.param_sizes(cfg)
    prof = memory.memory_profile(cfg, layout)
    assert isinstance(K3, ModelSpec) and isinstance(sizes, ParamSizes) and isinstance(prof, Profile)
    assert len(prof.layers) == cfg.num_hidden_layers and set(prof.head) <= set(prof.classes)


def test_quantizable_is_the_model_of_a_family_with_quantizable_layers():
    """``ModelSpec.quantizable``: the typed view ``--qat`` and the MXFP4 export switch QAT on through; a family that
    declares no quantizable layers (dense) is refused with one line naming it."""
    from moonrt.models.dense.model.config import dense_tiny
    from moonrt.models.dense.spec import DENSE
    from moonrt.ops.qat import scheme_for

    cfg = k3_tiny()
    model = K3.build(cfg, None)
    names = K3.quantizable(model).enable_qat(scheme_for("mxfp4", 8))
    assert sorted(names) == sorted(K3.qat_weights(cfg))
    with pytest.raises(ValueError, match=r"model family 'dense': declares no quantizable layers"):
        DENSE.quantizable(DENSE.build(dense_tiny(), None))
