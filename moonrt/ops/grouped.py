"""Routed experts as tensor math (K3_SYSTEMS §5.1-5.2): one GLU expert, the grouped-expert op and the
MoE reference, written once for the model and the expert-parallel runtime.

- :func:`glu_expert`: one expert ``down(act(x W_g^T, x W_u^T))`` on rows ``x [n, H]``.
- :func:`grouped_glu_experts`: rows sorted by expert and bounded by ``cu_seqlens [G + 1]``, segment
  ``i`` through expert ``i`` of stacked ``[G, ...]`` weights (the "grouped GEMM" that follows a
  dispatch). Used by ``RoutedExperts.forward`` (:mod:`moonrt.models.k3.model.moe`, every dispatcher) and by
  the MoonEP tests and benchmarks on home and slot rows.
- :func:`moe_reference`: ``out[t] = sum_j w[t, j] * Expert_{ids[t, j]}(x[t])`` with all ``E``
  experts and no dispatcher, the oracle of the local MoE layer and of MoonEP dispatch / combine.

Dtype rule (all three): compute in ``dt = promote(x.dtype, float32)``: inputs and weights are cast
to ``dt``, both matmuls and the GLU run in ``dt`` (bf16 / fp16 experts compute in fp32, fp64 stays
fp64), and expert outputs are returned in ``dt``. :func:`moe_reference` sums the k weighted expert
outputs in ``dt`` with j ascending and casts the sum to ``x.dtype`` once.

Shapes: ``H`` the expert input/output width (the latent width L in LatentMoE), ``F`` the expert
FFN width; weights in ``nn.Linear`` layout: ``w_gate [F, H]``, ``w_up [F, H]``, ``w_down [H, F]``
per expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from moonrt.ops.glu import Activation, glu_activation, glu_parts
from moonrt.ops.precision import no_autocast
from moonrt.ops.qat import QATScheme, fake_quantize_values

StackedWeight = torch.Tensor | Sequence[torch.Tensor | None]
"""One expert tensor for every segment: a ``[G, ...]`` stack, or a length-G sequence of per-expert
tensors (views of different stacks, e.g. home experts and prefetched slots; ``None`` for a segment
that has no expert here and must be empty)."""


def glu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               act: Activation = "situ", beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """One GLU expert: ``x [n, H]``, ``w_gate [F, H]``, ``w_up [F, H]``, ``w_down [H, F]`` -> ``[n, H]``.

    Computed in ``promote(x.dtype, float32)`` and returned in it (module docstring); ``act`` is
    ``"situ"`` (SiTU-GLU with caps ``beta``, ``linear_beta``) or ``"silu"`` (SwiGLU).
    """
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt)
    h = glu_activation(x @ w_gate.to(dt).t(), x @ w_up.to(dt).t(), act, beta, linear_beta)
    return h.to(dt) @ w_down.to(dt).t()


def _per_segment(w: StackedWeight, groups: int, name: str) -> Sequence[torch.Tensor | None]:
    if isinstance(w, torch.Tensor):
        if w.dim() < 1 or w.shape[0] != groups:
            raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [G = {groups}, ...] (one expert per segment)")
        return w.unbind(0)  # one gradient node for the stack, not one full-size gradient per segment
    if len(w) != groups:
        raise ValueError(f"{name}: {len(w)} per-segment tensors, expected G = {groups} (one per segment)")
    return w


def grouped_glu_experts(x: torch.Tensor, cu_seqlens: torch.Tensor, w_gate: StackedWeight, w_up: StackedWeight,
                        w_down: StackedWeight, act: Activation = "situ", beta: float = 4.0,
                        linear_beta: float = 25.0, qat: QATScheme | None = None) -> torch.Tensor:
    """Grouped expert compute: rows ``x [rows, H]`` grouped by ``cu_seqlens [G + 1]`` (int64,
    non-decreasing, within ``[0, rows]``); rows ``cu[i]:cu[i + 1]`` run through expert ``i``:
    ``glu_expert(rows, w_gate[i], w_up[i], w_down[i])``.

    Weights: ``[G, F, H]``, ``[G, F, H]``, ``[G, H, F]`` stacks or per-segment sequences
    (:data:`StackedWeight`; every expert used has the same ``F``). Returns ``[rows, H]`` in
    ``promote(x.dtype, float32)``; rows outside every segment (padding) are 0. Differentiable in ``x`` and
    every weight used.

    One autograd node for all segments (the readable grouped GEMM; a fused kernel would replace the loops):
    the gate / up matmuls of every non-empty segment write one ``[n, F]`` buffer each, the GLU runs once on
    them (:func:`moonrt.ops.glu.glu_parts`), the down matmuls write the output rows. It saves ``x`` as given,
    the GLU output and its two derivative factors (``[n, F]`` each, ``n = cu[G] - cu[0]``) and the weights:
    four activations however many experts, where a loop of per-expert autograd ops saves seven per expert
    (and fp32 copies of bf16 weights).

    ``qat`` (:class:`moonrt.ops.qat.QATScheme`): quantization-aware training. Every GEMM reads fake-quantized
    operands: the weights in ``qat.weight_format`` (MXFP4) and its inputs, ``x`` and the GLU output, in
    ``qat.act_format`` (MXFP8), all blocked along the GEMM's reduction axis (``H`` for gate / up, ``F`` for
    down), with straight-through gradients (the weight gradients are the products with the quantized inputs,
    the input gradients flow through the quantizers unchanged). The node then saves the quantized ``x``, GLU
    output and weights instead of the originals (the same sizes).
    """
    bounds = cu_seqlens.tolist()
    rows = x.shape[0]
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [rows, H]")
    if not bounds or bounds[0] < 0 or bounds[-1] > rows or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: {bounds[:8]}..., expected non-decreasing bounds within [0, {rows}]")
    groups = len(bounds) - 1
    ws = [_per_segment(w, groups, name) for w, name in ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down"))]
    hidden = None
    for i in range(groups):
        if bounds[i + 1] == bounds[i]:
            continue
        g, u, d = (w[i] for w in ws)
        if g is None or u is None or d is None:
            raise ValueError(f"segment {i} has {bounds[i + 1] - bounds[i]} rows but no expert weights were given "
                             "for it")
        if hidden is None:
            hidden = g.shape[0]
        if not (g.shape == u.shape == (hidden, x.shape[1]) and d.shape == (x.shape[1], hidden)):
            raise ValueError(f"segment {i}: expert weights {tuple(g.shape)}, {tuple(u.shape)}, {tuple(d.shape)}; "
                             f"expected [{hidden}, {x.shape[1]}], [{hidden}, {x.shape[1]}], [{x.shape[1]}, {hidden}] "
                             f"(the F of the first expert used)")
    if qat is not None and hidden is not None:
        qat.check_axis(x.shape[1], "the experts' gate / up projections (H)")
        qat.check_axis(hidden, "the experts' down projection (F)")
    flat = [w for per in ws for w in per]
    if torch.is_grad_enabled() and (x.requires_grad or any(w is not None and w.requires_grad for w in flat)):
        return _GroupedGLU.apply(x, bounds, act, float(beta), float(linear_beta), qat, *flat)
    if qat is not None:
        x, ws = _quantized_operands(x, bounds, ws, qat)
    return _grouped_forward(x, bounds, ws, act, beta, linear_beta, derivatives=False, qat=qat)[0]


def _quantized_operands(x: torch.Tensor, bounds: list[int], ws: list[Sequence[torch.Tensor | None]], qat: QATScheme
                        ) -> tuple[torch.Tensor, list[list[torch.Tensor | None]]]:
    """``x`` fake-quantized to the activation format and every used segment's weights to the weight format (no
    autograd: the values the QAT GEMMs read)."""
    return fake_quantize_values(x, qat.act_format, qat.block, qat.scale_mode), _quantized_weights(bounds, ws, qat)


def _quantized_weights(bounds: list[int], ws: Sequence[Sequence[torch.Tensor | None]], qat: QATScheme
                       ) -> list[list[torch.Tensor | None]]:
    """Every used segment's weights fake-quantized to the weight format (others as given; no autograd). A weight that
    is expert ``j`` of a stack (a ``[G, ...]`` tensor's ``select(0, j)``: the stacked parameters and their unbind) is
    read from the stack quantized once (bitwise the same: every block lies in one row of one expert)."""
    used = {i for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]}
    stacks: dict[int, torch.Tensor] = {}

    def quantized(w: torch.Tensor) -> torch.Tensor:
        base = w._base
        if (base is not None and base.dim() == w.dim() + 1 and base.shape[1:] == w.shape and base.is_contiguous()
                and w.is_contiguous() and (w.storage_offset() - base.storage_offset()) % base.stride(0) == 0):
            if id(base) not in stacks:
                stacks[id(base)] = fake_quantize_values(base, qat.weight_format, qat.block, qat.scale_mode)
            return stacks[id(base)][(w.storage_offset() - base.storage_offset()) // base.stride(0)]
        return fake_quantize_values(w, qat.weight_format, qat.block, qat.scale_mode)

    return [[quantized(w) if i in used and w is not None else w for i, w in enumerate(per)] for per in ws]


def _grouped_forward(x: torch.Tensor, bounds: list[int], ws: list[Sequence[torch.Tensor | None]], act: Activation,
                     beta: float, linear_beta: float, derivatives: bool, qat: QATScheme | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The output ``[rows, H]`` and, over rows ``cu[0]:cu[G]``, the GLU output and its factors ``dA``, ``dC``
    (the factors None without ``derivatives``; all three None when no row is routed). With ``qat``, ``x`` and
    ``ws`` are already fake-quantized (:func:`_quantized_operands`) and the GLU output is fake-quantized to the
    activation format before the down matmul (the returned GLU output is the quantized one)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    rows, width = x.shape
    lo, hi = bounds[0], bounds[-1]
    segs = [i for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
    if not segs:
        return x.new_zeros(rows, width, dtype=dt), None, None, None
    xs = x.to(dt)
    hidden = ws[0][segs[0]].shape[0]  # type: ignore[union-attr]
    gate = xs.new_empty(hi - lo, hidden)
    up = xs.new_empty(hi - lo, hidden)
    with torch.no_grad():
        for i in segs:
            a, b = bounds[i] - lo, bounds[i + 1] - lo
            xi = xs[lo + a:lo + b]
            torch.mm(xi, ws[0][i].to(dt).t(), out=gate[a:b])  # type: ignore[union-attr]
            torch.mm(xi, ws[1][i].to(dt).t(), out=up[a:b])  # type: ignore[union-attr]
        h, d_a, d_c = glu_parts(gate, up, act, beta, linear_beta, derivatives)
        if qat is not None:
            h = fake_quantize_values(h, qat.act_format, qat.block, qat.scale_mode)
        out = (x.new_zeros if lo > 0 or hi < rows else x.new_empty)(rows, width, dtype=dt)
        for i in segs:
            a, b = bounds[i], bounds[i + 1]
            torch.mm(h[a - lo:b - lo], ws[2][i].to(dt).t(), out=out[a:b])  # type: ignore[union-attr]
    return out, h, d_a, d_c


class _GroupedGLU(torch.autograd.Function):
    """:func:`grouped_glu_experts` as one node: ``forward(x, bounds, act, beta, linear_beta, qat, *weights)`` with
    the ``3 G`` per-segment weights flattened (gates, ups, downs; None for a segment that has none). With ``qat``
    it saves the fake-quantized ``x`` and GLU output in place of the originals (the same sizes) and the weights as
    given (parameters: no copy), quantizing them again in backward: the products are the straight-through ones,
    and no layer holds a quantized weight copy from its forward to its backward (only one layer's, transiently)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], act: Activation, beta: float, linear_beta: float,
                qat: QATScheme | None, *flat: torch.Tensor | None) -> torch.Tensor:
        groups = len(bounds) - 1
        ws = [flat[j * groups:(j + 1) * groups] for j in range(3)]
        if qat is not None:
            x, ws = _quantized_operands(x, bounds, ws, qat)
        out, h, d_a, d_c = _grouped_forward(x, bounds, ws, act, beta, linear_beta, derivatives=True, qat=qat)
        del ws
        ctx.bounds, ctx.qat = bounds, qat
        ctx.save_for_backward(x, h, d_a, d_c, *flat)
        return out

    @staticmethod
    @once_differentiable
    @no_autocast  # its matmuls pick their dtype (at least fp32) also when backward runs in an autocast region
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, h, d_a, d_c, *flat = ctx.saved_tensors
        bounds = ctx.bounds
        groups = len(bounds) - 1
        if ctx.qat is not None:  # the weights the forward multiplied (bitwise: the same quantizer)
            flat = [w for per in _quantized_weights(bounds, [flat[j * groups:(j + 1) * groups] for j in range(3)],
                                                    ctx.qat) for w in per]
        need = ctx.needs_input_grad
        d_flat: list[torch.Tensor | None] = [None] * (3 * groups)
        d_x = None
        if h is None:  # no routed row: the output was all zeros
            return (torch.zeros_like(x) if need[0] else None), None, None, None, None, None, *d_flat
        dt = h.dtype
        lo = bounds[0]
        xs = x.to(dt)
        g = grad.to(dt)
        segs = [i for i in range(groups) if bounds[i + 1] > bounds[i]]
        d_h = torch.empty_like(h)
        for i in segs:
            a, b = bounds[i], bounds[i + 1]
            w_down = flat[2 * groups + i]
            torch.mm(g[a:b], w_down.to(dt), out=d_h[a - lo:b - lo])
            if need[6 + 2 * groups + i]:
                d_flat[2 * groups + i] = (g[a:b].t() @ h[a - lo:b - lo]).to(w_down.dtype)
        d_gate = d_h * d_a
        d_up = d_h.mul_(d_c)
        if need[0]:
            d_x = torch.zeros_like(xs)
        for i in segs:
            a, b = bounds[i], bounds[i + 1]
            w_gate, w_up = flat[i], flat[groups + i]
            dg, du, xi = d_gate[a - lo:b - lo], d_up[a - lo:b - lo], xs[a:b]
            if need[6 + i]:
                d_flat[i] = (dg.t() @ xi).to(w_gate.dtype)
            if need[6 + groups + i]:
                d_flat[groups + i] = (du.t() @ xi).to(w_up.dtype)
            if d_x is not None:
                torch.mm(dg, w_gate.to(dt), out=d_x[a:b])
                d_x[a:b].addmm_(du, w_up.to(dt))
        return (d_x.to(x.dtype) if d_x is not None else None), None, None, None, None, None, *d_flat


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, act: Activation = "situ", beta: float = 4.0,
                  linear_beta: float = 25.0) -> torch.Tensor:
    """Reference routed-expert mixture: ``out[t] = sum_j topk_weights[t, j] * Expert_{topk_ids[t, j]}(x[t])``.

    Args:
        x: ``[s, H]`` float tokens.
        topk_ids: ``[s, k]`` int64 expert ids in ``[0, E)``.
        topk_weights: ``[s, k]`` float gate values.
        w_gate, w_up, w_down: all ``E`` experts, ``[E, F, H]``, ``[E, F, H]``, ``[E, H, F]``.

    Returns ``[s, H]`` in ``x.dtype``: each expert on its tokens with :func:`glu_expert`, the k
    weighted outputs summed in ``promote(x.dtype, float32)`` (j ascending), one cast at the end.
    Plain indexing and a loop over the experts used, sharing no code with any dispatcher; differentiable
    in every input (the oracle for gradients too).
    """
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe_reference: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}; expected [s, H], [s, k], [s, k]")
    dt = torch.promote_types(x.dtype, torch.float32)
    s, k = topk_ids.shape
    y = x.new_zeros(s, k, x.shape[1], dtype=dt)
    for e in torch.unique(topk_ids).tolist():
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        y = y.index_put((t, j), glu_expert(x[t], w_gate[e], w_up[e], w_down[e], act, beta, linear_beta))
    w = topk_weights.to(dt)
    out = y[:, 0] * w[:, :1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j:j + 1]
    return out.to(x.dtype)
