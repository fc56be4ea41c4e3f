"""``moonrt ep-sim``: simulate expert placement policies on a routing workload (K3_SYSTEMS §6).

For each step and MoE layer of a workload (synthetic, :func:`moonrt.scheduler.workload.synthetic`,
or a recorded trace ``.npz``, format in :mod:`moonrt.scheduler.workload`), every policy places the
layer's token-expert assignments on the R EP ranks and we measure:

* rank balance: max rank load / mean rank load (1.000 = perfect; MoonEP's contract, §6.1);
* ``maxvio`` of the routing itself: ``max_e(T_e / mean_T) - 1`` (policy independent);
* copied experts per rank (mean / max): MoonEP's occupied slots; EPLB's redundant replicas;
* expert-weight bytes to prefetch: MoonEP fetches every copied expert per layer-step; EPLB moves the
  replicas that change place at a re-plan; no redundancy fetches nothing;
* token bytes moved between ranks by dispatch (one direction; combine moves as much back);
* planner time per layer.

Policies: ``none`` (contiguous home placement), ``eplb`` (DeepSeek EPLB re-planned every
``--eplb-every`` steps from an exponential moving average of past loads, ``E`` redundant replicas =
the same ``E/R`` extra slots per rank as MoonEP), ``eplb-oracle`` (EPLB planned from the current
step's loads: perfect prediction, an upper bound on what prediction can reach) and ``moonep``.
With no arguments it runs a K3-sized default: E=896, k=16, R=64, s=4096, lognormal skew, ±30%
per-step drift. Output: a table on stdout, ``summary.json`` and ``ep_sim.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moonrt.scheduler import baselines as bl
from moonrt.scheduler.moonep import plan, transfer_matrix
from moonrt.scheduler.workload import Workload, load_trace, maxvio, synthetic

POLICIES = ("none", "eplb", "eplb-oracle", "moonep")
# K3 sizes (K3_SYSTEMS §1): latent width 3584 crosses ranks; an expert is 3 matrices 3584 x 3072.
K3_LATENT = 3584
K3_EXPERT_PARAMS = 3 * 3584 * 3072


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (synthetic unless --trace)")
    g.add_argument("--trace", type=Path, default=None, help="routing trace .npz (counts [steps, layers, R, E])")
    g.add_argument("--workload", choices=("uniform", "lognormal", "zipf"), default="lognormal")
    g.add_argument("--sigma", type=float, default=1.0, help="lognormal popularity sigma")
    g.add_argument("--zipf-s", type=float, default=1.0, help="zipf popularity exponent")
    g.add_argument("--drift", type=float, default=0.3, help="per-step relative fluctuation of expert shares")
    g.add_argument("--experts", type=int, default=896, help="E, routed experts (K3: 896)")
    g.add_argument("--ranks", type=int, default=64, help="R, EP ranks")
    g.add_argument("--top-k", type=int, default=16, help="k (K3: 16)")
    g.add_argument("--tokens", type=int, default=4096, help="s, tokens per rank per layer")
    g.add_argument("--steps", type=int, default=24)
    g.add_argument("--layers", type=int, default=3, help="MoE layers simulated (K3 has 92; a sample suffices)")
    g.add_argument("--seed", type=int, default=0)
    q = p.add_argument_group("policies and sizes")
    q.add_argument("--policies", default=",".join(POLICIES), help=f"comma list from {','.join(POLICIES)}")
    q.add_argument("--num-slots", type=int, default=None, help="MoonEP slots per rank B (default E/R)")
    q.add_argument("--eplb-every", type=int, default=4, help="EPLB re-plans every N steps (and at step 1)")
    q.add_argument("--warmup", type=int, default=1,
                   help="steps left out of the summary (step 0: EPLB has no history to predict from)")
    q.add_argument("--eplb-alpha", type=float, default=0.2, help="EPLB moving-average weight of the newest step")
    q.add_argument("--eplb-redundant", type=int, default=None, help="EPLB redundant replicas (default E)")
    q.add_argument("--hidden", type=int, default=K3_LATENT, help="activation width crossing ranks (K3 latent)")
    q.add_argument("--expert-params", type=int, default=K3_EXPERT_PARAMS, help="parameters per routed expert")
    q.add_argument("--bytes-per-elem", type=int, default=2, help="bytes per activation/weight element (bf16: 2)")
    q.add_argument("--out", type=Path, default=Path("runs/ep-sim"), help="output directory")
    q.add_argument("--no-plot", action="store_true", help="skip the PNG")
    q.add_argument("--quiet", action="store_true", help="no progress bar")


def _policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"--policies: {text!r}, expected a comma list from {POLICIES}")
    return names


def simulate(wl: Workload, policies: list[str], *, num_slots: int | None = None, eplb_every: int = 4,
             eplb_alpha: float = 0.2, eplb_redundant: int | None = None, token_bytes: int = 2 * K3_LATENT,
             expert_bytes: int = 2 * K3_EXPERT_PARAMS, progress: bool = True) -> dict:
    """Run every policy on every (step, layer) of ``wl``; returns per-step records and per-rank loads.

    Returns a dict: ``maxvio [steps, layers]``, and per policy ``balance``, ``copies_mean``,
    ``copies_max``, ``prefetch_bytes``, ``token_bytes``, ``plan_s`` (each ``[steps, layers]``
    float64) and ``loads`` (``[R]`` rank loads of the last step, layer 0).
    """
    T, L, R, E = wl.shape
    if eplb_every < 1:
        raise ValueError(f"eplb_every: {eplb_every}, expected >= 1")
    red = E if eplb_redundant is None else eplb_redundant
    equal = wl.equal_rank_totals()
    keys = ("balance", "copies_mean", "copies_max", "prefetch_bytes", "token_bytes", "plan_s")
    out: dict = {"maxvio": np.zeros((T, L))}
    for p in policies:
        out[p] = {k: np.zeros((T, L)) for k in keys}
    home = bl.no_redundancy(E, R)
    ema = [bl.MovingAverage(eplb_alpha) for _ in range(L)]
    # EPLB placements per layer; before any history, EPLB plans from a uniform prediction.
    first = bl.eplb(np.ones(E), R, red) if any(p.startswith("eplb") for p in policies) else home
    placed = {p: [first] * L for p in policies if p.startswith("eplb")}
    for t in tqdm(range(T), desc="ep-sim", unit="step", disable=not progress):
        for l in range(L):
            counts = wl.counts[t, l]
            load = counts.sum(0)
            mean = counts.sum() / R if counts.sum() else 1.0
            out["maxvio"][t, l] = maxvio(load)
            for p in policies:
                rec = out[p]
                if p == "moonep":
                    t0 = time.perf_counter()
                    pl = plan(counts, num_slots, None if equal else int(counts.sum()) // wl.top_k)
                    rec["plan_s"][t, l] = time.perf_counter() - t0
                    loads = pl.alloc.sum(0)
                    ncp = pl.copies_per_rank()
                    rec["copies_mean"][t, l], rec["copies_max"][t, l] = ncp.mean(), ncp.max()
                    rec["prefetch_bytes"][t, l] = ncp.sum() * expert_bytes
                    tm = transfer_matrix(counts, pl.cuts)
                    rec["token_bytes"][t, l] = (tm.sum() - np.trace(tm)) * token_bytes
                else:
                    if p == "none":
                        place, moves, dt = home, 0, 0.0
                    else:
                        prev = placed[p]
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
                rec["balance"][t, l] = loads.max() / mean
                if t == T - 1 and l == 0:
                    rec["loads"] = loads.astype(np.int64)
            ema[l].update(load)
    return out


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
    return s


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
    return "\n".join(lines)


def plot(res: dict, policies: list[str], path: Path, title: str) -> None:
    """PNG: rank balance per policy over steps; per-rank loads of step 0, layer 0 per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for p in policies:
        bal = res[p]["balance"]
        a.plot(np.arange(bal.shape[0]), bal.mean(1), marker=".", label=p)
    a.axhline(1.0, color="k", lw=0.5)
    a.set_xlabel("step")
    a.set_ylabel("rank balance (max / mean, mean over layers)")
    a.set_title("rank balance per step")
    a.legend()
    R = res[policies[0]]["loads"].shape[0]
    x = np.arange(R)
    for p in policies:
        loads = res[p]["loads"]
        if p == "none":
            b.bar(x, loads, width=0.9, color="0.75", label="none (before)")
        else:
            b.step(x, loads, where="mid", lw=1.4, label=p)
    b.axhline(res[policies[0]]["loads"].mean(), color="k", lw=0.6, ls="--", label="mean")
    b.set_xlabel("rank")
    b.set_ylabel("assignments computed")
    b.set_title(f"per-rank load, last step ({res['maxvio'].shape[0] - 1}), layer 0")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    if args.trace is not None:
        wl = load_trace(args.trace)
    else:
        wl = synthetic(args.workload, num_experts=args.experts, num_ranks=args.ranks, top_k=args.top_k,
                       tokens_per_rank=args.tokens, steps=args.steps, layers=args.layers, sigma=args.sigma,
                       zipf_s=args.zipf_s, drift=args.drift, seed=args.seed)
    T, L, R, E = wl.shape
    t0 = time.perf_counter()
    res = simulate(wl, policies, num_slots=args.num_slots, eplb_every=args.eplb_every, eplb_alpha=args.eplb_alpha,
                   eplb_redundant=args.eplb_redundant, token_bytes=args.hidden * args.bytes_per_elem,
                   expert_bytes=args.expert_params * args.bytes_per_elem, progress=not args.quiet)
    if not 0 <= args.warmup < T:
        raise ValueError(f"--warmup: {args.warmup}, expected 0 <= warmup < steps ({T})")
    summary = summarize(res, policies, args.warmup)
    title = f"{wl.name}: E={E} R={R} k={wl.top_k} steps={T} layers={L}"
    print(title)
    print(format_table(summary, float(res["maxvio"][args.warmup:].mean()), args.warmup))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "workload": wl.name, "experts": E, "ranks": R, "top_k": wl.top_k, "steps": T, "layers": L,
        "policies": policies, "warmup": args.warmup, "summary": summary, "maxvio": res["maxvio"].tolist(),
        "per_step": {p: {k: v.tolist() for k, v in res[p].items()} for p in policies},
        "seconds": time.perf_counter() - t0,
    }
    (args.out / "summary.json").write_text(json.dumps(doc, indent=1))
    written = [str(args.out / "summary.json")]
    if not args.no_plot:
        plot(res, policies, args.out / "ep_sim.png", title)
        written.append(str(args.out / "ep_sim.png"))
    print(f"wrote {', '.join(written)} in {doc['seconds']:.1f} s")
    return 0
