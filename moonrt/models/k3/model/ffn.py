"""The gated FFN used for the dense first layer and the shared experts (K3_SYSTEMS §1, §5.1).

The activation (SiTU-GLU or SwiGLU, K3_SYSTEMS §5.2) is :func:`moonrt.ops.glu.glu_activation`.
"""

from __future__ import annotations

import torch
from torch import nn

from moonrt.models.k3.model.config import K3Config
from moonrt.ops.glu import Activation, glu_activation
from moonrt.ops.qat import QATScheme, qat_linear


class GLUFFN(nn.Module):
    """Gated FFN ``down(act(gate(x), up(x)))`` (K3_SYSTEMS §1, §5.1).

    Used for the dense first-layer FFN (width ``intermediate_size``) and for each full-width shared
    expert of a LatentMoE layer (width ``moe_intermediate_size``). Projections have no bias.

    Parameters (``nn.Linear`` layout ``[out, in]``): ``gate_proj.weight [hidden, dim]``,
    ``up_proj.weight [hidden, dim]``, ``down_proj.weight [dim, hidden]``.
    The activation is computed in fp32 and cast back to the input dtype before ``down_proj``.

    ``qat`` (a plain attribute, None until :meth:`moonrt.models.k3.model.model.K3Model.enable_qat` sets it on the
    shared experts): the three projections read MXFP4 fake-quantized weights and MXFP8 fake-quantized inputs
    (``x`` for gate / up, the GLU output for down), straight-through gradients, no weight copy saved
    (:func:`moonrt.ops.qat.qat_linear`).
    """

    def __init__(self, dim: int, hidden: int, act: Activation = "situ", beta: float = 4.0,
                 linear_beta: float = 25.0, init_std: float | None = None) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"GLUFFN: {name}={value!r}, expected an integer >= 1")
        if act not in ("situ", "silu"):
            raise ValueError(f"GLUFFN: act={act!r}, expected 'situ' or 'silu'")
        if not (beta > 0 and linear_beta > 0):
            raise ValueError(f"GLUFFN: beta={beta!r}, linear_beta={linear_beta!r}, expected positive numbers")
        self.dim, self.hidden, self.act = dim, hidden, act
        self.beta, self.linear_beta = float(beta), float(linear_beta)
        self.qat: QATScheme | None = None
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        if init_std is not None:
            for lin in (self.gate_proj, self.up_proj, self.down_proj):
                nn.init.normal_(lin.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]`` in ``x``'s dtype."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"GLUFFN: input last dimension {x.shape[-1]}, expected dim={self.dim}")
        q = self.qat
        if q is None:
            h = glu_activation(self.gate_proj(x), self.up_proj(x), self.act, self.beta, self.linear_beta)
            return self.down_proj(h.to(x.dtype))
        h = glu_activation(qat_linear(x, self.gate_proj.weight, q), qat_linear(x, self.up_proj.weight, q),
                           self.act, self.beta, self.linear_beta)
        return qat_linear(h.to(x.dtype), self.down_proj.weight, q)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}, act={self.act!r}, betas=({self.beta}, {self.linear_beta})"


def config_ffn(config: K3Config, hidden: int) -> GLUFFN:
    """``GLUFFN(D, hidden)`` with the config's activation, caps and init (the dense and shared-expert FFNs)."""
    return GLUFFN(config.hidden_size, hidden, act=config.hidden_act, beta=config.activation_situ_beta,
                  linear_beta=config.activation_situ_linear_beta, init_std=config.initializer_range)


def dense_ffn(config: K3Config) -> GLUFFN:
    """The dense FFN of the first ``first_k_dense_replace`` layers: ``GLUFFN(D, intermediate_size)``."""
    return config_ffn(config, config.intermediate_size)


def shared_expert(config: K3Config) -> GLUFFN:
    """One full-width shared expert of a LatentMoE layer: ``GLUFFN(D, moe_intermediate_size)`` (§5.1)."""
    return config_ffn(config, config.moe_intermediate_size)
