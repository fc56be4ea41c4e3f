"""The shm symmetric heap vs gloo vs this machine's memcpy, side by side in the same job (issue 48 item 1).

For each world size one :func:`moonrt.cluster.local.run_ranks` job (CPU gloo ranks of this host, one thread each)
measures, at each size (bytes each rank sends, split equally over the ranks, rows of 64 fp32), with every rank at
once and the slowest rank's time:

- ``memcpy``: each rank copies its buffer into another of its own (``Tensor.copy_``): the physical limit for ranks
  sharing one memory, measured under the same contention;
- ``heap put``: each rank writes its rows straight into every peer's receive buffer through the peer views, signals
  each, and waits for every peer's signal (the one-sided transfer alone);
- ``heap all_to_all``: :meth:`moonrt.comm.transport.shm.ShmHeap.all_to_all_v` (the puts plus the copy out of the
  receive buffer into a new tensor the caller owns), first checked bitwise against gloo;
- ``gloo all_to_all``: ``all_to_all_single`` over TCP loopback (:class:`moonrt.comm.transport.collectives.
  CollectivesTransport`, today's path).

Bandwidth = bytes each rank sends / time. Table on stdout; JSON (a new file; an existing one only with --force).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transport.py [--worlds 2,4] [--sizes 1M,4M,16M] [--iters 10]
        [--out /tmp/moonrt-bench/bench_transport.json] [--force]
"""

from __future__ import annotations

import argparse
import sys

import torch
from machine import rank_bench_args, write_rows

from moonrt.cluster.local import run_ranks
from moonrt.comm.transport.collectives import CollectivesTransport
from moonrt.comm.transport.shm import ShmHeap
from moonrt.jobs.selftest.common import byte_sizes, timed

ROW = 64  # fp32 per row


def _measure(heap: ShmHeap, gloo: CollectivesTransport, rank: int, world: int, nbytes: int, iters: int) -> dict:
    rows = max(1, nbytes // 4 // ROW // world)  # rows to each rank
    sent = rows * world * ROW * 4
    counts = [[rows] * world for _ in range(world)]
    x = torch.randn(rows * world, ROW, generator=torch.Generator().manual_seed(rank))
    if not torch.equal(heap.all_to_all_v(x, counts), gloo.all_to_all_v(x, counts)):
        raise RuntimeError(f"rank {rank}: the heap's all-to-all differs from gloo's at {sent} bytes")
    dst = torch.empty_like(x)
    recv = heap.alloc((2, rows * world, ROW), torch.float32)
    calls = [0]

    def put() -> None:
        parity = calls[0] % 2  # double buffer, as the heap's all-to-all: no barrier per call
        calls[0] += 1
        for i in range(world):
            d = (rank + i) % world
            recv.peer(d)[parity, rank * rows: (rank + 1) * rows].copy_(x[d * rows: (d + 1) * rows])
            if d != rank:
                heap.signal(d)
        for i in range(1, world):
            heap.wait((rank - i) % world)

    t = {"memcpy": timed(lambda: dst.copy_(x), iters), "heap_put": timed(put, iters),
         "heap_all_to_all": timed(lambda: heap.all_to_all_v(x, counts), iters),
         "gloo_all_to_all": timed(lambda: gloo.all_to_all_v(x, counts), iters)}
    row: dict = {"world": world, "bytes_per_rank": sent}
    for k, dt in t.items():
        row[f"{k}_s"], row[f"{k}_GBps"] = dt, sent / dt / 1e9
    row["heap_put_vs_gloo"] = t["gloo_all_to_all"] / t["heap_put"]
    row["heap_all_to_all_vs_gloo"] = t["gloo_all_to_all"] / t["heap_all_to_all"]
    row["heap_put_vs_memcpy"] = t["memcpy"] / t["heap_put"]
    return row


def _bench_rank(rank: int, world: int, sizes: tuple[int, ...], iters: int) -> list[dict]:
    heap, gloo = ShmHeap(), CollectivesTransport()
    rows = [_measure(heap, gloo, rank, world, nbytes, iters) for nbytes in sizes]
    heap.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=byte_sizes, default=(1 << 20, 4 << 20, 16 << 20),
                        help="bytes each rank sends (K/M suffixes)")
    args, worlds = rank_bench_args(parser, "bench_transport", iters=10)
    rows: list[dict] = []
    for world in worlds:
        rows += run_ranks(_bench_rank, world, args.sizes, args.iters, timeout=600)[0]
    head = (f"{'ranks':>5} {'MB/rank':>8} | {'memcpy':>8} {'heap put':>9} {'heap a2a':>9} {'gloo a2a':>9} GB/s | "
            f"{'put/gloo':>8} {'a2a/gloo':>8} {'put/memcpy':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['world']:>5} {r['bytes_per_rank'] / 2**20:>8.2f} | {r['memcpy_GBps']:>8.2f} "
              f"{r['heap_put_GBps']:>9.2f} {r['heap_all_to_all_GBps']:>9.2f} {r['gloo_all_to_all_GBps']:>9.3f}      | "
              f"{r['heap_put_vs_gloo']:>7.1f}x {r['heap_all_to_all_vs_gloo']:>7.1f}x {r['heap_put_vs_memcpy']:>9.0%}")
    write_rows(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
