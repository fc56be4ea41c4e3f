"""KDA layer (K3_SYSTEMS §2.1-2.2): decoding with a cache == full sequence, bounded gate, gradients everywhere."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_same_function, growth

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.kda_layer import KDACache, KDALayer
from moonrt.ops.kda import kda_recurrent
from moonrt.parallel.context import AttentionContext


def layer_growth(layer: KDALayer, T: int) -> int:
    """Error growth of one KDA layer output (tests/numerics.py): the q/k/v/gate projections (D), the short
    conv, the q/k L2 norms (K), the state recurrence over T tokens of K-long dot products, the output gate
    and projection (H * K)."""
    cfg = layer.config
    H, K = cfg.linear_attn_config.num_heads, cfg.linear_attn_config.head_dim
    return growth([cfg.hidden_size, cfg.linear_attn_config.short_conv_kernel_size, K, T, K, H * K])


def make_layer(seed: int = 0) -> KDALayer:
    torch.manual_seed(seed)
    layer = KDALayer(k3_tiny())
    with torch.no_grad():  # larger weights than the init so every path matters
        for p in (layer.qkv_proj.weight, layer.g_proj.weight, layer.b_proj.weight, layer.f_a_proj.weight):
            p.mul_(5.0)
    return layer


def test_shapes_and_parameter_shapes() -> None:
    cfg = k3_tiny()
    layer = KDALayer(cfg)
    H, K, D = cfg.linear_attn_config.num_heads, cfg.linear_attn_config.head_dim, cfg.hidden_size
    assert layer.qkv_proj.weight.shape == (3 * H * K, D)
    assert layer.conv_weight.shape == (3 * H * K, cfg.linear_attn_config.short_conv_kernel_size)
    assert layer.f_a_proj.weight.shape == (K, D) and layer.f_b_proj.weight.shape == (H * K, K)
    assert layer.g_proj.weight.shape == (H * K, D) and layer.o_proj.weight.shape == (D, H * K)
    assert layer.A_log.shape == (H,) and layer.dt_bias.shape == (H * K,)
    y = layer(torch.randn(2, 37, D))
    assert y.shape == (2, 37, D) and torch.isfinite(y).all()


def test_decoding_with_cache_equals_full_sequence() -> None:
    layer = make_layer()
    x = torch.randn(2, 41, layer.hidden_size)
    with torch.no_grad():
        full = layer(x)
        cache = KDACache.empty(layer.config, batch_size=2)
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(x.shape[1])]
        c = layer_growth(layer, x.shape[1])
        assert_same_function(torch.cat(steps, dim=1), full, c, "decode vs full")
        assert cache.tokens == 41
        # a prefill of 30 tokens then 11 single-token steps, and a prefill in two uneven pieces
        cache = KDACache.empty(layer.config, batch_size=2)
        parts = [layer(x[:, :30], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(30, 41)]
        assert_same_function(torch.cat(parts, dim=1), full, c, "prefill 30 + decode vs full")
        cache2 = KDACache.empty(layer.config, batch_size=2)
        parts = [layer(x[:, :2], cache=cache2), layer(x[:, 2:], cache=cache2)]
        assert_same_function(torch.cat(parts, dim=1), full, c, "prefill 2 + 39 vs full")
        assert_same_function(cache2.state, cache.state, c, "final state")
        torch.testing.assert_close(cache2.conv, cache.conv)


class RecurrentContext(AttentionContext):
    """Routes the layer's KDA through the token recurrence; records the calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):  # type: ignore[override]
        self.calls.append(dict(q=q, k=k, g=g, beta=beta))
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)

    def conv_prefix(self, x: torch.Tensor, width: int) -> torch.Tensor:
        return torch.ones(x.shape[0], width, x.shape[2]) * 0.5


