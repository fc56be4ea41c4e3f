"""``moe_dispatch_only`` under MoonEP on 2 gloo ranks (K3_SYSTEMS §8): the LatentMoE routed path
saves only its dispatch input and backward replays the dispatch (a collective) on every rank; the
output, input gradient and every parameter gradient equal the unsharded layer's without the manager."""

from __future__ import annotations

import torch
from dist import dist_run
from moe_layer import OneLayer

from moonrt.comm.ep.parallel import ExpertParallel
from moonrt.config import ParallelConfig
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy
from moonrt.models.k3.model.config import k3_tiny

B, T = 2, 5


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    D = k3_tiny().hidden_size
    return torch.randn(world * B, T, D, generator=g), torch.randn(world * B, T, D, generator=g)


def _rank_fn(rank: int, world: int) -> dict:
    model = OneLayer()
    x, gout = _data(world)
    ep = ExpertParallel(ParallelConfig(ep=world), capacity=B * T)
    ep.parallelize(model)
    mgr = ActivationManager(model, MemoryPolicy(moe_dispatch_only=["moe"]))
    xs = x[rank * B:(rank + 1) * B].clone().requires_grad_()
    with mgr:
        out = model.moe(xs)
    disp = ep.dispatchers[1]
    calls_fwd = disp.counters.calls
    (out * gout[rank * B:(rank + 1) * B]).sum().backward()
    ep.sync_grads(model)
    st = mgr.accounting.regions[("moe.routed", "recompute")]
    res = {"out": out.detach(), "gx": xs.grad, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
           "calls": (calls_fwd, disp.counters.calls), "routed": (st.count, st.deduped, st.logical_bytes),
           "experts_saved": sum(s.count for (r, _), s in mgr.accounting.regions.items() if r.startswith("moe.experts")),
           "steps": model.moe.step_counts.clone(), "live": mgr.accounting.live["device"]}
    mgr.close()
    return res


def test_moe_dispatch_only_replays_the_ep_dispatch_exactly() -> None:
    world = 2
    res = dist_run(_rank_fn, world, timeout=120)
    model = OneLayer()
    x, gout = _data(world)
    x = x.clone().requires_grad_()
    out = model.moe(x)
    (out * gout).sum().backward()
    L, k = k3_tiny().routed_expert_hidden_size, model.moe.top_k

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{what}: relative error {err:.2e}"

    for r, got in enumerate(res):
        close(got["out"], out[r * B:(r + 1) * B].detach(), f"rank {r} output")
        close(got["gx"], x.grad[r * B:(r + 1) * B], f"rank {r} input grad")
        assert got["calls"] == (1, 2), "forward dispatches once, backward replays the dispatch once"
        # saved for the routed path: z [s, L] + topk_weights [s, k] fp32 stored, topk_ids [s, k] deduped
        # with the router's save of the same storage; nothing from the expert compute
        assert got["routed"] == (3, 1, B * T * (L + k) * 4) and got["experts_saved"] == 0
        assert int(got["steps"].sum()) == B * T * k  # routing counted once despite the replay
        assert got["live"] == 0
    for name, p in model.named_parameters():
        if name.startswith("moe.experts."):
            got = torch.cat([res[r]["grads"][name] for r in range(world)])
        else:
            got = res[0]["grads"][name]
        close(got, p.grad, f"grad of {name}")
