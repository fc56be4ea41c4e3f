"""GLU activations: SiTU-GLU and the SwiGLU baseline (K3_SYSTEMS §5.2), elementwise and in fp32.

SiTU-GLU soft-caps both GLU factors::

    cap_b(x) = b * tanh(x / b)
    SiTU-GLU(gate, up) = [cap_{b1}(gate) * sigmoid(gate)] * cap_{b2}(up),   b1 = 4, b2 = 25

so every output coordinate is bounded by ``b1 * b2 = 100`` however large the pre-activations
grow, while near zero ``cap_b(x) ~ x`` and it matches SwiGLU ``silu(gate) * up``. Used by the
model's FFNs (``moonrt.models.k3.model.ffn``) and by the routed experts (:mod:`moonrt.ops.grouped`, which the
model and the EP runtime share): written once, here.

Both are one autograd node. A GLU is ``h = A(gate) * C(up)``; the forward also computes the two
derivative factors ``dA = C(up) A'(gate)`` and ``dC = A(gate) C'(up)`` and saves only those, so the
backward is ``d_gate = d_h * dA``, ``d_up = d_h * dC``: two saved tensors instead of the six
intermediates (tanh and sigmoid outputs, both caps, their product) autograd saves for the composed
expression, and nothing recomputed (a node that saved gate / up and recomputed tanh and sigmoid in
backward made the CPU step 7% slower). Outputs are the composed expression's; gradients equal
autograd's of it up to fp32 rounding (tests: fp64 gradcheck and equality).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.autograd.function import once_differentiable

Activation = Literal["situ", "silu"]


def soft_cap(x: torch.Tensor, b: float) -> torch.Tensor:
    """``cap_b(x) = b * tanh(x / b)``: identity near zero, bounded by ``b`` in magnitude."""
    return b * torch.tanh(x / b)


def glu_parts(gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float = 4.0, linear_beta: float = 25.0,
              derivatives: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = A(gate) * C(up)`` and, with ``derivatives``, ``dA = C(up) A'(gate)`` and ``dC = A(gate) C'(up)``
    (else None): the GLU and its two derivative factors, from ``gate`` / ``up`` already in the compute dtype.
    No autograd (the callers' nodes use ``dA`` / ``dC`` in backward); ``"situ"``: ``A = cap_{beta}(g) sigmoid(g)``,
    ``C = cap_{linear_beta}(u)``; ``"silu"``: ``A = g sigmoid(g)``, ``C = u``."""
    with torch.no_grad():
        s = torch.sigmoid(gate)
        if act == "situ":
            t1 = torch.tanh(gate / beta)
            cap1 = t1 * beta
            a = cap1 * s
            t2 = torch.tanh(up / linear_beta)
            c = t2 * linear_beta
            h = a * c
            if not derivatives:
                return h, None, None
            # A' = s (cap1' + cap1 (1 - s)),  cap1' = 1 - t1^2;  C' = 1 - t2^2  (in place, few passes)
            d_a = torch.rsub(s, 1).mul_(cap1).addcmul_(t1, t1, value=-1).add_(1).mul_(s).mul_(c)
            d_c = torch.addcmul(a, a, t2.square_(), value=-1)
            return h, d_a, d_c
        if act == "silu":
            a = gate * s
            h = a * up
            if not derivatives:
                return h, None, None
            # A' = s (1 + g (1 - s)),  C' = 1
            d_a = torch.rsub(s, 1).mul_(gate).add_(1).mul_(s).mul_(up)
            return h, d_a, a
    raise ValueError(f"hidden_act = {act!r}: expected 'situ' or 'silu'")


def _check(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")


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
    _check("situ_glu", gate, up)
    if not (beta > 0 and linear_beta > 0):
        raise ValueError(f"situ_glu: beta={beta!r}, linear_beta={linear_beta!r}, expected positive numbers")
    return _glu(gate, up, "situ", float(beta), float(linear_beta))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` in fp32 (``[..., F]`` -> ``[..., F]`` fp32, fp64 stays), the uncapped baseline."""
    _check("swiglu", gate, up)
    return _glu(gate, up, "silu", 0.0, 0.0)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float = 4.0,
                   linear_beta: float = 25.0) -> torch.Tensor:
    """Dispatch on ``act``: ``"situ"`` -> :func:`situ_glu`, ``"silu"`` -> :func:`swiglu`; fp32 out."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act = {act!r}: expected 'situ' or 'silu'")


def _glu(gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float, linear_beta: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _GLU.apply(gate, up, act, beta, linear_beta)
    dt = torch.promote_types(gate.dtype, torch.float32)  # the node's forward without its factors: the same h
    return glu_parts(gate.to(dt), up.to(dt), act, beta, linear_beta, derivatives=False)[0]


class _GLU(torch.autograd.Function):
    """``h = A(gate) C(up)`` saving ``dA``, ``dC`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, act: Activation, beta: float,
                linear_beta: float) -> torch.Tensor:
        dt = torch.promote_types(gate.dtype, torch.float32)
        h, d_a, d_c = glu_parts(gate.to(dt), up.to(dt), act, beta, linear_beta)
        ctx.save_for_backward(d_a, d_c)
        ctx.dtypes = gate.dtype, up.dtype
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        d_a, d_c = ctx.saved_tensors
        g_dtype, u_dtype = ctx.dtypes
        d_gate = (grad * d_a).to(g_dtype) if ctx.needs_input_grad[0] else None
        d_up = (grad * d_c).to(u_dtype) if ctx.needs_input_grad[1] else None
        return d_gate, d_up, None, None, None
