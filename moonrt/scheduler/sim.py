"""The expert-placement simulator behind ``moonrt ep-sim`` (:mod:`moonrt.jobs.ep_sim`, K3_SYSTEMS §6): pure functions.

:func:`simulate` places every step and MoE layer of a workload with each policy and records rank balance, copied
experts, prefetch and dispatch bytes and planner time; :func:`summarize` reduces that to per-policy means,
:func:`format_table` / :func:`format_time_table` print it, :func:`figure` draws it and :func:`plot` saves that.
The command line (flags, memory estimate check, outputs) is the job layer's :mod:`moonrt.jobs.ep_sim`; what the
columns mean is documented there.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from moonrt.scheduler import baselines as bl
from moonrt.scheduler.hardware import HardwareProfile
from moonrt.scheduler.moonep import plan, transfer_matrix
from moonrt.scheduler.steptime import PHASES, layer_time, moonep_traffic, placement_traffic
from moonrt.scheduler.workload import SyntheticStream, TraceStream, Workload, maxvio

WorkloadLike = Workload | SyntheticStream | TraceStream

POLICIES = ("none", "eplb", "eplb-oracle", "moonep")
# K3 sizes (K3_SYSTEMS §1): latent width 3584 crosses ranks; an expert is 3 matrices 3584 x 3072.
K3_LATENT = 3584
K3_EXPERT_PARAMS = 3 * 3584 * 3072


def dedup_rows(tm: np.ndarray, top_k: int) -> np.ndarray:
    """Expected token rows ``[R_src, R_dst]`` when each token is sent once per destination rank (MoonEP dedup).

    ``tm [R_src, R_dst]``: assignments each source sends to each destination (:func:`transfer_matrix`). A
    count-only model (a workload holds counts, not tokens): source r's ``s_r = tm[r].sum() / k`` tokens
    each draw their k destinations independently with probabilities ``q = tm[r] / (s_r k)``, so a token
    reaches d at least once with probability ``1 - (1 - q_d)^k`` and ``s_r (1 - (1 - q_d)^k)`` rows go
    to d. Never more than ``tm`` (equal when k = 1); ``benchmarks/bench_moonep_dedup.py`` compares it with
    the exact count of sampled token routings."""
    tm = np.asarray(tm, dtype=np.float64)
    s = tm.sum(1, keepdims=True) / top_k
    q = np.divide(tm, s * top_k, out=np.zeros_like(tm), where=s > 0)
    return np.minimum(s * (1.0 - (1.0 - q) ** top_k), tm)


def simulate(wl: WorkloadLike, policies: list[str], *, num_slots: int | None = None, eplb_every: int = 4,
             eplb_alpha: float = 0.2, eplb_redundant: int | None = None, token_bytes: int = 2 * K3_LATENT,
             expert_bytes: int = 2 * K3_EXPERT_PARAMS, progress: bool = True, hardware: HardwareProfile | None = None,
             expert_params: int = K3_EXPERT_PARAMS, passes: str = "fwd+bwd") -> dict:
    """Run every policy on every (step, layer) of ``wl``; returns per-step records and per-rank loads.

    ``wl`` is a :class:`Workload`, :class:`SyntheticStream` or :class:`TraceStream`: its counts
    ``[R, E]`` are consumed one (step, layer) at a time, so memory is O(R·E + R²), independent of
    steps x layers (apart from the ``[steps, layers]`` records); time per layer-step is O(R·E) plus
    O(R²) for the rank-to-rank matrices of the step-time model.

    Returns a dict: ``maxvio [steps, layers]``, and per policy ``balance``, ``copies_mean``,
    ``copies_max``, ``prefetch_bytes``, ``token_bytes``, ``plan_s`` (each ``[steps, layers]``
    float64; for ``moonep`` also ``token_rows`` (assignments sent between ranks), ``token_rows_dedup`` and
    ``token_bytes_dedup`` (one row per (token, destination), :func:`dedup_rows`)) and ``loads`` (``[R]``
    rank loads of the last step, layer 0). With ``hardware``, per
    policy also ``time_<phase>`` ``[steps, layers]`` seconds for the phases of
    :func:`moonrt.scheduler.steptime.layer_time` and ``time_total``.
    """
    T, L, R, E = wl.shape
    if eplb_every < 1:
        raise ValueError(f"eplb_every: {eplb_every}, expected >= 1")
    red = E if eplb_redundant is None else eplb_redundant
    keys = ("balance", "copies_mean", "copies_max", "prefetch_bytes", "token_bytes", "plan_s")
    if hardware is not None:
        keys += tuple(f"time_{k}" for k in (*PHASES, "total"))
    out: dict = {"maxvio": np.zeros((T, L))}
    for p in policies:
        out[p] = {k: np.zeros((T, L)) for k in keys + (("token_rows", "token_rows_dedup", "token_bytes_dedup")
                                                        if p == "moonep" else ())}
    home = bl.no_redundancy(E, R)
    ema = [bl.MovingAverage(eplb_alpha) for _ in range(L)]
    # EPLB placements per layer; before any history, EPLB plans from a uniform prediction.
    first = bl.eplb(np.ones(E), R, red) if any(p.startswith("eplb") for p in policies) else home
    placed = {p: [first] * L for p in policies if p.startswith("eplb")}
    timing = dict(num_experts=E, token_bytes=token_bytes, expert_bytes=expert_bytes, expert_params=expert_params,
                  passes=passes)
    with tqdm(total=T, desc="ep-sim", unit="step", disable=not progress) as bar:
        for t, l, counts in wl.layer_steps():
            load = counts.sum(0)
            total = counts.sum()
            mean = total / R if total else 1.0
            rows = counts.sum(1)
            equal = bool((rows == rows[0]).all())
            out["maxvio"][t, l] = maxvio(load)
            for p in policies:
                rec = out[p]
                traffic = None
                if p == "moonep":
                    t0 = time.perf_counter()
                    pl = plan(counts, num_slots, None if equal else int(total) // wl.top_k)
                    rec["plan_s"][t, l] = time.perf_counter() - t0
                    loads = pl.alloc.sum(0)
                    ncp = pl.copies_per_rank()
                    rec["copies_mean"][t, l], rec["copies_max"][t, l] = ncp.mean(), ncp.max()
                    rec["prefetch_bytes"][t, l] = ncp.sum() * expert_bytes
                    tm = transfer_matrix(counts, pl.cuts)
                    rec["token_bytes"][t, l] = (tm.sum() - np.trace(tm)) * token_bytes
                    dd = dedup_rows(tm, wl.top_k)
                    rec["token_rows"][t, l] = tm.sum() - np.trace(tm)
                    rec["token_rows_dedup"][t, l] = dd.sum() - np.trace(dd)
                    rec["token_bytes_dedup"][t, l] = rec["token_rows_dedup"][t, l] * token_bytes
                    if hardware is not None:
                        traffic = moonep_traffic(counts, pl, rec["plan_s"][t, l])
                else:
                    before = None
                    if p == "none":
                        place, moves, dt = home, 0, 0.0
                    else:
                        prev = placed[p]
                        before = prev[l]
                        predicted = None
                        if p == "eplb-oracle":  # perfect prediction: planned from this step's loads
                            predicted = load
                        elif ema[l].value is not None and (t % eplb_every == 0 or prev[l] is first):
                            predicted = ema[l].value
                        place, dt = prev[l], 0.0
                        if predicted is not None:
                            t0 = time.perf_counter()
                            place = bl.eplb(predicted, R, red)
                            dt = time.perf_counter() - t0
                        moves = bl.replica_moves(prev[l], place) if place is not prev[l] else 0
                        prev[l] = place
                    loads = bl.rank_loads(load, place)
                    extra = np.bincount(place.replica_rank, minlength=R) - np.bincount(home.replica_rank, minlength=R)
                    rec["copies_mean"][t, l], rec["copies_max"][t, l] = extra.mean(), extra.max()
                    rec["prefetch_bytes"][t, l] = moves * expert_bytes
                    rec["token_bytes"][t, l] = bl.moved_assignments(counts, place) * token_bytes
                    rec["plan_s"][t, l] = dt
                    if hardware is not None:
                        traffic = placement_traffic(counts, place, before)
                rec["balance"][t, l] = loads.max() / mean
                if traffic is not None:
                    for k, v in layer_time(traffic, hardware, **timing).items():
                        if f"time_{k}" in rec:
                            rec[f"time_{k}"][t, l] = v
                if t == T - 1 and l == 0:
                    rec["loads"] = loads.astype(np.int64)
            ema[l].update(load)
            if l == L - 1:
                bar.update(1)
    return out


def estimate_memory_bytes(num_ranks: int, num_experts: int, steps: int, layers: int, policies: list[str],
                          eplb_redundant: int | None = None, hardware: bool = False) -> int:
    """Peak resident bytes of :func:`simulate` plus ``summary.json`` (an upper estimate, checked
    against measured peak RSS in ``benchmarks/bench_ep_sim_scale.py``): the interpreter with numpy,
    numba and matplotlib; per layer-step temporaries of the workload generator, the planners and
    the byte counters (about 24 ``[R, E]`` 8-byte arrays at once); the MoonEP plan ``[E, 2R + 1]``;
    EPLB's per-layer placements and moving averages; ``[R, R]`` matrices; the ``[steps, layers]``
    records and their JSON text."""
    R, E, T, L = num_ranks, num_experts, steps, layers
    P = E + (E if eplb_redundant is None else eplb_redundant)
    base = 400 << 20
    re = 24 * R * E * 8 + (4 * R * P * 8 if hardware else 0)
    plan_buf = E * (2 * R + 1) * 8 + 2 * R * R * 8
    eplb = L * (4 * P * 8 + 2 * E * 8) if any(p.startswith("eplb") for p in policies) else 0
    rr = (12 if hardware else 2) * R * R * 8
    n_keys = 1 + len(policies) * (6 + (7 if hardware else 0))
    records = T * L * n_keys * (8 + 3 * 28)  # float64 array + list + JSON text (~25 chars a number)
    return int(base + re + plan_buf + eplb + rr + records)


def summarize(res: dict, policies: list[str], warmup: int = 0) -> dict:
    """Per policy over steps ``>= warmup``: balance mean / max, copies per rank mean / max, MB per
    layer-step, plan ms median."""
    s = {}
    for p in policies:
        r = {k: v[warmup:] for k, v in res[p].items() if k != "loads"}
        planned = r["plan_s"][r["plan_s"] > 0]
        s[p] = {
            "balance_mean": float(r["balance"].mean()),
            "balance_max": float(r["balance"].max()),
            "copies_per_rank_mean": float(r["copies_mean"].mean()),
            "copies_per_rank_max": float(r["copies_max"].max()),
            "prefetch_MB_per_layer_step": float(r["prefetch_bytes"].mean() / 1e6),
            "token_MB_per_layer_step": float(r["token_bytes"].mean() / 1e6),
            "plan_ms_median": float(np.median(planned) * 1e3) if planned.size else 0.0,
        }
        if "token_rows_dedup" in r:  # one row per (token, destination rank): the ep-sim model (dedup_rows)
            s[p]["token_rows_per_layer_step"] = float(r["token_rows"].mean())
            s[p]["token_rows_per_layer_step_dedup"] = float(r["token_rows_dedup"].mean())
            s[p]["token_MB_per_layer_step_dedup"] = float(r["token_bytes_dedup"].mean() / 1e6)
        if "time_total" in r:
            s[p]["layer_ms"] = {k: float(r[f"time_{k}"].mean() * 1e3) for k in (*PHASES, "total")}
            s[p]["layer_ms_worst"] = float(r["time_total"].max() * 1e3)
    if "moonep" in s and "layer_ms" in s["moonep"]:
        base = s["moonep"]["layer_ms"]["total"]
        for p in policies:
            s[p]["moonep_speedup"] = s[p]["layer_ms"]["total"] / base if base > 0 else float("nan")
    return s


def format_time_table(summary: dict, hw: HardwareProfile, passes: str) -> str:
    """Estimated MoE layer time per policy (mean over summarized layer-steps), per phase, ms."""
    head = (f"{'policy':<12} {'plan':>7} {'dispatch':>9} {'prefetch':>9} {'gemm':>8} {'combine':>8} "
            f"{'total':>8} {'worst':>8} {'MoonEP speed-up':>16}")
    lines = [f"estimated MoE layer time on {hw.name} ({passes}; {hw.ranks_per_node} ranks/node; "
             f"prefetch {'overlapped with' if hw.overlap_prefetch else 'after'} dispatch), ms per layer:", head,
             "-" * len(head)]
    for p, v in summary.items():
        t = v["layer_ms"]
        sp = f"{v['moonep_speedup']:.2f}x" if "moonep_speedup" in v else "-"
        lines.append(f"{p:<12} {t['plan']:>7.3f} {t['dispatch']:>9.3f} {t['prefetch']:>9.3f} {t['gemm']:>8.3f} "
                     f"{t['combine']:>8.3f} {t['total']:>8.3f} {v['layer_ms_worst']:>8.3f} {sp:>16}")
    lines.append("phases end with their slowest rank; speed-up = policy total / MoonEP total (mean over layer-steps)")
    return "\n".join(lines)


def format_table(summary: dict, maxvio_mean: float, warmup: int = 0) -> str:
    head = (f"{'policy':<12} {'balance':>8} {'worst':>8} {'copies/rank':>12} {'max':>5} "
            f"{'prefetch MB':>12} {'tokens MB':>10} {'plan ms':>9}")
    lines = [f"routing maxvio (mean over steps and layers): {maxvio_mean:.2f}", head, "-" * len(head)]
    for p, v in summary.items():
        lines.append(f"{p:<12} {v['balance_mean']:>8.3f} {v['balance_max']:>8.3f} {v['copies_per_rank_mean']:>12.2f} "
                     f"{v['copies_per_rank_max']:>5.0f} {v['prefetch_MB_per_layer_step']:>12.1f} "
                     f"{v['token_MB_per_layer_step']:>10.1f} {v['plan_ms_median']:>9.3f}")
    lines.append(f"balance = max rank load / mean (mean and worst over steps >= {warmup} x layers); "
                 "MB per layer-step; tokens = dispatch bytes between ranks; plan ms = median per layer plan")
    m = summary.get("moonep", {})
    if "token_rows_per_layer_step_dedup" in m:
        lines.append(f"moonep, one row per (token, destination rank) (parallel.ep_dedup, modelled from counts): "
                     f"{m['token_rows_per_layer_step_dedup']:.0f} rows / {m['token_MB_per_layer_step_dedup']:.1f} MB "
                     f"per layer-step vs {m['token_rows_per_layer_step']:.0f} / {m['token_MB_per_layer_step']:.1f} "
                     "per assignment")
    return "\n".join(lines)


# One style per policy, shared by both panels of :func:`figure`. MoonEP and the EPLB oracle both sit near balance 1
# and the mean load: MoonEP is a wide solid line under a dashed, marked oracle line, so either stays visible.
POLICY_STYLE = {
    "none": dict(color="#8c8c8c", ls="-", marker="o", lw=1.4, zorder=2),
    "eplb": dict(color="#dd8452", ls="-", marker="s", lw=1.4, zorder=3),
    "eplb-oracle": dict(color="#4c72b0", ls="--", marker="^", lw=1.4, zorder=5),
    "moonep": dict(color="#c44e52", ls="-", marker="", lw=3.2, zorder=4, alpha=0.85),
}


def _labels(series: dict[str, np.ndarray], policies: list[str]) -> dict[str, str]:
    """Legend label per policy, naming an earlier policy whose series it equals (to 1e-9): ``"x (= y)"``."""
    out = {}
    for i, p in enumerate(policies):
        same = [q for q in policies[:i] if series[q].shape == series[p].shape
                and np.allclose(series[q], series[p], rtol=0, atol=1e-9)]
        out[p] = f"{p} (= {same[0]})" if same else p
    return out


def figure(res: dict, policies: list[str], title: str):
    """The ep-sim figure (a :class:`matplotlib.figure.Figure`, not saved): left, rank balance per step (mean over
    layers) per policy; right, per-rank loads of the last step, layer 0 (``none`` as bars, the others as steps).
    A policy has one :data:`POLICY_STYLE` colour and marker (on about 16-24 points) in both panels; a policy whose
    series equals an earlier one's says so in its legend label (``eplb-oracle (= moonep)``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    a, b = fig.subplots(1, 2)
    bal = {p: res[p]["balance"].mean(1) for p in policies}
    lab = _labels(bal, policies)
    for p in policies:
        st = POLICY_STYLE.get(p, {})
        a.plot(np.arange(bal[p].shape[0]), bal[p], label=lab[p], markersize=4,
               markevery=max(1, bal[p].shape[0] // 24), **st)
    a.axhline(1.0, color="k", lw=0.5, zorder=1)
    a.set_xlabel("step")
    a.set_ylabel("rank balance (max / mean, mean over layers)")
    a.set_title("rank balance per step")
    a.legend(fontsize=9)
    R = res[policies[0]]["loads"].shape[0]
    x = np.arange(R)
    loads = {p: res[p]["loads"] for p in policies}
    lab = _labels(loads, policies)
    for p in policies:
        st = dict(POLICY_STYLE.get(p, {}))
        if p == "none":
            b.bar(x, loads[p], width=0.9, color=st["color"], label=f"{lab[p]} (before)", zorder=1)
        else:
            b.step(x, loads[p], where="mid", label=lab[p], markersize=4, markevery=max(1, R // 16), **st)
    b.axhline(loads[policies[0]].mean(), color="k", lw=0.6, ls=":", label="mean", zorder=6)
    b.set_xlabel("rank")
    b.set_ylabel("assignments computed")
    b.set_title(f"per-rank load, last step ({res['maxvio'].shape[0] - 1}), layer 0")
    b.legend(fontsize=9)
    fig.suptitle(title)
    return fig


def plot(res: dict, policies: list[str], path: Path | BinaryIO, title: str) -> None:
    """:func:`figure` as PNG to ``path`` (a file name or an open binary file)."""
    figure(res, policies, title).savefig(path, dpi=110, format="png")
