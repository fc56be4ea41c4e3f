"""A fixed corpus of MoonEP-style adversarial routings (issue 34 item 6), each checked for every
planner invariant (K3_SYSTEMS §6.1-§6.3) by all four planners: ``plan`` with the greedy rounds and
with the closed form (numba), and their device twins ``plan_torch`` / ``plan_device`` (the greedy; plan_device
through its numba and its Triton backend, the latter under Triton's interpreter) / ``plan_prefix`` (identical plans
required), at B = E/R (exact balance), B = 1 and B = 0 (the fewer-slots policy, checked
against a loop reference of that policy); plus the policy end to end through the dispatcher.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import dist_run

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.placement import MoonEPPlacement
from moonrt.ops.grouped import grouped_glu_experts, moe_reference
from moonrt.scheduler.moonep import capacities, plan, send_split, transfer_matrix
from moonrt.scheduler.moonep_torch import plan_device, plan_prefix, plan_torch


def _ids(name: str) -> tuple[list[np.ndarray], int]:
    """Per-rank top-k ids ``[s_r, k]`` of one corpus case, and E."""
    rng = np.random.default_rng(sum(map(ord, name)))  # fixed per case
    if name == "balanced":  # every expert equally loaded on every rank: no copies at all
        return [np.arange(8 * 4).reshape(8, 4) % 16 for _ in range(4)], 16
    if name == "tiny_s1_k1":
        return [rng.integers(0, 8, (1, 1)) for _ in range(4)], 8
    if name == "all_local":  # each rank routes only to its own home experts
        return [np.stack([rng.permutation(4)[:2] + 4 * r for _ in range(16)]) for r in range(4)], 16
    if name == "all_remote":  # each rank routes only to the next rank's experts: balanced, everything moves
        return [np.stack([rng.permutation(4)[:2] + 4 * ((r + 1) % 4) for _ in range(16)]) for r in range(4)], 16
    if name == "heavy_bias":  # 90% of first choices on expert 3
        out = []
        for _ in range(8):
            ids = np.stack([rng.permutation(32)[:2] for _ in range(32)])
            hot = rng.random(32) < 0.9
            ids[hot, 0] = 3
            ids[hot & (ids[:, 1] == 3), 1] = 4
            out.append(ids)
        return out, 32
    if name == "near_degenerate":  # every token on expert 0 but one, on the last expert
        ids = [np.zeros((16, 1), np.int64) for _ in range(4)]
        ids[2][5, 0] = 15
        return ids, 16
    if name == "duplicate_topk":  # repeated experts inside one token's top-k
        return [np.repeat(rng.integers(0, 8, (8, 2)), 2, axis=1) for _ in range(4)], 8
    if name == "exact_padding_single_expert":  # one expert takes everything, a multiple of 64 per rank
        return [np.ones((64, 1), np.int64) for _ in range(2)], 4
    if name == "e_over_1000":  # E = 2048, zipf popularity
        p = rng.permutation(1.0 / np.arange(1, 2049) ** 1.1)
        p = p / p.sum()
        return [np.stack([rng.choice(2048, 8, replace=False, p=p) for _ in range(64)]) for _ in range(8)], 2048
    if name.startswith("partial_s"):  # every rank passes s < S = 16 tokens
        s = int(name.rsplit("_", 1)[1])
        p = rng.lognormal(0, 1.5, 16)
        return [np.stack([rng.choice(16, 2, replace=False, p=p / p.sum()) for _ in range(s)]) for _ in range(4)], 16
    if name == "per_rank_s":  # ranks pass different s (floor/ceil targets)
        p = rng.lognormal(0, 1.5, 16)
        return [np.stack([rng.choice(16, 2, replace=False, p=p / p.sum()) for _ in range(s)])
                for s in (1, 8, 15, 16)], 16
    raise AssertionError(name)


CASES = ["balanced", "tiny_s1_k1", "all_local", "all_remote", "heavy_bias", "near_degenerate", "duplicate_topk",
         "exact_padding_single_expert", "e_over_1000", "partial_s_1", "partial_s_8", "partial_s_15", "per_rank_s"]


def corpus_case(name: str) -> tuple[np.ndarray, int | None]:
    """``(counts [R, E] int64, total_tokens or None when every rank passes the same s)``."""
    ids, E = _ids(name)
    counts = np.stack([np.bincount(i.reshape(-1), minlength=E) for i in ids]).astype(np.int64)
    sizes = {len(i) for i in ids}
    return counts, (None if len(sizes) == 1 else sum(len(i) for i in ids))


def slot_policy_reference(alloc: np.ndarray, B: int) -> np.ndarray:
    """The fewer-slots policy as a loop: a rank with more than B foreign experts keeps the B with the
    most assignments (ties: larger id); the others' assignments go to their home rank."""
    alloc = np.array(alloc)
    E, R = alloc.shape
    G = E // R
    for r in range(R):
        held = [e for e in range(E) if alloc[e, r] > 0 and e // G != r]
        held.sort(key=lambda e: (alloc[e, r], e), reverse=True)
        for e in held[B:]:
            alloc[e, e // G] += alloc[e, r]
            alloc[e, r] = 0
    return alloc


def check_invariants(counts: np.ndarray, p, B: int, total_tokens: int | None, full) -> None:
    """Exact balance (or the reported policy imbalance), <= B slots, one donor group per rank,
    conservation, no rank over its target unless the policy sent work home, consistent cuts/sends."""
    R, E = counts.shape
    G = E // R
    home = np.arange(E) // G
    target = capacities(int(counts.sum()), R)
    assert p.alloc.shape == (E, R) and p.copies.shape == (R, B) and (p.alloc >= 0).all()
    np.testing.assert_array_equal(p.alloc.sum(1), counts.sum(0))  # conservation
    np.testing.assert_array_equal(p.target, target)
    np.testing.assert_array_equal(p.capacity, p.alloc.sum(0))
    np.testing.assert_array_equal(p.imbalance(), p.capacity - p.target)
    for r in range(R):
        held = [int(e) for e in p.copies[r] if e >= 0]
        assert (p.copies[r, len(held):] == -1).all() and held == sorted(set(held)) and len(held) <= min(B, G)
        assert all(home[e] != r for e in held)
        computed = {int(e) for e in np.nonzero(p.alloc[:, r])[0] if home[e] != r}
        assert computed == set(held), f"rank {r} computes {computed}, holds {held}"
        groups = {int(home[e]) for e in held}
        assert len(groups) <= 1 and groups == ({int(p.donor[r])} if p.donor[r] >= 0 else set())
        assert int(p.segment_sizes(r).sum()) == p.capacity[r]
    needed = int(full.copies_per_rank().max())
    if B >= needed:
        np.testing.assert_array_equal(p.capacity, target)  # exact balance, so no rank over capacity
        np.testing.assert_array_equal(p.alloc, full.alloc)
    else:
        np.testing.assert_array_equal(p.alloc, slot_policy_reference(full.alloc, B))
        sent_home = np.zeros(R, np.int64)  # per home rank, assignments the policy returned to it
        np.add.at(sent_home, home, p.alloc[np.arange(E), home] - full.alloc[np.arange(E), home])
        foreign = home[:, None] != np.arange(R)[None, :]
        lost = ((full.alloc - p.alloc) * foreign).sum(0)  # per rank, assignments of its dropped copies
        np.testing.assert_array_equal(p.imbalance(), sent_home - lost)  # the whole imbalance is the policy's
        assert (p.imbalance() <= sent_home).all()  # no rank over its target but by work sent home
    np.testing.assert_array_equal(p.cuts[:, 0], 0)
    np.testing.assert_array_equal(np.diff(p.cuts, axis=1), p.alloc)
    splits = np.stack([send_split(counts, p.cuts, r) for r in range(R)])
    np.testing.assert_array_equal(splits.sum(2), counts)
    np.testing.assert_array_equal(splits.sum(0), p.alloc)
    np.testing.assert_array_equal(transfer_matrix(counts, p.cuts), splits.sum(1))


@pytest.mark.parametrize("name", CASES)
def test_corpus_invariants_all_planners(name: str) -> None:
    counts, tokens = corpus_case(name)
    R, E = counts.shape
    G = E // R
    ct = torch.from_numpy(counts)
    twins = {"greedy": (plan_torch, plan_device), "prefix": (plan_prefix,)}
    for method in ("greedy", "prefix"):
        full = plan(counts, total_tokens=tokens, method=method)
        for B in sorted({G, 1, 0, G + 2}):
            p = plan(counts, num_slots=B, total_tokens=tokens, method=method)
            check_invariants(counts, p, B, tokens, full)
            for twin in twins[method]:
                q = twin(ct, num_slots=B, total_tokens=tokens).to_numpy()  # bit-identical on the device path
                for f in ("alloc", "copies", "capacity", "cuts", "donor", "target"):
                    np.testing.assert_array_equal(getattr(q, f), getattr(p, f), err_msg=f"{name} {method} B={B} {f}")
                q = twin(ct, num_slots=B, total_tokens=tokens, validate=False).to_numpy()
                np.testing.assert_array_equal(q.alloc, p.alloc)
    if name in ("balanced", "all_local", "all_remote"):
        assert plan(counts).num_copies() == 0 and plan(counts, method="prefix").num_copies() == 0
    if name == "all_remote":
        assert np.trace(transfer_matrix(counts, plan(counts).cuts)) == 0


@pytest.mark.parametrize("name", CASES)
def test_corpus_triton_greedy_equals_plan(name: str, triton_kernels) -> None:
    """plan_device with the Triton backend of the greedy (on CUDA, or under Triton's interpreter) equals plan()
    field by field on every corpus case and slot count."""
    counts, tokens = corpus_case(name)
    G = counts.shape[1] // counts.shape[0]
    ct = torch.from_numpy(counts).to(triton_kernels.device)
    for B in sorted({G, 1, 0}):
        p = plan(counts, num_slots=B, total_tokens=tokens)
        q = plan_device(ct, num_slots=B, total_tokens=tokens, validate=False, kernels="triton").to_numpy()
        for f in ("alloc", "copies", "capacity", "cuts", "donor", "target"):
            np.testing.assert_array_equal(getattr(q, f), getattr(p, f), err_msg=f"{name} B={B} {f}")


# --------------------------------------------------------------------- the policy through the dispatcher
H, F = 6, 5


def _policy_rank(rank: int, world: int, E: int, ids_all: list[torch.Tensor], num_slots: int | None,
                 kernels: str = "auto") -> dict:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(i.shape[0], H, generator=g) for i in ids_all]
    ws = [torch.rand(*i.shape, generator=g) + 0.1 for i in ids_all]
    experts = [torch.randn(E, F, H, generator=g), torch.randn(E, F, H, generator=g), torch.randn(E, H, F, generator=g)]
    gout = [torch.randn(x.shape[0], H, generator=g) for x in xs][rank]
    per = E // world
    disp = EPDispatcher(None, capacity=xs[rank].shape[0], hidden=H, top_k=ids_all[0].shape[1], num_experts=E,
                        placement=MoonEPPlacement(num_slots=num_slots, kernels=kernels))
    x = xs[rank].clone().requires_grad_()
    home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in experts]
    recv_x, _, _, handle = disp.dispatch(x, ids_all[rank], ws[rank])
    slots = disp.prefetch_weights(handle, home)
    y = torch.cat([grouped_glu_experts(recv_x[: handle.home_rows], handle.home_cu_seqlens(), *home),
                   grouped_glu_experts(recv_x[handle.home_rows:], handle.slot_cu_seqlens(), *slots)])
    out = disp.combine(y, handle)
    (out * gout).sum().backward()
    return {"out": out.detach(), "gx": x.grad, "gexperts": [t.grad for t in home], "rows": handle.rows,
            "imbalance": [int(v) for v in handle.plan.imbalance()], "alloc": np.asarray(handle.plan.alloc).copy()}


