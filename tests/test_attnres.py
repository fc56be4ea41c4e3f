"""Block AttnRes (K3_SYSTEMS §4): direct form vs an explicit reference, two-phase == direct, block structure."""

from __future__ import annotations

import pytest
import torch

from moonrt.model.attnres import AttnResState, BlockAttnRes, inter_block_pass, merge_partial, mix


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


def _setup(num_layers: int = 9, block: int = 4, d: int = 16) -> tuple[BlockAttnRes, torch.Tensor, list]:
    torch.manual_seed(0)
    attn = BlockAttnRes(d, num_layers, block, 1e-5)
    with torch.no_grad():
        attn.queries.normal_(std=1.0)
        attn.final_query.normal_(std=1.0)
    emb = torch.randn(2, 5, d)
    weights = [torch.randn(d, d) / d**0.5 for _ in range(2 * num_layers)]
    return attn, emb, weights


def test_direct_matches_explicit_reference() -> None:
    attn, emb, weights = _setup()
    torch.testing.assert_close(_run(attn, emb, weights, False), _reference(attn, emb, weights), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_layers,block", [(9, 4), (8, 4), (5, 1), (3, 12)])
def test_two_phase_equals_direct_outputs_and_grads(num_layers: int, block: int) -> None:
    attn, emb, weights = _setup(num_layers, block)
    emb.requires_grad_(True)
    direct = _run(attn, emb, weights, False)
    two = _run(attn, emb, weights, True)
    torch.testing.assert_close(two, direct, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(direct)
    g_d = torch.autograd.grad((direct * w).sum(), [emb, attn.queries, attn.final_query])
    g_t = torch.autograd.grad((two * w).sum(), [emb, attn.queries, attn.final_query])
    for a, b in zip(g_t, g_d):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_online_merge_equals_softmax_over_all_sources() -> None:
    torch.manual_seed(1)
    q = torch.randn(3, 8) * 3
    finished = [torch.randn(2, 4, 8) * s for s in (1.0, 10.0, 0.1)]
    partial = torch.randn(2, 4, 8)
    state = inter_block_pass(q, finished, 1e-5)
    for i in range(3):
        torch.testing.assert_close(merge_partial(state, i, partial, q[i], 1e-5), mix(q[i], finished + [partial], 1e-5))
        torch.testing.assert_close(merge_partial(state, i, None, q[i], 1e-5), mix(q[i], finished, 1e-5))


def test_zero_init_queries_mix_uniformly() -> None:
    attn = BlockAttnRes(8, 3, 2, 1e-5)
    sources = [torch.randn(1, 3, 8) for _ in range(3)]
    torch.testing.assert_close(mix(attn.queries[0], sources, 1e-5), sum(sources) / 3)


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
