"""K3's traced memory profiles: saved activations measured under the activation manager (K3_SYSTEMS §8).

Job layer, beside :mod:`moonrt.models.k3.memory` (the analytic formulas): :func:`traced_profile_by_kind` builds one
instance of each K3 layer kind at the configured widths (:func:`kind_modules`), runs it on a few tokens
under the :class:`~moonrt.memory.manager.ActivationManager` and scales (``moonrt mem-plan --profile
traced``); :func:`traced_profile` counts a whole model's forward at two batch sizes and fits the
per-token bytes per class (:func:`class_of` maps the manager's regions of a K3 model to the planner's
classes; :func:`policy_for_all` is one policy for every class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moonrt.memory.model_memory import LayerSpec, Profile, SavedClass
from moonrt.models.k3.memory import kernel_profile, layer_specs


def kind_modules(cfg: Any, max_experts: int = 32) -> dict[str, Callable[[], Any]]:
    """Builders of one instance of each layer kind: ``name -> () -> (module, run(module, x, tokens))``.

    MoE layers get ``min(E, max(k + 1, max_experts))`` experts (the saved bytes per token and per
    assignment do not depend on E except the ``[T, E]`` router scores, which :func:`traced_profile_by_kind`
    scales to the real E)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from moonrt.models.k3.model.attnres import mix
    from moonrt.models.k3.model.ffn import dense_ffn
    from moonrt.models.k3.model.kda_layer import KDALayer
    from moonrt.models.k3.model.mla import GatedMLA
    from moonrt.models.k3.model.moe import LatentMoE
    from moonrt.models.k3.model.norm import RMSNorm

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

        def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            logits = self.lm_head(self.norm(x)).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), reduction="sum")

    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Parameter(torch.randn(cfg.hidden_size) * 0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return mix(self.query, [x, x * 0.5], cfg.rms_norm_eps)  # 2 sources

    def reduced() -> Any:
        k = cfg.num_experts_per_token
        return dataclasses.replace(cfg, num_experts=min(cfg.num_experts, max(k + 1, max_experts)))

    return {
        "norm": lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        "kda.attn": lambda: KDALayer(cfg),
        "mla.attn": lambda: GatedMLA(cfg),
        "moe": lambda: LatentMoE(reduced()),
        "ffn": lambda: dense_ffn(cfg),
        "attn_res": Mix,
        "head": Head,
        "embed": lambda: nn.Embedding(cfg.vocab_size, cfg.hidden_size),
    }


KIND_SOURCES = {"attn_res": 2}
"""Instances of the class one traced run of a kind holds (the AttnRes probe mixes 2 sources)."""


def measure_kind(name: str, module: Any, cfg: Any, batch: int, tokens: int, dtype: Any,
                 policy: str = "keep") -> float:
    """Bytes one forward of layer kind ``name`` on ``batch x tokens`` leaves saved for backward under
    the activation manager with ``policy`` for every tensor (``recompute``: the module checkpointed)."""
    import torch
    from torch import nn

    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy, PolicyRule

    box = nn.Module()
    box.m = module
    if policy == "recompute":
        pol = MemoryPolicy(rules=[PolicyRule(match="m", policy="recompute")])
    else:
        pol = MemoryPolicy(default=policy)
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen)
    x = (torch.randn(batch, tokens, cfg.hidden_size, generator=gen)).to(dtype).requires_grad_(True)
    mgr = ActivationManager(box, pol)
    try:
        with mgr:
            if name == "embed":
                out = module(ids)  # box.m: the same module, registered under the policy's name
            elif name == "head":
                out = module(x, ids)
            else:
                out = module(x)
        total = float(sum(st.live_bytes for st in mgr.accounting.regions.values()))
        del out
        return total
    finally:
        mgr.close()


