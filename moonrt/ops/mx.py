"""OCP Microscaling (MX v1.0) codecs: MXFP4 (E2M1), MXFP8 E4M3 and E5M2 with E8M0 block scales (issue 33 item 1).

A tensor is cut along one axis (``axis``, default the last) into blocks of ``block`` elements (default 32, the
spec's block). Each block shares one E8M0 scale ``X = 2^(s - 127)`` stored as the byte ``s`` (``uint8``; no zero,
no infinity, ``255`` is NaN); each element ``v`` is stored as the element-format code of ``v / X``. Decoding is
``value(code) * X``. The formats (:data:`FORMATS`):

- ``mxfp4``: E2M1, values ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives (code bit 3 is the sign); no inf, no
  NaN. Two codes per byte along the axis: element ``2j`` in the low nibble, ``2j + 1`` in the high nibble (the
  layout of torchao's ``pack_uint4``), so ``codes`` has half the axis length.
- ``mxfp8_e4m3`` / ``mxfp8_e5m2``: the bytes of ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (max 448 /
  57344), one per element.

The scale modes are torchao's ``torchao.prototype.mx_formats`` ``ScaleCalculationMode`` (0.18), with
``amax`` the block's largest magnitude in fp32, ``e(a)`` the unbiased exponent field of the fp32 ``a`` (``-127``
for zero and subnormals, ``128`` for inf) and ``emax`` the exponent of the element format's largest power of two
(E2M1 2, E4M3 8, E5M2 15):

- ``floor`` (the spec's §6.3 and torchao's default): ``s = e(amax) - emax``;
- ``ceil``: ``s = e(amax) + [mantissa(amax) != 0] - emax``;
- ``even``: ``amax`` first rounded to the element's mantissa width (half away from zero, carrying into the
  exponent), then as ``floor``;
- ``rceil`` (cuBLAS's MXFP8 recipe, PTX ``cvt.rp.satfinite.ue8m0``): ``s = ceil(log2(amax / max_elem))`` with the
  fp32 quotient, clamped to ``[-127, 127]``; an infinite ``amax`` gives the byte 254.

For ``floor``/``ceil``/``even`` the unbiased scale is clamped to ``[-127, 128]`` (the byte range; 255 is reached
by NaN only). A block whose ``amax`` is NaN (any NaN element) gets the NaN scale 255 in every mode, and decodes to
NaN whatever its codes. Elements are divided by ``X`` (``floor``/``ceil``/``even``; ``X`` read as at least the
smallest normal fp32 ``2^-126`` for the byte 0, as torchao does) or multiplied by ``2^(127 - s)`` (``rceil``; by
1 for the byte 0, by ``2^-127`` for the byte 254, as torchao does), clamped to ``+-max_elem`` (saturating: an inf
element becomes the largest finite code with its sign) and rounded to nearest, ties to even. Signed zeros keep
their sign. A NaN element becomes the format's NaN code in FP8 (``0x7F``, sign kept) and, as E2M1 has no NaN, a
zero code in FP4 (0, or 8 for a NaN with the sign bit set; torchao writes a payload-dependent bit pattern there);
its block has the NaN scale and decodes to NaN either way.

Against torchao 0.18 (CPU, eager) this is bitwise the same scales and codes (tests/ops/test_mx.py) except: FP4
codes of NaN elements (above), and ``rceil`` where torchao's eager fallback takes ``ceil(torch.log2(q))`` of the
fp32 quotient ``q``: the rounded ``log2`` of a ``q`` just above a power of two (``q = 2^k (1 + m)``, ``m`` below
about ``2^-18`` for ``|k| >= 4``) can equal ``k`` exactly, so torchao gives ``k`` where the exact ``ceil`` (and the
PTX instruction torchao uses when compiled on Blackwell) gives ``k + 1``. Here the exponent is exact (from
``torch.frexp``).

Every tensor is created on the input's device; the work is vectorized torch ops (CPU or CUDA).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
"""Accepted element-format names."""

SCALE_MODES = ("floor", "rceil", "ceil", "even")
"""Accepted scale modes (torchao's ``ScaleCalculationMode`` values)."""

E8M0_BIAS = 127
E8M0_NAN = 255

# name -> (mantissa bits, exponent of the largest power of two, largest finite value)
_SPEC = {
    "mxfp4": (1, 2, 6.0),
    "mxfp8_e4m3": (3, 8, float(torch.finfo(torch.float8_e4m3fn).max)),
    "mxfp8_e5m2": (2, 15, float(torch.finfo(torch.float8_e5m2).max)),
}
_FP8 = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The E2M1 value of each 4-bit code (the spec's table: sign, 2 exponent bits with bias 1, 1 mantissa bit)."""

# midpoints of neighbouring E2M1 magnitudes; those whose tie goes up (to codes 2, 4, 6) as the fp32 just below
_FP4_MIDPOINTS = tuple(m if i % 2 == 0 else float(np.nextafter(np.float32(m), np.float32(0.0)))
                       for i, m in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)))


