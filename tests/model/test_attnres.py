"""Block AttnRes (K3_SYSTEMS §4): direct form vs an explicit reference, two-phase == direct, block structure.

Equalities are checked in float64 (1e-12); fp32 runs against the float64 reference within a bound
derived from the computation (tests/numerics.py), so the suite passes on any CPU's summation order.
"""

from __future__ import annotations

import pytest
import torch
from numerics import F64_RTOL, assert_equal_f64, assert_near_reference, eps, normwise_err

from moonrt.models.k3.model import attnres
from moonrt.models.k3.model.attnres import AttnResState, BlockAttnRes, inter_block_pass, merge_partial, mix


def _run(attn: BlockAttnRes, emb: torch.Tensor, weights: list[torch.Tensor], two_phase: bool) -> torch.Tensor:
    """Drive ``num_layers`` decoder layers whose two sub-layers are ``tanh(h @ W)``."""
    state = AttnResState(blocks=[emb])
    for layer in range(attn.num_layers):
        attn.begin_layer(layer, state, two_phase)
        for which in (0, 1):
            h = attn.sublayer_input(layer, which, state, two_phase)
            state.add(torch.tanh(h @ weights[2 * layer + which]))
        attn.end_layer(layer, state)
    return attn.final(state)


def _reference(attn: BlockAttnRes, emb: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Explicit Eq. 8-10 with per-position loops: softmax over [b_0..b_{n-1}, partial]."""
    eps = attn.eps

    def key(v: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)

    def softmix(w: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        logits = torch.stack([(key(v) * w).sum(-1) for v in sources])  # [N, B, T]
        a = torch.exp(logits - logits.max(0).values) / torch.exp(logits - logits.max(0).values).sum(0)
        return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(sources))

    blocks, partial = [emb], None
    for layer in range(attn.num_layers):
        for which in (0, 1):
            sources = blocks + ([partial] if partial is not None else [])
            out = torch.tanh(softmix(attn.queries[2 * layer + which], sources) @ weights[2 * layer + which])
            partial = out if partial is None else partial + out
        if (layer + 1) % attn.block_size == 0 or layer == attn.num_layers - 1:
            blocks.append(partial)
            partial = None
    return softmix(attn.final_query, blocks)


def _setup(num_layers: int = 9, block: int = 4, d: int = 16,
           dtype: torch.dtype = torch.float32) -> tuple[BlockAttnRes, torch.Tensor, list[torch.Tensor]]:
    """Seeded module, embedding ``[2, 5, d]`` and sub-layer weights; drawn in fp32, then cast to
    ``dtype`` (so the fp32 and fp64 setups hold exactly the same values)."""
    torch.manual_seed(0)
    attn = BlockAttnRes(d, num_layers, block, 1e-5)
    with torch.no_grad():
        attn.queries.normal_(std=1.0)
        attn.final_query.normal_(std=1.0)
    emb = torch.randn(2, 5, d)
    weights = [torch.randn(d, d) / d**0.5 for _ in range(2 * num_layers)]
    return attn.to(dtype), emb.to(dtype), [w.to(dtype) for w in weights]


def _growth(num_layers: int, d: int, backward: bool = False) -> int:
    """A-priori error-growth constant ``c`` of :func:`_run` and its backward (see tests/numerics.py).

    The stack is ``2 L + 1`` sequential AttnRes mixes (and as many ``tanh(h @ W)`` sub-layers). Each
    mix reduces over at most ``d`` terms (RMS, logits, the weighted sum over N <= d sources; the
    sub-layer matmul likewise), i.e. at most ~``d`` eps of relative rounding error per step; softmax,
    RMSNorm and tanh are O(1)-Lipschitz at these scales, so the errors add along the depth. A gradient
    carries the forward error plus a backward pass of the same depth and reduction lengths: twice the
    constant. Measured (fp32 vs fp64, AVX2 and scalar kernels, 1 and 2 threads, 6 cotangents per
    shape): at most 59 eps against bounds of 224-608 for gradients; an algebra error gives an O(1)
    relative error (~1e7 eps).
    """
    return (2 if backward else 1) * (2 * num_layers + 1) * d


def _outputs_and_grads(attn: BlockAttnRes, emb: torch.Tensor, weights: list[torch.Tensor], two_phase: bool,
                       w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output ``[B, T, D]`` and the gradients of ``sum(out * w)`` w.r.t. embedding and pseudo-queries."""
    emb = emb.detach().clone().requires_grad_(True)
    out = _run(attn, emb, weights, two_phase)
    g_emb, g_q, g_fq = torch.autograd.grad((out * w).sum(), [emb, attn.queries, attn.final_query])
    return {"out": out.detach(), "d_emb": g_emb, "d_queries": g_q, "d_final_query": g_fq}


def test_direct_matches_explicit_reference() -> None:
    attn, emb, weights = _setup(dtype=torch.float64)
    assert_equal_f64(_run(attn, emb, weights, False), _reference(attn, emb, weights), "direct vs Eq. 8-10")
    attn32, emb32, weights32 = _setup()
    assert_near_reference(_run(attn32, emb32, weights32, False), _reference(attn, emb, weights),
                          _growth(attn.num_layers, emb.shape[-1]), "fp32 direct vs fp64 Eq. 8-10")


@pytest.mark.parametrize("num_layers,block", [(9, 4), (8, 4), (5, 1), (3, 12)])
def test_two_phase_equals_direct_outputs_and_grads(num_layers: int, block: int) -> None:
    """Mathematical equality in fp64 (1e-12); each fp32 form within the derived bound of the fp64 one.

    (The fp32 forms are not compared element-wise with each other: a gradient entry that is a sum of
    cancelling terms has a large relative error in both, and which entry depends on the CPU kernels.)
    """
    torch.manual_seed(1)
    w = torch.randn(2, 5, 16, dtype=torch.float64)
    attn, emb, weights = _setup(num_layers, block, dtype=torch.float64)
    direct = _outputs_and_grads(attn, emb, weights, False, w)
    two = _outputs_and_grads(attn, emb, weights, True, w)
    for name, ref in direct.items():
        assert_equal_f64(two[name], ref, f"{name}: two-phase vs direct")
    attn32, emb32, weights32 = _setup(num_layers, block)
    for two_phase in (False, True):
        got = _outputs_and_grads(attn32, emb32, weights32, two_phase, w.float())
        for name, ref in direct.items():
            assert got[name].dtype == torch.float32
            c = _growth(num_layers, emb.shape[-1], backward=name != "out")
            assert_near_reference(got[name], ref, c, f"fp32 {'two-phase' if two_phase else 'direct'} {name}")


def test_fp64_comparison_catches_an_error_below_fp32_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression for the fp64 check itself: a phase-2 key normalized with a different eps (2e-5 instead
    of 1e-5) changes the result by only a few fp32 ulps, inside the fp32 bound, yet fails in fp64."""
    torch.manual_seed(1)
    w = torch.randn(2, 5, 16, dtype=torch.float64)
    attn, emb, weights = _setup(9, 4, dtype=torch.float64)
    direct = _outputs_and_grads(attn, emb, weights, False, w)

    def merge_with_wrong_eps(state, index, partial, query, eps):  # noqa: ANN001, ANN202
        return merge_partial(state, index, partial, query, 2 * eps)

    monkeypatch.setattr(attnres, "merge_partial", merge_with_wrong_eps)
    buggy = _outputs_and_grads(attn, emb, weights, True, w)
    err = normwise_err(buggy["out"], direct["out"])
    assert 1e3 * F64_RTOL < err < _growth(9, 16) * eps(torch.float32), err
    with pytest.raises(AssertionError, match="float64 normwise relative difference"):
        assert_equal_f64(buggy["out"], direct["out"], "out")


def test_online_merge_equals_softmax_over_all_sources() -> None:
    """Online-softmax merge == one softmax over all sources: fp64 to 1e-12, fp32 within ``c = 4 d``
    (two length-``d`` reductions and at most N + 1 = 4 rescaled terms per output, no depth)."""
    torch.manual_seed(1)
    q = torch.randn(3, 8, dtype=torch.float64) * 3
    finished = [torch.randn(2, 4, 8, dtype=torch.float64) * s for s in (1.0, 10.0, 0.1)]
    partial = torch.randn(2, 4, 8, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        fin, par = [f.to(dtype) for f in finished], partial.to(dtype)
        state = inter_block_pass(q.to(dtype), fin, 1e-5)
        for i in range(3):
            for extra in ([par], []):
                merged = merge_partial(state, i, par if extra else None, q[i].to(dtype), 1e-5)
                ref = mix(q[i], finished + ([partial] if extra else []), 1e-5)
                if dtype == torch.float64:
                    assert_equal_f64(merged, ref, f"query {i}, partial={bool(extra)}")
                else:
                    assert_near_reference(merged, ref, 4 * 8, f"fp32 query {i}, partial={bool(extra)}")


def test_zero_init_queries_mix_uniformly() -> None:
    attn = BlockAttnRes(8, 3, 2, 1e-5)
    sources = [torch.randn(1, 3, 8, dtype=torch.float64) for _ in range(3)]
    assert_equal_f64(mix(attn.queries[0], sources, 1e-5), sum(sources) / 3, "zero-query mix vs mean")


def test_block_structure() -> None:
    attn = BlockAttnRes(8, 9, 4, 1e-5)
    assert attn.block_ranges() == [range(0, 4), range(4, 8), range(8, 9)]
    assert [attn.block_of(i) for i in range(9)] == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [attn.is_block_end(i) for i in range(9)] == [False, False, False, True, False, False, False, True, True]
    k3 = BlockAttnRes(4, 93, 12, 1e-5)
    assert len(k3.block_ranges()) == 8 and len(k3.block_ranges()[-1]) == 9  # 7 full + a 9-layer block
    with pytest.raises(ValueError, match="block_size"):
        BlockAttnRes(8, 9, 0, 1e-5)
    with pytest.raises(ValueError, match="at least one source"):
        mix(torch.zeros(8), [], 1e-5)
