"""``config.json`` of the released Kimi K3 layout, read and written (issue 32 item 2).

The released file is multimodal: ``{"model_type": "kimi_k3", ..., "text_config": {...}}`` with the decoder's
fields in ``text_config`` (``model_type`` ``kimi_linear``, ``architectures`` ``["KimiLinearForCausalLM"]``); a
text-only export writes those fields at the top level (what ``KimiLinearForCausalLM`` reads). Fields:

- :class:`~moonrt.models.k3.model.config.K3Config`'s own fields (same names; not :data:`MOONRT_ONLY`, moonrt's
  initialization choices, which describe no released tensor), plus ``linear_attn_config.kda_layers``
  (the 1-indexed complement of ``full_attn_layers``);
- fields whose released value is the only one moonrt's K3 computes (:data:`FIXED`): ``num_key_value_heads`` (=
  ``num_attention_heads``), ``moe_renormalize``, ``moe_router_activation_func``, ``use_grouped_topk``,
  ``num_expert_group``, ``topk_group``, ``topk_method``, ``moe_layer_freq``, ``num_nextn_predict_layers``;
  reading another value is an error naming the field and the value moonrt supports;
- ``quantization_config`` (written with ``--mxfp4``: compressed-tensors ``mxfp4-pack-quantized``, group 32, the
  release's scope: routed experts only) and ``dtype``.

Unknown fields are **kept verbatim**, not refused: the release's ``text_config`` also carries transformers'
generic ``PretrainedConfig`` keys (sampling defaults such as ``top_k``, token ids, ``rope_parameters`` -- unused,
K3's MLA is NoPE --) that change nothing moonrt computes. :func:`read_config` returns them in
:attr:`HFConfig.extra` (and the multimodal wrapper's own keys, ``vision_config`` etc., in
:attr:`HFConfig.wrapper`); :func:`write_config` writes them back unchanged, so read -> write keeps every field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from moonrt.config import ConfigError, from_dict
from moonrt.models.k3.model.config import K3Config

MAX_CONFIG_BYTES = 1 << 20
"""Largest ``config.json`` read (1 MiB; the release's is ~5 KB): its size is checked before it is parsed."""

FIXED: dict[str, Any] = {
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}
"""Released fields with the one value moonrt's K3 implements (sigmoid router, top-k weights renormalized, no
expert groups, bias-corrected selection, every layer after ``first_k_dense_replace`` MoE, no MTP head)."""

TEXT_MODEL_TYPE, TEXT_ARCHITECTURES = "kimi_linear", ["KimiLinearForCausalLM"]
WRAPPER_MODEL_TYPE = "kimi_k3"

MXFP4_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
"""The released ``quantization_config.ignore`` list (modules left unquantized)."""


def quantization_config(block: int = 32) -> dict[str, Any]:
    """The released ``quantization_config``: compressed-tensors MXFP4 (E2M1 weights, E8M0 uint8 scales per
    ``block``), applied to the routed experts (``experts.E.w1/w2/w3``). Every field of compressed-tensors' scheme
    that outside readers index is written: the weights' ``strategy: "group"`` and ``type: "float"``, and
    ``input_activations`` / ``output_activations`` null (weights only; :func:`from_json` reads the file without
    them, as it reads a weights block without ``type``)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "dynamic": False, "group_size": block, "num_bits": 4, "scale_dtype": "torch.uint8", "strategy": "group",
            "symmetric": True, "type": "float"}, "input_activations": None, "output_activations": None}},
        "ignore": list(MXFP4_IGNORE),
    }


@dataclasses.dataclass(slots=True)
class HFConfig:
    """A read ``config.json``: the model, the ``text_config`` fields moonrt does not interpret (``extra``, kept
    verbatim), the multimodal wrapper's own fields (``wrapper``; None for a text-only file), the MXFP4 block of its
    ``quantization_config`` (None: none) and its ``dtype``."""

    model: K3Config
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    wrapper: dict[str, Any] | None = None
    mxfp4_block: int | None = None
    dtype: str | None = None


MOONRT_ONLY = frozenset({"kda_dt_bias_init"})
"""K3Config fields that are moonrt's own initialization options: not written (a released checkpoint's weights are
already initialized), and the default when read."""


def text_fields(cfg: K3Config, dtype: str = "bfloat16", mxfp4_block: int | None = None) -> dict[str, Any]:
    """The released ``text_config`` of ``cfg`` (every released field, in the released names)."""
    lac = cfg.linear_attn_config
    out: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE, "architectures": list(TEXT_ARCHITECTURES), "dtype": dtype}
    for f in dataclasses.fields(K3Config):
        if f.name in MOONRT_ONLY:
            continue
        value = getattr(cfg, f.name)
        if f.name == "linear_attn_config":
            full = sorted(lac.full_attn_layers)
            mla = set(full)
            value = {"kda_layers": [i for i in range(1, cfg.num_hidden_layers + 1) if i not in mla],
                     "full_attn_layers": full, **{g.name: getattr(lac, g.name) for g in dataclasses.fields(lac)
                                                  if g.name != "full_attn_layers"}}
        out[f.name] = copy.deepcopy(value)
    out["num_key_value_heads"] = cfg.num_attention_heads
    out |= FIXED
    if mxfp4_block is not None:
        out["quantization_config"] = quantization_config(mxfp4_block)
    return out


def to_json(cfg: K3Config, *, dtype: str = "bfloat16", mxfp4_block: int | None = None,
            extra: dict[str, Any] | None = None, wrapper: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` document: text-only (the text fields at the top level) or, with ``wrapper`` (a dict,
    possibly empty), the multimodal form ``{**wrapper, "model_type": "kimi_k3", "text_config": {...}}``.
    ``extra`` fields are added to the text fields verbatim (moonrt's own fields win over a same-named extra)."""
    text = {**copy.deepcopy(extra or {}), **text_fields(cfg, dtype, mxfp4_block)}
    if wrapper is None:
        return text
    return {**copy.deepcopy(wrapper), "model_type": WRAPPER_MODEL_TYPE, "text_config": text}


