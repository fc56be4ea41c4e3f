"""GLU activations: SiTU-GLU and the SwiGLU baseline (K3_SYSTEMS §5.2), elementwise and in fp32.

SiTU-GLU soft-caps both GLU factors::

    cap_b(x) = b * tanh(x / b)
    SiTU-GLU(gate, up) = [cap_{b1}(gate) * sigmoid(gate)] * cap_{b2}(up),   b1 = 4, b2 = 25

so every output coordinate is bounded by ``b1 * b2 = 100`` however large the pre-activations
grow, while near zero ``cap_b(x) ~ x`` and it matches SwiGLU ``silu(gate) * up``. Used by the
model's FFNs (``moonrt.model.ffn``) and by the routed experts (:mod:`moonrt.ops.grouped`, which the
model and the EP runtime share): written once, here.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

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
    dt = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(dt)
    return soft_cap(g, beta) * torch.sigmoid(g) * soft_cap(up.to(dt), linear_beta)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` in fp32 (``[..., F]`` -> ``[..., F]`` fp32, fp64 stays), the uncapped baseline."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    dt = torch.promote_types(gate.dtype, torch.float32)
    return F.silu(gate.to(dt)) * up.to(dt)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float = 4.0,
                   linear_beta: float = 25.0) -> torch.Tensor:
    """Dispatch on ``act``: ``"situ"`` -> :func:`situ_glu`, ``"silu"`` -> :func:`swiglu`; fp32 out."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act = {act!r}: expected 'situ' or 'silu'")
