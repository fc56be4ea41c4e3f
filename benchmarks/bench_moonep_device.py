"""Benchmark the fixed-op device planner (``plan_device``) against the step-loop torch planner (``plan_torch``).

Issue 34 item 5. Both plan on the counts' device without a host synchronization; ``plan_device``
computes the closed form (``moonep.plan(method="prefix")``) in a fixed sequence of vectorized ops,
``plan_torch`` the greedy rounds in ``~2R + E/R`` Python-loop steps. Measured on CPU here (median
per layer over steps x layers, one intra-op thread: on a shared machine a multi-threaded op waits on
its thread barrier, which is noise, not planner cost) at K3's shape (E=896, R=64) and at E=2,050
(R=41 and R=50), lognormal and zipf popularity, k=16, s=4096. Also: aten ops per plan (torch's CPU
profiler), the numba planners' time, and copies per plan of the two methods (the closed form's price).

    .venv/bin/python benchmarks/bench_moonep_device.py [--out /tmp/moonrt-bench/bench_moonep_device.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from moonrt.scheduler.moonep import plan
from moonrt.scheduler.moonep_torch import plan_device, plan_prefix, plan_torch
from moonrt.scheduler.workload import synthetic

VIEWS = {"aten::view", "aten::select", "aten::slice", "aten::unsqueeze", "aten::permute", "aten::alias",
         "aten::reshape", "aten::as_strided", "aten::expand", "aten::diagonal", "aten::t", "aten::transpose"}


def _median_ms(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def aten_ops(fn) -> int:
    """Top-level aten ops (view-only ops left out) that one call runs, from the CPU profiler."""
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        fn()
    return sum(1 for e in prof.function_events if e.name.startswith("aten::") and e.name not in VIEWS
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def run_shape(E: int, R: int, kind: str, args: argparse.Namespace) -> dict:
    wl = synthetic(kind, num_experts=E, num_ranks=R, top_k=args.top_k, tokens_per_rank=args.tokens,
                   steps=args.steps, layers=args.layers, seed=args.seed)
    dev, pre, loop, numba_g, numba_p, cp_g, cp_p = [], [], [], [], [], [], []
    for t in range(args.steps):
        for l in range(args.layers):
            c = wl.counts[t, l]
            ct = torch.from_numpy(c)
            a, b = plan(c), plan(c, method="prefix")
            fields = ("alloc", "copies", "capacity", "cuts", "donor")
            got = plan_device(ct, validate=False).to_numpy()
            assert all(np.array_equal(getattr(got, f), getattr(a, f)) for f in fields)
            got = plan_prefix(ct, validate=False).to_numpy()
            assert all(np.array_equal(getattr(got, f), getattr(b, f)) for f in fields)
            cp_g.append(a.num_copies())
            cp_p.append(b.num_copies())
            dev.append(_median_ms(lambda ct=ct: plan_device(ct, validate=False), args.repeat))
            pre.append(_median_ms(lambda ct=ct: plan_prefix(ct, validate=False), args.repeat))
            loop.append(_median_ms(lambda ct=ct: plan_torch(ct, validate=False), max(1, args.repeat // 5)))
            numba_g.append(_median_ms(lambda c=c: plan(c), args.repeat))
            numba_p.append(_median_ms(lambda c=c: plan(c, method="prefix"), args.repeat))
    ct = torch.from_numpy(wl.counts[0, 0])
    row = {"E": E, "R": R, "kind": kind,
           "plan_device_ms": float(np.median(dev)), "plan_prefix_ms": float(np.median(pre)),
           "plan_torch_ms": float(np.median(loop)),
           "numba_greedy_ms": float(np.median(numba_g)), "numba_prefix_ms": float(np.median(numba_p)),
           "plan_device_ops": aten_ops(lambda: plan_device(ct, validate=False)),
           "plan_prefix_ops": aten_ops(lambda: plan_prefix(ct, validate=False)),
           "plan_torch_ops": aten_ops(lambda: plan_torch(ct, validate=False)),
           "copies_greedy_mean": float(np.mean(cp_g)), "copies_prefix_mean": float(np.mean(cp_p)),
           "copies_per_rank_max_greedy": int(max(plan(c).copies_per_rank().max() for c in wl.counts.reshape(-1, R, E))),
           "copies_per_rank_max_prefix": int(max(plan(c, method="prefix").copies_per_rank().max()
                                                for c in wl.counts.reshape(-1, R, E)))}
    row["speedup"] = row["plan_torch_ms"] / row["plan_device_ms"]
    row["speedup_prefix"] = row["plan_torch_ms"] / row["plan_prefix_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per layer (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moonrt-bench/bench_moonep_device.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plan(np.ones((2, 4), np.int64))  # numba JIT / cache load outside the timings
    plan(np.ones((2, 4), np.int64), method="prefix")
    plan_device(torch.ones(2, 4, dtype=torch.int64))
    plan_prefix(torch.ones(2, 4, dtype=torch.int64))
    shapes = ((896, 64), (2050, 41), (2050, 50))
    rows = [run_shape(E, R, kind, args) for E, R in shapes for kind in ("lognormal", "zipf")]
    print(f"{'E':>5} {'R':>3} {'workload':<10} {'device/prefix/torch ms':>24} {'speedup dev/prefix':>18} "
          f"{'ops dev/prefix/torch':>20} {'numba greedy/prefix ms':>22} {'copies greedy/prefix':>20}")
    for r in rows:
        print(f"{r['E']:>5} {r['R']:>3} {r['kind']:<10} "
              f"{r['plan_device_ms']:>8.2f}/{r['plan_prefix_ms']:.2f}/{r['plan_torch_ms']:<6.1f} "
              f"{str(round(r['speedup'], 1)) + 'x/' + str(round(r['speedup_prefix'], 1)) + 'x':>18} "
              f"{r['plan_device_ops']:>8}/{r['plan_prefix_ops']}/{r['plan_torch_ops']:<6} "
              f"{r['numba_greedy_ms']:>11.3f}/{r['numba_prefix_ms']:<10.3f} "
              f"{r['copies_greedy_mean']:>10.1f}/{r['copies_prefix_mean']:<9.1f}")
    k3 = [r for r in rows if r["E"] == 896]
    big = [r for r in rows if r["E"] == 2050]
    ok = all(r["speedup"] >= 1.0 for r in k3) and all(r["speedup"] >= 5.0 for r in big)
    ok &= len({r["plan_device_ops"] for r in rows}) == 1 and len({r["plan_prefix_ops"] for r in rows}) == 1
    print(f"plan_device: K3 shape no slower than plan_torch and E=2050 at least 5x faster, one op count for all "
          f"shapes (plan_prefix too): {ok}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows, "ok": ok}, indent=2))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
