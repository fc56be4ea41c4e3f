"""Triton KDA kernels (moonrt.ops.kda.backends.triton) under Triton's interpreter on CPU tensors: forward, final state
and every input gradient against the fp64 recurrence (K3_SYSTEMS §2.1); KCP's summaries against the CPU ones.

Tolerances: fp32 runs are held to the CPU chunk kernel's bound (1e-5 relative RMS against fp64, tests/ops/test_kda.py);
fp64 runs to ``F64_RTOL`` (mathematical equality); bf16 runs to one bf16 rounding of the stored result (2^-8
relative per element) plus the fp32 bound, with a loss whose output weights are bf16-exact so the output gradient
is not rounded. Shapes are small (the interpreter runs each program in numpy).

On a GPU the fp32 dots run as tf32x3 (``kt.FP32_DOT``); the interpreter computes every dot in fp32 whatever its
input precision, so :func:`emulate_tf32x3` replaces the interpreter's dot by the tensor cores' arithmetic (each fp32
operand split into two TF32 parts, three products, fp32 accumulation) and the kernels are held to ``TF32X3_TOL``,
derived in K3_SYSTEMS §2.3.1: the fp32 bound scaled by the per-product error ratio ``3 * 2^-22 / 2^-24 = 12``.
"""

from __future__ import annotations

import os

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from dist import dist_run  # noqa: E402
from numerics import F64_RTOL, rel_l2  # noqa: E402

import moonrt.ops.kda.backends.triton as kt  # noqa: E402
from moonrt.comm.cp.kcp import kcp_kda  # noqa: E402
from moonrt.comm.cp.ops import slice_bounds  # noqa: E402
from moonrt.ops import kda as cpu  # noqa: E402

# the conftest fixture: skip where Triton is missing, fail instead under MOONRT_REQUIRE_TRITON=1 (CI)
pytestmark = pytest.mark.usefixtures("triton_kernels")

FP32_TOL = 1e-5  # the CPU chunk kernel's bound against fp64 (tests/ops/test_kda.py)
BF16_TOL = 2.0 ** -8 + FP32_TOL  # one rounding (unit roundoff 2^-8) of each bf16 result, on fp32 arithmetic
TF32X3_TOL = FP32_TOL * (3 * 2.0 ** -22) / 2.0 ** -24  # tf32x3 products err <= 3 * 2^-22 relative, fp32's 2^-24


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest TF32 value (10 stored mantissa bits; ties away from zero, as ``cvt.rna.tf32.f32``)."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def emulate_tf32x3(monkeypatch: pytest.MonkeyPatch, passes: int = 3) -> list[int]:
    """Make the interpreter compute every tf32x3 ``tl.dot`` of fp32 operands as sm_90's tensor cores do: ``a = a_hi +
    a_lo`` (both TF32), ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` accumulated in fp32 (``passes=1``: plain TF32,
    ``a_hi b_hi`` only). Returns a one-element list counting the emulated dots."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    calls = [0]

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision != ir.INPUT_PRECISION.TF32x3 or a.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        calls[0] += 1
        a_hi, b_hi = _round_tf32(a.data), _round_tf32(b.data)
        a_lo, b_lo = _round_tf32(a.data - a_hi), _round_tf32(b.data - b_hi)
        acc = d.data.astype(np.float32)
        for x, y in ((a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi))[3 - passes:]:
            acc = (np.matmul(x, y, dtype=np.float32) + acc).astype(np.float32)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return calls


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int, dtype: torch.dtype = torch.float32,
                decay: str = "k3") -> dict[str, torch.Tensor]:
    """Unit-norm q, k; beta in (0, 1); g = -5 sigmoid(N(0, 1)) ("k3", the strong-decay case of the issue),
    -0.05 sigmoid(N(0, 1)) ("weak": long memory, so M and far states matter), or down to -15 ("beyond15": past
    K3's gate)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g_min = {"k3": -5.0, "weak": -0.05, "beyond15": -15.0}[decay]
    g = g_min * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    S0 = torch.randn(B, H, K, V, generator=gen)
    return {n: t.to(dtype) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0).items()}


