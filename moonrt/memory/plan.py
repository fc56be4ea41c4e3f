"""Memory-budget planner (K3_SYSTEMS §8 "Memory-budget planning", §10); its command line is the job
``moonrt mem-plan`` (:mod:`moonrt.jobs.mem_plan`); the table, JSON and plot of a plan are in
:mod:`moonrt.memory.plan_report`.

``plan_memory(...)`` is a pure function: from a model config, a :class:`JobLayout`, parameter sizes and an
activation profile supplied by the model's client (:mod:`moonrt.models`; the planner never imports the
model) and a :class:`Hardware` budget it chooses, per pipeline rank and saved-tensor
class, one storage policy among keep / recompute / FP8 / host / disk / remote (and FP8 compositions), those of
the caller's ``tiers`` only, minimizing the added step time, subject to:

- device: ``static_r + activations_r(point) + remote_in_r <= budget - reserve`` at every point of the
  rank's schedule walk (:func:`moonrt.memory.model_memory.rank_models`);
- host / disk capacity per rank at every point; remote offload goes to the mirror rank
  ``pp - 1 - r`` (interleaved 1F1B loads the first ranks most, K3_SYSTEMS §8) and counts against its
  budget;
- copy bandwidth: each offloaded byte crosses the link twice per micro-batch; the part of that
  copy time that exceeds the rank's compute time is exposed (added) time.

Objective: the largest added time over ranks (the pipeline waits for the slowest), plus a small
weight on their sum. A small ILP solved by PuLP with HiGHS; :func:`greedy` is the fallback (local
tiers only). An infeasible budget is answered with the minimum budget (the same ILP minimizing the
budget, rounded up to 0.1 GiB once: :func:`round_up_gib`) and the term that dominates on the worst rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Collection
from typing import Any

from moonrt.memory.model_memory import (
    GIB,
    JobLayout,
    ParamSizes,
    Profile,
    RankModel,
    activation_bytes,
    rank_models,
)


@dataclasses.dataclass(kw_only=True, slots=True)
class Hardware:
    """Per-rank device and host resources (defaults: an H100/H200-class node, 8 GPUs, 2 TB host)."""

    budget_gib: float = 80.0
    reserve_gib: float | None = None
    """Kept free for allocator fragmentation, kernels' workspaces and transient reloads; None: 5% of the
    budget, at most 4 GiB (:func:`default_reserve`)."""
    host_gib: float = 200.0
    host_gbs: float = 50.0
    remote_gbs: float = 150.0
    disk_gib: float = 0.0
    """NVMe per rank; 0 disables the disk tier."""
    disk_gbs: float = 5.0
    tflops: float = 400.0
    """Effective dense bf16 throughput (sets compute time: the overlap window and recompute cost)."""
    hbm_gbs: float = 3000.0

    def __post_init__(self) -> None:
        if self.reserve_gib is None:
            self.reserve_gib = default_reserve(self.budget_gib)


def default_reserve(budget_gib: float) -> float:
    """Default device memory kept free: 5% of the budget, at most 4 GiB."""
    return min(4.0, 0.05 * budget_gib)


@dataclasses.dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    layers: tuple[int, ...]
    static: dict[str, float]
    activations_keep: float
    activations: float
    host: float
    disk: float
    remote_out: float
    remote_in: float
    choice: dict[str, str]
    added_s: float
    compute_s: float
    in_flight_chunks: int
    in_flight_microbatches: float
    class_layers: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Decoder layers of this rank holding each class (for the policy's per-layer rules)."""

    @property
    def total(self) -> float:
        return sum(self.static.values()) + self.activations + self.remote_in


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    feasible: bool
    solver: str
    solve_s: float
    budget_gib: float
    ranks: tuple[RankPlan, ...]
    min_budget_gib: float | None = None
    dominating: str | None = None
    message: str = ""


TIERS = ("keep", "recompute", "fp8", "host", "disk", "remote")
"""The storage tiers a plan may choose from; a policy is one of them or ``fp8+`` an offload tier."""


