"""Triton kernels of the chunked KDA (K3_SYSTEMS §2.1-2.4, §7), launched by :mod:`moonrt.ops.kda.backends.triton`.

Layouts. Token tensors are token-major ``[T_total, H, D]`` (all sequences packed along T, fla's varlen layout);
chunk tensors are ``[NC, H, C, *]`` (NC chunks of C tokens over all sequences, tail chunks zero padded); states
are ``[NS, H, K, V]`` or ``[NC, H, K, V]``. ``chunk_bos [NC]`` (int64) is each chunk's first token,
``chunk_len [NC]`` its token count (<= C), ``seq_chunk0 [NS + 1]`` (int64) the first chunk of each sequence.
Rows past ``chunk_len`` load as padding tokens that neither decay nor write (g = k = q = v = beta = 0).

Blocking (sm_90's 232,448 B of shared memory per block, registers without spills; K3_SYSTEMS §2.3.1): the per-chunk
kernels hold ``[C, C]`` tiles and ``[C, BK]`` / ``[C, BV]`` blocks of the key / value dimensions (BK, BV <= 32,
loops over the blocks, fla's blocking); products over the key dimension accumulate over its blocks. The backward's
per-chunk work is three kernels (:func:`chunk_grads_v_kernel`, :func:`chunk_grads_wy_kernel`, then
:func:`chunk_grads_k_kernel`, through scratch tensors), so that each holds fewer live tiles; their products with a
``[C, C]`` tile are formed transposed (``tl.trans(tl.dot(tl.trans(Y), X))`` for ``X^T Y``) so that the tile is the
dot's B operand (shared memory on Hopper) rather than the A operand (registers, both tf32x3 halves). The state
passes hold the state as up to four ``[BKS, BV]`` key blocks (fla's ``b_h1 .. b_h4``; its rows are coupled through
``W S``, so every block is carried in registers) and split the value columns (and for the transition also the
columns of ``M``) over programs.

Numerics (K3_SYSTEMS §2.3.1): arithmetic in ``DT`` (fp32 for fp32/bf16 inputs, fp64 for fp64 inputs); every
``tl.dot`` runs with ``PREC`` (``"tf32x3"`` for fp32: three TF32 tensor-core products per dot, about fp32's
accuracy; ``"ieee"`` for fp64); the in-chunk cumulative log-decay ``G`` in fp64 so that each exponent is a difference
of fp64 sums rounded once; in-chunk decays ``exp(G_r - G_c)`` enter the matmuls factored through sub-tiles of ``SUB``
rows: diagonal blocks with a midpoint reference (factors within ``e^(SUB/2 * 5)`` under K3's gate bound
``g >= -5``, which the host checks), off-diagonal blocks with the reference ``b_i`` = G before sub-tile i (factors
<= 1, exponents clamped at ``LOG_FLOOR``). The blocks are formed as full ``[C, C]`` products with masks
(``tl.where``). The gradient of G is summed in fp64.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG_FLOOR = tl.constexpr(-80.0)
"""Exponents of decaying factors are clamped from below here (as :data:`moonrt.ops.kda.terms.LOG_FLOOR`)."""


@triton.jit
def _tile(ptr, R, D, r0, d0, BR: tl.constexpr, BD: tl.constexpr):
    """Block pointer to rows ``r0 ..``, columns ``d0 ..`` (``[BR, BD]``) of a row-major ``[R, D]`` tile at ``ptr``:
    loads through :func:`_ld` pad with zeros past R, D. (Offsets from block pointers are scalars; index tiles
    hoisted out of the state passes' loops would hold registers across them.)"""
    return tl.make_block_ptr(ptr, (R, D), (D, 1), (r0, d0), (BR, BD), (1, 0))


@triton.jit
def _ld(bp):
    return tl.load(bp, boundary_check=(0, 1), padding_option="zero")


@triton.jit
def _st(bp, x):
    tl.store(bp, x, boundary_check=(0, 1))


@triton.jit
def _chunk_tile(ptr, bos, ln, h, H, D, d0, C: tl.constexpr, BD: tl.constexpr):
    """Block pointer to tokens ``bos .. bos + ln`` (``[C]`` rows, padded past ln), columns ``d0 ..`` of head h of a
    token-major ``[T, H, D]`` tensor."""
    return tl.make_block_ptr(ptr + (bos * H + h) * D, (ln, D), (H * D, 1), (0, d0), (C, BD), (1, 0))


@triton.jit
def _load_chunk(ptr, bos, ln, h, H, D, d0, C: tl.constexpr, BD: tl.constexpr, DT: tl.constexpr):
    """``[C, BD]`` in DT of :func:`_chunk_tile` (zeros past the chunk's tokens and D)."""
    return _ld(_chunk_tile(ptr, bos, ln, h, H, D, d0, C, BD)).to(DT)


@triton.jit
def _store_chunk(ptr, x, bos, ln, h, H, D, d0, C: tl.constexpr, BD: tl.constexpr):
    _st(_chunk_tile(ptr, bos, ln, h, H, D, d0, C, BD), x.to(ptr.dtype.element_ty))


@triton.jit
def _midpoints(G, r, C: tl.constexpr, SUB: tl.constexpr):
    """``[C, BK]``: row r holds G at the midpoint row ``SUB/2 - 1`` of r's sub-tile (fp64)."""
    Gm = tl.zeros_like(G)
    for i in range(0, C // SUB):
        m_i = tl.sum(tl.where(r[:, None] == i * SUB + SUB // 2 - 1, G, 0.0), axis=0)
        Gm = tl.where((r // SUB == i)[:, None], m_i[None, :], Gm)
    return Gm


@triton.jit
def _offdiag_factors(G, r, i, SUB: tl.constexpr, DT: tl.constexpr):
    """Row factors ``exp(G_r - b_i)`` for rows of sub-tile i (1 elsewhere) and column factors ``exp(b_i - G_c)`` for
    columns before it (1 elsewhere), ``b_i`` = G at row ``i SUB - 1``; both <= 1, exponents clamped at LOG_FLOOR."""
    b = tl.sum(tl.where(r[:, None] == i * SUB - 1, G, 0.0), axis=0)[None, :]
    row_x = tl.where((r // SUB == i)[:, None], G - b, 0.0)
    col_x = tl.where((r < i * SUB)[:, None], b - G, 0.0)
    return tl.exp(tl.maximum(row_x, LOG_FLOOR).to(DT)), tl.exp(tl.maximum(col_x, LOG_FLOOR).to(DT))


@triton.jit
def _decayed_products(a, kk, G, r, C: tl.constexpr, SUB: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``[C, C]``: ``sum_d a_rd k_cd exp(G_rd - G_cd)`` over this key block for c < r, 0 elsewhere (the sub-tile
    factorization)."""
    rows = r[:, None]
    cols = r[None, :]
    out = tl.zeros([C, C], dtype=DT)
    if SUB > 1:
        x_pos = (G - _midpoints(G, r, C, SUB)).to(DT)
        blk = tl.dot(a * tl.exp(x_pos), tl.trans(kk * tl.exp(-x_pos)), input_precision=PREC)
        out = tl.where((rows > cols) & (rows // SUB == cols // SUB), blk, out)
    for i in range(1, C // SUB):
        row_f, col_f = _offdiag_factors(G, r, i, SUB, DT)
        blk = tl.dot(a * row_f, tl.trans(kk * col_f), input_precision=PREC)
        out = tl.where((rows // SUB == i) & (cols < i * SUB), blk, out)
    return out


@triton.jit
def _block_products_bwd(dA, blk, a, kk, row_f, col_f, PREC: tl.constexpr):
    """One factored block of :func:`_decayed_products` (entries ``blk``, ``A = (a row_f) (k col_f)^T``) backward:
    its ``(da_row, dk_col)`` terms, each multiplied by its factor. The ``[C, C]`` gradient is each dot's B operand
    (``X^T Y`` formed as ``(Y^T X)^T``)."""
    d_b = tl.where(blk, dA, 0.0)
    return (tl.trans(tl.dot(tl.trans(kk * col_f), tl.trans(d_b), input_precision=PREC)) * row_f,
            tl.trans(tl.dot(tl.trans(a * row_f), d_b, input_precision=PREC)) * col_f)


@triton.jit
def _decayed_products_bwd(dA, a, kk, G, r, C: tl.constexpr, SUB: tl.constexpr, DT: tl.constexpr,
                          PREC: tl.constexpr):
    """Backward of :func:`_decayed_products` (rows ``a``: k for ``A_kk``, qs for the strictly lower ``A_qk``) given
    its gradient ``dA`` (zero outside c < r): ``(da_row, dk_col)`` ``[C, BK]``, each already multiplied by its
    factor, so that its log-decay gradient is ``a da_row - k dk_col``. One ``[C, C]`` gradient per call: the key
    side calls it for ``A_kk`` and ``A_qk`` in turn, so only one is live."""
    rows = r[:, None]
    cols = r[None, :]
    da_row = tl.zeros_like(kk)
    dk_col = tl.zeros_like(kk)
    if SUB > 1:
        x_pos = (G - _midpoints(G, r, C, SUB)).to(DT)
        d_r, d_c = _block_products_bwd(dA, rows // SUB == cols // SUB, a, kk, tl.exp(x_pos), tl.exp(-x_pos), PREC)
        da_row += d_r
        dk_col += d_c
    for i in range(1, C // SUB):
        row_f, col_f = _offdiag_factors(G, r, i, SUB, DT)
        d_r, d_c = _block_products_bwd(dA, (rows // SUB == i) & (cols < i * SUB), a, kk, row_f, col_f, PREC)
        da_row += d_r
        dk_col += d_c
    return da_row, dk_col


@triton.jit
def _unit_lower_inverse(L, r, C: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``(I + L)^-1`` for strictly lower ``L [C, C]``: forward substitution inside the diagonal 16 x 16 blocks (all
    blocks at once, one row of each per step), then block forward substitution for the blocks below the diagonal
    (``X_bj = -D_b^-1 sum_{k<b} L_bk X_kj``)."""
    rows = r[:, None]
    cols = r[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0).to(DT)
    L_diag = tl.where(rows // 16 == cols // 16, L, 0.0)
    X = eye
    for i in range(1, 16):
        X = tl.where((r % 16 == i)[:, None], eye - tl.dot(L_diag, X, input_precision=PREC), X)
    D_inv = X  # block diagonal
    for b in range(1, C // 16):
        in_b = (rows // 16 == b)
        Y = tl.dot(tl.where(in_b & (cols < b * 16), L, 0.0), X, input_precision=PREC)
        Z = tl.dot(tl.where(in_b, D_inv, 0.0), Y, input_precision=PREC)
        X = tl.where(in_b & (cols < b * 16), -Z, X)
    return X


@triton.jit
def _chunk_keys(q, k, g, bos, ln, h, H, K, k0, scale, C: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """A chunk's key columns ``k0 .. k0 + BK``: ``k``, ``scale q`` (DT) and the fp64 in-chunk inclusive cumulative
    log-decay ``G``. ``scale`` is loaded from a one-element DT tensor by the caller (a Python float argument would be
    an fp32 scalar)."""
    kk = _load_chunk(k, bos, ln, h, H, K, k0, C, BK, DT)
    qs = _load_chunk(q, bos, ln, h, H, K, k0, C, BK, DT) * scale
    G = tl.cumsum(_load_chunk(g, bos, ln, h, H, K, k0, C, BK, tl.float64), axis=0)
    return kk, qs, G


@triton.jit
def _decay_factors(G, r, C: tl.constexpr, DT: tl.constexpr):
    """``exp(G)``, ``exp(G_C - G)`` ``[C, BK]`` and ``G_C`` ``[BK]`` (fp64, G after the chunk's last row)."""
    G_C = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    return (tl.exp(tl.maximum(G, LOG_FLOOR).to(DT)), tl.exp(tl.maximum(G_C[None, :] - G, LOG_FLOOR).to(DT)), G_C)


@triton.jit
def _chunk_program(chunk_bos, chunk_len):
    """``(n, h, bos, ln)`` of a per-chunk program (grid ``(NC, H)``): its chunk, head, first token and token count."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    return n, h, tl.load(chunk_bos + n), tl.load(chunk_len + n)


@triton.jit
def _sequence_program(seq_chunk0):
    """``(s, h, c0, c1)`` of a per-sequence program (grid ``(NS, H, ...)``): its sequence and head, and the sequence's
    chunks ``c0 .. c1 - 1``."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    return s, h, tl.load(seq_chunk0 + s), tl.load(seq_chunk0 + s + 1)


@triton.jit
def _key_block(ptr, base, K, i, C: tl.constexpr, BKS: tl.constexpr):
    """Key block i (``[C, BKS]``, zero past K) of chunk ``base``'s ``[C, K]`` tile of a ``[NC, H, C, K]`` tensor."""
    return _ld(_tile(ptr + base * C * K, C, K, 0, i * BKS, C, BKS))


@triton.jit
def _decay_block(decay, base, K, i, BKS: tl.constexpr):
    """Key block i of chunk ``base``'s ``decay [K]`` as a ``[BKS, 1]`` column (zero past K)."""
    dk = i * BKS + tl.arange(0, BKS)
    return tl.load(decay + base * K + dk, mask=dk < K, other=0.0)[:, None]


@triton.jit
def _state_block(ptr, sbase, K, V, i, v0, BKS: tl.constexpr, BV: tl.constexpr):
    """Block pointer to rows ``i BKS ..``, columns ``v0 ..`` of the ``[K, V]`` state at ``ptr + sbase * K * V``."""
    return _tile(ptr + sbase * K * V, K, V, i * BKS, v0, BKS, BV)


@triton.jit
def _store_state(ptr, sbase, K, V, v0, S0, S1, S2, S3, BKS: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr):
    """Store the key blocks ``S0 .. S{NKB-1}`` ``[BKS, BV]`` of a state's columns ``v0 ..``."""
    _st(_state_block(ptr, sbase, K, V, 0, v0, BKS, BV), S0)
    if NKB > 1:
        _st(_state_block(ptr, sbase, K, V, 1, v0, BKS, BV), S1)
    if NKB > 2:
        _st(_state_block(ptr, sbase, K, V, 2, v0, BKS, BV), S2)
    if NKB > 3:
        _st(_state_block(ptr, sbase, K, V, 3, v0, BKS, BV), S3)


@triton.jit
def _load_state(ptr, sbase, K, V, v0, BKS: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr, DT: tl.constexpr):
    """The key blocks of a state's columns ``v0 ..`` (zeros past NKB blocks)."""
    S0 = _ld(_state_block(ptr, sbase, K, V, 0, v0, BKS, BV)).to(DT)
    S1 = tl.zeros([BKS, BV], dtype=DT)
    S2 = tl.zeros([BKS, BV], dtype=DT)
    S3 = tl.zeros([BKS, BV], dtype=DT)
    if NKB > 1:
        S1 = _ld(_state_block(ptr, sbase, K, V, 1, v0, BKS, BV)).to(DT)
    if NKB > 2:
        S2 = _ld(_state_block(ptr, sbase, K, V, 2, v0, BKS, BV)).to(DT)
    if NKB > 3:
        S3 = _ld(_state_block(ptr, sbase, K, V, 3, v0, BKS, BV)).to(DT)
    return S0, S1, S2, S3


@triton.jit
def _times_state(ptr, base, K, S0, S1, S2, S3, C: tl.constexpr, BKS: tl.constexpr, NKB: tl.constexpr,
                 PREC: tl.constexpr):
    """``X S`` for chunk ``base``'s ``X [C, K]`` (``W``, ``Qg`` or ``Kg``) and a state in key blocks: the sum over
    the blocks of ``[C, BKS] @ [BKS, BV]``."""
    acc = tl.dot(_key_block(ptr, base, K, 0, C, BKS), S0, input_precision=PREC)
    if NKB > 1:
        acc += tl.dot(_key_block(ptr, base, K, 1, C, BKS), S1, input_precision=PREC)
    if NKB > 2:
        acc += tl.dot(_key_block(ptr, base, K, 2, C, BKS), S2, input_precision=PREC)
    if NKB > 3:
        acc += tl.dot(_key_block(ptr, base, K, 3, C, BKS), S3, input_precision=PREC)
    return acc


@triton.jit
def _block_update(S, decay, ptr, base, K, i, Y, C: tl.constexpr, BKS: tl.constexpr, PREC: tl.constexpr):
    """Key block i of ``Diag(decay) S + X^T Y`` for chunk ``base``'s ``X [C, K]`` (``Kg``, ``Qg`` or ``W``)."""
    return (_decay_block(decay, base, K, i, BKS) * S
            + tl.dot(tl.trans(_key_block(ptr, base, K, i, C, BKS)), Y, input_precision=PREC))


@triton.jit
def chunk_terms_kernel(q, k, v, g, beta, chunk_bos, chunk_len, W, U, Kg, Qg, A_qk, A_kk, T_inv, decay, scale,
                       H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB: tl.constexpr,
                       HAS_Q: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Per chunk and head (grid ``(NC, H)``), K3_SYSTEMS §2.3 steps 1-3, 5-6: ``A_kk`` (strictly lower), the UT
    transform ``T_inv = (I + Diag(beta) A_kk)^-1``, ``W = T_inv Diag(beta) exp(G) K``, ``U = T_inv Diag(beta) V``,
    ``Kg = exp(G_C - G) K``, ``decay = exp(G_C)`` and with ``HAS_Q`` ``Qg = scale Q exp(G)`` and ``A_qk`` (lower,
    exact diagonal ``scale q_r . k_r``). The ``[C, C]`` products accumulate over blocks of BK key columns; the
    ``[C, K]`` / ``[C, V]`` results are formed per block of BK / BV columns."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    rows = r[:, None]
    cols = r[None, :]
    sc = tl.load(scale).to(DT)
    bb = tl.load(beta + (bos + r) * H + h, mask=r < ln, other=0.0).to(DT)
    A = tl.zeros([C, C], dtype=DT)
    Aq = tl.zeros([C, C], dtype=DT)
    diag = tl.zeros([C], dtype=DT)
    for kb in range(0, tl.cdiv(K, BK)):
        kk, qs, G = _chunk_keys(q, k, g, bos, ln, h, H, K, kb * BK, sc, C, BK, DT)
        A += _decayed_products(kk, kk, G, r, C, SUB, DT, PREC)
        if HAS_Q:
            Aq += _decayed_products(qs, kk, G, r, C, SUB, DT, PREC)
            diag += tl.sum(qs * kk, axis=1)
    Ti = _unit_lower_inverse(A * bb[:, None], r, C, DT, PREC)
    base = n * H + h
    _st(_tile(A_kk + base * C * C, C, C, 0, 0, C, C), A)
    _st(_tile(T_inv + base * C * C, C, C, 0, 0, C, C), Ti)
    if HAS_Q:
        _st(_tile(A_qk + base * C * C, C, C, 0, 0, C, C), tl.where(rows == cols, diag[:, None], Aq))
    for kb in range(0, tl.cdiv(K, BK)):
        kk, qs, G = _chunk_keys(q, k, g, bos, ln, h, H, K, kb * BK, sc, C, BK, DT)
        eG, eCG, G_C = _decay_factors(G, r, C, DT)
        _st(_tile(W + base * C * K, C, K, 0, kb * BK, C, BK), tl.dot(Ti, eG * kk * bb[:, None], input_precision=PREC))
        _st(_tile(Kg + base * C * K, C, K, 0, kb * BK, C, BK), eCG * kk)
        dk = kb * BK + tl.arange(0, BK)
        tl.store(decay + base * K + dk, tl.exp(tl.maximum(G_C, LOG_FLOOR).to(DT)), mask=dk < K)
        if HAS_Q:
            _st(_tile(Qg + base * C * K, C, K, 0, kb * BK, C, BK), qs * eG)
    for vb in range(0, tl.cdiv(V, BV)):
        vv = _load_chunk(v, bos, ln, h, H, V, vb * BV, C, BV, DT)
        _st(_tile(U + base * C * V, C, V, 0, vb * BV, C, BV), tl.dot(Ti, vv * bb[:, None], input_precision=PREC))


@triton.jit
def state_fwd_kernel(W, U, Kg, Qg, A_qk, decay, S0, S_in, O, S_final, seq_chunk0, chunk_bos, chunk_len,
                     H, K, V, C: tl.constexpr, BKS: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
                     HAS_S0: tl.constexpr, HAS_Q: tl.constexpr, STORE_S_IN: tl.constexpr, DT: tl.constexpr,
                     PREC: tl.constexpr):
    """The inter-chunk state pass of one sequence, head and block of BV value columns (grid ``(NS, H, cdiv(V, BV))``:
    the columns of S are independent), in DT, the state held as NKB <= 4 key blocks ``[BKS, BV]`` (fla's
    ``b_h1 .. b_h4``): per chunk, store the entering state ``S_n`` (``STORE_S_IN``), ``V~ = U - W S_n``, with
    ``HAS_Q`` the outputs ``O = Qg S_n + A_qk V~``, then ``S_{n+1} = Diag(decay) S_n + Kg^T V~``. Writes the state
    after the sequence to ``S_final``."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    v0 = tl.program_id(2) * BV
    if HAS_S0:
        S_0, S_1, S_2, S_3 = _load_state(S0, s * H + h, K, V, v0, BKS, BV, NKB, DT)
    else:
        S_0 = tl.zeros([BKS, BV], dtype=DT)
        S_1 = tl.zeros([BKS, BV], dtype=DT)
        S_2 = tl.zeros([BKS, BV], dtype=DT)
        S_3 = tl.zeros([BKS, BV], dtype=DT)
    for n in range(c0, c1):
        base = n * H + h
        if STORE_S_IN:
            _store_state(S_in, base, K, V, v0, S_0, S_1, S_2, S_3, BKS, BV, NKB)
        Vt = (_ld(_tile(U + base * C * V, C, V, 0, v0, C, BV))
              - _times_state(W, base, K, S_0, S_1, S_2, S_3, C, BKS, NKB, PREC))
        if HAS_Q:
            o = (_times_state(Qg, base, K, S_0, S_1, S_2, S_3, C, BKS, NKB, PREC)
                 + tl.dot(_ld(_tile(A_qk + base * C * C, C, C, 0, 0, C, C)), Vt, input_precision=PREC))
            _store_chunk(O, o, tl.load(chunk_bos + n), tl.load(chunk_len + n), h, H, V, v0, C, BV)
        S_0 = _block_update(S_0, decay, Kg, base, K, 0, Vt, C, BKS, PREC)
        if NKB > 1:
            S_1 = _block_update(S_1, decay, Kg, base, K, 1, Vt, C, BKS, PREC)
        if NKB > 2:
            S_2 = _block_update(S_2, decay, Kg, base, K, 2, Vt, C, BKS, PREC)
        if NKB > 3:
            S_3 = _block_update(S_3, decay, Kg, base, K, 3, Vt, C, BKS, PREC)
    _store_state(S_final, s * H + h, K, V, v0, S_0, S_1, S_2, S_3, BKS, BV, NKB)


@triton.jit
def _identity_block(is_m, i, col0, BKS: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr):
    """Rows ``i BKS ..``, columns ``col0 ..`` of the identity where ``is_m``, else zeros (``[BKS, BV]``)."""
    rows = i * BKS + tl.arange(0, BKS)
    return tl.where(is_m & (rows[:, None] == col0 + tl.arange(0, BV)[None, :]), 1.0, 0.0).to(DT)


@triton.jit
def transition_kernel(W, U, Kg, decay, M_out, S_out, seq_chunk0, H, K, V, C: tl.constexpr, BKS: tl.constexpr,
                      NKB: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Affine map of one segment and head, K3_SYSTEMS §2.4: ``M = prod_n M_n`` (later chunks on the left) with
    ``M_n X = Diag(decay) X - Kg^T (W X)``, and ``S_ext`` the state after the segment from zero. Grid
    ``(NS, H, cdiv(K, BV) + cdiv(V, BV))``: program j < cdiv(K, BV) carries BV columns of M (from the identity),
    the others BV columns of S_ext (from zero, with U): ``X <- Diag(decay) X + Kg^T ([U] - W X)``, X in NKB key
    blocks as in :func:`state_fwd_kernel`."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    j = tl.program_id(2)
    n_m = tl.cdiv(K, BV)
    is_m = j < n_m
    col0 = tl.where(is_m, j, j - n_m) * BV
    X_0 = _identity_block(is_m, 0, col0, BKS, BV, DT)
    X_1 = _identity_block(is_m, 1, col0, BKS, BV, DT)
    X_2 = _identity_block(is_m, 2, col0, BKS, BV, DT)
    X_3 = _identity_block(is_m, 3, col0, BKS, BV, DT)
    u_rows = tl.where(is_m, 0, C)  # M's programs read no U (an empty block: zeros)
    for n in range(c0, c1):
        base = n * H + h
        Y = (_ld(_tile(U + base * C * V, u_rows, V, 0, col0, C, BV))
             - _times_state(W, base, K, X_0, X_1, X_2, X_3, C, BKS, NKB, PREC))
        X_0 = _block_update(X_0, decay, Kg, base, K, 0, Y, C, BKS, PREC)
        if NKB > 1:
            X_1 = _block_update(X_1, decay, Kg, base, K, 1, Y, C, BKS, PREC)
        if NKB > 2:
            X_2 = _block_update(X_2, decay, Kg, base, K, 2, Y, C, BKS, PREC)
        if NKB > 3:
            X_3 = _block_update(X_3, decay, Kg, base, K, 3, Y, C, BKS, PREC)
    if is_m:
        _store_state(M_out, s * H + h, K, K, col0, X_0, X_1, X_2, X_3, BKS, BV, NKB)
    else:
        _store_state(S_out, s * H + h, K, V, col0, X_0, X_1, X_2, X_3, BKS, BV, NKB)


@triton.jit
def state_bwd_kernel(W, Kg, Qg, A_qk, decay, dO, d_final, dS0, dS_out, seq_chunk0, chunk_bos, chunk_len,
                     H, K, V, C: tl.constexpr, BKS: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
                     HAS_D_FINAL: tl.constexpr, STORE_DS_OUT: tl.constexpr, AQ_AS_B: tl.constexpr, DT: tl.constexpr,
                     PREC: tl.constexpr):
    """The reverse state pass of one sequence, head and block of BV value columns (grid ``(NS, H, cdiv(V, BV))``),
    the state gradient in NKB key blocks as in :func:`state_fwd_kernel`: from the final-state gradient, per chunk
    from the last, store the gradient of the state leaving it (``STORE_DS_OUT``), then
    ``dS_n = M_n^T dS_{n+1} + P_n = Diag(decay) dS_{n+1} + Qg^T dO - W^T (A_qk^T dO + Kg dS_{n+1})``. Writes the
    gradient of the state entering the sequence to ``dS0``. ``AQ_AS_B``: ``A_qk^T dO`` formed transposed
    (``(dO^T A_qk)^T``), so that the ``[C, C]`` tile is the B operand (shared memory) instead of the A operand
    (registers, both tf32x3 halves); which of the two fits sm_90 depends on the shape (K3_SYSTEMS §2.3.1)."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    v0 = tl.program_id(2) * BV
    if HAS_D_FINAL:
        dS_0, dS_1, dS_2, dS_3 = _load_state(d_final, s * H + h, K, V, v0, BKS, BV, NKB, DT)
    else:
        dS_0 = tl.zeros([BKS, BV], dtype=DT)
        dS_1 = tl.zeros([BKS, BV], dtype=DT)
        dS_2 = tl.zeros([BKS, BV], dtype=DT)
        dS_3 = tl.zeros([BKS, BV], dtype=DT)
    for j in range(0, c1 - c0):
        n = c1 - 1 - j
        base = n * H + h
        if STORE_DS_OUT:
            _store_state(dS_out, base, K, V, v0, dS_0, dS_1, dS_2, dS_3, BKS, BV, NKB)
        dOn = _load_chunk(dO, tl.load(chunk_bos + n), tl.load(chunk_len + n), h, H, V, v0, C, BV, DT)
        Aq = _ld(_tile(A_qk + base * C * C, C, C, 0, 0, C, C))
        if AQ_AS_B:  # dV~^T = dO^T A_qk: the [C, C] tile is the dot's B operand (read from shared memory)
            dVt = tl.trans(tl.dot(tl.trans(dOn), Aq, input_precision=PREC))
        else:
            dVt = tl.dot(tl.trans(Aq), dOn, input_precision=PREC)
        dVt += _times_state(Kg, base, K, dS_0, dS_1, dS_2, dS_3, C, BKS, NKB, PREC)
        dS_0 = (_block_update(dS_0, decay, Qg, base, K, 0, dOn, C, BKS, PREC)
                - tl.dot(tl.trans(_key_block(W, base, K, 0, C, BKS)), dVt, input_precision=PREC))
        if NKB > 1:
            dS_1 = (_block_update(dS_1, decay, Qg, base, K, 1, dOn, C, BKS, PREC)
                    - tl.dot(tl.trans(_key_block(W, base, K, 1, C, BKS)), dVt, input_precision=PREC))
        if NKB > 2:
            dS_2 = (_block_update(dS_2, decay, Qg, base, K, 2, dOn, C, BKS, PREC)
                    - tl.dot(tl.trans(_key_block(W, base, K, 2, C, BKS)), dVt, input_precision=PREC))
        if NKB > 3:
            dS_3 = (_block_update(dS_3, decay, Qg, base, K, 3, dOn, C, BKS, PREC)
                    - tl.dot(tl.trans(_key_block(W, base, K, 3, C, BKS)), dVt, input_precision=PREC))
    _store_state(dS0, s * H + h, K, V, v0, dS_0, dS_1, dS_2, dS_3, BKS, BV, NKB)


@triton.jit
def chunk_grads_v_kernel(v, beta, chunk_bos, chunk_len, W, U, Kg, A_qk, T_inv, S_in, dS_out, dO, g, k,
                         Vt_buf, dVt_buf, dA_buf, dv_, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Backward, value side, of one chunk and head (grid ``(NC, H)``) given the output gradient ``dO``, the entering
    state ``S_n`` and the gradient ``dS_{n+1}`` of the leaving one: the transposes of the outputs ``O = Qg S_n + A_qk
    V~``, ``S_{n+1} = Diag(decay) S_n + Kg^T V~``, ``V~ = U - W S_n`` and of ``U = T v``, ``W = T X`` (``T = T_inv
    Diag(beta)``, ``X = exp(G) K``, ``T_inv = (I + Diag(beta) A_kk)^-1``).

    Per block of BV value columns (contractions over the key blocks): ``V~``, ``dV~ = A_qk^T dO + Kg dS_{n+1}``
    (stored to the scratch ``Vt_buf``, ``dVt_buf`` ``[NC, H, C, V]`` DT for :func:`chunk_grads_k_kernel`), ``dv``,
    and the ``[C, C]`` gradients ``dA_qk += dO V~^T``, ``dT += dV~ (v - X S_n)^T`` (``dT = dW X^T + dV~ v^T`` with
    ``dW = -dV~ S_n^T``), stored (lower) to ``dA_buf [NC, H, 2, C, C]`` DT: ``dT`` (which
    :func:`chunk_grads_wy_kernel` turns into ``dL Diag(beta)``, the gradient of ``A_kk``) and ``dA_qk`` with its
    diagonal (the exact ``scale q_r . k_r``)."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    rows = r[:, None]
    cols = r[None, :]
    bb = tl.load(beta + (bos + r) * H + h, mask=r < ln, other=0.0).to(DT)
    base = n * H + h
    Aq = _ld(_tile(A_qk + base * C * C, C, C, 0, 0, C, C))
    Ti = _ld(_tile(T_inv + base * C * C, C, C, 0, 0, C, C))
    dAq = tl.zeros([C, C], dtype=DT)
    dT = tl.zeros([C, C], dtype=DT)
    for vb in range(0, tl.cdiv(V, BV)):
        v0 = vb * BV
        dOn = _load_chunk(dO, bos, ln, h, H, V, v0, C, BV, DT)
        Vt = _ld(_tile(U + base * C * V, C, V, 0, v0, C, BV))
        Y = _load_chunk(v, bos, ln, h, H, V, v0, C, BV, DT)
        dVt = tl.trans(tl.dot(tl.trans(dOn), Aq, input_precision=PREC))
        for kb in range(0, tl.cdiv(K, BK)):
            k0 = kb * BK
            S = _ld(_tile(S_in + base * K * V, K, V, k0, v0, BK, BV))
            G = tl.cumsum(_load_chunk(g, bos, ln, h, H, K, k0, C, BK, tl.float64), axis=0)
            X = tl.exp(tl.maximum(G, LOG_FLOOR).to(DT)) * _load_chunk(k, bos, ln, h, H, K, k0, C, BK, DT)
            Vt -= tl.dot(_ld(_tile(W + base * C * K, C, K, 0, k0, C, BK)), S, input_precision=PREC)
            Y -= tl.dot(X, S, input_precision=PREC)
            dVt += tl.dot(_ld(_tile(Kg + base * C * K, C, K, 0, k0, C, BK)),
                          _ld(_tile(dS_out + base * K * V, K, V, k0, v0, BK, BV)), input_precision=PREC)
        dAq += tl.dot(dOn, tl.trans(Vt), input_precision=PREC)
        dT += tl.dot(dVt, tl.trans(Y), input_precision=PREC)
        _st(_tile(Vt_buf + base * C * V, C, V, 0, v0, C, BV), Vt)
        _st(_tile(dVt_buf + base * C * V, C, V, 0, v0, C, BV), dVt)
        _store_chunk(dv_, tl.trans(tl.dot(tl.trans(dVt), Ti * bb[None, :], input_precision=PREC)), bos, ln, h, H, V,
                     v0, C, BV)
    _st(_tile(dA_buf + base * 2 * C * C, C, C, 0, 0, C, C), tl.where(rows >= cols, dT, 0.0))
    _st(_tile(dA_buf + (base * 2 + 1) * C * C, C, C, 0, 0, C, C), tl.where(rows >= cols, dAq, 0.0))


@triton.jit
def chunk_grads_wy_kernel(beta, chunk_bos, chunk_len, A_kk, T_inv, dA_buf, dbeta, H, C: tl.constexpr,
                          DT: tl.constexpr, PREC: tl.constexpr):
    """Backward of the UT transform of one chunk and head (grid ``(NC, H)``), between :func:`chunk_grads_v_kernel`
    and :func:`chunk_grads_k_kernel`: from ``dT`` (``dA_buf[.., 0]``) ``dbeta`` and ``dL = -T_inv^T (dT Diag(beta))
    T_inv^T`` (strictly lower), which replaces dT there as ``dL Diag(beta)``, the gradient of ``A_kk``."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    rows = r[:, None]
    cols = r[None, :]
    bb = tl.load(beta + (bos + r) * H + h, mask=r < ln, other=0.0).to(DT)
    base = n * H + h
    Ti = _ld(_tile(T_inv + base * C * C, C, C, 0, 0, C, C))
    dT = _ld(_tile(dA_buf + base * 2 * C * C, C, C, 0, 0, C, C))
    d_beta = tl.sum(dT * Ti, axis=0)
    dL = -tl.dot(tl.dot(tl.trans(Ti), dT * bb[None, :], input_precision=PREC), tl.trans(Ti), input_precision=PREC)
    dL = tl.where(rows > cols, dL, 0.0)
    d_beta += tl.sum(dL * _ld(_tile(A_kk + base * C * C, C, C, 0, 0, C, C)), axis=1)
    tl.store(dbeta + (bos + r) * H + h, d_beta.to(dbeta.dtype.element_ty), mask=r < ln)
    tl.debug_barrier()  # every thread has read dT before it is overwritten
    _st(_tile(dA_buf + base * 2 * C * C, C, C, 0, 0, C, C), dL * bb[:, None])


@triton.jit
def chunk_grads_k_kernel(q, k, g, beta, chunk_bos, chunk_len, T_inv, S_in, dS_out, dO, Vt_buf, dVt_buf, dA_buf,
                         dq, dk_, dg, scale, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         SUB: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """Backward, key side, of one chunk and head (grid ``(NC, H)``), after :func:`chunk_grads_v_kernel` (its
    scratch ``Vt_buf``, ``dVt_buf``, ``dA_buf``): per block of BK key columns (contractions over the value blocks)
    ``dKg = V~ dS_{n+1}^T``, ``dW = -dV~ S_n^T``, ``dQg = dO S_n^T``, ``d decay``, then the transposes of
    :func:`chunk_terms_kernel`'s key terms: dq, dk and dg (the log-decay gradient summed in fp64)."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    rows = r[:, None]
    cols = r[None, :]
    sc = tl.load(scale).to(DT)
    bb = tl.load(beta + (bos + r) * H + h, mask=r < ln, other=0.0).to(DT)
    base = n * H + h
    f64 = tl.float64
    for kb in range(0, tl.cdiv(K, BK)):
        k0 = kb * BK
        kk, qs, G = _chunk_keys(q, k, g, bos, ln, h, H, K, k0, sc, C, BK, DT)
        dKg = tl.zeros([C, BK], dtype=DT)
        dW = tl.zeros([C, BK], dtype=DT)
        dQg = tl.zeros([C, BK], dtype=DT)
        d_dec = tl.zeros([BK], dtype=DT)
        for vb in range(0, tl.cdiv(V, BV)):
            v0 = vb * BV
            S = _ld(_tile(S_in + base * K * V, K, V, k0, v0, BK, BV))
            dS = _ld(_tile(dS_out + base * K * V, K, V, k0, v0, BK, BV))
            dKg += tl.dot(_ld(_tile(Vt_buf + base * C * V, C, V, 0, v0, C, BV)), tl.trans(dS), input_precision=PREC)
            dW -= tl.dot(_ld(_tile(dVt_buf + base * C * V, C, V, 0, v0, C, BV)), tl.trans(S), input_precision=PREC)
            dQg += tl.dot(_load_chunk(dO, bos, ln, h, H, V, v0, C, BV, DT), tl.trans(S), input_precision=PREC)
            d_dec += tl.sum(S * dS, axis=1)
        eG, eCG, G_C = _decay_factors(G, r, C, DT)
        X = eG * kk
        T = _ld(_tile(T_inv + base * C * C, C, C, 0, 0, C, C)) * bb[None, :]
        dX = tl.trans(tl.dot(tl.trans(dW), T, input_precision=PREC))
        dAq = _ld(_tile(dA_buf + (base * 2 + 1) * C * C, C, C, 0, 0, C, C))
        diag = tl.sum(tl.where(rows == cols, dAq, 0.0), axis=1)
        dq_row, dk_col = _decayed_products_bwd(tl.where(rows > cols, dAq, 0.0), qs, kk, G, r, C, SUB, DT, PREC)
        dk_row, dk_col_k = _decayed_products_bwd(_ld(_tile(dA_buf + base * 2 * C * C, C, C, 0, 0, C, C)), kk, kk, G,
                                                 r, C, SUB, DT, PREC)
        dk_col += dk_col_k
        dqs = dq_row + diag[:, None] * kk + dQg * eG
        dkk = dk_row + dk_col + diag[:, None] * qs + dX * eG + dKg * eCG
        # log-decay gradient in fp64 (its terms are large and cancel), then the reverse cumulative sum over the chunk
        dKgKg = dKg.to(f64) * (eCG * kk).to(f64)
        dG = (dX.to(f64) * X.to(f64) + kk.to(f64) * (dk_row.to(f64) - dk_col.to(f64)) + qs.to(f64) * dq_row.to(f64)
              - dKgKg + dQg.to(f64) * (qs * eG).to(f64))
        last = tl.sum(dKgKg, axis=0) + d_dec.to(f64) * tl.exp(tl.maximum(G_C, LOG_FLOOR).to(DT)).to(f64)
        dG = tl.where(rows == C - 1, dG + last[None, :], dG)
        dG = tl.cumsum(dG, axis=0, reverse=True)
        _store_chunk(dq, dqs * sc, bos, ln, h, H, K, k0, C, BK)
        _store_chunk(dk_, dkk, bos, ln, h, H, K, k0, C, BK)
        _store_chunk(dg, dG.to(DT), bos, ln, h, H, K, k0, C, BK)  # via DT: no direct fp64 -> bf16 cast
