"""Block-wise FP8 storage of activations (K3_SYSTEMS §8: E4M3, 1 x 128 tiles, fp32 scales).

A tensor ``x`` of shape ``[..., N]`` is cut along its last dimension into tiles of ``block``
elements (the last tile is zero-padded when ``N`` is not a multiple of ``block``). Each tile is
scaled so that its largest magnitude maps to the E4M3 maximum (448), rounded to
``torch.float8_e4m3fn`` and stored with its fp32 scale. Storage cost per element:
``1 + 4 / block`` bytes (1.03 B at block 128), i.e. ~1.94x smaller than bf16 and ~3.9x smaller
than fp32. Round-trip error on Gaussian data is ~2.6% relative L2; an all-zero tile has scale 0
and round-trips exactly.

Per element, with ``s`` the tile's scale: ``|y - x| <= 2^-4 |x| + 2^-10 s`` (E4M3 has 3 mantissa bits
and subnormal spacing 2^-9), plus a few fp32 ulps. A tile whose ``amax / 448`` is not a normal fp32
(``amax < 448 * 2^-126``, about 5.3e-36; subnormal inputs included) gets the power-of-two scale
``2^k >= 2^-149`` with ``amax / 2^k`` in ``(224, 448]`` instead, so the bound holds there too (and zeros
stay zero) where ``448 / amax`` would overflow.

The row codec has three backends with the same bits (:mod:`moonrt.ops.kernels`, ops ``fp8_quantize`` /
``fp8_dequantize``): torch ops (any device), one numba pass (CPU) and Triton (:mod:`moonrt.ops.fp8.triton`, CUDA);
``kernel=`` picks one (``auto``: by the tensors' device).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from moonrt.ops import kernels

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0


def _lut(device: torch.device) -> torch.Tensor:
    """``[256]`` fp32 on ``device``: the value of every E4M3 code. Decoding by table lookup is bitwise the
    same as ``.float()`` and several times faster on CPU, where the fp8 -> fp32 cast is scalar code (there a
    numba loop does the lookup and the scale in one pass: ~3x faster than ``index_select`` + ``mul_``)."""
    lut = _LUTS.get(device)
    if lut is None:
        lut = _LUTS[device] = torch.arange(256, dtype=torch.uint8, device=device).view(E4M3).float()
    return lut


_LUTS: dict[torch.device, torch.Tensor] = {}


def _check(x: torch.Tensor, block: int, name: str = "quantize") -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name}: x.dtype = {x.dtype}: expected a floating dtype")
    if block < 1:
        raise ValueError(f"{name}: block = {block}: expected an integer >= 1")
    if x.numel() == 0 or (x.dim() > 0 and x.shape[-1] == 0):
        raise ValueError(f"{name}: x.shape = {tuple(x.shape)}: expected a non-empty last dimension")


def _quantize_rows(x2: torch.Tensor, block: int, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The codec on ``[M, N]`` rows: ``payload [M, nb * block]`` E4M3 (zero past ``N``), ``scales [M, nb]``, by the
    backend ``kernel`` picks for ``x2``'s device (:mod:`moonrt.ops.kernels`, op ``fp8_quantize``: ``auto`` is numba
    on CPU, Triton on CUDA); every backend gives the same bits.

    Works on the unpadded data (no padded fp32 copy): a tile's amax and its scaled values do not depend on
    the zero padding, and padding encodes to the E4M3 zero the buffer starts with, so the result is
    bitwise that of scaling the zero-padded tiles (the formula in the module docstring).
    """
    x2 = x2.contiguous()
    return kernels.kernel("fp8_quantize", kernel, x2.device)(x2, block)


