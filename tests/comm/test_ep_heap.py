"""MoonEP over the shm symmetric heap (issue 48 item 2), on real gloo ranks (tests/dist.py):

- dispatch, prefetch and combine through :class:`HeapTransport` equal :class:`CollectiveTransport` bitwise (fp32),
  outputs and every gradient (tokens, router weights, home expert weights through their slot copies), on 2 and 4
  ranks (8: slow), with and without dedup, repeated top-k, token padding, fewer slots than copies (a shared slot
  pool re-prefetched in backward) and the all-to-all baseline; the heap pass makes no all-to-all or all-gather
  collective (they are patched to raise) and reuses its receive slots (no allocation after the first layer call);
- the device layouts (MoonEP, B >= E/R) place every assignment as the host layout does; a whole MoE layer through the
  dispatcher on the heap (counts, plan, layout, dispatch, prefetch, combine, forward and backward) makes no host
  synchronization (``tests/host_syncs.py``'s counter, on CPU), and neither do the data verbs; the traffic counters
  equal the collectives'; ``MOONRT_DEBUG=1`` takes the host layout and names bad routing ids on every rank;
- ``dispatch_async`` (the rows moved on the transport's worker thread while this thread computes) equals the
  synchronous dispatch bitwise, forward and backward;
- a rank killed in the middle of a dispatch is named by its peer and nothing is left in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import dist_run
from host_syncs import HostSyncCounter

from moonrt.cluster.local import RankError, run_ranks
from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.heap import HeapTransport
from moonrt.comm.ep.placement import HomePlacement, MoonEPPlacement
from moonrt.comm.ep.slots import SlotPool
from moonrt.comm.transport.shm import SHM_DIR, PeerDied, ShmHeap
from moonrt.ops.grouped import grouped_glu_experts
from moonrt.scheduler.moonep import MoonEPPlan

H, F, E, S = 12, 10, 8, 6


def _problem(world: int, k: int, routing: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = E // world
    bias = torch.tensor([8.0] * per + [1.0] * (E - per))  # rank 0's experts hot: copies and shared destinations
    xs, ids, ws, gouts = [], [], [], []
    for _ in range(world):
        xs.append(torch.randn(S, H, generator=g))
        gouts.append(torch.randn(S, H, generator=g))
        if routing == "repeated":  # a token may list an expert twice
            ids.append(torch.multinomial(bias, S * k, replacement=True, generator=g).view(S, k))
        else:
            ids.append(torch.stack([torch.multinomial(bias, k, generator=g) for _ in range(S)]))
        w = torch.rand(S, k, generator=g) + 0.1
        ws.append(w / w.sum(1, keepdim=True))
    experts = [torch.randn(E, F, H, generator=g) * 0.3, torch.randn(E, F, H, generator=g) * 0.3,
               torch.randn(E, H, F, generator=g) * 0.3]
    return {"xs": xs, "ids": ids, "ws": ws, "gouts": gouts, "experts": experts}


def _layer(disp: EPDispatcher, p: dict, rank: int, world: int) -> list[torch.Tensor]:
    """One MoE layer forward and backward through ``disp``: every tensor the comparison needs."""
    per = E // world
    x = p["xs"][rank].clone().requires_grad_()
    w = p["ws"][rank].clone().requires_grad_()
    home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]]
    recv_x, recv_w, cu, handle = disp.dispatch(x, p["ids"][rank], w)
    slots = disp.prefetch_weights(handle, home)
    y_home = grouped_glu_experts(recv_x[: handle.home_rows], handle.home_cu_seqlens(), *home)
    y_slot = grouped_glu_experts(recv_x[handle.home_rows:], handle.slot_cu_seqlens(), *slots)
    y = torch.cat([y_home, y_slot])
    out = disp.combine(y, handle)
    ((out * p["gouts"][rank]).sum() + (recv_w * torch.arange(recv_w.shape[0])).sum()).backward()
    return [recv_x.detach(), recv_w.detach(), cu, out.detach(), x.grad, w.grad, *[t.grad for t in home]]


def _no_collectives(*args: object, **kwargs: object) -> None:
    raise AssertionError("the heap path called an all-to-all / all-gather collective")


def _rank_fn(rank: int, world: int, k: int, routing: str, dedup: bool, padding: int, num_slots: int | None,
             baseline: bool) -> dict:
    torch.manual_seed(0)
    heap = ShmHeap()

    def build(transport: HeapTransport | None) -> tuple[EPDispatcher, EPDispatcher]:
        placement = HomePlacement() if baseline else MoonEPPlacement(num_slots)
        pool = None
        if not baseline:  # two layers share one slot pool: each re-prefetches its copies in backward
            pool = SlotPool(placement.slots(E // world), 2 * F * H + H * F)
        return tuple(EPDispatcher(None, capacity=S, hidden=H, top_k=k, num_experts=E, placement=placement,
                                  pool=pool, dedup=dedup, token_padding=padding, transport=transport)
                     for _ in range(2))

    ref_layers = build(None)
    transport = HeapTransport(heap, capacity=S, top_k=k)
    heap_layers = build(transport)
    problems = [_problem(world, k, routing, seed) for seed in (1, 2, 3)]
    want = [_layer(ref_layers[i % 2], p, rank, world) for i, p in enumerate(problems)]
    real_a2a, real_ag = dist.all_to_all_single, dist.all_gather_single
    dist.all_to_all_single, dist.all_gather_single = _no_collectives, _no_collectives
    try:
        got = [_layer(heap_layers[0], problems[0], rank, world)]
        slots_after_first = len(transport.exchange.slots)
        got += [_layer(heap_layers[i % 2], p, rank, world) for i, p in enumerate(problems) if i]
    finally:
        dist.all_to_all_single, dist.all_gather_single = real_a2a, real_ag
    same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for g, w in zip(got, want) for a, b in zip(g, w))
    for d in (*ref_layers, *heap_layers):
        d.counters.settle()
    counters_same = [dataclasses.astuple(a.counters) == dataclasses.astuple(b.counters)
                     for a, b in zip(ref_layers, heap_layers)]
    result = {"same": same, "counters_same": counters_same,
              "puts": transport.exchange.puts, "grew": len(transport.exchange.slots) - slots_after_first,
              "copies": sum(int(d.counters.experts_prefetched) for d in ref_layers),
              "device": [d.device_layouts for d in heap_layers]}
    heap.close()
    return result


CASES = [  # (world, k, routing, dedup, padding, num_slots, baseline)
    (2, 2, "skewed", True, 1, None, False),
    (2, 3, "repeated", False, 1, None, False),
    (2, 2, "skewed", True, 4, 1, False),
    (4, 3, "repeated", True, 1, None, False),
    (4, 2, "skewed", False, 4, None, False),
    (4, 4, "repeated", True, 4, 1, False),  # fewer slots than the copies the plan wants
    (4, 2, "skewed", True, 1, None, True),
]


@pytest.mark.parametrize("world,k,routing,dedup,padding,num_slots,baseline", CASES)
def test_heap_transport_equals_collectives_bitwise(world: int, k: int, routing: str, dedup: bool, padding: int,
                                                   num_slots: int | None, baseline: bool) -> None:
    res = dist_run(_rank_fn, world, k, routing, dedup, padding, num_slots, baseline, timeout=180)
    assert all(r["same"] for r in res), "heap transport differs from the collectives (bitwise)"
    assert all(r["counters_same"] == [True, True] for r in res), "traffic counters differ from the collectives'"
    assert all(r["puts"] > 0 for r in res) and all(r["grew"] == 0 for r in res), res
    # MoonEP with B >= E/R moves on the device layouts; fewer slots (rows follow the routing) and the baseline on
    # the host layouts
    assert all(r["device"] == [num_slots is None and not baseline] * 2 for r in res), res
    if not baseline:
        assert sum(r["copies"] for r in res) > 0, "the problem must make the planner copy experts"


@pytest.mark.slow
def test_heap_transport_equals_collectives_bitwise_8_ranks() -> None:
    for case in [(8, 3, "repeated", True, 4, 1, False), (8, 2, "skewed", False, 1, None, False)]:
        res = dist_run(_rank_fn, *case, timeout=300)
        assert all(r["same"] and r["puts"] > 0 and r["grew"] == 0 for r in res), res


def _killed_mid_dispatch(rank: int, world: int, report: str) -> str:
    heap = ShmHeap()
    Path(report, "prefix").write_text(heap._prefix)
    transport = HeapTransport(heap, capacity=S, top_k=2)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=2, num_experts=E, placement=MoonEPPlacement(),
                        transport=transport)
    p = _problem(world, 2, "skewed", 0)
    disp.dispatch(p["xs"][rank], p["ids"][rank], p["ws"][rank])  # warm (the planner's first call compiles)
    if rank == 1:  # dies in the next dispatch's first row exchange (after the counts' all-gather)
        real = transport.exchange.scatter_rows

        def die(*args: object) -> torch.Tensor:
            heap.wait(0)  # rank 0 has put its rows here and waits for this rank's
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)
            return real(*args)

        transport.exchange.scatter_rows = die
    t0 = time.monotonic()
    try:
        disp.dispatch(p["xs"][rank], p["ids"][rank], p["ws"][rank])
    except PeerDied as exc:
        Path(report, "rank0").write_text(f"{time.monotonic() - t0:.3f}\n{exc}")
        return "named"
    return "dispatch finished without its peer"


def test_a_rank_killed_mid_dispatch_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_killed_mid_dispatch, 2, str(tmp_path), timeout=60, collective_timeout_s=30)
    assert info.value.rank == 1, info.value
    seconds, line = (tmp_path / "rank0").read_text().split("\n", 1)
    assert float(seconds) < 10.0
    assert line.startswith("shm heap: rank 1 (pid ") and "died while rank 0 waited for its signal" in line, line
    prefix = (tmp_path / "prefix").read_text()
    assert sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix)) == []


def _resolve(rank: int, world: int, kind: str) -> tuple[str, str, bool]:
    from moonrt.comm.ep.parallel import ExpertParallel
    from moonrt.config import ParallelConfig

    try:
        ep = ExpertParallel(ParallelConfig(ep=2, ep_transport=kind), capacity=4)
    except ValueError as exc:
        return "error", str(exc), False
    heap = ep.heap
    ep.close()
    return ep.ep_transport, type(heap).__name__, heap is not None


@pytest.mark.parametrize("kind,want", [("shm", "shm"), ("auto", "shm"), ("collectives", "collectives")])
def test_expert_parallel_resolves_the_transport_for_its_group(kind: str, want: str) -> None:
    out = dist_run(_resolve, 2, kind, timeout=60)
    assert out[0] == out[1] and out[0][0] == want and out[0][2] == (want == "shm"), out


def test_a_cuda_heap_on_cpu_ranks_is_one_line() -> None:
    out = dist_run(_resolve, 2, "cuda", timeout=60)
    assert out[0] == out[1] == ("error", "parallel.ep_transport = 'cuda': the tensors are on cpu; expected GPUs (shm "
                                "serves CPU ranks)", False), out
    from moonrt.comm.ep.parallel import ExpertParallel
    from moonrt.config import ParallelConfig

    assert ExpertParallel(ParallelConfig(ep=1, ep_transport="cuda"), capacity=4).heap is None  # no EP group


def _layer_syncs(rank: int, world: int, dedup: bool, padding: int) -> tuple[dict, int, bool]:
    """Host synchronizations of one whole MoE layer through the dispatcher on the heap: dispatch (counts, plan,
    layout, rows), prefetch, combine, forward and backward. The expert compute is a dense stand-in (the grouped
    GEMM's CPU path reads its ``cu_seqlens`` bounds, that is the kernel's, not the dispatcher's)."""
    heap = ShmHeap()
    k, per = 3, E // world
    p = _problem(world, k, "repeated", 5)
    transport = HeapTransport(heap, capacity=S, top_k=k)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=k, num_experts=E, placement=MoonEPPlacement(),
                        transport=transport, dedup=dedup, token_padding=padding)
    _layer(disp, p, rank, world)  # warm: the receive slots are allocated, the planner compiled
    puts = transport.exchange.puts
    x = p["xs"][rank].clone().requires_grad_()
    w = p["ws"][rank].clone().requires_grad_()
    home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]]
    with HostSyncCounter() as layer:
        recv_x, recv_w, cu, handle = disp.dispatch(x, p["ids"][rank], w)
        slots = disp.prefetch_weights(handle, home)
        y = recv_x * (1 + sum(t.sum() for t in slots)) + recv_w.unsqueeze(1) + cu[-1]
        out = disp.combine(y, handle)
        ((out * p["gouts"][rank]).sum() + sum(t.sum() for t in home)).backward()
    moved = transport.exchange.puts - puts
    heap.close()
    return dict(layer.counts), moved, disp.device_layouts


