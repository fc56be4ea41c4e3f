"""Document packing (moonrt/parallel/packing.py): a packed batch's per-document outputs and gradients equal each
document run alone, for the KDA layer, the MLA layer and the whole k3_tiny model; the unpacked run of the
same rows does not (so the comparison sees a leak); bad packings and unsupported combinations fail clearly.

Tolerances (tests/numerics.py): packed vs alone computes one exact function two ways in fp32 (different chunk
and row layouts of the same sums), so :func:`assert_same_function` with each layer's error-growth constant.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from numerics import assert_same_function, growth

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.kda_layer import KDACache, KDALayer
from moonrt.models.k3.model.mla import GatedMLA
from moonrt.models.k3.model.model import K3Model
from moonrt.parallel.context import AttentionContext
from moonrt.parallel.packing import DocumentPacking

# Two rows of 80 tokens: documents of 1 and 2 tokens (shorter than the conv kernel), one longer than a KDA
# chunk (64), and a row that is a single document.
LENGTHS = [[5, 1, 70, 2, 2], [80]]


def _docs(x: torch.Tensor, lengths: list[list[int]]) -> list[torch.Tensor]:
    """``x [B, T, ...]`` -> each document as its own ``[1, n, ...]`` sequence, row by row."""
    out = []
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            out.append(x[b:b + 1, start:start + n])
            start += n
    return out


def _check_layer(layer: torch.nn.Module, c: int, c_grad: int) -> None:
    """Packed outputs and input/parameter gradients of ``layer`` equal the documents run alone."""
    packing = DocumentPacking.from_lengths(LENGTHS)
    D = 128
    x = torch.randn(2, 80, D, requires_grad=True)
    w = torch.randn(2, 80, D)
    y = layer(x, packing=packing)
    grads = torch.autograd.grad((y * w).sum(), [x, *layer.parameters()])
    pieces = [piece.detach().clone().requires_grad_(True) for piece in _docs(x, LENGTHS)]
    alone = [layer(piece) for piece in pieces]
    loss = sum((o * wd).sum() for o, wd in zip(alone, _docs(w, LENGTHS), strict=True))
    grads_alone = torch.autograd.grad(loss, [*pieces, *layer.parameters()])
    for i, (got, ref) in enumerate(zip(_docs(y, LENGTHS), alone, strict=True)):
        assert_same_function(got, ref, c, f"output of document {i}")
    for i, (got, ref) in enumerate(zip(_docs(grads[0], LENGTHS), grads_alone[:len(pieces)], strict=True)):
        assert_same_function(got, ref, c_grad, f"d x of document {i}")
    names = [n for n, _ in layer.named_parameters()]
    for name, got, ref in zip(names, grads[1:], grads_alone[len(pieces):], strict=True):
        assert_same_function(got, ref, c_grad, f"d {name}")
    # the same rows unpacked: later documents see earlier ones (what the packing prevents)
    leaked = _docs(layer(x), LENGTHS)
    assert not torch.allclose(leaked[2], alone[2], rtol=1e-3, atol=1e-5)


def test_packing_offsets_positions_and_masks() -> None:
    p = DocumentPacking.from_lengths([[2, 3], [1, 4]])
    assert p.cu_seqlens.tolist() == [0, 2, 5, 6, 10]
    assert p.positions.tolist() == [[0, 1, 0, 1, 2], [0, 0, 1, 2, 3]]
    m = p.attention_mask()[1, 0]
    assert m.tolist()[2] == [False, True, True, False, False]  # token 2 of row 1 sees tokens 1..2 only
    assert p.conv_valid(2)[0, :, 0].tolist() == [False, False, False, False, True]
    assert DocumentPacking.from_doc_ids(torch.tensor([[7, 7, 9, 9, 9]])).cu_seqlens.tolist() == [0, 2, 5]


def test_packing_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="expected non-decreasing"):
        DocumentPacking.from_doc_ids(torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match=r"expected a \[B, T\] integer tensor"):
        DocumentPacking.from_doc_ids(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one common sum"):
        DocumentPacking.from_lengths([[2, 3], [4]])


def test_kda_layer_packed_equals_documents_alone() -> None:
    torch.manual_seed(0)
    layer = KDALayer(k3_tiny())
    with torch.no_grad():  # larger weights than the init so every path matters
        for p in (layer.qkv_proj.weight, layer.g_proj.weight, layer.b_proj.weight, layer.f_a_proj.weight):
            p.mul_(5.0)
    la = layer.config.linear_attn_config
    # chain: projections (D), short conv (kernel), q/k norms (K), the recurrence over 80 tokens of K-long
    # dot products, the output gate and projection (H * K)
    chain = [layer.hidden_size, la.short_conv_kernel_size, la.head_dim, 80, la.head_dim, la.num_heads * la.head_dim]
    _check_layer(layer, growth(chain), growth(chain, backward=True))


def test_mla_layer_packed_equals_documents_alone() -> None:
    torch.manual_seed(1)
    layer = GatedMLA(k3_tiny())
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(std=0.1)
    q_lora = layer.q_b_proj.in_features
    chain = [layer.q_a_proj.in_features, q_lora, q_lora, layer.nope + layer.rope, 80, layer.o_proj.in_features]
    _check_layer(layer, growth(chain), growth(chain, backward=True))


def _model_growth(model: K3Model, t: int, backward: bool = False) -> int:
    """The whole forward's chain (as tests/model/test_model.py): per layer two AttnRes mixes (D), attention
    (D, head dim, t, heads x head dim), FFN (D, intermediate); then the final mix and LM head (D)."""
    cfg = model.config
    d, la = cfg.hidden_size, cfg.linear_attn_config
    per_layer = [d, d, la.head_dim, t, la.num_heads * la.head_dim, d, cfg.intermediate_size]
    return growth(per_layer * cfg.num_hidden_layers + [d, d], backward)


def test_model_packed_logits_and_gradients_equal_documents_alone() -> None:
    """k3_tiny's first 4 layers (KDA and MLA, dense FFN and LatentMoE, Block AttnRes): logits of every document and the
    parameter gradients of the summed loss equal those of the documents run alone."""
    torch.manual_seed(2)
    model = K3Model(dataclasses.replace(k3_tiny(), num_hidden_layers=4))  # KDA + dense, KDA + MoE, MLA + MoE
    assert {"kda", "mla"} <= set(model.config.layer_types()) and model.moe_layers()
    with torch.no_grad():  # non-zero pseudo-queries so AttnRes is not a uniform average
        model.attn_res.queries.normal_(std=0.5)
        model.attn_res.final_query.normal_(std=0.5)
    packing = DocumentPacking.from_lengths(LENGTHS)
    tokens = torch.randint(0, model.config.vocab_size, (2, 80))
    targets = torch.randint(0, model.config.vocab_size, (2, 80))
    logits = model(tokens, packing=packing)
    loss = model.loss_sum(tokens, targets, packing=packing)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    docs = list(zip(_docs(tokens, LENGTHS), _docs(targets, LENGTHS), strict=True))
    c, c_grad = _model_growth(model, 80), _model_growth(model, 80, backward=True)
    for i, ((tok, _), got) in enumerate(zip(docs, _docs(logits, LENGTHS), strict=True)):
        assert_same_function(got, model(tok), c, f"logits of document {i}")
    loss_alone = sum(model.loss_sum(tok, tgt) for tok, tgt in docs)
    grads_alone = torch.autograd.grad(loss_alone, list(model.parameters()), allow_unused=True)
    assert_same_function(loss.detach(), loss_alone.detach(), c, "summed loss")
    for (name, _), got, ref in zip(model.named_parameters(), grads, grads_alone, strict=True):
        assert (got is None) == (ref is None), name
        if got is not None:
            assert_same_function(got, ref, c_grad, f"d {name}")
    assert not torch.allclose(_docs(model(tokens), LENGTHS)[2], _docs(logits, LENGTHS)[2], rtol=1e-3, atol=1e-5)


def test_loss_ignores_masked_targets() -> None:
    torch.manual_seed(3)
    model = K3Model(dataclasses.replace(k3_tiny(), num_hidden_layers=2))
    tokens = torch.randint(0, 256, (1, 9))
    targets = torch.randint(0, 256, (1, 9))
    masked = targets.clone()
    masked[0, 4] = -100
    with torch.no_grad():
        logits = model(tokens)
        full = torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="none")
        got = model.loss_sum(tokens, masked)
    assert_same_function(got, full.sum() - full[4], growth([9]), "loss without target 4")


def test_packing_refuses_cache_context_and_shape() -> None:
    layer = KDALayer(k3_tiny())
    packing = DocumentPacking.from_lengths([[3, 4]])
    x = torch.randn(1, 7, layer.hidden_size)
    with pytest.raises(ValueError, match="packing with a KDACache"):
        layer(x, cache=KDACache.empty(layer.config, 1), packing=packing)

    class Other(AttentionContext):
        pass

    with pytest.raises(ValueError, match="do not travel through context parallelism"):
        layer(x, ctx=Other(), packing=packing)
    with pytest.raises(ValueError, match=r"expected \(1, 6\)"):
        GatedMLA(k3_tiny())(x[:, :6], packing=packing)
