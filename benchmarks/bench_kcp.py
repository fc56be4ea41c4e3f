"""KCP benchmark (K3_SYSTEMS §7): communication bytes per layer per rank, and KDA layer time / peak memory.

Part 1, bytes (measured with the CP byte counters on real gloo ranks, k3_tiny layer shapes):
  for T in {4K, 16K, 64K} and CP in {2, 4}, one KDA layer forward+backward through
  :class:`ContextParallel` (KCP summary + short-conv halo) and one MLA latent all-gather
  forward+backward (the MLA layer's only collective). KCP bytes must be constant in T and equal
  ``B*H*K*(K+V)*4`` per rank per direction; MLA bytes grow linearly with T. Prints the measured
  crossover T (where the MLA latent all-gather sends as much as the KCP summary) and the same
  numbers computed for the real K3 shapes (H=96, K=V=128, latent 512+64).

Part 2, speed and memory: one k3_tiny KDA layer forward+backward at T (default 64K) as
  CP=2 (two gloo ranks, one thread each) vs one process with two threads (and, for reference, one
  process with one thread), side by side in one run, with ``OMP_WAIT_POLICY=PASSIVE`` by default.
  Peak memory is each process's peak resident set above its resident set just before the step
  (``/proc/self/clear_refs`` reset of VmHWM); time is one step after a warm-up, in fresh processes,
  the layouts alternating for ``--rounds`` rounds (best time of each layout, largest peak). CPU
  seconds (summed over a layout's ranks and threads) are printed too: on a shared machine the wall
  time of N processes also reflects their N-fold share of the CPUs, CPU seconds show the work.

    .venv/bin/python benchmarks/bench_kcp.py [--seq 65536] [--rounds 2] [--out /tmp/bench_kcp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import time

import torch

from moonrt.cluster.local import run_ranks

BYTES_TS = (4096, 16384, 65536)
BYTES_CPS = (2, 4)


def _layer() -> torch.nn.Module:
    from moonrt.models.k3.model.config import k3_tiny
    from moonrt.models.k3.model.kda_layer import KDALayer

    torch.manual_seed(0)
    return KDALayer(k3_tiny())


def _bytes_rank(rank: int, world: int, seqs: tuple[int, ...]) -> list[dict]:
    from moonrt.comm.cp.context import ContextParallel
    from moonrt.models.k3.model.config import k3_tiny

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


def _cpu_s() -> float:
    """CPU seconds used by this process so far (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _step_rank(rank: int, world: int, seq: int, reps: int, threads: int) -> dict:
    """One KDA layer fwd+bwd on this rank's slice (world 1: the whole sequence), timed and memory-measured."""
    torch.set_num_threads(threads)
    from moonrt.comm.cp.context import ContextParallel
    from moonrt.parallel.context import LOCAL

    layer = _layer()
    ctx = ContextParallel(None) if world > 1 else LOCAL
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(1, seq, layer.hidden_size, generator=gen)
    x = ctx.slice(x_full) if world > 1 else x_full
    del x_full

    def step(inp: torch.Tensor) -> tuple[float, float]:
        inp = inp.clone().requires_grad_(True)
        if world > 1:
            torch.distributed.barrier()
        t0, c0 = time.perf_counter(), _cpu_s()
        layer(inp, ctx=ctx).sum().backward()
        c1 = _cpu_s()
        if world > 1:
            torch.distributed.barrier()
        layer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, c1 - c0

    step(x[:, :1024])  # warm-up
    times, cpus, peaks = [], [], []
    for _ in range(reps):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            can_reset = True
        except OSError:
            can_reset = False
        base, _ = _peak_rss_mb()
        wall, cpu = step(x)
        times.append(wall)
        cpus.append(cpu)
        _, hwm = _peak_rss_mb()
        peaks.append(hwm - base if can_reset else float("nan"))
    return {"rank": rank, "time_s": min(times), "cpu_s": min(cpus), "peak_mb": max(peaks), "tokens": x.shape[1]}


def bytes_part(seqs: tuple[int, ...], cps: tuple[int, ...]) -> dict:
    from moonrt.models.k3.model.config import k3_tiny

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


LAYOUTS = (("1 process x 1 thread", 1, 1), ("1 process x 2 threads", 1, 2), ("CP=2 (2 ranks x 1 thread)", 2, 1))
"""(name, ranks, threads per rank) of the time/memory comparison."""


def speed_part(seq: int, rounds: int) -> dict:
    print(f"\nPart 2: one k3_tiny KDA layer forward+backward at T = {seq:,} (load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          f"{rounds} alternating rounds, fresh processes")
    runs: dict[str, list[list[dict]]] = {name: [] for name, _, _ in LAYOUTS}
    for i in range(rounds):
        for name, ranks, threads in LAYOUTS:
            runs[name].append(run_ranks(_step_rank, ranks, seq, 1, threads, timeout=3600, threads=threads))
        print(f"  round {i + 1}: " + ", ".join(f"{name} {max(r['time_s'] for r in runs[name][-1]):.2f} s"
                                                for name, _, _ in LAYOUTS), flush=True)
    table = {}
    for name, _, _ in LAYOUTS:
        table[name] = {"time_s": min(max(r["time_s"] for r in run) for run in runs[name]),
                       "cpu_s": min(sum(r["cpu_s"] for r in run) for run in runs[name]),
                       "peak_mb": max(r["peak_mb"] for run in runs[name] for r in run)}
    print(f"{'layout':<34}{'wall (s)':>10}{'CPU s, all ranks':>18}{'peak MB/process':>18}")
    for name, row in table.items():
        print(f"{name:<34}{row['time_s']:>10.2f}{row['cpu_s']:>18.2f}{row['peak_mb']:>18.0f}")
    single, cp = table[LAYOUTS[1][0]], table[LAYOUTS[2][0]]
    print(f"CP=2 vs 1 process x 2 threads: time x{cp['time_s'] / single['time_s']:.2f} (speed-up "
          f"{single['time_s'] / cp['time_s']:.2f}x), peak memory per process x{cp['peak_mb'] / single['peak_mb']:.2f}")
    return {"seq": seq, "runs": runs, "table": table, "time_ratio": cp["time_s"] / single["time_s"],
            "memory_ratio": cp["peak_mb"] / single["peak_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=65536, help="tokens for the time/memory comparison")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds of both layouts (best time, max peak)")
    parser.add_argument("--bytes-seqs", type=int, nargs="+", default=list(BYTES_TS))
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-bytes", action="store_true")
    parser.add_argument("--out", default="/tmp/bench_kcp.json", help="JSON results")
    parser.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY for the ranks (PASSIVE: idle OpenMP threads sleep instead of spinning, "
                             "the fair setting on a shared machine; '' keeps the environment's)")
    args = parser.parse_args()
    if args.omp_wait_policy:  # before the first run_ranks starts the fork server, which the ranks inherit
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
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
