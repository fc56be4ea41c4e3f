"""``moonrt selftest --suite collectives``: all_reduce, all_to_all, all_gather and a send/recv ring.

1. **checks** each collective against values every rank computes locally (exact equality: inputs
   are small integers in fp32);
2. **measures** each at several message sizes: time, algorithm bandwidth and bus bandwidth
   (nccl-tests conventions: ``algbw = bytes / time`` with ``bytes`` the per-rank message;
   ``busbw = algbw x 2(n-1)/n`` for all_reduce, ``x (n-1)/n`` for all_gather and all_to_all,
   ``x 1`` for the ring).

Also the ``cpu-local`` hardware profile of ``moonrt ep-sim`` (:func:`measure_local_profile`,
:func:`local_profile`): all_to_all fitted to latency + bytes / bandwidth, plus a GEMM rate.
"""

from __future__ import annotations

import argparse
import time

from moonrt.jobs.selftest.common import SuiteResult, byte_sizes, device, timed

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
"""Message sizes in bytes per rank."""
OPS = ("all_reduce", "all_to_all", "all_gather", "ring")
_sizes = byte_sizes  # the parser's old name (benchmarks/bench_collectives.py)


# ---------------------------------------------------------------------------------------------
# Correctness checks


def check_collectives(rank: int, world: int) -> tuple[dict[str, bool], dict[str, list]]:
    """Run each collective on rank-dependent integer data; compare with the locally computed answer.

    Returns ``(ok, outputs)``: ``ok[op]`` is this rank's verdict, ``outputs[op]`` the raw result
    (lists of floats) for independent verification by a caller.
    """
    import torch
    import torch.distributed as dist

    dev = device()
    ok: dict[str, bool] = {}
    outputs: dict[str, list] = {}
    n = 8  # elements per rank per peer

    # all_reduce: rank r contributes (r + 1) * (i + 1); sum over r = world (world + 1) / 2 * (i + 1)
    x = (rank + 1) * torch.arange(1, n + 1, dtype=torch.float32, device=dev)
    dist.all_reduce(x)
    outputs["all_reduce"] = x.tolist()
    ok["all_reduce"] = torch.equal(x, world * (world + 1) / 2 * torch.arange(1, n + 1, dtype=torch.float32, device=dev))

    # all_to_all: rank r sends block d = 1000 r + 10 d + i to rank d; rank r receives 1000 s + 10 r + i from s
    i = torch.arange(n, dtype=torch.float32, device=dev)
    send = torch.cat([1000 * rank + 10 * d + i for d in range(world)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    outputs["all_to_all"] = recv.tolist()
    ok["all_to_all"] = torch.equal(recv, torch.cat([1000 * s + 10 * rank + i for s in range(world)]))

    # all_gather: rank r contributes 100 r + i
    mine = 100 * rank + i
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    outputs["all_gather"] = torch.cat(gathered).tolist()
    ok["all_gather"] = torch.equal(torch.cat(gathered), torch.cat([100 * s + i for s in range(world)]))

    # ring: send 7 r + i to rank r+1, receive from rank r-1
    got = _ring(7 * rank + i, rank, world)
    outputs["ring"] = got.tolist()
    ok["ring"] = torch.equal(got, 7 * ((rank - 1) % world) + i)
    return ok, outputs


def _ring(x, rank: int, world: int):
    import torch
    import torch.distributed as dist

    if world == 1:
        return x.clone()
    out = torch.empty_like(x)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, (rank + 1) % world),
        dist.P2POp(dist.irecv, out, (rank - 1) % world),
    ])
    for req in reqs:
        req.wait()
    return out


# ---------------------------------------------------------------------------------------------
# Bandwidth


BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "ring": lambda n: 1.0,
}


