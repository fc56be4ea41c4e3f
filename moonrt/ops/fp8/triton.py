"""The FP8 block codec (:mod:`moonrt.ops.fp8.codec`: 1 x ``block`` E4M3 tiles, fp32 scales) as Triton kernels.

The registry's ``triton`` backend of ``fp8_quantize`` / ``fp8_dequantize`` (:mod:`moonrt.ops.kernels`), with the row
contracts of :func:`moonrt.ops.fp8.codec.quantize_rows_torch` / :func:`~moonrt.ops.fp8.codec.dequantize_rows_torch`,
and the same bits as the CPU codec (numba), every corner included. The encoding, per tile of ``x [M, N]`` fp32:

- ``amax`` = the tile's largest magnitude (NaN if the tile holds a NaN); ``scale = amax / 448`` (IEEE division);
- ``inv = 448 * (1 / amax)`` when ``amax >= 448 * 2^-126`` (so ``inv`` and ``scale`` are normal), else 0; each value
  ``x * inv`` (one fp32 product) rounded to E4M3 by integer arithmetic on its bits (round to nearest even, the
  subnormal grid 2^-9 by one fp32 addition of 2^14), the CPU codec's ``_e4m3_code``;
- tiles with ``0 < amax < 448 * 2^-126`` (subnormal inputs included): the power-of-two scale ``2^k``,
  ``k = max(-149, e)`` with ``e`` the frexp exponent of ``amax / 448`` (in fp64, read off its bits), values
  ``x * 2^-k`` formed in fp64 (exact) and rounded once to fp32 (exact) then to E4M3;
- the corners fixed by the CPU codec's x86 arithmetic, written out here so a GPU gives the same bits: a NaN input
  encodes as ``0x7F`` with its sign (x86 keeps a NaN operand's sign), an infinite input (its tile's ``inv`` is 0) as
  ``0xFF`` (x86's ``inf * 0`` is the negative default NaN), a NaN tile's scale is the positive quiet NaN.

Decoding is ``lut[code] * scale`` in fp32 (the table of :func:`moonrt.ops.fp8.codec._lut`), with x86's NaN rules written
out likewise: a NaN scale gives the scale, else a NaN code keeps the table's NaN, ``0 * inf`` is the negative
default NaN.

Index arithmetic is int64 (tile ids, ``M * NB``, row offsets): a payload of ``M * NB > 2^31`` tiles (e.g. 2^20 rows
of 2^12 tiles) indexes past int32. Divisions use ``tl.math.div_rn`` (Triton's ``/`` on fp32 may lower to an
approximate division). The kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported), which is how CI checks them bit for bit against the CPU
codec.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import moonrt.ops.fp8.codec as fp8
from moonrt.ops.kernels import on_tensor_device

TILES_PER_PROGRAM = 8
"""Tiles (rows of the ``[TILES, BLOCK]`` block) each program encodes or decodes."""


@triton.jit
def _e4m3_bits(v):
    """E4M3 codes (uint32, low byte) of fp32 ``v``: :func:`moonrt.ops.fp8.codec._e4m3_code` in Triton (NaN handled by
    the caller)."""
    f = v.to(tl.uint32, bitcast=True)
    a = (tl.abs(v) + 16384.0).to(tl.uint32, bitcast=True)
    sign = f & 0x80000000
    f = f ^ sign
    normal = (f - (120 << 23) + 0x7FFFF + ((f >> 20) & 1)) >> 20
    sub = a - (141 << 23)
    r = tl.where(f < (121 << 23), sub, normal)
    r = tl.where(f > 0x43E80000, 0x7E, r)
    r = tl.where(f > 0x7F800000, 0x7F, r)
    return (r | (sign >> 24)) & 0xFF


@triton.jit
def _quantize_kernel(x_ptr, payload_ptr, scales_ptr, M, N, NB, min_amax,
                     BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * TILES + tl.arange(0, TILES).to(tl.int64)  # [TILES] tile ids (row-major over [M, NB])
    live = t < tl.cast(M, tl.int64) * NB  # int64: M * NB passes 2^31 long before either does
    row = t // NB
    col0 = (t % NB) * BLOCK
    offs = tl.arange(0, BLOCK_P2)
    col = col0[:, None] + offs[None, :]  # [TILES, BLOCK_P2]
    in_tile = (offs < BLOCK)[None, :] & live[:, None]
    valid = in_tile & (col < N)
    x = tl.load(x_ptr + row[:, None] * N + col, mask=valid, other=0.0)
    xb = x.to(tl.uint32, bitcast=True)
    mag = xb & 0x7FFFFFFF
    x_nan = mag > 0x7F800000
    x_inf = mag == 0x7F800000
    tile_nan = tl.max(x_nan.to(tl.int32), axis=1) > 0
    amax = tl.max(tl.where(x_nan, 0.0, tl.abs(x)), axis=1)  # [TILES]
    ok = amax >= min_amax
    nan = tl.full(amax.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)  # the positive quiet NaN
    scale = tl.where(tile_nan, nan, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    safe = tl.where(ok & ~tile_nan, amax, 1.0)
    inv = tl.where(ok & ~tile_nan, 448.0 * tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), safe), 0.0)
    # tiles below fp32's normal scales: the power-of-two scale 2^k, values scaled in fp64
    small = (amax > 0.0) & ~ok & ~tile_nan
    q = amax.to(tl.float64) / 448.0
    e = ((q.to(tl.uint64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1022  # frexp exponent of amax / 448
    k = tl.maximum(tl.where(small, e, 0), -149)
    up = ((1023 - k).to(tl.uint64) << 52).to(tl.float64, bitcast=True)  # 2^-k
    scale = tl.where(small, ((1023 + k).to(tl.uint64) << 52).to(tl.float64, bitcast=True).to(tl.float32), scale)
    v_small = (x.to(tl.float64) * up[:, None]).to(tl.float32)
    v = tl.where(small[:, None], v_small, x * inv[:, None])
    code = _e4m3_bits(v)
    code = tl.where(x_inf, 0xFF, code)  # inf * 0 (x86: the negative default NaN)
    code = tl.where(x_nan, 0x7F | ((xb >> 24) & 0x80), code)  # NaN * anything: the NaN, its sign kept
    code = tl.where(valid, code, 0)  # padding past N
    width = tl.cast(NB, tl.int64) * BLOCK
    tl.store(payload_ptr + row[:, None] * width + col, code.to(tl.uint8), mask=in_tile)
    tl.store(scales_ptr + t, scale, mask=live)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, lut_ptr, out_ptr, M, N, NB, code_stride, scale_stride,
                       BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * TILES + tl.arange(0, TILES).to(tl.int64)
    live = t < tl.cast(M, tl.int64) * NB
    row = t // NB
    tile = t % NB
    offs = tl.arange(0, BLOCK_P2)
    col = (tile * BLOCK)[:, None] + offs[None, :]
    valid = (offs < BLOCK)[None, :] & live[:, None] & (col < N)
    code = tl.load(codes_ptr + row[:, None] * code_stride + col, mask=valid, other=0).to(tl.int32)
    v = tl.load(lut_ptr + code, mask=valid, other=0.0)
    s = tl.load(scales_ptr + row * scale_stride + tile, mask=live, other=1.0)[:, None]
    y = v * s
    vb = v.to(tl.uint32, bitcast=True)
    sb = s.to(tl.uint32, bitcast=True)
    v_nan = (vb & 0x7FFFFFFF) > 0x7F800000
    s_nan = (sb & 0x7FFFFFFF) > 0x7F800000
    zero_inf = ((vb & 0x7FFFFFFF) == 0) & ((sb & 0x7FFFFFFF) == 0x7F800000)
    yb = y.to(tl.uint32, bitcast=True)
    yb = tl.where(zero_inf, 0xFFC00000, yb)  # 0 * inf (x86: the negative default NaN)
    yb = tl.where(v_nan, vb, yb)
    yb = tl.where(s_nan, sb, yb)  # both NaN: the scale's (the CPU codec's bits)
    tl.store(out_ptr + row[:, None] * N + col, yb.to(tl.float32, bitcast=True), mask=valid)


def _p2(block: int) -> int:
    return 1 << max(0, (block - 1).bit_length())


@on_tensor_device
def quantize_rows(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec on ``x2 [M, N]`` fp32 rows (registry op ``fp8_quantize``): ``payload [M, nb * block]`` E4M3 (zero
    past ``N``) and ``scales [M, nb]`` fp32, bitwise :func:`moonrt.ops.fp8.codec.quantize_rows_numba`."""
    x2 = x2.contiguous()
    m, n = x2.shape
    nb = -(-n // block)
    payload = torch.empty(m, nb * block, dtype=torch.uint8, device=x2.device)
    scales = torch.empty(m, nb, dtype=torch.float32, device=x2.device)
    if m * nb:
        grid = (triton.cdiv(m * nb, TILES_PER_PROGRAM),)
        _quantize_kernel[grid](x2, payload, scales, m, n, nb, fp8._MIN_NORMAL_AMAX, BLOCK=block, BLOCK_P2=_p2(block),
                               TILES=TILES_PER_PROGRAM)
    return payload.view(fp8.E4M3), scales


@on_tensor_device
def dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``payload [M, nb * block]`` E4M3 + ``scales [M, nb]`` fp32 -> ``[M, n]`` fp32 (registry op ``fp8_dequantize``),
    bitwise :func:`moonrt.ops.fp8.codec.dequantize_rows_numba`. Rows may be strided (unit stride within a row)."""
    m, width = payload.shape
    nb = scales.shape[-1]
    block = width // nb
    codes = payload.view(torch.uint8)
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    scales = scales.float()
    if scales.stride(1) != 1:
        scales = scales.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=payload.device)
    if m * n:
        grid = (triton.cdiv(m * nb, TILES_PER_PROGRAM),)
        _dequantize_kernel[grid](codes, scales, fp8._lut(payload.device), out, m, n, nb, codes.stride(0),
                                 scales.stride(0), BLOCK=block, BLOCK_P2=_p2(block), TILES=TILES_PER_PROGRAM)
    return out


__all__ = ["dequantize_rows", "quantize_rows"]