@pytest.mark.parametrize("dedup,padding", [(True, 1), (False, 4)])
def test_a_heap_moe_layer_makes_no_host_synchronization(dedup: bool, padding: int) -> None:
    """Zero counted host synchronizations (``item``, ``int()`` / ``bool()``, ``tolist``, ``.cpu()``, host -> device
    copies of lists) for one MoE layer's dispatch + prefetch + combine, forward and backward, on the heap with the
    device layouts. The heap's signal waits poll shared CPU memory (a flag the peer's put sets), no device tensor:
    the counter sees nothing there, and on a GPU heap they are device-side waits too."""
    for counts, moved, device in dist_run(_layer_syncs, 2, dedup, padding, timeout=120):
        assert device and moved > 0
        assert counts == {}, counts


def test_the_debug_switch_takes_the_host_layout_and_names_bad_ids() -> None:
    """``MOONRT_DEBUG=1``: the heap dispatcher takes the host layout, whose validation reads every rank's status
    back, so an out-of-range routing id is one clear error on every rank (not a hang or an index error)."""
    out = dist_run(_bad_ids, 2, timeout=120)
    assert all(not device for device, _ in out), out
    assert all(line == "EP dispatch: EP rank 1 passed invalid input (topk ids out of range); see that rank's error "
               "for details" if r == 0 else line.startswith("EP dispatch (EP rank 1): topk_ids: value 8 out of range")
               for r, (_, line) in enumerate(out)), out


