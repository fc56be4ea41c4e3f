"""The EP ladder (issue 46 item 2): one :class:`EPDispatcher` given a placement policy and a transport.

- :class:`HomePlacement` is the all-to-all baseline: every assignment on its expert's home rank, no slots;
  :class:`MoonEPPlacement` is MoonEP's plan (balanced rows).
- Both policies compute the same math: on 2 gloo ranks the same skewed problem gives equal outputs and gradients
  (tokens, router weights, experts), only the rows each rank computes differ.
- ``ExpertParallel`` with ``parallel.ep_dispatcher = alltoall`` installs the baseline and matches the unsharded
  LatentMoE (before, it passed ``kernels=`` the baseline's constructor did not take: TypeError on 2 ranks).
- Every data move goes through the dispatcher's transport (the seam a symmetric-memory transport plugs into).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import dist_run
from moe_layer import OneLayer

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.parallel import ExpertParallel
from moonrt.comm.ep.placement import HomePlacement, MoonEPPlacement, PlacementPolicy, placement_policy
from moonrt.comm.ep.transport import CollectiveTransport, EPTransport
from moonrt.config import ConfigError, ParallelConfig, from_dict
from moonrt.models.k3.model.config import k3_tiny
from moonrt.ops.grouped import grouped_glu_experts

H, F, E = 12, 10, 8


def _counts(R: int, s: int = 6, k: int = 2) -> torch.Tensor:
    """``[R, E]`` routing counts of s tokens x k picks per rank, skewed to expert 0 (rank 0's)."""
    g = torch.Generator().manual_seed(0)
    bias = torch.tensor([8.0] + [1.0] * (E - 1))
    return torch.stack([torch.bincount(torch.multinomial(bias, s * k, replacement=True, generator=g), minlength=E)
                        for _ in range(R)])


@pytest.mark.parametrize("R", [1, 2, 4])
def test_home_placement_puts_every_assignment_on_its_home_rank(R: int) -> None:
    counts = _counts(R)
    home = HomePlacement()
    assert isinstance(home, PlacementPolicy) and home.slots(E // R) == 0
    assert home.plan_on_device(counts, 0) is None
    plan, placement = home.place(counts, None, 0)
    load = counts.sum(0)
    want = torch.zeros(E, R, dtype=torch.int64)
    want[torch.arange(E), torch.arange(E) // (E // R)] = load
    assert torch.equal(torch.as_tensor(placement.alloc), want)
    assert tuple(placement.copies.shape) == (R, 0)
    assert placement.capacity.tolist() == load.view(R, -1).sum(1).tolist()
    # MoonEP's placement of the same counts: every rank computes the same number of rows (R s k / R)
    moon = MoonEPPlacement(kernels="torch")
    assert moon.slots(E // R) == E // R and MoonEPPlacement(num_slots=3).slots(E // R) == 3
    _, balanced = moon.place(counts, None, E // R)
    assert torch.equal(torch.as_tensor(balanced.alloc).sum(1), load)
    assert int(balanced.capacity.max()) - int(balanced.capacity.min()) <= 1
    device_plan = moon.plan_on_device(counts, E // R)
    np.testing.assert_array_equal(device_plan.to_torch().alloc.cpu().numpy(), np.asarray(balanced.alloc))


def test_placement_and_dispatcher_errors_name_the_field() -> None:
    assert isinstance(placement_policy("alltoall"), HomePlacement)
    assert isinstance(placement_policy("moonep", num_slots=2), MoonEPPlacement)
    with pytest.raises(ValueError, match=r"^parallel.ep_dispatcher = 'deepep': expected one of moonep, alltoall$"):
        placement_policy("deepep")
    with pytest.raises(ValueError, match=r"^num_slots = -1: expected an integer >= 0$"):
        MoonEPPlacement(num_slots=-1)
    with pytest.raises(ValueError, match=r"^placement = 'moonep': expected a placement policy"):
        EPDispatcher(None, 4, H, 2, E, placement="moonep")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ep_dispatcher = 'deepep': expected one of 'moonep', 'alltoall'"):
        from_dict(ParallelConfig, {"ep_dispatcher": "deepep"})
    assert from_dict(ParallelConfig, {"ep_dispatcher": "alltoall"}).ep_dispatcher == "alltoall"
    assert ParallelConfig().ep_dispatcher == "moonep"


def _problem(world: int, s: int, k: int) -> dict:
    """Seeded skewed problem: most picks on rank 0's home experts, so the home placement is unbalanced."""
    g = torch.Generator().manual_seed(0)
    bias = torch.tensor([8.0] * (E // world) + [1.0] * (E - E // world))
    return {"xs": [torch.randn(s, H, generator=g) for _ in range(world)],
            "ids": [torch.stack([torch.multinomial(bias, k, generator=g) for _ in range(s)]) for _ in range(world)],
            "ws": [torch.rand(s, k, generator=g) + 0.1 for _ in range(world)],
            "gouts": [torch.randn(s, H, generator=g) for _ in range(world)],
            "experts": [torch.randn(E, F, H, generator=g) * 0.3, torch.randn(E, F, H, generator=g) * 0.3,
                        torch.randn(E, H, F, generator=g) * 0.3]}


def _policies_fn(rank: int, world: int, s: int, k: int, dedup: bool) -> dict:
    p = _problem(world, s, k)
    per = E // world
    out = {}
    for placement in (MoonEPPlacement(), HomePlacement()):
        disp = EPDispatcher(None, s, H, k, E, placement=placement, dedup=dedup)
        x = p["xs"][rank].clone().requires_grad_()
        w = p["ws"][rank].clone().requires_grad_()
        home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]]
        recv_x, _, _, handle = disp.dispatch(x, p["ids"][rank], w)
        slots = disp.prefetch_weights(handle, home)
        y = torch.cat([grouped_glu_experts(recv_x[:handle.home_rows], handle.home_cu_seqlens(), *home),
                       grouped_glu_experts(recv_x[handle.home_rows:], handle.slot_cu_seqlens(), *slots)])
        y_out = disp.combine(y, handle)
        (y_out * p["gouts"][rank]).sum().backward()
        out[placement.name] = {"out": y_out.detach(), "gx": x.grad, "gw": w.grad, "gexperts": [t.grad for t in home],
                               "rows": disp.last_rows.tolist(), "slots": [tuple(t.shape) for t in slots],
                               "counts": disp.last_counts}
    return out


@pytest.mark.parametrize("dedup", [True, False])
def test_both_policies_give_equal_outputs_and_gradients(dedup: bool) -> None:
    world, s, k = 2, 6, 3
    res = dist_run(_policies_fn, world, s, k, dedup, timeout=120)

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= 1e-6, f"{what}: relative error {err:.2e}"

    for r, got in enumerate(res):
        moon, home = got["moonep"], got["alltoall"]
        for key in ("out", "gx", "gw"):
            close(home[key], moon[key], f"rank {r} {key}")
        for i, (a, b) in enumerate(zip(home["gexperts"], moon["gexperts"])):
            close(a, b, f"rank {r} expert weight {i} grad")
        load = moon["counts"].sum(0).view(world, -1).sum(1).tolist()
        assert home["rows"] == load != moon["rows"] == [s * k] * world, (home["rows"], moon["rows"])
        assert all(shape[0] == 0 for shape in home["slots"]), "the baseline has no slots"


B, T = 2, 5


def _latentmoe_fn(rank: int, world: int, kind: str) -> dict:
    model = OneLayer()
    with torch.no_grad():
        model.moe.router.bias[0] = 100.0  # every token picks expert 0 (rank 0's): the baseline is unbalanced
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g)
    gout = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g)
    ep = ExpertParallel(ParallelConfig(ep=world, ep_dispatcher=kind), capacity=B * T)
    ep.parallelize(model)
    xs = x[rank * B:(rank + 1) * B].clone().requires_grad_()
    out = model.moe(xs)
    (out * gout[rank * B:(rank + 1) * B]).sum().backward()
    ep.sync_grads(model)
    disp = ep.dispatchers[1]
    return {"out": out.detach(), "gx": xs.grad, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "rows": disp.last_rows.tolist(), "placement": type(disp.placement).__name__,
            "prefetched": disp.counters.experts_prefetched}


@pytest.mark.parametrize("kind", ["alltoall", "moonep"])
def test_expert_parallel_dispatcher_field_matches_single_process(kind: str) -> None:
    world = 2
    res = dist_run(_latentmoe_fn, world, kind, timeout=120)
    model = OneLayer()
    with torch.no_grad():
        model.moe.router.bias[0] = 100.0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g).requires_grad_()
    gout = torch.randn(world * B, T, k3_tiny().hidden_size, generator=g)
    out = model.moe(x)
    (out * gout).sum().backward()

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{what}: relative error {err:.2e}"

    k = model.moe.top_k
    for r, got in enumerate(res):
        close(got["out"], out[r * B:(r + 1) * B].detach(), f"rank {r} output")
        close(got["gx"], x.grad[r * B:(r + 1) * B], f"rank {r} input grad")
        assert got["placement"] == {"alltoall": "HomePlacement", "moonep": "MoonEPPlacement"}[kind]
        if kind == "alltoall":  # expert 0 is rank 0's: rank 0 computes every token's assignment of it
            assert got["rows"][0] >= world * B * T > got["rows"][1] and got["prefetched"] == 0, got["rows"]
        else:
            assert got["rows"] == [B * T * k] * world
    for name, p in model.named_parameters():
        got = torch.cat([res[r]["grads"][name] for r in range(world)]) if name.startswith("moe.experts.") \
            else res[0]["grads"][name]
        close(got, p.grad, f"grad of {name}")


class _Recording(CollectiveTransport):
    """The collectives, recording each verb the dispatcher calls."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[str] = []

    def all_gather(self, row):
        self.calls.append("all_gather")
        return super().all_gather(row)

    def dedup_layout(self, layout, device):
        self.calls.append("dedup_layout")
        return super().dedup_layout(layout, device)

    def dispatch(self, x, weights, layout, dedup):
        self.calls.append("dispatch")
        return super().dispatch(x, weights, layout, dedup)

    def combine(self, y, weights, layout, dedup, deps, refill, dtype):
        self.calls.append("combine")
        return super().combine(y, weights, layout, dedup, deps, refill, dtype)

    def fetch_slots(self, home, layout, pool, dep):
        self.calls.append("fetch_slots")
        return super().fetch_slots(home, layout, pool, dep)


@pytest.mark.parametrize("dedup", [True, False])
def test_every_data_move_goes_through_the_transport(dedup: bool) -> None:
    transport = _Recording()
    assert isinstance(transport, EPTransport)
    disp = EPDispatcher(None, 4, H, 2, E, placement=MoonEPPlacement(), dedup=dedup, transport=transport)
    assert disp.transport is transport
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, H, generator=g).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=g) + 0.1
    experts = [torch.randn(E, F, H, generator=g), torch.randn(E, F, H, generator=g), torch.randn(E, H, F, generator=g)]
    recv_x, _, _, handle = disp.dispatch(x, ids, w)
    disp.prefetch_weights(handle, experts)
    out = disp.combine(recv_x, handle)
    out.sum().backward()
    want = ["all_gather"] + ["dedup_layout"] * dedup + ["dispatch", "fetch_slots", "combine"]
    assert transport.calls == want
    torch.testing.assert_close(out, x.detach() * w.sum(1, keepdim=True))  # identity experts: weighted sum of x


def test_zero_takes_an_expert_sharding_part_and_duplicates_only_where_declared() -> None:
    """ZeRO is typed against :class:`ExpertSharding` (what it asks of the expert part), not ExpertParallel; only a
    part that declares ``counts_every_rank`` takes the pipeline's duplicates, any other refuses them."""
    from moonrt.comm.parallelism import ExpertSharding, Part
    from moonrt.comm.zero.adamw import Zero1

    ep = ExpertParallel(ParallelConfig(), capacity=4)
    assert isinstance(ep, ExpertSharding) and not isinstance(Part(), ExpertSharding)
    zero = Zero1()
    zero.wrap(ep)
    assert zero.ep is ep
    with pytest.raises(TypeError, match=r"^Zero1 wraps an expert-sharding part .*; got Part$"):
        zero.wrap(Part())
    assert zero.ep is ep, "a refused wrap changes nothing"
    assert zero.counts_every_rank and not ep.counts_every_rank
    zero.accept_duplicates({"pseudo_query"})
    assert zero.duplicates == {"pseudo_query"}
    with pytest.raises(TypeError, match=r"^ExpertParallel: takes no duplicates"):
        ep.accept_duplicates({"pseudo_query"})
    assert not hasattr(ep, "duplicates")
