"""MoonEP dispatch / prefetch / combine on 2 and 4 gloo ranks vs the single-process reference.

Every rank builds the same seeded global problem, runs its slice through the dispatcher (home
experts sharded E/R per rank), and returns its output, all gradients and its expert rows; the test
compares them with :func:`moonrt.ops.grouped.moe_reference` / :func:`moonrt.comm.ep.ref.rows_reference`.
"""

from __future__ import annotations

import pytest
import torch
from dist import dist_run

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.layout import assignment_destinations, padded_rows
from moonrt.comm.ep.placement import HomePlacement, MoonEPPlacement
from moonrt.comm.ep.ref import rows_reference
from moonrt.comm.ep.slots import SlotPool
from moonrt.ops.grouped import grouped_glu_experts, moe_reference

H, F, E = 12, 10, 8


def make_problem(world: int, s: int | tuple[int, ...], k: int, routing: str, seed: int = 0) -> dict:
    """Seeded global problem: per-rank tokens, routing, weights, full expert weights, output grads.

    ``s``: tokens per rank, or one count per rank (ranks may route different numbers of tokens).
    """
    sizes = [s] * world if isinstance(s, int) else list(s)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, H, generator=g) for n in sizes]
    gouts = [torch.randn(n, H, generator=g) for n in sizes]
    ids = []
    for s in sizes:
        if routing == "random":
            ids.append(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(s)]))
        elif routing == "one_expert":  # every token picks expert 0 (and, for k > 1, others of rank 0's group)
            rest = [torch.randperm(E // world - 1, generator=g)[: k - 1] + 1 for _ in range(s)]
            ids.append(torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), r]) for r in rest]))
        elif routing == "skewed":  # most picks on rank 0's experts: tokens share destinations
            bias = torch.tensor([8.0] * (E // world) + [1.0] * (E - E // world))
            ids.append(torch.stack([torch.multinomial(bias, k, generator=g) for _ in range(s)]))
        elif routing == "repeated":  # with replacement: a token may list an expert more than once
            bias = torch.tensor([8.0] * (E // world) + [1.0] * (E - E // world))
            ids.append(torch.multinomial(bias, s * k, replacement=True, generator=g).view(s, k))
        elif routing == "rank_unused":  # the last rank's home experts are never chosen
            allowed = E - E // world
            ids.append(torch.stack([torch.randperm(allowed, generator=g)[:k] for _ in range(s)]))
        else:
            raise AssertionError(routing)
    ws = [torch.rand(n, k, generator=g) + 0.1 for n in sizes]
    ws = [w / w.sum(1, keepdim=True) for w in ws]
    experts = [torch.randn(E, F, H, generator=g) * 0.3, torch.randn(E, F, H, generator=g) * 0.3,
               torch.randn(E, H, F, generator=g) * 0.3]
    return {"xs": xs, "ids": ids, "ws": ws, "experts": experts, "gouts": gouts}


def _rank_fn(rank: int, world: int, s: int, k: int, routing: str, baseline: bool, dedup: bool,
             padding: int = 1) -> dict:
    torch.manual_seed(0)
    p = make_problem(world, s, k, routing)
    per = E // world
    placement = HomePlacement() if baseline else MoonEPPlacement()
    disp = EPDispatcher(None, capacity=s if isinstance(s, int) else max(s), hidden=H, top_k=k, num_experts=E,
                        placement=placement, dedup=dedup, token_padding=padding)
    x = p["xs"][rank].clone().requires_grad_()
    w = p["ws"][rank].clone().requires_grad_()
    home = [t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]]
    recv_x, recv_w, cu, handle = disp.dispatch(x, p["ids"][rank], w)
    slots = disp.prefetch_weights(handle, home)
    y_home = grouped_glu_experts(recv_x[: handle.home_rows], handle.home_cu_seqlens(), *home)
    y_slot = grouped_glu_experts(recv_x[handle.home_rows:], handle.slot_cu_seqlens(), *slots)
    y = torch.cat([y_home, y_slot])
    real = torch.arange(handle.rows)
    if padding > 1:
        pad = handle.padding
        assert bool((cu % padding == 0).all()) and recv_x.shape[0] == handle.out_rows == pad.padded_rows
        assert handle.out_rows == padded_rows(handle.rows, E // world + disp.num_slots, padding)
        mask = torch.zeros(handle.out_rows, dtype=torch.bool)
        for a, b in pad.pad_ranges.tolist():
            mask[a:b] = True
        assert int(mask.sum()) == handle.out_rows - handle.rows and not bool(mask[pad.row_index].any())
        assert not bool(recv_x[mask].any()) and not bool(recv_w[mask].any()), "padding rows must be zero"
        # whatever the expert compute leaves in the padding (here: a function of every expert weight)
        # must reach neither the output nor any gradient
        y = y + mask.unsqueeze(1) * (1e3 * sum(t.sum() for t in home + list(slots)))
        real = pad.row_index
    out = disp.combine(y, handle)
    (out * p["gouts"][rank]).sum().backward()
    # recv_weights is differentiable too: its gradient must reach topk_weights.
    w2 = p["ws"][rank].clone().requires_grad_()
    _, recv_w2, _, _ = disp.dispatch(x.detach(), p["ids"][rank], w2)
    (recv_w2[real] * torch.arange(real.shape[0], dtype=torch.float32)).sum().backward()
    cu_real = handle.layout.cu_seqlens
    return {
        "out": out.detach(), "gx": x.grad, "gw": w.grad, "gexperts": [t.grad for t in home],
        "recv_x": recv_x[real].detach(), "recv_w": recv_w[real].detach(), "cu": cu_real.tolist(),
        "rows": handle.rows,
        "alloc": torch.as_tensor(handle.plan.alloc), "copies": torch.as_tensor(handle.plan.copies),
        "capacity": [int(c) for c in handle.plan.capacity], "gw2": w2.grad,
        "counters": disp.counters,
    }


def _check(world: int, s: int | tuple[int, ...], k: int, routing: str, baseline: bool = False,
           dedup: bool = True, padding: int = 1) -> list[dict]:
    res = dist_run(_rank_fn, world, s, k, routing, baseline, dedup, padding, timeout=120)
    p = make_problem(world, s, k, routing)
    xs = [x.clone().requires_grad_() for x in p["xs"]]
    ws = [w.clone().requires_grad_() for w in p["ws"]]
    experts = [t.clone().requires_grad_() for t in p["experts"]]
    outs = [moe_reference(x, i, w, *experts) for x, i, w in zip(xs, p["ids"], ws)]
    sum((o * g).sum() for o, g in zip(outs, p["gouts"])).backward()

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        err = (a - b).norm() / b.norm().clamp_min(1e-30)
        assert err <= 1e-6, f"{what}: relative error {err:.2e}"

    for r, got in enumerate(res):
        close(got["out"], outs[r].detach(), f"rank {r} output")
        close(got["gx"], xs[r].grad, f"rank {r} input grad")
        close(got["gw"], ws[r].grad, f"rank {r} router-weight grad")
        rows, cu = rows_reference(p["ids"], got["alloc"], got["copies"], r)
        assert got["cu"] == cu
        want_x = torch.stack([p["xs"][src][t] for src, t, _ in rows]) if rows else torch.zeros(0, H)
        want_w = torch.tensor([float(p["ws"][src][t, j]) for src, t, j in rows])
        assert torch.equal(got["recv_x"], want_x), f"rank {r}: rows differ from rows_reference"
        assert torch.equal(got["recv_w"], want_w)
        assert got["rows"] == got["capacity"][r] == got["counters"].rows_computed
        # gradient of recv_weights (row index) lands on the right (token, j)
        want_gw2 = torch.zeros(p["xs"][r].shape[0], k)
        for i, (src, t, j) in enumerate(rows):
            if src == r:
                want_gw2[t, j] = i
        # rows of rank r's tokens may sit on other ranks; gather the full expectation
        res_r = want_gw2
        for d in range(world):
            if d == r:
                continue
            rows_d, _ = rows_reference(p["ids"], got["alloc"], got["copies"], d)
            for i, (src, t, j) in enumerate(rows_d):
                if src == r:
                    res_r[t, j] = i
        assert torch.equal(got["gw2"], res_r)
    # counters: dispatch sends H fp32 per token row (one per assignment, or with dedup one per distinct
    # (token, destination) pair) + the weight (and with dedup an int64 row index) per assignment;
    # combine sends H fp32 per token row back (two forward dispatches ran: the main one and the recv_weights one)
    rows_of = [rows_reference(p["ids"], res[0]["alloc"], res[0]["copies"], d)[0] for d in range(world)]
    for r in range(world):
        for d in range(world):
            to_d = sum(src == r for src, _, _ in rows_of[d])
            pairs_to_d = len({t for src, t, _ in rows_of[d] if src == r}) if dedup else to_d
            pairs_from_d = len({t for src, t, _ in rows_of[r] if src == d}) if dedup else \
                sum(src == d for src, _, _ in rows_of[r])
            c = res[r]["counters"]
            assert c.rows_sent[d] == 2 * pairs_to_d and c.assignments_sent[d] == 2 * to_d
            per_assignment = 4 + (8 if dedup else 0)
            assert c.token_bytes_sent[d] == 2 * (pairs_to_d * H * 4 + to_d * per_assignment) + pairs_from_d * H * 4
    for i, t in enumerate(experts):
        got = torch.cat([res[r]["gexperts"][i] for r in range(world)])
        assert got.shape == t.shape
        close(got, t.grad, f"expert weight {i} grad")
    if not baseline:
        total = sum(x.shape[0] for x in p["xs"]) * k
        for r in range(world):  # s*k each; floor/ceil of the total when ranks route different s (§6.1)
            assert res[r]["rows"] == total // world + (r < total % world), "MoonEP: exact per-rank capacity"
    return res


@pytest.mark.parametrize("world,routing,k,dedup", [
    (2, "random", 2, True), (2, "one_expert", 1, True), (2, "rank_unused", 2, False),
    (4, "random", 2, False), (4, "one_expert", 2, True), (4, "rank_unused", 3, True),
    (4, "skewed", 4, True), (4, "repeated", 4, True), (4, "repeated", 3, False),
])
def test_moonep_matches_reference(world: int, routing: str, k: int, dedup: bool) -> None:
    """Outputs and gradients equal the reference; with dedup, rows sent = distinct (token, destination) pairs."""
    res = _check(world, s=6, k=k, routing=routing, dedup=dedup)
    if routing == "skewed":  # tokens share destinations: dedup sends strictly fewer rows than assignments
        assert sum(sum(r["counters"].rows_sent) for r in res) < sum(sum(r["counters"].assignments_sent) for r in res)
    if routing == "one_expert":  # rank 0 homes every chosen expert: all other ranks compute copies of them
        copies = res[0]["copies"]
        assert bool((copies[1:] >= 0).any(1).all()) and bool((copies[0] < 0).all())
        assert sum(r["counters"].experts_prefetched for r in res) == int((copies >= 0).sum())
        assert res[1]["counters"].weight_bytes_sent[0] == 0 < res[0]["counters"].weight_bytes_sent[1]


@pytest.mark.parametrize("dedup", [True, False])
def test_token_padding_matches_reference(dedup: bool) -> None:
    """Segments padded to multiples of 4 (zero fill, static padded row count): same outputs, gradients and
    real rows as without padding, even with the padding rows of the expert output set to garbage."""
    _check(4, s=6, k=3, routing="repeated", dedup=dedup, padding=4)


def test_alltoall_baseline_matches_reference() -> None:
    res = _check(2, s=6, k=2, routing="one_expert", baseline=True, dedup=False)
    # unbalanced: rank 0 homes the hot experts and computes every assignment
    assert res[0]["rows"] == 2 * 6 * 2 and res[1]["rows"] == 0


def _two_layers_fn(rank: int, world: int, misuse: bool) -> dict:
    """Two MoE layers in sequence sharing one SlotPool (layer 1: all tokens on expert 0, layer 2: random)."""
    s, k = 6, 2
    p1, p2 = make_problem(world, s, k, "one_expert", seed=0), make_problem(world, s, k, "random", seed=1)
    per = E // world
    pool = SlotPool(per, 2 * F * H + H * F)
    disps = [EPDispatcher(None, s, H, k, E, placement=MoonEPPlacement(), pool=pool) for _ in range(2)]
    x = p1["xs"][rank].clone().requires_grad_()
    homes = [[t[rank * per:(rank + 1) * per].clone().requires_grad_() for t in p["experts"]] for p in (p1, p2)]
    h_in, handles, ys = x, [], []
    for layer, (disp, p, home) in enumerate(zip(disps, (p1, p2), homes)):
        recv_x, _, _, h = disp.dispatch(h_in, p["ids"][rank], p["ws"][rank])
        slots = disp.prefetch_weights(h, home)
        y = torch.cat([grouped_glu_experts(recv_x[:h.home_rows], h.home_cu_seqlens(), *home),
                       grouped_glu_experts(recv_x[h.home_rows:], h.slot_cu_seqlens(), *slots)])
        if misuse and layer == 0:
            h.refill.clear()  # layer 1's copies will not be re-prefetched before its backward
        handles.append(h)
        ys.append(y)
        if layer == 0:
            h_in = disp.combine(y, h)
    out = disps[1].combine(ys[1], handles[1])
    try:
        (out * p1["gouts"][rank]).sum().backward()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"out": out.detach(), "gx": x.grad, "g1": [t.grad for t in homes[0]], "g2": [t.grad for t in homes[1]],
            "copies": [torch.as_tensor(h.plan.copies) for h in handles]}


@pytest.mark.parametrize("world", [2, 4])
def test_shared_slot_pool_two_layers(world: int) -> None:
    """Both layers' copies live in one pool; combine's backward re-prefetches them: exact gradients."""
    res = dist_run(_two_layers_fn, world, False, timeout=120)
    s, k = 6, 2
    p1, p2 = make_problem(world, s, k, "one_expert", seed=0), make_problem(world, s, k, "random", seed=1)
    xs = [x.clone().requires_grad_() for x in p1["xs"]]
    e1 = [t.clone().requires_grad_() for t in p1["experts"]]
    e2 = [t.clone().requires_grad_() for t in p2["experts"]]
    mid = [moe_reference(x, i, w, *e1) for x, i, w in zip(xs, p1["ids"], p1["ws"])]
    outs = [moe_reference(x, i, w, *e2) for x, i, w in zip(mid, p2["ids"], p2["ws"])]
    sum((o * g).sum() for o, g in zip(outs, p1["gouts"])).backward()
    for r in range(world):
        for a, b in ((res[r]["out"], outs[r].detach()), (res[r]["gx"], xs[r].grad)):
            assert float((a - b).norm() / b.norm()) <= 1e-5
    assert bool((res[0]["copies"][0] >= 0).any()), "layer 1 must use slots"
    for key, ref in (("g1", e1), ("g2", e2)):
        for i, t in enumerate(ref):
            got = torch.cat([res[r][key][i] for r in range(world)])
            assert float((got - t.grad).norm() / t.grad.norm()) <= 1e-5, (key, i)


def test_shared_slot_pool_overwrite_is_an_error() -> None:
    """Without the re-prefetch, layer 2's copies sit in the pool during layer 1's backward: RuntimeError."""
    res = dist_run(_two_layers_fn, 2, True, timeout=120)
    for r in res:
        assert "slot pool was overwritten" in r.get("error", ""), r


def test_moonep_unequal_tokens_per_rank() -> None:
    """Ranks route 5, 8, 3 and 7 tokens (46 assignments): capacities 12, 12, 11, 11 (floor/ceil, §6.1)."""
    _check(4, (5, 8, 3, 7), k=2, routing="random")


def _bf16_fn(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, H, generator=g).bfloat16().requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)])
    w = (torch.rand(6, 2, generator=g) + 0.1).requires_grad_()
    # one rounding: per-assignment combine (dedup adds one)
    disp = EPDispatcher(None, 6, H, 2, E, placement=MoonEPPlacement(), dedup=False)
    recv_x, recv_w, _, h = disp.dispatch(x, ids, w)
    out = disp.combine(recv_x, h)
    (out.float().sum() + recv_w.sum()).backward()
    return {"x": x.detach(), "w": w.detach(), "out": out.detach(), "gx": x.grad, "gw": w.grad,
            "dtypes": (recv_x.dtype, recv_w.dtype, out.dtype)}