def _bad_ids(rank: int, world: int, debug: bool = True, what: str = "ids") -> tuple[bool, str]:
    if debug:
        os.environ["MOONRT_DEBUG"] = "1"  # this rank process's own environment
    heap = ShmHeap()
    transport = HeapTransport(heap, capacity=S, top_k=2)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=2, num_experts=E, placement=MoonEPPlacement(),
                        transport=transport)
    p = _problem(world, 2, "skewed", 0)
    ids, x, w = p["ids"][rank].clone(), p["xs"][rank], p["ws"][rank]
    if rank == 1 and what == "ids":
        ids[0, 0] = E
    if rank == 1 and what == "tokens":
        ids, x, w = ids[:-1], x[:-1], w[:-1]
    try:
        disp.dispatch(x, ids, w)
        line = "no error"
    except (ValueError, RuntimeError) as exc:
        line = str(exc)
    heap.close()
    return disp.device_layouts, line


@pytest.mark.parametrize("what,want", [
    ("ids", "EP dispatch: an EP rank passed topk ids outside [0, E) (E = 8); rerun with MOONRT_DEBUG=1"),
    ("tokens", "EP dispatch: the EP ranks passed different token counts"),
])
def test_the_device_layout_path_fails_on_every_rank_for_bad_routing_or_unequal_tokens(what: str, want: str) -> None:
    """Without the debug switch the heap path reads nothing back, but the all-gathered status and token counts are
    checked by a device-side assert on every rank (CPU: raised at once; CUDA: an asynchronous device assert), so
    out-of-range ids or unequal ``s`` (which would break the static ``s * k`` rows) never pass silently."""
    out = dist_run(_bad_ids, 2, False, what, timeout=120)
    assert all(device and line.startswith(want) for device, line in out), out


