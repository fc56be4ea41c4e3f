"""``moonrt selftest --suite transport``: the transport seam's backends (issue 48 item 1), so a user checks a new
allocation's heap before a long job.

Backends run: ``collectives`` always (the reference); ``shm`` when the ranks are CPU ranks of one host; ``cuda``
when they are GPUs of one host and torch symmetric memory builds (never proven by this project's tests: no GPU).
A heap backend that does not fit the job is reported skipped with its reason, never passed.

Checks (``transport/<backend>/<what>``, on every rank, exact):

- ``put_get``: each rank puts rank-dependent data into the next rank's buffer through its peer view, signals it,
  waits for the previous rank's; then every rank reads every rank's buffer (gets) after a barrier;
- ``signal_order``: 20 rounds around the ring, each round's value seen whole after its signal;
- ``barrier``: every rank's write before a barrier is seen by every rank after it;
- ``all_to_all``: variable row counts (seeded, the same on every rank), equal to the collectives' result bitwise.

Measured per backend and ``--transport-sizes`` (bytes each rank sends): one all-to-all of equal splits, slowest
rank, and its bandwidth ``bytes per rank / time``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from moonrt.comm.transport.base import SymmetricHeap, Transport
from moonrt.comm.transport.collectives import CollectivesTransport
from moonrt.comm.transport.select import group_hosts
from moonrt.jobs.selftest.common import SuiteResult, byte_sizes, device, timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport-sizes", type=byte_sizes, default=(64 << 10, 1 << 20, 4 << 20),
                        help="transport suite: bytes each rank sends per all-to-all, comma-separated, K/M suffixes "
                             "(default 64K,1M,4M)")


def _heaps(world: int) -> tuple[list[SymmetricHeap], list[str]]:
    """The heap backends this job can build (collective), and the reasons of those it cannot."""
    dev, hosts = device(), sorted(set(group_hosts(None)))
    if len(hosts) > 1:
        return [], [f"shm/cuda: the ranks are on {len(hosts)} hosts (a heap is one host's memory)"]
    if dev.type == "cpu":
        from moonrt.comm.transport.shm import ShmHeap

        return [ShmHeap()], ["cuda: CPU ranks"]
    try:
        from moonrt.comm.transport.cuda import CudaHeap

        return [CudaHeap()], ["shm: GPU ranks"]
    except RuntimeError as exc:
        return [], ["shm: GPU ranks", f"cuda: {exc}"]


def _check_heap(res: SuiteResult, heap: SymmetricHeap, ref: CollectivesTransport, rank: int, world: int) -> None:
    dev = device()
    name = f"transport/{heap.name}"
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = heap.alloc((256,), torch.float32)
    heap.barrier()
    data = lambda r: torch.arange(256, dtype=torch.float32, device=dev) * (r + 1) + 0.5 * r  # noqa: E731
    buf.peer(nxt).copy_(data(rank))
    if world > 1:
        heap.signal(nxt)
        heap.wait(prv)
    put = torch.equal(buf.local, data(prv))
    heap.barrier()
    got = all(torch.equal(buf.peer(r), data((r - 1) % world)) for r in range(world))
    heap.barrier()
    res.check(f"{name}/put_get", put and got, put=put, get=got)
    cell = heap.alloc((64,), torch.int64)
    ok = True
    for i in range(20):  # round i: rank i % world writes i into the next rank's cell
        if world == 1:
            break
        if rank == i % world:
            cell.peer(nxt).fill_(i)
            heap.signal(nxt)
        elif rank == (i + 1) % world:
            heap.wait(prv)
            ok &= bool((cell.local == i).all())
    heap.barrier()
    res.check(f"{name}/signal_order", ok)
    cell.local.fill_(7000 + rank)
    heap.barrier()
    ok = all(bool((cell.peer(r) == 7000 + r).all()) for r in range(world))
    heap.barrier()
    res.check(f"{name}/barrier", ok)
    g = torch.Generator().manual_seed(11)
    ok = True
    for hi in (4, 33, 0):
        counts = torch.randint(0, hi + 1, (world, world), generator=g).tolist()
        x = torch.randn(sum(counts[rank]), 24, generator=torch.Generator().manual_seed(rank + hi)).to(dev)
        ok &= torch.equal(heap.all_to_all_v(x, counts), ref.all_to_all_v(x, counts))
    res.check(f"{name}/all_to_all", ok)


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    res = SuiteResult()
    ref = CollectivesTransport()
    heaps, skipped = _heaps(world)
    res.extra["skipped"] = skipped
    for heap in heaps:
        _check_heap(res, heap, ref, rank, world)
    dev = device()
    transports: list[Transport] = [ref, *heaps]
    for transport in transports:
        for nbytes in args.transport_sizes:
            rows = max(1, nbytes // 4 // 64 // world)  # rows of 64 fp32 to each rank
            counts = [[rows] * world for _ in range(world)]
            x = torch.randn(rows * world, 64, device=dev)
            dt = timed(lambda t=transport, x=x, c=counts: t.all_to_all_v(x, c), args.iters)
            sent = rows * world * 64 * 4
            res.rows.append({"backend": transport.name, "bytes": sent, "ms": dt * 1e3, "GBps": sent / dt / 1e9})
    for heap in heaps:
        heap.close()
    dist.barrier()
    res.table = format_table(res.rows, world)
    return res


def format_table(rows: list[dict], world: int) -> str:
    head = f"{'backend':>12} {'bytes':>10} | {'all_to_all ms':>13} {'GB/s':>8}"
    lines = [f"moonrt selftest transport: {world} ranks, all-to-all of equal splits, bytes each rank sends, "
             "slowest rank", head, "-" * len(head)]
    lines += [f"{r['backend']:>12} {r['bytes']:>10d} | {r['ms']:>13.3f} {r['GBps']:>8.3f}" for r in rows]
    return "\n".join(lines)
