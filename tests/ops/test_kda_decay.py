"""KDA's chunk form at any log-decay g <= 0 (K3_SYSTEMS §2.2): equal to the recurrence, outputs, states and every
gradient; kda_transition, kda_state_grad and KCP through the same clamp and sub-tile choice.

Strong decays are clamped at ``log_decay_floor(dtype)`` (a change below the dtype's resolution) and the in-chunk
sub-tile shrinks with the largest ``|g|`` (``sub_tile``) so every decay factor stays within ``e^80``. fp64 runs
are held to the recurrence at 1e-12 (normwise, :func:`numerics.assert_equal_f64`); fp32 runs to an fp64
recurrence within ``c eps`` with ``c`` the reduction lengths of the chunk form's longest chain (key dim K: the
in-chunk products; chunk C: the UT solve and W, U; C: A_qk V~; K: the state read), doubled for gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist import dist_run
from kda_terms_check import fused_and_autograd_terms
from numerics import assert_equal_f64, assert_near_reference, growth

import moonrt.ops.kda.terms as kda_terms
from moonrt.ops.kda import (
    kda_chunk,
    kda_recurrent,
    kda_state_grad,
    kda_transition,
    log_decay_floor,
    sub_tile,
)

NAMES = ("q", "k", "v", "g", "beta")


def _inputs(T: int, H: int, K: int, V: int, seed: int, gates: str, n_seq: int = 1) -> dict[str, torch.Tensor]:
    """fp64 inputs. ``gates``: ``"mixed"`` mostly mild (K3's range) with scattered tokens/channels at -40, -57,
    -1000 and -inf; ``"hard"`` every log-decay -1000; ``"logsigmoid"`` ``logsigmoid(randn)`` (dips below -5 at
    this seed and shape); ``"weak_mixed"`` weak decays (the state survives whole chunks) with the strong tokens of
    ``"mixed"`` in a quarter of the channels."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rn(1, T, H, K), dim=-1)
    u = torch.rand(1, T, H, K, generator=gen, dtype=torch.float64)
    if gates == "hard":
        g = torch.full((1, T, H, K), -1000.0, dtype=torch.float64)
    elif gates == "logsigmoid":
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=torch.Generator().manual_seed(80)))
        g = g.double()
        assert g.min() < -5.0  # the case the old bound refused
    else:
        g = -5.0 * torch.sigmoid(rn(1, T, H, K) - 1.0) if gates == "mixed" else -0.05 * u.flip(1)
        strong = torch.ones_like(g, dtype=torch.bool) if gates == "mixed" else torch.arange(K) < K // 4
        for lo, hi, val in ((0.0, 0.05, -40.0), (0.05, 0.08, -57.0), (0.08, 0.1, -1000.0), (0.1, 0.11, -torch.inf)):
            g = torch.where(strong & (u >= lo) & (u < hi), val, g)
    beta = torch.sigmoid(rn(1, T, H))
    S0 = rn(n_seq, H, K, V)
    return dict(q=q, k=k, v=rn(1, T, H, V), g=g, beta=beta, initial_state=S0)


