"""Benchmark the MoonEP planner against placement baselines at K3 size (K3_SYSTEMS §6).

E=896, R=64, k=16, s=4096, lognormal and zipf expert popularity with ±30% per-step drift. For each
policy: rank balance (max/mean; MoonEP must be exactly 1.000), copies per rank, and plan time per
layer; MoonEP's and EPLB's planners are timed side by side on the same counts in one run (median
over steps x layers, each the median of --repeat calls). Then the greedy's optimality gap against
the MILP oracle (HiGHS) on small random cases.

    .venv/bin/python benchmarks/bench_moonep_plan.py [--out /tmp/moonrt-bench/bench_moonep_plan.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moonrt.scheduler import baselines as bl
from moonrt.scheduler.lp import solve_placement
from moonrt.scheduler.moonep import plan
from moonrt.scheduler.moonep_torch import plan_torch
from moonrt.scheduler.sim import simulate, summarize
from moonrt.scheduler.workload import synthetic


def _median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_planners(wl, repeat: int, alpha: float) -> dict:
    """Per (step >= 1, layer): MoonEP plan (median of ``repeat``) vs EPLB from the moving average, interleaved."""
    T, L, R, E = wl.shape
    ema = [bl.MovingAverage(alpha) for _ in range(L)]
    moon, eplb, moon_torch = [], [], []
    for t in range(T):
        for l in range(L):
            c = wl.counts[t, l]
            if ema[l].value is not None:
                pred = ema[l].value
                moon.append(_median_time(lambda c=c: plan(c), repeat))
                eplb.append(_median_time(lambda pred=pred: bl.eplb(pred, R, E), max(1, repeat // 10)))
                if len(moon_torch) < 4:
                    ct = torch.from_numpy(c)
                    moon_torch.append(_median_time(lambda ct=ct: plan_torch(ct, validate=False), 3))
            ema[l].update(c.sum(0))
    return {"moonep_ms": np.array(moon) * 1e3, "eplb_ms": np.array(eplb) * 1e3,
            "moonep_torch_cpu_ms": np.array(moon_torch) * 1e3}


def lp_gaps(cases: int, time_limit: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in tqdm(range(cases), desc="greedy vs LP", unit="case"):
        R = int(rng.choice([2, 3, 4, 6, 8]))
        G = int(rng.choice([2, 3, 4, 6, 8]))
        if R * G > 64:
            G = 64 // R
        E = R * G
        kind = ("lognormal", "zipf", "hot")[i % 3]
        if kind == "lognormal":
            p = rng.lognormal(0.0, 1.5, E)
        elif kind == "zipf":
            p = rng.permutation(1.0 / np.arange(1, E + 1) ** 1.2)
        else:
            p = np.full(E, 0.2 / E)
            p[rng.integers(E)] += 0.8
        k = int(rng.integers(1, min(8, E) + 1))
        counts = rng.multinomial(int(rng.integers(4, 64)) * k, p / p.sum(), size=R).astype(np.int64)
        g = plan(counts).num_copies()
        res = solve_placement(counts, time_limit=time_limit)
        rows.append({"R": R, "E": E, "kind": kind, "greedy": g, "lp": res.num_copies, "status": res.status,
                     "bound": res.bound, "lp_s": res.seconds})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--drift", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per layer (median)")
    ap.add_argument("--lp-cases", type=int, default=40)
    ap.add_argument("--lp-time-limit", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moonrt-bench/bench_moonep_plan.json"))
    args = ap.parse_args()

    plan(np.ones((2, 4), np.int64))  # numba JIT / cache load, paid once outside the timings
    policies = ["none", "eplb", "eplb-oracle", "moonep"]
    report: dict = {"config": vars(args) | {"out": str(args.out)}, "workloads": {}}
    ok = True
    for kind in ("lognormal", "zipf"):
        wl = synthetic(kind, num_experts=args.experts, num_ranks=args.ranks, top_k=args.top_k,
                       tokens_per_rank=args.tokens, steps=args.steps, layers=args.layers, drift=args.drift,
                       seed=args.seed)
        res = simulate(wl, policies, eplb_every=1, progress=True)
        summ = summarize(res, policies, warmup=1)
        tim = time_planners(wl, args.repeat, 0.2)
        m_med, e_med = float(np.median(tim["moonep_ms"])), float(np.median(tim["eplb_ms"]))
        exact = bool((res["moonep"]["balance"] == 1.0).all())
        ok &= exact and m_med <= 1.0 and e_med / m_med >= 100
        print(f"\n{wl.name}: E={args.experts} R={args.ranks} k={args.top_k} s={args.tokens}, "
              f"{args.steps - 1} steps x {args.layers} layers (after 1 warm-up step)")
        print(f"{'policy':<12} {'balance mean':>12} {'worst':>7} {'copies/rank':>11} {'max':>4} {'plan ms/layer':>14}")
        for p in policies:
            v = summ[p]
            pm = {"moonep": m_med, "eplb": e_med}.get(p, v["plan_ms_median"])
            print(f"{p:<12} {v['balance_mean']:>12.3f} {v['balance_max']:>7.3f} {v['copies_per_rank_mean']:>11.2f} "
                  f"{v['copies_per_rank_max']:>4.0f} {pm:>14.3f}")
        print(f"MoonEP plan: median {m_med:.3f} ms (p90 {np.percentile(tim['moonep_ms'], 90):.3f}); EPLB median "
              f"{e_med:.1f} ms; speedup {e_med / m_med:.0f}x; exact balance every layer: {exact}; "
              f"torch planner on CPU {np.median(tim['moonep_torch_cpu_ms']):.1f} ms")
        report["workloads"][kind] = {
            "name": wl.name, "summary": summ, "moonep_plan_ms_median": m_med, "eplb_plan_ms_median": e_med,
            "speedup": e_med / m_med, "moonep_exact_balance": exact,
            "moonep_plan_ms_p90": float(np.percentile(tim["moonep_ms"], 90)),
            "moonep_torch_cpu_ms_median": float(np.median(tim["moonep_torch_cpu_ms"])),
        }

    rows = lp_gaps(args.lp_cases, args.lp_time_limit, args.seed)
    solved = [r for r in rows if r["status"] == "optimal"]
    gaps = np.array([r["greedy"] - r["lp"] for r in solved])
    rel = np.array([(r["greedy"] - r["lp"]) / max(r["lp"], 1) for r in solved])
    assert (gaps >= 0).all(), "the greedy can never beat the optimum"
    hist = {int(g): int((gaps == g).sum()) for g in np.unique(gaps)} if gaps.size else {}
    print(f"\ngreedy vs MILP optimum on {len(rows)} small cases (R<=8, E<=64; {len(solved)} solved to optimality): "
          f"copies gap (greedy - optimum) histogram {hist}; mean relative gap {rel.mean():.1%}, "
          f"max {rel.max():.1%}; optimal in {(gaps == 0).mean():.0%} of cases")
    report["lp_gap"] = {"cases": rows, "histogram": hist, "mean_rel_gap": float(rel.mean()),
                        "max_rel_gap": float(rel.max()), "optimal_fraction": float((gaps == 0).mean())}
    print(f"\nacceptance (MoonEP exact balance, median <= 1 ms, >= 100x EPLB): {'PASS' if ok else 'FAIL'}")
    report["acceptance_pass"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
