"""CPU benchmark of the chunked KDA kernel (K3_SYSTEMS §2.3) against this machine's fp32 matmul rate.

Measures, for fp32, B=1, H=4, K=V=64, T in {2048, 8192} and two decay regimes on K3's gate range
``g = -5 sigmoid(x)`` (mild: ``x ~ N(-2, 1)``; strong: ``x ~ N(0, 1)``): the forward and forward+backward time of
``kda_chunk``, its achieved GFLOP/s, that rate as a fraction of the 512 x 512 fp32 matmul rate measured in the same
run with the same thread count (torch's default unless ``--threads``), and the strong/mild time ratio; plus the
speedup of ``kda_chunk`` over ``kda_recurrent`` (forward, T=2048). Timings are the minimum over repetitions (at
least ``--reps``, and until each function ran ``--min-time`` seconds), with the matmul and both regimes' kernel
repetitions interleaved so all see the same machine load. Every printed figure carries the thread count, the CPU
model and torch's CPU capability.

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

``--baseline FILE|DIR``: also time the ``kda_chunk`` of another version of the kernel in the same interleaved rounds,
forward and forward+backward, and print both side by side: a self-contained ``kda.py`` (e.g.
``git show 106d3e1:moonrt/ops/kda.py > /tmp/kda_old.py``), or a checkout directory holding ``moonrt/`` (e.g.
``git worktree add /tmp/kda_base <rev>``; needed since the kernel spans kda.py, kda_terms.py and kda_autograd.py).

Usage: python benchmarks/bench_kda.py [--T 2048 8192] [--reps 5] [--threads N] [--baseline FILE|DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
from machine import cpu_model
from tqdm import tqdm

from moonrt.ops.kda import kda_chunk, kda_recurrent


def chunk_flops(B: int, T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Forward FLOPs of :func:`kda_chunk` (the formula in the module docstring)."""
    N = -(-T // C)
    per_chunk = (4 * C * C * K + C**3 + 2 * C * C * (K + V) + 2 * C * K * (K + V) + 2 * K * K * V
                 + 4 * C * K * V + 2 * C * C * V)
    return B * H * N * per_chunk


DECAY_SHIFT = {"mild": -2.0, "strong": 0.0}
"""Mean of x in ``g = -5 sigmoid(x)``, x ~ N(shift, 1), per decay regime."""


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0,
                shift: float = -2.0) -> dict[str, torch.Tensor]:
    """Layer-like inputs: unit-norm q, k; ``g = -5 sigmoid(x)``, x ~ N(shift, 1) as K3's gate; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        k=torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, H, V, generator=gen),
        g=-5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) + shift),
        beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)),
    )


def load_baseline(path: str) -> Callable[..., object]:
    """``kda_chunk`` of an older version of the kernel: a self-contained kda.py, or a checkout directory (e.g. from
    ``git worktree add /tmp/kda_base <rev>``) whose ``moonrt`` package is imported in isolation (its modules are
    loaded under their own names, then taken out of ``sys.modules`` again so this run's ``moonrt`` stays in place;
    the baseline's functions keep their own module globals)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "moonrt", "ops", "kda.py")):
            raise SystemExit(f"--baseline {path}: no moonrt/ops/kda/chunk.py in that directory")
        ours = {name: mod for name, mod in sys.modules.items() if name == "moonrt" or name.startswith("moonrt.")}
        for name in ours:
            del sys.modules[name]
        sys.path.insert(0, os.path.abspath(path))
        try:
            return importlib.import_module("moonrt.ops.kda").kda_chunk
        finally:
            sys.path.remove(os.path.abspath(path))
            for name in [n for n in sys.modules if n == "moonrt" or n.startswith("moonrt.")]:
                del sys.modules[name]
            sys.modules.update(ours)
    spec = importlib.util.spec_from_file_location("kda_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kda_chunk


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
    parser.add_argument("--matmul-n", type=int, default=512, help="size of the square reference matmul")
    parser.add_argument("--baseline", default=None,
                        help="an older self-contained kda.py, or a checkout directory, to time side by side")
    parser.add_argument("--out", default="/tmp/bench_kda.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, K, V, C = 1, 4, 64, 64, 64
    env = dict(threads=torch.get_num_threads(), cpu=cpu_model(), capability=torch.backends.cpu.get_cpu_capability())
    tag = f"[threads={env['threads']}, {env['cpu']}, {env['capability']}]"
    n = args.matmul_n
    a, b = torch.randn(n, n), torch.randn(n, n)
    load_before = os.getloadavg()
    kernels = {"": kda_chunk}
    if args.baseline:
        kernels["old_"] = load_baseline(args.baseline)
    rows = []
    for T in tqdm(args.T, desc="kda_chunk", unit="T"):
        fns: dict[str, Callable[[], object]] = {"matmul": lambda: a @ b}
        for regime, shift in DECAY_SHIFT.items():
            x = make_inputs(B, T, H, K, V, shift=shift)
            xg = {name: t.clone().requires_grad_() for name, t in x.items()}

            for prefix, kernel in kernels.items():

                def fwd(x: dict[str, torch.Tensor] = x, kernel: Callable[..., object] = kernel) -> None:
                    with torch.no_grad():
                        kernel(**x, chunk_size=C)

                def fwd_bwd(xg: dict[str, torch.Tensor] = xg, kernel: Callable[..., object] = kernel) -> None:
                    o, _ = kernel(**xg, chunk_size=C)  # type: ignore[misc]
                    o.sum().backward()

                fns[f"{prefix}fwd_{regime}"], fns[f"{prefix}fwd_bwd_{regime}"] = fwd, fwd_bwd
        t = interleaved_min(fns, args.reps, args.min_time)
        peak = 2 * n**3 / t["matmul"] / 1e9
        flops = chunk_flops(B, T, H, K, V, C)
        for prefix in kernels:
            for regime in DECAY_SHIFT:
                tf, tb = t[f"{prefix}fwd_{regime}"], t[f"{prefix}fwd_bwd_{regime}"]
                row = dict(kernel=prefix.rstrip("_") or "new", T=T, decay=regime, fwd_ms=tf * 1e3,
                           fwd_bwd_ms=tb * 1e3, fwd_gflops=flops / tf / 1e9, fwd_bwd_gflops=3 * flops / tb / 1e9,
                           matmul_gflops=peak, **env)
                row["fwd_frac"] = row["fwd_gflops"] / peak
                row["fwd_bwd_frac"] = row["fwd_bwd_gflops"] / peak
                rows.append(row)
            rows[-1]["strong_over_mild"] = dict(T=T, fwd=t[f"{prefix}fwd_strong"] / t[f"{prefix}fwd_mild"],
                                                fwd_bwd=t[f"{prefix}fwd_bwd_strong"] / t[f"{prefix}fwd_bwd_mild"])
    # speedup over the token recurrence, forward, T = 2048, mild decay (fewer repetitions: it is slow)
    x = make_inputs(B, 2048, H, K, V)
    with torch.no_grad():
        t = interleaved_min({"chunk": lambda: kda_chunk(**x), "recurrent": lambda: kda_recurrent(**x)},
                            max(1, args.reps // 2), args.min_time)
    speedup = dict(T=2048, chunk_ms=t["chunk"] * 1e3, recurrent_ms=t["recurrent"] * 1e3,
                   speedup=t["recurrent"] / t["chunk"], **env)

    print(f"\nKDA chunked kernel, CPU fp32, B={B} H={H} K={K} V={V} C={C}; reference: {n}x{n} fp32 matmul")
    print(f"{'kernel':>6} {'T':>6} {'decay':>6} {'fwd ms':>8} {'of mm':>6} {'fwd+bwd ms':>11} {'of mm':>6}"
          f" {'mm GFLOP/s':>11}"
          f" {'strong/mild fwd, fwd+bwd':>25}  machine")
    for r in rows:
        ratio_s = ""
        if "strong_over_mild" in r:
            ratio_s = f"{r['strong_over_mild']['fwd']:.2f}, {r['strong_over_mild']['fwd_bwd']:.2f}"
        print(f"{r['kernel']:>6} {r['T']:>6} {r['decay']:>6} {r['fwd_ms']:>8.1f} {r['fwd_frac']:>6.1%}"
              f" {r['fwd_bwd_ms']:>11.1f}"
              f" {r['fwd_bwd_frac']:>6.1%} {r['matmul_gflops']:>11.1f} {ratio_s:>25}  {tag}")
    print(f"speedup over kda_recurrent (forward, T=2048, mild): {speedup['speedup']:.1f}x "
          f"({speedup['recurrent_ms']:.1f} ms -> {speedup['chunk_ms']:.1f} ms)  {tag}")
    result = dict(config=dict(B=B, H=H, K=K, V=V, C=C, dtype="float32", matmul_n=n, reps=args.reps,
                              min_time=args.min_time, baseline=args.baseline, torch=torch.__version__,
                              machine=platform.machine(), load_before=load_before, load_after=os.getloadavg(), **env),
                  rows=rows, recurrent_speedup=speedup)
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {os.getloadavg()} (shared machine)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
