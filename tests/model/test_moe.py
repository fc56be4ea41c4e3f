"""Stable LatentMoE (K3_SYSTEMS §5): equality with a naive per-token reference (outputs and every
gradient), router semantics, the dispatcher seam with an EP-style layout, Quantile Balancing in a
training loop, and the data-parallel bias update."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist import dist_run
from numerics import rel_l2

from moonrt.config import ConfigError
from moonrt.models.k3.model.balance import maxvio
from moonrt.models.k3.model.config import MoEConfig, k3_tiny, moe_config_from_dict
from moonrt.models.k3.model.moe import LatentMoE, RoutedExperts
from moonrt.ops.grouped import moe_reference
from moonrt.parallel.dispatch import LocalDispatcher


def small_config(**changes):
    cfg = k3_tiny()  # D 128, latent 64, E 16, k 2, expert FFN 56, 2 shared experts
    return dataclasses.replace(cfg, **changes)


def make_moe(seed: int = 0, moe_config: MoEConfig | None = None, **changes) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(small_config(**changes), moe_config)
    with torch.no_grad():  # make routing decisive and the experts non-trivial
        moe.router.weight.normal_(std=0.3)
        for w in moe.experts.weights():
            w.normal_(std=0.2)
        moe.router.bias.copy_(torch.randn(moe.num_experts) * 0.05)
        if moe.norm is not None:
            moe.norm.weight.uniform_(0.5, 1.5)
    return moe


def reference_forward(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Naive LatentMoE (Eq. 11), written out independently of ``LatentMoE.forward``: routing in fp32,
    the routed experts through :func:`moonrt.ops.grouped.moe_reference` (no dispatcher), then norm,
    ``up_proj`` and shared experts.

    ``x [B, T, D]`` -> ``[B, T, D]``; needs all experts (unsharded); differentiable in every parameter.
    """
    B, T, D = x.shape
    x2 = x.reshape(B * T, D)
    ex = moe.experts
    dt = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(x2.to(dt) @ moe.router.weight.to(dt).t())
    ids = torch.topk(scores.detach() + moe.router.bias.to(dt), moe.top_k, dim=-1).indices
    sel = scores.gather(1, ids)
    p = sel / sel.sum(-1, keepdim=True) * moe.router.scaling
    z = moe.down_proj(x2)
    u = moe_reference(z, ids, p, *ex.weights(), act=ex.act, beta=ex.beta, linear_beta=ex.linear_beta)
    if moe.norm is not None:
        u = moe.norm(u)
    y = moe.up_proj(u)
    for expert in moe.shared_experts:
        y = y + expert(x2)
    return y.view(B, T, D)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run_and_grad(moe: LatentMoE, x: torch.Tensor, fn) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    moe.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out = fn(xi)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * g).sum().backward()
    return out.detach(), xi.grad.clone(), grads(moe)



