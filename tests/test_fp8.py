"""Block-wise FP8 storage (K3_SYSTEMS §8): round-trip error, exact zeros, padding, byte savings."""

from __future__ import annotations

import pytest
import torch
from numerics import rel_l2

from moonrt.ops import fp8


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
