"""A k3_tiny pipeline step on 4 gloo ranks: measured idle fraction per rank vs the simulator's bubble,
cached vs naive AttnRes bytes, step time.

For each schedule (1F1B, interleaved with V = 2, ZB1P) and AttnRes mode (cached, naive) the ranks run
:class:`moonrt.comm.pp.part.PipelineParallel` on k3_tiny (fp32, batch ``--batch`` x ``--seq-len``, M =
``--microbatches``): one warm-up step, then ``--steps`` timed steps. Per rank: forward blocks and bytes
sent, backward bytes, and the idle fraction (seconds blocked in receives / seconds of the action list,
median over the timed steps); the simulator's idle fraction per rank under unit costs (F = I = W = 1,
B = 2) is printed beside it. On a machine with fewer cores than ranks the measured idle time also holds
time the OS gave the other ranks, so only the bytes are exact there.

    .venv/bin/python benchmarks/bench_pp_step.py [--steps 3] [--microbatches 8]
        [--out /tmp/moonrt-bench/bench_pp_step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from machine import cpu_model

from moonrt.cluster.local import run_ranks
from moonrt.comm.pp.part import PipelineParallel
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.model import K3Model
from moonrt.scheduler.pipeline import build_schedule, simulate

RANKS = 4
LAYOUTS = (("1f1b", 1), ("interleaved", 2), ("zb", 1))


def _rank(rank: int, world: int, kind: str, vpp: int, mode: str, m: int, batch: int, seq: int,
          steps: int) -> dict:
    torch.manual_seed(0)
    part = PipelineParallel(build_schedule(kind, world, m, vpp), group=dist.group.WORLD, rank=rank, mode=mode)
    model = part.parallelize(K3Model(k3_tiny()))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    idle, wall = [], []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        part.forward_backward(model, x, y, 1.0 / y.numel())
        dt = time.perf_counter() - t0
        st = part.executor.stats
        if i:
            idle.append(st.recv_wait_s / st.wall_s)
            wall.append(dt)
    return {"idle": statistics.median(idle), "step_s": statistics.median(wall), "blocks": st.blocks_sent,
            "bytes_fwd": st.bytes_sent, "bytes_bwd": st.bytes_sent_bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default="/tmp/moonrt-bench/bench_pp_step.json")
    args = ap.parse_args()
    rows = []
    print(f"k3_tiny, {RANKS} gloo ranks, batch {args.batch} x {args.seq_len}, M = {args.microbatches}; {cpu_model()}")
    print(f"{'schedule':<12} {'mode':<7} {'step s':>7} {'fwd KiB/rank':>26} {'bwd KiB':>9}  idle measured | simulated")
    for kind, vpp in LAYOUTS:
        sim = simulate(build_schedule(kind, RANKS, args.microbatches, vpp))
        for mode in ("cached", "naive"):
            res = run_ranks(_rank, RANKS, kind, vpp, mode, args.microbatches, args.batch, args.seq_len, args.steps,
                            timeout=900)
            row = {"schedule": kind, "vpp": vpp, "mode": mode, "ranks": res,
                   "sim_idle": [sim.idle_fraction(r) for r in range(RANKS)], "sim_bubble": sim.bubble_fraction}
            rows.append(row)
            fwd = "/".join(f"{r['bytes_fwd'] / 1024:.0f}" for r in res)
            idle = " ".join(f"{r['idle']:.2f}" for r in res)
            simi = " ".join(f"{v:.2f}" for v in row["sim_idle"])
            print(f"{kind:<12} {mode:<7} {max(r['step_s'] for r in res):7.2f} {fwd:>26} "
                  f"{sum(r['bytes_bwd'] for r in res) / 1024:9.0f}  {idle} | {simi}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
