"""The released Kimi K3 Hugging Face layout (issue 32): pinned key patterns and config fields, bitwise round trips
moonrt -> released -> moonrt, the full K3's names and shapes on the meta device, strict import errors."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moonrt.config import ConfigError
from moonrt.models.k3 import hf_adapter, hf_config
from moonrt.models.k3.model.config import LinearAttnConfig, k3, k3_tiny
from moonrt.models.k3.model.model import K3Model
from moonrt.models.k3.model.params import count_params
from tests.model.k3_release_fixture import release_names_and_shapes, release_tensors, text_config_of

# The release's 45 text-key patterns (N: layer, E: expert), written out here from the published layout.
PINNED_PATTERNS = sorted("""
lm_head.weight
model.embed_tokens.weight
model.norm.weight
model.output_attn_res_norm.weight
model.output_attn_res_proj.weight
model.layers.N.input_layernorm.weight
model.layers.N.post_attention_layernorm.weight
model.layers.N.self_attention_res_norm.weight
model.layers.N.self_attention_res_proj.weight
model.layers.N.mlp_res_norm.weight
model.layers.N.mlp_res_proj.weight
model.layers.N.self_attn.q_proj.weight
model.layers.N.self_attn.k_proj.weight
model.layers.N.self_attn.v_proj.weight
model.layers.N.self_attn.q_conv1d.weight
model.layers.N.self_attn.k_conv1d.weight
model.layers.N.self_attn.v_conv1d.weight
model.layers.N.self_attn.f_a_proj.weight
model.layers.N.self_attn.f_b_proj.weight
model.layers.N.self_attn.A_log
model.layers.N.self_attn.dt_bias
model.layers.N.self_attn.b_proj.weight
model.layers.N.self_attn.g_proj.weight
model.layers.N.self_attn.o_norm.weight
model.layers.N.self_attn.o_proj.weight
model.layers.N.self_attn.q_a_proj.weight
model.layers.N.self_attn.q_a_layernorm.weight
model.layers.N.self_attn.q_b_proj.weight
model.layers.N.self_attn.kv_a_proj_with_mqa.weight
model.layers.N.self_attn.kv_a_layernorm.weight
model.layers.N.self_attn.kv_b_proj.weight
model.layers.N.mlp.gate_proj.weight
model.layers.N.mlp.up_proj.weight
model.layers.N.mlp.down_proj.weight
model.layers.N.block_sparse_moe.gate.weight
model.layers.N.block_sparse_moe.gate.e_score_correction_bias
model.layers.N.block_sparse_moe.routed_expert_down_proj.weight
model.layers.N.block_sparse_moe.routed_expert_norm.weight
model.layers.N.block_sparse_moe.routed_expert_up_proj.weight
model.layers.N.block_sparse_moe.shared_experts.gate_proj.weight
model.layers.N.block_sparse_moe.shared_experts.up_proj.weight
model.layers.N.block_sparse_moe.shared_experts.down_proj.weight
model.layers.N.block_sparse_moe.experts.E.w1.weight
model.layers.N.block_sparse_moe.experts.E.w2.weight
model.layers.N.block_sparse_moe.experts.E.w3.weight
""".split())

# The released text_config values of K3 (config.json, the fields named in issue 32 and K3_SYSTEMS §1).
K3_RELEASED = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96,
    "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
    "first_k_dense_replace": 1, "intermediate_size": 33792, "num_experts": 896, "num_experts_per_token": 16,
    "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True, "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.02,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "full_attn_layers": [*range(4, 93, 4), 93], "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True},
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "dynamic": False, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8", "strategy": "group",
            "symmetric": True, "type": "float"}, "input_activations": None, "output_activations": None}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]},
}
K3_TOTAL, K3_ACTIVE, K3_RES_NORMS = 2_779_483_053_152, 104_188_189_792, 1_340_416


def k3_few() -> object:
    """K3-shaped with few layers and experts: KKKM M (forced final MLA), dense layer 0, AttnRes blocks of 2 (a
    partial last block), three shared experts, H*K != D, latent = D/2."""
    return dataclasses.replace(
        k3(), vocab_size=96, hidden_size=64, num_hidden_layers=5,
        linear_attn_config=LinearAttnConfig(full_attn_layers=[4, 5], num_heads=2, head_dim=24),
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate_size=96, num_experts=4, num_experts_per_token=2, num_shared_experts=3,
        moe_intermediate_size=24, routed_expert_hidden_size=32, attn_res_block_size=2)


def pattern(name: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"\.layers\.\d+\.", ".layers.N.", name))


def randomized(model: K3Model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in model.state_dict().values():  # nonzero queries and biases too
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model.state_dict()


def test_released_key_patterns_and_shapes_are_pinned():
    assert len(PINNED_PATTERNS) == 45 and sorted(hf_adapter.RELEASED_KEY_PATTERNS) == PINNED_PATTERNS
    for cfg in (k3_tiny(), k3_few()):
        out = hf_adapter.to_hf(K3Model(cfg).state_dict(), cfg)
        assert sorted({pattern(k) for k in out}) == PINNED_PATTERNS
        want = release_names_and_shapes(text_config_of(cfg))  # the independent fixture's shapes
        assert {k: tuple(v.shape) for k, v in out.items()} == want == hf_adapter.released_shapes(cfg)


@pytest.mark.parametrize("make", [k3_tiny, k3_few])
@pytest.mark.parametrize("prefix", ["", hf_adapter.MULTIMODAL_PREFIX])
def test_round_trip_is_bitwise(make, prefix):
    cfg = make()
    sd = randomized(K3Model(cfg))
    out = hf_adapter.to_hf(sd, cfg, prefix)
    assert all(k.startswith(prefix + ("model." if k != prefix + "lm_head.weight" else "")) for k in out)
    back = hf_adapter.from_hf(out, cfg, prefix)
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_fixture_tensors_import_bitwise():
    """The independent fixture's tensors (AttnRes norms 2, projections q / 2) import to the exact state dict."""
    cfg = k3_few()
    sd = randomized(K3Model(cfg))
    back = hf_adapter.from_hf(release_tensors(text_config_of(cfg), sd), cfg)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


