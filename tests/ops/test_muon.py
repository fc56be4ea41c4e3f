"""Muon math (moonrt.ops.muon): equal to torch.optim.Muon on whole matrices, per-head and per-expert blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonrt.ops.muon import (
    Muon,
    adjusted_lr,
    block_view,
    from_blocks,
    to_blocks,
    zeropower_via_newtonschulz,
)


@dataclasses.dataclass(frozen=True)
class Spec:
    stack_dims: int = 0
    head_dim: int | None = None
    axis: int = 0


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> None:
    for step in range(steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("adjust", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_whole_matrix_equals_torch_muon(adjust: str | None, nesterov: bool) -> None:
    """Same params and grads, 3 steps, fp32 params: moonrt Muon (bf16 NS like torch) == torch.optim.Muon."""
    shapes = [(48, 32), (32, 80), (64, 64)]
    ref, mine = _params(shapes), _params(shapes)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov, "adjust_lr_fn": adjust}
    _run(torch.optim.Muon(ref, **kw), ref, 3)
    _run(Muon(mine, ns_dtype="bfloat16", **kw), mine, 3)
    for r, m in zip(ref, mine):
        assert torch.allclose(m, r, rtol=1e-6, atol=0), (m - r).abs().max()


def test_fp32_newton_schulz_matches_float64() -> None:
    """fp32 NS (the CPU default) vs the same iteration in float64: within fp32 rounding of 5 steps."""
    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(1))
    x32 = zeropower_via_newtonschulz(g, dtype=torch.float32)
    x64 = zeropower_via_newtonschulz(g.double(), dtype=torch.float64)
    assert (x32.double() - x64).abs().max() < 1e-4 * x64.abs().max()
    s = torch.linalg.svdvals(x64)  # the quintic's fixed band: singular values pushed into ~(0.5, 1.5)
    assert s.min() > 0.3 and s.max() < 1.3


def test_batched_equals_per_block() -> None:
    g = torch.randn(6, 16, 40, generator=torch.Generator().manual_seed(2))
    batched = zeropower_via_newtonschulz(g, dtype=torch.float64)
    single = torch.stack([zeropower_via_newtonschulz(x, dtype=torch.float64) for x in g])
    assert torch.allclose(batched, single, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec,shape", [(Spec(0, 8, 0), (32, 12)), (Spec(0, 4, 1), (6, 16)),
                                        (Spec(1, None, 0), (3, 5, 7)), (Spec(1, 2, 0), (3, 4, 5))])
def test_blocks_round_trip(spec: Spec, shape: tuple[int, ...]) -> None:
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    blocks = to_blocks(t, spec)
    assert torch.equal(from_blocks(blocks, spec, shape), t)
    for k in range(blocks.shape[0]):
        assert torch.equal(block_view(t, spec, k), blocks[k])


def test_one_head_equals_whole_matrix_bitwise() -> None:
    shapes = [(48, 32), (32, 80)]
    whole, heads = _params(shapes), _params(shapes)
    kw = {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw"}
    _run(Muon(whole, **kw), whole, 3)
    _run(Muon(heads, blocks={heads[0]: Spec(0, 48, 0), heads[1]: Spec(0, 80, 1)}, **kw), heads, 3)
    for w, h in zip(whole, heads):
        assert torch.equal(w, h)


def test_per_expert_equals_separate_matrices() -> None:
    """A stacked [E, a, b] parameter with stack_dims 1 == E separate 2-D parameters (float64 NS)."""
    (stacked,) = _params([(3, 12, 20)])
    parts = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(3)]
    kw = {"lr": 0.02, "adjust_lr_fn": "original", "ns_dtype": "float64"}
    opt_s = Muon([stacked], blocks={stacked: Spec(1, None, 0)}, **kw)
    opt_p = Muon(parts, **kw)
    for step in range(2):
        g = _grads([stacked], step)[0]
        stacked.grad = g.clone()
        for e, p in enumerate(parts):
            p.grad = g[e].clone()
        opt_s.step()
        opt_p.step()
    assert torch.allclose(stacked.detach(), torch.stack([p.detach() for p in parts]), rtol=1e-12, atol=1e-12)


def test_per_head_balances_a_loud_head() -> None:
    """One head's gradient x100: whole-matrix Muon gives that head almost the whole update; per-head
    Muon gives every head a comparable update norm (each head's block is orthogonalized on its own).

    The gradient is a weight gradient of a batch of T = 4 tokens, ``dY^T X`` (rank <= T, as in training);
    head 0's output gradients ``dY[:, head 0]`` are scaled 100x. Whole-matrix NS spends the rank on the
    loud head's directions; the quiet heads get what is left.
    """
    heads, hd, d, tokens = 4, 8, 32, 4
    gen = torch.Generator().manual_seed(3)
    dy, x = torch.randn(tokens, heads * hd, generator=gen), torch.randn(tokens, d, generator=gen)
    dy[:, :hd] *= 100.0
    grad = dy.T @ x
    whole, per_head = _params([(heads * hd, d)]), _params([(heads * hd, d)])
    before = whole[0].detach().clone()
    kw = {"lr": 0.01, "weight_decay": 0.0, "adjust_lr_fn": "match_rms_adamw"}
    for p, opt in ((whole[0], Muon(whole, **kw)), (per_head[0], Muon(per_head, blocks={per_head[0]: Spec(0, hd, 0)},
                                                                                   **kw))):
        p.grad = grad.clone()
        opt.step()

    def head_norms(p: torch.Tensor) -> torch.Tensor:
        return (p.detach() - before).reshape(heads, hd, d).norm(dim=(1, 2))

    nw, nh = head_norms(whole[0]), head_norms(per_head[0])
    assert nw[0] > 10 * nw[1:].max()  # whole matrix: the loud head dominates the update
    assert nh.max() < 1.5 * nh.min()  # per head: every head moves by a comparable amount
    assert nh[0] < 2 * nh[1:].min()  # ... and the loud head no longer dominates


def test_adamw_group_equals_torch_adamw() -> None:
    shapes = [(16,), (10, 6)]
    ref, mine = _params(shapes), _params(shapes)
    _run(torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8), ref, 3)
    _run(Muon([{"params": mine, "use_muon": False}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95)), mine, 3)
    for r, m in zip(ref, mine):
        assert torch.equal(r, m)


def test_adjusted_lr_rules() -> None:
    assert adjusted_lr(1.0, "original", 8, 2) == 2.0
    assert adjusted_lr(1.0, None, 2, 8) == 1.0
    assert adjusted_lr(1.0, "match_rms_adamw", 16, 4) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="adjust_lr_fn = 'x'"):
        adjusted_lr(1.0, "x", 2, 2)


def test_bad_blocking_is_one_clear_error() -> None:
    (p,) = _params([(30, 8)])
    with pytest.raises(ValueError, match="head_dim = 7: expected a positive divisor"):
        Muon([p], blocks={p: Spec(0, 7, 0)})
    (q,) = _params([(2, 3, 4)])
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\): expected 0 stacked dims"):
        Muon([q])
