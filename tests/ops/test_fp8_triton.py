"""The Triton FP8 block codec (moonrt.ops.fp8.triton) is bitwise the CPU codec (numba, moonrt.ops.fp8.codec).

Runs under Triton's interpreter on CPU tensors (the ``triton_kernels`` fixture; CI: ``MOONRT_REQUIRE_TRITON=1`` makes
a missing Triton a failure), on the GPU with ``MOONRT_TEST_DEVICE=cuda``. Payload codes, scales and decoded values
are compared as bits (NaNs included: the Triton kernels write out the CPU codec's NaN rules). Small shapes: the
interpreter runs each program in numpy."""

from __future__ import annotations

import re

import pytest
import torch

import moonrt.ops.fp8.codec as fp8

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0


@pytest.fixture(scope="module")
def ft(triton_kernels):
    return triton_kernels.load("moonrt.ops.fp8.triton")


@pytest.fixture(scope="module")
def dev(triton_kernels) -> torch.device:
    return triton_kernels.device


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8) if t.element_size() == 1 else t.cpu().view(torch.int32)


def _check(ft, dev: torch.device, x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton encode and decode of ``x [M, N]`` fp32 against the numba codec, bit for bit; returns the payload and
    scales."""
    p, s = ft.quantize_rows(x.to(dev), block)
    rp, rs = fp8.quantize_rows_numba(x, block)
    assert p.dtype == fp8.E4M3 and p.shape == rp.shape and s.shape == rs.shape
    bad = (_bits(p) != _bits(rp)).nonzero()
    assert not len(bad), [(x[i, j].item(), hex(_bits(p)[i, j]), hex(_bits(rp)[i, j])) for i, j in bad[:5].tolist()]
    assert torch.equal(_bits(s), _bits(rs)), (s, rs)
    n = x.shape[1]
    y = ft.dequantize_rows(p, s, n)
    ry = fp8.dequantize_rows_numba(rp, rs, n)
    assert y.shape == (x.shape[0], n) and torch.equal(_bits(y), _bits(ry))
    return p, s


def test_every_e4m3_value_times_scales(ft, dev) -> None:
    """All 256 codes as inputs (the finite ones times each scale, normal, tiny and huge; NaNs in their own rows):
    encoded and decoded bitwise as the CPU codec; a row whose amax is 448 x a power of two round-trips exactly."""
    lut = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()
    finite = lut[torch.isfinite(lut)]  # 254 values, both zeros
    row = torch.cat([finite, finite.new_zeros(2)])  # two tiles of 128
    scales = [1.0, 2.0 ** -10, 2.0 ** 20, 3.7, 1e-3, 0.1234567, 2.0 ** -133, 1e-40, 7e-44, 1e30]
    x = torch.stack([row * s for s in scales])
    nan_rows = torch.stack([lut, lut.flip(0)])  # NaN codes 0x7F and 0xFF amid every value: NaN tiles
    x = torch.cat([x, nan_rows])
    p, s = _check(ft, dev, x)
    for i, sc in enumerate(scales[:3]):  # exact powers of two with an amax of 448 * sc: decode(encode(x)) == x
        y = fp8.dequantize_rows_numba(p[i:i + 1].cpu(), s[i:i + 1].cpu(), x.shape[1])
        assert torch.equal(y[0], x[i]), sc


@pytest.mark.parametrize("shape,block", [((6, 300), 128), ((3, 128), 128), ((4, 100), 32), ((5, 77), 48),
                                         ((2, 1), 128)])
def test_random_tiles_and_ragged_last_tile(ft, dev, shape, block) -> None:
    """Gaussian tiles over seven decades, N not a multiple of the block (a ragged last tile, N < block, a block
    that is not a power of two), and strided payload rows on decode."""
    g = torch.Generator().manual_seed(sum(shape) + block)
    x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 4, (shape[0], 1), generator=g).float()
    p, s = _check(ft, dev, x, block)
    sub = ft.dequantize_rows(p[::2], s[::2], shape[1])
    assert torch.equal(_bits(sub), _bits(fp8.dequantize_rows_numba(p[::2].cpu(), s[::2].cpu(), shape[1])))


def test_adversarial_tiles(ft, dev) -> None:
    """NaN (both signs), +-inf, inf beside NaN, all-zero and -0 tiles, subnormal and tiny-amax tiles (the
    power-of-two scale path, down to fp32's smallest subnormal), amax at and just below 448 * 2^-126, and values
    straddling E4M3's rounding midpoints."""
    n = 256 + 40  # two full tiles and a ragged one
    x = torch.randn(14, n, generator=torch.Generator().manual_seed(7))
    x[0, 3] = float("nan")
    x[0, 140] = -float("nan")
    x[1, :128] = float("inf")
    x[1, 5] = -1.0
    x[1, 200] = -float("inf")
    x[1, 270] = float("nan")
    x[1, 271] = float("inf")
    x[2] = 0.0
    x[2, 1] = -0.0
    x[2, 260:] = -0.0
    x[3] = torch.tensor(2 ** -149).float() * torch.arange(n).remainder(7).float()  # subnormals: 0..6 ulp
    x[4] = 1e-38 * torch.randn(n, generator=torch.Generator().manual_seed(8))
    min_amax = fp8._MIN_NORMAL_AMAX
    x[5] = torch.linspace(-1, 1, n) * min_amax
    x[5, 0] = min_amax  # amax exactly at the bound: the normal path
    x[6] = torch.linspace(-1, 1, n) * min_amax
    x[6, 0] = torch.tensor(min_amax).nextafter(torch.tensor(0.0)).item()  # just below: the small-tile path
    x[6, 129] = torch.finfo(torch.float32).smallest_normal
    x[7] = -torch.finfo(torch.float32).max
    x[8] = torch.finfo(torch.float32).max * torch.rand(n, generator=torch.Generator().manual_seed(9))
    mids = torch.arange(256, dtype=torch.uint8).view(fp8.E4M3).float()[:126]
    mids = (mids[1:] + mids[:-1]) / 2  # E4M3 rounding midpoints (ties to even), with 448 the amax
    x[9, :125] = mids
    x[9, 125] = 448.0
    x[10] = torch.tensor(float.fromhex("0x1.fffffep-7")).repeat(n)  # just below E4M3's smallest normal
    x[10, 0] = 448.0
    x[11, :128] = torch.tensor([2 ** -149, -(2 ** -149)]).repeat(64)  # one-ulp tile: amax the smallest subnormal
    x[12] = float("nan")
    x[13, 256:] = 0.0
    x[13, 290] = 3e-40
    _check(ft, dev, x)


def test_public_api_through_the_registry(ft, dev) -> None:
    """``kernel="triton"`` in quantize / quantize_many / dequantize / dequantize_many reaches the Triton codec (on
    CPU tensors under the interpreter), with the results of the default CPU codec."""
    x = torch.randn(2, 3, 130, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    p, s = fp8.quantize(x.to(dev), kernel="triton")
    rp, rs = fp8.quantize(x)
    assert torch.equal(_bits(p), _bits(rp)) and torch.equal(_bits(s), _bits(rs))
    y = fp8.dequantize(p, s, x.shape, torch.float32, kernel="triton")
    assert torch.equal(_bits(y), _bits(fp8.dequantize(rp, rs, x.shape, torch.float32)))
    many = fp8.quantize_many([x.to(dev), x[0].to(dev)], kernel="triton")
    outs = fp8.dequantize_many([(pp, ss, tuple(t.shape), t.dtype) for (pp, ss), t in zip(many, (x, x[0]))],
                               kernel="triton")
    assert torch.equal(outs[0].cpu(), fp8.dequantize(rp, rs, x.shape, x.dtype)) and torch.equal(outs[1].cpu(),
                                                                                              outs[0][0].cpu())


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import moonrt.ops.fp8.triton as ft
sig = {"quantize": (ft._quantize_kernel, {"x_ptr": "*fp32", "payload_ptr": "*u8", "scales_ptr": "*fp32", "M": "i32",
                                          "N": "i32", "NB": "i32", "min_amax": "fp32"}),
       "dequantize": (ft._dequantize_kernel, {"codes_ptr": "*u8", "scales_ptr": "*fp32", "lut_ptr": "*fp32",
                                              "out_ptr": "*fp32", "M": "i32", "N": "i32", "NB": "i32",
                                              "code_stride": "i32", "scale_stride": "i32"})}
out = {}
for name, (fn, s) in sig.items():
    const = {"BLOCK": 48, "BLOCK_P2": 64, "TILES": 8}
    src = ASTSource(fn, signature={**s, **{k: "constexpr" for k in const}}, constexprs=const)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
json.dump(out, sys.stdout)
"""


def test_kernels_compile_for_a_gpu_with_ieee_arithmetic(triton_kernels) -> None:
    """What the interpreter cannot show: compiled for sm_90 (no GPU needed; Triton ships ptxas), the kernels use only
    IEEE-rounded fp32 arithmetic, the condition for the GPU's bits to be the interpreter's: divisions ``div.rn``
    (no approximate ``div.full`` / ``rcp.approx``), no fused multiply-add (the products are rounded before the sum
    of 2^14), no flush of subnormals to zero."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = json.loads(r.stdout)
    for name, text in ptx.items():
        ops = set(re.findall(r"\b(?:div|rcp|sqrt|fma|mad|mul|add|cvt|ex2)\.[a-z0-9.]+", text))
        assert not [o for o in ops if ".ftz" in o or ".approx" in o or ".full" in o], (name, sorted(ops))
        assert not [o for o in ops if o.startswith(("fma.", "mad.")) and ("f32" in o or "f64" in o)], (name, ops)
        if name == "quantize":
            assert {"div.rn.f32", "div.rn.f64", "mul.f32", "add.f32"} <= ops, sorted(ops)


def test_tile_index_math_is_int64_past_2_31_tiles(ft, dev):
    """``M * NB > 2^31`` (2^20 rows of 2^12 tiles, a 4 GiB payload) without allocating it: program 0 of each kernel
    on buffers holding only row 0's first 8 tiles (what that program touches) must encode/decode them as the CPU
    codec does. With ``M * NB`` in int32 (2^32 wraps to 0) no tile is live and nothing is written."""
    block, nb, m = 16, 1 << 12, 1 << 20
    assert m * nb >= 2**32
    n = nb * block
    tiles = ft.TILES_PER_PROGRAM
    x = torch.randn(1, tiles * block, generator=torch.Generator().manual_seed(3))
    ref_p, ref_s = fp8.quantize_rows_numba(x, block)
    payload = torch.full((tiles * block,), 0xAB, dtype=torch.uint8, device=dev)
    scales = torch.full((tiles,), -1.0, device=dev)
    ft._quantize_kernel[(1,)](x.to(dev), payload, scales, m, n, nb, fp8._MIN_NORMAL_AMAX, BLOCK=block,
                              BLOCK_P2=block, TILES=tiles)
    assert torch.equal(payload.cpu(), ref_p.view(torch.uint8)[0])
    assert torch.equal(_bits(scales), _bits(ref_s[0]))
    out = torch.full((tiles * block,), -7.0, device=dev)
    ft._dequantize_kernel[(1,)](payload, scales, fp8._lut(payload.device), out, m, n, nb, n, nb, BLOCK=block,
                                BLOCK_P2=block, TILES=tiles)
    assert torch.equal(_bits(out), _bits(fp8.dequantize_rows_numba(ref_p, ref_s, tiles * block)[0]))