def round_up_gib(gib: float) -> float:
    """``gib`` rounded up to 0.1 GiB: the one rounding every printed minimum budget uses (rounded up, so that the
    printed figure fits)."""
    return math.ceil(round(gib * 10, 6)) / 10


def _policies(layout: JobLayout, hw: Hardware, tiers: frozenset[str] = frozenset(TIERS)) -> list[str]:
    """The policies a plan may choose: keep, and each of ``tiers``' policies the hardware and layout allow (disk
    with ``disk_gib > 0``, remote with a peer pipeline rank), ``fp8+`` an allowed offload tier when fp8 is allowed."""
    pols = ["keep", "recompute", "fp8", "host", "fp8+host"]
    if hw.disk_gib > 0:
        pols += ["disk", "fp8+disk"]
    if layout.parallel.pp > 1:
        pols += ["remote", "fp8+remote"]
    return [p for p in pols if all(part in tiers for part in p.split("+"))]


def _tier(policy: str) -> str | None:
    t = policy.split("+")[-1]
    return t if t in ("host", "disk", "remote") else None


def _costs(profile: Profile, name: str, policy: str, T: int, m: int, count: int, hw: Hardware) -> float:
    """Added seconds per step (not counting copy time) of ``count`` instances of class ``name``."""
    cls = profile.classes[name]
    if policy == "recompute":
        return count * m * cls.flops(T) / (hw.tflops * 1e12)
    if policy.startswith("fp8"):
        return count * m * 2 * cls.bytes("keep", T)[0] / (hw.hbm_gbs * 1e9)
    return 0.0


