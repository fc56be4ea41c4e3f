"""``moonrt ep-sim`` at cluster scale: wall time per layer-step and peak RSS against R.

Each configuration runs as its own ``moonrt ep-sim`` process (all four policies, the step-time model
on ``--hardware``, no plot); peak RSS is that process's ``ru_maxrss`` (``os.wait4``). Default
grid: E=896, k=16, s=4096, 8 steps x 8 layers, R in {64, 112, 224, 448, 896}, and E=4096, R=1024.
The R=64 run is compared with ``benchmarks/ep_sim_r64_reference.json`` (written by ep-sim
before workloads were streamed and the transfer matrix became an O(R·E) sweep): balance, copies and
bytes must be identical.

    .venv/bin/python benchmarks/bench_ep_sim_scale.py   # JSON: /tmp/moonrt-bench/bench_ep_sim_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRID = [(896, r) for r in (64, 112, 224, 448, 896)] + [(4096, 1024)]


def run_one(E: int, R: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "moonrt.cli", "ep-sim", "--experts", str(E), "--ranks", str(R), "--top-k",
           str(args.top_k), "--tokens", str(args.tokens), "--steps", str(args.steps), "--layers", str(args.layers),
           "--out", str(out), "--no-plot", "--quiet"]
    if args.hardware:
        cmd += ["--hardware", args.hardware]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"E={E} R={R}: exit {proc.returncode}: {stderr.strip()}")
    doc = json.loads((out / "summary.json").read_text())
    n = args.steps * args.layers
    row = {"experts": E, "ranks": R, "wall_s": wall, "sim_s": doc["seconds"], "layer_steps": n,
           "ms_per_layer_step": 1e3 * doc["seconds"] / n, "peak_rss_MB": usage.ru_maxrss / 1024,
           "estimated_MB": doc["estimated_memory_bytes"] / 2**20, "summary": doc["summary"], "stdout": stdout}
    if R == 64 and E == 896 and (args.steps, args.layers, args.tokens, args.top_k) == (8, 8, 4096, 16):
        ref = json.loads((HERE / "ep_sim_r64_reference.json").read_text())
        same = ref["maxvio"] == doc["maxvio"] and all(
            v == doc["per_step"][p][k] for p in ref["policies"] for k, v in ref["per_step"][p].items())
        row["identical_to_reference"] = same
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hardware", default="h800-ib400", help="profile for the step-time model ('' for none)")
    ap.add_argument("--grid", default=None, help="E:R pairs, comma separated (default: E=896 with R in "
                    "64..896, and 4096:1024)")
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_ep_sim_scale.json")
    args = ap.parse_args(argv)
    grid = GRID if not args.grid else [tuple(int(x) for x in p.split(":")) for p in args.grid.split(",")]
    rows = []
    print(f"{'E':>5} {'R':>5} {'wall s':>8} {'ms/layer-step':>14} {'peak RSS MB':>12} {'est. MB':>8} "
          f"{'us/(layer-step x R x E)':>24} {'MoonEP speed-up vs none/eplb':>29}")
    with tempfile.TemporaryDirectory() as tmp:
        for E, R in grid:
            row = run_one(E, R, args, Path(tmp) / f"{E}_{R}")
            rows.append(row)
            s = row["summary"]
            sp = (f"{s['none']['moonep_speedup']:.2f}x / {s['eplb']['moonep_speedup']:.2f}x"
                  if "moonep_speedup" in s.get("none", {}) else "-")
            ident = {True: " (identical to the reference run)", False: " (DIFFERS from reference)"}.get(
                row.get("identical_to_reference"), "")
            print(f"{E:>5} {R:>5} {row['sim_s']:>8.1f} {row['ms_per_layer_step']:>14.1f} {row['peak_rss_MB']:>12.0f} "
                  f"{row['estimated_MB']:>8.0f} {1e6 * row['ms_per_layer_step'] / 1e3 / (R * E):>24.4f} "
                  f"{sp:>29}{ident}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
