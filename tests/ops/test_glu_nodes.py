"""The GLU and the grouped experts as single autograd nodes (moonrt.ops.glu, moonrt.ops.grouped).

Each node must compute what the composed torch expression computes (forward and gradients, in float64
to the last digits; fp32 within rounding of a float64 reference) while saving less: the GLU two derivative
factors instead of six intermediates, the grouped experts four activations for all experts instead of
seven per expert (and no fp32 copies of bf16 weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_equal_f64, assert_near_reference, eps, growth

from moonrt.ops.glu import glu_activation, situ_glu, soft_cap, swiglu
from moonrt.ops.grouped import grouped_glu_experts


def _composed(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    dt = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(dt), up.to(dt)
    return soft_cap(g, 4.0) * torch.sigmoid(g) * soft_cap(u, 25.0) if act == "situ" else F.silu(g) * u


def _saves(fn):  # (result, non-parameter tensors autograd saved while fn ran)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.slow
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_node_equals_the_composed_expression_and_saves_two_tensors(act: str) -> None:
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(64, 48, generator=gen, dtype=torch.float64) * 6).requires_grad_()
    up = (torch.randn(64, 48, generator=gen, dtype=torch.float64) * 40).requires_grad_()
    fn = (lambda a, b: situ_glu(a, b)) if act == "situ" else swiglu
    assert torch.autograd.gradcheck(fn, (gate, up))
    proj = torch.randn(64, 48, generator=gen, dtype=torch.float64)
    out, saved = _saves(lambda: fn(gate, up))
    assert len(saved) == 2 and all(t.shape == (64, 48) for t in saved)
    ref, ref_saved = _saves(lambda: _composed(gate, up, act))
    assert len(ref_saved) >= 3  # what the node replaces
    assert_equal_f64(out, ref, f"{act} forward")
    got = torch.autograd.grad((out * proj).sum(), (gate, up))
    want = torch.autograd.grad((ref * proj).sum(), (gate, up))
    for a, b, name in zip(got, want, ("d_gate", "d_up")):
        assert_equal_f64(a, b, f"{act} {name}")
    # fp32 and bf16 inputs: fp32 math (elementwise: a few roundings per factor), gradients in the input dtype
    for dtype, c in ((torch.float32, 16), (torch.bfloat16, 16)):
        g2, u2 = gate.detach().to(dtype).requires_grad_(), up.detach().to(dtype).requires_grad_()
        out2 = glu_activation(g2, u2, act)  # type: ignore[arg-type]
        assert out2.dtype == torch.float32
        ref64 = _composed(g2.detach().double(), u2.detach().double(), act)
        assert_near_reference(out2, ref64, c, f"{act} {dtype} forward")
        d_gate, d_up = torch.autograd.grad((out2 * proj.float()).sum(), (g2, u2))
        assert d_gate.dtype == dtype and d_up.dtype == dtype
        if dtype == torch.float32:
            g64, u64 = g2.detach().double().requires_grad_(), u2.detach().double().requires_grad_()
            want64 = torch.autograd.grad((_composed(g64, u64, act) * proj).sum(), (g64, u64))
            for a, b, name in zip((d_gate, d_up), want64, ("d_gate", "d_up")):
                assert_near_reference(a, b, c, f"{act} fp32 {name}")


def test_glu_without_grad_builds_no_node_and_matches() -> None:
    gate, up = torch.randn(5, 7), torch.randn(5, 7)
    with torch.no_grad():
        a = situ_glu(gate.requires_grad_(), up)
    assert a.grad_fn is None
    torch.testing.assert_close(a, situ_glu(gate.detach(), up), rtol=0, atol=0)


def _loop_reference(x, bounds, wg, wu, wd, act):
    """The per-expert loop of composed autograd ops the grouped node replaces."""
    dt = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(x.shape[0], x.shape[1], dtype=dt)
    rows = []
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            xi = x[a:b].to(dt)
            h = _composed(xi @ wg[i].to(dt).t(), xi @ wu[i].to(dt).t(), act)
            rows.append((a, b, h @ wd[i].to(dt).t()))
    for a, b, y in rows:
        out = torch.cat([out[:a], y, out[b:]])
    return out


def _experts(gen, G, F_, H, dtype):
    return [(torch.randn(G, *shape, generator=gen, dtype=torch.float64) * 0.4).to(dtype).requires_grad_()
            for shape in ((F_, H), (F_, H), (H, F_))]


@pytest.mark.slow
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_grouped_node_equals_the_per_expert_loop(act: str) -> None:
    """Empty segments, padding rows before and after the segments, float64: output and every gradient equal
    the loop's; gradcheck; fp32 within rounding of float64 (reductions over H and over the segment rows)."""
    gen = torch.Generator().manual_seed(1)
    G, F_, H, rows = 5, 12, 16, 40
    bounds = [3, 10, 10, 20, 31, 35]  # rows 0-2 and 35-39 are padding, segment 1 is empty
    cu = torch.tensor(bounds)
    x = (torch.randn(rows, H, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ws = _experts(gen, G, F_, H, torch.float64)
    assert torch.autograd.gradcheck(lambda *a: grouped_glu_experts(a[0], cu, *a[1:], act=act), (x, *ws))
    out = grouped_glu_experts(x, cu, *ws, act=act)
    ref = _loop_reference(x, bounds, *ws, act)
    assert_equal_f64(out, ref, "grouped forward")
    assert (out[:3] == 0).all() and (out[35:] == 0).all()
    proj = torch.randn(rows, H, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out * proj).sum(), (x, *ws))
    want = torch.autograd.grad((ref * proj).sum(), (x, *ws))
    for a, b, name in zip(got, want, ("d_x", "d_gate", "d_up", "d_down")):
        assert_equal_f64(a, b, f"grouped {name}")
    assert (got[1][1] == 0).all()  # the empty segment's expert gets a zero gradient
    x32 = x.detach().float().requires_grad_()
    w32 = [w.detach().float().requires_grad_() for w in ws]
    out32 = grouped_glu_experts(x32, cu, *w32, act=act)
    c = growth([H, F_, 11], backward=True)  # gate/up dots over H, down dot over F, weight grads over a segment
    assert_near_reference(out32, out.detach(), c, "grouped fp32 forward")
    got32 = torch.autograd.grad((out32 * proj.float()).sum(), (x32, *w32))
    for a, b, name in zip(got32, got, ("d_x", "d_gate", "d_up", "d_down")):
        assert_near_reference(a, b, c, f"grouped fp32 {name}")


def test_grouped_node_saves_four_activations_and_the_weights_as_given() -> None:
    """bf16 rows and stacked bf16 weights: one node saves x (bf16, as given), the GLU output and its two
    fp32 derivative factors, plus the weights themselves (no fp32 copies); gradients come back in bf16 and
    equal the loop's up to the bf16 rounding of the result."""
    gen = torch.Generator().manual_seed(2)
    G, F_, H, rows = 4, 8, 16, 30
    cu = torch.tensor([0, 7, 15, 15, 30])
    x = torch.randn(rows, H, generator=gen).bfloat16().requires_grad_()
    ws = _experts(gen, G, F_, H, torch.bfloat16)
    out, saved = _saves(lambda: grouped_glu_experts(x, cu, *ws))
    activations = [t for t in saved if not any(t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                                               for w in ws)]
    assert [(t.dtype, tuple(t.shape)) for t in activations] == [
        (torch.bfloat16, (rows, H))] + [(torch.float32, (rows, F_))] * 3
    assert activations[0].data_ptr() == x.data_ptr()
    assert len(saved) - len(activations) == 3 * G  # one save per expert weight, each a view of its stack
    ref, ref_saved = _saves(lambda: _loop_reference(x, cu.tolist(), *ws, "situ"))
    assert len(ref_saved) > len(saved)
    got = torch.autograd.grad(out.sum(), (x, *ws))
    want = torch.autograd.grad(ref.sum(), (x, *ws))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        # both sides are fp32 math rounded to bf16 once: at most half a bf16 ulp each, plus fp32 rounding
        assert_near_reference(a.float(), b.double(), 2 * eps(torch.bfloat16) / eps(torch.float32), "bf16 grads")


def test_grouped_per_segment_weights_and_errors() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 16, generator=gen, requires_grad=True)
    wg, wu, wd = _experts(gen, 3, 12, 16, torch.float32)
    cu = torch.tensor([0, 4, 4, 10])
    seg = [[w[0], None, w[2]] for w in (wg, wu, wd)]
    out = grouped_glu_experts(x, cu, *seg)
    torch.testing.assert_close(out, grouped_glu_experts(x, cu, wg, wu, wd), rtol=0, atol=0)
    out.sum().backward()
    assert (wg.grad[1] == 0).all() and wg.grad[0].abs().sum() > 0
    with torch.no_grad():
        assert grouped_glu_experts(x, cu, wg, wu, wd).grad_fn is None
    with pytest.raises(ValueError, match="segment 1 has 2 rows but no expert weights"):
        grouped_glu_experts(x, torch.tensor([0, 4, 6, 10]), *seg)
    with pytest.raises(ValueError, match=r"segment 2: expert weights \(8, 16\)"):
        grouped_glu_experts(x, cu, [wg[0], wg[1], wg[2, :8]], [wu[0], wu[1], wu[2, :8]], [wd[0], wd[1], wd[2, :, :8]])
    empty = grouped_glu_experts(x, torch.tensor([0, 0, 0, 0]), wg, wu, wd)
    assert (empty == 0).all()
    empty.sum().backward()
