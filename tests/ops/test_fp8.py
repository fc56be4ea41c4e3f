"""Block-wise FP8 storage (K3_SYSTEMS §8): round-trip error, exact zeros, padding, byte savings."""

from __future__ import annotations

import pytest
import torch
from numerics import rel_l2

import moonrt.ops.fp8.codec as fp8


@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 128), (17, 300), (1000,), (4, 1)])
def test_roundtrip_gaussian_within_3_percent(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    payload, scales = fp8.quantize(x)
    assert payload.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    y = fp8.dequantize(payload, scales, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_l2(y, x) <= 0.03


def test_gaussian_error_close_to_report():
    torch.manual_seed(1)
    x = torch.randn(256, 1024)
    y = fp8.dequantize(*fp8.quantize(x), x.shape, x.dtype)
    assert 0.015 < rel_l2(y, x) < 0.03  # report: ~2.6%


def test_zeros_exact_and_mixed_tiles():
    x = torch.zeros(8, 256)
    x[0, 128:] = torch.randn(128)  # one nonzero tile next to all-zero tiles
    y = fp8.dequantize(*fp8.quantize(x), x.shape, x.dtype)
    assert torch.equal(y[1:], torch.zeros(7, 256)) and torch.equal(y[0, :128], torch.zeros(128))
    assert torch.equal(fp8.dequantize(*fp8.quantize(torch.zeros(3, 7)), (3, 7), torch.float32), torch.zeros(3, 7))


def test_padding_last_dim_not_multiple_of_block():
    torch.manual_seed(2)
    x = torch.randn(5, 130) * 1000  # large values: the per-tile scale handles range
    payload, scales = fp8.quantize(x)
    assert payload.shape == (5, 256) and scales.shape == (5, 2)
    assert torch.equal(payload[:, 130:].float(), torch.zeros(5, 126))
    y = fp8.dequantize(payload, scales, x.shape, x.dtype)
    assert rel_l2(y, x) <= 0.03
    # a tile's max element is represented exactly (it maps to 448)
    i = x[:, :128].abs().argmax(dim=1)
    assert torch.allclose(y[torch.arange(5), i], x[torch.arange(5), i], rtol=1e-6)


def test_bytes_saved_vs_bf16_and_fp32():
    x32 = torch.randn(64, 1024)
    for x, lo, hi in ((x32.bfloat16(), 1.9, 2.0), (x32, 3.8, 4.0)):
        payload, scales = fp8.quantize(x)
        stored = payload.numel() * payload.element_size() + scales.numel() * scales.element_size()
        assert stored == fp8.stored_bytes(x.shape)
        ratio = x.numel() * x.element_size() / stored
        assert lo < ratio < hi, ratio


def test_bad_input():
    with pytest.raises(ValueError, match="floating dtype"):
        fp8.quantize(torch.arange(10))
    with pytest.raises(ValueError, match="block"):
        fp8.quantize(torch.randn(4), block=0)


def _reference_quantize(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec as first written (pad to whole tiles, scale, round): the formula the fast paths must
    reproduce bit for bit."""
    x = x.reshape(1) if x.dim() == 0 else x
    n = x.shape[-1]
    nb = -(-n // block)
    x2 = torch.nn.functional.pad(x.detach().reshape(-1, n).float(), (0, nb * block - n))
    tiles = x2.view(x2.shape[0], nb, block)
    amax = tiles.abs().amax(dim=-1)
    inv = torch.where(amax > 0, fp8.E4M3_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(amax))
    payload = (tiles * inv.unsqueeze(-1)).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3)
    return payload.view(x2.shape[0], nb * block), amax / fp8.E4M3_MAX


def _reference_dequantize(payload, scales, shape, dtype):
    m, width = payload.shape
    nb = scales.shape[-1]
    x = (payload.view(m, nb, width // nb).float() * scales.unsqueeze(-1)).view(m, width)
    return x[:, :shape[-1] if shape else 1].to(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


CASES = [((64, 256), torch.float32), ((3, 5, 128), torch.float32), ((17, 300), torch.float32), ((1000,), torch.float32),
         ((4, 1), torch.float32), ((7, 56), torch.bfloat16), ((2, 3, 200), torch.float16), ((), torch.float32),
         ((9, 56), torch.float32), ((5, 384), torch.bfloat16), ((6, 56), torch.float64)]


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    xs = []
    for i, (shape, dtype) in enumerate(CASES):
        x = torch.randn(shape, generator=g) * 10.0 ** (i % 5 - 2)
        if x.dim() >= 2:
            x[0] = 0  # all-zero tiles
            x[-1] = 1e-30  # a tiny tile (scale near the fp32 minimum)
        xs.append(x.to(dtype))
    xs.append(torch.randn(8, 300, generator=g)[:, ::2])  # non-contiguous input, 150 wide
    return xs


def test_fast_codec_bitwise_equals_reference():
    for x in _inputs():
        p, s = fp8.quantize(x)
        rp, rs = _reference_quantize(x)
        assert p.shape == rp.shape and torch.equal(_bits(p), _bits(rp)), tuple(x.shape)
        assert torch.equal(_bits(s), _bits(rs)), tuple(x.shape)
        y = fp8.dequantize(p, s, x.shape, x.dtype)
        ry = _reference_dequantize(rp, rs, tuple(x.shape), x.dtype)
        assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(_bits(y), _bits(ry)), tuple(x.shape)


def test_cpu_decode_bitwise_equals_reference_in_any_thread():
    """The CPU decode (one numba pass, no GIL) of a large tensor with a padded last tile, a tiny tile and
    non-contiguous codes: bitwise the reference decode, in the calling thread and in another thread at once."""
    import concurrent.futures

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2_400_037, generator=g) * 3.0
    x[1, :500] = 1e-30
    p, s = fp8.quantize(x)
    ry = _reference_dequantize(p, s, tuple(x.shape), x.dtype)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        others = [pool.submit(fp8.dequantize, p, s, x.shape, x.dtype) for _ in range(2)]
        mine = fp8.dequantize(p, s, x.shape, x.dtype)
        ys = [mine] + [f.result() for f in others]
    for y in ys:
        assert torch.equal(_bits(y), _bits(ry))
    sub = fp8._dequantize_rows(p[::2], s[::2], x.shape[1])  # strided rows of the payload and scales
    assert torch.equal(_bits(sub), _bits(ry[::2]))


@pytest.mark.parametrize("alone_bytes", [1 << 20, 1000])
def test_batched_codec_bitwise_equals_per_tensor(monkeypatch, alone_bytes):
    """quantize_many / dequantize_many (one call per row width, tensors concatenated; large tensors on
    their own) give every tensor exactly the payload, scales and decoded values of its own quantize /
    dequantize call."""
    monkeypatch.setattr(fp8, "BATCH_ALONE_BYTES", alone_bytes)
    xs = _inputs()
    xs += [x * 3 for x in xs]  # groups with several members of every width
    batched = fp8.quantize_many(xs)
    for x, (p, s) in zip(xs, batched):
        rp, rs = fp8.quantize(x)
        assert torch.equal(_bits(p), _bits(rp)) and torch.equal(_bits(s), _bits(rs)), tuple(x.shape)
    ys = fp8.dequantize_many([(p, s, tuple(x.shape), x.dtype) for x, (p, s) in zip(xs, batched)])
    for x, (p, s), y in zip(xs, batched, ys):
        assert torch.equal(_bits(y), _bits(fp8.dequantize(p, s, x.shape, x.dtype))), tuple(x.shape)
    # decoding rows that are not views of one buffer (copied parts, as from an offload tier) is the same
    copied = fp8.dequantize_many([(p.clone(), s.clone(), tuple(x.shape), x.dtype) for x, (p, s) in zip(xs, batched)])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(copied, ys))
    with pytest.raises(ValueError, match=r"quantize_many: x.dtype = torch.int64"):
        fp8.quantize_many([torch.randn(3), torch.arange(3)])


def _elementwise_bound(x: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The codec's per-element round-trip bound (module docstring) for ``x [M, N]`` fp32:
    ``2^-4 |x| + 2^-10 s + 2^-149``, with ``s`` the tile's stored scale. E4M3 has 3 mantissa bits
    (half an ulp is 2^-4 relative in its normal range) and subnormal spacing 2^-9 (half: 2^-10 in units of
    ``s``); the fp32 scale, its reciprocal and the decode multiply add a few fp32 ulps (the 1e-5 factor,
    2^-24 relative each) and one rounding to fp32's subnormal grid (< 2^-149)."""
    s = scales.repeat_interleave(block, dim=1)[:, :x.shape[1]]
    return (2.0 ** -4 * (1 + 1e-5)) * x.abs() + 2.0 ** -10 * s + 2.0 ** -149


def test_tiny_and_subnormal_tiles_roundtrip_within_bound():
    """A tile whose largest magnitude is subnormal, or too small for ``448 / amax`` to be a finite fp32
    (< 1.3e-36), round-trips without NaN or inf within the per-element bound, relative to its own scale;
    zeros inside such a tile and all-zero tiles stay exactly zero."""
    g = torch.Generator().manual_seed(4)
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal fp32
    rows = []
    for amax in (1e-30, 1e-36, 5e-36, tiny, 1e-38, 1e-40, 1e-43, 2.0 ** -149 * 300, 2.0 ** -149 * 7, 2.0 ** -149):
        r = torch.randn(2 * 128, generator=g)
        r = r / r.abs().max() * amax
        r[::5] = 0  # zeros inside the tiny tile
        r[128:] = 0  # and an all-zero tile next to it
        rows.append(r)
    x = torch.stack(rows).float()
    assert (x[:, :128].abs().amax(dim=1) > 0).all()  # every tiny tile is nonzero in fp32
    payload, scales = fp8.quantize(x)
    assert torch.isfinite(scales).all() and (scales[:, 0] > 0).all()
    assert torch.equal(scales[:, 1], torch.zeros(len(rows)))
    y = fp8.dequantize(payload, scales, x.shape, x.dtype)
    assert torch.isfinite(y).all()
    assert torch.equal(y[x == 0], torch.zeros(int((x == 0).sum())))
    err = (y.double() - x.double()).abs()
    assert (err <= _elementwise_bound(x.double(), scales.double())).all()
    # relative to the tile: the scale uses at least half of E4M3's range (s <= amax / 224)
    assert (scales[:, 0].double() <= x[:, :128].abs().amax(dim=1).double() / 224 + 2.0 ** -149).all()
    # the same tile, alone or batched
    [(bp, bs)] = fp8.quantize_many([x])
    assert torch.equal(_bits(bp), _bits(payload)) and torch.equal(_bits(bs), _bits(scales))
    # a tiny tile that is the zero-padded last tile, after an ordinary one (N = 200)
    xp = torch.cat([torch.randn(len(rows), 128, generator=g), x[:, :72]], dim=1)
    pp, ps = fp8.quantize(xp)
    yp = fp8.dequantize(pp, ps, xp.shape, xp.dtype)
    assert pp.shape == (len(rows), 256) and torch.equal(pp[:, 200:].view(torch.uint8), torch.zeros(len(rows), 56,
                                                                                                    dtype=torch.uint8))
    assert torch.equal(_bits(pp[:, :128]), _bits(fp8.quantize(xp[:, :128])[0]))  # ordinary tiles unchanged
    assert torch.equal(yp[xp == 0], torch.zeros(int((xp == 0).sum())))
    assert ((yp.double() - xp.double()).abs() <= _elementwise_bound(xp.double(), ps.double())).all()


def test_elementwise_bound_holds_on_gaussian_tiles():
    """The per-element bound is the codec's, not a special case: it holds for ordinary tiles too."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    payload, scales = fp8.quantize(x)
    y = fp8.dequantize(payload, scales, x.shape, x.dtype)
    err = (y.double() - x.double()).abs()
    assert (err <= _elementwise_bound(x.double(), scales.double())).all()


def test_cpu_cast_equals_torch_cast():
    """The CPU codec's fp32 -> E4M3 encoding (numba) equals torch's cast on every E4M3 value and the midpoints
    between neighbours (+-8 fp32 ulps), a stride through all fp32 patterns up to 464 (the codec's range: scaled
    values are at most 448 (1 + 2 ulp)), subnormals of both formats, zeros and NaNs, both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    finite = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    centers = torch.cat([finite, mids, torch.tensor([2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 464.0])]).view(torch.int32)
    near = (centers[:, None] + torch.arange(-8, 9, dtype=torch.int32)).reshape(-1)
    stride = torch.arange(0, 0x43E80000 + 1, 9973, dtype=torch.int64).to(torch.int32)
    tiny = torch.arange(0, 4096, dtype=torch.int32)  # fp32 subnormals and the smallest normals' neighbourhood
    bits = torch.cat([near[near >= 0], stride, tiny, torch.tensor([0x7FC00000, 0x7F800001], dtype=torch.int32)])
    v = bits.view(torch.float32)
    v = torch.cat([v, -v])
    v = v[~(v.abs() > 464)]  # (NaNs stay)
    assert v.isnan().sum() == 4 and v.numel() > 200_000
    out = torch.empty(v.numel(), dtype=torch.uint8)
    fp8._cast_e4m3_cpu(v.numpy(), out.numpy())
    assert torch.equal(out, v.to(fp8.E4M3).view(torch.uint8))


def test_cpu_quantize_bitwise_equals_torch_ops():
    """The CPU codec (one numba pass per tile) gives the payload and scales of the torch-ops codec bit for bit:
    padded last tiles, all-zero, tiny (re-encoded) and NaN / inf tiles included."""
    g = torch.Generator().manual_seed(11)
    for m, n in ((5, 1), (9, 56), (16, 128), (7, 300), (3, 1000)):
        x = torch.randn(m, n, generator=g) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=g)
        x[0] = 0
        if m > 3:
            x[1, : min(n, 130)] = 1e-38  # a tiny tile (scale below fp32's normals)
            x[2, 0] = float("nan")
            x[3, -1] = float("inf")
        p, s = fp8._quantize_rows(x, 128)
        rp, rs = fp8.quantize_rows_torch(x, 128)
        assert torch.equal(_bits(p), _bits(rp)), (m, n)
        assert torch.equal(_bits(s), _bits(rs)), (m, n)
