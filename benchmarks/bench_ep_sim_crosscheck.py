"""Check the ep-sim step-time model against measured MoE layers.

1. Measure the ``cpu-local`` hardware profile (4 gloo ranks' all_to_all fitted to latency +
   bytes / bandwidth; single-thread fp32 GEMM micro-benchmark).
2. Run ``benchmarks/bench_moonep_layer.py`` (4 gloo ranks, maxvio 0/1/4/16, all-to-all vs MoonEP)
   or read its JSON (``--measured``).
3. Rebuild each skew's router counts with the benchmark's own ``skewed_routing``, run the model's
   traffic (``placement_traffic`` with home placement for all-to-all, ``moonep_traffic`` for MoonEP)
   and compare per row: slowest-rank expert fwd+bwd time (rows x 3 x 2 x 3HF FLOPs / GEMM rate vs
   the benchmark's replayed slowest-rank compute) and off-rank bytes (tokens: dispatch + combine;
   MoonEP slot weights).

    .venv/bin/python benchmarks/bench_ep_sim_crosscheck.py   # JSON: /tmp/moonrt-bench/bench_ep_sim_crosscheck.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moonep_layer as layer  # noqa: E402

from moonrt.jobs.selftest.cli import measure_local_profile  # noqa: E402
from moonrt.scheduler import baselines as bl  # noqa: E402
from moonrt.scheduler.hardware import profile_from_dict  # noqa: E402
from moonrt.scheduler.moonep import plan  # noqa: E402
from moonrt.scheduler.steptime import moonep_traffic, placement_traffic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=None, help="bench_moonep_layer.py JSON (default: run it now)")
    ap.add_argument("--profile", default=None, help="cpu-local profile YAML (default: measure it now)")
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_ep_sim_crosscheck.json")
    args = ap.parse_args(argv)
    if args.profile:
        import yaml

        prof = yaml.safe_load(Path(args.profile).read_text())
    else:
        prof = measure_local_profile(4)
    hw = profile_from_dict(prof, "cpu-local")
    meas_path = args.measured
    if meas_path is None:
        meas_path = "/tmp/moonrt-bench/bench_moonep_layer.json"
        layer.main(["--out", meas_path])
    meas = json.loads(Path(meas_path).read_text())
    cfg = meas["config"]
    R, s, k, E, H, F = cfg["ranks"], cfg["tokens"], cfg["top_k"], cfg["experts"], cfg["hidden"], cfg["ffn"]
    flops_row = 3 * 2 * 3 * H * F  # fwd+bwd (3x forward) of three H x F matrices, multiply-add
    rows_out = []
    print(f"cpu-local: GEMM {hw.gemm_tflops * 1e3:.1f} GFLOP/s (1 thread fp32), all_to_all "
          f"{hw.intra_node.bandwidth_GBps:.3f} GB/s + {hw.intra_node.latency_us:.0f} us; R={R} s={s} k={k} E={E} "
          f"H={H} F={F}")
    print(f"{'maxvio':>6} {'policy':>8} | {'expert ms model':>15} {'measured':>9} {'err':>7} | "
          f"{'token MB model':>14} {'measured':>9} {'err':>6} | {'weight MB model':>15} {'measured':>9}")
    for entry in meas["results"]:
        ids = layer.skewed_routing(R, s, k, E, entry["maxvio"], seed=1)
        counts = np.stack([torch.bincount(i.flatten(), minlength=E).numpy() for i in ids]).astype(np.int64)
        pl = plan(counts)
        model = {"alltoall": placement_traffic(counts, bl.no_redundancy(E, R)),
                 "moonep": moonep_traffic(counts, pl, 0.0)}
        for m, tr in model.items():
            got = entry[m]
            ms = float(tr.rows.max()) * flops_row / (hw.gemm_tflops * 1e12) * 1e3
            tok = 2 * (tr.tokens.sum() - np.trace(tr.tokens)) * H * 4
            wgt = tr.weights.sum() * 3 * H * F * 4
            row = {"maxvio": entry["maxvio"], "policy": m, "expert_ms_model": ms,
                   "expert_ms_measured": got["slowest_compute_ms"],
                   "expert_err": ms / got["slowest_compute_ms"] - 1, "token_MB_model": tok / 1e6,
                   "token_MB_measured": got["token_bytes_off_rank"] / 1e6,
                   "token_err": tok / got["token_bytes_off_rank"] - 1 if got["token_bytes_off_rank"] else 0.0,
                   "weight_MB_model": wgt / 1e6, "weight_MB_measured": got["weight_bytes_off_rank"] / 1e6}
            rows_out.append(row)
            print(f"{row['maxvio']:>6g} {m:>8} | {ms:>15.1f} {row['expert_ms_measured']:>9.1f} "
                  f"{row['expert_err']:>+7.1%} | {row['token_MB_model']:>14.2f} {row['token_MB_measured']:>9.2f} "
                  f"{row['token_err']:>+6.1%} | {row['weight_MB_model']:>15.2f} {row['weight_MB_measured']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"profile": hw.to_dict(), "measured": meas_path, "rows": rows_out}, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
