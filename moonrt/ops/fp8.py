"""Block-wise FP8 storage of activations (K3_SYSTEMS §8: E4M3, 1 x 128 tiles, fp32 scales).

A tensor ``x`` of shape ``[..., N]`` is cut along its last dimension into tiles of ``block``
elements (the last tile is zero-padded when ``N`` is not a multiple of ``block``). Each tile is
scaled so that its largest magnitude maps to the E4M3 maximum (448), rounded to
``torch.float8_e4m3fn`` and stored with its fp32 scale. Storage cost per element:
``1 + 4 / block`` bytes (1.03 B at block 128), i.e. ~1.94x smaller than bf16 and ~3.9x smaller
than fp32. Round-trip error on Gaussian data is ~2.6% relative L2; an all-zero tile has scale 0
and round-trips exactly.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0


def quantize(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` block-wise to FP8 E4M3.

    Args:
        x: ``[..., N]`` floating tensor (any float dtype), N >= 1.
        block: tile length along the last dimension.

    Returns:
        payload: ``[M, nb * block]`` ``float8_e4m3fn``, ``M = x.numel() // N``, ``nb = ceil(N / block)``;
            the tiles, zero-padded past ``N``.
        scales: ``[M, nb]`` fp32; dequantized value = ``payload * scale`` (0 for all-zero tiles).
    """
    if not x.is_floating_point():
        raise ValueError(f"quantize: x.dtype = {x.dtype}: expected a floating dtype")
    if block < 1:
        raise ValueError(f"quantize: block = {block}: expected an integer >= 1")
    if x.dim() == 0:
        x = x.reshape(1)
    n = x.shape[-1]
    if n == 0 or x.numel() == 0:
        raise ValueError(f"quantize: x.shape = {tuple(x.shape)}: expected a non-empty last dimension")
    nb = -(-n // block)
    x2 = x.detach().reshape(-1, n).float()
    if nb * block != n:
        x2 = torch.nn.functional.pad(x2, (0, nb * block - n))
    tiles = x2.view(x2.shape[0], nb, block)
    amax = tiles.abs().amax(dim=-1)  # [M, nb]
    scales = amax / E4M3_MAX
    inv = torch.where(amax > 0, E4M3_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(amax))
    # |tile * inv| <= 448 * (1 + 2 ulp) and E4M3 rounds anything below 464 to at most 448, so no clamp
    # is needed (one pass fewer; the payload is bitwise the same as with a clamp)
    payload = (tiles * inv.unsqueeze(-1)).to(E4M3)
    return payload.view(x2.shape[0], nb * block), scales.float()


def dequantize(payload: torch.Tensor, scales: torch.Tensor, shape: torch.Size | tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`.

    Args:
        payload: ``[M, nb * block]`` ``float8_e4m3fn`` from :func:`quantize`.
        scales: ``[M, nb]`` fp32 from :func:`quantize`.
        shape: the original shape ``[..., N]`` (padding past ``N`` is dropped).
        dtype: dtype of the result.

    Returns:
        ``[shape]`` tensor of ``dtype`` on ``payload``'s device.
    """
    m, width = payload.shape
    nb = scales.shape[-1]
    if scales.shape[0] != m or width % nb:
        raise ValueError(f"dequantize: payload {tuple(payload.shape)} and scales {tuple(scales.shape)} do not match")
    block = width // nb
    shape = tuple(shape)
    n = shape[-1] if shape else 1
    x = payload.view(m, nb, block).float() * scales.unsqueeze(-1)
    x = x.view(m, nb * block)[:, :n]
    return x.to(dtype).reshape(shape)


def stored_bytes(shape: torch.Size | tuple[int, ...], block: int = 128) -> int:
    """Bytes :func:`quantize` stores for a tensor of ``shape`` (payload + fp32 scales)."""
    shape = tuple(shape) or (1,)
    n = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    nb = -(-n // block)
    return m * nb * block + 4 * m * nb


__all__ = ["E4M3", "E4M3_MAX", "dequantize", "quantize", "stored_bytes"]