@contextlib.contextmanager
def _quiet():
    """Silence the solver's banner (it writes to fd 1 directly)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solve_ilp(rms: list[RankModel], profile: Profile, layout: JobLayout, hw: Hardware,
               minimize_budget: bool, tiers: frozenset[str]) -> tuple[dict[int, dict[str, str]], float] | None:
    import warnings

    import pulp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3 warns on the classic LpVariable API
        return _build_and_solve(pulp, rms, profile, layout, hw, minimize_budget, tiers)


def _build_and_solve(pulp: Any, rms: list[RankModel], profile: Profile, layout: JobLayout, hw: Hardware,
                     minimize_budget: bool, tiers: frozenset[str]) -> tuple[dict[int, dict[str, str]], float] | None:
    T, m = layout.tokens(), layout.parallel.microbatches
    pols = _policies(layout, hw, tiers)
    prob = pulp.LpProblem("memplan", pulp.LpMinimize)
    x: dict[tuple[int, str, str], Any] = {}
    budget = (hw.budget_gib - hw.reserve_gib) if not minimize_budget else pulp.LpVariable("budget", 0)
    Z = pulp.LpVariable("Z", 0)
    added = {}
    rout = {r.rank: pulp.LpVariable(f"rout_{r.rank}", 0) for r in rms}
    pdev = {r.rank: pulp.LpVariable(f"pdev_{r.rank}", 0) for r in rms}
    peer = {r.rank: layout.parallel.pp - 1 - r.rank for r in rms}
    for rm in rms:
        r = rm.rank
        names = sorted({n for cc in rm.chunk_classes for n in cc})
        totals = {n: sum(cc.get(n, 0) for cc in rm.chunk_classes) for n in names}
        for n in names:
            allowed = [p for p in pols if not (_tier(p) == "remote" and peer[r] == r)]
            for p in allowed:
                x[r, n, p] = pulp.LpVariable(f"x_{r}_{n.replace('.', '_')}_{p.replace('+', '_')}", cat="Binary")
            prob += pulp.lpSum(x[r, n, p] for p in allowed) == 1

        def chunk_expr(counts: dict[str, int], tier: str | None, rank: int = r) -> Any:
            terms = []
            for n, cnt in counts.items():
                for p in pols:
                    if (rank, n, p) not in x:
                        continue
                    d, o = profile.classes[n].bytes(p, T)
                    v = d if tier is None else (o if _tier(p) == tier else 0.0)
                    if v:
                        terms.append(cnt * v / GIB * x[rank, n, p])
            return pulp.lpSum(terms)

        dev_c = [chunk_expr(cc, None) for cc in rm.chunk_classes]
        off = {t: [chunk_expr(cc, t) for cc in rm.chunk_classes] for t in ("host", "disk", "remote")}
        for pt in rm.live_points:
            prob += pulp.lpSum(k * dev_c[c] for c, k in enumerate(pt) if k) <= pdev[r]
            prob += pulp.lpSum(k * off["host"][c] for c, k in enumerate(pt) if k) <= hw.host_gib
            prob += pulp.lpSum(k * off["disk"][c] for c, k in enumerate(pt) if k) <= hw.disk_gib
            prob += pulp.lpSum(k * off["remote"][c] for c, k in enumerate(pt) if k) <= rout[r]
        # time: recompute + fp8 passes, plus copy time beyond the compute window per tier
        base = pulp.lpSum(_costs(profile, n, p, T, m, totals[n], hw) * x[r, n, p]
                          for n in names for p in pols if (r, n, p) in x)
        exposed = []
        for tier, bw in (("host", hw.host_gbs), ("disk", hw.disk_gbs), ("remote", hw.remote_gbs)):
            e = pulp.LpVariable(f"exp_{tier}_{r}", 0)
            traffic = pulp.lpSum(2 * m * totals[n] * profile.classes[n].bytes(p, T)[1] / (bw * 1e9) * x[r, n, p]
                                 for n in names for p in pols if (r, n, p) in x and _tier(p) == tier)
            prob += e >= traffic - rm.compute_s
            exposed.append(e)
        added[r] = base + pulp.lpSum(exposed)
        prob += Z >= added[r]
    for rm in rms:
        r = rm.rank
        src = [q for q in peer if peer[q] == r and q != r]
        prob += sum(rm.static.values()) / GIB + pdev[r] + pulp.lpSum(rout[q] for q in src) <= budget
    if minimize_budget:
        prob += budget + 1e-6 * Z
    else:
        prob += Z + 1e-3 * pulp.lpSum(added.values())
    highs = pulp.HiGHS(msg=False, timeLimit=20)
    if not highs.available():
        raise RuntimeError("HiGHS is not available to PuLP (pip install highspy)")
    with _quiet():
        status = prob.solve(highs)
    if pulp.LpStatus[status] == "Infeasible":
        return None
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"ILP ended with status {pulp.LpStatus[status]}")
    choice: dict[int, dict[str, str]] = {}
    for (r, n, p), var in x.items():
        if (var.value() or 0) > 0.5:
            choice.setdefault(r, {})[n] = p
    value = budget.value() if minimize_budget else Z.value()
    return choice, float(value or 0.0)


def greedy(rms: list[RankModel], profile: Profile, layout: JobLayout, hw: Hardware,
           tiers: frozenset[str] = frozenset(TIERS)) -> dict[int, dict[str, str]]:
    """Fallback: per rank, repeatedly take the move with the most device bytes saved per added
    second (local tiers of ``tiers`` only, host/disk capacity respected) until the rank fits."""
    T, m = layout.tokens(), layout.parallel.microbatches
    pols = [p for p in _policies(layout, hw, tiers) if _tier(p) != "remote"]
    out = {}
    for rm in rms:
        names = sorted({n for cc in rm.chunk_classes for n in cc})
        totals = {n: sum(cc.get(n, 0) for cc in rm.chunk_classes) for n in names}
        choice = dict.fromkeys(names, "keep")
        cap = (hw.budget_gib - hw.reserve_gib) * GIB - sum(rm.static.values())

        def state(ch: dict[str, str], rm: RankModel = rm) -> tuple[float, dict[str, float]]:
            dev, _ = activation_bytes(rm, profile, ch, T)
            used = {}
            for tier in ("host", "disk"):
                sub = {n: (p if _tier(p) == tier else "keep") for n, p in ch.items()}
                only = {n: p for n, p in sub.items() if p != "keep"}
                used[tier] = activation_bytes(rm, profile, only, T)[1] if only else 0.0
            return dev, used

        def cost(ch: dict[str, str], rm: RankModel = rm, totals: dict[str, int] = totals) -> float:
            t = sum(_costs(profile, n, p, T, m, totals[n], hw) for n, p in ch.items())
            for tier, bw in (("host", hw.host_gbs), ("disk", hw.disk_gbs)):
                traffic = sum(2 * m * totals[n] * profile.classes[n].bytes(p, T)[1] / (bw * 1e9)
                              for n, p in ch.items() if _tier(p) == tier)
                t += max(0.0, traffic - rm.compute_s)
            return t

        dev, _ = state(choice)
        while dev > cap:
            best = None
            for n in names:
                for p in pols:
                    if p == choice[n]:
                        continue
                    trial = dict(choice, **{n: p})
                    d2, used = state(trial)
                    if d2 >= dev or used["host"] > hw.host_gib * GIB or used["disk"] > hw.disk_gib * GIB:
                        continue
                    score = (dev - d2) / (cost(trial) - cost(choice) + 1e-9)
                    if best is None or score > best[0]:
                        best = (score, trial, d2)
            if best is None:
                break
            _, choice, dev = best
        out[rm.rank] = choice
    return out


def _rank_plans(rms: list[RankModel], profile: Profile, layout: JobLayout, hw: Hardware,
                choice: dict[int, dict[str, str]]) -> list[RankPlan]:
    T, m = layout.tokens(), layout.parallel.microbatches
    plans = []
    remote_out = {}
    for rm in rms:
        ch = choice.get(rm.rank, {})
        remote_out[rm.rank] = activation_bytes(rm, profile, {n: p for n, p in ch.items() if _tier(p) == "remote"},
                                               T)[1]
    for rm in rms:
        ch = choice.get(rm.rank, {})
        keep, _ = activation_bytes(rm, profile, {}, T)
        dev, _ = activation_bytes(rm, profile, ch, T)
        tier_b = {t: activation_bytes(rm, profile, {n: p for n, p in ch.items() if _tier(p) == t}, T)[1]
                  for t in ("host", "disk")}
        totals = {n: sum(cc.get(n, 0) for cc in rm.chunk_classes) for n in ch}
        added = sum(_costs(profile, n, p, T, m, totals[n], hw) for n, p in ch.items())
        for tier, bw in (("host", hw.host_gbs), ("disk", hw.disk_gbs), ("remote", hw.remote_gbs)):
            traffic = sum(2 * m * totals[n] * profile.classes[n].bytes(p, T)[1] / (bw * 1e9)
                          for n, p in ch.items() if _tier(p) == tier)
            added += max(0.0, traffic - rm.compute_s)
        src = layout.parallel.pp - 1 - rm.rank
        rin = remote_out[src] if src != rm.rank else 0.0
        cl = {n: tuple(i for i in rm.layers if n in profile.layers[i].classes) for n in ch}
        plans.append(RankPlan(rm.rank, rm.layers, dict(rm.static), keep, dev, tier_b["host"], tier_b["disk"],
                              remote_out[rm.rank], rin, dict(ch), added, rm.compute_s, rm.in_flight_chunks,
                              rm.in_flight_microbatches, cl))
    return plans


def plan_memory(cfg: Any, layout: JobLayout, sizes: ParamSizes, hw: Hardware, profile: Profile,
                solver: str = "highs", tiers: Collection[str] = TIERS) -> Plan:
    """Choose storage policies per rank and class under ``hw.budget_gib`` (see module docstring), each policy made
    of ``tiers`` only (keep always; :data:`TIERS` by default; ``moonrt mem-plan`` passes the tiers ``moonrt train``
    runs).

    ``cfg`` is read only through its structural fields (:func:`~moonrt.memory.model_memory.rank_models`);
    ``sizes`` and ``profile`` describe the model (its ``ModelSpec.memory``: for K3 ``param_sizes`` /
    ``memory_profile``)."""
    if solver not in ("highs", "greedy"):
        raise ValueError(f"solver = {solver!r}: expected 'highs' or 'greedy'")
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise ValueError(f"tiers = {unknown[0]!r}: expected some of {', '.join(TIERS)}")
    tiers = frozenset(tiers) | {"keep"}
    if not (math.isfinite(hw.budget_gib) and hw.budget_gib > 0):
        raise ValueError(f"budget_gib = {hw.budget_gib}: expected a positive number of GiB")
    for name in ("reserve_gib", "host_gib", "disk_gib"):
        v = getattr(hw, name)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} = {v}: expected a finite number >= 0")
    for name in ("host_gbs", "remote_gbs", "disk_gbs", "tflops", "hbm_gbs"):
        v = getattr(hw, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} = {v}: expected a finite number > 0")
    if hw.reserve_gib >= hw.budget_gib:
        raise ValueError(f"reserve_gib = {hw.reserve_gib:g}: expected less than the budget ({hw.budget_gib:g} GiB); "
                         "the reserve is device memory kept free for allocator fragmentation and workspaces")
    t0 = time.perf_counter()
    rms = rank_models(cfg, layout, sizes, profile, hw.tflops)
    cap = hw.budget_gib - hw.reserve_gib
    worst = max(rms, key=lambda r: r.static["params"])
    if worst.static["params"] / GIB > cap:
        need = sum(worst.static.values()) / GIB + hw.reserve_gib
        msg = (f"budget {hw.budget_gib:g} GiB minus the reserve {hw.reserve_gib:g} GiB (kept free for allocator "
               f"fragmentation and workspaces, --reserve-gib) leaves {cap:.2f} GiB, below the parameter memory of "
               f"rank {worst.rank} ({worst.static['params'] / GIB:.2f} GiB of {layout.param_bytes}-byte weights; "
               f"{need:.2f} GiB with gradients, optimizer states, buffers and the reserve before any activation): "
               f"raise pp/ep or the budget")
        return Plan(False, solver, time.perf_counter() - t0, hw.budget_gib,
                    tuple(_rank_plans(rms, profile, layout, hw, {})), need, "params", msg)
    used = solver
    if solver == "highs":
        try:
            result = _solve_ilp(rms, profile, layout, hw, minimize_budget=False, tiers=tiers)
        except (ImportError, RuntimeError) as exc:  # solver missing or failed: fall back
            result, used = None, f"greedy (ILP: {exc})"
            choice = greedy(rms, profile, layout, hw, tiers)
        else:
            choice = result[0] if result is not None else {}
    else:
        choice = greedy(rms, profile, layout, hw, tiers)
    ranks = _rank_plans(rms, profile, layout, hw, choice)
    feasible = bool(choice) and all(r.total <= cap * GIB * (1 + 1e-6) and r.host <= hw.host_gib * GIB * (1 + 1e-6)
                                    for r in ranks)
    if feasible:
        return Plan(True, used, time.perf_counter() - t0, hw.budget_gib, tuple(ranks),
                    message=f"fits {hw.budget_gib:g} GiB")
    try:
        mb = _solve_ilp(rms, profile, layout, hw, minimize_budget=True, tiers=tiers)
    except (ImportError, RuntimeError):
        mb = None
    min_budget = round_up_gib(mb[1] + hw.reserve_gib) if mb else None  # the figure every output prints
    if mb:
        ranks = _rank_plans(rms, profile, layout, hw, mb[0])
    w = max(ranks, key=lambda r: r.total)
    terms = dict(w.static, activations=w.activations, remote_in=w.remote_in)
    dom = max(terms, key=terms.get)
    if min_budget:
        msg = (f"does not fit {hw.budget_gib:g} GiB: minimum budget {min_budget:.1f} GiB (table: the plan at that "
               f"budget)")
    else:
        msg = f"does not fit {hw.budget_gib:g} GiB even with every class offloaded or recomputed"
    msg += f"; on rank {w.rank} the largest term is {dom} ({terms[dom] / GIB:.1f} GiB)"
    return Plan(False, used, time.perf_counter() - t0, hw.budget_gib, tuple(ranks), min_budget, dom, msg)


__all__ = ["TIERS", "Hardware", "Plan", "RankPlan", "default_reserve", "greedy", "plan_memory", "round_up_gib"]
