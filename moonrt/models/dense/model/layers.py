"""Per-token layers of the dense decoder: RMSNorm (:class:`moonrt.parallel.decoder.RMSNorm`, shared with K3) and the
SwiGLU FFN (math in :mod:`moonrt.ops`)."""

from __future__ import annotations

import torch
from torch import nn

from moonrt.ops.glu import swiglu
from moonrt.parallel.decoder import RMSNorm


class SwiGLUFFN(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases; the activation in fp32 (:func:`moonrt.ops.glu.swiglu`, one
    autograd node), cast back to ``x``'s dtype before ``down_proj``.

    Parameters (``nn.Linear`` layout ``[out, in]``): ``gate_proj.weight [F, D]``, ``up_proj.weight [F, D]``,
    ``down_proj.weight [D, F]``, each ~ N(0, ``init_std``). All three are whole Muon matrices (the default).
    """

    def __init__(self, dim: int, hidden: int, init_std: float) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"SwiGLUFFN: {name}={value!r}, expected an integer >= 1")
        self.dim, self.hidden = dim, hidden
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` -> ``[..., D]`` in ``x.dtype``."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"SwiGLUFFN: input last dimension {x.shape[-1]}, expected dim={self.dim}")
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)).to(x.dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}"


__all__ = ["RMSNorm", "SwiGLUFFN"]