def traced_profile_by_kind(cfg: Any, dtype: Any, seq_tokens: int, batch: int = 1, cp: int = 1,
                           probe_tokens: int = 256, max_experts: int = 32,
                           kinds: tuple[str, ...] | None = None) -> Profile:
    """Profile by measuring each layer kind (built at ``cfg``'s widths, parameters in ``dtype``).

    Per kind and policy (keep, fp8, recompute) three forwards: ``(1, P)``, ``(2, P)`` and ``(1, 2P)``
    tokens (``P = probe_tokens``) give ``bytes = c + B (a t + q t^2)``; the planned class is
    ``a + q * S`` per token (``S`` the attended length, ``seq_tokens * cp`` for MLA, else ``seq_tokens``)
    plus ``c`` per instance. The MoE router's ``[T, E]`` fp32 scores are rescaled from the probe's
    expert count to the real ``E``. KDA's per-sequence conv prefix and chunk padding are taken at
    ``P`` tokens (``P`` a multiple of the chunk size keeps padding out).
    """
    import torch

    builders = kind_modules(cfg, max_experts)
    flops = kernel_profile(cfg).classes
    E_probe = min(cfg.num_experts, max(cfg.num_experts_per_token + 1, max_experts))
    classes = {}
    for name in kinds or tuple(builders):
        torch.manual_seed(0)
        module = builders[name]().to(dtype)
        per_policy = {}
        for pol in ("keep", "fp8", "recompute"):
            y11 = measure_kind(name, module, cfg, 1, probe_tokens, dtype, pol)
            y21 = measure_kind(name, module, cfg, 2, probe_tokens, dtype, pol)
            y12 = measure_kind(name, module, cfg, 1, 2 * probe_tokens, dtype, pol) if name == "mla.attn" else None
            P = probe_tokens
            q = (y12 - y21) / (2 * P * P) if y12 is not None else 0.0
            a_ = (y21 - y11) / P - q * P
            c = max(0.0, y11 - a_ * P - q * P * P)
            S = seq_tokens * cp if name == "mla.attn" else seq_tokens
            n = KIND_SOURCES.get(name, 1)
            lin = (a_ + q * S) / n
            if name == "moe" and pol != "recompute":
                lin += 4 * (cfg.num_experts - E_probe)
            per_policy[pol] = (lin, c / n)
        del module
        f = flops.get(name)
        classes[name] = SavedClass(name, per_policy["keep"][0], 0.0, per_policy["fp8"][0], 0.0,
                                   per_policy["recompute"][0], f.flops_lin if f else 0.0,
                                   f.flops_quad if f else 0.0, per_policy["keep"][1], per_policy["fp8"][1])
    layers, head, embed = layer_specs(cfg)
    return Profile(classes, layers, head, embed)


ATTNRES_REGIONS = ("attn_res.sublayer_input", "attn_res.final")


def class_of(region: str, cfg: Any) -> str:
    """Saved-tensor class of a manager region (module path or region name) of a K3 model."""
    parts = region.split(".")
    if region.startswith("attn_res"):
        return "attn_res"
    if parts[0] in ("norm", "lm_head", "<root>"):
        return "head"  # the root saves are the loss's (log-softmax of the logits)
    if parts[0] == "embed":
        return "embed"
    if parts[0] != "layers" or len(parts) < 3:
        return "other"
    i, sub = int(parts[1]), parts[2]
    if sub in ("attn_norm", "ffn_norm"):
        return "norm"
    if sub == "attn":
        return f"{cfg.layer_types()[i]}.attn"
    return sub  # "moe" or "ffn"


def policy_for_all(policy: str) -> Any:
    """A :class:`MemoryPolicy` applying ``policy`` to every class (recompute: every region checkpointed)."""
    from moonrt.memory.policy import MemoryPolicy, PolicyRule

    if policy != "recompute":
        return MemoryPolicy(default=policy, rules=[PolicyRule(match=r, policy=policy) for r in ATTNRES_REGIONS])
    rules = [PolicyRule(match=p, policy="recompute") for p in (
        "layers.*.attn", "layers.*.attn_norm", "layers.*.ffn_norm", "layers.*.ffn", "layers.*.moe", "norm", "lm_head")]
    return MemoryPolicy(rules=rules, attnres_checkpoint=list(ATTNRES_REGIONS))


