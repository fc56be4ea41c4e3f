"""Gated NoPE MLA (K3_SYSTEMS §3): naive per-head reference, context-parallel seam, bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from numerics import assert_near_reference, assert_same_function, growth

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.mla import GatedMLA
from moonrt.parallel.context import AttentionContext


def _layer(seed: int = 0) -> GatedMLA:
    torch.manual_seed(seed)
    layer = GatedMLA(k3_tiny())
    for p in layer.parameters():  # non-trivial norm weights too
        p.data.add_(0.05 * torch.randn_like(p))
    return layer


def _naive(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Explicit per-batch, per-head, per-query loops straight from the §3 equations."""
    c = layer
    b, t, d = x.shape
    h, nope, rope, vd, r = c.num_heads, c.nope, c.rope, c.v_dim, c.kv_lora

    def rms(z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps) * w

    out = torch.zeros(b, t, d, dtype=x.dtype)
    for bi in range(b):
        xb = x[bi]
        q_all = rms(xb @ c.q_a_proj.weight.T, c.q_a_norm.weight, c.q_a_norm.eps) @ c.q_b_proj.weight.T
        ckv = xb @ c.kv_a_proj.weight.T
        lat = rms(ckv[:, :r], c.kv_a_norm.weight, c.kv_a_norm.eps)
        k_rope = ckv[:, r:]  # NoPE: no rotary, shared by all heads
        kv = lat @ c.kv_b_proj.weight.T
        gate = torch.sigmoid(xb @ c.g_proj.weight.T)
        heads = []
        for hi in range(h):
            q = q_all[:, hi * (nope + rope):(hi + 1) * (nope + rope)]
            k_nope = kv[:, hi * (nope + vd):hi * (nope + vd) + nope]
            v = kv[:, hi * (nope + vd) + nope:(hi + 1) * (nope + vd)]
            k = torch.cat([k_nope, k_rope], dim=-1)
            o = torch.zeros(t, vd, dtype=x.dtype)
            for ti in range(t):
                s = (k[: ti + 1] @ q[ti]) / math.sqrt(nope + rope)
                o[ti] = torch.softmax(s, 0) @ v[: ti + 1]
            heads.append(o)
        o = torch.cat(heads, dim=-1) * gate
        out[bi] = o @ c.o_proj.weight.T
    return out


def _growth(layer: GatedMLA, t: int, backward: bool = False) -> int:
    """Error-growth constant (tests/numerics.py) of the layer: its longest chain of reductions is
    q_a_proj (D) -> q_a_norm and q_b_proj (q_lora) -> scores (nope + rope) -> softmax and the value sum
    (up to ``t`` keys) -> o_proj (H * v_dim)."""
    q_lora = layer.q_b_proj.in_features
    return growth([layer.q_a_proj.in_features, q_lora, q_lora, layer.nope + layer.rope, t,
                   layer.o_proj.in_features], backward)


def test_mla_matches_naive_reference_outputs_and_grads() -> None:
    """The fp32 layer against the naive loops run in float64 (same parameters), outputs and gradients,
    within the derived normwise bound (measured: <= ~6 eps; a wrong equation gives O(1))."""
    layer = _layer()
    x = torch.randn(2, 13, 128, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 13, 128) and y.dtype == torch.float32
    layer64 = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_(True)
    ref = _naive(layer64, x64)
    assert_near_reference(y, ref, _growth(layer, 13), "output")
    w = torch.randn(2, 13, 128, dtype=torch.float64)
    grads = torch.autograd.grad((y * w.float()).sum(), [x, *layer.parameters()])
    grads_ref = torch.autograd.grad((ref * w).sum(), [x64, *layer64.parameters()])
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, g, gr in zip(names, grads, grads_ref, strict=True):
        assert_near_reference(g, gr, _growth(layer, 13, backward=True), f"d {name}")


def test_mla_is_causal() -> None:
    layer = _layer(1)
    x = torch.randn(1, 10, 128)
    y = layer(x)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(1, 4, 128)
    assert_same_function(layer(x2)[:, :6], y[:, :6], _growth(layer, 10), "outputs before the change")
    assert not torch.allclose(layer(x2)[:, 6:], y[:, 6:])


class _ConcatContext(AttentionContext):
    """A fake context-parallel context: the earlier slice's latent is prepended by concatenation."""

    def __init__(self, earlier: torch.Tensor | None) -> None:
        self.earlier = earlier

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.earlier is None:
            return x, 0
        return torch.cat([self.earlier, x], dim=1), self.earlier.shape[1]


def test_mla_two_slices_through_gather_sequence_equal_full_run() -> None:
    layer = _layer(2)
    x = torch.randn(2, 21, 128)
    full_x = x.clone().requires_grad_(True)
    full = layer(full_x)
    w = torch.randn_like(full)
    g_full = torch.autograd.grad((full * w).sum(), [full_x, *layer.parameters()])

    x0 = x[:, :9].clone().requires_grad_(True)
    x1 = x[:, 9:].clone().requires_grad_(True)
    y0 = layer(x0, ctx=_ConcatContext(None))
    y1 = layer(x1, ctx=_ConcatContext(layer.latent(x0)))  # gradient flows back into slice 0
    c, c_grad = _growth(layer, 21), _growth(layer, 21, backward=True)
    assert_same_function(torch.cat([y0, y1], dim=1), full, c, "output")
    loss = (y0 * w[:, :9]).sum() + (y1 * w[:, 9:]).sum()
    g_split = torch.autograd.grad(loss, [x0, x1, *layer.parameters()])
    assert_same_function(torch.cat([g_split[0], g_split[1]], dim=1), g_full[0], c_grad, "d x")
    for (name, _), g, gr in zip(layer.named_parameters(), g_split[2:], g_full[1:], strict=True):
        assert_same_function(g, gr, c_grad, f"d {name}")


def test_mla_rejects_bad_input() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match=r"expected \[B, T, 128\]"):
        layer(torch.randn(2, 5, 64))

    class Short(AttentionContext):
        def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x, 3

    with pytest.raises(ValueError, match="gathered sequence length"):
        layer(torch.randn(1, 4, 128), ctx=Short())
