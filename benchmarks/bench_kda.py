"""CPU benchmark of the chunked KDA kernel (K3_SYSTEMS §2.3) against this machine's fp32 matmul rate.

Measures, for fp32, B=1, H=4, K=V=64 and T in {2048, 8192}: the forward and forward+backward time of
``kda_chunk``, its achieved GFLOP/s, and that rate as a fraction of the best large square fp32 matmul rate
measured in the same run with the same thread count; plus the speedup of ``kda_chunk`` over ``kda_recurrent``
(forward, T=2048). Timings are the minimum over repetitions (at least ``--reps``, and until each function ran
``--min-time`` seconds), with matmul and kernel repetitions interleaved so both see the same machine load.

FLOP count (per head and chunk of C tokens; only the matmuls the algorithm executes, dense shapes, 2 FLOPs per
multiply-add; elementwise work such as exponentials is not counted)::

    4 C^2 K           A = [K exp(G - m); Q exp(G - m)] (K exp(m - G))^T per 32-token sub-tile (L and A_qk)
    C^3               T = (I + L)^-1 Diag(beta): triangular solve against a C x C right-hand side
    2 C^2 (K + V)     W = T (exp(G) K), U = T V
    2 C K (K + V)     M = Diag(exp(G_C)) - Kg^T W, S_ext = Kg^T U
    2 K^2 V           the sequential state pass S <- M S + S_ext
    4 C K V           W S and Qg S
    2 C^2 V           A_qk V~

forward FLOPs = B * H * ceil(T / C) * (sum above); forward+backward FLOPs = 3 x forward (the backward of each
matmul is two matmuls of its size).

Usage: python benchmarks/bench_kda.py [--T 2048 8192] [--reps 5] [--threads N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from moonrt.model.kda import kda_chunk, kda_recurrent


def chunk_flops(B: int, T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Forward FLOPs of :func:`kda_chunk` (the formula in the module docstring)."""
    N = -(-T // C)
    per_chunk = (4 * C * C * K + C**3 + 2 * C * C * (K + V) + 2 * C * K * (K + V) + 2 * K * K * V
                 + 4 * C * K * V + 2 * C * C * V)
    return B * H * N * per_chunk


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Layer-like inputs: unit-norm q, k; g in (-5, 0) as K3's gate; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        k=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, H, V, generator=gen),
        g=-5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 2.0),
        beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)),
    )


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_min(fns: dict[str, Callable[[], object]], reps: int, min_time: float = 0.0) -> dict[str, float]:
    """Minimum wall time of each function over at least ``reps`` rounds, continuing until every function has
    run for ``min_time`` seconds in total; each round runs every function once (so all see the same load)."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    total = dict.fromkeys(fns, 0.0)
    rounds = 0
    while rounds < reps or min(total.values()) < min_time:
        for name, fn in fns.items():
            t = timed(fn)
            best[name] = min(best[name], t)
            total[name] += t
        rounds += 1
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192], help="sequence lengths")
    parser.add_argument("--reps", type=int, default=5, help="least timed repetitions (minimum is reported)")
    parser.add_argument("--min-time", type=float, default=3.0,
                        help="repeat until each measured function ran this many seconds (noisy shared machines)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--matmul-n", type=int, nargs="+", default=[1024, 2048],
                        help="sizes of the square reference matmuls (the best rate is the peak)")
    parser.add_argument("--out", default="/tmp/bench_kda.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, K, V, C = 1, 4, 64, 64, 64
    mats = {n: (torch.randn(n, n), torch.randn(n, n)) for n in args.matmul_n}
    matmuls = {f"matmul{n}": (lambda a=a, b=b: a @ b) for n, (a, b) in mats.items()}
    rows = []
    for T in tqdm(args.T, desc="kda_chunk", unit="T"):
        x = make_inputs(B, T, H, K, V)
        xg = {name: t.clone().requires_grad_() for name, t in x.items()}

        def fwd(x: dict[str, torch.Tensor] = x) -> None:
            with torch.no_grad():
                kda_chunk(**x, chunk_size=C)

        def fwd_bwd(xg: dict[str, torch.Tensor] = xg) -> None:
            o, _ = kda_chunk(**xg, chunk_size=C)
            o.sum().backward()

        t = interleaved_min({**matmuls, "fwd": fwd, "fwd_bwd": fwd_bwd}, args.reps, args.min_time)
        peak = max(2 * n**3 / t[f"matmul{n}"] / 1e9 for n in mats)
        flops = chunk_flops(B, T, H, K, V, C)
        row = dict(T=T, fwd_ms=t["fwd"] * 1e3, fwd_bwd_ms=t["fwd_bwd"] * 1e3, fwd_gflops=flops / t["fwd"] / 1e9,
                   fwd_bwd_gflops=3 * flops / t["fwd_bwd"] / 1e9, matmul_gflops=peak)
        row["fwd_frac"] = row["fwd_gflops"] / peak
        row["fwd_bwd_frac"] = row["fwd_bwd_gflops"] / peak
        rows.append(row)
    # speedup over the token recurrence, forward, T = 2048 (fewer repetitions: it is slow)
    x = make_inputs(B, 2048, H, K, V)
    with torch.no_grad():
        t = interleaved_min({"chunk": lambda: kda_chunk(**x), "recurrent": lambda: kda_recurrent(**x)},
                            max(1, args.reps // 2), args.min_time)
    speedup = dict(T=2048, chunk_ms=t["chunk"] * 1e3, recurrent_ms=t["recurrent"] * 1e3,
                   speedup=t["recurrent"] / t["chunk"])

    print(f"\nKDA chunked kernel, CPU fp32, B={B} H={H} K={K} V={V} C={C}, threads={torch.get_num_threads()}")
    print(f"{'T':>6} {'fwd ms':>9} {'GFLOP/s':>8} {'of peak':>8} {'fwd+bwd ms':>11} {'GFLOP/s':>8} {'of peak':>8}"
          f" {'matmul GFLOP/s':>15}")
    for r in rows:
        print(f"{r['T']:>6} {r['fwd_ms']:>9.1f} {r['fwd_gflops']:>8.2f} {r['fwd_frac']:>8.1%} {r['fwd_bwd_ms']:>11.1f}"
              f" {r['fwd_bwd_gflops']:>8.2f} {r['fwd_bwd_frac']:>8.1%} {r['matmul_gflops']:>15.2f}")
    print(f"speedup over kda_recurrent (forward, T=2048): {speedup['speedup']:.1f}x "
          f"({speedup['recurrent_ms']:.1f} ms -> {speedup['chunk_ms']:.1f} ms)")
    result = dict(config=dict(B=B, H=H, K=K, V=V, C=C, dtype="float32", threads=torch.get_num_threads(),
                              matmul_n=args.matmul_n, reps=args.reps, torch=torch.__version__,
                              machine=platform.machine()),
                  rows=rows, recurrent_speedup=speedup)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
