"""KCP's summary gather over the shm heap vs gloo's all-gather, in the same job (issue 48 item 3).

KCP moves one fixed-size summary per rank and pass, ``[B, H, K, V + K]`` fp32 (``[S_ext | M]`` forward, ``[a | M]``
backward; :mod:`moonrt.comm.cp.kcp`). For each world size one :func:`moonrt.cluster.local.run_ranks` job (CPU gloo
ranks of this host, one thread each) times, at each model's summary shape, with every rank at once and the slowest
rank's time (:func:`moonrt.jobs.selftest.common.timed`):

- ``heap``: :class:`moonrt.comm.cp.gather.HeapGather` over :class:`moonrt.comm.transport.shm.ShmHeap` (each rank
  writes its summary into its slot of every peer's buffer, signals, waits for every peer; the copy out of the buffer
  into tensors the caller owns included), first checked bitwise against gloo;
- ``gloo``: :class:`moonrt.comm.cp.gather.CollectiveGather` (``dist.all_gather`` over TCP loopback, today's path).

Shapes: ``k3_tiny`` (B 2, H 4, K = V 48), ``k3_100m`` (B 1, H 10, K = V 96) and one K3 layer's (B 1, H 96, K = V 128,
12.6 MB per rank). Table on stdout; JSON (a new file; an existing one only with --force).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_kcp_heap.py [--worlds 2,4] [--iters 20]
        [--out /tmp/moonrt-bench/bench_kcp_heap.json] [--force]
"""

from __future__ import annotations

import argparse
import sys

import torch
from machine import rank_bench_args, write_rows

from moonrt.cluster.local import run_ranks
from moonrt.comm.cp.gather import CollectiveGather, HeapGather
from moonrt.comm.transport.shm import ShmHeap
from moonrt.jobs.selftest.common import timed

SHAPES: dict[str, tuple[int, int, int, int]] = {"k3_tiny": (2, 4, 48, 48), "k3_100m": (1, 10, 96, 96),
                                                 "k3": (1, 96, 128, 128)}
"""Model -> (B, H, K, V) of its KCP summary ``[B, H, K, V + K]``."""


def _bench_rank(rank: int, world: int, iters: int) -> list[dict]:
    heap, gloo = HeapGather(ShmHeap()), CollectiveGather(None)
    rows = []
    for name, (B, H, K, V) in SHAPES.items():
        x = torch.randn(B, H, K, V + K, generator=torch.Generator().manual_seed(rank))
        if not all(torch.equal(a, b) for a, b in zip(heap.all_gather(x), gloo.all_gather(x))):
            raise RuntimeError(f"rank {rank}: the heap's summary gather differs from gloo's for {name}")
        t_heap = timed(lambda: heap.all_gather(x), iters)  # noqa: B023 (timed runs it now)
        t_gloo = timed(lambda: gloo.all_gather(x), iters)  # noqa: B023
        nbytes = x.numel() * x.element_size()
        rows.append({"world": world, "model": name, "shape": [B, H, K, V + K], "bytes_per_rank": nbytes,
                     "heap_s": t_heap, "gloo_s": t_gloo, "heap_GBps": world * nbytes / t_heap / 1e9,
                     "gloo_GBps": world * nbytes / t_gloo / 1e9, "heap_vs_gloo": t_gloo / t_heap})
    heap.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args, worlds = rank_bench_args(parser, "bench_kcp_heap", iters=20)
    rows: list[dict] = []
    for world in worlds:
        rows += run_ranks(_bench_rank, world, args.iters, timeout=600)[0]
    head = f"{'ranks':>5} {'model':>8} {'KB/rank':>9} | {'heap us':>9} {'gloo us':>9} | {'heap/gloo':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['world']:>5} {r['model']:>8} {r['bytes_per_rank'] / 1024:>9.1f} | {r['heap_s'] * 1e6:>9.1f} "
              f"{r['gloo_s'] * 1e6:>9.1f} | {r['heap_vs_gloo']:>8.1f}x")
    write_rows(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
