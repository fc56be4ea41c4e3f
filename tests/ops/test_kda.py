"""KDA ops (K3_SYSTEMS §2.1-2.4): chunk form == recurrence == the textbook update, outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
from kda_terms_check import fused_and_autograd_terms
from numerics import rel_l2

import moonrt.ops.kda.autograd as kda_module
import moonrt.ops.kda.terms as kda_terms
from moonrt.ops.kda import (
    chunk_terms,
    chunk_transitions,
    kda_chunk,
    kda_recurrent,
    kda_state_grad,
    kda_transition,
)


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int, dtype: torch.dtype = torch.float32,
                g_min: float = -5.0) -> dict[str, torch.Tensor]:
    """Random inputs shaped like the layer's: unit-norm q, k; g in (g_min, 0) as K3's gate; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = g_min * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    S0 = torch.randn(B, H, K, V, generator=gen)
    return {n: t.to(dtype) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0).items()}


def run_with_grads(fn, inputs: dict[str, torch.Tensor], use_state: bool, seed: int):
    """Outputs, final state and the gradients of all inputs for a fixed random loss."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    kwargs = {n: leaves[n] for n in ("q", "k", "v", "g", "beta")}
    if use_state:
        kwargs["initial_state"] = leaves["initial_state"]
    o, S = fn(**kwargs, output_final_state=True)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()
    loss.backward()
    grads = {n: t.grad for n, t in leaves.items() if t.grad is not None}
    return o.detach(), S.detach(), grads


@pytest.mark.parametrize("use_state", [False, True])
@pytest.mark.parametrize("T", [63, 64, 200, 1024])
def test_chunk_matches_recurrent(T: int, use_state: bool) -> None:
    inputs = make_inputs(B=1, T=T, H=2, K=16, V=8, seed=T + use_state)
    o_r, S_r, g_r = run_with_grads(kda_recurrent, inputs, use_state, seed=T)
    o_c, S_c, g_c = run_with_grads(kda_chunk, inputs, use_state, seed=T)
    assert o_c.dtype == torch.float32 and S_c.dtype == torch.float32
    assert rel_l2(o_c, o_r) <= 1e-5
    assert rel_l2(S_c, S_r) <= 1e-5
    expected = {"q", "k", "v", "g", "beta"} | ({"initial_state"} if use_state else set())
    assert set(g_c) == set(g_r) == expected
    for name in expected:
        assert rel_l2(g_c[name], g_r[name]) <= 1e-5, name


@pytest.mark.parametrize("chunks_per_group", [1, 3])
def test_chunk_groups(chunks_per_group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks processed in several cache-sized groups (the state carried across groups): same results."""
    inputs = make_inputs(B=2, T=300, H=2, K=16, V=8, seed=9)
    o_r, S_r, g_r = run_with_grads(kda_recurrent, inputs, True, seed=3)
    monkeypatch.setattr(kda_module, "CHUNK_GROUP_ELEMS", chunks_per_group * 2 * 2 * 64 * 16)
    o_c, S_c, g_c = run_with_grads(kda_chunk, inputs, True, seed=3)
    assert rel_l2(o_c, o_r) <= 1e-5 and rel_l2(S_c, S_r) <= 1e-5
    for name in g_r:
        assert rel_l2(g_c[name], g_r[name]) <= 1e-5, name


@pytest.mark.parametrize("chunk_size", [16, 32, 8, 5])
def test_chunk_sizes_and_padding(chunk_size: int) -> None:
    inputs = make_inputs(B=1, T=77, H=2, K=16, V=16, seed=chunk_size, dtype=torch.float64)
    o_r, S_r = kda_recurrent(**inputs, output_final_state=True)
    o_c, S_c = kda_chunk(**inputs, output_final_state=True, chunk_size=chunk_size)
    assert rel_l2(o_c, o_r) < 1e-12 and rel_l2(S_c, S_r) < 1e-12


def test_recurrent_matches_textbook_update() -> None:
    """S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T, o_t = S_t^T (scale q), written out per head."""
    B, T, H, K, V = 1, 5, 2, 3, 4
    x = make_inputs(B, T, H, K, V, seed=7, dtype=torch.float64)
    x["k"] = x["k"] * 1.3  # not unit norm: the op must use k as given
    scale = 0.7
    o, S = kda_recurrent(**x, scale=scale, output_final_state=True)
    for h in range(H):
        S_ref = x["initial_state"][0, h]
        for t in range(T):
            k, v, b = x["k"][0, t, h], x["v"][0, t, h], x["beta"][0, t, h]
            S_ref = (torch.eye(K, dtype=k.dtype) - b * torch.outer(k, k)) @ torch.diag(x["g"][0, t, h].exp()) @ S_ref
            S_ref = S_ref + b * torch.outer(k, v)
            torch.testing.assert_close(o[0, t, h], S_ref.T @ (scale * x["q"][0, t, h]))
        torch.testing.assert_close(S[0, h], S_ref)


