"""SiTU-GLU bound and SwiGLU agreement, GLUFFN, RMSNorm (K3_SYSTEMS §5.2, §1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_equal_f64, assert_near_reference

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.ffn import GLUFFN, dense_ffn, shared_expert
from moonrt.models.k3.model.norm import RMSNorm
from moonrt.ops.glu import situ_glu, soft_cap, swiglu


def test_situ_glu_bounded_by_100_everywhere():
    g = torch.Generator().manual_seed(0)
    scales = [1e-3, 1.0, 10.0, 1e3, 1e6, 1e30]
    for scale in scales:
        gate = torch.randn(4096, generator=g) * scale
        up = torch.randn(4096, generator=g) * scale
        out = situ_glu(gate, up)
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()
        assert out.abs().max() <= 100.0
    # the supremum is approached: large positive gate and large |up|
    big = torch.tensor([1e4, 1e4, -1e4, float("inf")])
    out = situ_glu(big, torch.tensor([1e4, -1e4, 1e4, float("inf")]))
    torch.testing.assert_close(out[:2], torch.tensor([100.0, -100.0]))
    assert out[2].abs() < 1e-3  # negative gate: sigmoid kills it
    assert out[3] == 100.0
    # swiglu is unbounded on the same inputs
    assert swiglu(torch.tensor([1e3]), torch.tensor([1e3])).item() > 1e5


def test_situ_glu_bf16_inputs_compute_fp32():
    gate = torch.randn(64, dtype=torch.bfloat16) * 50
    up = torch.randn(64, dtype=torch.bfloat16) * 50
    out = situ_glu(gate, up)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, situ_glu(gate.float(), up.float()))


def test_situ_glu_matches_swiglu_near_zero():
    """Relative difference to SwiGLU -> 0 as inputs shrink (it is O(x^2 / b^2))."""
    g = torch.Generator().manual_seed(1)
    gate0 = torch.randn(10000, generator=g, dtype=torch.float64)
    up0 = torch.randn(10000, generator=g, dtype=torch.float64)
    rels = []
    for eps in [1.0, 0.1, 0.01, 0.001]:
        a = situ_glu(gate0 * eps, up0 * eps).double()
        b = swiglu(gate0 * eps, up0 * eps).double()
        rels.append(((a - b).norm() / b.norm()).item())
    # monotone decrease, roughly 100x per 10x shrink (quadratic), and tiny at 1e-3
    for r_big, r_small in zip(rels, rels[1:]):
        assert r_small < r_big / 20
    assert rels[0] < 0.1  # already close at unit scale: the leading correction is gate^2 / (3 b1^2)
    assert rels[-1] < 1e-6
    # exact analytic check of soft_cap near zero
    x = torch.tensor([1e-3], dtype=torch.float64)
    torch.testing.assert_close(soft_cap(x, 4.0), x - x**3 / (3 * 16), rtol=1e-12, atol=0)


def test_situ_glu_gradients_finite_for_large_inputs():
    for scale in [1.0, 1e2, 1e4, 1e8]:
        gate = (torch.randn(1000) * scale).requires_grad_()
        up = (torch.randn(1000) * scale).requires_grad_()
        situ_glu(gate, up).sum().backward()
        assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    # gradcheck in float64 at moderate values
    gate = torch.randn(20, dtype=torch.float64, requires_grad=True)
    up = torch.randn(20, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: soft_cap(a, 4.0) * torch.sigmoid(a) * soft_cap(b, 25.0),
                                    (gate * 10, up * 30))


def test_situ_glu_bad_input():
    with pytest.raises(ValueError, match="gate shape"):
        situ_glu(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="beta"):
        situ_glu(torch.zeros(3), torch.zeros(3), beta=0.0)


def test_gluffn_matches_manual_formula():
    torch.manual_seed(0)
    for act in ("situ", "silu"):
        ffn = GLUFFN(16, 24, act=act)
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        ffn = ffn.double()
        g = x @ ffn.gate_proj.weight.T
        u = x @ ffn.up_proj.weight.T
        if act == "situ":
            h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
        else:
            h = F.silu(g) * u
        ref = h @ ffn.down_proj.weight.T
        # the activation computes in promote_types(dtype, fp32): float64 here, so equality to 1e-12
        assert_equal_f64(ffn(x), ref, f"GLUFFN act={act}")
    with pytest.raises(ValueError, match="dim=16"):
        GLUFFN(16, 8)(torch.zeros(3, 15))
    with pytest.raises(ValueError, match="act"):
        GLUFFN(16, 8, act="relu")  # type: ignore[arg-type]


def test_gluffn_from_config_shapes():
    cfg = k3_tiny()
    d = dense_ffn(cfg)
    s = shared_expert(cfg)
    assert d.gate_proj.weight.shape == (cfg.intermediate_size, cfg.hidden_size)
    assert s.down_proj.weight.shape == (cfg.hidden_size, cfg.moe_intermediate_size)
    assert (d.beta, d.linear_beta, d.act) == (4.0, 25.0, "situ")
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    assert d.to(torch.bfloat16)(x).dtype == torch.bfloat16


def test_rmsnorm_fp32_compute_and_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    x = torch.randn(4, 7, 32, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    out = norm(x.float())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    xb = x.to(torch.bfloat16)
    ob = norm(xb)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(ob.double(), norm(xb.float()).to(torch.bfloat16).double())
    with pytest.raises(ValueError, match="dim=32"):
        norm(torch.zeros(2, 31))
    with pytest.raises(ValueError, match="dim"):
        RMSNorm(0)


def _composed_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as plain torch ops (the form autograd differentiates step by step)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(dt)
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * w.to(dt)).to(x.dtype)


def test_rmsnorm_is_one_node_saving_input_and_rstd() -> None:
    """RMSNorm saves its input as given, the fp32 reciprocal RMS [..., 1] and the weight (a parameter),
    not the composed form's fp32 input copy, normed tensor and fp32 weight copy; the forward is bitwise the
    composed form's; gradients (input and weight) equal it in fp64 and are within fp32 rounding of it."""
    gen = torch.Generator().manual_seed(5)
    D = 96
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(D).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(D, generator=gen) + 0.5)
        x = (torch.randn(4, 7, D, generator=gen) * 3).to(dtype).requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = norm(x)
            n_fused = len(saved)
            ref = _composed_rms(x, norm.weight, norm.eps)
        assert n_fused == 3
        assert (saved[0].dtype, saved[0].data_ptr()) == (dtype, x.data_ptr())
        assert saved[1].shape == (4, 7, 1) and saved[1].dtype == torch.float32
        assert saved[2] is norm.weight or saved[2].data_ptr() == norm.weight.data_ptr()
        assert len(saved) - n_fused >= 5  # the composed form's saves
        assert torch.equal(out, ref), f"{dtype}: forward differs from the composed form"
    x64 = (torch.randn(3, 5, D, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    w64 = (torch.rand(D, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNorm.forward(_WithWeight(b), a), (x64, w64))
    proj = torch.randn(3, 5, D, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((_composed_rms(x64, w64, 1e-5) * proj).sum(), (x64, w64))
    got = torch.autograd.grad((RMSNorm.forward(_WithWeight(w64), x64) * proj).sum(), (x64, w64))
    for a, b, name in zip(got, want, ("d_x", "d_weight")):
        assert_equal_f64(a, b, f"rmsnorm {name}")
    # fp32: reductions of length D (mean of squares, mean of dy * y) and of 15 rows (weight): c = 2 (D + 15)
    x32, w32 = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
    got32 = torch.autograd.grad((RMSNorm.forward(_WithWeight(w32), x32) * proj.float()).sum(), (x32, w32))
    for a, b, name in zip(got32, want, ("d_x", "d_weight")):
        assert_near_reference(a, b, 2 * (D + 15), f"rmsnorm fp32 {name}")


class _WithWeight:
    """The attributes RMSNorm.forward reads, around a given weight tensor (a leaf for gradcheck)."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-5) -> None:
        self.weight, self.eps, self.dim = weight, eps, weight.shape[0]