def write_config(path: str | Path, cfg: K3Config, **kwargs: Any) -> None:
    """Write :func:`to_json` (``kwargs`` as there) to ``path`` (indented JSON)."""
    Path(path).write_text(json.dumps(to_json(cfg, **kwargs), indent=2) + "\n")


def _fail(field: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"config.json: {field} = {value!r}: expected {expected}")


def from_json(doc: dict[str, Any]) -> HFConfig:
    """Parse a released ``config.json`` document (text-only or multimodal); ConfigError naming the field for a
    missing field or a value moonrt's K3 does not compute."""
    if not isinstance(doc, dict):
        raise _fail("(document)", type(doc).__name__, "a JSON object")
    wrapper = None
    text = doc
    if "text_config" in doc:
        wrapper = {k: v for k, v in doc.items() if k != "text_config"}
        text = doc["text_config"]
        if not isinstance(text, dict):
            raise _fail("text_config", text, "a JSON object")
    text = copy.deepcopy(text)
    where = "text_config." if wrapper is not None else ""
    for name, value in FIXED.items():
        if name in text and text[name] != value:
            raise _fail(where + name, text[name], f"{value!r} (the only value moonrt's K3 implements)")
    names = {f.name for f in dataclasses.fields(K3Config)}
    fields = {k: text[k] for k in names if k in text}
    lac = fields.get("linear_attn_config")
    if isinstance(lac, dict):
        lac = dict(lac)
        kda = lac.pop("kda_layers", None)
        fields["linear_attn_config"] = lac
    try:
        model = from_dict(K3Config, fields)  # validated: num_hidden_layers <= MAX_LAYERS before any list is made
    except ConfigError as exc:
        raise ConfigError(f"config.json: {where}{exc}") from None
    if isinstance(lac, dict) and kda is not None:
        full = set(model.linear_attn_config.full_attn_layers)
        if not isinstance(kda, list) or not all(type(i) is int for i in kda) or sorted(kda) != [
                i for i in range(1, model.num_hidden_layers + 1) if i not in full]:
            raise _fail(where + "linear_attn_config.kda_layers", kda,
                        "the 1-indexed layers not in full_attn_layers (each layer exactly one kind)")
    if "num_key_value_heads" in text and text["num_key_value_heads"] != model.num_attention_heads:
        raise _fail(where + "num_key_value_heads", text["num_key_value_heads"],
                    f"num_attention_heads ({model.num_attention_heads}; K3's MLA has no GQA)")
    block = None
    q = text.get("quantization_config")
    if q is not None:
        try:  # compressed-tensors' defaults where a field is absent: type float, strategy group, no activations
            scheme = next(iter(q["config_groups"].values()))
            group = scheme["weights"]
            ok = (q["format"] == "mxfp4-pack-quantized" and group["num_bits"] == 4
                  and group.get("type", "float") == "float" and group.get("strategy", "group") == "group"
                  and group["scale_dtype"] == "torch.uint8" and scheme.get("input_activations") is None
                  and scheme.get("output_activations") is None)
            block = int(group["group_size"])
        except (KeyError, TypeError, StopIteration, AttributeError, ValueError):
            ok = False
        if not ok:
            raise _fail(where + "quantization_config", q, "compressed-tensors mxfp4-pack-quantized (4-bit float "
                        "weights in groups, uint8 E8M0 scales, no activation quantization) as the release declares, "
                        "or no quantization_config")
    known = names | set(FIXED) | {"num_key_value_heads", "quantization_config", "dtype", "torch_dtype", "model_type",
                                  "architectures"}
    extra = {k: v for k, v in text.items() if k not in known}
    dtype = text.get("dtype", text.get("torch_dtype"))
    return HFConfig(model=model, extra=extra, wrapper=wrapper, mxfp4_block=block, dtype=dtype)


def read_config(path: str | Path) -> HFConfig:
    """:func:`from_json` of the file ``path``: ConfigError naming the file if it is larger than
    :data:`MAX_CONFIG_BYTES` (checked before it is read), not UTF-8 JSON, or nested deeper than Python parses."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{str(path)!r}: {size:,} bytes; expected a config.json of at most "
                                  f"{MAX_CONFIG_BYTES:,} bytes (MAX_CONFIG_BYTES)")
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:  # grew while read
            raise ConfigError(f"{str(path)!r}: more than {MAX_CONFIG_BYTES:,} bytes; expected a config.json of at "
                              f"most {MAX_CONFIG_BYTES:,} bytes (MAX_CONFIG_BYTES)")
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON, UTF-8; RecursionError: deep nesting
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0]
        raise ConfigError(f"{str(path)!r}: not a JSON config.json ({reason})") from None
    try:
        return from_json(doc)
    except ConfigError as exc:  # "config.json: field = value: expected ..." -> the file's path
        raise ConfigError(f"{str(path)!r}: {str(exc).removeprefix('config.json: ')}") from None
    except RecursionError:  # a value nested deeper than its copy recurses
        raise ConfigError(f"{str(path)!r}: a value nested too deeply; expected a config.json") from None


__all__ = ["FIXED", "HFConfig", "MAX_CONFIG_BYTES", "MOONRT_ONLY", "MXFP4_IGNORE", "from_json", "quantization_config",
           "read_config", "text_fields", "to_json", "write_config"]