def run_with_grads(fn, inputs: dict[str, torch.Tensor], use_state: bool, seed: int, **kw):
    """Outputs, final state and the gradients of all inputs for a fixed random loss whose weights are bf16-exact
    (the output gradient is the same in every dtype)."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if use_state or n != "initial_state"}
    o, S = fn(**leaves, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    w_o = torch.randn(o.shape, generator=gen).to(torch.bfloat16).double()
    w_s = torch.randn(S.shape, generator=gen).double()
    loss = (o.double() * w_o).sum() + (S.double() * w_s).sum()
    loss.backward()
    return o.detach(), S.detach(), {n: t.grad for n, t in leaves.items()}


def reference(inputs: dict[str, torch.Tensor], use_state: bool, seed: int, **kw):
    """The fp64 recurrence on the same (rounded) input values."""
    return run_with_grads(cpu.kda_recurrent, {n: t.double() for n, t in inputs.items()}, use_state, seed, **kw)


def assert_close(got, ref, tol: float) -> None:
    o, S, grads = got
    o_r, S_r, grads_r = ref
    assert rel_l2(o, o_r) <= tol, ("o", rel_l2(o, o_r))
    assert rel_l2(S, S_r) <= tol, ("final state", rel_l2(S, S_r))
    assert set(grads) == set(grads_r)
    for name in grads_r:
        assert rel_l2(grads[name], grads_r[name]) <= tol, (name, rel_l2(grads[name], grads_r[name]))


@pytest.mark.parametrize(("B", "T", "decay", "use_state"), [
    pytest.param(2, 128, "k3", False, marks=pytest.mark.slow),  # fixed length, two full chunks per sequence, K3's
    # strong decays (slow: ~7 s interpreted; the fast lane keeps the case below)
    (1, 100, "weak", True),  # T % chunk != 0, an initial state carried over long memory
])
def test_fp32_matches_fp64_recurrence(B: int, T: int, decay: str, use_state: bool) -> None:
    inputs = make_inputs(B=B, T=T, H=2, K=32, V=16, seed=T, decay=decay)
    got = run_with_grads(kt.kda_chunk, inputs, use_state, seed=T)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(got, reference(inputs, use_state, seed=T), FP32_TOL)


def test_bf16_inputs_fp32_state() -> None:
    """bf16 inputs: the state stays fp32 (final state within the fp32 bound of the fp64 run on the same bf16 values);
    outputs and gradients come back in bf16, each within one bf16 rounding."""
    inputs = make_inputs(B=1, T=80, H=2, K=32, V=32, seed=5, dtype=torch.bfloat16)
    o, S, grads = run_with_grads(kt.kda_chunk, inputs, True, seed=5)
    o_r, S_r, grads_r = reference(inputs, True, seed=5)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_l2(o, o_r) <= BF16_TOL
    assert rel_l2(S, S_r) <= FP32_TOL
    for name in grads_r:
        assert grads[name].dtype == inputs[name].dtype, name
        assert rel_l2(grads[name], grads_r[name]) <= BF16_TOL, (name, rel_l2(grads[name], grads_r[name]))


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])  # the fast
# lane keeps fp64 (the same sequence boundaries); fp32 is CI's
def test_varlen_with_empty_and_single_token_sequences(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """cu_seqlens with an empty sequence (its final state is its initial state, its state gradient the final-state
    one), a length-1 sequence and a tail chunk: equal to the recurrence run per sequence, outputs and gradients.
    The state passes split V = 32 into blocks of 16 columns (separate programs)."""
    monkeypatch.setattr(kt, "STATE_V_BLOCK", 16)
    lens = [0, 1, 70, 0, 21]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    T, H, K, V = sum(lens), 2, 16, 32
    inputs = make_inputs(B=1, T=T, H=H, K=K, V=V, seed=7, dtype=dtype, decay="weak")
    inputs["initial_state"] = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(8)).to(dtype)
    o, S, grads = run_with_grads(kt.kda_chunk, inputs, True, seed=7, cu_seqlens=cu)
    # reference: the same loss, the recurrence per sequence (fp64)
    leaves = {n: t.double().requires_grad_() for n, t in inputs.items()}
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, S_i = cpu.kda_recurrent(*(leaves[n][:, a:b] for n in ("q", "k", "v", "g", "beta")),
                                     initial_state=leaves["initial_state"][i : i + 1], output_final_state=True)
        outs.append(o_i)
        finals.append(S_i)
    o_r, S_r = torch.cat(outs, dim=1), torch.cat(finals)
    gen = torch.Generator().manual_seed(8)
    w_o = torch.randn(o_r.shape, generator=gen).to(torch.bfloat16).double()
    w_s = torch.randn(S_r.shape, generator=gen).double()
    ((o_r * w_o).sum() + (S_r * w_s).sum()).backward()
    tol = F64_RTOL if dtype == torch.float64 else FP32_TOL
    assert S.shape == (len(lens), H, K, V)
    assert rel_l2(o, o_r) <= tol and rel_l2(S, S_r) <= tol
    for name, leaf in leaves.items():
        assert rel_l2(grads[name], leaf.grad) <= tol, (name, rel_l2(grads[name], leaf.grad))


@pytest.mark.slow  # ~12 s interpreted with tf32x3 emulated in every dot: CI runs it, the fast lane need not
def test_tf32x3_tensor_core_products_keep_the_derived_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 run with sm_90's tf32x3 arithmetic emulated in every dot (several key and value blocks, K3's strong
    decays, an initial state): outputs, final state and every gradient within TF32X3_TOL of the fp64 recurrence;
    the emulation changes the results (it is not a no-op) and plain TF32 would not be accurate enough."""
    inputs = make_inputs(B=1, T=80, H=1, K=48, V=40, seed=29)
    ref = reference(inputs, True, seed=29)
    plain = run_with_grads(kt.kda_chunk, inputs, True, seed=29)
    calls = emulate_tf32x3(monkeypatch)
    got = run_with_grads(kt.kda_chunk, inputs, True, seed=29)
    assert calls[0] > 0 and not torch.equal(got[0], plain[0])
    assert_close(got, ref, TF32X3_TOL)
    emulate_tf32x3(monkeypatch, passes=1)  # plain TF32 (2^-11 per operand): outside the bound
    with pytest.raises(AssertionError):
        assert_close(run_with_grads(kt.kda_chunk, inputs, True, seed=29), ref, TF32X3_TOL)


