"""fp64 means fp64 (issue 32 item 4): a K3 model cast to float64 computes every op in float64, and its forward
equals float64 references of each layer written from the math of K3_SYSTEMS §2-5.

The references below are independent of the model code: per-token loops and plain tensor algebra, no moonrt
op. Two float64 computations of one function agree to rounding, so equality is :func:`assert_equal_f64`
(normwise 1e-12, tests/numerics.py); any fp32 step inside the model would show as ~1e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist import dist_run
from dtype_record import DtypeRecorder
from numerics import assert_equal_f64, assert_near_reference, growth

from moonrt.comm.ep.dispatch import EPDispatcher
from moonrt.comm.ep.placement import MoonEPPlacement
from moonrt.models.dense.model.config import dense_tiny
from moonrt.models.dense.model.model import DenseModel
from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.kda_layer import KDACache, KDALayer
from moonrt.models.k3.model.model import K3Model

F64 = torch.float64


# ---- references from K3_SYSTEMS -----------------------------------------------------------------
def rms(z: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (weightless when ``w`` is None)."""
    y = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def kda_reference(m: KDALayer, x: torch.Tensor) -> torch.Tensor:
    """§2.1-2.2, token by token: conv + SiLU on q|k|v, L2-normalized q, k, the bounded sigmoid decay, the delta
    rule ``S <- Diag(alpha) S; S <- S + beta k (v - S^T k)^T; o = S^T q / sqrt(K)``, then per-head RMSNorm times
    the sigmoid output gate and the output projection."""
    B, T, _ = x.shape
    H, K, W = m.num_heads, m.head_dim, m.kernel_size
    pre = x @ m.qkv_proj.weight.T
    conv = sum(F.pad(pre, (0, 0, j, 0))[:, :T] * m.conv_weight[:, W - 1 - j] for j in range(W))  # tap j: token t-j
    q, k, v = (z.reshape(B, T, H, K) for z in F.silu(conv).split(H * K, dim=-1))
    q, k = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    beta = torch.sigmoid(x @ m.b_proj.weight.T)  # [B, T, H]
    A = torch.exp(m.A_log).repeat_interleave(K)
    z = x @ m.f_a_proj.weight.T @ m.f_b_proj.weight.T
    g = (m.gate_lower_bound * torch.sigmoid(A * (z + m.dt_bias))).view(B, T, H, K)
    S = x.new_zeros(B, H, K, K)
    out = []
    for t in range(T):
        S = torch.exp(g[:, t]).unsqueeze(-1) * S
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + beta[:, t, :, None, None] * kt.unsqueeze(-1) * err.unsqueeze(-2)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K ** -0.5))
    o = rms(torch.stack(out, 1), m.o_norm_weight, m.eps) * torch.sigmoid(x @ m.g_proj.weight.T).view(B, T, H, K)
    return o.reshape(B, T, H * K) @ m.o_proj.weight.T


def mla_reference(m, x: torch.Tensor) -> torch.Tensor:
    """§3: latent-compressed queries / keys / values, NoPE, causal softmax, sigmoid output gate."""
    B, T, _ = x.shape
    H, nope, rope, vd, r = m.num_heads, m.nope, m.rope, m.v_dim, m.kv_lora
    q = (rms(x @ m.q_a_proj.weight.T, m.q_a_norm.weight, m.q_a_norm.eps) @ m.q_b_proj.weight.T).view(B, T, H, -1)
    ckv = x @ m.kv_a_proj.weight.T
    kv = (rms(ckv[..., :r], m.kv_a_norm.weight, m.kv_a_norm.eps) @ m.kv_b_proj.weight.T).view(B, T, H, nope + vd)
    k = torch.cat([kv[..., :nope], ckv[..., r:].unsqueeze(2).expand(B, T, H, rope)], dim=-1)
    s = torch.einsum("bthd,bshd->bhts", q, k) / (nope + rope) ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), kv[..., nope:]).reshape(B, T, H * vd)
    return (torch.sigmoid(x @ m.g_proj.weight.T) * o) @ m.o_proj.weight.T


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, b1: float, b2: float) -> torch.Tensor:
    """§5.2: SiTU-GLU ``[cap_b1(g) sigmoid(g)] cap_b2(u)``, ``cap_b(x) = b tanh(x / b)``; or SwiGLU."""
    if act == "silu":
        return F.silu(gate) * up
    return b1 * torch.tanh(gate / b1) * torch.sigmoid(gate) * (b2 * torch.tanh(up / b2))


