"""OCP MX codecs (issue 33 item 1): exhaustive code tables, round-to-nearest-even encoding, E8M0 scales per mode,
bitwise parity with torchao's ``torchao.prototype.mx_formats`` (installed beside torch by the ``test`` extra),
packing, axes, round-trip SQNR and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from device_discipline import device_discipline

from moonrt.ops import mx

NAN, INF = float("nan"), float("inf")
FMAX = torch.finfo(torch.float32).max


def _fp4_value(c: int) -> float:
    """E2M1 from its bits (spec table): exponent bias 1, subnormal when the exponent field is 0."""
    sign, e, m = -1.0 if c & 8 else 1.0, (c >> 1) & 3, c & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def _fp8_value(c: int, ebits: int, mbits: int) -> float:
    """E4M3 (OCP ``fn``: no inf, only S.1111.111 is NaN) or E5M2 (IEEE-like) from its bits."""
    bias = (1 << (ebits - 1)) - 1
    sign = -1.0 if c & 0x80 else 1.0
    e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
    if ebits == 4 and e == 15 and m == 7:
        return NAN
    if ebits == 5 and e == 31:
        return sign * INF if m == 0 else NAN
    if e == 0:
        return sign * m / (1 << mbits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def _table(fmt: str) -> list[float]:
    if fmt == "mxfp4":
        return [_fp4_value(c) for c in range(16)]
    ebits, mbits = (4, 3) if fmt == "mxfp8_e4m3" else (5, 2)
    return [_fp8_value(c, ebits, mbits) for c in range(256)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, and the same sign of zero."""
    a, b = a.float(), b.float()
    return bool((((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_every_code_decodes_to_the_spec_value(fmt):
    n = 16 if fmt == "mxfp4" else 256
    got = mx.decode_codes(torch.arange(n, dtype=torch.uint8), fmt)
    assert _same(got, torch.tensor(_table(fmt)))


def test_every_e8m0_byte_is_its_power_of_two():
    got = mx.scale_values(torch.arange(256, dtype=torch.uint8))
    want = torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)] + [NAN])
    assert _same(got, want) and got[0].item() == 2.0 ** -127


# an amax that gives every mode the scale byte 127 (X = 1): the format's max for floor/even/rceil; for ceil, whose
# scale rounds a non-power-of-two amax up, its largest power of two (values above it are not tested under ceil)
UNIT_AMAX = {("mxfp4", "ceil"): 4.0, ("mxfp8_e4m3", "ceil"): 256.0, ("mxfp8_e5m2", "ceil"): 32768.0}
MAXES = {"mxfp4": 6.0, "mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0}


def _encode_at_unit_scale(fmt: str, mode: str, values: list[float]) -> torch.Tensor:
    """Element codes of ``values`` in blocks of 32 whose first element is the unit amax (scale byte 127)."""
    amax = UNIT_AMAX.get((fmt, mode), MAXES[fmt])
    assert all(abs(v) <= amax for v in values)
    rows = [[amax] + values[i:i + 31] + [0.0] * (31 - len(values[i:i + 31])) for i in range(0, len(values), 31)]
    q = mx.quantize(torch.tensor(rows), fmt, scale_mode=mode)
    assert (q.scales == 127).all()
    codes = q.codes
    if fmt == "mxfp4":
        codes = torch.stack((codes & 0xF, codes >> 4), -1).flatten(-2)
    return codes[:, 1:].flatten()[:len(values)]


@pytest.mark.parametrize("mode", mx.SCALE_MODES)
@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_encode_representable_values_and_midpoints(fmt, mode):
    """Every finite code value encodes to its code; every midpoint of neighbours to the even code of the two
    (round to nearest, ties to even); one fp32 ulp either side of a midpoint to the nearer code."""
    amax = UNIT_AMAX.get((fmt, mode), MAXES[fmt])
    table = _table(fmt)
    codes = [c for c, v in enumerate(table) if not math.isnan(v) and abs(v) <= amax and not math.isinf(v)]
    got = _encode_at_unit_scale(fmt, mode, [table[c] for c in codes])
    assert got.tolist() == codes  # -0.0 included: the sign bit is kept
    pos = sorted({table[c] for c in codes if table[c] >= 0 and not math.copysign(1, table[c]) < 0})
    code_of = {table[c]: c for c in codes if not math.copysign(1, table[c]) < 0}
    a, b = torch.tensor(pos[:-1]), torch.tensor(pos[1:])
    m = (a + b) / 2  # exact in fp32: neighbours differ by one step of at most 4 significant bits
    ca, cb = torch.tensor([code_of[v] for v in pos[:-1]]), torch.tensor([code_of[v] for v in pos[1:]])
    even = torch.where(ca % 2 == 0, ca, cb)
    below, above = torch.nextafter(m, torch.zeros_like(m)), torch.nextafter(m, torch.full_like(m, INF))
    sign = 8 if fmt == "mxfp4" else 0x80
    mids = torch.cat((m, below, above, -m, -below, -above)).tolist()
    want = torch.cat((even, ca, cb, even | sign, ca | sign, cb | sign)).tolist()
    assert _encode_at_unit_scale(fmt, mode, mids).tolist() == want


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_saturation_and_infinities(fmt):
    """floor: an amax in (max, 2^(emax + 1)) keeps the scale byte 127, so it saturates to the largest code; an inf
    element saturates too (with its sign) and its block's scale is the inf amax's exponent (128 - emax)."""
    mx_ = MAXES[fmt]
    top = 7 if fmt == "mxfp4" else (0x7E if fmt == "mxfp8_e4m3" else 0x7B)
    neg = 8 if fmt == "mxfp4" else 0x80
    emax = {"mxfp4": 2, "mxfp8_e4m3": 8, "mxfp8_e5m2": 15}[fmt]
    x = torch.zeros(3, 32)
    x[0, 0], x[0, 2] = mx_ * 1.1, -mx_ * 1.1  # below 2^(emax + 1) = 8/512/65536
    x[1, 0], x[1, 2] = INF, 1.0
    x[2, 0], x[2, 2] = -INF, 1.0
    q = mx.quantize(x, fmt)
    codes = q.codes if fmt != "mxfp4" else torch.stack((q.codes & 0xF, q.codes >> 4), -1).flatten(-2)
    assert q.scales[:, 0].tolist() == [127, 128 - emax + 127, 128 - emax + 127]
    assert codes[:, 0].tolist() == [top, top, top | neg] and codes[0, 2].item() == top | neg
    assert codes[1, 2].item() == 0  # 1.0 / 2^(128 - emax) is far below the smallest subnormal


# (format, amax) -> expected scale byte for floor, ceil, even, rceil; worked by hand from the mode definitions
SCALE_CASES = [
    ("mxfp8_e4m3", 448.0, (127, 128, 127, 127)),  # 1.75 * 2^8: ceil rounds up; rceil 448/448 = 1
    ("mxfp8_e4m3", 449.0, (127, 128, 127, 128)),  # even: 1.7539 rounds to 1.75 (3 bits)
    ("mxfp8_e4m3", 496.0, (127, 128, 128, 128)),  # even: 1.9375 rounds half away to 2.0: exponent carries
    ("mxfp8_e4m3", 256.0, (127, 127, 127, 127)),  # rceil: ceil(log2(256/448)) = 0
    ("mxfp8_e4m3", 0.0, (0, 0, 0, 0)),
    ("mxfp8_e4m3", 1e-45, (0, 0, 0, 0)),  # subnormal amax: clamped to the smallest scale
    ("mxfp8_e4m3", FMAX, (246, 247, 247, 247)),  # 2^127 (2 - 2^-23)
    ("mxfp8_e4m3", INF, (247, 247, 247, 254)),
    ("mxfp8_e4m3", NAN, (255, 255, 255, 255)),
    ("mxfp8_e5m2", 57344.0, (127, 128, 127, 127)),  # 1.75 * 2^15
    ("mxfp8_e5m2", 1.0, (112, 112, 112, 112)),  # 2^0 / 2^15; rceil ceil(log2(1/57344)) = -15
    ("mxfp4", 6.0, (127, 128, 127, 127)),
    ("mxfp4", 7.0, (127, 128, 128, 128)),  # even: 1.75 rounds to 2.0 at 1 mantissa bit
    ("mxfp4", 0.75, (124, 125, 124, 124)),  # 1.5 * 2^-1; even: 1.5 stays; rceil log2(0.75 / 6) = -3
    ("mxfp4", 2.0 ** -130, (0, 0, 0, 0)),
]


@pytest.mark.parametrize("fmt,amax,want", SCALE_CASES)
def test_scale_byte_per_mode(fmt, amax, want):
    x = torch.zeros(1, 32)
    x[0, 5] = amax
    got = tuple(mx.quantize(x, fmt, scale_mode=m).scales.item() for m in ("floor", "ceil", "even", "rceil"))
    assert got == want


def test_rceil_exponent_is_exact_where_float_log2_rounds():
    """rceil is ``ceil(log2(amax / max))`` exactly: ``q = 2^5 (1 + 2^-23)`` gives 6 (the rounded fp32 log2 of q is
    5.0, which torchao's eager fallback takes; the module docstring says so)."""
    q = torch.tensor(32.0 * (1 + 2.0 ** -23))
    amax = q * 6.0  # exact: 6 = 3 * 2, and (1 + 2^-23) * 3 fits in 24 bits
    assert (amax / 6.0).item() == q.item()
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    assert mx.quantize(x, "mxfp4", scale_mode="rceil").scales.item() == 127 + 6
    assert math.ceil(math.log2(q.item())) == 6 and torch.log2(q).item() == 5.0


def test_fp4_packing_even_element_in_low_nibble():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([0.5, 1.0, -6.0, 3.0])
    q = mx.quantize(x, "mxfp4")  # amax 6: scale byte 127, X = 1
    assert q.codes.shape == (1, 16) and q.codes.dtype == torch.uint8
    assert q.codes[0, :2].tolist() == [0x1 | (0x2 << 4), 0xF | (0x5 << 4)]


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_axis_and_block(fmt):
    torch.manual_seed(0)
    x = torch.randn(3, 64, 5)
    q = mx.quantize(x, fmt, axis=1, block=16)
    ref = mx.quantize(x.movedim(1, -1).contiguous(), fmt, block=16)
    assert q.axis == 1 and q.block == 16 and q.shape == x.shape and q.format == fmt
    assert q.scales.shape == (3, 4, 5) and torch.equal(q.scales, ref.scales.movedim(-1, 1))
    assert torch.equal(q.codes, ref.codes.movedim(-1, 1))
    assert q.codes.shape == ((3, 32, 5) if fmt == "mxfp4" else (3, 64, 5))
    assert q.nbytes == q.codes.numel() + 3 * 4 * 5
    assert _same(q.dequantize(), ref.dequantize().movedim(-1, 1))
    assert mx.quantize(x, fmt, axis=-2, block=16).axis == 1


# torchao's thresholds (test_mx_tensor.py): fp8 >= 18 dB, fp4 >= 13 dB
SQNR_MIN = {"mxfp4": 13.0, "mxfp8_e4m3": 18.0, "mxfp8_e5m2": 18.0}


def sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """``20 log10(|x| / |x - y|)`` in dB (torchao's ``compute_error``)."""
    return 20 * math.log10(x.norm().item() / (x - y).norm().item())


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_roundtrip_sqnr_gaussian(fmt):
    torch.manual_seed(0)
    x = torch.randn(64, 1024)
    for mode in mx.SCALE_MODES:
        y = mx.quantize(x, fmt, scale_mode=mode).dequantize()
        assert sqnr(x, y) >= SQNR_MIN[fmt], (fmt, mode)
    y = mx.quantize(x.bfloat16(), fmt).dequantize(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and sqnr(x, y.float()) >= SQNR_MIN[fmt]


def test_every_tensor_on_the_input_device(device):
    x = torch.randn(4, 64, device=device)
    with device_discipline(device) as found:
        for fmt in mx.FORMATS:
            for mode in mx.SCALE_MODES:
                q = mx.quantize(x, fmt, axis=0, block=4, scale_mode=mode)
                y = q.dequantize(torch.bfloat16)
    assert found == [] and q.codes.device == x.device and y.device == x.device


def test_bad_input():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match=r"format = 'mxfp6': expected one of mxfp4, mxfp8_e4m3, mxfp8_e5m2"):
        mx.quantize(x, "mxfp6")
    with pytest.raises(ValueError, match=r"block = 32: expected a divisor of the axis length 48"):
        mx.quantize(x, "mxfp4")
    with pytest.raises(ValueError, match=r"block = 0: expected an integer >= 1"):
        mx.quantize(x, "mxfp4", block=0)
    with pytest.raises(ValueError, match=r"scale_mode = 'round': expected one of floor, rceil, ceil, even"):
        mx.quantize(x, "mxfp8_e4m3", block=16, scale_mode="round")
    with pytest.raises(ValueError, match=r"axis = 2: expected an axis"):
        mx.quantize(x, "mxfp8_e4m3", axis=2, block=16)
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 3: mxfp4 packs two codes a byte"):
        mx.quantize(torch.randn(2, 3), "mxfp4", block=1)
    with pytest.raises(ValueError, match=r"x.dtype = torch.int64: expected a floating dtype"):
        mx.quantize(torch.ones(2, 32, dtype=torch.long), "mxfp4")
    with pytest.raises(ValueError, match=r"format = 'fp8'"):
        mx.decode_codes(torch.zeros(2, dtype=torch.uint8), "fp8")


# ---- bitwise parity with torchao (test extra) ----

AO_DTYPE = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}


def _parity_input() -> torch.Tensor:
    """Random blocks over the whole fp32 exponent range, plus adversarial blocks: NaN, +-inf, zeros and signed
    zeros, subnormals, fp32 max, every format's max and its neighbours, E2M1/E4M3 midpoints."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 256, generator=g) * torch.exp2(torch.randint(-140, 120, (96, 1), generator=g).float())
    rows = [
        [NAN, 1.0], [1.0, -NAN], [INF, 1.0, -2.0], [-INF, 3.0], [INF, -INF], [0.0, -0.0, -0.0], [1e-45, -3e-45, 1e-40],
        [FMAX, -FMAX, 1.0], [448.0, 449.0, -447.0], [57344.0, 61440.0, 1.0], [6.0, 5.0, 7.0, -6.5],
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5],
        [496.0, 464.0, 240.0, 232.0, 0.001953125, 0.0029296875],
        [2.0 ** -127, 2.0 ** -126, 2.0 ** -133], [1.0e38, 3.0e38, -2.9e38],
    ]
    for i, r in enumerate(rows):
        x[i, :32] = 0.0
        x[i, :len(r)] = torch.tensor(r)
        x[i, 32:64] = torch.tensor(r * (32 // len(r)) + r[:32 % len(r)])  # the pattern over a whole block
    return x


@pytest.mark.parametrize("mode", mx.SCALE_MODES)
@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_bitwise_parity_with_torchao(fmt, mode):
    """Scales and codes bitwise torchao's ``to_mx``, dequantized values its ``to_dtype`` (fp32 and bf16); the one
    documented difference: FP4 codes of NaN elements (+-0 here, a bit pattern of the NaN payload there; those blocks
    have the NaN scale and decode to NaN in both)."""
    torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    ao_mode = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode(mode)
    x = _parity_input()
    for xin in (x, x.bfloat16()):
        s, d = torchao_mx.to_mx(xin, AO_DTYPE[fmt], 32, ao_mode)
        q = mx.quantize(xin, fmt, scale_mode=mode)
        assert torch.equal(q.scales, s.view(torch.uint8))
        ao_codes = d.view(torch.uint8)
        if fmt == "mxfp4":
            nan_block = (q.scales == 255).repeat_interleave(16, dim=-1)
            assert torch.equal(q.codes[~nan_block], ao_codes[~nan_block])
            ours = torch.stack((q.codes & 0xF, q.codes >> 4), -1).flatten(-2)
            assert ((ours[xin.float().isnan()] & 7) == 0).all()  # +-0 by the NaN's sign bit
        else:
            assert torch.equal(q.codes, ao_codes)
        for dtype in (torch.float32, torch.bfloat16):
            assert _same(q.dequantize(dtype), torchao_mx.to_dtype(d, s, AO_DTYPE[fmt], 32, dtype))
