"""Block-wise FP8 (K3_SYSTEMS §8): ``codec`` (E4M3 in 1 x 128 tiles with fp32 scales: torch and numba paths, the
public ``quantize`` / ``dequantize`` and their batched forms) and ``triton`` (the same codec as Triton kernels, chosen
through :mod:`moonrt.ops.kernels`)."""