@pytest.mark.parametrize("decay", ["beyond15", "inf", "positive", "nan"])
def test_decays_outside_the_k3_gate_bound_raise_one_error_naming_the_torch_backend(decay: str) -> None:
    """The Triton path relies on K3's gate bound (every per-token log-decay in [-5, 0], K3_SYSTEMS §2.2): a decay
    below it (-15, -inf), above 0 or NaN raises one ValueError naming kernels.kda=torch, in the chunk op and in KCP's
    transition and state gradient; the torch op takes the same inputs (exact at any decay: tests/ops/test_kda.py)."""
    inputs = make_inputs(B=1, T=40, H=1, K=16, V=16, seed=11, decay="beyond15" if decay == "beyond15" else "k3")
    g = inputs["g"]
    if decay != "beyond15":
        g[0, 7, 0, 3] = {"inf": float("-inf"), "positive": 0.5, "nan": float("nan")}[decay]
    assert float(g.min()) < kt.G_LOWER_BOUND or decay != "beyond15"
    q, k, v, beta = (inputs[n] for n in ("q", "k", "v", "beta"))
    with pytest.raises(ValueError, match=r"g: min .*\[-5.0, 0\].*kernels.kda=torch"):
        kt.kda_chunk(**inputs)
    with pytest.raises(ValueError, match="kernels.kda=torch"):
        kt.kda_transition(k, v, g, beta)
    with pytest.raises(ValueError, match="kernels.kda=torch"):
        kt.kda_state_grad(q, k, v, g, beta, torch.ones_like(v))
    if decay != "nan":
        o, _ = cpu.kda_chunk(**inputs)
        assert torch.isfinite(o).all()


def test_the_bound_itself_is_accepted() -> None:
    """Decays exactly at the bound (-5) and at 0 run (the closed interval) and match the fp64 recurrence."""
    inputs = make_inputs(B=1, T=40, H=1, K=16, V=16, seed=31)
    inputs["g"][0, :10] = kt.G_LOWER_BOUND
    inputs["g"][0, 10:12] = 0.0
    assert_close(run_with_grads(kt.kda_chunk, inputs, True, seed=31), reference(inputs, True, seed=31), FP32_TOL)