def measure(op: str, nbytes: int, iters: int, rank: int, world: int) -> float:
    """Mean seconds of one ``op`` on ``nbytes`` per rank (fp32), max over ranks, after one warm-up."""
    import torch
    import torch.distributed as dist

    numel = max(world, nbytes // 4 // world * world)
    dev = device()
    x = torch.ones(numel, dtype=torch.float32, device=dev)
    if op == "all_reduce":
        step = lambda: dist.all_reduce(x)
    elif op == "all_to_all":
        y = torch.empty_like(x)
        step = lambda: dist.all_to_all_single(y, x)
    elif op == "all_gather":
        y = torch.empty(numel * world, dtype=torch.float32, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        step = lambda: gather(y, x)
    else:
        step = lambda: _ring(x, rank, world)
    return timed(step, iters)


def gemm_tflops(shape: tuple[int, int, int] = (2048, 256, 256), repeats: int = 20) -> float:
    """Sustained fp32 GEMM rate of this process (1e12 FLOP/s): best of ``repeats`` ``[m, k] @ [k, n]``
    products at the current torch thread count (1 under selftest and ``run_ranks``)."""
    import torch

    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    out = torch.empty(m, n)
    torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e12


def fit_link(rows: list[dict], world: int) -> dict:
    """``{bandwidth_GBps, latency_us}`` from the all_to_all rows: least squares of time against the
    off-rank bytes each rank sends (``bytes x (n-1)/n``; the whole message on a 1-rank job); a
    single size or a non-positive slope falls back to the
    largest message's bus bandwidth, a negative intercept to 0."""
    import numpy as np

    share = (world - 1) / world if world > 1 else 1.0  # one rank: a local copy of the whole message
    pts = [(r["bytes"] * share, r["time_s"]) for r in rows if r["op"] == "all_to_all"]
    if not pts:
        raise ValueError("bandwidth table: no all_to_all rows to fit a link from")
    x, y = np.array(pts).T
    slope, icpt = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (y[0] / max(x[0], 1.0), 0.0)
    if slope <= 0:
        i = int(np.argmax(x))
        slope, icpt = y[i] / max(x[i], 1.0), 0.0
    return {"bandwidth_GBps": float(1.0 / slope / 1e9), "latency_us": float(max(icpt, 0.0) * 1e6)}


def local_profile(rows: list[dict], world: int, tflops: float, backend: str) -> dict:
    """The ``cpu-local`` hardware profile (a dict in the YAML layout of :mod:`moonrt.scheduler.hardware`):
    one node of ``world`` ranks; the inter-node link is set equal to the measured one (unused)."""
    link = fit_link(rows, world)
    return {"name": "cpu-local", "description": f"measured on this machine: {world} {backend} ranks, "
            "all_to_all fitted to latency + bytes / bandwidth; single-thread fp32 GEMM micro-benchmark",
            "ranks_per_node": world, "intra_node": link, "inter_node": dict(link), "gemm_tflops": tflops,
            "overlap_prefetch": False,
            "measured": {"world_size": world, "backend": backend, "all_to_all": [
                {"bytes": r["bytes"], "time_s": r["time_s"]} for r in rows if r["op"] == "all_to_all"]}}


def _profile_rank(rank: int, world: int, sizes: tuple[int, ...], iters: int) -> dict | None:
    rows = [{"op": "all_to_all", "bytes": b, "time_s": measure("all_to_all", b, iters, rank, world)} for b in sizes]
    return local_profile(rows, world, gemm_tflops(), "gloo") if rank == 0 else None


def measure_local_profile(ranks: int = 4, sizes: tuple[int, ...] = (64 << 10, 1 << 20, 4 << 20, 16 << 20),
                          iters: int = 5) -> dict:
    """Measure the ``cpu-local`` profile on the spot: ``ranks`` local gloo ranks time all_to_all at
    ``sizes`` bytes per rank, then rank 0 runs :func:`gemm_tflops`. Returns the profile dict."""
    from moonrt.cluster.local import run_ranks

    return run_ranks(_profile_rank, ranks, sizes, iters, timeout=300.0)[0]


def format_table(rows: list[dict], world: int) -> str:
    head = f"{'op':<11} {'bytes/rank':>11} {'time (ms)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
    lines = [f"moonrt selftest: collective bandwidth on {world} ranks", head, "-" * len(head)]
    for row in rows:
        lines.append(f"{row['op']:<11} {row['bytes']:>11d} {row['time_s'] * 1e3:>10.3f} "
                     f"{row['algbw_GBps']:>13.3f} {row['busbw_GBps']:>13.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The suite


def run_suite(args: argparse.Namespace, rank: int, world: int) -> SuiteResult:
    """Checks (``collectives/<op>``, with the raw outputs in ``extra["outputs"]``), then the table."""
    res = SuiteResult()
    ok, outputs = check_collectives(rank, world)
    for op, good in ok.items():
        res.check(f"collectives/{op}", good)
    res.extra["ok"], res.extra["outputs"] = ok, outputs
    for nbytes in args.sizes:
        for op in OPS:
            dt = measure(op, nbytes, args.iters, rank, world)
            algbw = nbytes / dt / 1e9
            res.rows.append({"op": op, "bytes": nbytes, "time_s": dt, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * BUS_FACTOR[op](world)})
    table = format_table(res.rows, world)
    if res.rows:
        peak = max(res.rows, key=lambda row: row["busbw_GBps"])
        table += f"\npeak busbw {peak['busbw_GBps']:.3f} GB/s ({peak['op']}, {peak['bytes']} B)"
    res.table = table
    return res
