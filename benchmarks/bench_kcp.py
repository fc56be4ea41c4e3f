"""KCP benchmark (K3_SYSTEMS §7): communication bytes per layer per rank, and KDA layer time / peak memory.

Part 1, bytes (measured with the CP byte counters on real gloo ranks, k3_tiny layer shapes):
  for T in {4K, 16K, 64K} and CP in {2, 4}, one KDA layer forward+backward through
  :class:`ContextParallel` (KCP summary + short-conv halo) and one MLA latent all-gather
  forward+backward (the MLA layer's only collective). KCP bytes must be constant in T and equal
  ``B*H*K*(K+V)*4`` per rank per direction; MLA bytes grow linearly with T. Prints the measured
  crossover T (where the MLA latent all-gather sends as much as the KCP summary) and the same
  numbers computed for the real K3 shapes (H=96, K=V=128, latent 512+64).

Part 2, speed and memory: one k3_tiny KDA layer forward+backward at T (default 64K) as
  CP=2 (two gloo ranks, one thread each) vs one process with two threads, side by side in one run.
  Peak memory is each process's peak resident set above its resident set just before the step
  (``/proc/self/clear_refs`` reset of VmHWM); time is one step after a warm-up, in fresh processes,
  the layouts alternating for ``--rounds`` rounds (best time of each layout, largest peak).

    .venv/bin/python benchmarks/bench_kcp.py [--seq 65536] [--rounds 2] [--out /tmp/bench_kcp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from moonrt.cluster.local import run_ranks

BYTES_TS = (4096, 16384, 65536)
BYTES_CPS = (2, 4)


def _layer() -> torch.nn.Module:
    from moonrt.model.config import k3_tiny
    from moonrt.model.kda_layer import KDALayer

    torch.manual_seed(0)
    return KDALayer(k3_tiny())


def _bytes_rank(rank: int, world: int, seqs: tuple[int, ...]) -> list[dict]:
    from moonrt.comm.cp_context import ContextParallel
    from moonrt.model.config import k3_tiny

    cfg = k3_tiny()
    latent_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layer = _layer()
    ctx = ContextParallel(None)
    out = []
    for T in seqs:
        gen = torch.Generator().manual_seed(T)
        ctx.new_step()
        x = ctx.slice(torch.randn(1, T, cfg.hidden_size, generator=gen)).requires_grad_(True)
        layer(x, ctx=ctx).sum().backward()
        kda = ctx.log.by_op()
        ctx.new_step()
        lat = ctx.slice(torch.randn(1, T, latent_width, generator=gen)).requires_grad_(True)
        full, _ = ctx.gather_sequence(lat)
        full.sum().backward()
        out.append({"T": T, "kcp": kda["kcp"], "halo": kda["halo"], "mla": ctx.log.by_op()["gather"]})
    return out


def _peak_rss_mb() -> tuple[float, float]:
    status = open("/proc/self/status").read()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024
    return rss, hwm


def _step_rank(rank: int, world: int, seq: int, reps: int, threads: int) -> dict:
    """One KDA layer fwd+bwd on this rank's slice (world 1: the whole sequence), timed and memory-measured."""
    torch.set_num_threads(threads)
    from moonrt.comm.cp_context import ContextParallel
    from moonrt.model.context import LOCAL

    layer = _layer()
    ctx = ContextParallel(None) if world > 1 else LOCAL
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(1, seq, layer.hidden_size, generator=gen)
    x = ctx.slice(x_full) if world > 1 else x_full
    del x_full

    def step(inp: torch.Tensor) -> float:
        inp = inp.clone().requires_grad_(True)
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        layer(inp, ctx=ctx).sum().backward()
        if world > 1:
            torch.distributed.barrier()
        layer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(x[:, :1024])  # warm-up
    times, peaks = [], []
    for _ in range(reps):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            can_reset = True
        except OSError:
            can_reset = False
        base, _ = _peak_rss_mb()
        times.append(step(x))
        _, hwm = _peak_rss_mb()
        peaks.append(hwm - base if can_reset else float("nan"))
    return {"rank": rank, "time_s": min(times), "peak_mb": max(peaks), "tokens": x.shape[1]}