def measure_classes(model: Any, cfg: Any, policy: Any, run: Callable[[Any, int], Any], n: int) -> dict[str, float]:
    """Bytes saved per class and still held at the end of one ``run(model, n)`` forward (all tiers;
    recompute-region inputs counted in their class) under the activation manager with ``policy``:
    what backward needs, i.e. what an in-flight micro-batch keeps."""
    from moonrt.memory.manager import ActivationManager

    mgr = ActivationManager(model, policy)
    try:
        with mgr:
            out = run(model, n)
        res: dict[str, float] = {}
        for (reg, _pol), st in mgr.accounting.regions.items():
            c = class_of(reg, cfg)
            res[c] = res.get(c, 0.0) + st.live_bytes
        del out
        return res
    finally:
        mgr.close()


def traced_profile(build: Callable[[], Any], run: Callable[[Any, int], Any], cfg: Any, seq_len: int,
                   batches: tuple[int, int] = (1, 2)) -> Profile:
    """Profile by counting, at one sequence length: ``build()`` returns a model and ``run(model, B)``
    runs its forward on ``B`` sequences of ``seq_len`` tokens; the activation manager counts the bytes
    saved per class for keep, FP8 and recompute at two batch sizes and the profile fits
    ``bytes = c0 + c1 * tokens`` per class (``c0`` folded into the per-token term at the larger size).
    Saved bytes are linear in the number of sequences (FP8 tiles run along the feature dimension),
    so the fit is exact at that sequence length; sequence-length effects (the reference MLA's
    ``T x T`` scores, KDA chunking) are folded into the per-token terms, so plan with the same
    ``seq_len / cp``. Classes are those of :func:`kernel_profile` (same manager patterns), so a plan
    from this profile writes the same policy YAML.
    """
    types = cfg.layer_types()
    model = build()
    b0, b1 = batches
    keep = [measure_classes(model, cfg, policy_for_all("keep"), run, b) for b in batches]
    q = [measure_classes(model, cfg, policy_for_all("fp8"), run, b) for b in batches]
    rec = [measure_classes(model, cfg, policy_for_all("recompute"), run, b) for b in batches]
    counts = class_counts(cfg)

    def fit(samples: list[float]) -> float:
        y0, y1 = samples
        c1 = (y1 - y0) / ((b1 - b0) * seq_len)
        c0 = y0 - c1 * b0 * seq_len
        return c1 + c0 / (b1 * seq_len)

    flops = kernel_profile(cfg).classes  # recompute cost: the analytic FLOPs (bytes are what is traced)
    classes = {}
    for name, n in counts.items():
        if n == 0:
            continue
        f = flops.get(name)
        classes[name] = SavedClass(name, fit([s.get(name, 0.0) / n for s in keep]), 0.0,
                                   fit([s.get(name, 0.0) / n for s in q]), 0.0,
                                   fit([s.get(name, 0.0) / n for s in rec]),
                                   f.flops_lin if f else 0.0, f.flops_quad if f else 0.0)
    layers = tuple(LayerSpec(i, ("norm", f"{t}.attn", "norm", "moe" if cfg.is_moe_layer(i) else "ffn",
                                 "attn_res", "attn_res")) for i, t in enumerate(types))
    return Profile(classes, layers, ("head", "attn_res"), ("embed",))


def class_counts(cfg: Any) -> dict[str, int]:
    """Instances of each class in the whole model (norm: 2 per layer; attn_res: 2 per layer + final)."""
    types = cfg.layer_types()
    n_moe = sum(cfg.is_moe_layer(i) for i in range(len(types)))
    return {"norm": 2 * len(types), "attn_res": 2 * len(types) + 1, "head": 1, "embed": 1, "moe": n_moe,
            "ffn": len(types) - n_moe, "kda.attn": types.count("kda"), "mla.attn": types.count("mla")}


__all__ = ["ATTNRES_REGIONS", "KIND_SOURCES", "class_counts", "class_of", "kind_modules", "measure_classes",
           "measure_kind", "policy_for_all", "traced_profile", "traced_profile_by_kind"]
