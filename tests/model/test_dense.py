"""The dense baseline model client (``moonrt.models.dense.model``): config, parameter count, a naive float64 reference,
the stage API and the real pipeline executor, context parallelism (a fake gather seam in one process, and
ContextParallel on 2 gloo ranks), packed documents, Muon blocks, and a short training sanity run.

Tolerances (tests/numerics.py): fp32 results are held to a normwise bound ``c * eps(fp32)`` against a float64
run, with ``c`` the sum of the reduction lengths along the longest chain (:func:`_growth`); two float64 runs
of mathematically equal computations (split vs whole sequence, packed vs separate documents, the model vs
the naive loops) to ``1e-12`` normwise.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import dist_run
from numerics import assert_equal_f64, assert_near_reference, assert_same_function, growth, rel_l2

from moonrt.comm.cp.context import ContextParallel
from moonrt.comm.pp.executor import PipelineExecutor
from moonrt.comm.pp.cache import block_plan
from moonrt.comm.pp.part import PipelineParallel
from moonrt.config import ConfigError, from_dict, to_dict
from moonrt.models.dense.model.config import PRESETS, DenseConfig, dense_tiny
from moonrt.models.dense.model.model import DenseModel
from moonrt.models.dense.model.params import count_params, stage_sizes
from moonrt.ops.muon import block_grid
from moonrt.parallel.blocks import WHOLE, MatrixBlocks, matrix_blocks
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.model import PipelineLayout, TrainableModel, missing_members
from moonrt.parallel.packing import DocumentPacking
from moonrt.scheduler.attnres_comm import hop_plan
from moonrt.scheduler.pipeline import Action, build_schedule


def _cfg(**kw: Any) -> DenseConfig:
    """A small config whose attention is far from uniform (init std 0.15: scores O(1)) and whose rotary turns
    fast (base 100), so masks and positions matter; H * hd = D here, but nothing assumes it."""
    base = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=3,
                head_dim=16, rope_theta=100.0, initializer_range=0.15)
    return DenseConfig(**{**base, **kw})


def _model(seed: int = 0, **kw: Any) -> DenseModel:
    torch.manual_seed(seed)
    model = DenseModel(_cfg(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial norm weights
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _growth(cfg: DenseConfig, t: int, backward: bool = False) -> int:
    """Error-growth constant of the logits: per layer RMSNorm (D), q/kv projections (D), scores (hd), softmax
    and value sum (t keys), o_proj (H hd), RMSNorm (D), gate/up (D), down (F); then the final norm and the LM
    head (D each)."""
    d = cfg.hidden_size
    per_layer = [d, d, cfg.head_dim, t, cfg.num_attention_heads * cfg.head_dim, d, d, cfg.intermediate_size]
    return growth(per_layer * cfg.num_hidden_layers + [d, d], backward)


def _tokens(b: int, t: int, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---- the naive reference --------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, pos: list[int], theta: float) -> torch.Tensor:
    """``x [T, hd]``: pair ``(j, j + hd/2)`` of token ``t`` turned by ``pos[t] * theta ** (-2 j / hd)``."""
    hd = x.shape[1]
    half = hd // 2
    rows = []
    for t in range(x.shape[0]):
        first, second = [], []
        for j in range(half):
            a = pos[t] * theta ** (-2.0 * j / hd)
            c, s = math.cos(a), math.sin(a)
            first.append(x[t, j] * c - x[t, j + half] * s)
            second.append(x[t, j + half] * c + x[t, j] * s)
        rows.append(torch.stack(first + second))
    return torch.stack(rows)


def _naive(model: DenseModel, tokens: torch.Tensor, docs: list[list[int]] | None = None) -> torch.Tensor:
    """Logits ``[B, T, V]`` by explicit loops from the equations: a sequential residual ``h = h + sub-layer``,
    per head and per query a softmax over the keys ``s <= t`` of the query's document (``docs[b][t]``: document
    index; None: one document), rotary at the position within the document."""
    c = model.config
    H, hd, eps = c.num_attention_heads, c.head_dim, c.rms_norm_eps
    B, T = tokens.shape
    out = []
    for b in range(B):
        doc = docs[b] if docs is not None else [0] * T
        pos = [sum(doc[s] == doc[t] for s in range(t)) for t in range(T)]
        h = model.embed.weight[tokens[b]]
        for layer in model.layers:
            a = layer.attn
            x = _rms(h, layer.attn_norm.weight, eps)
            q, kv = x @ a.q_proj.weight.T, x @ a.kv_proj.weight.T
            heads = []
            for i in range(H):
                qh, kh, vh = q[:, i * hd:(i + 1) * hd], kv[:, i * hd:(i + 1) * hd], kv[:, (H + i) * hd:(H + i + 1) * hd]
                if c.rope_theta is not None:
                    qh, kh = _rotate(qh, pos, c.rope_theta), _rotate(kh, pos, c.rope_theta)
                rows = []
                for t in range(T):
                    keys = [s for s in range(t + 1) if doc[s] == doc[t]]
                    p = torch.softmax(torch.stack([qh[t] @ kh[s] for s in keys]) / math.sqrt(hd), 0)
                    rows.append(sum(p[j] * vh[s] for j, s in enumerate(keys)))
                heads.append(torch.stack(rows))
            h = h + torch.cat(heads, -1) @ a.o_proj.weight.T
            f = layer.ffn
            x = _rms(h, layer.ffn_norm.weight, eps)
            h = h + (F.silu(x @ f.gate_proj.weight.T) * (x @ f.up_proj.weight.T)) @ f.down_proj.weight.T
        out.append(_rms(h, model.norm.weight, eps) @ model.lm_head.weight.T)
    return torch.stack(out)


# ---- config and parameters ------------------------------------------------------------------------


def test_preset_config_roundtrip_and_validation() -> None:
    cfg = PRESETS["dense_tiny"]()
    cfg.validate()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (256, 128, 4)
    assert cfg.pipeline_layout() == PipelineLayout(num_layers=cfg.num_hidden_layers, width=cfg.hidden_size,
                                                   block_size=cfg.num_hidden_layers)
    assert not cfg.tie_word_embeddings
    assert from_dict(DenseConfig, to_dict(cfg)) == cfg
    bad = [({"head_dim": 15}, "head_dim = 15: expected an even integer"),
           ({"num_hidden_layers": 0}, "num_hidden_layers = 0: expected an integer >= 1"),
           ({"rope_theta": -1.0}, "rope_theta = -1.0: expected a finite number > 1"),
           ({"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0: expected a finite number > 0"),
           ({"num_attention_heads": 2.5}, "num_attention_heads = 2.5: expected an integer >= 1")]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            DenseModel(dataclasses.replace(_cfg(), **change))
        with pytest.raises(ConfigError, match=message.split(" = ")[0]):
            from_dict(DenseConfig, {**to_dict(_cfg()), **change})
    DenseModel(_cfg(head_dim=15, rope_theta=None))  # NoPE: any head width


@pytest.mark.parametrize("change", [{}, {"tie_word_embeddings": True}, {"rope_theta": None},
                                    {"num_attention_heads": 5, "head_dim": 6, "intermediate_size": 7}])
def test_param_count_equals_numel(change: dict[str, Any]) -> None:
    for cfg in (dataclasses.replace(dense_tiny(), **change), _cfg(**change)):
        model = DenseModel(cfg)
        counts = count_params(cfg)
        assert counts.total == sum(p.numel() for p in model.parameters())
        assert counts.per_layer == sum(p.numel() for p in model.layers[0].parameters())
        embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        assert counts.active == counts.total - embed
        sizes = stage_sizes(cfg)
        assert sum(sizes["layers"]) + sizes["embed"] + sizes["lm_head"] == counts.total
        assert len(sizes["layers"]) == len(sizes["expert"]) == cfg.num_hidden_layers and not any(sizes["expert"])
    assert count_params(dense_tiny()).total == 918_656


def test_module_names_and_muon_blocks() -> None:
    model = _model()
    names = {n for n, _ in model.named_modules()}
    assert {"embed", "layers.2.attn", "layers.2.attn_norm", "layers.2.ffn", "layers.2.ffn_norm", "norm",
            "lm_head"} <= names
    blocks = matrix_blocks(model)
    hd = model.config.head_dim
    for i in range(3):
        assert blocks[f"layers.{i}.attn.q_proj.weight"] == MatrixBlocks(head_dim=hd)
        assert blocks[f"layers.{i}.attn.kv_proj.weight"] == MatrixBlocks(head_dim=hd)
        for n in ("attn.o_proj", "ffn.gate_proj", "ffn.up_proj", "ffn.down_proj"):
            assert blocks[f"layers.{i}.{n}.weight"] == WHOLE
    assert not any("norm" in n or n.startswith("embed") for n in blocks)
    params = dict(model.named_parameters())
    H = model.config.num_attention_heads
    assert block_grid(params["layers.0.attn.q_proj.weight"].shape, blocks["layers.0.attn.q_proj.weight"]) == (
        1, H, hd, 48)
    assert block_grid(params["layers.0.attn.kv_proj.weight"].shape, blocks["layers.0.attn.kv_proj.weight"]) == (
        1, 2 * H, hd, 48)
    assert model.moe_layers() == [] and model.routing_counts() == {}
    assert model.update_routing_bias(all_reduce=lambda t: pytest.fail("no collective expected")) == {}
    model.set_record_routing(False)


# ---- numerics against the naive reference ----------------------------------------------------------


@pytest.mark.parametrize("rope", [100.0, None])
def test_forward_and_grads_match_naive_float64_reference(rope: float | None) -> None:
    """fp32 model vs the naive loops in float64 (same parameters): logits and every gradient within the
    derived normwise bound; the float64 model equals the loops to 1e-12 (a wrong equation gives O(1))."""
    model = _model(rope_theta=rope)
    T = 12
    tokens = _tokens(2, T)
    logits = model(tokens)
    assert logits.shape == (2, T, 64) and logits.dtype == torch.float32
    model64 = copy.deepcopy(model).double()
    ref = _naive(model64, tokens)
    assert_equal_f64(model64(tokens), ref, "float64 model vs naive loops")
    assert_near_reference(logits, ref, _growth(model.config, T), "logits")
    w = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad((logits * w.float()).sum(), list(model.parameters()))
    grads_ref = torch.autograd.grad((ref * w).sum(), list(model64.parameters()))
    for (name, _), g, gr in zip(model.named_parameters(), grads, grads_ref, strict=True):
        assert_near_reference(g, gr, _growth(model.config, T, backward=True), f"d {name}")


def test_loss_sum_ignores_minus_100_and_model_is_causal() -> None:
    model = _model()
    x, y = _tokens(2, 10), _tokens(2, 10, seed=2)
    y_masked = y.clone()
    y_masked[0, 3:] = -100
    logits = model(x)
    ref = F.cross_entropy(logits[0, :3], y[0, :3], reduction="sum") + F.cross_entropy(logits[1], y[1],
                                                                                          reduction="sum")
    torch.testing.assert_close(model.loss_sum(x, y_masked), ref, rtol=1e-6, atol=0)
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 64
    changed = model(x2)
    assert torch.equal(changed[:, :6], logits[:, :6])  # same ops on the unchanged prefix: bitwise
    assert not torch.allclose(changed[:, 6:], logits[:, 6:])


# ---- the stage API and the pipeline executor -------------------------------------------------------


def test_stages_compose_to_the_full_forward_and_backward() -> None:
    """Stages run one after the other on fresh leaves (what crosses a pipeline hop: block 0 and the partial
    sum) give the full forward bitwise (same ops, same order) and, with the leaves' gradients sent back, the
    full gradients (only the embedding's / partial's gradient sums are reordered)."""
    model = _model()
    L = model.config.num_hidden_layers
    x = _tokens(2, 9)
    full = model(x)
    w = torch.randn_like(full)
    g_full = torch.autograd.grad((full * w).sum(), list(model.parameters()))
    assert model.pipeline_layout() == PipelineLayout(num_layers=L, width=48, block_size=L)
    assert isinstance(model, TrainableModel) and missing_members(model) == []
    for n in range(1, L + 1):
        ranges = model.stages(n)
        assert [i for r in ranges for i in r] == list(range(L))
        state = model.embed_tokens(x)
        hops = []  # (sent tensors, received leaves) per hop
        for s, r in enumerate(ranges):
            if s:
                leaves = [t.detach().requires_grad_(True) for t in [state.blocks[0], state.partial]]
                hops.append(([state.blocks[0], state.partial], leaves))
                state = model.stream([leaves[0]], leaves[1])
            state = model.run_layers(state, r)
            if s < n - 1:
                assert len(state.blocks) == 1 and state.partial is not None  # block open at every cut
        assert len(state.blocks) == 2 and state.partial is None  # the last layer closed block 1
        logits = model.head(state)
        assert torch.equal(logits, full), n
        params = list(model.parameters())
        grads = [torch.zeros_like(p) for p in params]
        outs, out_grads = [(logits * w).sum()], [None]
        for sent, leaves in [*reversed(hops), (None, None)]:
            inputs = params + (leaves or [])
            got = torch.autograd.grad(outs, inputs, out_grads, allow_unused=True)
            grads = [a + (b if b is not None else 0) for a, b in zip(grads, got[:len(params)], strict=True)]
            if sent is not None:
                outs, out_grads = sent, list(got[len(params):])
        for (name, _), g, gr in zip(model.named_parameters(), grads, g_full, strict=True):
            assert_same_function(g, gr, _growth(model.config, 9, backward=True), f"{n} stages: d {name}")
    assert model.stages(1, align_to_blocks=True) == [range(0, L)]
    with pytest.raises(ValueError, match="num_stages = 2: expected 1..1"):
        model.stages(2, align_to_blocks=True)
    with pytest.raises(ValueError, match="num_stages = 4: expected 1..3"):
        model.stages(4)
    assert model.stage_modules(range(1, 2), False, True) == ["layers.1", "norm", "lm_head"]
    assert model.stage_modules(range(0, 1), True, False) == ["layers.0", "embed"]
    with pytest.raises(ValueError, match="already closed"):
        model.run_layers(model.run_layers(model.embed_tokens(x), range(L)), range(L - 1, L))


@pytest.mark.parametrize("mode", ["cached", "naive"])
def test_real_pipeline_executor_in_one_process_equals_the_model(mode: str) -> None:
    """The runtime's PipelineExecutor with every stage on one rank (same-rank hops, no communication) and two
    micro-batches: loss and gradients of the single-process model. Its block plan (from
    ``pipeline_layout().block_size``) matches the stream: block 0 from stage 0, block 1 closed by the last stage,
    a partial at every cut."""
    model = _model()
    L = model.config.num_hidden_layers
    x, y = _tokens(4, 8), _tokens(4, 8, seed=3)
    scale = 1.0 / y.numel()
    ref_model = copy.deepcopy(model)
    ref = ref_model.loss_sum(x, y) * scale
    ref.backward()
    ranges = model.stages(L)
    plan = block_plan(ranges, model.pipeline_layout().block_size, lambda s: 0, mode)
    assert plan.produced == ((0,), (), (1,)) and plan.partial_in == (False, True, True)
    actions = [Action("F", m, c) for m in range(2) for c in range(L)]
    actions += [Action("B", m, c) for m in range(2) for c in reversed(range(L))]
    ex = PipelineExecutor(model, plan, actions, rank=0, rank_of=lambda s: 0, stage_of=lambda c: c, group=None,
                          params_of=lambda s: [p for n in model.stage_modules(ranges[s], s == 0, s == L - 1)
                                               for p in model.get_submodule(n).parameters()])
    loss = ex.run(list(x.chunk(2)), list(y.chunk(2)), scale, model.config.hidden_size, torch.float32)
    assert abs(float(loss) - float(ref.detach())) <= 1e-6 * float(ref.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert rel_l2(p.grad, q.grad) <= 1e-5, name  # micro-batch sums reordered (see test_pp_executor)


RUNS = [("1f1b", 1, 2, "cached"), ("interleaved", 2, 2, "cached"), ("zb", 2, 4, "naive")]


def _pp_rank(rank: int, world: int, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for kind, vpp, m, mode in RUNS:
        model = DenseModel(_cfg(num_hidden_layers=4))
        model.load_state_dict(state)
        part = PipelineParallel(build_schedule(kind, world, m, vpp), group=dist.group.WORLD, rank=rank, mode=mode)
        model = part.parallelize(model)
        x, y = _tokens(4, 8), _tokens(4, 8, seed=3)
        loss = part.forward_backward(model, x, y, 1.0 / y.numel())
        part.sync_grads(model)
        out.append({"loss": float(loss), "blocks": part.executor.stats.blocks_sent,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}})
    return out


def test_pipeline_parallel_on_two_ranks_equals_the_model() -> None:
    """``PipelineParallel`` (the runtime's pp part, unchanged) on 2 gloo ranks: 1F1B, interleaved (4 stages,
    vpp 2) and zero-bubble; every rank's loss and the union of the ranks' gradients equal the single process."""
    model = _model(num_hidden_layers=4)
    state = model.state_dict()
    x, y = _tokens(4, 8), _tokens(4, 8, seed=3)
    ref = model.loss_sum(x, y) / y.numel()
    ref.backward()
    ref = ref.detach()
    results = dist_run(_pp_rank, 2, state, timeout=300)
    for i, run in enumerate(RUNS):
        seen = set()
        for rank in range(2):
            r = results[rank][i]
            assert abs(r["loss"] - float(ref)) <= 1e-5 * float(ref), run
            for n, g in r["grads"].items():
                assert rel_l2(g, dict(model.named_parameters())[n].grad) <= 1e-5, (run, n)
                seen.add(n)
        assert seen == {n for n, _ in model.named_parameters()}, run
        # the blocks sent are the hop plan's for a block of L layers: block 0 (the embedding) only; cached: once
        # per micro-batch to the rank that lacks it, naive: on every cross-rank hop
        kind, vpp, m, mode = run
        sched = build_schedule(kind, 2, m, vpp)
        plan = hop_plan(model.stages(sched.num_stages), model.pipeline_layout().block_size, sched.rank_of, mode)
        assert all(ids in ((), (0,)) for ids in plan.sends)
        assert sum(results[rank][i]["blocks"] for rank in range(2)) == m * plan.total, run
        if mode == "cached":
            assert plan.total == 1


# ---- context parallelism ---------------------------------------------------------------------------


class _Recording(AttentionContext):
    """Slice 0 of a sequence: keeps every gathered ``[k | v]`` (graph tensors), in call (= layer) order."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.seen.append(x)
        return x, 0