@pytest.mark.parametrize(("K", "V"), [pytest.param(96, 96, marks=pytest.mark.slow), (48, 40)])  # the fast lane
# keeps 48 x 40 (several key blocks and a masked value block); 96 (three blocks of 32) is CI's
def test_key_and_value_blocks_match_fp64_recurrence(K: int, V: int) -> None:
    """Head sizes split into several key / value blocks: 96 as three blocks of 32 in the per-chunk kernels (no
    padding to 128) and as 64 + a masked 64 in the state passes, 48 as three of 16 and V = 40 as 32 + a masked 32
    (forward) / two of 16 + a masked 16 (backward); outputs, final state and every gradient in fp64 (mathematical
    equality: every block's contribution is counted once) and fp32."""
    assert kt.block_for(96) == 32 and kt.block_for(48) == 16 and kt.block_for(40) == 32
    assert kt.block_for(40, 64) == 64
    assert kt.state_k_block(96) == 64 and kt.state_k_block(48) == 16
    assert kt.block_for(40, kt.GRADS_MAX_BLOCK) == 16 and kt.block_for(96, kt.GRADS_MAX_BLOCK) == 16
    for dtype, tol in ((torch.float64, F64_RTOL), (torch.float32, FP32_TOL)):
        inputs = make_inputs(B=1, T=70, H=1, K=K, V=V, seed=K, dtype=dtype)
        assert_close(run_with_grads(kt.kda_chunk, inputs, True, seed=K), reference(inputs, True, seed=K), tol)


@pytest.mark.parametrize("chunk_size", [16, pytest.param(128, marks=pytest.mark.slow)])  # 128: CI's (~6 s)
def test_other_chunk_sizes_float64(chunk_size: int) -> None:
    """One sub-tile per chunk (16) and eight (128), several chunks and a tail: the recurrence's results."""
    inputs = make_inputs(B=1, T=150 if chunk_size == 128 else 40, H=1, K=16, V=16, seed=12, dtype=torch.float64)
    got = run_with_grads(kt.kda_chunk, inputs, True, seed=12, chunk_size=chunk_size)
    assert_close(got, reference(inputs, True, seed=12), F64_RTOL)


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])  # fp32: CI's
def test_kcp_summaries_equal_the_cpu_ones(dtype: torch.dtype) -> None:
    """kda_transition (M, S_ext) and kda_state_grad (with and without a final-state gradient) equal the CPU ops, on a
    segment of several chunks with a tail and decays weak enough that M and the final-state path are O(1)."""
    inputs = make_inputs(B=2, T=150, H=2, K=32, V=16, seed=13, dtype=dtype, decay="weak")
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    tol = F64_RTOL if dtype == torch.float64 else 2 * FP32_TOL  # two fp32 results, each within FP32_TOL
    M, S_ext = kt.kda_transition(k, v, g, beta)
    M_r, S_r = cpu.kda_transition(k, v, g, beta)
    assert M.dtype == S_ext.dtype == M_r.dtype and float(M_r.norm()) > 1e-3
    assert rel_l2(M, M_r) <= tol and rel_l2(S_ext, S_r) <= tol
    gen = torch.Generator().manual_seed(14)
    d_o = torch.randn(v.shape, generator=gen).to(dtype)
    d_final = torch.randn(2, 2, 32, 16, generator=gen).to(dtype)
    for df in (d_final, None):
        got = kt.kda_state_grad(q, k, v, g, beta, d_o, d_final=df)
        ref = cpu.kda_state_grad(q, k, v, g, beta, d_o, d_final=df)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_l2(got, ref) <= tol


def test_empty_sequence_and_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(B=1, T=0, H=1, K=16, V=16, seed=1)
    o, S = kt.kda_chunk(**inputs, output_final_state=True)
    assert o.shape == (1, 0, 1, 16) and torch.equal(S, inputs["initial_state"])
    M, S_ext = kt.kda_transition(*(inputs[n] for n in ("k", "v", "g", "beta")))
    assert torch.equal(M[0, 0], torch.eye(16)) and not S_ext.any()
    inputs = make_inputs(B=1, T=8, H=1, K=16, V=16, seed=1)
    with pytest.raises(ValueError, match="chunk_size = 48"):
        kt.kda_chunk(**inputs, chunk_size=48)
    bad = dict(inputs, g=inputs["g"].clone().index_fill_(1, torch.tensor([3]), float("nan")))
    with pytest.raises(ValueError, match="g: min"):
        kt.kda_chunk(**bad)
    with pytest.raises(TypeError, match="chunk_size"):
        kt.kda_chunk(**inputs, chunk_size=True)
    with pytest.raises(ValueError, match="head_dim K = 272.*kernels.kda=torch"):  # past four key blocks of 64
        kt.kda_chunk(**make_inputs(B=1, T=8, H=1, K=272, V=16, seed=1))
    assert kt.kda_chunk(**inputs)[1] is None
    with pytest.raises(RuntimeError, match="no backward"):
        kt.kda_transition(*(inputs[n].requires_grad_() for n in ("k", "v", "g", "beta")))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kt.kda_chunk(**inputs)


