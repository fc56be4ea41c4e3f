"""Triton kernels of the chunked KDA (K3_SYSTEMS §2.1-2.4, §7), launched by :mod:`moonrt.ops.kda.backends.triton`.

Layouts. Token tensors are token-major ``[T_total, H, D]`` (all sequences packed along T, fla's varlen layout);
chunk tensors are ``[NC, H, C, *]`` (NC chunks of C tokens over all sequences, tail chunks zero padded); states
are ``[NS, H, K, V]`` or ``[NC, H, K, V]``. ``chunk_bos [NC]`` (int64) is each chunk's first token,
``chunk_len [NC]`` its token count (<= C), ``seq_chunk0 [NS + 1]`` (int64) the first chunk of each sequence.
Rows past ``chunk_len`` load as padding tokens that neither decay nor write (g = k = q = v = beta = 0).

Numerics (as the CPU kernel, :mod:`moonrt.ops.kda.terms`): arithmetic in ``DT`` (fp32 for fp32/bf16 inputs, fp64 for
fp64 inputs), every ``tl.dot`` with ``input_precision=IEEE`` (no TF32 on GPUs); the in-chunk cumulative log-decay
``G`` in fp64 so that each exponent is a difference of fp64 sums rounded once; in-chunk decays ``exp(G_r - G_c)``
enter the matmuls factored through sub-tiles of ``SUB`` rows: diagonal blocks with a midpoint reference (factors
within ``e^(SUB/2 * |g_min|)``), off-diagonal blocks with the reference ``b_i`` = G before sub-tile i (factors <= 1,
exponents clamped at ``LOG_FLOOR``). The blocks are formed as full ``[C, C]`` products with masks (``tl.where``, so a
masked entry that overflowed never reaches a result). The gradient of G is summed in fp64.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG_FLOOR = tl.constexpr(-80.0)
"""Exponents of decaying factors are clamped from below here (as :data:`moonrt.ops.kda.terms.LOG_FLOOR`)."""

G_FLOOR = tl.constexpr(-1000.0)
"""Per-token log-decays are clamped from below here (:data:`moonrt.ops.kda.backends.triton.G_FLOOR`: ``exp(-1000) = 0``)."""

IEEE = tl.constexpr("ieee")
"""``tl.dot``'s input precision for every product: full fp32 (a GPU would otherwise round fp32 operands to TF32)."""


@triton.jit
def _load_chunk(ptr, bos, ln, h, H, D, r, d, DT: tl.constexpr):
    """Tokens ``bos .. bos + ln`` of head h of a token-major ``[T, H, D]`` tensor as ``[C, BD]`` in DT (zeros past)."""
    mask = (r[:, None] < ln) & (d[None, :] < D)
    return tl.load(ptr + ((bos + r[:, None]) * H + h) * D + d[None, :], mask=mask, other=0.0).to(DT)


