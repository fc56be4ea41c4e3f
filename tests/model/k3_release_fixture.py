"""An independent writer of the released Kimi K3 Hugging Face layout, for tests (issue 32 item 3).

Written from the published facts (key names, shapes as functions of ``config.json``'s fields, the AttnRes
proj/norm pair, packed MXFP4 experts, the multimodal ``language_model.`` prefix, sharded safetensors with
``model.safetensors.index.json``), NOT through moonrt's exporter (``moonrt.models.k3.hf_adapter``), so an import
test reads a directory moonrt did not write. The values come from a moonrt ``K3Model.state_dict()`` so the
imported model's logits can be compared with the model it was made from. The AttnRes key-norm weights are written
as 2 and the projections as half the moonrt pseudo-query (exact in binary floating point), so the import must
really fold ``proj * norm``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def release_names_and_shapes(text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Released text key (no prefix) -> shape, from a released ``text_config`` dict."""
    D, V = text["hidden_size"], text["vocab_size"]
    la = text["linear_attn_config"]
    H, K, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    full = set(la["full_attn_layers"])
    E, F, L = text["num_experts"], text["moe_intermediate_size"], text["routed_expert_hidden_size"]
    S, I = text["num_shared_experts"], text["intermediate_size"]  # noqa: E741
    nh, dn, dr, dv = (text["num_attention_heads"], text["qk_nope_head_dim"], text["qk_rope_head_dim"],
                      text["v_head_dim"])
    qr, kr = text["q_lora_rank"], text["kv_lora_rank"]
    shapes = {"model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "model.norm.weight": (D,),
              "model.output_attn_res_norm.weight": (D,), "model.output_attn_res_proj.weight": (1, D)}
    for n in range(text["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for site in ("self_attention_res", "mlp_res"):
            shapes[p + site + "_norm.weight"] = (D,)
            shapes[p + site + "_proj.weight"] = (1, D)
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        s = p + "self_attn."
        if n + 1 in full:  # gated MLA, NoPE
            shapes.update({s + "q_a_proj.weight": (qr, D), s + "q_a_layernorm.weight": (qr,),
                           s + "q_b_proj.weight": (nh * (dn + dr), qr), s + "kv_a_proj_with_mqa.weight": (kr + dr, D),
                           s + "kv_a_layernorm.weight": (kr,), s + "kv_b_proj.weight": (nh * (dn + dv), kr),
                           s + "g_proj.weight": (nh * dv, D), s + "o_proj.weight": (D, nh * dv)})
        else:  # KDA
            for x in ("q", "k", "v"):
                shapes[s + x + "_proj.weight"] = (H * K, D)
                shapes[s + x + "_conv1d.weight"] = (H * K, 1, W)
            shapes.update({s + "f_a_proj.weight": (K, D), s + "f_b_proj.weight": (H * K, K), s + "A_log": (H,),
                           s + "dt_bias": (H * K,), s + "b_proj.weight": (H, D), s + "g_proj.weight": (H * K, D),
                           s + "o_norm.weight": (K,), s + "o_proj.weight": (D, H * K)})
        if n < text["first_k_dense_replace"]:
            shapes.update({p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                           p + "mlp.down_proj.weight": (D, I)})
            continue
        b = p + "block_sparse_moe."
        shapes.update({b + "gate.weight": (E, D), b + "gate.e_score_correction_bias": (E,),
                       b + "routed_expert_down_proj.weight": (L, D), b + "routed_expert_norm.weight": (L,),
                       b + "routed_expert_up_proj.weight": (D, L),
                       b + "shared_experts.gate_proj.weight": (S * F, D),
                       b + "shared_experts.up_proj.weight": (S * F, D),
                       b + "shared_experts.down_proj.weight": (D, S * F)})
        for e in range(E):
            shapes.update({f"{b}experts.{e}.w1.weight": (F, L), f"{b}experts.{e}.w3.weight": (F, L),
                           f"{b}experts.{e}.w2.weight": (L, F)})
    return shapes


def release_tensors(text: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released text tensors holding the values of moonrt state dict ``sd`` (see the module docstring)."""
    la = text["linear_attn_config"]
    hk = la["num_heads"] * la["head_dim"]
    full = set(la["full_attn_layers"])
    S = text["num_shared_experts"]
    q = sd["attn_res.queries"]
    two = torch.full((text["hidden_size"],), 2.0, dtype=q.dtype)
    out = {"model.embed_tokens.weight": sd["embed.weight"], "lm_head.weight": sd["lm_head.weight"],
           "model.norm.weight": sd["norm.weight"], "model.output_attn_res_norm.weight": two,
           "model.output_attn_res_proj.weight": (sd["attn_res.final_query"] / 2).reshape(1, -1)}
    for n in range(text["num_hidden_layers"]):
        p, m = f"model.layers.{n}.", f"layers.{n}."
        out[p + "self_attention_res_norm.weight"] = two
        out[p + "self_attention_res_proj.weight"] = (q[2 * n] / 2).reshape(1, -1)
        out[p + "mlp_res_norm.weight"] = two
        out[p + "mlp_res_proj.weight"] = (q[2 * n + 1] / 2).reshape(1, -1)
        out[p + "input_layernorm.weight"] = sd[m + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[m + "ffn_norm.weight"]
        s, a = p + "self_attn.", m + "attn."
        if n + 1 in full:
            for hf, ours in (("q_a_proj", "q_a_proj"), ("q_b_proj", "q_b_proj"), ("kv_b_proj", "kv_b_proj"),
                             ("kv_a_proj_with_mqa", "kv_a_proj"), ("g_proj", "g_proj"), ("o_proj", "o_proj"),
                             ("q_a_layernorm", "q_a_norm"), ("kv_a_layernorm", "kv_a_norm")):
                out[s + hf + ".weight"] = sd[a + ours + ".weight"]
        else:
            for j, x in enumerate(("q", "k", "v")):
                out[s + x + "_proj.weight"] = sd[a + "qkv_proj.weight"][j * hk:(j + 1) * hk]
                out[s + x + "_conv1d.weight"] = sd[a + "conv_weight"][j * hk:(j + 1) * hk].reshape(hk, 1, -1)
            for hf in ("f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"):
                out[s + hf + ".weight"] = sd[a + hf + ".weight"]
            out[s + "A_log"], out[s + "dt_bias"] = sd[a + "A_log"], sd[a + "dt_bias"]
            out[s + "o_norm.weight"] = sd[a + "o_norm_weight"]
        if n < text["first_k_dense_replace"]:
            for w in ("gate_proj", "up_proj", "down_proj"):
                out[p + "mlp." + w + ".weight"] = sd[m + "ffn." + w + ".weight"]
            continue
        b, r = p + "block_sparse_moe.", m + "moe."
        out[b + "gate.weight"] = sd[r + "router.weight"]
        out[b + "gate.e_score_correction_bias"] = sd[r + "router.bias"]
        out[b + "routed_expert_down_proj.weight"] = sd[r + "down_proj.weight"]
        out[b + "routed_expert_up_proj.weight"] = sd[r + "up_proj.weight"]
        out[b + "routed_expert_norm.weight"] = sd[r + "norm.weight"]
        for w, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            out[b + "shared_experts." + w + ".weight"] = torch.cat(
                [sd[f"{r}shared_experts.{j}.{w}.weight"] for j in range(S)], dim=dim)
        for e in range(text["num_experts"]):
            out[f"{b}experts.{e}.w1.weight"] = sd[r + "experts.w_gate"][e]
            out[f"{b}experts.{e}.w3.weight"] = sd[r + "experts.w_up"][e]
            out[f"{b}experts.{e}.w2.weight"] = sd[r + "experts.w_down"][e]
    return {k: v.contiguous().clone() for k, v in out.items()}


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_pair(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``w`` ``[rows, cols]`` whose values are exactly E2M1 code values times a power of two per ``block``
    (see :func:`fp4_representable`) as (packed uint8 ``[rows, cols / 2]``, E8M0 uint8 ``[rows, cols / block]``):
    per block the smallest scale ``2^k`` with ``|w| / 2^k`` on the E2M1 grid, low nibble first."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // block, block)
    amax = blocks.abs().amax(-1)
    k = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.zeros_like(amax))  # 6 = 1.5 * 2^2
    scaled = blocks / torch.exp2(k)[..., None]
    mag = (scaled.abs()[..., None] - FP4).abs().argmin(-1)
    assert torch.equal(FP4[mag] * torch.exp2(k)[..., None] * blocks.sign().where(blocks != 0, 1.0), blocks), \
        "weights not representable in MXFP4 with this block"
    code = (mag | ((blocks < 0).to(torch.int64) << 3)).reshape(rows, cols).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed, (k + 127).to(torch.uint8)


def fp4_representable(shape: tuple[int, ...], block: int, generator: torch.Generator) -> torch.Tensor:
    """Random weights each an E2M1 value times a per-block power of two (scales 2^-8 .. 2^-5), max 6 per block."""
    rows, cols = shape[-2], shape[-1]
    codes = torch.randint(0, 16, (*shape[:-2], rows, cols), generator=generator)
    vals = FP4[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    vals[..., 0::block] = 6.0  # every block's max is 6 * scale, so its scale is exactly the one chosen here
    k = torch.randint(-8, -4, (*shape[:-2], rows, cols // block), generator=generator).to(torch.float32)
    return vals * torch.exp2(k).repeat_interleave(block, -1)


def write_release(out: Path, text: dict[str, Any], sd: dict[str, torch.Tensor], *, multimodal: bool = False,
                  shards: int = 3, mxfp4_block: int | None = None) -> dict[str, torch.Tensor]:
    """Write ``config.json``, ``shards`` safetensors files and ``model.safetensors.index.json`` into ``out`` in the
    released layout for the values of ``sd``; returns the tensors written (name -> tensor). ``multimodal``: the
    wrapper config and ``language_model.`` prefix plus two vision tensors; ``mxfp4_block``: routed experts packed
    (their values must be MXFP4-representable, :func:`fp4_representable`)."""
    shapes = release_names_and_shapes(text)
    tensors = release_tensors(text, sd)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    text = dict(text)
    if mxfp4_block is not None:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "dynamic": False, "group_size": mxfp4_block, "num_bits": 4, "scale_dtype": "torch.uint8",
                "symmetric": True, "type": "float"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"]}
        for name in [n for n in tensors if ".experts." in n]:
            w = tensors.pop(name)
            tensors[name + "_packed"], tensors[name + "_scale"] = mxfp4_pair(w, mxfp4_block)
    prefix = "language_model." if multimodal else ""
    tensors = {prefix + k: v for k, v in tensors.items()}
    if multimodal:
        tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 3)
        tensors["mm_projector.proj.0.weight"] = torch.zeros(2, 4)
        doc = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
               "media_placeholder_token_id": 7, "vision_config": {"hidden_size": 4}, "text_config": text}
    else:
        doc = text
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(doc, indent=2))
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return tensors


def text_config_of(cfg: Any) -> dict[str, Any]:
    """A released ``text_config`` for a moonrt ``K3Config`` ``cfg``: its fields (the same names), the 1-indexed
    ``kda_layers``, and the released constants moonrt's K3 has (written here by hand, not by moonrt)."""
    import dataclasses

    text = dataclasses.asdict(cfg)
    text.pop("kda_dt_bias_init", None)  # moonrt's own init option: the release has no such field
    full = text["linear_attn_config"]["full_attn_layers"]
    text["linear_attn_config"]["kda_layers"] = [i for i in range(1, cfg.num_hidden_layers + 1) if i not in full]
    text.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], dtype="float32",
                num_key_value_heads=cfg.num_attention_heads, moe_renormalize=True,
                moe_router_activation_func="sigmoid", use_grouped_topk=True, num_expert_group=1, topk_group=1,
                topk_method="noaux_tc", moe_layer_freq=1, num_nextn_predict_layers=0,
                top_k=50, pad_token_id=0, rope_parameters=None)  # generic transformers keys, kept verbatim
    return text
