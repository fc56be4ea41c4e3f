"""Chunked KDA in Triton (K3_SYSTEMS §2.1-2.4) and KCP's segment summaries (§7): the contracts of
:func:`moonrt.ops.kda.kda_chunk`, :func:`~moonrt.ops.kda.kda_transition` and :func:`~moonrt.ops.kda.kda_state_grad`.

The kernels (:mod:`moonrt.ops.kda.backends.triton_kernels`, imported on first use so that importing this module needs no
Triton) run the chunk form of §2.3 on token-major tensors with all sequences packed along T:

1. per chunk and head (parallel): ``A_kk``, the UT transform ``T_inv = (I + Diag(beta) A_kk)^-1`` (forward
   substitution), ``W``, ``U``, ``Kg = exp(G_C - G) K``, ``decay = exp(G_C)``, ``Qg`` and ``A_qk``;
2. per sequence and head (sequential over its chunks): the fp32 state pass ``S_{n+1} = M_n S_n + S_ext_n`` with the
   outputs ``O = Qg S_n + A_qk (U - W S_n)``;
3. backward: the terms again (1.), the reverse state pass ``dS_n = M_n^T dS_{n+1} + P_n`` per sequence, then every
   input gradient per chunk in three kernels: value side, the UT transform's backward, key side (the transposes of
   1. and 2.; the log-decay gradient in fp64).

State arithmetic is fp32 for fp32 and bf16 inputs, fp64 for fp64 inputs; outputs and input gradients come back in
their tensors' dtypes. fp32 ``tl.dot`` runs on tensor cores with ``input_precision="tf32x3"`` (:data:`FP32_DOT`,
about fp32's accuracy: K3_SYSTEMS §2.3.1), fp64 with ``"ieee"``. The kernels rely on K3's gate bound: every
per-token log-decay in ``[G_LOWER_BOUND, 0] = [-5, 0]`` (K3_SYSTEMS §2.2, fla's ``safe_gate``), which keeps the
factored in-chunk exponentials of 16-token sub-tiles within ``e^40``; other decays raise one ValueError that names
``kernels.kda=torch`` (the CPU-exact path for any decay). Tiles are blocked for sm_90's limits (BK, BV <= 32 in
the per-chunk kernels, key blocks of <= 64 rows and 16 or 32 value columns per program in the state passes; see
:func:`block_for`, :func:`state_k_block`).

CPU tensors run through Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported): that is how
the tests check these kernels without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType
from typing import Any

import torch

from moonrt.ops.kda.contract import (
    check_cu_seqlens,
    check_inputs,
    check_sequence_states,
    check_state_grad_inputs,
    compute_dtype,
    prepare_call,
)
from moonrt.ops.kda.fla_options import FlaOptions
from moonrt.ops.kda.terms import check_chunk_size
from moonrt.ops.kernels import on_tensor_device
from moonrt.ops.precision import fp32_island

G_LOWER_BOUND = -5.0
"""K3's gate bound (``linear_attn_config.gate_lower_bound``, K3_SYSTEMS §2.2): the Triton path accepts per-token
log-decays in ``[G_LOWER_BOUND, 0]`` only (a 16-token sub-tile's midpoint factors then stay within ``e^(8 * 5) =
e^40``, products of two within ``e^80 < 3.4e38``)."""

SUB_TILE = 16
"""Rows of a sub-tile of the in-chunk decay factorization (the tensor cores' smallest tile; ``SUB/2 * 5 = 40``)."""

FP32_DOT = "tf32x3"
"""``tl.dot``'s input precision for fp32 arithmetic: three TF32 tensor-core products (``a_hi b_hi + a_hi b_lo +
a_lo b_hi``), each operand split into two TF32 parts; relative error per product about ``3 * 2^-22`` (K3_SYSTEMS
§2.3.1), against ``2^-11`` for plain ``"tf32"`` and FMA loops (no tensor cores, spills) for ``"ieee"``."""

MAX_BLOCK = 32
"""Largest key / value block of the per-chunk terms kernel (fla's BK, BV): its tiles are ``[C, C]`` and ``[C, 32]``.
Compiled for sm_90 at head_dim 64 and 128, 64-column blocks spilled 1,428 B per thread (tf32x3 keeps both halves of
each ``[C, 64]`` operand live), 32-column blocks 104 B (benchmarks/RESULTS.md)."""

GRADS_MAX_BLOCK = 16
"""Largest key / value block of the backward's per-chunk kernels: they hold more ``[C, C]`` tiles (A_qk, T_inv, their
gradients) and each tf32x3 product stages both TF32 halves of its operands in shared memory; at 64-column blocks
sm_90 compiled the (then single) kernel to 278,528 B of shared memory (over the 232,448 B a block may use). Spill
stores per thread at head_dim 128 (value side / key side): 32-column blocks 1,012 / 1,776 B, 16-column 692 / 816 B,
16-column with the ``[C, C]`` tiles as the dots' B operands 8 / 384 B, and with the key side's ``dA_qk`` and ``dA_kk``
backward one after the other 8 / 240 B (at every checked head size)."""

CHUNK_WARPS = 8
"""Warps of the per-chunk kernels (terms, grads): their ``[C, C]`` and ``[C, BK]`` tiles spread over 256 threads
(registers and spills per kernel: benchmarks/gpu/kda_sm90_resources.py, benchmarks/RESULTS.md)."""

STATE_K_BLOCK = 64
"""Largest key block of the state passes and the transition: the state is held as at most four key blocks
(fla's ``b_h1 .. b_h4``), so head sizes up to 256."""

STATE_V_BLOCK = 64
"""Most value columns per program of the state passes and of the transition (their columns, and M's, are
independent): bounds the ``[BKS, BV]`` key blocks of one program and adds programs to a sequential pass."""

STATE_FWD_V_BLOCK = 16
"""Value columns per program of the forward state pass. Measured for sm_90 (benchmarks/gpu/sm90.py, spill stores
per thread at head_dim 48 / 64 / 96 / 128): 64 columns 572 / 200 / 1,964 / 1,140 B, 32: 76 / 40 / 916 / 328 B,
16: 32 / 0 / 260 / 260 B (96 with two 64-row key blocks, :func:`state_k_block`)."""

STATE_BWD_V_BLOCK = 32
"""Value columns per program of the reverse state pass at head_dim <= 64 (key blocks of at most 32 rows, or one of
64), ``A_qk`` the A operand. Measured for sm_90 (benchmarks/gpu/sm90.py, spill stores per thread at head_dim 32 / 48
/ 64, two pipeline stages): 32 columns 28 / 80 / 208 B, 16: 16 / 576 / 0 B; with ``A_qk`` as the B operand, 32
columns: 664 / 56 / 80 B, 16: 460 / 560 / 0 B."""

STATE_BWD_WIDE_V_BLOCK = 16
"""Value columns per program of the reverse state pass above head_dim 64 (key blocks of 64 rows), which forms
``A_qk^T dO`` with the ``[C, C]`` tile as the dot's B operand (``AQ_AS_B``). At head_dim 128 (two stages): 16 columns
192 B (A_qk as B operand) / 312 B (as A operand), 32 columns 344 / 496 B; one stage, 32 columns: 644 B."""

TRANSITION_V_BLOCK = 16
"""Columns of M and of S_ext per transition program: 64 columns spilled 364 B at head_dim 96 (three 32-row key
blocks), 16 spill at most 48 B at every checked head size."""

STATE_PASS_STAGES = 1
"""Software-pipelining stages of the transition's chunk loop: Triton's default (3 on sm_90) buffers each chunk's
tiles three times in shared memory; AOT-compiled for sm_90 at K = V = 128 (value block 64) the forward pass needed
288 KiB (over the 227 KiB a block may use) with 3 stages and 48 KiB with 1."""

STATE_SCAN_STAGES = 2
"""Software-pipelining stages of the forward and reverse state passes (at their 16 / 32-column value blocks): two
stages take 79-169 KiB of shared memory and fewer registers for the loads in flight, so fewer spills than one stage
(forward pass at head_dim 96 and 128: 200 B from 260 B; three stages need 271,360 B at 128, over the limit)."""

STATE_WARPS = 4
"""Warps of the state passes and the transition."""

_TRITON_CHUNKS = (16, 32, 64, 128)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernels() -> ModuleType:
    try:
        import moonrt.ops.kda.backends.triton_kernels as kda_triton_kernels
    except ImportError as e:  # triton missing
        raise ImportError(f"moonrt.ops.kda.backends.triton needs the 'triton' package (pip install triton): {e}") from e
    return kda_triton_kernels


def _check_device(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kda_triton: CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 set "
                             "before importing triton); use moonrt.ops.kda on CPU")


def _chunk_len(chunk_size: object) -> int:
    c = check_chunk_size(chunk_size)
    if c not in _TRITON_CHUNKS:
        raise ValueError(f"chunk_size = {c}: the Triton kernel expects one of {_TRITON_CHUNKS}")
    return c


def block_for(D: int, cap: int = MAX_BLOCK) -> int:
    """Block of a key / value dimension D in the per-chunk kernels: the largest of 64, 32, 16 that is ``<= cap`` and
    divides D (96 -> 32: three blocks, no padding), else D rounded up to a power of two, at most ``cap`` (masked
    tail)."""
    for b in (64, 32, 16):
        if b <= cap and D % b == 0:
            return b
    return min(cap, max(16, 1 << (D - 1).bit_length()))


def check_decay_bound(g: torch.Tensor) -> None:
    """ValueError unless every per-token log-decay is in ``[G_LOWER_BOUND, 0]`` (one host sync): the Triton
    kernels' factored exponentials need K3's gate bound; ``kernels.kda=torch`` is exact at any decay."""
    if not g.numel():
        return
    lo, hi = (float(x) for x in torch.aminmax(g.detach()))
    if not (G_LOWER_BOUND <= lo and hi <= 0.0):  # NaN fails both comparisons
        raise ValueError(f"g: min {lo}, max {hi}: the Triton KDA needs per-token log-decays in "
                         f"[{G_LOWER_BOUND}, 0] (K3's gate bound, gate_lower_bound / fla's safe_gate, K3_SYSTEMS "
                         "§2.2); use kernels.kda=torch for other decays")


def state_k_block(K: int) -> int:
    """Key block of the state passes and the transition: :func:`block_for` up to ``K = STATE_K_BLOCK``, above it
    ``STATE_K_BLOCK`` with a masked tail (96 -> two blocks of 64, not three of 32: compiled for sm_90 the three-block
    reverse pass spilled 3,240 B per thread, the two-block one as K = 128's; benchmarks/RESULTS.md)."""
    return block_for(K, STATE_K_BLOCK) if K <= STATE_K_BLOCK else STATE_K_BLOCK


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """Chunk tables of packed sequences (see :mod:`moonrt.ops.kda.backends.triton_kernels`) and the kernels' tile
    sizes."""

    H: int
    K: int
    V: int
    C: int
    SUB: int
    BK: int
    BV: int
    BKG: int
    BVG: int
    BKS: int
    NS: int
    NC: int
    chunk_bos: torch.Tensor
    chunk_len: torch.Tensor
    seq_chunk0: torch.Tensor
    dtype: torch.dtype

    def tl_dtype(self) -> Any:
        import triton.language as tl

        return tl.float64 if self.dtype == torch.float64 else tl.float32

    @property
    def NKB(self) -> int:
        """Key blocks of the state passes' state (at most 4)."""
        return triton_cdiv(self.K, self.BKS)

    def state_tiles(self, v_block: int) -> dict[str, int]:
        """The state passes' tile constexprs: key blocks ``BKS`` x ``NKB`` and value columns ``BV`` per program."""
        return dict(BKS=self.BKS, NKB=self.NKB, BV=min(STATE_V_BLOCK, v_block, max(16, 1 << (self.V - 1).bit_length())))

    def prec(self) -> str:
        """``tl.dot``'s input precision: :data:`FP32_DOT` for fp32 arithmetic, ``"ieee"`` for fp64."""
        return "ieee" if self.dtype == torch.float64 else FP32_DOT


@functools.lru_cache(maxsize=64)
def _chunk_tables(lens: tuple[int, ...], C: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """``(chunk_bos, chunk_len, seq_chunk0)`` int64 on ``device`` for sequences of ``lens`` tokens in chunks of ``C``:
    built once per (lengths, chunk, device) and reused by every later call (read-only to the kernels), so a training
    step's KDA calls copy no tables to the GPU after the first step (issue 47 item 5)."""
    bos, cnt, first = [], [], [0]
    start = 0
    for n in lens:
        for c in range(0, n, C):
            bos.append(start + c)
            cnt.append(min(C, n - c))
        first.append(len(bos))
        start += n

    def ints(x: list[int]) -> torch.Tensor:
        return torch.tensor(x or [0], dtype=torch.int64, device=device)

    return ints(bos), ints(cnt), ints(first)


def _make_plan(lens: list[int], C: int, H: int, K: int, V: int, g: torch.Tensor, dtype: torch.dtype) -> _Plan:
    chunk_bos, chunk_len, seq_chunk0 = _chunk_tables(tuple(lens), C, g.device)
    NC = sum(triton_cdiv(n, C) for n in lens)
    check_decay_bound(g)
    if K > 4 * STATE_K_BLOCK:
        raise ValueError(f"head_dim K = {K}: the Triton KDA holds a state in at most 4 key blocks of "
                         f"{STATE_K_BLOCK} (K <= {4 * STATE_K_BLOCK}); use kernels.kda=torch")
    return _Plan(H=H, K=K, V=V, C=C, SUB=min(SUB_TILE, C), BK=block_for(K), BV=block_for(V),
                 BKG=block_for(K, GRADS_MAX_BLOCK), BVG=block_for(V, GRADS_MAX_BLOCK),
                 BKS=state_k_block(K), NS=len(lens), NC=NC,
                 chunk_bos=chunk_bos, chunk_len=chunk_len, seq_chunk0=seq_chunk0, dtype=dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class _Terms:
    """Per-chunk terms ``[max(NC, 1), H, C, *]`` in the compute dtype (one dummy chunk when there are none)."""

    W: torch.Tensor
    U: torch.Tensor
    Kg: torch.Tensor
    Qg: torch.Tensor
    A_qk: torch.Tensor
    A_kk: torch.Tensor
    T_inv: torch.Tensor
    decay: torch.Tensor


def _terms(p: _Plan, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           scale: float) -> _Terms:
    N = max(p.NC, 1)

    def new(*shape: int) -> torch.Tensor:
        return torch.zeros(N, p.H, *shape, dtype=p.dtype, device=k.device)

    has_q = q is not None
    t = _Terms(W=new(p.C, p.K), U=new(p.C, p.V), Kg=new(p.C, p.K), Qg=new(p.C, p.K) if has_q else new(1, 1),
               A_qk=new(p.C, p.C) if has_q else new(1, 1), A_kk=new(p.C, p.C), T_inv=new(p.C, p.C), decay=new(p.K))
    if p.NC:
        _kernels().chunk_terms_kernel[(p.NC, p.H)](
            q if has_q else k, k, v, g, beta, p.chunk_bos, p.chunk_len, t.W, t.U, t.Kg, t.Qg, t.A_qk, t.A_kk,
            t.T_inv, t.decay, _scalar(scale, p, k.device), p.H, p.K, p.V, C=p.C, BK=p.BK, BV=p.BV, SUB=p.SUB,
            HAS_Q=has_q, DT=p.tl_dtype(), PREC=p.prec(), num_warps=CHUNK_WARPS)
    return t


def _scalar(x: float, p: _Plan, device: torch.device) -> torch.Tensor:
    """``x`` as a one-element tensor in the compute dtype: a kernel's Python float argument is an fp32 scalar, which
    would round the query scale of an fp64 run."""
    return torch.full((1,), x, dtype=p.dtype, device=device)


def _placeholder(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a one-element tensor of its dtype standing for an empty one (a kernel argument never read)."""
    return x if x.numel() else x.new_zeros(1)


def _state_fwd(p: _Plan, t: _Terms, S0: torch.Tensor | None, O: torch.Tensor | None,
               store_s_in: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dev = t.W.device
    S_in = torch.empty(max(p.NC, 1) if store_s_in else 1, p.H, p.K, p.V, dtype=p.dtype, device=dev)
    S_final = torch.empty(p.NS, p.H, p.K, p.V, dtype=p.dtype, device=dev)
    tiles = p.state_tiles(STATE_FWD_V_BLOCK)
    _kernels().state_fwd_kernel[(p.NS, p.H, triton_cdiv(p.V, tiles["BV"]))](
        t.W, t.U, t.Kg, t.Qg, t.A_qk, t.decay, S_final if S0 is None else S0.contiguous(), S_in,
        _placeholder(O) if O is not None else S_in, S_final, p.seq_chunk0, p.chunk_bos, p.chunk_len, p.H, p.K, p.V,
        C=p.C, **tiles, HAS_S0=S0 is not None, HAS_Q=O is not None, STORE_S_IN=store_s_in,
        DT=p.tl_dtype(), PREC=p.prec(), num_stages=STATE_SCAN_STAGES, num_warps=STATE_WARPS)
    return S_in, S_final


def _state_bwd(p: _Plan, t: _Terms, dO: torch.Tensor, d_final: torch.Tensor | None,
               store_ds_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dev = t.W.device
    dS0 = torch.empty(p.NS, p.H, p.K, p.V, dtype=p.dtype, device=dev)
    dS_out = torch.empty(max(p.NC, 1) if store_ds_out else 1, p.H, p.K, p.V, dtype=p.dtype, device=dev)
    wide = p.K > STATE_K_BLOCK  # key blocks of 64 rows (STATE_BWD_WIDE_V_BLOCK)
    tiles = p.state_tiles(STATE_BWD_WIDE_V_BLOCK if wide else STATE_BWD_V_BLOCK)
    _kernels().state_bwd_kernel[(p.NS, p.H, triton_cdiv(p.V, tiles["BV"]))](
        t.W, t.Kg, t.Qg, t.A_qk, t.decay, _placeholder(dO.contiguous()),
        dS0 if d_final is None else d_final.contiguous(), dS0, dS_out, p.seq_chunk0, p.chunk_bos, p.chunk_len,
        p.H, p.K, p.V, C=p.C, **tiles, HAS_D_FINAL=d_final is not None, STORE_DS_OUT=store_ds_out, AQ_AS_B=wide,
        DT=p.tl_dtype(), PREC=p.prec(), num_stages=STATE_SCAN_STAGES, num_warps=STATE_WARPS)
    return dS0, dS_out


class _ChunkKDA(torch.autograd.Function):
    """Chunked KDA on token-major ``q, k, g [T, H, K]``, ``v [T, H, V]``, ``beta [T, H]`` packed sequences (``plan``);
    ``S0 [NS, H, K, V]`` or None. Returns ``O [T, H, V]`` (v's dtype; kda_chunk casts it to q's) and the final
    states ``[NS, H, K, V]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S0: torch.Tensor | None, plan: _Plan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        terms = _terms(plan, q, k, v, g, beta, scale)
        O = torch.empty_like(v)
        S_in, S_final = _state_fwd(plan, terms, None if S0 is None else S0.to(plan.dtype), O, store_s_in=True)
        ctx.save_for_backward(q, k, v, g, beta, S_in)
        ctx.plan, ctx.scale = plan, scale
        ctx.s0_dtype = None if S0 is None else S0.dtype
        return O, S_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    @fp32_island
    @on_tensor_device  # on dO's GPU: the autograd engine's thread for that device, made explicit
    def backward(ctx: Any, dO: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, S_in = ctx.saved_tensors
        p: _Plan = ctx.plan
        terms = _terms(p, q, k, v, g, beta, ctx.scale)
        dS0, dS_out = _state_bwd(p, terms, dO, d_final.to(p.dtype), store_ds_out=True)
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        if p.NC:
            kern = _kernels()
            dq, dk, dv, dg, dbeta = grads
            # the value-side kernel's scratch for the key side: V~, dV~ [NC, H, C, V] and dA [NC, H, 2, C, C]
            Vt_buf, dVt_buf = torch.empty_like(terms.U), torch.empty_like(terms.U)
            dA_buf = torch.empty(p.NC, p.H, 2, p.C, p.C, dtype=p.dtype, device=q.device)
            dO = dO.contiguous()
            kern.chunk_grads_v_kernel[(p.NC, p.H)](
                v, beta, p.chunk_bos, p.chunk_len, terms.W, terms.U, terms.Kg, terms.A_qk, terms.T_inv, S_in, dS_out,
                dO, g, k, Vt_buf, dVt_buf, dA_buf, dv, p.H, p.K, p.V, C=p.C, BK=p.BKG, BV=p.BVG, DT=p.tl_dtype(),
                PREC=p.prec(), num_warps=CHUNK_WARPS)
            kern.chunk_grads_wy_kernel[(p.NC, p.H)](
                beta, p.chunk_bos, p.chunk_len, terms.A_kk, terms.T_inv, dA_buf, dbeta, p.H, C=p.C, DT=p.tl_dtype(),
                PREC=p.prec(), num_warps=CHUNK_WARPS)
            kern.chunk_grads_k_kernel[(p.NC, p.H)](
                q, k, g, beta, p.chunk_bos, p.chunk_len, terms.T_inv, S_in, dS_out, dO, Vt_buf, dVt_buf, dA_buf,
                dq, dk, dg, _scalar(ctx.scale, p, q.device), p.H, p.K, p.V, C=p.C, BK=p.BKG, BV=p.BVG, SUB=p.SUB,
                DT=p.tl_dtype(), PREC=p.prec(), num_warps=CHUNK_WARPS)
        need = ctx.needs_input_grad
        dS0 = dS0.to(ctx.s0_dtype) if ctx.s0_dtype is not None and need[5] else None
        return (*(gr if need[i] else None for i, gr in enumerate(grads)), dS0, None, None)


@fp32_island
@on_tensor_device
def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA in Triton with a hand-written backward: the contract of :func:`moonrt.ops.kda.kda_chunk`,
    fla's keyword options included (applied to the inputs and states as the CPU op applies them,
    :mod:`moonrt.ops.kda.fla_options`: grouped value heads, in-kernel q/k L2 norm, gate, beta options,
    ``state_v_first``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decays in [-5, 0] (K3's gate bound); beta:
            ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) or None (zeros).
        output_final_state: also return the state after the last token of each sequence.
        chunk_size: tokens per chunk, one of 16, 32, 64, 128 (ValueError naming it otherwise).
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed along T (B = 1), as in ``kda_chunk``.

    Returns:
        ``o [B, T, H, V]`` in q's dtype (fla's) and the final state ``[B, H, K, V]`` (``[N, H, K, V]``) in fp32
        (fp64 for fp64 inputs) or None. Differentiable in q, k, v, g, beta and initial_state (and ``A_log``,
        ``dt_bias`` with the in-kernel gate).
    """
    C = _chunk_len(chunk_size)
    call = prepare_call(q, k, v, g, beta, FlaOptions(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first), scale=scale, initial_state=initial_state,
        per_sequence_state=cu_seqlens is not None)
    q, k, v, g, beta = call.tensors
    _check_device(q, k, v, g, beta, call.initial_state)
    B, T, H, K, V = call.dims
    if cu_seqlens is None:
        lens = [T] * B
    else:
        cu = check_cu_seqlens(cu_seqlens, B, T)
        lens = [b - a for a, b in zip(cu, cu[1:])]
        check_sequence_states(call.initial_state, len(lens), H, K, V)
    plan = _make_plan(lens, C, H, K, V, g, call.dtype)
    flat = (x.reshape(B * T, H, x.shape[-1]) for x in (q, k, v, g))
    O, S = _ChunkKDA.apply(*flat, beta.reshape(B * T, H), call.initial_state, plan, float(call.scale))
    o = O.view(B, T, H, V).to(call.out_dtype)
    if not output_final_state:
        return o, None
    return o, call.final(S.view(B, H, K, V) if cu_seqlens is None else S)


@fp32_island
@on_tensor_device
def kda_state_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    d_o: torch.Tensor,
    *,
    d_final: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gradient of :func:`kda_chunk`'s ``initial_state`` only (KCP's backward step 1): the contract of
    :func:`moonrt.ops.kda.kda_state_grad`. The terms kernel, then the reverse state pass kernel (no input gradients).

    Returns ``dS_in [B, H, K, V]`` fp32 (fp64 for fp64 inputs). No graph.
    """
    C = _chunk_len(chunk_size)
    B, T, H, K, V = check_state_grad_inputs(q, k, v, g, beta, d_o, d_final)
    _check_device(q, k, v, g, beta, d_o, d_final)
    scale = K ** -0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta)
    plan = _make_plan([T] * B, C, H, K, V, g, dtype)
    with torch.no_grad():
        q2, k2, v2, g2, d2 = (x.detach().reshape(B * T, H, x.shape[-1]).contiguous() for x in (q, k, v, g, d_o))
        terms = _terms(plan, q2, k2, v2, g2, beta.detach().reshape(B * T, H).contiguous(), scale)
        dS0, _ = _state_bwd(plan, terms, d2, None if d_final is None else d_final.detach().to(dtype),
                            store_ds_out=False)
    return dS0.view(B, H, K, V)


@fp32_island
@on_tensor_device
def kda_transition(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine state map of a segment, ``S_end = M S_start + S_ext`` (KCP's forward step 1): the contract of
    :func:`moonrt.ops.kda.kda_transition`, as the terms kernel and one sequential transition kernel per head.

    Returns ``M [B, H, K, K]`` and ``S_ext [B, H, K, V]``, fp32 (fp64 for fp64 inputs). No graph (KCP calls it
    under ``torch.no_grad``; the differentiable form is :func:`moonrt.ops.kda.kda_transition`).
    """
    C = _chunk_len(chunk_size)
    B, T, H, K, V = check_inputs(None, k, v, g, beta, None)
    _check_device(k, v, g, beta)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (k, v, g, beta)):
        raise RuntimeError("kda_triton.kda_transition has no backward: call it under torch.no_grad() (as KCP does) "
                           "or use moonrt.ops.kda.kda_transition for a differentiable M, S_ext")
    dtype = compute_dtype(k, v, g, beta)
    plan = _make_plan([T] * B, C, H, K, V, g, dtype)
    with torch.no_grad():
        k2, v2, g2 = (x.detach().reshape(B * T, H, x.shape[-1]).contiguous() for x in (k, v, g))
        terms = _terms(plan, None, k2, v2, g2, beta.detach().reshape(B * T, H).contiguous(), 1.0)
        M = torch.empty(B, H, K, K, dtype=dtype, device=k.device)
        S = torch.empty(B, H, K, V, dtype=dtype, device=k.device)
        # columns of M and of S_ext per program
        bv = min(STATE_V_BLOCK, TRANSITION_V_BLOCK, max(16, 1 << (max(K, V) - 1).bit_length()))
        _kernels().transition_kernel[(B, H, triton_cdiv(K, bv) + triton_cdiv(V, bv))](
            terms.W, terms.U, terms.Kg, terms.decay, M, S, plan.seq_chunk0, H, K, V, C=C, BKS=plan.BKS,
            NKB=plan.NKB, BV=bv, DT=plan.tl_dtype(), PREC=plan.prec(), num_stages=STATE_PASS_STAGES,
            num_warps=STATE_WARPS)
    return M, S


__all__ = ["block_for", "check_decay_bound", "kda_chunk", "kda_state_grad", "kda_transition", "state_k_block"]