def test_default_scale_and_dtypes() -> None:
    x = make_inputs(1, 20, 1, 16, 8, seed=3)
    o1, _ = kda_chunk(**x)
    o2, _ = kda_chunk(**x, scale=16 ** -0.5)
    torch.testing.assert_close(o1, o2)
    bf = {n: (t.bfloat16() if n != "initial_state" else t) for n, t in x.items()}
    o, S = kda_chunk(**bf, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_r, S_r = kda_recurrent(**bf, output_final_state=True)
    assert rel_l2(S, S_r) < 1e-5


def test_strong_decay_stays_finite() -> None:
    """Per-token log-decay at the accepted limit (-5, K3's bound) in every channel: no inf/NaN, gradients agree."""
    x = make_inputs(1, 100, 2, 16, 8, seed=5)
    x["g"] = torch.full_like(x["g"], -5.0)
    x["k"] = x["k"] * 3.0
    o_r, S_r, g_r = run_with_grads(kda_recurrent, x, True, seed=1)
    o_c, S_c, g_c = run_with_grads(kda_chunk, x, True, seed=1)
    assert rel_l2(o_c, o_r) < 1e-5 and rel_l2(S_c, S_r) < 1e-5
    for name in g_r:
        assert torch.isfinite(g_c[name]).all() and rel_l2(g_c[name], g_r[name]) < 1e-5, name


def test_segment_transition_is_the_affine_state_map() -> None:
    """kda_transition's (M, S_ext) predicts kda_chunk's final state from two different entering states."""
    T = 45
    x = make_inputs(2, T, 2, 16, 8, seed=11, g_min=-0.05)  # weak decay: the entering state still matters
    M, S_ext = kda_transition(x["k"], x["v"], x["g"], x["beta"], chunk_size=16)
    assert M.shape == (2, 2, 16, 16) and S_ext.shape == (2, 2, 16, 8) and M.dtype == torch.float32
    assert M.abs().max() > 0.1
    S_a = x["initial_state"]
    S_b = torch.randn(S_a.shape, generator=torch.Generator().manual_seed(0))
    for S0 in (S_a, S_b, torch.zeros_like(S_a)):
        _, S_end = kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=S0, output_final_state=True)
        assert rel_l2(M @ S0 + S_ext, S_end) < 1e-5
    # the per-chunk maps compose to the segment's: M = prod over tokens of (I - beta k k^T) Diag(alpha)
    M_ref = torch.eye(16, dtype=torch.float64).expand(2, 2, 16, 16)
    for t in range(T):
        k, b = x["k"][:, t].double(), x["beta"][:, t, :, None, None].double()
        step = torch.eye(16, dtype=torch.float64) - b * k[..., :, None] * k[..., None, :]
        M_ref = step @ torch.diag_embed(x["g"][:, t].double().exp()) @ M_ref
    assert rel_l2(M, M_ref) < 1e-5


