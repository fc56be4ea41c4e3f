"""K3 LatentMoE with MoonEP on 2 and 4 gloo ranks vs the unsharded single-process layer.

Every rank builds the same seeded LatentMoE (k3_tiny widths), :class:`ExpertParallel` shards the
experts (E/R home experts per rank) and installs the MoonEP dispatcher; each rank runs its slice of
a seeded global batch. Checked: the output slices, the input gradient, every dense gradient (summed
over ranks by ``sync_grads``) and every expert gradient (home shards concatenated) equal the
unsharded layer's, for random routing, all tokens on one expert, and one rank's experts unused;
every rank computes exactly ``s * k`` rows.
"""

from __future__ import annotations

import pytest
import torch
from dist import dist_run
from moe_layer import OneLayer

from moonrt.comm.ep.parallel import ExpertParallel
from moonrt.config import ParallelConfig
from moonrt.models.k3.model.config import k3_tiny

B, T = 2, 5


def _setup(routing: str, world: int) -> tuple[OneLayer, torch.Tensor, torch.Tensor]:
    model = OneLayer()
    E = model.moe.num_experts
    with torch.no_grad():
        if routing == "one_expert":
            model.moe.router.bias[3] = 100.0  # selection only: every token picks expert 3
        elif routing == "rank_unused":
            model.moe.router.bias[E - E // world:] = -100.0  # the last rank's experts are never chosen
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g)
    gout = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g)
    return model, x, gout


def _rank_fn(rank: int, world: int, routing: str, parallel: dict) -> dict:
    model, x, gout = _setup(routing, world)
    ep = ExpertParallel(ParallelConfig(ep=world, **parallel), capacity=B * T)
    ep.parallelize(model)
    xs = x[rank * B:(rank + 1) * B].clone().requires_grad_()
    out = model.moe(xs)
    (out * gout[rank * B:(rank + 1) * B]).sum().backward()
    ep.sync_grads(model)
    disp = ep.dispatchers[1]
    return {"out": out.detach(), "gx": xs.grad,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "rows": [int(r) for r in disp.last_rows], "counts": disp.last_counts,
            "prefetched": disp.counters.experts_prefetched}