def quantize_rows_numba(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_rows` in one fused numba pass (CPU tensors; no GIL), bitwise :func:`quantize_rows_torch`."""
    m, n = x2.shape
    x2 = x2.contiguous()
    nb = -(-n // block)
    payload = torch.empty(m, nb * block, dtype=torch.uint8, device=x2.device)
    scales = torch.empty(m, nb, dtype=torch.float32, device=x2.device)
    if _quantize_cpu(x2.numpy(), payload.numpy(), scales.numpy(), block, np.float32(_MIN_NORMAL_AMAX)):
        amax = _tile_amax(x2, block)
        _quantize_small_tiles(x2, block, amax, (amax > 0) & (amax < _MIN_NORMAL_AMAX), payload.view(E4M3), scales)
    return payload.view(E4M3), scales


def quantize_rows_torch(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_rows` in torch ops (any device; the reference)."""
    x2 = x2.contiguous()
    m, n = x2.shape
    nb = -(-n // block)
    full = n // block
    amax = _tile_amax(x2, block)
    scales = amax / E4M3_MAX
    ok = amax >= _MIN_NORMAL_AMAX  # amax / 448 a normal fp32 and 448 / amax finite; else 0 here, fixed below
    inv = torch.where(ok, E4M3_MAX / amax.clamp_min(_MIN_NORMAL_AMAX), torch.zeros_like(amax))
    # |tile * inv| <= 448 * (1 + 2 ulp) and E4M3 rounds anything below 464 to at most 448: no clamp needed
    if full == nb:
        scaled = x2.view(m, nb, block) * inv[:, :, None]
        payload = scaled.view(m, n).to(E4M3)
    else:
        payload = torch.zeros(m, nb * block, dtype=E4M3, device=x2.device)
        if full:
            scaled = x2[:, :full * block].reshape(m, full, block) * inv[:, :full, None]
            payload[:, :full * block] = scaled.reshape(m, full * block).to(E4M3)
        payload[:, full * block:n] = (x2[:, full * block:] * inv[:, full:]).to(E4M3)
    small = (amax > 0) & ~ok
    if small.any():  # rare (tiles below ~5e-36): one small pass over the rows that hold such a tile
        _quantize_small_tiles(x2, block, amax, small, payload, scales)
    return payload, scales


def _tile_amax(x2: torch.Tensor, block: int) -> torch.Tensor:
    """``[M, nb]`` fp32: each tile's largest magnitude (NaN if the tile holds one)."""
    m, n = x2.shape
    nb = -(-n // block)
    full = n // block
    amax = torch.empty(m, nb, dtype=torch.float32, device=x2.device)
    if full:
        amax[:, :full] = x2[:, :full * block].reshape(m, full, block).abs().amax(dim=-1)
    if full < nb:
        amax[:, full] = x2[:, full * block:].abs().amax(dim=-1)
    return amax


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _e4m3_code(f: int, a: int) -> int:
    """E4M3 code of the fp32 value with bits ``f``, given the bits ``a`` of ``|value| + 2^14`` (in fp32): torch's
    cast (round to nearest even; NaN -> 0x7F with the sign; above 464 saturates to 448 in torch 2.13, a range
    the codec never reaches: its scaled values are at most 448 (1 + 2 ulp)). Below E4M3's smallest normal 2^-6,
    fp32's own rounding of ``|value| + 2^14`` lands on the subnormal grid 2^-9."""
    sign = f & np.uint32(0x80000000)
    f = f ^ sign
    normal = (f - np.uint32(120 << 23) + np.uint32(0x7FFFF) + ((f >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
    sub = a - np.uint32(141 << 23)
    if f > np.uint32(0x7F800000):
        r = np.uint32(0x7F)
    elif f > np.uint32(0x43E80000):
        r = np.uint32(0x7E)
    elif f < np.uint32(121 << 23):
        r = sub
    else:
        r = normal
    return (r | (sign >> np.uint32(24))) & np.uint32(0xFF)


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def _quantize_cpu(x: np.ndarray, payload: np.ndarray, scales: np.ndarray, block: int, min_amax: np.float32) -> bool:
    """The codec of the torch path in one pass per tile: amax, ``scale = amax / 448``, ``inv = 448 * (1 / amax)``
    (torch's ``448 / t`` is a reciprocal times 448), ``x * inv`` cast to E4M3, padding zero; the same fp32
    operations, so bitwise the same. Tiles with ``0 < amax < min_amax`` get ``inv = 0`` here; returns whether there
    is one (the caller re-encodes them, :func:`_quantize_small_tiles`)."""
    m, n = x.shape
    nb = scales.shape[1]
    sc = np.empty(block, np.float32)
    ad = np.empty(block, np.float32)
    scb = sc.view(np.uint32)
    adb = ad.view(np.uint32)
    e4 = np.float32(448.0)
    zero = np.float32(0.0)
    small = False
    for i in range(m):
        for b in range(nb):
            j0 = b * block
            w = min(block, n - j0)
            amax = zero
            nan = False
            for k in range(w):
                v = abs(x[i, j0 + k])
                amax = max(amax, v)
                nan |= v != v
            if nan:
                amax = np.float32(np.nan)
            scales[i, b] = amax / e4
            ok = amax >= min_amax
            inv = e4 * (np.float32(1.0) / amax) if ok else zero
            if amax > zero and not ok:
                small = True
            for k in range(w):
                v = x[i, j0 + k] * inv
                sc[k] = v
                ad[k] = abs(v) + np.float32(16384.0)
            for k in range(w):
                payload[i, j0 + k] = _e4m3_code(scb[k], adb[k])
            for k in range(w, block):
                payload[i, j0 + k] = 0
    return small


@njit(cache=True, nogil=True, boundscheck=False)
def _cast_e4m3_cpu(v: np.ndarray, out: np.ndarray) -> None:
    """``out[k]``: the E4M3 code of fp32 ``v[k]`` by :func:`_quantize_cpu`'s encoding (tests: torch's cast)."""
    ad = np.abs(v) + np.float32(16384.0)
    vb = v.view(np.uint32)
    adb = ad.view(np.uint32)
    for k in range(v.shape[0]):
        out[k] = _e4m3_code(vb[k], adb[k])


_MIN_NORMAL_AMAX = E4M3_MAX * torch.finfo(torch.float32).tiny
"""Smallest tile amax whose scale ``amax / 448`` is a normal fp32 (448 * 2^-126, ~5.3e-36)."""


def _quantize_small_tiles(x2: torch.Tensor, block: int, amax: torch.Tensor, small: torch.Tensor,
                          payload: torch.Tensor, scales: torch.Tensor) -> None:
    """Re-encode, in place, the tiles with ``0 < amax < 448 * 2^-126`` (``small [M, nb]``) of ``x2 [M, N]``.

    Their scale is the power of two ``2^k``, ``k = max(-149, exponent of amax / 448)`` (frexp: ``amax / 2^k``
    in ``[224, 448)``), exact in fp32 (down to its smallest subnormal); the payload ``x * 2^-k`` is formed in
    float64, where it is exact (a power-of-two scaling of an fp32 value, at most 448), then rounded to E4M3
    like every other tile. Decoding ``payload * 2^k`` in fp32 then rounds once to fp32's grid.
    """
    n = x2.shape[1]
    nb = amax.shape[1]
    rows = small.any(dim=1).nonzero().squeeze(1)
    k = torch.frexp(amax[rows].double() / E4M3_MAX).exponent.clamp_min(-149).double()
    tile_scale = torch.where(small[rows], torch.exp2(k), scales[rows].double())
    scales[rows] = tile_scale.float()
    sub = torch.nn.functional.pad(x2[rows].double(), (0, nb * block - n)).view(-1, nb, block)
    enc = (sub * torch.where(small[rows], torch.exp2(-k), 0.0)[:, :, None]).float().to(E4M3).view(-1, nb * block)
    keep = (~small[rows]).repeat_interleave(block, dim=1)  # [R, nb * block], the payload's width
    payload[rows] = torch.where(keep, payload[rows].view(torch.uint8), enc.view(torch.uint8)).view(E4M3)


def quantize(x: torch.Tensor, block: int = 128, *, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` block-wise to FP8 E4M3.

    Args:
        x: ``[..., N]`` floating tensor (any float dtype), N >= 1.
        block: tile length along the last dimension.
        kernel: the backend (``kernels.fp8``: auto, torch, numba, triton; :mod:`moonrt.ops.kernels`); all give the
            same bits.

    Returns:
        payload: ``[M, nb * block]`` ``float8_e4m3fn``, ``M = x.numel() // N``, ``nb = ceil(N / block)``;
            the tiles, zero-padded past ``N``.
        scales: ``[M, nb]`` fp32; dequantized value = ``payload * scale`` (0 for all-zero tiles).
    """
    _check(x, block)
    if x.dim() == 0:
        x = x.reshape(1)
    n = x.shape[-1]
    return _quantize_rows(x.detach().reshape(-1, n).float(), block, kernel)


BATCH_ALONE_BYTES = 1 << 20
"""Tensors of at least this many bytes are quantized on their own by :func:`quantize_many` (their per-op
overhead is already negligible; concatenating them would only add a copy)."""


def quantize_many(xs: list[torch.Tensor], block: int = 128, *, kernel: str = "auto"
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`quantize` of several tensors in one batched call per row width (bitwise the same results).

    Tensors with the same last dimension ``N`` (any leading shape, any float dtype) are concatenated as
    ``[sum M, N]`` fp32 rows and quantized together; each result is a row range of the shared buffers.
    Tensors of :data:`BATCH_ALONE_BYTES` or more are quantized on their own (same results, no copy).

    Args:
        xs: floating tensors ``[..., N_i]`` on one device.
        block: tile length.
        kernel: the backend, as in :func:`quantize`.

    Returns:
        ``[(payload_i [M_i, nb_i * block] E4M3, scales_i [M_i, nb_i] fp32)]`` in the order of ``xs``
        (views of one payload/scale buffer per distinct ``N``: they share its storage).
    """
    groups: dict[int, list[int]] = {}
    rows: list[torch.Tensor] = []
    for i, x in enumerate(xs):
        _check(x, block, "quantize_many")
        x = x.detach()
        if x.dim() == 0:
            x = x.reshape(1)
        rows.append(x.reshape(-1, x.shape[-1]))
        alone = x.numel() * x.element_size() >= BATCH_ALONE_BYTES
        groups.setdefault(-1 - i if alone else x.shape[-1], []).append(i)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(xs)  # type: ignore[list-item]
    for idx in groups.values():
        parts = [rows[i] for i in idx]
        cat = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()  # float promotion is exact
        payload, scales = _quantize_rows(cat, block, kernel)
        off = 0
        for i in idx:
            m = rows[i].shape[0]
            out[i] = (payload[off:off + m], scales[off:off + m])
            off += m
    return out


def _dequantize_rows(payload: torch.Tensor, scales: torch.Tensor, n: int, kernel: str = "auto") -> torch.Tensor:
    """``[M, nb * block]`` E4M3 + ``[M, nb]`` scales -> ``[M, N]`` fp32 (contiguous; padding dropped), by the backend
    ``kernel`` picks for the payload's device (:mod:`moonrt.ops.kernels`, op ``fp8_dequantize``); every backend gives
    the same bits."""
    return kernels.kernel("fp8_dequantize", kernel, payload.device)(payload, scales, n)


def dequantize_rows_numba(payload: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`_dequantize_rows` in one fused numba pass (CPU tensors; no GIL): table lookup times the tile's scale."""
    m, width = payload.shape
    block = width // scales.shape[-1]
    x = torch.empty(m, n, dtype=torch.float32, device=payload.device)
    if m * n:
        _decode_cpu(payload.view(torch.uint8).numpy(), scales.float().numpy(), _lut(payload.device).numpy(), x.numpy(),
                    block)
    return x


def dequantize_rows_torch(payload: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`_dequantize_rows` in torch ops (any device; the reference)."""
    m, width = payload.shape
    nb = scales.shape[-1]
    block = width // nb
    codes = payload.view(torch.uint8)
    x = _lut(payload.device).index_select(0, codes[:, :n].to(torch.int32).reshape(-1)).view(m, n)
    full = n // block
    if full:
        x[:, :full * block].view(m, full, block).mul_(scales[:, :full, None])
    if full < nb:
        x[:, full * block:].mul_(scales[:, full:])
    return x


@njit(cache=True, nogil=True, boundscheck=False)
def _decode_cpu(codes: np.ndarray, scales: np.ndarray, lut: np.ndarray, out: np.ndarray, block: int) -> None:
    """``out[i, j] = lut[codes[i, j]] * scales[i, j // block]`` for ``out [M, N]`` (one fp32 product per element,
    as the torch path's ``mul_``: bitwise the same). Releases the GIL, so a decode on the manager's copy thread
    runs beside the backward."""
    m, n = out.shape
    nb = scales.shape[1]
    for i in range(m):
        for b in range(nb):
            s = scales[i, b]
            for j in range(b * block, min((b + 1) * block, n)):
                out[i, j] = lut[codes[i, j]] * s


def dequantize(payload: torch.Tensor, scales: torch.Tensor, shape: torch.Size | tuple[int, ...],
               dtype: torch.dtype, *, kernel: str = "auto") -> torch.Tensor:
    """Inverse of :func:`quantize`.

    Args:
        payload: ``[M, nb * block]`` ``float8_e4m3fn`` from :func:`quantize`.
        scales: ``[M, nb]`` fp32 from :func:`quantize`.
        shape: the original shape ``[..., N]`` (padding past ``N`` is dropped).
        dtype: dtype of the result.
        kernel: the backend, as in :func:`quantize`.

    Returns:
        ``[shape]`` tensor of ``dtype`` on ``payload``'s device (contiguous).
    """
    m, width = payload.shape
    nb = scales.shape[-1]
    if scales.shape[0] != m or width % nb:
        raise ValueError(f"dequantize: payload {tuple(payload.shape)} and scales {tuple(scales.shape)} do not match")
    shape = tuple(shape)
    n = shape[-1] if shape else 1
    return _dequantize_rows(payload, scales, n, kernel).to(dtype).reshape(shape)


def _stacked(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(ts)`` of 2-D row blocks; a view without copying when they are consecutive rows of one
    buffer (what :func:`quantize_many` returns for one group)."""
    first = ts[0]
    if len(ts) == 1:
        return first
    sptr = first.untyped_storage()._cdata
    nxt = first.storage_offset()
    width = first.shape[1]
    for t in ts:
        if not t.is_contiguous() or t.storage_offset() != nxt or t.untyped_storage()._cdata != sptr:
            return torch.cat(ts)
        nxt += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, width), (width, 1))


def dequantize_many(items: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], torch.dtype]], *,
                    kernel: str = "auto") -> list[torch.Tensor]:
    """:func:`dequantize` of several tensors, one batched decode per (payload width, scale count, N)
    (bitwise the same results).

    Args:
        items: ``[(payload_i [M_i, nb * block], scales_i [M_i, nb], shape_i [..., N], dtype_i)]``.
        kernel: the backend, as in :func:`quantize`.

    Returns:
        ``[shape_i]`` tensors of ``dtype_i`` (views of one decoded buffer per group when its dtype is fp32).
    """
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, (payload, scales, shape, _) in enumerate(items):
        if scales.shape[0] != payload.shape[0] or payload.shape[1] % scales.shape[-1]:
            raise ValueError(f"dequantize_many: items[{i}]: payload {tuple(payload.shape)} and scales "
                             f"{tuple(scales.shape)} do not match")
        n = shape[-1] if len(shape) else 1
        groups.setdefault((payload.shape[1], scales.shape[1], n), []).append(i)
    out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
    for (_, _, n), idx in groups.items():
        if len(idx) == 1:
            p, s, shape, dtype = items[idx[0]]
            out[idx[0]] = _dequantize_rows(p, s, n, kernel).to(dtype).reshape(tuple(shape))
            continue
        x = _dequantize_rows(_stacked([items[i][0] for i in idx]), _stacked([items[i][1] for i in idx]), n, kernel)
        off = 0
        for i in idx:
            _, s, shape, dtype = items[i]
            m = s.shape[0]
            out[i] = x[off:off + m].to(dtype).reshape(tuple(shape))
            off += m
    return out


def stored_bytes(shape: torch.Size | tuple[int, ...], block: int = 128) -> int:
    """Bytes :func:`quantize` stores for a tensor of ``shape`` (payload + fp32 scales)."""
    shape = tuple(shape) or (1,)
    n = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    nb = -(-n // block)
    return m * nb * block + 4 * m * nb


__all__ = ["E4M3", "E4M3_MAX", "dequantize", "dequantize_many", "quantize", "quantize_many", "stored_bytes"]
