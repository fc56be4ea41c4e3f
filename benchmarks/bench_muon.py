"""Per-Head Muon: Newton-Schulz time per optimizer step, per-head vs whole-matrix, and ZeRO-1 bytes per step.

1. K3 shapes (hidden 7168, 96 heads x 128): one query projection ``[96 * 128, 7168]`` orthogonalized as
   96 ``[128, 7168]`` head blocks (batched) vs one ``[12288, 7168]`` matrix. Analytic FLOPs for both
   (:func:`moonrt.ops.muon.ns_flops`); wall time measured for the heads, and for the whole matrix only with
   ``--k3-whole`` (about 1.6e13 FLOPs: tens of minutes on one CPU core; timed once), optionally timing
   ``--whole-steps`` of the 5 NS iterations and scaling (every iteration does the same work). Every figure is
   printed with the CPU model, core count, torch thread count and load average at the time it was taken.
2. k3_tiny: every Muon matrix of the model, as ``moonrt train --optimizer muon`` orthogonalizes them
   (``muon_per_head`` true vs false), NS time per optimizer step (median of ``--repeats``).
3. Communication per step and rank, ZeRO-1 over dp ranks (k3_tiny, fp32): AdamW's flat partition
   (:mod:`moonrt.comm.zero.adamw`: one reduce-scatter and one all-gather of ``ceil(L / dp)`` per rank) vs
   Muon's unit ownership (:mod:`moonrt.comm.zero.muon`: the same two collectives on segments padded to the
   largest owner, from the same plan the part builds). Ring bytes sent per rank: ``2 * (dp - 1) * S * 4``.

    .venv/bin/python benchmarks/bench_muon.py [--repeats 3] [--k3-whole] [--whole-steps 1] [--device cpu]
        [--out /tmp/moonrt-bench/bench_muon.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from machine import wall_times

from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig, OptimConfig
from moonrt.jobs.train.optimizers import muon_blocks
from moonrt.ops.muon import block_grid, ns_flops, to_blocks, zeropower_via_newtonschulz
from moonrt.scheduler.muon_plan import plan_units, unit_layout


def _time(fn, repeats: int, device: str) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    return statistics.median(wall_times(fn, repeats, device))


def machine() -> dict:
    """What the timings ran on: CPU model, core count, torch threads, load averages (1, 5, 15 min) now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _machine_line(m: dict) -> str:
    return (f"[{m['time']}: {m['cpu']}, {m['cores']} cores, torch threads {m['threads']}, "
            f"load average {'/'.join(map(str, m['loadavg']))}]")


def k3_projection(repeats: int, whole: bool, whole_steps: int, device: str, dtype: torch.dtype) -> dict:
    heads, hd, d = 96, 128, 7168
    g = torch.randn(heads * hd, d, device=device)
    blocks = g.view(heads, hd, d)
    row = {"shape": [heads * hd, d], "heads": heads, "head_dim": hd,
           "flops_per_head": heads * ns_flops(hd, d), "flops_whole": ns_flops(heads * hd, d)}
    row["machine_before"] = machine()
    row["heads_s"] = _time(lambda: zeropower_via_newtonschulz(blocks, dtype=dtype), repeats, device)
    row["machine_heads"] = machine()
    if whole:  # timed once, no warm-up (one call is minutes on a CPU)
        t0 = time.perf_counter()
        zeropower_via_newtonschulz(g, steps=whole_steps, dtype=dtype)
        if device == "cuda":
            torch.cuda.synchronize()
        row["whole_s"] = (time.perf_counter() - t0) * 5 / whole_steps
        row["whole_steps_timed"] = whole_steps
        row["machine_whole"] = machine()
    return row


def tiny_step(repeats: int, device: str, dtype: torch.dtype) -> dict:
    out = {}
    for per_head in (True, False):
        cfg = OptimConfig(optimizer="muon", muon_per_head=per_head)
        model = build_model(JobConfig(model="k3_tiny", optim=cfg))
        params = dict(model.named_parameters())
        specs = muon_blocks(model, cfg)
        mats = [to_blocks(torch.randn(params[n].shape, device=device), s) for n, s in specs.items()]
        flops = 0
        for n, s in specs.items():
            stack, heads, a, b = block_grid(params[n].shape, s)
            flops += stack * heads * ns_flops(a, b)

        def step(mats: list[torch.Tensor] = mats) -> None:
            for u in mats:
                zeropower_via_newtonschulz(u[0] if u.shape[0] == 1 else u, dtype=dtype)

        out["per_head" if per_head else "whole"] = {"ns_s": _time(step, repeats, device), "flops": flops,
                                                    "blocks": sum(u.shape[0] for u in mats)}
    out["machine"] = machine()
    return out