@triton.jit
def _store_chunk(ptr, x, bos, ln, h, H, D, r, d):
    mask = (r[:, None] < ln) & (d[None, :] < D)
    tl.store(ptr + ((bos + r[:, None]) * H + h) * D + d[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_offsets(base, R, D, r, d):
    """Offsets of a ``[R, D]`` tile starting at ``base`` and its mask (``d < D``)."""
    return base + r[:, None] * D + d[None, :], (r[:, None] < R) & (d[None, :] < D)


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
def _decayed_products(a, kk, G, r, C: tl.constexpr, SUB: tl.constexpr, DT: tl.constexpr):
    """``[C, C]``: ``sum_d a_rd k_cd exp(G_rd - G_cd)`` for c < r, 0 elsewhere (the sub-tile factorization)."""
    rows = r[:, None]
    cols = r[None, :]
    out = tl.zeros([C, C], dtype=DT)
    if SUB > 1:
        x_pos = (G - _midpoints(G, r, C, SUB)).to(DT)
        blk = tl.dot(a * tl.exp(x_pos), tl.trans(kk * tl.exp(-x_pos)), input_precision=IEEE)
        out = tl.where((rows > cols) & (rows // SUB == cols // SUB), blk, out)
    for i in range(1, C // SUB):
        row_f, col_f = _offdiag_factors(G, r, i, SUB, DT)
        blk = tl.dot(a * row_f, tl.trans(kk * col_f), input_precision=IEEE)
        out = tl.where((rows // SUB == i) & (cols < i * SUB), blk, out)
    return out


@triton.jit
def _block_products_bwd(dA_k, dA_q, blk, kk, qs, row_f, col_f):
    """One factored block of :func:`_decayed_products` (entries ``blk``, ``A = (a row_f) (k col_f)^T``) backward, for
    ``A_kk`` (rows k) and ``A_qk`` (rows qs): its ``(dk_row, dqs_row, dk_col)`` terms, each multiplied by its factor."""
    dk_b = tl.where(blk, dA_k, 0.0)
    dq_b = tl.where(blk, dA_q, 0.0)
    k_col = kk * col_f
    return (tl.dot(dk_b, k_col, input_precision=IEEE) * row_f, tl.dot(dq_b, k_col, input_precision=IEEE) * row_f,
            (tl.dot(tl.trans(dk_b), kk * row_f, input_precision=IEEE)
             + tl.dot(tl.trans(dq_b), qs * row_f, input_precision=IEEE)) * col_f)


@triton.jit
def _decayed_products_bwd(dA_k, dA_q, kk, qs, G, r, C: tl.constexpr, SUB: tl.constexpr, DT: tl.constexpr):
    """Backward of :func:`_decayed_products` for ``A_kk`` (rows k) and the strictly lower ``A_qk`` (rows qs) given
    their gradients (zero outside c < r): ``(dk_row, dqs_row, dk_col)`` ``[C, BK]`` each, already multiplied by its
    factor, so that the log-decay gradient is ``k dk_row + qs dqs_row - k dk_col``."""
    rows = r[:, None]
    cols = r[None, :]
    dk_row = tl.zeros_like(kk)
    dq_row = tl.zeros_like(kk)
    dk_col = tl.zeros_like(kk)
    if SUB > 1:
        x_pos = (G - _midpoints(G, r, C, SUB)).to(DT)
        e_pos = tl.exp(x_pos)
        e_neg = tl.exp(-x_pos)
        d_kr, d_qr, d_kc = _block_products_bwd(dA_k, dA_q, rows // SUB == cols // SUB, kk, qs, e_pos, e_neg)
        dk_row += d_kr
        dq_row += d_qr
        dk_col += d_kc
    for i in range(1, C // SUB):
        row_f, col_f = _offdiag_factors(G, r, i, SUB, DT)
        d_kr, d_qr, d_kc = _block_products_bwd(dA_k, dA_q, (rows // SUB == i) & (cols < i * SUB), kk, qs, row_f,
                                               col_f)
        dk_row += d_kr
        dq_row += d_qr
        dk_col += d_kc
    return dk_row, dq_row, dk_col


@triton.jit
def _unit_lower_inverse(L, r, C: tl.constexpr, DT: tl.constexpr):
    """``(I + L)^-1`` for strictly lower ``L [C, C]``: forward substitution inside the diagonal 16 x 16 blocks (all
    blocks at once, one row of each per step), then block forward substitution for the blocks below the diagonal
    (``X_bj = -D_b^-1 sum_{k<b} L_bk X_kj``)."""
    rows = r[:, None]
    cols = r[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0).to(DT)
    L_diag = tl.where(rows // 16 == cols // 16, L, 0.0)
    X = eye
    for i in range(1, 16):
        X = tl.where((r % 16 == i)[:, None], eye - tl.dot(L_diag, X, input_precision=IEEE), X)
    D_inv = X  # block diagonal
    for b in range(1, C // 16):
        in_b = (rows // 16 == b)
        Y = tl.dot(tl.where(in_b & (cols < b * 16), L, 0.0), X, input_precision=IEEE)
        Z = tl.dot(tl.where(in_b, D_inv, 0.0), Y, input_precision=IEEE)
        X = tl.where(in_b & (cols < b * 16), -Z, X)
    return X


@triton.jit
def _chunk_inputs(q, k, g, beta, bos, ln, h, H, K, r, dk, scale, DT: tl.constexpr):
    """A chunk's ``k``, ``scale q``, ``beta`` (DT) and fp64 in-chunk inclusive cumulative log-decay ``G``. ``scale``
    is loaded from a one-element DT tensor by the caller (a Python float argument would be an fp32 scalar)."""
    kk = _load_chunk(k, bos, ln, h, H, K, r, dk, DT)
    qs = _load_chunk(q, bos, ln, h, H, K, r, dk, DT) * scale
    G = tl.cumsum(tl.maximum(_load_chunk(g, bos, ln, h, H, K, r, dk, tl.float64), G_FLOOR), axis=0)
    bb = tl.load(beta + (bos + r) * H + h, mask=r < ln, other=0.0).to(DT)
    return kk, qs, G, bb


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
def _value_block(BV: tl.constexpr):
    """This program's block of BV value columns (program id 2): the columns of a state are independent."""
    return tl.program_id(2) * BV + tl.arange(0, BV)


@triton.jit
def _state_pass_start(S_init, s, h, H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_INIT: tl.constexpr, DT: tl.constexpr):
    """Start of a per-sequence state pass over this program's block of value columns: the index vectors ``r``
    (chunk rows), ``dk`` (key rows), ``dv`` (:func:`_value_block`), the offsets and mask of the sequence's state tile,
    and the ``[BK, BV]`` state entering the pass (loaded from ``S_init`` with ``HAS_INIT``, else zeros)."""
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    dv = _value_block(BV)
    os_, ms = _tile_offsets((s * H + h) * K * V, K, V, dk, dv)
    S = tl.zeros([BK, BV], dtype=DT)
    if HAS_INIT:
        S = tl.load(S_init + os_, mask=ms, other=0.0).to(DT)
    return r, dk, dv, os_, ms, S


@triton.jit
def _transition_tiles(W, Kg, decay, base, C: tl.constexpr, K, ck, mk, dk):
    """Chunk ``base``'s ``W [C, BK]``, ``Kg^T [BK, C]`` and ``decay [BK]``: its transition is
    ``M_n X = Diag(decay) X - Kg^T (W X)``."""
    Wn = tl.load(W + base * C * K + ck, mask=mk, other=0.0)
    KgT = tl.trans(tl.load(Kg + base * C * K + ck, mask=mk, other=0.0))
    dec = tl.load(decay + base * K + dk, mask=dk < K, other=0.0)
    return Wn, KgT, dec


@triton.jit
def _state_step(S, U, base, Wn, KgT, dec, C: tl.constexpr, V, cv, mv):
    """One chunk of the forward state pass: ``(S_{n+1}, V~)`` with ``V~ = U - W S_n`` and
    ``S_{n+1} = Diag(decay) S_n + Kg^T V~`` (the tiles of :func:`_transition_tiles`)."""
    Vt = tl.load(U + base * C * V + cv, mask=mv, other=0.0) - tl.dot(Wn, S, input_precision=IEEE)
    return dec[:, None] * S + tl.dot(KgT, Vt, input_precision=IEEE), Vt


@triton.jit
def chunk_terms_kernel(q, k, v, g, beta, chunk_bos, chunk_len, W, U, Kg, Qg, A_qk, A_kk, T_inv, decay, scale,
                       H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SUB: tl.constexpr,
                       HAS_Q: tl.constexpr, DT: tl.constexpr):
    """Per chunk and head (grid ``(NC, H)``), K3_SYSTEMS §2.3 steps 1-3, 5-6: ``A_kk`` (strictly lower), the UT
    transform ``T_inv = (I + Diag(beta) A_kk)^-1``, ``W = T_inv Diag(beta) exp(G) K``, ``U = T_inv Diag(beta) V``,
    ``Kg = exp(G_C - G) K``, ``decay = exp(G_C)`` and with ``HAS_Q`` ``Qg = scale Q exp(G)`` and ``A_qk`` (lower,
    exact diagonal ``scale q_r . k_r``)."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    kk, qs, G, bb = _chunk_inputs(q, k, g, beta, bos, ln, h, H, K, r, dk, tl.load(scale).to(DT), DT)
    vv = _load_chunk(v, bos, ln, h, H, V, r, dv, DT)
    A = _decayed_products(kk, kk, G, r, C, SUB, DT)
    Ti = _unit_lower_inverse(A * bb[:, None], r, C, DT)
    eG = tl.exp(tl.maximum(G, LOG_FLOOR).to(DT))
    G_C = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    eCG = tl.exp(tl.maximum(G_C[None, :] - G, LOG_FLOOR).to(DT))
    base = n * H + h
    ok, mk = _tile_offsets(base * C * K, C, K, r, dk)
    ov, mv = _tile_offsets(base * C * V, C, V, r, dv)
    oc, mc = _tile_offsets(base * C * C, C, C, r, r)
    tl.store(W + ok, tl.dot(Ti, eG * kk * bb[:, None], input_precision=IEEE), mask=mk)
    tl.store(U + ov, tl.dot(Ti, vv * bb[:, None], input_precision=IEEE), mask=mv)
    tl.store(Kg + ok, eCG * kk, mask=mk)
    tl.store(A_kk + oc, A, mask=mc)
    tl.store(T_inv + oc, Ti, mask=mc)
    tl.store(decay + base * K + dk, tl.exp(tl.maximum(G_C, LOG_FLOOR).to(DT)), mask=dk < K)
    if HAS_Q:
        tl.store(Qg + ok, qs * eG, mask=mk)
        Aq = _decayed_products(qs, kk, G, r, C, SUB, DT)
        Aq = tl.where(r[:, None] == r[None, :], tl.sum(qs * kk, axis=1)[:, None], Aq)
        tl.store(A_qk + oc, Aq, mask=mc)


@triton.jit
def _load_tile(ptr, base, R, D, r, d):
    off, mask = _tile_offsets(base, R, D, r, d)
    return tl.load(ptr + off, mask=mask, other=0.0)


@triton.jit
def state_fwd_kernel(W, U, Kg, Qg, A_qk, decay, S0, S_in, O, S_final, seq_chunk0, chunk_bos, chunk_len,
                     H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                     HAS_Q: tl.constexpr, STORE_S_IN: tl.constexpr, DT: tl.constexpr):
    """The inter-chunk state pass of one sequence, head and block of BV value columns (grid ``(NS, H, cdiv(V, BV))``:
    the columns of S are independent), in DT: per chunk, store the entering
    state ``S_n`` (``STORE_S_IN``), ``V~ = U - W S_n``, with ``HAS_Q`` the outputs ``O = Qg S_n + A_qk V~``, then
    ``S_{n+1} = Diag(decay) S_n + Kg^T V~``. Writes the state after the sequence to ``S_final``."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    r, dk, dv, os_, ms, S = _state_pass_start(S0, s, h, H, K, V, C, BK, BV, HAS_S0, DT)
    ck, mk = _tile_offsets(0, C, K, r, dk)  # offsets inside one chunk's tiles (the loop adds the chunk's base)
    cv, mv = _tile_offsets(0, C, V, r, dv)
    cc, mc = _tile_offsets(0, C, C, r, r)
    sv, _ = _tile_offsets(0, K, V, dk, dv)
    for n in range(c0, c1):
        base = n * H + h
        if STORE_S_IN:
            tl.store(S_in + base * K * V + sv, S, mask=ms)
        Wn, KgT, dec = _transition_tiles(W, Kg, decay, base, C, K, ck, mk, dk)
        S_next, Vt = _state_step(S, U, base, Wn, KgT, dec, C, V, cv, mv)
        if HAS_Q:
            o = (tl.dot(tl.load(Qg + base * C * K + ck, mask=mk, other=0.0), S, input_precision=IEEE)
                 + tl.dot(tl.load(A_qk + base * C * C + cc, mask=mc, other=0.0), Vt, input_precision=IEEE))
            bos = tl.load(chunk_bos + n)
            mo = (r[:, None] < tl.load(chunk_len + n)) & (dv[None, :] < V)
            tl.store(O + ((bos + r[:, None]) * H + h) * V + dv[None, :], o.to(O.dtype.element_ty), mask=mo)
        S = S_next
    tl.store(S_final + os_, S, mask=ms)


@triton.jit
def transition_kernel(W, U, Kg, decay, M_out, S_out, seq_chunk0, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, DT: tl.constexpr):
    """Affine map of one segment and head (grid ``(NS, H)``), K3_SYSTEMS §2.4: ``M = prod_n M_n`` (later chunks on
    the left) with ``M_n X = Diag(decay) X - Kg^T (W X)``, and ``S_ext`` the state after the segment from zero."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    M = tl.where(dk[:, None] == dk[None, :], 1.0, 0.0).to(DT)
    S = tl.zeros([BK, BV], dtype=DT)
    ck, mk = _tile_offsets(0, C, K, r, dk)
    cv, mv = _tile_offsets(0, C, V, r, dv)
    for n in range(c0, c1):
        base = n * H + h
        Wn, KgT, dec = _transition_tiles(W, Kg, decay, base, C, K, ck, mk, dk)
        M = dec[:, None] * M - tl.dot(KgT, tl.dot(Wn, M, input_precision=IEEE), input_precision=IEEE)
        S, _ = _state_step(S, U, base, Wn, KgT, dec, C, V, cv, mv)
    om, mm = _tile_offsets((s * H + h) * K * K, K, K, dk, dk)
    tl.store(M_out + om, M, mask=mm)
    os_, ms = _tile_offsets((s * H + h) * K * V, K, V, dk, dv)
    tl.store(S_out + os_, S, mask=ms)


@triton.jit
def state_bwd_kernel(W, Kg, Qg, A_qk, decay, dO, d_final, dS0, dS_out, seq_chunk0, chunk_bos, chunk_len,
                     H, K, V, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_D_FINAL: tl.constexpr,
                     STORE_DS_OUT: tl.constexpr, DT: tl.constexpr):
    """The reverse state pass of one sequence, head and block of BV value columns (grid ``(NS, H, cdiv(V, BV))``):
    from the final-state gradient, per chunk from the last, store the gradient of the state leaving it
    (``STORE_DS_OUT``), then
    ``dS_n = M_n^T dS_{n+1} + P_n = Diag(decay) dS_{n+1} + Qg^T dO - W^T (A_qk^T dO + Kg dS_{n+1})``. Writes the
    gradient of the state entering the sequence to ``dS0``."""
    s, h, c0, c1 = _sequence_program(seq_chunk0)
    r, dk, dv, os_, ms, dS = _state_pass_start(d_final, s, h, H, K, V, C, BK, BV, HAS_D_FINAL, DT)
    ck, mk = _tile_offsets(0, C, K, r, dk)
    cc, mc = _tile_offsets(0, C, C, r, r)
    sv, _ = _tile_offsets(0, K, V, dk, dv)
    for j in range(0, c1 - c0):
        n = c1 - 1 - j
        base = n * H + h
        if STORE_DS_OUT:
            tl.store(dS_out + base * K * V + sv, dS, mask=ms)
        bos = tl.load(chunk_bos + n)
        mo = (r[:, None] < tl.load(chunk_len + n)) & (dv[None, :] < V)
        dOn = tl.load(dO + ((bos + r[:, None]) * H + h) * V + dv[None, :], mask=mo, other=0.0).to(DT)
        AqT = tl.trans(tl.load(A_qk + base * C * C + cc, mask=mc, other=0.0))
        dVt = (tl.dot(AqT, dOn, input_precision=IEEE)
               + tl.dot(tl.load(Kg + base * C * K + ck, mask=mk, other=0.0), dS, input_precision=IEEE))
        dec = tl.load(decay + base * K + dk, mask=dk < K, other=0.0)
        QgT = tl.trans(tl.load(Qg + base * C * K + ck, mask=mk, other=0.0))
        WT = tl.trans(tl.load(W + base * C * K + ck, mask=mk, other=0.0))
        dS = dec[:, None] * dS + tl.dot(QgT, dOn, input_precision=IEEE) - tl.dot(WT, dVt, input_precision=IEEE)
    tl.store(dS0 + os_, dS, mask=ms)


@triton.jit
def chunk_grads_kernel(q, k, v, g, beta, chunk_bos, chunk_len, W, U, Kg, Qg, A_qk, A_kk, T_inv, decay, S_in, dS_out,
                       dO, dq, dk_, dv_, dg, dbeta, scale, H, K, V, C: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, SUB: tl.constexpr, DT: tl.constexpr):
    """Input gradients of one chunk and head (grid ``(NC, H)``) given the output gradient ``dO``, the entering state
    ``S_n`` and the gradient ``dS_{n+1}`` of the leaving one: the transposes of :func:`chunk_terms_kernel` and of
    the outputs ``O = Qg S_n + A_qk V~``, ``S_{n+1} = Diag(decay) S_n + Kg^T V~``, ``V~ = U - W S_n``."""
    n, h, bos, ln = _chunk_program(chunk_bos, chunk_len)
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    rows = r[:, None]
    cols = r[None, :]
    kk, qs, G, bb = _chunk_inputs(q, k, g, beta, bos, ln, h, H, K, r, dk, tl.load(scale).to(DT), DT)
    vv = _load_chunk(v, bos, ln, h, H, V, r, dv, DT)
    dOn = _load_chunk(dO, bos, ln, h, H, V, r, dv, DT)
    base = n * H + h
    S = _load_tile(S_in, base * K * V, K, V, dk, dv)
    dS = _load_tile(dS_out, base * K * V, K, V, dk, dv)
    Wn = _load_tile(W, base * C * K, C, K, r, dk)
    Kgn = _load_tile(Kg, base * C * K, C, K, r, dk)
    Qgn = _load_tile(Qg, base * C * K, C, K, r, dk)
    Aq = _load_tile(A_qk, base * C * C, C, C, r, r)
    Ak = _load_tile(A_kk, base * C * C, C, C, r, r)
    Ti = _load_tile(T_inv, base * C * C, C, C, r, r)
    dec = tl.load(decay + base * K + dk, mask=dk < K, other=0.0)
    Vt = _load_tile(U, base * C * V, C, V, r, dv) - tl.dot(Wn, S, input_precision=IEEE)
    # state-side gradients
    dVt = tl.dot(tl.trans(Aq), dOn, input_precision=IEEE) + tl.dot(Kgn, dS, input_precision=IEEE)
    dKg = tl.dot(Vt, tl.trans(dS), input_precision=IEEE)
    dW = -tl.dot(dVt, tl.trans(S), input_precision=IEEE)
    dQg = tl.dot(dOn, tl.trans(S), input_precision=IEEE)
    d_dec = tl.sum(S * dS, axis=1)
    dAq = tl.dot(dOn, tl.trans(Vt), input_precision=IEEE)
    # through the UT transform: W = T X, U = T v, T = T_inv Diag(beta), T_inv = (I + Diag(beta) A_kk)^-1
    eG = tl.exp(tl.maximum(G, LOG_FLOOR).to(DT))
    X = eG * kk
    dT = tl.dot(dW, tl.trans(X), input_precision=IEEE) + tl.dot(dVt, tl.trans(vv), input_precision=IEEE)
    dT = tl.where(rows >= cols, dT, 0.0)
    T = Ti * bb[None, :]
    dX = tl.dot(tl.trans(T), dW, input_precision=IEEE)
    dvv = tl.dot(tl.trans(T), dVt, input_precision=IEEE)
    d_beta = tl.sum(dT * Ti, axis=0)
    dL = -tl.dot(tl.dot(tl.trans(Ti), dT * bb[None, :], input_precision=IEEE), tl.trans(Ti), input_precision=IEEE)
    dL = tl.where(rows > cols, dL, 0.0)
    d_beta += tl.sum(dL * Ak, axis=1)
    # through the factored in-chunk decays
    diag = tl.sum(tl.where(rows == cols, dAq, 0.0), axis=1)
    dk_row, dq_row, dk_col = _decayed_products_bwd(dL * bb[:, None], tl.where(rows > cols, dAq, 0.0), kk, qs, G, r,
                                                   C, SUB, DT)
    dqs = dq_row + diag[:, None] * kk + dQg * eG
    G_C = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    eCG = tl.exp(tl.maximum(G_C[None, :] - G, LOG_FLOOR).to(DT))
    dkk = dk_row + dk_col + diag[:, None] * qs + dX * eG + dKg * eCG
    # log-decay gradient in fp64 (its terms are large and cancel), then the reverse cumulative sum over the chunk
    f64 = tl.float64
    dKgKg = dKg.to(f64) * Kgn.to(f64)
    dG = (dX.to(f64) * X.to(f64) + kk.to(f64) * (dk_row.to(f64) - dk_col.to(f64)) + qs.to(f64) * dq_row.to(f64)
          - dKgKg + dQg.to(f64) * Qgn.to(f64))
    last = tl.sum(dKgKg, axis=0) + d_dec.to(f64) * dec.to(f64)
    dG = tl.where(rows == C - 1, dG + last[None, :], dG)
    dG = tl.cumsum(dG, axis=0, reverse=True)
    _store_chunk(dq, dqs * tl.load(scale).to(DT), bos, ln, h, H, K, r, dk)
    _store_chunk(dk_, dkk, bos, ln, h, H, K, r, dk)
    _store_chunk(dv_, dvv, bos, ln, h, H, V, r, dv)
    _store_chunk(dg, dG.to(DT), bos, ln, h, H, K, r, dk)  # via DT: no direct fp64 -> bf16 cast
    tl.store(dbeta + (bos + r) * H + h, d_beta.to(dbeta.dtype.element_ty), mask=r < ln)
