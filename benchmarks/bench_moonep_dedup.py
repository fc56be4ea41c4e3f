"""MoonEP dispatch rows and bytes per layer-step, one row per assignment vs one per (token, destination rank).

With ``dedup`` (``parallel.ep_dedup``, the default) a token whose k experts are computed on m distinct ranks
travels m times instead of k (plus 8 bytes of row index per assignment; the fp32 router weight travels per
assignment either way). Two parts:

1. **K3 shape, R in {8, 64}** (E=896, k=16, s=4096 tokens per rank, latent width 3584 in bf16): per workload,
   token-level routing is sampled (Gumbel top-k over the workload's expert shares: k distinct experts per
   token), MoonEP plans it, and every source rank's exact destinations come from the dispatcher's own layout
   code (:func:`moonrt.comm.ep.layout.build_layout`); rows sent off-rank are counted with and without dedup.
   Next to them, ep-sim's count-only model (:func:`moonrt.scheduler.sim.dedup_rows`) from the same counts.
2. **Measured on 4 CPU gloo ranks** (E=896, k=16, s=512, H=256 fp32 by default): the real dispatcher,
   dispatch + combine forward and backward with dedup on and off; rows and bytes from its counters (off-rank,
   one forward), the outputs of both modes compared, and the median wall time of a fwd+bwd round.

Bytes per layer-step, all ranks, off-rank only: dispatch rows * row bytes + assignments * (4 [+ 8 with dedup])
+ combine rows * row bytes (the backward moves the same again).

    .venv/bin/python benchmarks/bench_moonep_dedup.py   # JSON: /tmp/moonrt-bench/bench_moonep_dedup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from moonrt.cluster.local import run_ranks
from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.layout import assignment_destinations, build_layout
from moonrt.comm.ep.placement import MoonEPPlacement
from moonrt.scheduler.moonep import plan, transfer_matrix
from moonrt.scheduler.sim import K3_LATENT, dedup_rows
from moonrt.scheduler.workload import popularity

WORKLOADS = {"uniform": ("uniform", 1.0), "lognormal": ("lognormal", 1.0), "lognormal-2": ("lognormal", 2.0)}
"""name -> (ep-sim popularity kind, sigma): ep-sim's default skew, none, and a concentrated one."""


def sample_routing(shares: np.ndarray, world: int, s: int, k: int, seed: int) -> list[torch.Tensor]:
    """Per-rank ``topk_ids [s, k]``: each token's k distinct experts by Gumbel top-k on ``log(shares)``."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.as_tensor(np.log(shares), dtype=torch.float32)
    out = []
    for _ in range(world):
        u = torch.rand(s, logp.shape[0], generator=g).clamp_(1e-20, 1.0)
        out.append(torch.topk(logp - torch.log(-torch.log(u)), k, dim=1).indices)
    return out


def rows_off_rank(ids: list[torch.Tensor], num_experts: int) -> dict:
    """Plan the routing, then count every source rank's off-rank assignments and distinct (token, rank) pairs."""
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=num_experts) for i in ids])
    p = plan(counts.numpy())
    pt = p.to_torch()
    assignments = pairs = 0
    for r, topk in enumerate(ids):
        layout = build_layout(topk, counts, pt.alloc, pt.copies, r)
        dst = assignment_destinations(layout)
        tok = torch.arange(topk.shape[0]).repeat_interleave(topk.shape[1])
        off = dst != r
        assignments += int(off.sum())
        pairs += int(torch.unique(dst[off] * topk.shape[0] + tok[off]).numel())
    tm = transfer_matrix(counts.numpy(), p.cuts)
    dd = dedup_rows(tm, ids[0].shape[1])
    return {"assignments": assignments, "pairs": pairs, "model_assignments": int(tm.sum() - np.trace(tm)),
            "model_pairs": float(dd.sum() - np.trace(dd))}


def layer_bytes(rows: float, assignments: float, row_bytes: int, dedup: bool) -> float:
    """Off-rank bytes of one dispatch + combine (forward): rows both ways, weight (+ index) per assignment."""
    return 2 * rows * row_bytes + assignments * (4 + (8 if dedup else 0))


def k3_shape(ranks: list[int], s: int, k: int, E: int, seed: int) -> list[dict]:
    out = []
    row_bytes = 2 * K3_LATENT  # bf16 latent
    for R in ranks:
        for name, (kind, sigma) in WORKLOADS.items():
            shares = popularity(kind, E, np.random.default_rng(seed), sigma=sigma)
            c = rows_off_rank(sample_routing(shares, R, s, k, seed), E)
            rec = {"R": R, "workload": name, "E": E, "k": k, "s": s, **c,
                   "bytes": layer_bytes(c["assignments"], c["assignments"], row_bytes, False),
                   "bytes_dedup": layer_bytes(c["pairs"], c["assignments"], row_bytes, True),
                   "model_bytes_dedup": layer_bytes(c["model_pairs"], c["model_assignments"], row_bytes, True)}
            rec["rows_saved"] = 1 - c["pairs"] / max(c["assignments"], 1)
            rec["bytes_saved"] = 1 - rec["bytes_dedup"] / max(rec["bytes"], 1)
            out.append(rec)
    return out