def test_layer_uses_the_context() -> None:
    """The KDA op and the conv halo come from ctx; q and k are unit norm; beta in (0, 1)."""
    layer = make_layer(1)
    x = torch.randn(1, 20, layer.hidden_size)
    ctx = RecurrentContext()
    y_ctx = layer(x, ctx=ctx)
    (call,) = ctx.calls
    torch.testing.assert_close(call["q"].norm(dim=-1), torch.ones(1, 20, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(call["k"].norm(dim=-1), torch.ones(1, 20, 4), atol=1e-3, rtol=0)
    assert ((call["beta"] > 0) & (call["beta"] < 1)).all()
    # the halo changes the first kernel-1 outputs only (the chunk op and the recurrence agree)
    y_local = layer(x)
    assert not torch.allclose(y_ctx[:, :3], y_local[:, :3], atol=1e-4)
    cache = KDACache.empty(layer.config, 1)
    cache.conv.fill_(0.5)
    assert_same_function(layer(x, cache=cache), y_ctx, layer_growth(layer, x.shape[1]), "cache halo vs ctx halo")


def test_gate_is_bounded() -> None:
    layer = make_layer(2)
    g_min = layer.gate_lower_bound
    g = layer.gate(torch.randn(2, 50, layer.hidden_size))
    assert g.dtype == torch.float32 and g.shape == (2, 50, 4, 48)
    assert ((g > g_min) & (g < 0)).all()
    # extreme inputs saturate the sigmoid but never leave [g_min, 0]
    g = layer.gate(torch.randn(2, 50, layer.hidden_size) * 1e4)
    assert ((g >= g_min) & (g <= 0)).all() and (g < g_min / 2).any() and (g > g_min / 2).any()
    # at init (f ~ 0) the decay is Kimi Linear's -A * dt with dt in [1e-3, 0.1]
    fresh = KDALayer(k3_tiny())
    g0 = fresh.gate(torch.zeros(1, 1, fresh.hidden_size)).flatten()
    A = fresh.A_log.exp().repeat_interleave(fresh.head_dim)
    dt = -g0 / A
    assert (dt > 1e-3 * 0.999).all() and ((dt < 0.1 * 1.001) | (g0 <= 0.9 * g_min * 0.999)).all()


def test_gradients_reach_every_parameter() -> None:
    layer = make_layer(3)
    x = torch.randn(2, 70, layer.hidden_size, requires_grad=True)
    layer(x).pow(2).mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    assert x.grad is not None and x.grad.abs().max() > 0


def test_gradients_match_the_recurrent_op() -> None:
    """The layer through the chunk op and through the recurrence: same output and parameter gradients."""
    layer = make_layer(4)
    x = torch.randn(1, 45, layer.hidden_size)

    def grads(ctx: AttentionContext | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        layer.zero_grad()
        y = layer(x) if ctx is None else layer(x, ctx=ctx)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}

    class Rec(RecurrentContext):
        def conv_prefix(self, x: torch.Tensor, width: int) -> torch.Tensor:
            return x.new_zeros(x.shape[0], width, x.shape[2])

    y_c, g_c = grads(None)
    y_r, g_r = grads(Rec())
    assert_same_function(y_c, y_r, layer_growth(layer, x.shape[1]), "chunk vs recurrent output")
    for n in g_c:
        err = (g_c[n] - g_r[n]).norm() / g_r[n].norm()
        assert err < 1e-5, (n, float(err))


def test_bad_input_is_rejected() -> None:
    cfg = k3_tiny()
    cfg.linear_attn_config.gate_lower_bound = 0.5  # not a decay (any negative bound is accepted)
    with pytest.raises(ValueError, match="gate_lower_bound = 0.5"):
        KDALayer(cfg)
    layer = KDALayer(k3_tiny())
    with pytest.raises(ValueError, match="x.shape"):
        layer(torch.randn(1, 4, 7))
    cache = KDACache.empty(layer.config, batch_size=3)
    with pytest.raises(ValueError, match="cache.conv.shape"):
        layer(torch.randn(2, 4, layer.hidden_size), cache=cache)
    cache = KDACache.empty(layer.config, batch_size=2)
    cache.state = cache.state.double()
    before = cache.conv.clone()
    with pytest.raises(ValueError, match="cache.state.dtype"):
        layer(torch.randn(2, 4, layer.hidden_size), cache=cache)
    assert cache.tokens == 0 and torch.equal(cache.conv, before)
