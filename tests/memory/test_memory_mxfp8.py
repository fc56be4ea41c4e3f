"""The activation manager's ``mxfp8`` saved-activation policy (issue 33 item 2): a saved tensor whose last axis is a
multiple of 32 comes back as the OCP MXFP8 (E4M3, E8M0 ``floor`` scales, block 32) round trip of itself, bit for bit,
on the device tier and through the host tier; stored in 33 bytes per 32 elements; others come back unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from moonrt.config import from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy
from moonrt.ops.qat import fake_quantize_values


class _Record(torch.autograd.Function):
    """Saves ``x`` and hands backward the tensor autograd gives back (what the manager restored)."""

    seen: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _Record.seen.append(x.clone())
        return g * 2


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Record.apply(self.inner(x))


@pytest.mark.parametrize("policy", ["mxfp8", "mxfp8+host"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_saves_are_the_codec_round_trip_bitwise(policy, dtype):
    gen = torch.Generator().manual_seed(0)
    for width, quantized in ((64, True), (48, False)):
        x = (torch.randn(6, width, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)).to(dtype)
        x.requires_grad_()
        _Record.seen.clear()
        model = Tiny()
        mgr = ActivationManager(model, from_dict(MemoryPolicy, {"default": policy}))
        with mgr:
            y = model(x)
        y.sum().backward()
        acc = mgr.accounting
        mgr.close()
        want = fake_quantize_values(x.detach(), "mxfp8_e4m3", 32) if quantized else x.detach()
        got = _Record.seen[0]
        assert got.dtype == dtype and torch.equal(got, want), (policy, width)
        tier = "host" if policy.endswith("host") else "device"
        stored = x.numel() * 33 // 32 if quantized else x.numel() * x.element_size()
        assert acc.peak[tier] == stored, (policy, width, acc.peak)
