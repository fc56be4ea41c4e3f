"""MoonEP dispatch + combine over the shm symmetric heap vs the collectives, and both vs memcpy (issue 48 item 5).

For each world size one :func:`moonrt.cluster.local.run_ranks` job (CPU gloo ranks of this host, one thread each)
builds two :class:`moonrt.comm.ep.dispatch.EPDispatcher` on the same problem (MoonEP placement, dedup on, fp32
rows of the K3 latent width 3584 by default, uniform random top-k routing), one over
:class:`moonrt.comm.ep.heap.HeapTransport` and one over :class:`moonrt.comm.ep.transport.CollectiveTransport`
(gloo ``all_to_all_single``), checks that their outputs and gradients are equal bitwise, and times, every rank at
once and the slowest rank's time:

- ``layer``: a MoE layer's dispatch + prefetch + combine, forward and backward (the expert compute is a row scaling,
  so the time is the dispatcher's): counts all-gather, plan, layout, and the data movement;
- ``move``: the transport's data verbs alone (``dispatch`` + ``combine`` forward and backward under a fixed layout,
  the dedup layout included), each transport under the layouts its dispatcher builds (the heap: the device
  layouts, rows named by their slot rows; gloo: the host split sizes): what the heap replaces;
- ``overlap``: the heap dispatch's forward and a stand-in shared expert (two matmuls), one after the other and with
  the shared expert computed while the rows move (:meth:`moonrt.comm.ep.heap.HeapTransport.dispatch_async`); and
  the dispatcher's whole dispatch (counts, plan, device layout, rows: :meth:`EPDispatcher.dispatch_async`, what
  ``LatentMoE`` does on the heap) with the shared expert: ``layer ratio`` = that time / max(dispatch, shared)
  (issue 48's acceptance: <= 1.2);
- ``memcpy``: one rank copying the bytes it sends in ``move`` (dispatch rows out and combine rows back, forward and
  backward) into another buffer of its own: this machine's memcpy bandwidth under the same contention.

GB/s = bytes this rank sends in ``move`` (all four transfers) / time. Host synchronizations per layer: the calls
``tests/host_syncs.py`` counts (``.item()``, ``int()`` / ``bool()`` of a tensor, ``.tolist()``, ``.cpu()``) in
moonrt's frames during one ``layer`` and during the data verbs of one ``move`` (dispatch and combine, forward and
backward, under the layer's dedup layout), per transport. Table on stdout; JSON (a new file; an existing
one only with --force).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ep_heap.py [--worlds 2,4] [--tokens 128] [--hidden 3584]
        [--top-k 4] [--iters 10] [--out /tmp/moonrt-bench/bench_ep_heap.json] [--force]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from host_syncs import HostSyncCounter  # noqa: E402
from machine import rank_bench_args, write_rows  # noqa: E402

from moonrt.cluster.local import run_ranks  # noqa: E402
from moonrt.comm.ep.dispatch import EPDispatcher  # noqa: E402
from moonrt.comm.ep.heap import HeapTransport  # noqa: E402
from moonrt.comm.ep.placement import MoonEPPlacement  # noqa: E402
from moonrt.comm.transport.shm import ShmHeap  # noqa: E402
from moonrt.jobs.selftest.common import timed  # noqa: E402

EXPERTS_PER_RANK = 4
FFN = 8  # the expert weights (only moved by the prefetch; the compute is a scaling)
SHARED = 512  # the stand-in shared expert's width: [s, H] @ [H, 512] @ [512, H]


def _layer(disp: EPDispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, home: list[torch.Tensor],
           gout: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    home = [t.detach().requires_grad_() for t in home]
    recv_x, _, _, handle = disp.dispatch(x, ids, w)
    slots = disp.prefetch_weights(handle, home)
    scale = torch.cat([home[0].sum((1, 2)), slots[0].sum((1, 2))])  # one number per segment owner: grads reach both
    seg = torch.repeat_interleave(torch.arange(handle.cu_seqlens.shape[0] - 1), handle.cu_seqlens.diff())
    per_seg = torch.zeros(handle.cu_seqlens.shape[0] - 1)
    E = disp.num_experts
    first = disp.rank * disp.experts_per_rank
    per_seg[first:first + disp.experts_per_rank] = 1.0
    per_seg[E:] = 1.0
    owner = torch.where(seg < E, seg - first, disp.experts_per_rank + seg - E).clamp_min(0)
    y = recv_x * (1.0 + 1e-3 * scale[owner]).unsqueeze(1) * per_seg[seg].unsqueeze(1)
    out = disp.combine(y, handle)
    (out * gout).sum().backward()
    return [out.detach(), x.grad, w.grad, *[t.grad for t in home]]


def _measure(rank: int, world: int, tokens: int, hidden: int, k: int, iters: int, heap: ShmHeap) -> dict:
    E = EXPERTS_PER_RANK * world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    gout = torch.randn(tokens, hidden, generator=g)
    home = [torch.randn(EXPERTS_PER_RANK, FFN, FFN, generator=g)]
    transports = {"heap": HeapTransport(heap, capacity=tokens, top_k=k), "gloo": None}
    disps = {name: EPDispatcher(None, capacity=tokens, hidden=hidden, top_k=k, num_experts=E,
                                placement=MoonEPPlacement(), transport=t) for name, t in transports.items()}
    got = {name: _layer(d, x, ids, w, home, gout) for name, d in disps.items()}
    if not all(torch.equal(a, b) for a, b in zip(got["heap"], got["gloo"])):
        raise RuntimeError(f"rank {rank}: the heap's MoE layer differs from the collectives' (bitwise)")
    handles = {name: d.dispatch(x, ids, w)[3] for name, d in disps.items()}  # each transport's own layouts
    dd = handles["gloo"].dedup  # host split sizes: the bytes each rank sends
    xr, wr = x.detach().requires_grad_(), w.detach()

    def move(name: str, fixed: bool = False) -> None:
        t, h = disps[name].transport, handles[name]
        rows, row_w = t.dispatch(xr, wr, h.layout, h.dedup if fixed else t.dedup_layout(h.layout, None))
        out = t.combine(rows * row_w.unsqueeze(1), None, h.layout, h.dedup, (), None, rows.dtype)
        out.sum().backward()

    row_bytes = hidden * 4
    sent = 2 * sum(dd.pair_send_splits) * row_bytes + 2 * sum(dd.pair_recv_splits) * row_bytes
    src = torch.randn(max(sent // 4, 1), generator=g)
    dst = torch.empty_like(src)
    row: dict = {"world": world, "tokens": tokens, "hidden": hidden, "top_k": k, "bytes_per_rank": sent,
                 "memcpy_s": timed(lambda: dst.copy_(src), iters)}
    for name, d in disps.items():
        row[f"{name}_layer_s"] = timed(lambda d=d: _layer(d, x, ids, w, home, gout), iters)
        row[f"{name}_move_s"] = timed(lambda name=name: move(name), iters)
        with HostSyncCounter() as c:
            _layer(d, x, ids, w, home, gout)
        row[f"{name}_layer_syncs"] = c.total
        with HostSyncCounter() as c:
            move(name, fixed=True)
        row[f"{name}_move_syncs"] = c.total
    # overlap: the heap dispatch's forward with a shared expert's two matmuls, one after the other and hidden under it
    heap_t, hh = disps["heap"].transport, handles["heap"]
    w1, w2 = torch.randn(hidden, SHARED, generator=g), torch.randn(SHARED, hidden, generator=g)

    def shared() -> torch.Tensor:
        return (x @ w1) @ w2

    def serial() -> None:
        heap_t.dispatch(x, w, hh.layout, hh.dedup)
        shared()

    def overlapped() -> None:
        pending = heap_t.dispatch_async(x, w, hh.layout, hh.dedup)
        shared()
        pending.wait()

    heap_d = disps["heap"]

    def layer_overlapped() -> None:  # what LatentMoE.forward does on the heap: the whole dispatch on the worker
        pending = heap_d.dispatch_async(x, ids, w)
        shared()
        pending.wait()

    with torch.no_grad():
        row["overlap_dispatch_s"] = timed(lambda: heap_t.dispatch(x, w, hh.layout, hh.dedup), iters)
        row["overlap_shared_s"] = timed(shared, iters)
        row["overlap_serial_s"] = timed(serial, iters)
        row["overlap_async_s"] = timed(overlapped, iters)
        row["overlap_layer_dispatch_s"] = timed(lambda: heap_d.dispatch(x, ids, w), iters)
        row["overlap_layer_async_s"] = timed(layer_overlapped, iters)
    row["overlap_layer_ratio"] = row["overlap_layer_async_s"] / max(row["overlap_layer_dispatch_s"],
                                                                    row["overlap_shared_s"])
    heap_t.close()
    for key in ("memcpy", "heap_move", "gloo_move"):
        row[f"{key}_GBps"] = sent / row[f"{key}_s"] / 1e9
    row["move_heap_vs_gloo"] = row["gloo_move_s"] / row["heap_move_s"]
    row["layer_heap_vs_gloo"] = row["gloo_layer_s"] / row["heap_layer_s"]
    row["move_heap_vs_memcpy"] = row["memcpy_s"] / row["heap_move_s"]
    return row


def _bench_rank(rank: int, world: int, tokens: int, hidden: int, k: int, iters: int) -> dict:
    heap = ShmHeap()
    try:
        return _measure(rank, world, tokens, hidden, k, iters, heap)
    finally:
        heap.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank per MoE call")
    parser.add_argument("--hidden", type=int, default=3584, help="row width (K3's routed-expert latent width)")
    parser.add_argument("--top-k", type=int, default=4)
    args, worlds = rank_bench_args(parser, "bench_ep_heap", iters=10)
    if min(args.tokens, args.hidden, args.top_k) < 1:
        print(f"bench_ep_heap: --tokens {args.tokens} --hidden {args.hidden} --top-k {args.top_k}: expected >= 1",
              file=sys.stderr)
        return 2
    rows = [run_ranks(_bench_rank, w, args.tokens, args.hidden, args.top_k, args.iters, timeout=900)[0]
            for w in worlds]
    head = (f"{'ranks':>5} {'MB/rank':>8} | {'memcpy':>7} {'heap':>7} {'gloo':>7} GB/s (move) | {'heap/gloo':>9} "
            f"{'heap/memcpy':>11} | layer ms heap {'gloo':>6} | syncs/layer heap gloo (move: heap gloo)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['world']:>5} {r['bytes_per_rank'] / 2**20:>8.2f} | {r['memcpy_GBps']:>7.2f} "
              f"{r['heap_move_GBps']:>7.2f} {r['gloo_move_GBps']:>7.3f}             | "
              f"{r['move_heap_vs_gloo']:>8.1f}x {r['move_heap_vs_memcpy']:>10.0%} | "
              f"{1e3 * r['heap_layer_s']:>13.2f} {1e3 * r['gloo_layer_s']:>6.2f} | "
              f"{r['heap_layer_syncs']:>16} {r['gloo_layer_syncs']:>4} ({r['heap_move_syncs']} {r['gloo_move_syncs']})")
    print("\noverlap (heap dispatch forward, a shared expert's [s,H]@[H,512]@[512,H]; ms): dispatch, shared, "
          "one after the other, shared computed while the rows move (dispatch_async) | the dispatcher's whole "
          "dispatch, it with the shared expert overlapped, ratio to max(dispatch, shared)")
    for r in rows:
        print(f"{r['world']:>5} | {1e3 * r['overlap_dispatch_s']:8.2f} {1e3 * r['overlap_shared_s']:8.2f} "
              f"{1e3 * r['overlap_serial_s']:8.2f} {1e3 * r['overlap_async_s']:8.2f} | "
              f"{1e3 * r['overlap_layer_dispatch_s']:8.2f} {1e3 * r['overlap_layer_async_s']:8.2f} "
              f"{r['overlap_layer_ratio']:6.2f}")
    write_rows(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