def _kcp_triton_rank(rank: int, world: int, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank of KCP with the Triton kernels in all three seams (chunk, transition, state gradient)."""
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels module is imported in this process, after this line
    a, b = slice_bounds(x["q"].shape[1], world, rank)
    leaves = {n: x[n][:, a:b].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].clone().requires_grad_(True) if rank == 0 else None
    o, s = kcp_kda(**leaves, group=None, initial_state=h0, output_final_state=True, chunk_fn=kt.kda_chunk,
                   transition_fn=kt.kda_transition, state_grad_fn=kt.kda_state_grad)
    loss = (o * x["w_o"][:, a:b]).sum() + ((s * x["w_s"]).sum() if rank == world - 1 else 0.0)
    loss.backward()
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if s is not None:
        out["s"] = s.detach()
    if h0 is not None:
        out["dinitial_state"] = h0.grad
    return out


def test_kcp_two_ranks_with_triton_kernels_equal_single_process() -> None:
    """kcp_kda on 2 gloo ranks with the Triton chunk, transition and state-gradient kernels equals single-process
    kda_chunk: outputs, final state and every gradient (incl. the initial state's), each within the fp32
    bound of the same function twice (2 * FP32_TOL). Long memory, so the state crossing ranks matters."""
    x = make_inputs(B=1, T=128, H=1, K=16, V=16, seed=17, decay="weak")
    gen = torch.Generator().manual_seed(18)
    x["w_o"] = torch.randn(x["v"].shape, generator=gen)
    x["w_s"] = torch.randn(x["initial_state"].shape, generator=gen)
    got = dist_run(_kcp_triton_rank, 2, x, timeout=240)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, s = cpu.kda_chunk(**leaves, output_final_state=True)
    ((o * x["w_o"]).sum() + (s * x["w_s"]).sum()).backward()
    assert rel_l2(torch.cat([r["o"] for r in got], 1), o.detach()) <= 2 * FP32_TOL
    assert rel_l2(got[1]["s"], s.detach()) <= 2 * FP32_TOL
    for n in ("q", "k", "v", "g", "beta"):
        assert rel_l2(torch.cat([r[f"d{n}"] for r in got], 1), leaves[n].grad) <= 2 * FP32_TOL, n
    assert rel_l2(got[0]["dinitial_state"], leaves["initial_state"].grad) <= 2 * FP32_TOL
    # the state entering rank 1 matters: rank 1 from zero differs
    o_zero, _ = cpu.kda_chunk(*(x[n][:, 64:] for n in ("q", "k", "v", "g", "beta")))
    assert rel_l2(o_zero, o.detach()[:, 64:]) > 1e-2


def test_fla_options_equal_the_cpu_op_with_the_same_options() -> None:
    """fla's keyword options (grouped value heads HV = 2H, in-kernel q/k L2 norm, in-kernel bounded gate with A_log and
    dt_bias, beta sigmoid with negative eigenvalues, state_v_first) on the Triton op equal the CPU op called with
    the same options in fp64 (the options are one computation on the inputs, moonrt.ops.kda.fla_options): output, final
    state and every gradient, A_log's and dt_bias's included; o in q's dtype."""
    B, T, H, K, V, HV = 1, 40, 1, 16, 16, 2
    gen = torch.Generator().manual_seed(23)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=rn(B, T, H, K), k=rn(B, T, H, K), v=rn(B, T, HV, V), g=rn(B, T, HV, K), beta=rn(B, T, HV),
             A_log=0.3 * rn(HV), dt_bias=0.5 * rn(HV * K), initial_state=rn(B, HV, V, K))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, state_v_first=True, lower_bound=-5.0)  # K3's gate: the Triton path's bound
    w_o, w_s = rn(B, T, HV, V), rn(B, HV, V, K)
    results = []
    for fn in (kt.kda_chunk, cpu.kda_chunk):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, s = fn(**leaves, **opts, output_final_state=True, chunk_size=16)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        results.append({"o": o.detach(), "s": s.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}})
        assert o.dtype == x["q"].dtype and s.shape == (B, HV, V, K)
    got, ref = results
    for name in ref:
        assert rel_l2(got[name], ref[name]) <= F64_RTOL, name
