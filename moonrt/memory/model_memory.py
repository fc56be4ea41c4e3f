"""Memory model of a K3 training job per pipeline rank (K3_SYSTEMS §1, §6, §8, §10).

Pure functions of a model config (duck-typed: the HF field names of ``K3Config``), a
:class:`JobLayout` and per-part parameter counts (:class:`ParamSizes`) and a per-layer activation
:class:`Profile`, both supplied by the caller (for K3: :mod:`moonrt.k3_memory`, reached through the
model registry :mod:`moonrt.models`); the runtime never imports the model package.

Per rank ``r`` of ``pp`` (chunks ``c`` of ``vpp`` hold stages ``c * pp + r``; layers are cut into
``pp * vpp`` near-equal contiguous stages as :meth:`K3Model.stages` does):

- **static**: bf16 parameters, fp32 gradients, optimizer states sharded ZeRO-1 (dense parameters
  over the ``dp * ep * cp`` replicas, routed experts over ``dp * cp``), the MoonEP slot pool
  (``E / ep`` expert copies + their fp32 gradient slots, shared by all MoE layers, §6.3) and
  communication buffers (EP dispatch/combine double buffers of ``CAP = T * k`` latent rows, PP
  send/recv of the stream, DP gradient buckets);
- **activations**: saved-tensor classes (:class:`SavedClass`) per layer, bytes per micro-batch as
  ``a1 * T + a2 * T^2`` for each storage policy, summed over the layers of each chunk, and the peak
  over the rank's schedule walk (:mod:`.schedule`): the exact set of chunk activations alive at
  every point of the action order, which reproduces 1F1B's ``pp - r`` and the interleaved factor.

Two activation profiles: :func:`kernel_profile` ([derived] formulas for fused kernels: flash-style
MLA saving ``q, k, v, o, lse``; chunked KDA kernel saving its inputs and output; the real ``k3``)
and :func:`traced_profile` (counted by running a model's forward through the activation manager
at two batch sizes and fitting the per-token bytes; the CPU reference layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from moonrt.config import ParallelConfig
from moonrt.ops import fp8 as fp8mod
from moonrt.scheduler.pipeline import Schedule, build_schedule, in_flight

GIB = 2**30
OFFLOAD = ("host", "disk", "remote", "fp8+host", "fp8+disk", "fp8+remote")


@dataclasses.dataclass(kw_only=True, slots=True)
class JobLayout:
    """Parallel layout and batch of the job being planned (K3_SYSTEMS §10)."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Degrees of the parallel dimensions (``dp``, ``pp``, ``vpp``, ``ep``, ``cp``): the same config a
    training job holds."""
    micro_batch_size: int = 1
    seq_len: int = 4096
    microbatches: int = 8
    schedule: str = "1f1b"
    act_bytes: int = 2
    """Bytes per activation element (bf16)."""
    param_bytes: int = 2
    grad_bytes: int = 4
    optim_bytes: int = 12
    """fp32 master + two moments per parameter (AdamW; Muon needs 8)."""
    shard_grads: bool = False
    """fp32 gradients sharded like the optimizer states (reduce-scattered per bucket), else full per rank."""
    dp_bucket_mib: float = 512.0
    """DP gradient reduce-scatter buckets (two in flight)."""

    def tokens(self) -> int:
        """Tokens per micro-batch on one rank: ``micro_batch_size * seq_len / cp``."""
        return self.micro_batch_size * self.seq_len // self.parallel.cp

    def check(self, num_layers: int, num_experts: int) -> None:
        """Raise ValueError (a :class:`~moonrt.config.ConfigError` for the degrees) naming the first bad field."""
        par = self.parallel
        par.validate()
        for name in ("micro_batch_size", "seq_len", "microbatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected an integer >= 1")
        if self.seq_len % par.cp:
            raise ValueError(f"seq_len = {self.seq_len}: expected a multiple of cp ({par.cp})")
        if num_experts % par.ep:
            raise ValueError(f"ep = {par.ep}: expected a divisor of num_experts ({num_experts})")
        if par.pp * par.vpp > num_layers:
            raise ValueError(f"pp * vpp = {par.pp * par.vpp}: expected <= num_hidden_layers ({num_layers})")
        if self.schedule == "interleaved" and par.vpp < 2:
            raise ValueError(f"vpp = {par.vpp}: expected >= 2 for schedule 'interleaved'")
        if self.schedule != "interleaved" and par.vpp != 1:
            raise ValueError(f"vpp = {par.vpp}: expected 1 for schedule {self.schedule!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSizes:
    """Parameter counts of one instance of each part (from ``moonrt.model.params``)."""

    kda: int
    mla: int
    dense_ffn: int
    moe_dense: int
    """Router, latent down/up, latent norm, shared experts of one MoE layer."""
    routed_expert: int
    embed: int
    lm_head: int
    norm: int
    """Per-layer norms + AttnRes pseudo-queries of one decoder layer."""


@dataclasses.dataclass(frozen=True, slots=True)
class SavedClass:
    """One class of tensors saved for backward, per layer instance and micro-batch.

    Bytes are ``lin * T + quad * T^2`` for ``T`` tokens; ``*_fp8`` are the same when stored as
    block-wise FP8; ``recompute_*`` what stays saved when the class is recomputed (the region's
    inputs); ``flops_*`` the forward FLOPs a recompute replays.
    """

    name: str
    lin: float
    quad: float = 0.0
    lin_fp8: float = 0.0
    quad_fp8: float = 0.0
    recompute_lin: float = 0.0
    flops_lin: float = 0.0
    flops_quad: float = 0.0
    const: float = 0.0
    """Bytes per instance independent of ``T`` (masks, fp32 weight copies in bf16 runs)."""
    const_fp8: float = 0.0

    def bytes(self, policy: str, T: int) -> tuple[float, float]:
        """``(device bytes, offloaded bytes)`` of one instance under ``policy`` for ``T`` tokens."""
        keep = self.lin * T + self.quad * T * T + self.const
        q = self.lin_fp8 * T + self.quad_fp8 * T * T + self.const_fp8
        if policy == "keep":
            return keep, 0.0
        if policy == "fp8":
            return q, 0.0
        if policy == "recompute":
            return self.recompute_lin * T, 0.0
        if policy.startswith("fp8+"):
            return 0.0, q
        return 0.0, keep

    def flops(self, T: int) -> float:
        return self.flops_lin * T + self.flops_quad * T * T


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    """Which saved-tensor classes one decoder layer has and the manager pattern of each."""

    index: int
    classes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """Activation profile: classes by name, the classes of each decoder layer, and the head's."""

    classes: dict[str, SavedClass]
    layers: tuple[LayerSpec, ...]
    head: tuple[str, ...]
    embed: tuple[str, ...] = ()