def _syncs(rank: int, world: int) -> tuple[int, dict, int]:
    heap = ShmHeap()
    k, per = 2, E // world
    p = _problem(world, k, "skewed", 5)
    transport = HeapTransport(heap, capacity=S, top_k=k)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=k, num_experts=E, placement=MoonEPPlacement(),
                        transport=transport)
    _layer(disp, p, rank, world)  # warm: the receive slots are allocated, the planner compiled
    x = p["xs"][rank].clone().requires_grad_()
    w = p["ws"][rank].clone().requires_grad_()
    home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]]
    with HostSyncCounter() as layer:
        _, _, _, handle = disp.dispatch(x, p["ids"][rank], w)
    puts = transport.exchange.puts
    with HostSyncCounter() as verbs:
        rows, row_w = transport.dispatch(x, w, handle.layout, handle.dedup)
        slots, _ = transport.fetch_slots(tuple(home), handle.weight_layout, None, rows)
        y = rows * row_w.unsqueeze(1) * (1 + sum(t.sum() for t in slots))
        out = transport.combine(y, None, handle.layout, handle.dedup, (rows, *slots), None, y.dtype)
        out.sum().backward()
    moved = transport.exchange.puts - puts
    heap.close()
    kinds: dict[str, int] = {}
    for (kind, _), n in verbs.counts.items():
        kinds[kind] = kinds.get(kind, 0) + n
    return kinds, dict(layer.counts), moved


def test_the_heap_data_verbs_make_no_host_synchronization() -> None:
    """No device -> host read (``item``, ``int()`` / ``bool()``, ``tolist``, ``.cpu()``) nor host -> device copy in
    the heap's dispatch, prefetch and combine, forward and backward, under the device layouts, and none in the
    dispatcher's counts, plan and layout (:func:`moonrt.comm.ep.layout.build_device_layout`)."""
    for kinds, layer, moved in dist_run(_syncs, 2, timeout=120):
        assert moved > 0 and kinds == {}, (kinds, moved)
        assert layer == {}, layer