def test_chunk_terms_match_definitions() -> None:
    """W, U, Kg, A_qk of one chunk against the §2.3 definitions written densely (with the explicit UT T)."""
    x = make_inputs(1, 32, 1, 8, 4, seed=2, dtype=torch.float64)
    ch = {n: x[n][0, :, 0] for n in ("q", "k", "v", "g")}  # [C, K]
    beta = x["beta"][0, :, 0]
    terms = chunk_terms(*(x[n].transpose(1, 2)[:, :, None] for n in ("k", "v", "g", "beta")),
                        q=x["q"].transpose(1, 2)[:, :, None], scale=0.5)
    G = ch["g"].cumsum(0)
    D = torch.exp(G[:, None, :] - G[None, :, :])  # [r, c, K]
    L = torch.tril(beta[:, None] * torch.einsum("rd,cd,rcd->rc", ch["k"], ch["k"], D), -1)
    T = torch.linalg.inv(torch.eye(32, dtype=torch.float64) + L) @ torch.diag(beta)
    torch.testing.assert_close(terms.W[0, 0, 0], T @ (G.exp() * ch["k"]))
    torch.testing.assert_close(terms.U[0, 0, 0], T @ ch["v"])
    torch.testing.assert_close(terms.Kg[0, 0, 0], (G[-1] - G).exp() * ch["k"])
    A_qk = 0.5 * torch.tril(torch.einsum("rd,cd,rcd->rc", ch["q"], ch["k"], D))
    torch.testing.assert_close(terms.A_qk[0, 0, 0], A_qk)
    M, _ = chunk_transitions(terms)
    torch.testing.assert_close(M[0, 0, 0], torch.diag(G[-1].exp()) - terms.Kg[0, 0, 0].T @ terms.W[0, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("C", "with_q"), [(64, True), (128, True), (96, False), (16, True)])
def test_fused_terms_equal_the_autograd_path(C: int, with_q: bool, dtype: torch.dtype) -> None:
    """The numba path of chunk_terms_with_factors (no graph) and the torch path (taken when an input requires
    grad) compute the same terms and tile factors: 1, 2, 3 and 4 sub-tiles per chunk, K3's full gate range."""
    x = make_inputs(2, 2 * C, 2, 16, 8, seed=C, dtype=dtype)
    x["g"] = -5.0 * torch.sigmoid(torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    ch = {n: kda_terms._to_chunks(x[n], C, dtype) for n in ("q", "k", "v", "g", "beta")}
    q = ch["q"] if with_q else None
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for field, a, b in fused_and_autograd_terms(ch, with_q=with_q):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype, field
        assert rel_l2(a, b) <= tol, field
    fused = kda_terms.chunk_terms_with_factors(ch["k"], ch["v"], ch["g"], ch["beta"], q=q, scale=0.3)
    terms = kda_terms.chunk_terms(ch["k"], ch["v"], ch["g"], ch["beta"], q=q, scale=0.3)
    assert terms.T is None  # the forward-only path skips T and solves for [W | U] directly
    assert rel_l2(terms.W, fused[0].W) <= tol and rel_l2(terms.U, fused[0].U) <= tol


def test_empty_sequence() -> None:
    x = make_inputs(1, 0, 2, 4, 4, seed=0)
    o, S = kda_chunk(**x, output_final_state=True)
    assert o.shape == (1, 0, 2, 4)
    torch.testing.assert_close(S, x["initial_state"])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"v": torch.zeros(1, 9, 2, 4)}, "v.shape"),
        ({"g": torch.zeros(1, 8, 2, 3)}, "g.shape"),
        ({"beta": torch.zeros(1, 8, 2, 1)}, "beta.shape"),
        ({"initial_state": torch.zeros(1, 2, 4, 5)}, "initial_state.shape"),
        ({"g": torch.full((1, 8, 2, 4), float("nan"))}, "g.min"),
    ],
)
def test_bad_input_is_rejected(override: dict[str, torch.Tensor], match: str) -> None:
    x = make_inputs(1, 8, 2, 4, 4, seed=0)
    x.update(override)
    with pytest.raises(ValueError, match=match):
        kda_chunk(**x)


def test_bad_chunk_size_is_rejected() -> None:
    x = make_inputs(1, 8, 2, 4, 4, seed=0)
    with pytest.raises(ValueError, match="chunk_size = 40"):
        kda_chunk(**x, chunk_size=40)


@pytest.mark.parametrize("lens", [[37, 64, 1, 100], [0, 5, 0, 130], [200]])
@pytest.mark.parametrize("use_state", [False, True])
def test_cu_seqlens_equals_per_sequence_calls(lens: list[int], use_state: bool) -> None:
    """Packed sequences (fla's cu_seqlens): outputs, per-sequence final states and every gradient equal separate
    calls per sequence (states reset at each boundary; nothing leaks across)."""
    T, H, K, V = sum(lens), 2, 16, 8
    x = make_inputs(1, T, H, K, V, seed=len(lens) + sum(lens))
    S0 = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    names = ("q", "k", "v", "g", "beta")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    s_leaf = S0.clone().requires_grad_()
    o, S = kda_chunk(**leaves, initial_state=s_leaf if use_state else None, output_final_state=True,
                     cu_seqlens=cu)
    assert o.shape == (1, T, H, V) and S.shape == (len(lens), H, K, V)
    gen = torch.Generator().manual_seed(5)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    ref_leaves = {n: x[n].clone().requires_grad_() for n in names}
    ref_s = S0.clone().requires_grad_()
    loss = 0.0
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, S_i = kda_recurrent(**{n: t[:, a:b] for n, t in ref_leaves.items()},
                                 initial_state=ref_s[i : i + 1] if use_state else None, output_final_state=True)
        if b > a:
            assert rel_l2(o[:, a:b].detach(), o_i.detach()) <= 1e-5
        if use_state or b > a:
            assert rel_l2(S[i].detach(), S_i[0].detach()) <= 1e-5
        else:  # an empty sequence from a zero state ends in the zero state
            assert not S[i].any()
        loss = loss + (o_i * w_o[:, a:b]).sum() + (S_i[0] * w_s[i]).sum()
    loss.backward()
    for n in names:
        assert rel_l2(leaves[n].grad, ref_leaves[n].grad) <= 1e-5, n
    if use_state:
        assert rel_l2(s_leaf.grad, ref_s.grad) <= 1e-5