@pytest.mark.parametrize("world,routing,parallel", [
    (2, "random", {}), (2, "one_expert", {}), (4, "rank_unused", {}), (4, "one_expert", {}),
    (4, "random", {"token_padding": 8}), (2, "random", {"ep_dedup": False}),
])
def test_latentmoe_moonep_matches_single_process(world: int, routing: str, parallel: dict) -> None:
    res = dist_run(_rank_fn, world, routing, parallel, timeout=120)
    model, x, gout = _setup(routing, world)
    x = x.clone().requires_grad_()
    out = model.moe(x)
    (out * gout).sum().backward()

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{what}: relative error {err:.2e}"

    k = model.moe.top_k
    for r, got in enumerate(res):
        close(got["out"], out[r * B:(r + 1) * B].detach(), f"rank {r} output")
        close(got["gx"], x.grad[r * B:(r + 1) * B], f"rank {r} input grad")
        assert got["rows"] == [B * T * k] * world, "every rank computes exactly s*k rows"
    for name, p in model.named_parameters():
        if name.startswith("moe.experts."):
            got = torch.cat([res[r]["grads"][name] for r in range(world)])
        else:
            got = res[0]["grads"][name]
            for r in range(1, world):
                assert torch.equal(res[r]["grads"][name], got), f"{name}: ranks disagree after sync"
        close(got, p.grad, f"grad of {name}")
    counts = res[0]["counts"]
    E = model.moe.num_experts
    if routing == "one_expert":
        assert int(counts[:, 3].sum()) == world * B * T
        assert sum(r["prefetched"] for r in res) >= world - 1
    if routing == "rank_unused":
        assert int(counts[:, E - E // world:].sum()) == 0


def _overlap_fn(rank: int, world: int, parallel: dict) -> dict:
    """One LatentMoE forward + backward three ways on the shm heap: dispatch, then the shared experts (in order);
    the shared experts computed while the dispatch moves the rows (``dispatch_async``); and in order again under
    the activation manager's ``moe_dispatch_only`` (the routed path checkpointed: no overlap, replayed dispatch)."""
    from moonrt.memory.manager import ActivationManager
    from moonrt.memory.policy import MemoryPolicy

    model, x, gout = _setup("random", world)
    ep = ExpertParallel(ParallelConfig(ep=world, ep_transport="shm", **parallel), capacity=B * T)
    ep.parallelize(model)
    disp = ep.dispatchers[1]
    out: dict = {"overlaps": disp.overlaps, "device": disp.device_layouts}
    for mode in ("in_order", "overlap", "checkpointed"):
        model.zero_grad(set_to_none=True)
        model.moe.overlap_shared = mode != "in_order"
        worker_before = disp.transport._worker is not None
        xs = x[rank * B:(rank + 1) * B].clone().requires_grad_()
        mgr = ActivationManager(model, MemoryPolicy(moe_dispatch_only=["moe"])) if mode == "checkpointed" else None
        if mgr is not None:
            with mgr:
                y = model.moe(xs)
        else:
            y = model.moe(xs)
        (y * gout[rank * B:(rank + 1) * B]).sum().backward()
        if mgr is not None:
            mgr.close()
        out[mode] = [y.detach(), xs.grad, *[p.grad.clone() for _, p in model.named_parameters()]]
        out[f"{mode}_worker"] = (worker_before, disp.transport._worker is not None)
    ep.close()
    return out


@pytest.mark.parametrize("parallel", [{}, {"ep_dedup": False, "token_padding": 8}])
def test_shared_experts_overlap_the_heap_dispatch_bitwise(parallel: dict) -> None:
    """LatentMoE on the heap computes its shared experts while the rows move (the dispatch on the transport's
    worker thread) and equals the in-order layer bitwise: output, input gradient, every parameter gradient; under
    ``moe_dispatch_only`` it keeps the order (the dispatch inside the checkpoint) and is bitwise the same too."""
    for res in dist_run(_overlap_fn, 2, parallel, timeout=180):
        assert res["overlaps"] and res["device"], res
        assert res["in_order_worker"] == (False, False), "the in-order run must not use the worker"
        assert res["overlap_worker"] == (False, True), "the overlap run dispatches on the worker"
        for mode in ("overlap", "checkpointed"):
            assert len(res[mode]) == len(res["in_order"])
            for i, (a, b) in enumerate(zip(res[mode], res["in_order"])):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{mode}: tensor {i} differs from the in-order run"


def _k3_layer_syncs(rank: int, world: int) -> dict:
    from host_syncs import HostSyncCounter

    model, x, gout = _setup("random", world)
    ep = ExpertParallel(ParallelConfig(ep=world, ep_transport="shm"), capacity=B * T)
    ep.parallelize(model)
    model.moe.overlap_shared = False  # the counter is this thread's: count the in-order layer (the same ops)
    xs = x[rank * B:(rank + 1) * B]
    model.moe(xs).sum().backward()  # warm: receive slots, planner
    with HostSyncCounter() as c:
        (model.moe(xs.clone().requires_grad_()) * gout[rank * B:(rank + 1) * B]).sum().backward()
    ep.close()
    return {f"{kind} {where.split(':')[0]}": n for (kind, where), n in c.counts.items()}


def test_the_k3_moe_layer_on_the_heap_reads_back_only_the_grouped_gemm_bounds() -> None:
    """A whole K3 LatentMoE forward + backward on the heap (router, dispatch, prefetch, experts, combine, shared
    experts): the one counted host synchronization is the grouped GEMM's ``cu_seqlens.tolist()`` (its CPU path
    slices rows by host bounds), none from the EP dispatcher."""
    for counts in dist_run(_k3_layer_syncs, 2, timeout=120):
        assert counts == {"tolist moonrt/ops/grouped.py": 1}, counts