class _Prefixed(AttentionContext):
    """Slice 1: each call returns the recorded slice-0 ``[k | v]`` of the same layer prepended, and its offset
    (what ContextParallel's all-gather returns; the gradient flows back into slice 0's graph)."""

    def __init__(self, prefixes: list[torch.Tensor]) -> None:
        self.prefixes = list(prefixes)

    def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        prefix = self.prefixes.pop(0)
        return torch.cat([prefix, x], dim=1), prefix.shape[1]


def _split_run(model: DenseModel, x: torch.Tensor, w: torch.Tensor, cut: int) -> tuple[torch.Tensor, list]:
    rec = _Recording()
    y0 = model(x[:, :cut], ctx=rec)
    y1 = model(x[:, cut:], ctx=_Prefixed(rec.seen))
    logits = torch.cat([y0, y1], dim=1)
    return logits, list(torch.autograd.grad((logits * w).sum(), list(model.parameters())))


@pytest.mark.parametrize("rope", [100.0, None])
def test_two_slices_through_gather_sequence_equal_the_whole_sequence(rope: float | None) -> None:
    """Split at an uneven cut, slice 1 sees slice 0 only through ``gather_sequence``: logits and every parameter
    gradient equal the whole-sequence run (float64: 1e-12; fp32: the derived bound)."""
    T, cut = 14, 5
    for dtype in (torch.float64, torch.float32):
        model = _model(rope_theta=rope).to(dtype)
        x = _tokens(2, T)
        full = model(x)
        w = torch.randn(full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(full.dtype)
        g_full = torch.autograd.grad((full * w).sum(), list(model.parameters()))
        logits, grads = _split_run(model, x, w, cut)
        names = [n for n, _ in model.named_parameters()]
        if dtype == torch.float64:
            assert_equal_f64(logits, full, "logits")
            for n, g, gr in zip(names, grads, g_full, strict=True):
                assert_equal_f64(g, gr, f"d {n}")
        else:
            assert_same_function(logits, full, _growth(model.config, T), "logits")
            for n, g, gr in zip(names, grads, g_full, strict=True):
                assert_same_function(g, gr, _growth(model.config, T, backward=True), f"d {n}")


def test_gather_rejects_a_short_or_malformed_sequence() -> None:
    model = _model()

    class Short(AttentionContext):
        def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x, 3

    class Narrow(AttentionContext):
        def gather_sequence(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x[..., :-1], 0

    with pytest.raises(ValueError, match="gathered sequence length 4 < offset 3"):
        model(_tokens(1, 4), ctx=Short())
    with pytest.raises(ValueError, match=r"gathered \[k \| v\] shape \(1, 4, 95\): expected \[1, S, 96\]"):
        model(_tokens(1, 4), ctx=Narrow())


def _cp_rank(rank: int, world: int, state: dict[str, torch.Tensor], x: torch.Tensor,
             w: torch.Tensor) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = DenseModel(_cfg())
    model.load_state_dict(state)
    ctx = ContextParallel(None)
    logits = model(ctx.slice(x), ctx=ctx)
    (logits * ctx.slice(w)).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "gather_sent": ctx.log.by_op()["gather"]["fwd_sent"]}


def test_context_parallel_on_two_ranks_equals_the_whole_sequence() -> None:
    """``ContextParallel`` (the runtime's CP context, unchanged) on 2 gloo ranks, 15 tokens: the slices' logits
    and the summed gradients equal the single process (fp32, relative RMS 1e-5: a few hundred ulps)."""
    model = _model()
    x = _tokens(2, 15)
    w = torch.randn(2, 15, 64, generator=torch.Generator().manual_seed(6))
    full = model(x)
    (full * w).sum().backward()
    res = dist_run(_cp_rank, 2, model.state_dict(), x, w, timeout=300)
    assert rel_l2(torch.cat([r["logits"] for r in res], dim=1), full.detach()) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_l2(res[0]["grads"][n] + res[1]["grads"][n], p.grad) <= 1e-5, n
    kv_row = 2 * 3 * 16 * 4  # [k | v] of one token in fp32: the only tensor a layer gathers
    assert [r["gather_sent"] for r in res] == [3 * 2 * 7 * kv_row, 3 * 2 * 8 * kv_row]  # 3 layers x B=2 x slice


# ---- packed documents ------------------------------------------------------------------------------


def test_packed_documents_equal_documents_run_alone() -> None:
    """Rows ``[3, 6, 3]`` and ``[12]`` tokens: each document's logits and its share of the gradients equal the
    document run alone (float64: 1e-12), and the float64 packed run equals the naive loops with document masks
    and restarted rotary positions; fp32 within the derived bound."""
    lengths = [[3, 6, 3], [12]]
    docs = [[i for i, n in enumerate(row) for _ in range(n)] for row in lengths]
    for dtype in (torch.float64, torch.float32):
        model = _model().to(dtype)
        packing = DocumentPacking.from_lengths(lengths)
        x = _tokens(2, 12)
        w = torch.randn(2, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(dtype)
        packed = model(x, packing=packing)
        g_packed = torch.autograd.grad((packed * w).sum(), list(model.parameters()))
        alone, loss = [], 0
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                y = model(x[b:b + 1, start:start + n])
                alone.append((y, packed[b:b + 1, start:start + n]))
                loss = loss + (y * w[b:b + 1, start:start + n]).sum()
                start += n
        g_alone = torch.autograd.grad(loss, list(model.parameters()))
        names = [n for n, _ in model.named_parameters()]
        if dtype == torch.float64:
            assert_equal_f64(packed, _naive(model, x, docs), "packed vs naive")
            for i, (y, p) in enumerate(alone):
                assert_equal_f64(p, y, f"document {i}")
            for n, g, gr in zip(names, g_packed, g_alone, strict=True):
                assert_equal_f64(g, gr, f"d {n}")
        else:
            for i, (y, p) in enumerate(alone):
                assert_same_function(p, y, _growth(model.config, 12), f"document {i}")
            for n, g, gr in zip(names, g_packed, g_alone, strict=True):
                assert_same_function(g, gr, _growth(model.config, 12, backward=True), f"d {n}")
    with pytest.raises(ValueError, match=r"expected \(1, 12\)"):
        model(x[:1], packing=packing)
    with pytest.raises(ValueError, match="single-device AttentionContext"):
        model(x, ctx=_Recording(), packing=packing)


# ---- bad input and training ------------------------------------------------------------------------


def test_bad_tokens_are_rejected() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"expected \[0, vocab_size = 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"expected \[B, T\] int64"):
        model(torch.zeros(2, 3))
    assert model(torch.tensor([[1, 2]], dtype=torch.int32), ctx=LOCAL).shape == (1, 2, 64)


def test_tied_embeddings_share_the_table() -> None:
    model = DenseModel(_cfg(tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    model(_tokens(1, 5)).sum().backward()
    assert model.embed.weight.grad is not None


def test_loss_falls_when_training_dense_tiny_on_a_fixed_batch() -> None:
    """Sanity: 40 AdamW steps on one fixed batch of dense_tiny cut its mean loss well below the start
    (~ln 256 = 5.5 nats at init; a model that cannot learn stays there)."""
    torch.manual_seed(0)
    model = DenseModel(dense_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = _tokens(4, 33, vocab=256, seed=8)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(40):
        loss = model.loss_sum(x, y) / y.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert abs(losses[0] - math.log(256)) < 0.1
    assert losses[-1] < 0.2 * losses[0], losses  # measured: 5.57 -> 0.02