def test_cu_seqlens_matches_per_sequence_kda_chunk_exactly_in_fp64() -> None:
    """Same math as separate kda_chunk calls (fp64: agreement to rounding), incl. one sequence of 0 tokens."""
    lens = [70, 0, 33]
    x = make_inputs(1, sum(lens), 2, 8, 8, seed=1, dtype=torch.float64)
    S0 = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    o, S = kda_chunk(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=S0, output_final_state=True,
                     cu_seqlens=torch.tensor([0, 70, 70, 103], dtype=torch.int32), chunk_size=32)
    a = 0
    for i, n in enumerate(lens):
        o_i, S_i = kda_chunk(*(x[m][:, a : a + n] for m in ("q", "k", "v", "g", "beta")),
                             initial_state=S0[i : i + 1], output_final_state=True, chunk_size=32)
        torch.testing.assert_close(o[:, a : a + n], o_i, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(S[i : i + 1], S_i, rtol=1e-12, atol=1e-12)
        a += n


@pytest.mark.parametrize(
    ("cu", "kwargs", "match"),
    [
        (torch.tensor([0, 3, 7]), {}, "cu_seqlens = \\[0, 3, 7\\]"),
        (torch.tensor([0, 5, 3, 8]), {}, "non-decreasing"),
        (torch.tensor([0.0, 8.0]), {}, "integer"),
        (torch.tensor([0, 8]), {"initial_state": torch.zeros(2, 2, 4, 4)}, "initial_state.shape"),
    ],
)
def test_bad_cu_seqlens_is_rejected(cu: torch.Tensor, kwargs: dict[str, torch.Tensor], match: str) -> None:
    x = make_inputs(1, 8, 2, 4, 4, seed=0)
    x.pop("initial_state")
    with pytest.raises(ValueError, match=match):
        kda_chunk(**x, **kwargs, cu_seqlens=cu)
    x2 = make_inputs(2, 8, 2, 4, 4, seed=0)
    x2.pop("initial_state")
    with pytest.raises(ValueError, match="batch size 1"):
        kda_chunk(**x2, cu_seqlens=torch.tensor([0, 8]))


def test_strong_decay_underflow_factors_match_float64() -> None:
    """Strong decay over long chunks (K3's full gate range, cumulative log-decays far below fp32's exp range):
    clamping decaying exponents at LOG_FLOOR leaves outputs, state and gradients within fp32 rounding of a
    float64 run of the same chunk form, and of the fp32 recurrence."""
    x = make_inputs(1, 256, 2, 16, 16, seed=12)
    x["g"] = -5.0 * torch.sigmoid(torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(2)))
    o_c, S_c, g_c = run_with_grads(kda_chunk, x, True, seed=6)
    o_d, S_d, g_d = run_with_grads(kda_chunk, {n: t.double() for n, t in x.items()}, True, seed=6)
    o_r, S_r, g_r = run_with_grads(kda_recurrent, x, True, seed=6)
    assert rel_l2(o_c, o_d) < 1e-6 and rel_l2(S_c, S_d) < 1e-6
    assert rel_l2(o_c, o_r) < 1e-5 and rel_l2(S_c, S_r) < 1e-5
    for name in g_d:
        assert rel_l2(g_c[name], g_d[name]) < 1e-5 and rel_l2(g_c[name], g_r[name]) < 1e-5, name


