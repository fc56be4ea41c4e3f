"""GLU activations: SiTU-GLU and the SwiGLU baseline (K3_SYSTEMS §5.2), elementwise and in fp32.

SiTU-GLU soft-caps both GLU factors::

    cap_b(x) = b * tanh(x / b)
    SiTU-GLU(gate, up) = [cap_{b1}(gate) * sigmoid(gate)] * cap_{b2}(up),   b1 = 4, b2 = 25

so every output coordinate is bounded by ``b1 * b2 = 100`` however large the pre-activations
grow, while near zero ``cap_b(x) ~ x`` and it matches SwiGLU ``silu(gate) * up``. Used by the
model's FFNs (``moonrt.model.ffn``) and by the routed experts (:mod:`moonrt.ops.grouped`, which the
model and the EP runtime share): written once, here.

Both GLUs are one autograd node that saves only its two inputs (as given, before the fp32 cast) and
recomputes the element-wise factors in backward (K3_SYSTEMS §8: "element-wise operators are
recomputed"; Megatron's fused SwiGLU does the same). Composed from torch ops, autograd would save
six ``[..., F]`` fp32 intermediates of SiTU-GLU (three of SwiGLU). The forward is the same
expression in the same order (bitwise the composed form); gradients equal autograd's of the composed
form up to fp32 rounding (tests: fp64 gradcheck, fp32 against the composed form).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Activation = Literal["situ", "silu"]


def soft_cap(x: torch.Tensor, b: float) -> torch.Tensor:
    """``cap_b(x) = b * tanh(x / b)``: identity near zero, bounded by ``b`` in magnitude."""
    return b * torch.tanh(x / b)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU (K3_SYSTEMS §5.2), computed in fp32 (fp64 inputs stay fp64).

    Args:
        gate: ``[..., F]`` any float dtype, the gate pre-activation ``x W_g^T``.
        up: ``[..., F]`` same shape, the linear pre-activation ``x W_u^T``.
        beta: ``b1``, the cap of the gate factor ``cap_{b1}(gate)`` (K3: 4).
        linear_beta: ``b2``, the cap of the linear factor ``cap_{b2}(up)`` (K3: 25).

    Returns:
        ``[..., F]`` fp32 (fp64 for fp64 input), ``cap_{b1}(gate) * sigmoid(gate) * cap_{b2}(up)``;
        ``|out| <= b1 * b2``.
    """
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    if not (beta > 0 and linear_beta > 0):
        raise ValueError(f"situ_glu: beta={beta!r}, linear_beta={linear_beta!r}, expected positive numbers")
    return _SiTUGLU.apply(gate, up, float(beta), float(linear_beta))


def _situ_factors(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cap_{b1}(g), sigmoid(g), tanh(g / b1), tanh(u / b2))`` in ``promote(gate.dtype, float32)``."""
    dt = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(dt)
    tg = torch.tanh(g / beta)
    tu = torch.tanh(up.to(dt) / linear_beta)
    return beta * tg, torch.sigmoid(g), tg, tu


class _SiTUGLU(torch.autograd.Function):
    """SiTU-GLU as one node: saves ``gate`` and ``up`` only (module docstring)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.caps = (beta, linear_beta)
        cap_g, sig, _, tu = _situ_factors(gate, up, beta, linear_beta)
        return cap_g * sig * (linear_beta * tu)  # soft_cap(g, b1) * sigmoid(g) * soft_cap(u, b2), same order

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        gate, up = ctx.saved_tensors
        beta, linear_beta = ctx.caps
        cap_g, sig, tg, tu = _situ_factors(gate, up, beta, linear_beta)
        act = cap_g * sig  # d/dg [cap(g) sig(g)] = (1 - tanh^2(g / b1)) sig(g) + cap(g) sig(g) (1 - sig(g))
        d_gate = grad * (linear_beta * tu) * ((1 - tg * tg) * sig + act * (1 - sig))
        d_up = grad * act * (1 - tu * tu)  # d/du cap(u) = 1 - tanh^2(u / b2)
        return d_gate.to(gate.dtype), d_up.to(up.dtype), None, None


class _SwiGLU(torch.autograd.Function):
    """SwiGLU as one node: saves ``gate`` and ``up`` only (module docstring)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        dt = torch.promote_types(gate.dtype, torch.float32)
        return F.silu(gate.to(dt)) * up.to(dt)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        dt = torch.promote_types(gate.dtype, torch.float32)
        g = gate.to(dt)
        sig = torch.sigmoid(g)
        d_gate = grad * up.to(dt) * (sig * (1 + g * (1 - sig)))  # d/dg g sigmoid(g)
        d_up = grad * (g * sig)
        return d_gate.to(gate.dtype), d_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` in fp32 (``[..., F]`` -> ``[..., F]`` fp32, fp64 stays), the uncapped baseline."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return _SwiGLU.apply(gate, up)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float = 4.0,
                   linear_beta: float = 25.0) -> torch.Tensor:
    """Dispatch on ``act``: ``"situ"`` -> :func:`situ_glu`, ``"silu"`` -> :func:`swiglu`; fp32 out."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act = {act!r}: expected 'situ' or 'silu'")
