"""K3Model assembly (K3_SYSTEMS §1-5): structure and names, fp32 logits/loss, causality, AttnRes modes,
the pipeline-stage API, routing statistics and Quantile Balancing hooks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_same_function, growth

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.kda_layer import KDALayer
from moonrt.models.k3.model.mla import GatedMLA
from moonrt.models.k3.model.model import K3Model
from moonrt.ops.kda import kda_chunk
from moonrt.parallel.context import AttentionContext


def _model(seed: int = 0, **changes) -> K3Model:
    torch.manual_seed(seed)
    model = K3Model(dataclasses.replace(k3_tiny(), **changes) if changes else k3_tiny())
    with torch.no_grad():  # non-zero pseudo-queries so AttnRes is not a uniform average
        model.attn_res.queries.normal_(std=0.5)
        model.attn_res.final_query.normal_(std=0.5)
    return model


def _growth(model: K3Model, t: int, backward: bool = False) -> int:
    """Error-growth constant (tests/numerics.py) of the whole forward on ``t`` tokens: per decoder layer
    two AttnRes mixes (D each), the attention chain (D in-projection, head-dim scores, a t-term causal
    sum, the heads' out-projection) and the FFN chain (D, the dense intermediate size, the largest);
    then the final mix and the LM head (D)."""
    cfg = model.config
    d, la = cfg.hidden_size, cfg.linear_attn_config
    per_layer = [d, d, la.head_dim, t, la.num_heads * la.head_dim, d, cfg.intermediate_size]
    return growth(per_layer * cfg.num_hidden_layers + [d, d], backward)


def test_structure_and_stable_names() -> None:
    cfg = k3_tiny()
    model = _model()
    assert cfg.pattern == "KKKMKKKMM"
    names = dict(model.named_modules())
    for i, kind in enumerate(cfg.layer_types()):
        assert isinstance(names[f"layers.{i}.attn"], KDALayer if kind == "kda" else GatedMLA)
        assert (f"layers.{i}.moe" in names) == (i >= cfg.first_k_dense_replace)
        assert (f"layers.{i}.ffn" in names) == (i < cfg.first_k_dense_replace)
    assert {"embed", "attn_res", "norm", "lm_head"} <= set(names)


def test_logits_loss_and_causality() -> None:
    model = _model()
    tokens = torch.randint(0, 256, (2, 20))
    logits = model(tokens)
    assert logits.shape == (2, 20, 256) and logits.dtype == torch.float32
    targets = torch.randint(0, 256, (2, 20))
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), reduction="sum")
    torch.testing.assert_close(model.loss_sum(tokens, targets), expected)
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 256, (2, 8))
    # equal up to fp32 rounding of the chunked KDA kernel (whose tiles also hold the later tokens)
    out = model(changed)
    assert_same_function(out[:, :12], logits[:, :12], _growth(model, 20), "logits before the change")
    assert not torch.allclose(out[:, 12:], logits[:, 12:])


def test_two_phase_attnres_equals_direct_in_the_model() -> None:
    model = _model(1)
    tokens = torch.randint(0, 256, (2, 12))
    # exact equality of the two AttnRes forms is tested in float64 in test_attnres.py; here the wiring
    assert_same_function(model(tokens, two_phase=True), model(tokens), _growth(model, 12), "logits")


def test_stages_compose_to_the_full_forward() -> None:
    model = _model(2)
    tokens = torch.randint(0, 256, (1, 8))
    full = model(tokens)
    for n, align in ((3, False), (2, True)):
        stages = model.stages(n, align_to_blocks=align)
        assert [i for r in stages for i in r] == list(range(9))
        if align:
            assert all(model.attn_res.is_block_start(r.start) for r in stages)
        state = model.embed_tokens(tokens)
        for r in stages:
            state = model.run_layers(state, r)
        torch.testing.assert_close(model.head(state), full)
    assert [list(r) for r in model.stages(2, align_to_blocks=True)] == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    with pytest.raises(ValueError, match="num_stages = 4"):
        model.stages(4, align_to_blocks=True)
    with pytest.raises(ValueError, match="num_stages = 10"):
        model.stages(10)


def test_routing_counts_and_bias_update() -> None:
    cfg = k3_tiny()
    model = _model(3)
    tokens = torch.randint(0, 256, (2, 16))
    model.train()
    model.loss_sum(tokens, tokens).backward()
    counts = model.routing_counts()
    assert sorted(counts) == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    assert all(int(c.sum()) == 2 * 16 * cfg.num_experts_per_token for c in counts.values())
    before = [moe.router.bias.clone() for _, moe in model.moe_layers()]
    calls = []
    stats = model.update_routing_bias(all_reduce=lambda t: calls.append(t.shape))
    assert len(calls) == len(before) and sorted(stats) == sorted(counts)
    after = [moe.router.bias for _, moe in model.moe_layers()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    for b in after:
        assert abs(float(b.mean())) < 1e-5  # QB centers the bias
    # bias changes selection only: logits depend on it only through routing, and gradients never reach it
    assert all(b.grad is None for b in after)
    model.set_record_routing(False)
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert all(int(s.sum()) == 0 for _, m in model.moe_layers() for s in [m.step_counts])


def test_tied_embeddings_and_bad_tokens() -> None:
    model = _model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    with pytest.raises(ValueError, match="vocab_size = 256"):
        model(torch.tensor([[0, 256]]))
    with pytest.raises(ValueError, match="expected \\[B, T\\] int64"):
        model(torch.zeros(2, 3))


class _Recorder(AttentionContext):
    """Fake 2-slice context parallelism: slice 0 records what slice 1 needs, slice 1 replays it.

    Per attention call (in layer order): the KDA state leaving slice 0, the last pre-conv tokens
    (the conv halo), and the MLA latent of slice 0. Nothing is detached, so gradients cross slices.
    """

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []
        self.halos: list[torch.Tensor] = []
        self.latents: list[torch.Tensor] = []
        self.replay = False

    def kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):  # noqa: ANN001
        if self.replay:
            return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=self.states.pop(0))
        o, s = kda_chunk(q, k, v, g, beta, scale=scale, output_final_state=True)
        self.states.append(s)
        return o, None

    def conv_prefix(self, x: torch.Tensor, width: int) -> torch.Tensor:
        if self.replay:
            return self.halos.pop(0)
        self.halos.append(x[:, -width:])
        return x.new_zeros(x.shape[0], width, x.shape[2])

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.replay:
            prev = self.latents.pop(0)
            return torch.cat([prev, x], dim=1), prev.shape[1]
        self.latents.append(x)
        return x, 0


def test_model_touches_other_slices_only_through_the_context() -> None:
    """Two sequence slices run through the context seam == the full sequence (outputs and gradients)."""
    model = _model(4)
    tokens = torch.randint(0, 256, (1, 22))
    full = model(tokens)
    w = torch.randn_like(full)
    params = [p for p in model.parameters() if p.requires_grad]
    g_full = torch.autograd.grad((full * w).sum(), params, allow_unused=True)
    ctx = _Recorder()
    y0 = model(tokens[:, :10], ctx=ctx)
    ctx.replay = True
    y1 = model(tokens[:, 10:], ctx=ctx)
    assert not (ctx.states or ctx.halos or ctx.latents)  # every recorded item replayed once
    assert_same_function(torch.cat([y0, y1], 1), full, _growth(model, 22), "logits")
    loss = (y0 * w[:, :10]).sum() + (y1 * w[:, 10:]).sum()
    g_split = torch.autograd.grad(loss, params, allow_unused=True)
    for p_name, a, b in zip([n for n, p in model.named_parameters() if p.requires_grad], g_split, g_full):
        if b is None:
            assert a is None or not a.any(), p_name
            continue
        assert_same_function(a, b, _growth(model, 22, backward=True), f"d {p_name}")
