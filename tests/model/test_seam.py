"""K3Model is a :class:`moonrt.parallel.model.TrainableModel`: every member the runtime calls, with the meaning the
protocol documents (the pipeline layout from the config, the stage run equal to the whole-model loss)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model
from moonrt.parallel.model import (
    MAX_LAYERS,
    NoMoE,
    ParamGroups,
    PipelineLayout,
    Stream,
    TrainableModel,
    default_param_groups,
    missing_members,
    protocol_members,
)


@pytest.fixture(scope="module")
def model() -> K3Model:
    torch.manual_seed(0)
    return K3Model(k3_tiny())


def test_k3_model_satisfies_the_protocol(model):
    assert isinstance(model, TrainableModel)
    members = protocol_members()
    assert set(members) == {"loss_sum", "pipeline_layout", "stages", "stage_modules", "stream", "embed_tokens",
                            "run_layers", "head", "moe_layers", "update_routing_bias", "routing_counts",
                            "set_record_routing", "param_groups"}
    assert missing_members(model) == []
    for name in members:  # the model accepts every argument the protocol passes, by the same names
        proto = inspect.signature(getattr(TrainableModel, name)).parameters
        mine = inspect.signature(getattr(model, name)).parameters
        assert [p for p in proto if p != "self"] == list(mine)[:len(proto) - 1], name


def test_a_module_missing_members_is_not_a_trainable_model():
    assert not isinstance(nn.Linear(2, 2), TrainableModel)
    assert "loss_sum" in missing_members(nn.Linear(2, 2))


def test_pipeline_layout_is_the_configs(model):
    cfg = model.config
    assert model.pipeline_layout() == PipelineLayout(num_layers=cfg.num_hidden_layers, width=cfg.hidden_size,
                                                     block_size=cfg.attn_res_block_size, tied_embeddings=False)
    with pytest.raises(ValueError, match=r"PipelineLayout.num_layers = 4097: expected at most 4096"):
        PipelineLayout(num_layers=MAX_LAYERS + 1, width=8, block_size=1)
    with pytest.raises(ValueError, match=r"PipelineLayout.width = 0: expected an integer >= 1"):
        PipelineLayout(num_layers=2, width=0, block_size=1)


def test_stage_run_through_streams_equals_loss_sum(model):
    """Two stages, the stream rebuilt at the boundary from its blocks and partial (what a pipeline hop carries):
    the same loss as the whole model, to fp32 rounding."""
    torch.manual_seed(1)
    cfg = model.config
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    y = torch.randint(0, cfg.vocab_size, (2, 16))
    model.set_record_routing(False)
    with torch.no_grad():
        whole = model.loss_sum(x, y)
        first, second = model.stages(2)
        state = model.run_layers(model.embed_tokens(x), first)
        assert isinstance(state, Stream)
        hop = model.stream([b.clone() for b in state.blocks], None if state.partial is None else state.partial.clone())
        logits = model.head(model.run_layers(hop, second))
        staged = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
    model.set_record_routing(True)
    torch.testing.assert_close(staged, whole, rtol=1e-6, atol=1e-4)
    covered = [n for r in (first, second) for n in model.stage_modules(r, r is first, r is second)]
    assert {n.split(".")[0] for n, _ in model.named_parameters()} <= {n.split(".")[0] for n in covered}


def test_param_groups_and_moe_defaults(model):
    groups = model.param_groups()
    assert groups == ParamGroups(no_weight_decay=("embed",)) == default_param_groups(model)
    assert not groups.decays("embed.weight", 2) and groups.decays("lm_head.weight", 2)
    assert not groups.decays("norm.weight", 1) and groups.decays("embedder.weight", 2)
    assert [i for i, _ in model.moe_layers()] == [i for i in range(model.config.num_hidden_layers)
                                                   if model.config.is_moe_layer(i)]
    plain = NoMoE()
    assert plain.moe_layers() == [] and plain.update_routing_bias() == {} and plain.routing_counts() == {}
    assert plain.set_record_routing(False) is None