def bytes_part(seqs: tuple[int, ...], cps: tuple[int, ...]) -> dict:
    from moonrt.model.config import k3_tiny

    cfg = k3_tiny()
    lac = cfg.linear_attn_config
    H, K = lac.num_heads, lac.head_dim
    summary = H * K * (K + K) * 4
    latent_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    rows = []
    print(f"\nPart 1: bytes per layer per rank (k3_tiny shapes: KDA H={H}, K=V={K}; MLA latent "
          f"{cfg.kv_lora_rank}+{cfg.qk_rope_head_dim} fp32; B=1). H*K*(K+V)*4 = {summary} B")
    print(f"{'CP':>3} {'T':>7} {'rank':>4} | {'KCP fwd':>9} {'KCP bwd':>9} | {'halo fwd':>8} {'halo bwd':>8} | "
          f"{'MLA fwd':>10} {'MLA bwd':>10}   (bytes sent)")
    for c in cps:
        res = run_ranks(_bytes_rank, c, seqs, timeout=1800)
        mine = sorted(({"cp": c, "rank": rank, **r} for rank, per in enumerate(res) for r in per),
                      key=lambda r: (r["T"], r["rank"]))
        rows.extend(mine)
        for r in mine:
            print(f"{c:>3} {r['T']:>7} {r['rank']:>4} | {r['kcp']['fwd_sent']:>9} {r['kcp']['bwd_sent']:>9} | "
                  f"{r['halo']['fwd_sent']:>8} {r['halo']['bwd_sent']:>8} | {r['mla']['fwd_sent']:>10} "
                  f"{r['mla']['bwd_sent']:>10}")
    kcp_const = all(r["kcp"]["fwd_sent"] == summary and r["kcp"]["bwd_sent"] == summary for r in rows)
    print(f"KCP bytes sent per rank constant in T and equal to H*K*(K+V)*4 = {summary} in both passes: {kcp_const}")
    crossover = {}
    for c in cps:
        # measured MLA forward bytes per token per rank (least squares through the origin over T and ranks)
        pts = [(r["T"] / c, r["mla"]["fwd_sent"]) for r in rows if r["cp"] == c]
        per_token = sum(t * b for t, b in pts) / sum(t * t for t, _ in pts)
        crossover[c] = c * summary / per_token
        print(f"CP={c}: MLA latent all-gather sends {per_token:.0f} B/token/rank (expected {latent_bytes}); "
              f"crossover T = {crossover[c]:,.0f} tokens (above it KCP sends less than the MLA latent)")
    # Real K3 shapes (K3_SYSTEMS §1, §7), analytic from the same formulas the counters verify.
    k3_summary = 96 * 128 * (128 + 128) * 4
    print(f"\nK3 shapes: KCP summary {k3_summary / 2**20:.1f} MiB per KDA layer per rank per direction")
    k3 = {}
    for c in (2, 4, 8):
        for name, elt in (("bf16", 2), ("fp32", 4)):
            t_star = c * k3_summary / (576 * elt)
            k3[f"cp{c}_{name}"] = t_star
        print(f"  CP={c}: crossover with the MLA latent (576 values/token) at T = {k3[f'cp{c}_bf16']:,.0f} (bf16 "
              f"latent), {k3[f'cp{c}_fp32']:,.0f} (fp32)")
    return {"rows": rows, "summary_bytes": summary, "kcp_constant": kcp_const, "crossover_tiny": crossover,
            "crossover_k3": k3}


def speed_part(seq: int, rounds: int) -> dict:
    print(f"\nPart 2: one k3_tiny KDA layer forward+backward at T = {seq:,} (load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); {rounds} alternating rounds, fresh processes")
    singles, cps = [], []
    for i in range(rounds):
        singles.append(run_ranks(_step_rank, 1, seq, 1, 2, timeout=3600, threads=2)[0])
        cps.append(run_ranks(_step_rank, 2, seq, 1, 1, timeout=3600, threads=1))
        print(f"  round {i + 1}: single {singles[-1]['time_s']:.2f} s, CP=2 {max(r['time_s'] for r in cps[-1]):.2f} s",
              flush=True)
    single_time = min(r["time_s"] for r in singles)
    single_peak = max(r["peak_mb"] for r in singles)
    cp_time = min(max(r["time_s"] for r in run) for run in cps)
    cp_peak = max(r["peak_mb"] for run in cps for r in run)
    print(f"{'layout':<34}{'time (s)':>10}{'peak MB/process':>18}")
    print(f"{'1 process x 2 threads':<34}{single_time:>10.2f}{single_peak:>18.0f}")
    print(f"{'CP=2 (2 ranks x 1 thread), max':<34}{cp_time:>10.2f}{cp_peak:>18.0f}")
    print(f"CP=2 / single: time x{cp_time / single_time:.2f} (speed-up {single_time / cp_time:.2f}x), "
          f"peak memory per process x{cp_peak / single_peak:.2f}")
    return {"seq": seq, "single_2threads": singles, "cp2": cps, "time_ratio": cp_time / single_time,
            "memory_ratio": cp_peak / single_peak, "single_time_s": single_time, "cp2_time_s": cp_time,
            "single_peak_mb": single_peak, "cp2_peak_mb": cp_peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=65536, help="tokens for the time/memory comparison")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds of both layouts (best time, max peak)")
    parser.add_argument("--bytes-seqs", type=int, nargs="+", default=list(BYTES_TS))
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-bytes", action="store_true")
    parser.add_argument("--out", default="/tmp/bench_kcp.json", help="JSON results")
    args = parser.parse_args()
    result = {}
    if not args.skip_bytes:
        result["bytes"] = bytes_part(tuple(args.bytes_seqs), BYTES_CPS)
    if not args.skip_speed:
        result["speed"] = speed_part(args.seq, args.rounds)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
