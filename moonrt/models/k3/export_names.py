"""The names of ``moonrt checkpoint export``'s single-file format (``--names hf``, moved here from the job layer:
``models/k3`` owns K3's state-dict naming): the Llama / DeepSeek-V3 convention where moonrt has the same tensor,
moonrt names elsewhere, one tensor per routed expert, and the reverse map the file's metadata records.

This is not the released Kimi K3 layout (the release's KDA, LatentMoE and AttnRes names and shapes differ):
``moonrt checkpoint export --format hf`` writes that one, through :mod:`moonrt.models.k3.hf_adapter`.
"""

from __future__ import annotations

import re
from typing import Any

HF_RULES: list[tuple[str, str]] = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.ffn\.(gate_proj|up_proj|down_proj)\.weight", r"model.layers.\1.mlp.\2.weight"),
    (r"layers\.(\d+)\.attn\.(q_a_proj|q_b_proj|kv_b_proj)\.weight", r"model.layers.\1.self_attn.\2.weight"),
    (r"layers\.(\d+)\.attn\.kv_a_proj\.weight", r"model.layers.\1.self_attn.kv_a_proj_with_mqa.weight"),
    (r"layers\.(\d+)\.attn\.q_a_norm\.weight", r"model.layers.\1.self_attn.q_a_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.kv_a_norm\.weight", r"model.layers.\1.self_attn.kv_a_layernorm.weight"),
    (r"layers\.(\d+)\.moe\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"layers\.(\d+)\.moe\.router\.bias", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
]
"""``(moonrt regex, HF replacement)``, matched against the whole name; first match wins."""

_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.w_(gate|up|down)")
_MLA_O = re.compile(r"layers\.(\d+)\.attn\.o_proj\.weight")


def hf_names(model: dict[str, Any]) -> dict[str, str]:
    """``moonrt name -> HF name`` for every non-expert tensor of a single-process ``model.state_dict()``
    (unmapped names map to themselves); MLA's ``o_proj`` only in layers that are MLA (``kv_b_proj`` present)."""
    out = {}
    for name in model:
        new = name
        for pat, rep in HF_RULES:
            if re.fullmatch(pat, name):
                new = re.sub(pat, rep, name)
                break
        m = _MLA_O.fullmatch(name)
        if m and f"layers.{m.group(1)}.attn.kv_b_proj.weight" in model:
            new = f"model.layers.{m.group(1)}.self_attn.o_proj.weight"
        out[name] = new
    return out


def to_hf(model: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The export tensors (HF names where :data:`HF_RULES` has one, experts one tensor per expert) and
    ``exported name -> moonrt name`` (``w_gate[e]`` for expert ``e`` of a stacked tensor)."""
    names = hf_names(model)
    tensors, back = {}, {}
    for name, t in model.items():
        m = _EXPERTS.fullmatch(name)
        if m:
            for e in range(t.shape[0]):
                key = f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}_proj.weight"
                tensors[key], back[key] = t[e].contiguous(), f"{name}[{e}]"
        else:
            tensors[names[name]], back[names[name]] = t.contiguous(), name
    return tensors, back


def from_hf(tensors: dict[str, Any], back: dict[str, str]) -> dict[str, Any]:
    """Invert :func:`to_hf`: moonrt names, experts stacked again ``[E, ...]`` in expert order."""
    import torch

    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, Any]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(.+)\[(\d+)\]", back[key])
        if m:
            stacks.setdefault(m.group(1), {})[int(m.group(2))] = t
        else:
            out[back[key]] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out