def _async(rank: int, world: int) -> bool:
    heap = ShmHeap()
    k = 3
    p = _problem(world, k, "repeated", 7)
    transport = HeapTransport(heap, capacity=S, top_k=k)
    disp = EPDispatcher(None, capacity=S, hidden=H, top_k=k, num_experts=E, placement=MoonEPPlacement(),
                        transport=transport)
    _, _, _, handle = disp.dispatch(p["xs"][rank], p["ids"][rank], p["ws"][rank])
    results = []
    for mode in ("sync", "async"):
        x = p["xs"][rank].clone().requires_grad_()
        w = p["ws"][rank].clone().requires_grad_()
        shared = torch.zeros(())
        if mode == "sync":
            rows, row_w = transport.dispatch(x, w, handle.layout, handle.dedup)
        else:
            pending = transport.dispatch_async(x, w, handle.layout, handle.dedup)
            shared = (x.detach() @ x.detach().t()).sum()  # this thread's work while the rows move
            rows, row_w = pending.wait()
            assert pending.event.is_set()
        out = transport.combine(rows * row_w.unsqueeze(1), None, handle.layout, handle.dedup, (rows,), None,
                                rows.dtype)
        (out * p["gouts"][rank]).sum().backward()
        results.append([rows.detach(), row_w.detach(), out.detach(), x.grad, w.grad, shared * 0])
    transport.close()
    heap.close()
    return all(torch.equal(a, b) for a, b in zip(*results))


def test_dispatch_async_equals_dispatch_bitwise() -> None:
    assert all(dist_run(_async, 2, timeout=120))


@pytest.mark.parametrize("world,k,seed", [(2, 2, 0), (4, 3, 1), (4, 4, 2), (8, 2, 3)])
def test_the_device_layout_places_every_assignment_as_the_host_layout(world: int, k: int, seed: int) -> None:
    """:func:`build_device_layout` (tensor ops only) puts every assignment on the rank and in the expert row that
    :func:`build_layout` does, on every rank, for skewed routing with repeated ids (MoonEP copies, B = E/R)."""
    from moonrt.comm.ep.layout import build_device_layout, build_layout
    from moonrt.scheduler.moonep_torch import plan_device

    g = torch.Generator().manual_seed(seed)
    bias = torch.tensor([8.0] * (E // world) + [1.0] * (E - E // world))
    ids = [torch.multinomial(bias, S * k, replacement=True, generator=g).view(S, k) for _ in range(world)]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plan = plan_device(counts, kernels="torch")
    assert int((plan.copies >= 0).sum()) > 0
    block = S * k
    # rank d's receive slot as the device layouts fill it: (source, row in source's block) -> assignment id
    slot = {}
    for r in range(world):
        dev = build_device_layout(ids[r], counts, plan.alloc, plan.copies, r, block)
        host = build_layout(ids[r], counts, plan.alloc, plan.copies, r)
        assert torch.equal(dev.cu_seqlens, host.cu_seqlens) and dev.rows == host.rows == S * k
        assert torch.equal(torch.bincount(dev.dst, minlength=world), torch.tensor(host.send_splits))
        for a in range(S * k):
            slot[(int(dev.dst[a]), r, int(dev.rib[a]))] = (r, a)
    for d in range(world):
        dev = build_device_layout(ids[d], counts, plan.alloc, plan.copies, d, block)
        host = build_layout(ids[d], counts, plan.alloc, plan.copies, d)
        # the host layout's expert row -> (source, assignment): receive buffer chunks by source, in send order
        recv = [(s, int(a)) for s in range(world)
                for a, dst in zip(build_layout(ids[s], counts, plan.alloc, plan.copies, s).send_perm.tolist(),
                                  _send_dst(ids[s], counts, plan, s, world)) if dst == d]
        want = [recv[int(p)] for p in host.recv_perm]
        got = [slot[(d, int(s), int(i))] for s, i in zip(dev.src, dev.src_rib)]
        assert got == want


def _send_dst(ids: torch.Tensor, counts: torch.Tensor, plan: MoonEPPlan, rank: int, world: int) -> list[int]:
    """Destination of each send-buffer position of the host layout (its splits, in rank order)."""
    from moonrt.comm.ep.layout import build_layout

    host = build_layout(ids, counts, plan.alloc, plan.copies, rank)
    return [d for d in range(world) for _ in range(host.send_splits[d])]