def comm_bytes(dps: tuple[int, ...]) -> list[dict]:
    cfg = OptimConfig(optimizer="muon")
    model = build_model(JobConfig(model="k3_tiny", optim=cfg))
    named, units, _ = unit_layout(model, muon_blocks(model, cfg))
    total = sum(p.numel() for _, p in named)
    rows = []
    for dp in dps:
        plan = plan_units(units, dp)
        s_adamw, s_muon = -(-total // dp), plan.shard
        rows.append({"dp": dp, "elements": total, "adamw_zero1_shard": s_adamw, "muon_zero1_shard": s_muon,
                     "adamw_bytes_per_rank": 2 * (dp - 1) * s_adamw * 4,
                     "muon_bytes_per_rank": 2 * (dp - 1) * s_muon * 4,
                     "muon_padding": dp * s_muon - total, "flops_imbalance": plan.imbalance,
                     "adamw_state_bytes_per_rank": 2 * 4 * s_adamw,
                     "muon_state_bytes_max_rank": 4 * max(
                         sum(units[u].numel * (1 if units[u].muon else 2) for u in plan.units[r]) for r in range(dp))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k3-whole", action="store_true", help="also time the whole [12288, 7168] matrix (slow on CPU)")
    ap.add_argument("--whole-steps", type=int, default=5, help="NS iterations timed for the whole matrix (scaled to 5)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_muon.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    res = {"device": args.device, "dtype": args.dtype, "threads": args.threads,
           "k3_tiny": tiny_step(args.repeats, args.device, dtype), "comm": comm_bytes((2, 4, 8)),
           "k3": k3_projection(args.repeats, args.k3_whole, args.whole_steps, args.device, dtype)}
    k3 = res["k3"]
    ratio = k3["flops_whole"] / k3["flops_per_head"]
    print(f"K3 q projection [{k3['shape'][0]}, {k3['shape'][1]}] ({args.device}, {args.dtype}): NS FLOPs 96 heads "
          f"{k3['flops_per_head']:.3g} vs whole {k3['flops_whole']:.3g} ({ratio:.1f}x); "
          f"heads {k3['heads_s']:.3f} s {_machine_line(k3['machine_heads'])}")
    if "whole_s" in k3:
        scaled = ", scaled to 5" if k3["whole_steps_timed"] < 5 else ""
        print(f"  whole matrix {k3['whole_s']:.1f} s ({k3['whole_s'] / k3['heads_s']:.1f}x the heads; "
              f"{k3['whole_steps_timed']} of 5 NS iterations timed{scaled}) {_machine_line(k3['machine_whole'])}")
    t = res["k3_tiny"]
    print(f"k3_tiny, all Muon matrices per step: per-head {t['per_head']['ns_s'] * 1e3:.1f} ms "
          f"({t['per_head']['blocks']} blocks, {t['per_head']['flops']:.3g} FLOPs) "
          f"vs whole {t['whole']['ns_s'] * 1e3:.1f} ms "
          f"({t['whole']['blocks']} blocks, {t['whole']['flops']:.3g} FLOPs) {_machine_line(t['machine'])}")
    print("ZeRO-1 on k3_tiny, bytes sent per rank per step (reduce-scatter + all-gather, ring):")
    for r in res["comm"]:
        print(f"  dp {r['dp']}: AdamW {r['adamw_bytes_per_rank']:,} vs Muon {r['muon_bytes_per_rank']:,} "
              f"({r['muon_bytes_per_rank'] / r['adamw_bytes_per_rank']:.3f}x; padding {r['muon_padding']:,} elements, "
              f"FLOP imbalance {r['flops_imbalance']:.3f}); optimizer state per rank AdamW "
              f"{r['adamw_state_bytes_per_rank']:,} vs Muon max {r['muon_state_bytes_max_rank']:,}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
