"""RMSNorm, the normalization used by every K3 block (K3_SYSTEMS §1, §3, §5).

Computed in fp32 whatever the input dtype, and returned in the input dtype; the math is one autograd node,
:func:`moonrt.ops.rmsnorm.rms_norm` (saves the input and the reciprocal RMS only).
"""

from __future__ import annotations

import torch
from torch import nn

from moonrt.ops.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Args:
        dim: size of the last dimension of the input.
        eps: added to the mean square before the reciprocal square root.

    Parameters: ``weight [dim]`` (init 1), kept in whatever dtype the module is cast to.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"RMSNorm: dim={dim!r}, expected an integer >= 1")
        if not eps > 0:
            raise ValueError(f"RMSNorm: eps={eps!r}, expected a positive number")
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` any float dtype -> ``[..., dim]`` same dtype (fp32 internally; fp64 stays fp64)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: input last dimension {x.shape[-1]}, expected dim={self.dim}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