def _fp8_lin(elems: float, width: int, act_bytes: int) -> float:
    """FP8 bytes per token of ``elems`` elements per token stored in rows of ``width``."""
    rows = elems / width
    return rows * fp8mod.stored_bytes((1, width)) if act_bytes > 1 else elems * act_bytes


def kernel_profile(cfg: Any, act_bytes: int = 2, chunk: int = 64) -> Profile:
    """[derived] saved bytes of K3 layers with fused kernels (what a GPU K3 run saves).

    Per token (a = ``act_bytes``): norms save input + fp32 rstd; KDA saves the normed input, pre- and
    post-conv q|k|v, fp32 decay ``g`` and ``beta``, the gate-rank input, kernel output, output-gate and
    o_proj inputs (the kernel recomputes chunk states); MLA saves the normed input, LoRA
    intermediates, per-head q, k, v, the fp32 output + lse (flash style), gate and o_proj inputs;
    LatentMoE saves the input, fp32 router scores, latent ``z``, per routed copy the expert input,
    gate/up/activation outputs and output, the combined latent and its norm, the shared experts'
    intermediates; AttnRes saves the normed sources it mixes; the head saves its input and the
    fp32 logits. Recompute keeps the region input (``D * a``); FLOPs are 2 per multiply-add. For
    LatentMoE, ``recompute`` is the whole-layer checkpoint (a ``recompute`` rule on ``layers.i.moe``);
    the ``moe_dispatch_only`` option (routed path only, saving ``z, ids, weights``) is not a class
    policy of the planner.
    """
    a = act_bytes
    la = cfg.linear_attn_config
    D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
    HK = H * K
    Hm = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    V = cfg.v_head_dim
    L, F, k, E = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token, cfg.num_experts
    ns, I = cfg.num_shared_experts, cfg.intermediate_size

    def cls(name: str, wide: list[tuple[float, int]], fp32: float, rec: float, flops: float, fq: float = 0.0):
        lin = sum(n for n, _ in wide) * a + fp32
        lin8 = sum(_fp8_lin(n, w, a) for n, w in wide) + fp32
        return SavedClass(name, lin, 0.0, lin8, 0.0, rec, flops, fq)

    norm = cls("norm", [(D, D)], 4, D * a, 4 * D)
    kda_params = 3 * D * HK + D * H + D * K + K * HK + 2 * D * HK
    kda = cls("kda.attn", [(D, D), (3 * HK, HK), (3 * HK, HK), (K, K), (HK, HK), (HK, HK), (HK, HK)],
              HK * 4 + H * 4 + H * 4, D * a, 2 * kda_params + 2 * (2 * HK * K + 2 * chunk * HK))
    mla_params = D * cfg.q_lora_rank + cfg.q_lora_rank * Hm * qk + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) \
        + cfg.kv_lora_rank * Hm * (cfg.qk_nope_head_dim + V) + 2 * D * Hm * V
    mla = cls("mla.attn", [(D, D), (2 * cfg.q_lora_rank, cfg.q_lora_rank),
                           (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                           (cfg.kv_lora_rank, cfg.kv_lora_rank), (2 * Hm * qk, qk), (Hm * V, V), (2 * Hm * V, V)],
              Hm * V * 4 + Hm * 4 + 8, D * a, 2 * mla_params, 2 * Hm * (qk + V))  # causal: T^2/2 pairs
    moe = cls("moe", [(D, D), (L, L), (k * L, L), (k * 2 * F, F), (k * F, F), (k * L, L), (2 * L, L),
                      (ns * 3 * F, F)], E * 4 + k * 12 + 4, D * a,
              2 * (D * E + 2 * D * L + k * 3 * L * F + ns * 3 * D * F))
    ffn = cls("ffn", [(D, D), (3 * I, I)], 0, D * a, 2 * 3 * D * I)
    nsrc = max(2, cfg.num_attn_res_blocks // 2 + 1)  # average sources a sub-layer mixes [derived]
    attn_res = SavedClass("attn_res", nsrc * D * a + nsrc * 4, 0.0, nsrc * _fp8_lin(D, D, a) + nsrc * 4, 0.0,
                          0.0, 2 * 4 * nsrc * D)
    head = cls("head", [(2 * D, D)], cfg.vocab_size * 4 + 4, D * a, 2 * D * cfg.vocab_size)
    classes = {c.name: c for c in (norm, kda, mla, moe, ffn, attn_res, head)}
    layers = []
    for i, t in enumerate(cfg.layer_types()):
        ffn_cls = "moe" if cfg.is_moe_layer(i) else "ffn"
        layers.append(LayerSpec(i, ("norm", f"{t}.attn", "norm", ffn_cls, "attn_res", "attn_res")))
    return Profile(classes, tuple(layers), ("head", "attn_res"))


def layer_class_patterns(name: str, layer: int) -> list[str]:
    """Manager patterns (module paths / regions) of class ``name`` in decoder ``layer``."""
    return {
        "norm": [f"layers.{layer}.attn_norm", f"layers.{layer}.ffn_norm"],
        "kda.attn": [f"layers.{layer}.attn"],
        "mla.attn": [f"layers.{layer}.attn"],
        "moe": [f"layers.{layer}.moe"],
        "ffn": [f"layers.{layer}.ffn"],
        "attn_res": ["attn_res.sublayer_input"],
        "head": ["norm", "lm_head"],
    }[name]


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


# ---------------------------------------------------------------------------------------------
# Per-rank breakdown


@dataclasses.dataclass(frozen=True, slots=True)
class RankModel:
    """Everything the planner needs about one pipeline rank."""

    rank: int
    layers: tuple[int, ...]
    static: dict[str, float]
    """Bytes: params, grads, optimizer, slot_pool, comm_buffers."""
    chunk_classes: tuple[dict[str, int], ...]
    """Per local chunk: saved-class name -> instances in that chunk (one micro-batch)."""
    live_points: tuple[tuple[int, ...], ...]
    """Distinct, non-dominated vectors of live micro-batches per chunk along the schedule walk."""
    in_flight_chunks: int
    in_flight_microbatches: float
    compute_s: float
    """Estimated compute time of one step on this rank (forward + backward)."""


def stage_layers(num_layers: int, pp: int, vpp: int, rank: int) -> list[range]:
    """Decoder layers of each chunk of ``rank`` (stage ``c * pp + rank``, even cuts)."""
    n_st = pp * vpp
    cuts = [i * num_layers // n_st for i in range(n_st + 1)]
    return [range(cuts[c * pp + rank], cuts[c * pp + rank + 1]) for c in range(vpp)]


def _live_points(schedule: Schedule, rank: int) -> tuple[tuple[int, ...], ...]:
    live = [0] * schedule.vpp
    points = set()
    for a in schedule.actions[rank]:
        live[a.chunk] += 1 if a.op == "F" else -1
        points.add(tuple(live))
    pts = sorted(points, key=sum, reverse=True)
    kept: list[tuple[int, ...]] = []
    for p in pts:
        if not any(all(x <= y for x, y in zip(p, q)) for q in kept):
            kept.append(p)
    return tuple(kept)


def rank_models(cfg: Any, layout: JobLayout, sizes: ParamSizes, profile: Profile,
                tflops: float = 400.0) -> list[RankModel]:
    """Static bytes, saved-class counts per chunk and schedule live points for every pipeline rank."""
    n, par = cfg.num_hidden_layers, layout.parallel
    layout.check(n, cfg.num_experts)
    sched = build_schedule(layout.schedule, par.pp, layout.microbatches, par.vpp)
    T = layout.tokens()
    E, ep, k = cfg.num_experts, par.ep, cfg.num_experts_per_token
    types = cfg.layer_types()
    out = []
    for r in range(par.pp):
        chunks = stage_layers(n, par.pp, par.vpp, r)
        dense = local_experts = 0
        chunk_classes = []
        active = 0.0
        for c, rng in enumerate(chunks):
            counts: dict[str, int] = {}
            for i in rng:
                dense += (sizes.kda if types[i] == "kda" else sizes.mla) + sizes.norm
                if cfg.is_moe_layer(i):
                    dense += sizes.moe_dense
                    local_experts += (E // ep) * sizes.routed_expert
                    active += k * sizes.routed_expert
                else:
                    dense += sizes.dense_ffn
                for name in profile.layers[i].classes:
                    counts[name] = counts.get(name, 0) + 1
            stage = c * par.pp + r
            if stage == 0:
                dense += sizes.embed
                for name in profile.embed:
                    counts[name] = counts.get(name, 0) + 1
            if stage == par.pp * par.vpp - 1:
                dense += sizes.lm_head
                for name in profile.head:
                    counts[name] = counts.get(name, 0) + 1
            chunk_classes.append(counts)
        active += dense - (sizes.embed if r == 0 else 0)
        has_moe = any(cfg.is_moe_layer(i) for rng in chunks for i in rng)
        params = dense + local_experts
        sharded = dense / (par.dp * ep * par.cp) + local_experts / (par.dp * par.cp)
        slot_pool = (E // ep) * sizes.routed_expert * (layout.param_bytes + 4) if has_moe and ep > 1 else 0
        comm = 0.0
        if ep > 1 and has_moe:
            comm += 2 * 2 * T * k * cfg.routed_expert_hidden_size * layout.act_bytes
        if par.pp > 1:
            comm += 2 * 2 * T * cfg.hidden_size * layout.act_bytes
        if par.dp * par.cp * ep > 1:
            comm += 2 * layout.dp_bucket_mib * 2**20
        static = {
            "params": params * layout.param_bytes,
            "grads": layout.grad_bytes * (sharded if layout.shard_grads else params),
            "optimizer": layout.optim_bytes * sharded,
            "slot_pool": float(slot_pool),
            "comm_buffers": comm,
        }
        chunks_peak, mb_peak = in_flight(sched, r)
        compute = 3 * 2 * active * T * layout.microbatches / (tflops * 1e12)
        out.append(RankModel(r, tuple(i for rng in chunks for i in rng), static, tuple(chunk_classes),
                             _live_points(sched, r), chunks_peak, mb_peak, compute))
    return out


def activation_bytes(rm: RankModel, profile: Profile, choice: dict[str, str], T: int) -> tuple[float, float]:
    """``(device, offloaded)`` peak activation bytes of a rank for a class -> policy choice."""
    per_chunk = []
    for counts in rm.chunk_classes:
        dev = off = 0.0
        for name, cnt in counts.items():
            d, o = profile.classes[name].bytes(choice.get(name, "keep"), T)
            dev += cnt * d
            off += cnt * o
        per_chunk.append((dev, off))
    dev_peak = max(sum(n * per_chunk[c][0] for c, n in enumerate(p)) for p in rm.live_points)
    off_peak = max(sum(n * per_chunk[c][1] for c, n in enumerate(p)) for p in rm.live_points)
    return dev_peak, off_peak


__all__ = [
    "GIB",
    "JobLayout",
    "LayerSpec",
    "ParamSizes",
    "Profile",
    "RankModel",
    "SavedClass",
    "activation_bytes",
    "kernel_profile",
    "layer_class_patterns",
    "rank_models",
    "stage_layers",
    "traced_profile",
    "class_counts",
    "class_of",
    "measure_classes",
    "policy_for_all",
]