def test_hand_written_backward_gradcheck_float64() -> None:
    """kda_chunk's explicit backward (ChunkKDA) against finite differences in float64 on a tiny shape: two
    32-token sub-tiles per chunk (diagonal and off-diagonal decay blocks), a padded tail, an initial state and
    the final state as outputs."""
    x = make_inputs(1, 40, 1, 4, 3, seed=21, dtype=torch.float64)
    leaves = tuple(x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state"))

    def fn(q, k, v, g, beta, s0):
        return kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=64)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_hand_written_backward_gradcheck_cu_seqlens_float64() -> None:
    """The reverse state pass with packed sequences (per-sequence initial and final states, an empty sequence):
    gradcheck in float64."""
    x = make_inputs(1, 45, 1, 4, 3, seed=22, dtype=torch.float64)
    S0 = torch.randn(3, 1, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = tuple(t.clone().requires_grad_() for t in (*(x[n] for n in ("q", "k", "v", "g", "beta")), S0))
    cu = torch.tensor([0, 38, 38, 45])

    def fn(q, k, v, g, beta, s0):
        return kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32,
                         cu_seqlens=cu)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("cu_lens", [None, [100, 0, 77, 1]])
def test_hand_written_backward_equals_recurrent_float64(cu_lens: list[int] | None) -> None:
    """float64: every gradient of kda_chunk (the explicit backward) equals autograd through kda_recurrent to
    rounding (1e-10 relative RMS), with several chunks, an initial state (per sequence with
    cu_seqlens) and the final state in the loss."""
    T = 178 if cu_lens is None else sum(cu_lens)
    x = make_inputs(1, T, 2, 8, 8, seed=23, dtype=torch.float64)
    if cu_lens is None:
        o_r, S_r, g_r = run_with_grads(kda_recurrent, x, True, seed=8)
        o_c, S_c, g_c = run_with_grads(kda_chunk, x, True, seed=8)
        assert rel_l2(o_c, o_r) < 1e-10 and rel_l2(S_c, S_r) < 1e-10
        for name in g_r:
            assert rel_l2(g_c[name], g_r[name]) < 1e-10, name
        return
    cu = [0, *torch.tensor(cu_lens).cumsum(0).tolist()]
    S0 = torch.randn(len(cu_lens), 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    names = ("q", "k", "v", "g", "beta")
    leaves = [t.clone().requires_grad_() for t in (*(x[n] for n in names), S0)]
    ref = [t.clone().requires_grad_() for t in (*(x[n] for n in names), S0)]
    o, S = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=torch.tensor(cu))
    gen = torch.Generator().manual_seed(7)
    w_o, w_s = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                     dtype=torch.float64)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    loss = 0.0
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        o_i, S_i = kda_recurrent(*(t[:, a:b] for t in ref[:5]), initial_state=ref[5][i : i + 1],
                                 output_final_state=True)
        loss = loss + (o_i * w_o[:, a:b]).sum() + (S_i[0] * w_s[i]).sum()
    loss.backward()
    for name, t, r in zip((*names, "initial_state"), leaves, ref):
        assert rel_l2(t.grad, r.grad) < 1e-10, name


@pytest.mark.parametrize("with_final", [False, True])
@pytest.mark.parametrize("chunks_per_group", [None, 1])
def test_state_grad_equals_autograd_initial_state_grad_float64(with_final: bool, chunks_per_group: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """kda_state_grad (KCP's state-only backward) equals autograd's initial-state gradient through kda_recurrent
    in float64 to rounding (1e-10 relative RMS): T = 178 (two full chunks of 64 and a padded tail), with and
    without a final-state gradient, with all chunks in one group and one chunk per group (the carry across
    groups)."""
    x = make_inputs(1, 178, 2, 8, 6, seed=31, dtype=torch.float64)
    if chunks_per_group is not None:
        monkeypatch.setattr(kda_module, "CHUNK_GROUP_ELEMS", chunks_per_group * 2 * 64 * 8)
    gen = torch.Generator().manual_seed(9)
    d_o = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    d_final = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64) if with_final else None
    s0 = x["initial_state"].clone().requires_grad_()
    o, S = kda_recurrent(*(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=s0, output_final_state=True)
    loss = (o * d_o).sum() + ((S * d_final).sum() if d_final is not None else 0.0)
    (ref,) = torch.autograd.grad(loss, [s0])
    got = kda_state_grad(*(x[n] for n in ("q", "k", "v", "g", "beta")), d_o, d_final=d_final)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert rel_l2(got, ref) < 1e-10


def test_state_grad_bad_input_is_rejected() -> None:
    x = make_inputs(1, 10, 2, 8, 6, seed=32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=r"d_o.shape = \(1, 10, 2, 5\): expected v's shape"):
        kda_state_grad(*args, torch.zeros(1, 10, 2, 5))
    with pytest.raises(ValueError, match=r"d_final.shape = \(1, 2, 8, 5\): expected \[B, H, K, V\]"):
        kda_state_grad(*args, torch.zeros(1, 10, 2, 6), d_final=torch.zeros(1, 2, 8, 5))