def ffn_reference(f, x: torch.Tensor) -> torch.Tensor:
    return glu(x @ f.gate_proj.weight.T, x @ f.up_proj.weight.T, f.act, f.beta, f.linear_beta) @ f.down_proj.weight.T


def moe_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """§5.1, §5.3: sigmoid scores, top-k on ``scores + bias``, unbiased weights renormalized and scaled, the
    chosen latent experts on ``W_down x``, RMSNorm of their weighted sum, ``W_up``, plus the shared experts."""
    B, T, D = x.shape
    x2 = x.reshape(B * T, D)
    s = torch.sigmoid(x2 @ moe.router.weight.T)
    ids = torch.topk(s + moe.router.bias, moe.top_k, dim=-1).indices
    p = s.gather(1, ids)
    p = p / p.sum(-1, keepdim=True) * moe.router.scaling
    z = x2 @ moe.down_proj.weight.T
    ex = moe.experts
    u = torch.zeros_like(z)
    for j in range(moe.top_k):
        e = ids[:, j]
        h = glu(torch.einsum("nfl,nl->nf", ex.w_gate[e], z), torch.einsum("nfl,nl->nf", ex.w_up[e], z),
                ex.act, ex.beta, ex.linear_beta)
        u = u + p[:, j:j + 1] * torch.einsum("nlf,nf->nl", ex.w_down[e], h)
    if moe.norm is not None:
        u = rms(u, moe.norm.weight, moe.norm.eps)
    y = u @ moe.up_proj.weight.T
    for shared in moe.shared_experts:
        y = y + ffn_reference(shared, x2)
    return y.view(B, T, D)


def attn_res_reference(w: torch.Tensor, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """§4: ``sum_i softmax_i(w^T RMSNorm(v_i)) v_i`` (weightless key norm)."""
    logits = torch.stack([(rms(v, None, eps) * w).sum(-1) for v in sources])
    a = torch.softmax(logits, 0)
    return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(sources))


def model_reference(model: K3Model, tokens: torch.Tensor, check_layers: bool = False) -> torch.Tensor:
    """The whole decoder from the references; with ``check_layers`` each sub-layer of ``model`` is also run on the
    reference's input and compared with its reference (so a mismatch names the layer)."""
    ar = model.attn_res
    blocks, partial = [model.embed.weight[tokens]], None
    for i, layer in enumerate(model.layers):
        for which in (0, 1):
            h = attn_res_reference(ar.queries[2 * i + which], blocks + ([partial] if partial is not None else []),
                                   ar.eps)
            if which == 0:
                x = rms(h, layer.attn_norm.weight, layer.attn_norm.eps)
                out = kda_reference(layer.attn, x) if layer.kind == "kda" else mla_reference(layer.attn, x)
                module = layer.attn
            else:
                x = rms(h, layer.ffn_norm.weight, layer.ffn_norm.eps)
                out = moe_reference(layer.moe, x) if layer.is_moe else ffn_reference(layer.ffn, x)
                module = layer.moe if layer.is_moe else layer.ffn
            if check_layers:
                assert_equal_f64(module(x), out, f"layer {i} {'attention' if which == 0 else 'ffn'} ({layer.kind})")
            partial = out if partial is None else partial + out
        if (i + 1) % ar.block_size == 0 or i == len(model.layers) - 1:
            blocks.append(partial)
            partial = None
    final = attn_res_reference(ar.final_query, blocks, ar.eps)
    return rms(final, model.norm.weight, model.norm.eps) @ model.lm_head.weight.T


def _fp64_model(seed: int = 0) -> K3Model:
    """k3_tiny in float64 with non-trivial pseudo-queries, router biases and norm weights (every path matters)."""
    torch.manual_seed(seed)
    model = K3Model(k3_tiny()).to(F64)
    with torch.no_grad():
        model.attn_res.queries.normal_(std=0.5)
        model.attn_res.final_query.normal_(std=0.5)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("o_norm_weight"):
                p.uniform_(0.5, 1.5)
        for _, moe in model.moe_layers():
            moe.router.bias.normal_(std=0.05)
    return model