def _run(fn, x: dict[str, torch.Tensor], dtype: torch.dtype, seed: int, **kw):
    """Outputs, final state and all six gradients for a fixed random loss (inputs cast to ``dtype``)."""
    leaves = {n: t.detach().to(dtype, copy=True).requires_grad_() for n, t in x.items()}
    o, S = fn(*(leaves[n] for n in NAMES), initial_state=leaves["initial_state"], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    w_s = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    return {"o": o.detach(), "S": S.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _recurrent_varlen(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens):
    """kda_recurrent per sequence of ``cu_seqlens``, outputs concatenated, final states stacked."""
    cu = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        o, S = kda_recurrent(*(t[:, a:b] for t in (q, k, v, g, beta)), initial_state=initial_state[i : i + 1],
                             output_final_state=output_final_state)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs, 1), torch.cat(finals)


def test_sub_tile_follows_the_decay_and_bounds_every_factor() -> None:
    """32-token sub-tiles for K3's gate range (the fast path is unchanged), shorter ones for stronger decays; for
    any choice, every diagonal-block factor exponent ``span(sub) * |g|max`` is within FACTOR_LOG_RANGE."""
    assert sub_tile(64) == sub_tile(64, 5.0) == sub_tile(128, 5.0) == 32
    assert sub_tile(64, -log_decay_floor(torch.float32)) == 8
    assert sub_tile(64, -log_decay_floor(torch.float64)) == 4
    assert sub_tile(64, 1000.0) == sub_tile(64, float("inf")) == 1
    assert sub_tile(5, 5.0) == 5 and sub_tile(7, 40.0) == 1  # divisors of a short chunk only
    for C in (1, 5, 7, 16, 24, 32, 64, 96):
        for extent in (0.0, 0.5, 5.0, 5.1, 11.0, 20.0, 27.0, 40.0, 80.0, 81.0, 1000.0):
            sub = sub_tile(C, extent)
            assert C % sub == 0 and (sub == 1 or kda_terms._span(sub) * extent <= kda_terms.FACTOR_LOG_RANGE)
    g = torch.full((2, 1, 1, 64, 4), -0.1, dtype=torch.float64)
    assert kda_terms._data_sub_tile(64, g) == 32
    g[1, 0, 0, 3, 2] = -20.0
    assert kda_terms._data_sub_tile(64, g) == 8


@pytest.mark.parametrize("gates", ["mixed", "hard", "logsigmoid"])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_any_decay_equals_the_recurrence_float64(gates: str, chunk_size: int) -> None:
    """fp64: outputs, final state and every gradient (q, k, v, g, beta, initial state) equal autograd through
    kda_recurrent to 1e-12, for log-decays down to -1000 and -inf; T = 200 (a padded tail)."""
    x = _inputs(200 if gates != "logsigmoid" else 256, 2, 32 if gates == "logsigmoid" else 16, 8, seed=1, gates=gates)
    ref = _run(kda_recurrent, x, torch.float64, seed=2)
    got = _run(kda_chunk, x, torch.float64, seed=2, chunk_size=chunk_size)
    scale = max(float(t.abs().max()) for t in ref.values())
    for name in ref:
        if not ref[name].any():  # "hard": exp(-1000) = 0 exactly: the initial state has no gradient; the clamped
            # decay exp(floor) leaves one below fp64's resolution of the gradients it carries
            assert float(got[name].abs().max()) <= math.exp(log_decay_floor(torch.float64)) * scale, name
            continue
        assert_equal_f64(got[name], ref[name], f"{gates} {name}")


@pytest.mark.parametrize("gates", ["mixed", "weak_mixed"])
def test_any_decay_equals_the_recurrence_float32(gates: str) -> None:
    """fp32 (fp32 clamp floor, 8-token sub-tiles) against the fp64 recurrence: within ``growth`` eps of its
    scale, outputs and state; gradients with the backward chain (twice)."""
    T, H, K, V, C = 200, 2, 16, 8, 64
    x = _inputs(T, H, K, V, seed=3, gates=gates)
    ref = _run(kda_recurrent, x, torch.float64, seed=4)
    got = _run(kda_chunk, x, torch.float32, seed=4)
    c = growth((K, C, C, K))
    for name in ref:
        assert got[name].dtype == torch.float32
        assert_near_reference(got[name], ref[name], c if name in ("o", "S") else 2 * c, f"{gates} {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_varlen_with_strong_decay_masks_equals_the_recurrence(dtype: torch.dtype) -> None:
    """cu_seqlens with fla-style masks (-1000 log-decays on whole stretches) and scattered strong tokens: every
    output, per-sequence final state and gradient equals the recurrence per sequence."""
    lens = [70, 0, 1, 90, 33]
    T, H, K, V = sum(lens), 2, 16, 8
    x = _inputs(T, H, K, V, seed=5, gates="weak_mixed", n_seq=len(lens))
    x["g"][:, 20:40] = -1000.0
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ref = _run(_recurrent_varlen, x, torch.float64, seed=6, cu_seqlens=cu)
    got = _run(kda_chunk, x, dtype, seed=6, cu_seqlens=cu, chunk_size=32)
    c = growth((K, 32, 32, K))
    for name in ref:
        if dtype == torch.float64:
            assert_equal_f64(got[name], ref[name], name)
        else:
            assert_near_reference(got[name], ref[name], c if name in ("o", "S") else 2 * c, name)


def test_clamp_is_below_resolution_and_its_gradient_is_zero() -> None:
    """A log-decay below the floor (here -25 and -inf in fp32) runs as the floor: the same outputs as at the
    floor itself, bit for bit, and a zero gradient there; the clamp only drops a decay below the dtype's
    resolution (exp(-20) = 2e-9 < eps(fp32) / 50)."""
    x = _inputs(64, 1, 8, 8, seed=7, gates="mixed")
    floor = log_decay_floor(torch.float32)
    assert torch.exp(torch.tensor(floor)) < torch.finfo(torch.float32).eps / 50
    assert torch.exp(torch.tensor(log_decay_floor(torch.float64), dtype=torch.float64)) \
        < torch.finfo(torch.float64).eps / 50
    g = x["g"].clamp(min=-5.0)
    g[0, 10, 0, :4] = -25.0
    g[0, 30, 0, 2] = -torch.inf
    at_floor = g.clamp(min=floor)
    a = _run(kda_chunk, {**x, "g": g}, torch.float32, seed=8)
    b = _run(kda_chunk, {**x, "g": at_floor}, torch.float32, seed=8)
    assert torch.equal(a["o"], b["o"]) and torch.equal(a["S"], b["S"])
    assert not a["dg"][0, 10, 0, :4].any() and a["dg"][0, 30, 0, 2] == 0
    assert torch.isfinite(a["dg"]).all()


def test_transition_and_state_grad_with_strong_decay_float64() -> None:
    """kda_transition's affine map predicts kda_chunk's final state, and its gradients (autograd through the torch
    terms and the clamp) equal the recurrence's; kda_state_grad equals the recurrence's initial-state gradient;
    all at log-decays down to -1000 / -inf (fp64, 1e-12)."""
    x = _inputs(150, 2, 16, 8, seed=9, gates="weak_mixed")
    args = [x[n] for n in NAMES]
    leaves = {n: x[n].clone().requires_grad_() for n in ("k", "v", "g", "beta")}
    M, S_ext = kda_transition(*(leaves[n] for n in ("k", "v", "g", "beta")), chunk_size=32)
    S0 = x["initial_state"]
    _, S_end = kda_chunk(*args, initial_state=S0, output_final_state=True)
    assert_equal_f64(M @ S0 + S_ext, S_end, "M S0 + S_ext")
    gen = torch.Generator().manual_seed(10)
    w_m, w_s = torch.randn(M.shape, generator=gen, dtype=torch.float64), torch.randn(S_ext.shape, generator=gen,
                                                                                    dtype=torch.float64)
    ((M * w_m).sum() + (S_ext * w_s).sum()).backward()
    # reference: M and S_ext from the recurrence (M's columns: the final state from unit-vector states, V = K)
    ref = {n: x[n].clone().requires_grad_() for n in ("k", "v", "g", "beta")}
    K = x["k"].shape[-1]
    eye = torch.eye(K, dtype=torch.float64).expand(1, 2, K, K)
    _, M_r = kda_recurrent(x["q"], ref["k"], torch.zeros(1, 150, 2, K, dtype=torch.float64), ref["g"], ref["beta"],
                           initial_state=eye, output_final_state=True)
    _, S_r = kda_recurrent(x["q"], ref["k"], ref["v"], ref["g"], ref["beta"], output_final_state=True)
    ((M_r * w_m).sum() + (S_r * w_s).sum()).backward()
    assert_equal_f64(M, M_r, "M")
    assert_equal_f64(S_ext, S_r, "S_ext")
    for n in ("k", "v", "g", "beta"):
        assert_equal_f64(leaves[n].grad, ref[n].grad, f"d{n}")
    d_o = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    d_final = torch.randn(S0.shape, generator=gen, dtype=torch.float64)
    s0 = S0.clone().requires_grad_()
    o, S = kda_recurrent(*args, initial_state=s0, output_final_state=True)
    (d_ref,) = torch.autograd.grad((o * d_o).sum() + (S * d_final).sum(), [s0])
    assert_equal_f64(kda_state_grad(*args, d_o, d_final=d_final, chunk_size=32), d_ref, "dS0")


@pytest.mark.parametrize("C", [64, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_terms_equal_the_autograd_path_at_strong_decay(C: int, dtype: torch.dtype) -> None:
    """The numba chunk terms and the torch ones agree at the short sub-tiles of strong decays (clamped at the
    floor: 8 tokens in fp32, 4 in fp64) and at 1-token sub-tiles (unclamped -1000)."""
    x = _inputs(2 * C, 2, 16, 8, seed=11, gates="mixed")
    for g in (x["g"].clamp(min=log_decay_floor(dtype)), torch.where(x["g"] < -50, -1000.0, x["g"])):
        ch = {n: kda_terms._to_chunks(x[n] if n != "g" else g, C, dtype) for n in NAMES}
        assert kda_terms._data_sub_tile(C, ch["g"]) in (1, 4, 8)
        for field, a, b in fused_and_autograd_terms(ch):
            assert a.shape == b.shape, field
            if dtype == torch.float64:
                assert_equal_f64(a, b, field)
            else:
                assert_near_reference(a, b.double(), 2 * growth((16, C)), field)


def _kcp_rank(rank: int, world: int, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from moonrt.comm.cp.ops import slice_bounds
    from moonrt.comm.cp.kcp import kcp_kda

    T = x["q"].shape[1]
    a, b = slice_bounds(T, world, rank)
    leaves = {n: x[n][:, a:b].clone().requires_grad_() for n in NAMES}
    h0 = x["initial_state"].clone().requires_grad_() if rank == 0 else None
    o, S = kcp_kda(*(leaves[n] for n in NAMES), group=None, initial_state=h0, output_final_state=True, chunk_size=32)
    loss = (o * x["w_o"][:, a:b]).sum() + ((S * x["w_s"]).sum() if S is not None else 0.0)
    loss.backward()
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if S is not None:
        out["S"] = S.detach()
    if h0 is not None:
        out["dinitial_state"] = h0.grad
    return out


def test_kcp_with_strong_decay_equals_the_recurrence_float64() -> None:
    """KCP on 2 gloo ranks (transition summaries, state-only backward and the local chunked kernel, all through the
    clamp) equals the single-process recurrence at log-decays down to -1000 / -inf: outputs, final state and every
    gradient (fp64, 1e-12). Weak decays elsewhere, so the state crosses the rank boundary."""
    x = _inputs(160, 2, 16, 8, seed=12, gates="weak_mixed")
    gen = torch.Generator().manual_seed(13)
    x["w_o"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    x["w_s"] = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)
    got = dist_run(_kcp_rank, 2, x, timeout=120)
    leaves = {n: x[n].clone().requires_grad_() for n in (*NAMES, "initial_state")}
    o, S = kda_recurrent(*(leaves[n] for n in NAMES), initial_state=leaves["initial_state"], output_final_state=True)
    ((o * x["w_o"]).sum() + (S * x["w_s"]).sum()).backward()
    assert_equal_f64(torch.cat([r["o"] for r in got], 1), o.detach(), "o")
    assert_equal_f64(got[1]["S"], S.detach(), "S")
    for n in NAMES:
        assert_equal_f64(torch.cat([r[f"d{n}"] for r in got], 1), leaves[n].grad, f"d{n}")
    assert_equal_f64(got[0]["dinitial_state"], leaves["initial_state"].grad, "dinitial_state")