def assert_same(a, b, tol=1e-5):
    """Outputs, input gradient and every parameter gradient agree to ``tol`` relative RMS."""
    out_a, gx_a, g_a = a
    out_b, gx_b, g_b = b
    assert rel_l2(out_a, out_b) <= tol and rel_l2(gx_a, gx_b) <= tol
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert rel_l2(g_a[name], g_b[name]) <= tol, (name, rel_l2(g_a[name], g_b[name]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("changes", [{}, {"latent_moe_use_norm": False, "routed_scaling_factor": 2.5,
                                          "num_shared_experts": 1, "num_experts_per_token": 3}])
def test_local_dispatcher_equals_naive_reference(changes, dtype, tol):
    moe = make_moe(0, **changes).to(dtype)
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = run_and_grad(moe, x, moe)
    ref = run_and_grad(moe, x, lambda xi: reference_forward(moe, xi))
    assert got[0].dtype == dtype
    assert_same(got, ref, tol)
    names = set(got[2])
    # every parameter got a gradient: router, latent down/up, every expert tensor, norm, shared experts
    assert {"router.weight", "down_proj.weight", "up_proj.weight", "experts.w_gate", "experts.w_up",
            "experts.w_down", "shared_experts.0.gate_proj.weight"} <= names
    if moe.norm is not None:
        assert "norm.weight" in names
    # experts that received no token get exactly zero gradient, the others not
    used = torch.zeros(moe.num_experts, dtype=torch.bool)
    used[moe.last_counts > 0] = True
    assert (got[2]["experts.w_gate"][~used] == 0).all()
    assert (got[2]["experts.w_gate"][used].flatten(1).abs().sum(1) > 0).all()


def test_router_renormalized_weights_and_bias_only_selects():
    moe = make_moe(3)
    router = moe.router
    x = torch.randn(40, 128)
    ids, w, scores = router(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(40))
    assert scores.dtype == torch.float32 and w.dtype == torch.float32
    assert ids.shape == (40, 2) and ids.dtype == torch.int64
    # bias changes the selection, never the gate values: force expert 5 into every token's top-k
    with torch.no_grad():
        router.bias.zero_()
        router.bias[5] = 10.0
    ids_b, w_b, scores_b = router(x)
    assert (ids_b == 5).any(-1).all()
    torch.testing.assert_close(scores_b, scores)
    sel = scores.gather(1, ids_b)
    torch.testing.assert_close(w_b, sel / sel.sum(-1, keepdim=True))
    # the bias is a buffer with no gradient
    assert "bias" not in dict(router.named_parameters()) and "bias" in dict(router.named_buffers())
    w_b.sum().backward()
    assert router.bias.grad is None and not router.bias.requires_grad
    # the scaling factor scales the renormalized weights
    router.scaling = 2.5
    torch.testing.assert_close(router(x)[1].sum(-1), torch.full((40,), 2.5))


def test_routing_counts_exposed():
    moe = make_moe(0)
    moe.train()
    x = torch.randn(2, 10, 128)
    moe(x)
    ids = moe.router(x.reshape(-1, 128))[0]
    assert torch.equal(moe.last_counts, torch.bincount(ids.reshape(-1), minlength=16))
    moe(x)
    assert int(moe.step_counts.sum()) == 2 * 20 * 2
    stats = moe.update_bias()
    assert int(stats.counts.sum()) == 80 and torch.equal(stats.local_counts, stats.counts)
    assert stats.maxvio == pytest.approx(maxvio(stats.counts))
    assert int(moe.step_counts.sum()) == 0


class SlotDispatcher:
    """An EP-style layout on one process, shaped like MoonEP's: G = E + B segments, the
    first half of expert 0's and expert 3's rows moved into slot segments E + 0 and E + 1 whose
    weights are copies of those experts (gradients returned to the home parameter by autograd), plus
    padding rows after the last segment. Proves the seam needs no change for such a dispatcher."""

    def __init__(self, num_experts: int, padding: int = 3) -> None:
        self.E, self.padding = num_experts, padding
        self.slot_experts = [0, 3]

    def dispatch(self, x, topk_ids, topk_weights):
        s, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        segs: list[list[int]] = [[] for _ in range(self.E + len(self.slot_experts))]
        for e in range(self.E):
            rows = (flat == e).nonzero().flatten().tolist()
            if e in self.slot_experts:
                half = len(rows) // 2
                segs[self.E + self.slot_experts.index(e)] = rows[:half]
                rows = rows[half:]
            segs[e] = rows
        order = torch.tensor([r for seg in segs for r in seg], dtype=torch.int64)
        cu = torch.tensor([0] + [len(seg) for seg in segs]).cumsum(0)
        recv_x = torch.cat([x.index_select(0, order // k), x.new_zeros(self.padding, x.shape[1])])
        recv_w = torch.cat([topk_weights.reshape(-1).index_select(0, order), topk_weights.new_zeros(self.padding)])
        return recv_x, recv_w, cu, (order, s, k)

    def combine(self, y, handle, weighted=True):
        order, s, k = handle
        assert not weighted
        out = y.new_zeros(s * k, y.shape[1]).index_copy(0, order, y[:order.shape[0]])
        return out.view(s, k, -1).sum(1)

    def segment_weights(self, handle, experts):
        home = [(e, experts.expert(e)) for e in range(self.E)]
        slots = [(self.E + j, tuple(w.clone() for w in experts.expert(e))) for j, e in enumerate(self.slot_experts)]
        return home + slots


def test_replaced_dispatcher_with_slots_and_padding_matches_local():
    moe = make_moe(2)
    x = torch.randn(2, 12, 128, generator=torch.Generator().manual_seed(4))
    local = run_and_grad(moe, x, moe)
    moe.dispatcher = SlotDispatcher(moe.num_experts)
    slotted = run_and_grad(moe, x, moe)
    assert_same(slotted, local)


def test_local_dispatcher_roundtrip_and_bad_input():
    d = LocalDispatcher(4)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 3], [1, 0], [3, 2], [0, 1]])
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    recv_x, recv_w, cu, h = d.dispatch(x, ids, w)
    assert cu.tolist() == [0, 3, 5, 8, 10]
    # rows are grouped by expert, token order inside a segment
    assert h.token_index.tolist() == [0, 2, 4, 2, 4, 0, 1, 3, 1, 3]
    out = d.combine(recv_x * 2, h)
    torch.testing.assert_close(out, 2 * x * w.sum(1, keepdim=True))
    torch.testing.assert_close(d.combine(recv_x, h, weighted=False), 2 * x)
    torch.autograd.gradcheck(lambda a, b: d.combine(d.dispatch(a, ids, b)[0], d.dispatch(a, ids, b)[3]), (x, w))
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\)"):
        d.dispatch(x, torch.tensor([[0, 4]] * 5), w)
    with pytest.raises(ValueError, match="int64"):
        d.dispatch(x, ids.int(), w)
    with pytest.raises(ValueError, match="rows = 10"):
        d.combine(recv_x[:9], h)


def test_sharded_experts_and_errors():
    moe = make_moe(0)
    full = [w.detach().clone() for w in moe.experts.weights()]
    moe.experts.shard(8, 4)
    assert moe.experts.num_local == 4 and moe.experts.first_expert == 8
    assert torch.equal(moe.experts.expert(9)[0], full[0][9])
    with pytest.raises(ValueError, match="expert 3"):
        moe.experts.expert(3)
    with pytest.raises(ValueError, match="needs all 16 experts"):
        moe(torch.randn(1, 4, 128))
    with pytest.raises(ValueError, match="shard"):
        moe.experts.shard(0, 2)
    with pytest.raises(ValueError, match="expected a slice"):
        RoutedExperts(4, 8, 8).shard(3, 2)
    with pytest.raises(ValueError, match=r"expected \[B, T, 128\]"):
        make_moe(0)(torch.randn(4, 128))
    with pytest.raises(ConfigError, match="qb_bins"):
        moe_config_from_dict({"qb_bins": 0})
    with pytest.raises(ConfigError, match="qb_estimator"):
        moe_config_from_dict({"qb_estimator": "median"})
    with pytest.raises(ConfigError, match="unknown key"):
        moe_config_from_dict({"bins": 3})
    assert moe_config_from_dict(None) == MoEConfig()


def _skewed_training_loop(estimator: str, steps: int, update: bool) -> list[float]:
    moe = make_moe(5, MoEConfig(qb_estimator=estimator, qb_bins=256))
    gen = torch.Generator().manual_seed(11)
    mu = torch.randn(128, generator=gen)
    with torch.no_grad():
        moe.router.bias.zero_()
        moe.router.weight.normal_(std=0.02)
        moe.router.weight[:3] += 0.3 * mu / mu.norm()  # experts 0-2 aligned with the input mean: hot
    opt = torch.optim.SGD(moe.parameters(), lr=1e-3)
    moe.train()
    history = []
    for _ in range(steps):
        x = torch.randn(4, 48, 128, generator=gen) + 3 * mu / mu.norm()
        loss = moe(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if update:
            history.append(moe.update_bias().maxvio)
        else:
            history.append(maxvio(moe.last_counts))
    if update:
        assert abs(float(moe.router.bias.sum())) < 1e-4  # zero-mean bias
    return history


@pytest.mark.parametrize("estimator", ["histogram", "exact"])
def test_quantile_balancing_training_loop_reduces_maxvio(estimator):
    """A strongly skewed router (experts 0-2 take most tokens): repeated update_bias() between
    training steps drives maxvio down substantially, with no learning rate for the bias. Each step
    sees a fresh batch (384 assignments, 24 per expert), so the floor is the sampling noise."""
    history = _skewed_training_loop(estimator, 10, update=True)
    assert history[0] > 3.0, history  # ideal maxvio 0, worst (all on 2 experts) 7
    assert sum(history[-5:]) / 5 < min(0.8, history[0] / 5), history  # observed ~0.45-0.65 vs 4.6
    if estimator == "histogram":  # without QB the same loop stays skewed
        assert min(_skewed_training_loop(estimator, 4, update=False)) > 3.0


def test_qb_disabled_leaves_bias_alone():
    off = make_moe(5, MoEConfig(qb_enabled=False))
    before = off.router.bias.clone()
    off.train()
    off(torch.randn(1, 8, 128))
    stats = off.update_bias()
    assert torch.equal(off.router.bias, before) and int(stats.counts.sum()) == 16


def _dp_update(rank: int, world: int, estimator: str) -> tuple[list[float], list[int]]:
    moe = make_moe(9, MoEConfig(qb_estimator=estimator, qb_bins=128))
    moe.train()
    x = torch.randn(world, 2, 16, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        moe(x[rank])

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    try:
        stats = moe.update_bias(all_reduce)
    except ValueError as exc:
        return [], [len(str(exc))] if "histogram" in str(exc) else [-1]
    return moe.router.bias.tolist(), stats.counts.tolist()


def test_data_parallel_histogram_update_equals_one_process():
    """Ranks sum histograms with one all-reduce: the bias equals a single process seeing all tokens."""
    results = dist_run(_dp_update, 2, "histogram", timeout=120)
    single = make_moe(9, MoEConfig(qb_bins=128))
    single.train()
    x = torch.randn(2, 2, 16, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        single(x.reshape(4, 16, 128))
    stats = single.update_bias()
    for bias, counts in results:
        assert counts == stats.counts.tolist()
        torch.testing.assert_close(torch.tensor(bias), single.router.bias, rtol=0, atol=1e-6)
    # exact estimator: a clear error on every rank instead of a wrong or hanging update
    results = dist_run(_dp_update, 2, "exact", timeout=120)
    assert all(b == [] and c[0] > 0 for b, c in results)