@pytest.mark.slow  # builds the full K3 model (on meta) and maps every tensor: CI runs it, the fast lane need not
def test_full_k3_on_meta_device():
    """Every released name and shape of the full K3, from a model built on the meta device (nothing allocated):
    the counts of issue 32 (moonrt's 2.78T, plus the 187 AttnRes key norms the release keeps)."""
    cfg = k3()
    with torch.device("meta"):
        model = K3Model(cfg)
    assert sum(p.numel() for p in model.parameters()) == K3_TOTAL == count_params(cfg).total
    assert count_params(cfg).active == K3_ACTIVE
    out = hf_adapter.to_hf(model.state_dict(), cfg)
    assert {k: tuple(v.shape) for k, v in out.items()} == release_names_and_shapes(text_config_of(cfg))
    norms = [k for k in out if k.endswith("res_norm.weight")]
    assert len(norms) == 2 * 93 + 1 and len(norms) * 7168 == K3_RES_NORMS
    buffers = sum(out[k].numel() for k in out if k.endswith("e_score_correction_bias"))  # router biases: buffers
    assert sum(t.numel() for t in out.values()) == K3_TOTAL + K3_RES_NORMS + buffers
    assert sorted({pattern(k) for k in out}) == PINNED_PATTERNS
    assert out["model.layers.1.block_sparse_moe.experts.895.w2.weight"].shape == (3584, 3072)


def test_import_is_strict():
    cfg = k3_tiny()
    out = hf_adapter.to_hf(K3Model(cfg).state_dict(), cfg)
    missing = dict(out)
    del missing["model.layers.2.self_attn.k_conv1d.weight"]
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.2\.self_attn\.k_conv1d\.weight'"):
        hf_adapter.from_hf(missing, cfg)
    with pytest.raises(ValueError, match=r"unexpected key 'model\.layers\.9\.mlp_res_norm\.weight'"):
        hf_adapter.from_hf({**out, "model.layers.9.mlp_res_norm.weight": torch.ones(128)}, cfg)
    a_log = out["model.layers.1.self_attn.A_log"]
    bad = {**out, "model.layers.1.self_attn.A_log": torch.cat([a_log, torch.ones(44)])}
    with pytest.raises(ValueError, match=r"A_log: shape \(48,\): expected \(4,\)"):
        hf_adapter.from_hf(bad, cfg)
    padded = {**out, "model.layers.1.self_attn.A_log": torch.cat([a_log, torch.zeros(44)])}  # zero padding: read
    assert torch.equal(hf_adapter.from_hf(padded, cfg)["layers.1.attn.A_log"], a_log)
    with pytest.raises(ValueError, match="unexpected key 'lm_head.weight' .*without the prefix"):
        hf_adapter.from_hf(out, cfg, hf_adapter.MULTIMODAL_PREFIX)


def test_mxfp4_pack_decodes_to_the_codec_values():
    cfg = k3_tiny()
    out = hf_adapter.to_hf(randomized(K3Model(cfg)), cfg)
    packed = hf_adapter.pack_mxfp4(out, block=8)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert name not in packed and packed[name + "_packed"].shape == (64, 28) and packed[name + "_scale"].shape == (
        64, 7)
    assert "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight" in packed  # the release's scope only
    from moonrt.ops.qat import fake_quantize_values

    decoded = hf_adapter.unpack(packed)
    assert torch.equal(decoded[name], fake_quantize_values(out[name], "mxfp4", 8))
    with pytest.raises(ValueError, match="no .*weight_scale"):
        hf_adapter.unpack({k: v for k, v in packed.items() if k != name + "_scale"})


def test_config_json_lists_every_released_field():
    assert hf_config.to_json(k3(), mxfp4_block=32) == K3_RELEASED
    parsed = hf_config.from_json(K3_RELEASED)
    assert parsed.model == k3() and parsed.mxfp4_block == 32 and parsed.extra == {}


def test_config_json_keeps_unknown_fields_and_refuses_other_semantics():
    doc = {"model_type": "kimi_k3", "media_placeholder_token_id": 7, "vision_config": {"depth": 2},
           "text_config": text_config_of(k3_tiny())}
    parsed = hf_config.from_json(doc)
    assert parsed.model == k3_tiny() and parsed.dtype == "float32"
    assert parsed.extra == {"top_k": 50, "pad_token_id": 0, "rope_parameters": None}
    assert hf_config.to_json(parsed.model, dtype="float32", extra=parsed.extra, wrapper=parsed.wrapper) == doc
    for field, value, match in (("moe_router_activation_func", "softmax", "expected 'sigmoid'"),
                                ("num_nextn_predict_layers", 1, "expected 0"),
                                ("num_key_value_heads", 1, "expected num_attention_heads")):
        bad = {**doc, "text_config": {**doc["text_config"], field: value}}
        with pytest.raises(ConfigError, match=f"text_config.{field} = .*{match}"):
            hf_config.from_json(bad)
    text = dict(doc["text_config"])
    del text["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        hf_config.from_json(text)
    text = {**doc["text_config"], "linear_attn_config": {**doc["text_config"]["linear_attn_config"],
                                                          "kda_layers": [1, 2]}}
    with pytest.raises(ConfigError, match="kda_layers"):
        hf_config.from_json(text)
