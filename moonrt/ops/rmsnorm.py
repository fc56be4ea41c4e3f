"""RMSNorm as one autograd node (K3_SYSTEMS §1): ``y = x / sqrt(mean(x^2) + eps) * weight`` over the last
dimension, computed in ``promote(x.dtype, float32)`` and returned in ``x``'s dtype.

The node saves the input as given and the fp32 reciprocal RMS ``r [..., 1]`` (plus the weight, a parameter)
and recomputes the normed ``x * r`` in backward, as fused norm kernels do (Kimi K2 recomputes its norms,
K3_SYSTEMS §8). Composed from torch ops, autograd would also save an fp32 copy of the input (bf16 runs), the
normed tensor and an fp32 copy of the weight. The forward is the composed expression in the same order
(bitwise); gradients equal autograd's of the composed form up to rounding (tests: fp64 gradcheck and
equality, fp32 within a bound of the ``D``-long reductions). The module every model's norms use (the
``weight`` parameter and its checks around :func:`rms_norm`) is :class:`moonrt.parallel.decoder.RMSNorm`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` any float dtype, ``weight [D]`` -> ``[..., D]`` in ``x.dtype`` (fp32 math; fp64 stays)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)}, expected [{x.shape[-1]}] (x's last dim)")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps={eps!r}, expected a positive number")
    return _RMSNorm.apply(x, weight, float(eps))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(dt)
        r = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return (x32 * r * weight.to(dt)).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, r, weight = ctx.saved_tensors
        dt = r.dtype
        y = x.to(dt) * r
        g = grad.to(dt)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (g * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            dy = g * weight.to(dt)  # d/dx [x r] = r (dy - y mean(dy y)), r = (mean(x^2) + eps)^(-1/2)
            d_x = (r * (dy - y * (dy * y).mean(dim=-1, keepdim=True))).to(x.dtype)
        return d_x, d_weight, None