def _measured_rank(rank: int, world: int, s: int, k: int, E: int, H: int, iters: int, seed: int) -> dict:
    torch.manual_seed(0)
    shares = popularity("lognormal", E, np.random.default_rng(seed), sigma=1.0)
    ids = sample_routing(shares, world, s, k, seed)[rank]
    g = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(s, H, generator=g)
    w0 = torch.rand(s, k, generator=g) + 0.1
    res: dict = {}
    for dedup in (False, True):
        disp = EPDispatcher(None, s, H, k, E, placement=MoonEPPlacement(), dedup=dedup)
        times, out = [], None
        for it in range(iters):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            t0 = time.perf_counter()
            recv_x, recv_w, _, h = disp.dispatch(x, ids, w)
            y = recv_x * 2.0  # stands in for the expert: the bench measures transport
            out = disp.combine(y, h)
            out.square().sum().backward()
            times.append(time.perf_counter() - t0)
            if it == 0:
                c = disp.counters
                peers = [d for d in range(world) if d != rank]
                res[dedup] = {"rows": sum(c.rows_sent[d] for d in peers),
                              "assignments": sum(c.assignments_sent[d] for d in peers),
                              "bytes": sum(c.token_bytes_sent[d] for d in peers)}
        res[dedup].update(ms=statistics.median(times) * 1e3, out=out.detach(), gx=x.grad, gw=w.grad)
    return res


def measured(world: int, s: int, k: int, E: int, H: int, iters: int, seed: int) -> dict:
    res = run_ranks(_measured_rank, world, s, k, E, H, iters, seed, timeout=900)
    rec: dict = {"R": world, "E": E, "k": k, "s": s, "H": H, "dtype": "fp32"}
    for dedup, key in ((False, "plain"), (True, "dedup")):
        rec[key] = {"rows": sum(r[dedup]["rows"] for r in res),
                    "assignments": sum(r[dedup]["assignments"] for r in res),
                    "bytes": sum(r[dedup]["bytes"] for r in res),
                    "wall_ms_max_rank": max(r[dedup]["ms"] for r in res)}

    def rel(a: str) -> float:
        return max(float((r[True][a] - r[False][a]).norm() / r[False][a].norm()) for r in res)

    rec["rel_diff"] = {"out": rel("out"), "grad_x": rel("gx"), "grad_w": rel("gw")}
    ids = sample_routing(popularity("lognormal", E, np.random.default_rng(seed), sigma=1.0), world, s, k, seed)
    rec["expected"] = rows_off_rank(ids, E)  # the layout's count: must equal the counters
    rec["rows_saved"] = 1 - rec["dedup"]["rows"] / rec["plain"]["rows"]
    rec["bytes_saved"] = 1 - rec["dedup"]["bytes"] / rec["plain"]["bytes"]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, default=4096, help="s per rank at K3 shape")
    ap.add_argument("--measured-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256, help="H of the measured run")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moonrt-bench/bench_moonep_dedup.json"))
    args = ap.parse_args()
    E, k = 896, 16
    shape = k3_shape(args.ranks, args.tokens, k, E, args.seed)
    print(f"K3 shape (E={E}, k={k}, s={args.tokens}/rank, bf16 latent {K3_LATENT}), off-rank per layer-step, "
          "all ranks, dispatch + combine forward:")
    print(f"{'R':>3} {'workload':<12} {'rows':>10} {'rows dedup':>11} {'model':>11} {'saved':>6} "
          f"{'GB':>8} {'GB dedup':>9} {'saved':>6}")
    for r in shape:
        print(f"{r['R']:>3} {r['workload']:<12} {r['assignments']:>10} {r['pairs']:>11} {r['model_pairs']:>11.0f} "
              f"{r['rows_saved']:>6.1%} {r['bytes'] / 1e9:>8.3f} {r['bytes_dedup'] / 1e9:>9.3f} "
              f"{r['bytes_saved']:>6.1%}")
    m = measured(4, args.measured_tokens, k, E, args.hidden, args.iters, args.seed)
    print(f"\nmeasured, 4 CPU gloo ranks (E={E}, k={k}, s={m['s']}, H={m['H']} fp32, lognormal), off-rank, "
          "all ranks, one forward dispatch + combine:")
    for key in ("plain", "dedup"):
        v = m[key]
        print(f"  {key:<6} rows {v['rows']:>7}  assignments {v['assignments']:>7}  MB {v['bytes'] / 1e6:>8.2f}  "
              f"fwd+bwd ms (slowest rank, median) {v['wall_ms_max_rank']:.1f}")
    print(f"  rows saved {m['rows_saved']:.1%}, bytes saved {m['bytes_saved']:.1%}; layout count: "
          f"{m['expected']['pairs']} pairs / {m['expected']['assignments']} assignments; "
          f"dedup vs plain max rel diff: out {m['rel_diff']['out']:.1e}, grad x {m['rel_diff']['grad_x']:.1e}, "
          f"grad w {m['rel_diff']['grad_w']:.1e}")
    assert m["dedup"]["rows"] == m["expected"]["pairs"] and m["plain"]["rows"] == m["expected"]["assignments"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"k3_shape": shape, "measured": m}, indent=1))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