@dataclasses.dataclass(frozen=True)
class MXQuantized:
    """One quantized tensor: ``codes`` and ``scales`` (both ``uint8``) with the axis in its place.

    ``codes`` has ``shape`` with the axis length halved for ``mxfp4`` (two codes a byte) and kept for FP8;
    ``scales`` has ``shape`` with the axis length divided by ``block``. ``axis`` is non-negative.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    format: str
    axis: int
    block: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Storage bytes: codes plus scales."""
        return self.codes.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:func:`dequantize` of this tensor."""
        return dequantize(self, dtype)


def _check_format(fmt: str) -> None:
    if fmt not in _SPEC:
        raise ValueError(f"format = {fmt!r}: expected one of {', '.join(FORMATS)}")


def _check(x: torch.Tensor, fmt: str, axis: int, block: int, mode: str) -> int:
    """Validate the arguments of :func:`quantize`; return ``axis`` made non-negative."""
    _check_format(fmt)
    if mode not in SCALE_MODES:
        raise ValueError(f"scale_mode = {mode!r}: expected one of {', '.join(SCALE_MODES)}")
    if not x.is_floating_point():
        raise ValueError(f"x.dtype = {x.dtype}: expected a floating dtype")
    if x.dim() == 0:
        raise ValueError("x.shape = (): expected at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis = {axis}: expected an axis of x.shape = {tuple(x.shape)} (-{x.dim()} .. {x.dim() - 1})")
    axis %= x.dim()
    n = x.shape[axis]
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block = {block!r}: expected an integer >= 1")
    if n % block:
        raise ValueError(f"block = {block}: expected a divisor of the axis length {n} (x.shape = {tuple(x.shape)}, "
                         f"axis = {axis})")
    if fmt == "mxfp4" and n % 2:
        raise ValueError(f"x.shape[{axis}] = {n}: mxfp4 packs two codes a byte along the axis, expected an even length")
    return axis


def _exponent_field(a: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of fp32 ``a >= 0`` (int32): -127 for zero/subnormal, 128 for inf/NaN."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _scale_bytes(amax: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """E8M0 byte (int32, 0..255) of each block from its fp32 ``amax``."""
    mbits, emax, max_elem = _SPEC[fmt]
    nan = torch.isnan(amax)
    if mode == "rceil":
        q = amax / max_elem
        mant, exp = torch.frexp(q)  # q = mant * 2^exp, mant in [0.5, 1): ceil(log2 q) = exp - [mant == 0.5]
        ceil_log2 = exp - (mant == 0.5).to(torch.int32)
        ceil_log2 = torch.where(q == 0, -E8M0_BIAS, ceil_log2).clamp(-E8M0_BIAS, E8M0_BIAS)
        s = torch.where(torch.isinf(q), 254, ceil_log2 + E8M0_BIAS)
    else:
        a = amax
        if mode == "even":  # round the mantissa to mbits, half away from zero, carry into the exponent
            a = ((a.view(torch.int32) + (1 << (22 - mbits))) & (0x1FF << 23)).view(torch.float32)
        e = _exponent_field(a)
        if mode == "ceil":
            e = e + ((a.view(torch.int32) & 0x7FFFFF) > 0).to(torch.int32)
        s = (e - emax).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(nan, E8M0_NAN, s)


def _fp4_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 ``y`` already clamped to ``[-6, 6]``: round to nearest, ties to even.

    The magnitude's code is its bucket among the midpoints of neighbouring values: the number of midpoints strictly
    below it (a value equal to a boundary goes to the lower bucket, as ``torch.bucketize`` counts; seven compares
    and adds, several times faster on the CPU than ``bucketize``'s per-element search): a midpoint whose lower
    neighbour has the even code is a boundary as is, one whose upper neighbour has it is replaced by the next fp32
    below it, so the tie goes up. NaN -> +-0 (by its sign bit).
    """
    a = torch.nan_to_num(y.abs(), nan=0.0)
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m in _FP4_MIDPOINTS:
        code += a > m
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def quantize(x: torch.Tensor, format: str, *, axis: int = -1, block: int = 32, scale_mode: str = "floor"
             ) -> MXQuantized:
    """Quantize ``x`` (any floating dtype; read as fp32) to ``format`` (:data:`FORMATS`) along ``axis``.

    Blocks of ``block`` consecutive elements along ``axis`` (``block`` must divide its length; ``mxfp4`` also
    needs an even length) share one E8M0 scale chosen by ``scale_mode`` (:data:`SCALE_MODES`; module docstring).
    """
    axis = _check(x, format, axis, block, scale_mode)
    mbits, emax, max_elem = _SPEC[format]
    shape = x.shape
    xm = x.movedim(axis, -1).to(torch.float32).contiguous()
    moved = xm.shape
    xb = xm.reshape(*moved[:-1], moved[-1] // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s = _scale_bytes(amax, format, scale_mode)
    if scale_mode == "rceil":
        # 2^(127 - s) for s in 1..253 is the fp32 with exponent field 254 - s (exact, built from bits)
        recip = ((254 - s).clamp(1, 254) << 23).view(torch.float32)
        factor = torch.where(s == E8M0_NAN, float("nan"), torch.where(s == 254, 2.0 ** -127, torch.where(
            s == 0, 1.0, recip)))
        y = xb * factor
    else:
        scale = (s << 23).view(torch.float32).clamp_min(2.0 ** -126)  # byte 255 -> +inf: finite elements -> 0
        y = xb / scale
    y = y.clamp(-max_elem, max_elem)  # NaN stays NaN
    if format == "mxfp4":
        c = _fp4_codes(y).reshape(moved)
        codes = c[..., 0::2] | (c[..., 1::2] << 4)
    else:
        codes = y.to(_FP8[format]).view(torch.uint8).reshape(moved)
    scales = s.to(torch.uint8).squeeze(-1)
    return MXQuantized(codes.movedim(-1, axis).contiguous(), scales.movedim(-1, axis).contiguous(), format, axis,
                       block, shape)


def decode_codes(codes: torch.Tensor, format: str) -> torch.Tensor:
    """fp32 element values of unpacked ``codes`` (``uint8``; one 4-bit code a byte for ``mxfp4``)."""
    _check_format(format)
    if format == "mxfp4":
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
        return lut[(codes & 0xF).long()]
    return codes.view(_FP8[format]).to(torch.float32)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(s - 127)`` of E8M0 bytes ``scales`` (``2^-127`` for 0, NaN for 255)."""
    s = scales.to(torch.int32)
    v = torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)  # fp32 bits: 2^-127 is the subnormal 0x400000
    return torch.where(s == E8M0_NAN, float("nan"), v)


def dequantize(q: MXQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``q`` encodes, in ``dtype``: each element's value and its block's scale cast to ``dtype`` and
    multiplied there (torchao's ``to_dtype`` order; exact for fp32 and bf16 except in their subnormal range)."""
    codes = q.codes.movedim(q.axis, -1)
    if q.format == "mxfp4":
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    vals = decode_codes(codes, q.format).to(dtype)
    moved = vals.shape
    vb = vals.reshape(*moved[:-1], moved[-1] // q.block, q.block)
    sc = scale_values(q.scales.movedim(q.axis, -1)).to(dtype).unsqueeze(-1)
    return (vb * sc).reshape(moved).movedim(-1, q.axis).contiguous()
