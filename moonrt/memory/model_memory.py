"""Memory model of a training job per pipeline rank (K3_SYSTEMS §1, §6, §8, §10).

Pure functions of a model config (read only through ``num_hidden_layers``, ``num_experts``,
``num_experts_per_token``, ``hidden_size`` and ``routed_expert_hidden_size``), a :class:`JobLayout`,
per-layer parameter counts (:class:`ParamSizes`) and a per-layer activation :class:`Profile`, both
supplied by the caller (for K3: :mod:`moonrt.models.k3.memory`, reached through the
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

The profiles themselves are the model client's: for K3, :mod:`moonrt.models.k3.memory` (analytic formulas,
the fused-kernel estimate) and :mod:`moonrt.models.k3.memory_trace` (measured under the activation manager).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moonrt.config import ParallelConfig
from moonrt.scheduler.pipeline import Schedule, build_schedule, in_flight

GIB = 2**30
OFFLOAD = ("host", "disk", "remote", "fp8+host", "fp8+disk", "fp8+remote")


@dataclasses.dataclass(kw_only=True, slots=True)
class JobLayout:
    """Parallel layout and batch of the job being planned (K3_SYSTEMS §10)."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The same config a training job holds: degrees (``dp``, ``pp``, ``vpp``, ``ep``, ``cp``), micro-batches
    per step (``microbatches``) and the pipeline schedule (``pipeline_schedule``: gpipe, 1f1b, interleaved)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    seq_len: int = 4096
    act_bytes: int = 2
    """Bytes per activation element (bf16)."""
    param_bytes: int = 2
    grad_bytes: int = 4
    optim_bytes: int = 12
    """Train-state bytes per parameter: held parameters, gradients, optimizer state (sharded by ZeRO-1). These
    defaults are Megatron's bf16 layout (bf16 parameters, fp32 gradients, fp32 main copy + two AdamW moments), kept
    for planning such jobs; ``moonrt mem-plan`` plans ``moonrt train``'s own AMP layout instead (4 / 4 / 8 for
    AdamW, 4 / 4 / 4 for Muon: ``moonrt.jobs.train.config.train_state_bytes``)."""
    qat_bytes: int = 0
    """Quantization-aware training (``moonrt mem-plan --qat mxfp4``): bytes per element of a fake-quantized weight
    copy (4: the fp32 values of the MXFP4 weights; 0: no QAT). The master weights are the parameters (``param_bytes``,
    no second copy). The QAT nodes (the routed experts' grouped GEMM, the shared experts' ``qat_linear``) save the
    parameters and quantize them again in backward, so only one layer's copies exist at a time: the rank's largest
    layer's quantized weights, ``static["qat_fake_quant"]``. (The quantized inputs they save replace the inputs a
    plain layer saves: the same bytes, counted in the activations.)"""
    shard_grads: bool = False
    """fp32 gradients sharded like the optimizer states (reduce-scattered per bucket), else full per rank."""
    dp_bucket_mib: float = 512.0
    """DP gradient reduce-scatter buckets (two in flight)."""

    def tokens(self) -> int:
        """Tokens per micro-batch on one rank: ``micro_batch_size * seq_len / cp``."""
        return self.micro_batch_size * self.seq_len // self.parallel.cp

    def check(self, num_layers: int, num_experts: int) -> None:
        """Raise ValueError naming the first bad field. Only the degrees of ``parallel`` are read (not the
        training job's rules in ``ParallelConfig.validate``: a plan may have ``pp = 1`` with several
        micro-batches, i.e. gradient accumulation)."""
        par = self.parallel
        fields = {n: getattr(par, n) for n in ("dp", "pp", "vpp", "ep", "cp")}
        fields["microbatches"] = par.microbatches
        fields.update((n, getattr(self, n)) for n in ("micro_batch_size", "seq_len"))
        for name, v in fields.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r}: expected an integer >= 1")
        if self.seq_len % par.cp:
            raise ValueError(f"seq_len = {self.seq_len}: expected a multiple of cp ({par.cp})")
        if num_experts % par.ep:
            raise ValueError(f"ep = {par.ep}: expected a divisor of num_experts ({num_experts})")
        if par.pp * par.vpp > num_layers:
            raise ValueError(f"pp * vpp = {par.pp * par.vpp}: expected <= num_hidden_layers ({num_layers})")
        schedule = par.pipeline_schedule
        if schedule == "interleaved" and par.vpp < 2:
            raise ValueError(f"vpp = {par.vpp}: expected >= 2 for schedule 'interleaved'")
        if schedule != "interleaved" and par.vpp != 1:
            raise ValueError(f"vpp = {par.vpp}: expected 1 for schedule {schedule!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSizes:
    """Parameter counts the planner places on pipeline ranks, supplied by the model's client (for K3:
    :func:`moonrt.models.k3.memory.param_sizes`). ``[L]`` tuples are per decoder layer."""

    layers: tuple[int, ...]
    """[L] parameters of each decoder layer that every rank of its stage holds whole: attention, norms, and
    the dense FFN or the always-active part of a MoE layer (router, shared experts, ...)."""
    expert: tuple[int, ...]
    """[L] parameters of one routed expert of each layer (0: a dense layer); ``num_experts / ep`` of them
    per EP rank, and as many slot copies in the MoonEP slot pool."""
    embed: int
    """The input embedding (held by the first stage; read by lookup, so not counted as compute)."""
    lm_head: int
    """What the last stage holds after the last decoder layer (final norms, output projection)."""
    qat_layers: tuple[int, ...] = ()
    """[L] parameters of ``layers[i]`` that quantization-aware training fake-quantizes (K3: the shared experts);
    empty: none."""
    qat_experts: bool = False
    """Whether quantization-aware training fake-quantizes the routed experts (K3: yes)."""


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
    if len(sizes.layers) != n or len(sizes.expert) != n:
        raise ValueError(f"sizes: {len(sizes.layers)} layers and {len(sizes.expert)} expert sizes; expected "
                         f"num_hidden_layers ({n}) of each")
    sched = build_schedule(par.pipeline_schedule, par.pp, par.microbatches, par.vpp)
    T = layout.tokens()
    E, ep, k = cfg.num_experts, par.ep, cfg.num_experts_per_token
    out = []
    for r in range(par.pp):
        chunks = stage_layers(n, par.pp, par.vpp, r)
        dense = local_experts = 0
        chunk_classes = []
        active = 0.0
        for c, rng in enumerate(chunks):
            counts: dict[str, int] = {}
            for i in rng:
                dense += sizes.layers[i]
                if sizes.expert[i]:
                    local_experts += (E // ep) * sizes.expert[i]
                    active += k * sizes.expert[i]
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
        expert = max(sizes.expert[i] for rng in chunks for i in rng)  # the slot pool is sized for the largest
        has_moe = expert > 0
        params = dense + local_experts
        sharded = dense / (par.dp * ep * par.cp) + local_experts / (par.dp * par.cp)
        slot_pool = (E // ep) * expert * (layout.param_bytes + 4) if has_moe and ep > 1 else 0
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
        if layout.qat_bytes:
            mine = [i for rng in chunks for i in rng]
            static["qat_fake_quant"] = float(layout.qat_bytes * max(
                ((E // ep) * sizes.expert[i] if sizes.qat_experts else 0) + (sizes.qat_layers[i] if sizes.qat_layers
                                                                            else 0) for i in mine))
        compute = 3 * 2 * active * T * par.microbatches / (tflops * 1e12)
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
    "rank_models",
    "stage_layers",
]
