"""RMSNorm, the normalization used by every K3 block (K3_SYSTEMS §1, §3, §5): the shared module
:class:`moonrt.parallel.decoder.RMSNorm` (fp32 math whatever the input dtype, returned in the input dtype; one autograd
node, :func:`moonrt.ops.rmsnorm.rms_norm`, saving the input and the reciprocal RMS only), named here for K3's layers.
"""

from __future__ import annotations

from moonrt.parallel.decoder import RMSNorm

__all__ = ["RMSNorm"]
