"""Quantization-aware training ops (issue 33 item 2): the fake-quantizer is the MX codec's round trip, bit for bit;
its gradient is the straight-through identity; the grouped experts and the shared-expert FFN under QAT are the
plain computation on fake-quantized operands, forward and gradients; bad input is one clear error."""

from __future__ import annotations

import pytest
import torch

from moonrt.models.k3.model.ffn import GLUFFN
from moonrt.ops import mx
from moonrt.ops.glu import glu_activation
from moonrt.ops.grouped import grouped_glu_experts
from moonrt.ops.qat import QATScheme, fake_quantize, scheme_for


def _adversarial(n: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian rows with a few blocks of exact FP4/FP8 values, midpoints, zeros, signed zeros and huge magnitudes."""
    x = torch.randn(n, 64, generator=gen) * torch.logspace(-6, 6, n).unsqueeze(1)
    x[0, :16] = torch.tensor(mx.FP4_VALUES)
    x[0, 16:32] = torch.tensor(mx.FP4_VALUES) + 0.25
    x[1, :32] = 0.0
    x[1, 32:] = -0.0
    x[2, 5] = 3.0e38
    return x


@pytest.mark.parametrize("fmt", mx.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", mx.SCALE_MODES)
def test_fake_quantize_is_the_codec_round_trip_bitwise(fmt, dtype, mode):
    x = _adversarial(16, torch.Generator().manual_seed(0)).to(dtype)
    for block in (32, 8):
        got = fake_quantize(x, fmt, block, mode)
        want = mx.dequantize(mx.quantize(x, fmt, axis=-1, block=block, scale_mode=mode), dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                  want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_straight_through_gradient_is_the_identity_on_every_element():
    x = _adversarial(8, torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    (fake_quantize(x, "mxfp4", 32) * g).sum().backward()
    assert torch.equal(x.grad, g)  # saturated elements (x[2, 5] and its block's clamped ones) included


def _ste_reference(x, cu, wg, wu, wd, q: QATScheme, act="situ"):
    """Per-expert composed autograd ops on STE fake-quantized operands (no grouped node)."""
    out = x.new_zeros(x.shape[0], wd.shape[1])
    xq = q.act(x)
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if b == a:
            continue
        h = glu_activation(xq[a:b] @ q.weight(wg[i]).t(), xq[a:b] @ q.weight(wu[i]).t(), act)
        out = out.index_add(0, torch.arange(a, b), q.act(h) @ q.weight(wd[i]).t())
    return out


def test_grouped_experts_under_qat_are_the_plain_experts_on_fake_quantized_operands():
    gen = torch.Generator().manual_seed(3)
    E, H, F, rows = 4, 64, 32, 40
    x = torch.randn(rows, H, generator=gen).requires_grad_()
    ws = [(torch.randn(E, F, H, generator=gen) * 0.1).requires_grad_(),
          (torch.randn(E, F, H, generator=gen) * 0.1).requires_grad_(),
          (torch.randn(E, H, F, generator=gen) * 0.1).requires_grad_()]
    cu = [0, 12, 12, 30, 40]
    q = QATScheme(block=32)
    g = torch.randn(rows, H, generator=gen)
    got = grouped_glu_experts(x, torch.tensor(cu), *ws, qat=q)
    grads = torch.autograd.grad((got * g).sum(), [x, *ws])
    want = _ste_reference(x, cu, *ws, q)
    wgrads = torch.autograd.grad((want * g).sum(), [x, *ws])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the no-grad path (eval) computes the same forward
        assert torch.equal(grouped_glu_experts(x, torch.tensor(cu), *ws, qat=q), got.detach())
    plain = grouped_glu_experts(x, torch.tensor(cu), *ws)
    assert not torch.allclose(plain, got)  # QAT changed the numbers


def test_shared_expert_ffn_under_qat():
    torch.manual_seed(4)
    ffn = GLUFFN(64, 32, init_std=0.1)
    x = torch.randn(2, 5, 64, requires_grad=True)
    q = QATScheme(block=32)
    ffn.qat = q
    got = ffn(x)
    with torch.no_grad():
        xq = fake_quantize(x, "mxfp8_e4m3", 32)
        h = glu_activation(xq @ fake_quantize(ffn.gate_proj.weight, "mxfp4").t(),
                           xq @ fake_quantize(ffn.up_proj.weight, "mxfp4").t(), "situ")
        want = fake_quantize(h, "mxfp8_e4m3") @ fake_quantize(ffn.down_proj.weight, "mxfp4").t()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()  # straight through: the fp32 master weights get gradients
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ffn.parameters())
    # gradients: the composed autograd ops on STE fake-quantized operands
    x2 = x.detach().requires_grad_()
    ws = [ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight]
    ref = [w.detach().requires_grad_() for w in ws]
    xq = q.act(x2)
    h = glu_activation(xq @ q.weight(ref[0]).t(), xq @ q.weight(ref[1]).t(), "situ")
    (q.act(h) @ q.weight(ref[2]).t()).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-7)
    for w, r in zip(ws, ref):
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-5, atol=1e-7)
    # bf16 autocast: the same fake-quantized operands, the products in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = ffn(x.detach())
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), want, rtol=0.05, atol=0.02)


def test_bad_qat_input_is_one_clear_error():
    with pytest.raises(ValueError, match=r"qat = 'mxfp3': expected one of none, mxfp4"):
        scheme_for("mxfp3")
    with pytest.raises(ValueError, match=r"block = 3: mxfp4 packs two codes a byte"):
        QATScheme(block=3)
    with pytest.raises(ValueError, match=r"weight_format = 'int4': expected one of"):
        QATScheme(weight_format="int4")
    with pytest.raises(ValueError, match=r"qat block = 32: expected a divisor of the reduction axis of the experts' "
                                         r"down projection \(F\) \(length 56\)"):
        grouped_glu_experts(torch.randn(4, 64), torch.tensor([0, 4]), torch.randn(1, 56, 64), torch.randn(1, 56, 64),
                            torch.randn(1, 64, 56), qat=QATScheme())
    assert scheme_for("none") is None


def test_grouped_qat_node_saves_no_quantized_weight_copy():
    """The grouped node and the shared-expert linears save the parameters themselves and quantize them again in
    backward (no quantized copy held from a layer's forward to its backward)."""
    gen = torch.Generator().manual_seed(5)
    ws = [(torch.randn(2, 32, 64, generator=gen) * 0.1).requires_grad_() for _ in range(2)]
    ws.append((torch.randn(2, 64, 32, generator=gen) * 0.1).requires_grad_())
    x = torch.randn(8, 64, generator=gen, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grouped_glu_experts(x, torch.tensor([0, 3, 8]), *ws, qat=QATScheme())
    params = {w.untyped_storage().data_ptr() for w in ws}
    weight_sized = [t for t in saved if t.dim() >= 2 and t.shape[-2:] in ((32, 64), (64, 32))]
    assert weight_sized and all(t.untyped_storage().data_ptr() in params for t in weight_sized)
    ffn = GLUFFN(64, 32, init_std=0.1)
    ffn.qat = QATScheme()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ffn(torch.randn(4, 64, requires_grad=True))
    params = {p.untyped_storage().data_ptr() for p in ffn.parameters()}
    weight_sized = [t for t in saved if t.shape in ((32, 64), (64, 32))]
    assert len(weight_sized) == 3 and all(t.untyped_storage().data_ptr() in params for t in weight_sized)
