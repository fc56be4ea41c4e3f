"""Quantization-aware training as K3 does it: MXFP4 weights, MXFP8 activations, straight-through gradients
(K3_SYSTEMS §1: "QAT uses MXFP4 weights and MXFP8 activations"; issue 33 item 2).

A fake-quantized tensor is the tensor the low-precision GEMM would read, in high precision: ``fake_quantize(x) =
mx.dequantize(mx.quantize(x))`` (:mod:`moonrt.ops.mx`), computed in the forward and used in place of ``x``. Its
gradient is the straight-through estimator (STE): the incoming gradient passed to ``x`` unchanged, for every element,
the saturated ones included. Masking the elements a block clamps (``|x| / X > max_elem``, which ``floor`` scales
produce for the block's largest elements) would withhold the gradient from exactly the weights that set the block's
scale, so no mask: the identity is the documented STE, the one torchao's MX training and Transformer Engine use.
The fp32 parameters stay the master weights; only the forward sees the quantized values.

:class:`QATScheme` fixes the numbers: weights in ``weight_format`` (MXFP4, E2M1 codes), activations in
``act_format`` (MXFP8 E4M3, both passes' forward inputs, Transformer Engine's MXFP8 recipe), blocks of ``block``
elements (the spec's 32) along the GEMM's reduction axis -- the last axis of a weight in ``nn.Linear`` layout
``[out, in]`` and of the activation ``[rows, in]`` it multiplies -- and E8M0 scales chosen by ``scale_mode``
(``floor``: the OCP spec's §6.3 rule and torchao's default, ``s = e(amax) - emax``). The same function quantizes
for the export (``moonrt checkpoint export --mxfp4``), so the packed file decodes to the forward's weights bitwise.

Pure tensor math: which layers are quantized is the model's business (``moonrt.models.k3``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moonrt.ops import mx

QAT_FORMATS = ("none", "mxfp4")
"""Accepted values of the job's ``qat`` field: ``none`` (no QAT) or ``mxfp4`` (:data:`MXFP4_SCHEME`'s numbers)."""


@dataclasses.dataclass(frozen=True, slots=True)
class QATScheme:
    """Fake-quantization numbers of one QAT run (module docstring).

    ``weight_format`` / ``act_format``: :data:`moonrt.ops.mx.FORMATS` names; ``block``: elements per E8M0 scale along
    the reduction axis (must divide every quantized reduction axis); ``scale_mode``: :data:`moonrt.ops.mx.SCALE_MODES`.
    """

    weight_format: str = "mxfp4"
    act_format: str = "mxfp8_e4m3"
    block: int = 32
    scale_mode: str = "floor"

    def __post_init__(self) -> None:
        for name in ("weight_format", "act_format"):
            value = getattr(self, name)
            if value not in mx.FORMATS:
                raise ValueError(f"{name} = {value!r}: expected one of {', '.join(mx.FORMATS)}")
        if self.scale_mode not in mx.SCALE_MODES:
            raise ValueError(f"scale_mode = {self.scale_mode!r}: expected one of {', '.join(mx.SCALE_MODES)}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block = {self.block!r}: expected an integer >= 1")
        if self.weight_format == "mxfp4" and self.block % 2:
            raise ValueError(f"block = {self.block}: mxfp4 packs two codes a byte, expected an even block")

    def check_axis(self, length: int, what: str) -> None:
        """ValueError unless ``block`` divides the reduction-axis length ``length`` of ``what``."""
        if length % self.block:
            raise ValueError(f"qat block = {self.block}: expected a divisor of the reduction axis of {what} "
                             f"(length {length})")

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w [..., out, in]`` fake-quantized to ``weight_format`` along ``in`` (STE gradient), in ``w.dtype``."""
        return fake_quantize(w, self.weight_format, self.block, self.scale_mode)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` fake-quantized to ``act_format`` along ``in`` (STE gradient), in ``x.dtype``."""
        return fake_quantize(x, self.act_format, self.block, self.scale_mode)

    def quantize_weight(self, w: torch.Tensor) -> mx.MXQuantized:
        """The packed codes and scales of ``w`` along its last axis: what :meth:`weight` decodes (the export)."""
        return mx.quantize(w.detach(), self.weight_format, axis=-1, block=self.block, scale_mode=self.scale_mode)


def scheme_for(qat: str, block: int = 32) -> QATScheme | None:
    """The :class:`QATScheme` of a job's ``qat`` value (None for ``none``); ValueError naming the field otherwise."""
    if qat not in QAT_FORMATS:
        raise ValueError(f"qat = {qat!r}: expected one of {', '.join(QAT_FORMATS)}")
    if qat == "none":
        return None
    return QATScheme(weight_format="mxfp4", act_format="mxfp8_e4m3", block=block)


def fake_quantize_values(x: torch.Tensor, format: str, block: int = 32, scale_mode: str = "floor") -> torch.Tensor:
    """``mx.dequantize(mx.quantize(x, format, axis=-1, block, scale_mode), x.dtype)``, no autograd: the values the
    low-precision GEMM reads. ``x [..., n]`` any floating dtype (read as fp32), ``block`` divides ``n``."""
    with torch.no_grad():
        return mx.quantize(x, format, axis=-1, block=block, scale_mode=scale_mode).dequantize(x.dtype)


def fake_quantize(x: torch.Tensor, format: str, block: int = 32, scale_mode: str = "floor") -> torch.Tensor:
    """:func:`fake_quantize_values` of ``x [..., n]`` along its last axis, with the straight-through gradient
    (``d x = d out``, identity on every element; module docstring). Returns ``x.dtype``."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuantize.apply(x, format, block, scale_mode)
    return fake_quantize_values(x, format, block, scale_mode)


def qat_linear(x: torch.Tensor, w: torch.Tensor, scheme: QATScheme) -> torch.Tensor:
    """``F.linear(scheme.act(x), scheme.weight(w))``: ``x [..., in]``, ``w [out, in]`` (``nn.Linear`` layout) ->
    ``[..., out]``, straight-through gradients to ``x`` and ``w``. One node that saves the quantized input (in the
    compute dtype, as a linear saves its input) and ``w`` itself, and quantizes ``w`` again in backward: no
    quantized weight copy lives from a layer's forward to its backward. Compute dtype: the autocast dtype inside an
    autocast region (both operands cast to it, as ``F.linear`` under autocast; MXFP4 and MXFP8 values are exact in
    bf16), else ``promote(x.dtype, w.dtype)``; returned in it."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _QATLinear.apply(x, w, scheme)
    with torch.no_grad():
        return _QATLinear.compute(x, w, scheme)[0]


class _QATLinear(torch.autograd.Function):
    """:func:`qat_linear` as one node: ``forward(x, w, scheme)``."""

    @staticmethod
    def compute(x: torch.Tensor, w: torch.Tensor, scheme: QATScheme) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, quantized input in the compute dtype)``."""
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(x.dtype, w.dtype)
        xq = fake_quantize_values(x, scheme.act_format, scheme.block, scheme.scale_mode).to(dt)
        wq = fake_quantize_values(w, scheme.weight_format, scheme.block, scheme.scale_mode).to(dt)
        with torch.autocast(dev, enabled=False):
            return torch.nn.functional.linear(xq, wq), xq

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scheme: QATScheme) -> torch.Tensor:
        y, xq = _QATLinear.compute(x, w, scheme)
        ctx.save_for_backward(xq, w)
        ctx.scheme, ctx.x_dtype = scheme, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, w = ctx.saved_tensors
        q: QATScheme = ctx.scheme
        dt = xq.dtype
        g = grad.to(dt)
        d_x = d_w = None
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                wq = fake_quantize_values(w, q.weight_format, q.block, q.scale_mode).to(dt)
                d_x = (g @ wq).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                d_w = (g.reshape(-1, g.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])).to(w.dtype)
        return d_x, d_w, None


class _FakeQuantize(torch.autograd.Function):
    """``forward(x, format, block, scale_mode)``: the fake-quantized values; ``backward``: the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, format: str, block: int, scale_mode: str) -> torch.Tensor:
        return fake_quantize_values(x, format, block, scale_mode)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None, None


__all__ = ["QAT_FORMATS", "QATScheme", "fake_quantize", "fake_quantize_values", "qat_linear", "scheme_for"]