def _dispatch_reference(E: int, ids_all: list[torch.Tensor], res: list[dict]) -> None:
    """Every rank's dispatch/combine output and gradients equal the single-process MoE reference."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(i.shape[0], H, generator=g).requires_grad_() for i in ids_all]
    ws = [torch.rand(*i.shape, generator=g) + 0.1 for i in ids_all]
    experts = [t.requires_grad_() for t in (torch.randn(E, F, H, generator=g), torch.randn(E, F, H, generator=g),
                                            torch.randn(E, H, F, generator=g))]
    gouts = [torch.randn(x.shape[0], H, generator=g) for x in xs]
    outs = [moe_reference(x, i, w, *experts) for x, i, w in zip(xs, ids_all, ws)]
    sum((o * go).sum() for o, go in zip(outs, gouts)).backward()
    per = E // len(ids_all)
    for r, got in enumerate(res):
        torch.testing.assert_close(got["out"], outs[r].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["gx"], xs[r].grad, rtol=1e-5, atol=1e-6)
        for gt, ref in zip(got["gexperts"], experts):
            torch.testing.assert_close(gt, ref.grad[r * per:(r + 1) * per], rtol=1e-5, atol=1e-6)


def test_dispatcher_plans_with_the_triton_backend(triton_kernels) -> None:
    """``kernels="triton"`` (the GPU default; here Triton's interpreter in each of 4 gloo ranks): the dispatcher's
    plan is ``moonep.plan``'s on every rank, and outputs and gradients equal the reference (corpus case
    partial_s_8)."""
    ids, E = _ids("partial_s_8")
    ids_all = [torch.from_numpy(i).to(torch.int64) for i in ids]
    res = dist_run(_policy_rank, 4, E, ids_all, None, "triton", timeout=180)
    counts, tokens = corpus_case("partial_s_8")
    want = plan(counts, total_tokens=tokens)
    assert want.num_copies() > 0  # the case moves work: the plan matters
    for got in res:
        np.testing.assert_array_equal(got["alloc"], want.alloc)
    _dispatch_reference(E, ids_all, res)


def test_too_few_slots_through_the_dispatcher() -> None:
    """Issue 34's reproduction (R=2, E=6, k=1, s=3, counts [[1,1,1,0,0,0]] * 2, B=1) on 2 gloo ranks:
    dispatch/combine consume the policy's plan unchanged; outputs and gradients equal the reference,
    rank 0 computes 4 rows and rank 1 computes 2 (the reported imbalance)."""
    E = 6
    ids_all = [torch.tensor([[0], [1], [2]]), torch.tensor([[0], [1], [2]])]
    res = dist_run(_policy_rank, 2, E, ids_all, 1, timeout=120)
    _dispatch_reference(E, ids_all, res)
    for got in res:
        assert got["imbalance"] == [1, -1]
    assert [got["rows"] for got in res] == [4, 2]
