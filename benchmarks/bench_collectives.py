"""Collective bandwidth of gloo on local ranks, side by side: all_reduce, all_to_all, all_gather, ring.

For each world size, one :func:`moonrt.cluster.local.run_ranks` job measures every op at every size
with :func:`moonrt.jobs.selftest.cli.measure` (after verifying results with
``check_collectives``). Reported per (world, size): bus bandwidth of each op (nccl-tests
conventions) and its ratio to the ring send/recv at the same size, measured in the same job, which
is what stays meaningful on a shared, noisy machine.

    .venv/bin/python benchmarks/bench_collectives.py [--worlds 2,4,8] [--sizes 64K,1M,4M] [--iters 5]
        [--out /tmp/moonrt-bench/bench_collectives.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from moonrt.cluster.local import run_ranks
from moonrt.jobs.selftest.cli import BUS_FACTOR, OPS, _sizes, check_collectives, measure


def _bench_rank(rank: int, world: int, sizes: tuple[int, ...], iters: int) -> list[dict]:
    ok, _ = check_collectives(rank, world)
    if not all(ok.values()):
        raise RuntimeError(f"rank {rank}: collective check failed: {ok}")
    rows = []
    for nbytes in sizes:
        for op in OPS:
            dt = measure(op, nbytes, iters, rank, world)
            algbw = nbytes / dt / 1e9
            rows.append({"world": world, "op": op, "bytes": nbytes, "time_s": dt, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * BUS_FACTOR[op](world)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes")
    parser.add_argument("--sizes", type=_sizes, default=(64 << 10, 1 << 20, 4 << 20), help="bytes per rank")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/moonrt-bench/bench_collectives.json"))
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]

    t0 = time.perf_counter()
    rows: list[dict] = []
    for world in tqdm(worlds, desc="world sizes"):
        rows += run_ranks(_bench_rank, world, args.sizes, args.iters, timeout=600)[0]
    ring = {(r["world"], r["bytes"]): r["busbw_GBps"] for r in rows if r["op"] == "ring"}
    for r in rows:
        r["vs_ring"] = r["busbw_GBps"] / ring[(r["world"], r["bytes"])]

    print(f"{'world':>5} {'bytes/rank':>11} " + " ".join(f"{op + ' busbw':>16} {'x ring':>7}" for op in OPS))
    for world in worlds:
        for nbytes in args.sizes:
            cells = {r["op"]: r for r in rows if r["world"] == world and r["bytes"] == nbytes}
            print(f"{world:>5} {nbytes:>11} " + " ".join(
                f"{cells[op]['busbw_GBps']:>16.3f} {cells[op]['vs_ring']:>7.2f}" for op in OPS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"worlds": worlds, "sizes": list(args.sizes), "iters": args.iters, "rows": rows},
                                   indent=1))
    print(f"bench_collectives: {len(rows)} measurements on worlds {worlds} in {time.perf_counter() - t0:.1f} s; "
          f"JSON in {args.out}")


if __name__ == "__main__":
    main()