# ---- tests ------------------------------------------------------------------------------------------
def test_fp64_model_runs_every_op_in_fp64() -> None:
    """Training forward (QB statistics on) and backward, the two-phase AttnRes forward and cached KDA decoding of
    an fp64 model: no op reads or writes a floating tensor of any dtype but float64 (and the decoding equals the
    full-sequence forward to float64 rounding)."""
    model = _fp64_model()
    tokens = torch.randint(0, model.config.vocab_size, (1, 8))
    kda = model.layers[0].attn
    with DtypeRecorder(expect=F64) as rec:
        loss = model.loss_sum(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        logits = model(tokens, two_phase=True)
        cache = KDACache.empty(model.config, 2, dtype=F64)
        x = torch.randn(2, 4, model.config.hidden_size, dtype=F64)
        with torch.no_grad():
            steps = torch.cat([kda(x[:, t:t + 1], cache=cache) for t in range(x.shape[1])], dim=1)
    assert loss.dtype == logits.dtype == cache.state.dtype == F64
    with torch.no_grad():
        assert_equal_f64(steps, kda(x), "fp64 cached decoding vs the full sequence")
    assert rec.dtypes == {F64}, "non-fp64 ops in an fp64 model:\n" + "\n".join(rec.narrower_than(F64))


def test_fp64_dense_model_runs_every_op_in_fp64() -> None:
    """The dense model (same cast rule, ``promote(x, fp32)``) in fp64: forward and backward all fp64."""
    torch.manual_seed(0)
    model = DenseModel(dense_tiny()).to(F64)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    with DtypeRecorder(expect=F64) as rec:
        model.loss_sum(tokens, tokens).backward()
    assert rec.dtypes == {F64}, "non-fp64 ops in an fp64 dense model:\n" + "\n".join(rec.narrower_than(F64))


def _backward_growth(model: K3Model, t: int) -> int:
    """Error-growth constant (tests/numerics.py) of a parameter gradient of the whole model: the forward chain
    through every decoder layer (two AttnRes mixes of D, the attention chain: D, head dim, a t-term causal sum,
    H * K; the FFN chain: D and the dense intermediate size, the largest), the final mix and the head (D), and
    the backward chain of the same lengths."""
    cfg = model.config
    d, la = cfg.hidden_size, cfg.linear_attn_config
    per_layer = [d, d, la.head_dim, t, la.num_heads * la.head_dim, d, cfg.intermediate_size]
    return growth(per_layer * cfg.num_hidden_layers + [d, d], backward=True)


def test_fp64_forward_equals_the_layer_references() -> None:
    """Each sub-layer (KDA, MLA, dense FFN, LatentMoE) on its AttnRes input and the logits equal the float64
    references to 1e-12; every parameter gradient is within the whole model's derived float64 bound (a 9-layer
    backward chain: ~5e-12; the fp32 model misses it by 1e4)."""
    model = _fp64_model(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 10))
    logits = model(tokens)
    ref = model_reference(model, tokens, check_layers=True)
    assert_equal_f64(logits, ref, "logits")
    w = torch.randn(logits.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    got = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
    want = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for name, a, b in zip(names, got, want, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_near_reference(a, b, _backward_growth(model, tokens.shape[1]), f"d {name}")


def _ep_fp64_fn(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 12, generator=g, dtype=F64).requires_grad_()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    w = (torch.rand(6, 2, generator=g, dtype=F64) + 0.1).requires_grad_()
    disp = EPDispatcher(None, 6, 12, 2, 8, placement=MoonEPPlacement())
    with DtypeRecorder(expect=F64) as rec:
        recv_x, recv_w, _, h = disp.dispatch(x, ids, w)
        out = disp.combine(recv_x, h)
        (out.sum() + recv_w.sum()).backward()
    return {"x": x.detach(), "w": w.detach(), "out": out.detach(), "gx": x.grad, "gw": w.grad,
            "narrower": rec.narrower_than(F64)}


@pytest.mark.slow  # two gloo ranks in fp64: CI runs it, the fast lane need not
def test_fp64_expert_parallel_dispatch_and_combine() -> None:
    """Under expert parallelism (MoonEP on 2 gloo ranks) an fp64 model's tokens and router weights are dispatched,
    weighted and combined in fp64, forward and backward (the combine computes in fp32 only for bf16 / fp32)."""
    for r in dist_run(_ep_fp64_fn, 2, timeout=60):
        assert r["narrower"] == [], r["narrower"]
        x, w = r["x"], r["w"]
        assert_equal_f64(r["out"], (x.unsqueeze(1) * w.unsqueeze(2)).sum(1), "combined output")
        assert_equal_f64(r["gw"], x.sum(1, keepdim=True).expand(-1, 2) + 1, "d router weights")
        assert_equal_f64(r["gx"], w.sum(1, keepdim=True).expand(-1, x.shape[1]), "d tokens")