def test_bf16_tokens_keep_fp32_router_weights() -> None:
    """bf16 activations travel as bf16 while the fp32 router weights and their gradients stay fp32."""
    for r in dist_run(_bf16_fn, 2, timeout=60):
        assert r["dtypes"] == (torch.bfloat16, torch.float32, torch.bfloat16)
        x32 = r["x"].float()
        ref = (x32.unsqueeze(1) * r["w"].unsqueeze(2)).sum(1)
        assert torch.equal(r["out"], ref.bfloat16())  # fp32 weighted sum, one rounding to bf16
        assert torch.equal(r["gw"], x32.sum(1, keepdim=True).expand(-1, 2) + 1)  # exact in fp32
        # each row's gradient w * 1 is a bf16 row; the k rows are summed in fp32, then rounded once
        want_gx = r["w"].bfloat16().float().sum(1, keepdim=True).expand(-1, H).bfloat16()
        assert torch.equal(r["gx"], want_gx)


def _bf16_dedup_fn(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(6)])
    w = torch.rand(6, 3, generator=g) + 0.1
    disp = EPDispatcher(None, 6, H, 3, E, placement=MoonEPPlacement())
    recv_x, _, _, h = disp.dispatch(x, ids, w)
    return {"x": x, "w": w, "out": disp.combine(recv_x, h), "dst": assignment_destinations(h.layout).view(6, 3)}


def test_bf16_dedup_rounds_once_per_destination() -> None:
    """With dedup a destination sums a token's weighted rows in fp32 and returns one bf16 row; the source sums
    those in fp32 and rounds once more: elementwise within u * (sum_d |partial_d| + |out|) of the fp32 sum
    (u = 2^-8, bf16's unit roundoff; plus fp32 summation error), where a per-assignment combine rounds once."""
    u = 2.0 ** -8
    for r in dist_run(_bf16_dedup_fn, 2, timeout=60):
        x32 = r["x"].float()
        ref = (x32.unsqueeze(1) * r["w"].unsqueeze(2)).sum(1)
        bound = ref.abs().clone()
        for t in range(6):
            for d in r["dst"][t].unique().tolist():
                sel = r["dst"][t] == d
                bound[t] += (x32[t] * r["w"][t, sel].sum()).abs()
        bound = u * bound + 1e-5 * (x32.abs().unsqueeze(1) * r["w"].unsqueeze(2)).sum(1)
        assert bool(((r["out"].float() - ref).abs() <= bound).all())
