"""Numba kernels of the chunk terms' elementwise work (K3_SYSTEMS §2.2-2.3): one pass over each chunk's inputs.

:func:`tile_operands` reads a chunk's ``g, k, q, v, beta`` once and writes every elementwise factor and matmul
operand that :func:`moonrt.ops.kda.terms.chunk_terms_with_factors` needs, rounded to the compute dtype once;
:func:`assemble_blocks` scatters the sub-tile block products into the masked ``[C, C]`` matrices. The matmuls stay
in torch (batched BLAS). Both run over the flattened chunk x batch x head index ``p`` in parallel (``prange``).

Sub-tile blocks (C = n_sub * sub tokens per chunk): block ``(i, j)``, ``j <= i``, pairs the rows of sub-tile i
with the columns of sub-tile j; blocks are stored in the order ``(0, 0), (1, 0), (1, 1), (2, 0), ...`` (index
``i (i + 1) / 2 + j``), so the off-diagonal blocks of one row tile are adjacent. Row factor ``f_r`` and column
factor ``h_c`` of a block multiply to ``exp(G_r - G_c)``:

- diagonal ``(i, i)``: ``f_r = exp(G_r - m_i)``, ``h_c = exp(m_i - G_c)``, m_i = G at the sub-tile's midpoint
  ``i sub + max(sub / 2 - 1, 0)``; ``|G_r - m_i| <= span(sub) max|g| <= 80``, the caller choosing ``sub`` so
  (:func:`moonrt.ops.kda.terms.sub_tile`: 32 tokens and ``16 * 5`` for log-decays >= -5);
- off-diagonal ``(i, j < i)``: ``b_i`` = G at the last token before sub-tile i, ``f_r = exp(G_r - b_i) <= 1``,
  ``h_c = exp(b_i - G_c) <= 1``, both clamped from below at ``e^LOG_FLOOR``.

Exponentials: only ``exp(G_r - m_i)`` is taken per element (fp64); every other factor is that one (or its
reciprocal) times a per-column fp64 constant of its sub-tile: ``exp(G_r - b_i) = exp(G_r - m_i) exp(m_i - b_i)``,
``exp(b_i - G_c) = exp(b_i - m_j) exp(m_j - G_c)``, ``exp(G_r) = exp(m_i) exp(G_r - m_i)``,
``exp(G_C - G_r) = exp(G_C - m_i) exp(m_i - G_r)``. Each product of two fp64 numbers carries a relative error of
a few fp64 ulps (1e-15), far below the single fp32 rounding that follows. Per-column constants whose exponent is
below ``2 LOG_FLOOR`` are clamped there first: the other factor is at most ``e^80 = e^-LOG_FLOOR``, so the
product is then below ``e^LOG_FLOOR`` and clamped to it anyway, and no constant underflows (any chunk length).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, typeof, types

LOG_FLOOR = -80.0
"""Same value as :data:`moonrt.ops.kda.terms.LOG_FLOOR` (kept here so this module has no torch import)."""

_FLOOR = math.exp(LOG_FLOOR)


def n_blocks(n_sub: int) -> int:
    """Number of sub-tile blocks ``(i, j <= i)`` of a chunk of ``n_sub`` sub-tiles."""
    return n_sub * (n_sub + 1) // 2


_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (Cody-Waite): k * _LN2_HI is exact for |k| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_SHIFT = 6755399441055744.0  # 1.5 * 2^52: the fp64 sum x + _SHIFT holds round(x) in its low mantissa bits
_SHIFT_BITS = 0x4338000000000000  # bit pattern of _SHIFT


@njit(inline="always", nogil=True, fastmath={"contract"})
def _vexp(x, out, neg, ibuf, n):  # pragma: no cover (compiled)
    """``out[:n] = exp(x[:n])`` and ``neg[:n] = exp(-x[:n])`` in fp64, ``x`` clamped to [-708, 708] (no
    subnormal or inf results). ``ibuf``: int64 scratch of at least 2 n.

    numba has no vectorized ``exp`` (without Intel's SVML it calls libm per element, ~9 ns here), so this one is
    written to vectorize: ``exp(+-x) = 2^(+-k) exp(+-r)``, ``k = round(x / ln 2)``, ``r = x - k ln 2`` in
    [-0.347, 0.347] (two-part ln 2), ``exp(+-r)`` by the Taylor polynomial of degree 10 in Estrin's scheme
    (truncation error ``0.347^11 / 11! < 3e-13`` relative, five orders below the fp32 rounding that follows), and
    ``2^(+-k)`` built from its bits. Both signs share the range reduction (and spare an fp64 division)."""
    fbuf = ibuf.view(np.float64)
    for j in range(n):
        xj = x[j]
        xj = xj if xj > -708.0 else -708.0
        xj = xj if xj < 708.0 else 708.0
        t = xj * _LOG2E + _SHIFT
        kf = t - _SHIFT
        r = (xj - kf * _LN2_HI) - kf * _LN2_LO
        r2 = r * r
        r4 = r2 * r2
        ev = (0.5 + r2 * (1.0 / 24.0)) + r4 * ((1.0 / 720.0 + r2 * (1.0 / 40320.0)) + r4 * (1.0 / 3628800.0))
        od = (1.0 + r2 * (1.0 / 6.0)) + r4 * ((1.0 / 120.0 + r2 * (1.0 / 5040.0)) + r4 * (1.0 / 362880.0))
        # exp(r) = 1 + r od(r^2) + r^2 ev(r^2); exp(-r) = 1 - r od + r^2 ev
        a = 1.0 + r2 * ev
        b = r * od
        out[j] = a + b
        neg[j] = a - b
        fbuf[j] = t
    ineg = ibuf[n : 2 * n]
    for j in range(n):
        kj = ibuf[j] - _SHIFT_BITS  # k
        ibuf[j] = (kj + 1023) << 52  # the bits of 2^k
        ineg[j] = (1023 - kj) << 52  # the bits of 2^-k
    fneg = ineg.view(np.float64)
    for j in range(n):
        out[j] *= fbuf[j]
        neg[j] *= fneg[j]


@njit(cache=True, nogil=True, fastmath={"contract"})
def tile_operands(g, k, q, v, beta, scale, sub, has_q, want_factors,  # pragma: no cover (compiled)
                  blk_rows, blk_cols, xv, kg, qg, decay, qk, e_pos, e_neg, eg, ecg, off_rows, off_cols):
    """Elementwise factors and matmul operands of ``P`` chunks (see the module docstring).

    Inputs (contiguous, compute dtype): ``g, k, q [P, C, K]`` (q ignored unless ``has_q``), ``v [P, C, V]``,
    ``beta [P, C]``; ``scale`` the query scale; ``sub`` tokens per sub-tile (C a multiple of it).
    Outputs (written here; R = 2 sub rows with q, else sub):

    - ``blk_rows [P, nb, R, K]``: block (i, j)'s rows ``[k_r f_r; scale q_r f_r]``, r in sub-tile i;
    - ``blk_cols [P, nb, sub, K]``: block (i, j)'s columns ``k_c h_c``, c in sub-tile j;
    - ``xv [P, C, K + V]``: ``[beta_r exp(G_r) k_r | beta_r v_r]`` (``T_inv xv = [W | U]``);
    - ``kg [P, C, K]``: ``exp(G_C - G_r) k_r``; ``decay [P, K]``: ``exp(G_C)`` (both clamped at e^LOG_FLOOR);
    - with q: ``qg [P, C, K]``: ``scale q_r exp(G_r)``; ``qk [P, C]``: ``scale q_r . k_r`` (A_qk's diagonal);
    - with ``want_factors`` (the backward's :class:`TileFactors`): ``e_pos, e_neg [P, C, K]`` the diagonal
      blocks' ``f_r, h_r``; ``eg, ecg [P, C, K]`` ``exp(G)``, ``exp(G_C - G)``; ``off_rows [P, n_sub - 1, sub, K]``
      the off-diagonal row factors of sub-tiles 1..; ``off_cols [P, sub n_sub (n_sub - 1) / 2, K]`` the column
      factors of sub-tile i's off-diagonal blocks (``i sub`` rows starting at row ``sub i (i - 1) / 2``).

    Factors are computed in fp64 and rounded to the compute dtype once; each operand is then one product in the
    compute dtype (``k f``: a second rounding, as a matmul's own). Unused outputs may be any arrays of the right
    dtype (not touched). Single-threaded (``nogil``): torch's OpenMP workers spin for milliseconds after each
    parallel op, so a second thread pool here (numba's ``prange``) only contends with them on small machines.
    One fused pass per sub-tile after the exponentials: every output element is written once.
    """
    P, C, K = g.shape
    V = v.shape[2]
    n_sub = C // sub
    mid = max(sub // 2 - 1, 0)
    n = sub * K
    lo = 2.0 * LOG_FLOOR
    # per-column constants of each sub-tile (rows of cst): exp(m_i), exp(G_C - m_i), exp(m_i - b_i) (i >= 1),
    # exp(b_i - m_j) (j < i, at 3 n_sub + i (i - 1) / 2 + j), the non-decaying ones clamped at 2 LOG_FLOOR
    n_cst = 3 * n_sub + n_sub * (n_sub - 1) // 2
    G = np.empty((C, K), np.float64)  # in-chunk inclusive cumulative log-decay
    arg = np.empty(max(n, n_cst * K), np.float64)
    f64s = np.empty((n_sub, n), np.float64)  # exp(G_r - m_i) over each sub-tile
    r64s = np.empty((n_sub, n), np.float64)  # exp(m_i - G_r)
    cst = np.empty((n_cst, K), np.float64)
    cneg = np.empty(n_cst * K, np.float64)
    ibuf = np.empty(2 * max(n, n_cst * K), np.int64)
    acc8 = np.empty(8, np.float64)
    for p in range(P):
        gp = g[p]
        for d in range(K):
            G[0, d] = gp[0, d]
        for r in range(1, C):
            for d in range(K):
                G[r, d] = G[r - 1, d] + gp[r, d]
        for i in range(n_sub):
            r0 = i * sub
            m = r0 + mid
            for t in range(sub):
                for d in range(K):
                    arg[t * K + d] = G[r0 + t, d] - G[m, d]
            _vexp(arg, f64s[i], r64s[i], ibuf, n)
        for i in range(n_sub):
            m = i * sub + mid
            b = i * sub - 1
            for d in range(K):
                x = G[m, d]
                arg[i * K + d] = x if x > lo else lo
                x = G[C - 1, d] - x
                arg[(n_sub + i) * K + d] = x if x > lo else lo
                arg[(2 * n_sub + i) * K + d] = G[m, d] - G[b, d] if i > 0 else 0.0  # <= 0 (decaying)
            for j in range(i):
                mj = j * sub + mid
                o = (3 * n_sub + i * (i - 1) // 2 + j) * K
                for d in range(K):
                    x = G[b, d] - G[mj, d]
                    arg[o + d] = x if x > lo else lo
        _vexp(arg, cst.reshape(n_cst * K), cneg, ibuf, n_cst * K)
        for i in range(n_sub):
            r0 = i * sub
            f64, r64 = f64s[i], r64s[i]
            c_eg, c_ecg, c_off = cst[i], cst[n_sub + i], cst[2 * n_sub + i]
            bd = i * (i + 1) // 2 + i  # diagonal block (i, i)
            b0 = i * (i + 1) // 2  # first off-diagonal block (i, 0)
            for t in range(sub):
                r = r0 + t
                b_r = beta[p, r]
                k_r, q_r, v_r, xv_r, kg_r = k[p, r], q[p, r], v[p, r], xv[p, r], kg[p, r]
                f_r, h_r = f64[t * K : (t + 1) * K], r64[t * K : (t + 1) * K]
                rows_k, cols_k = blk_rows[p, bd, t], blk_cols[p, bd, t]
                for d in range(K):
                    f = f_r[d]
                    x = c_eg[d] * f
                    e_g = x if x > _FLOOR else _FLOOR  # exp(G_r)
                    x = c_ecg[d] * h_r[d]
                    e_cg = x if x > _FLOOR else _FLOOR  # exp(G_C - G_r)
                    kv = k_r[d]
                    rows_k[d] = kv * f
                    cols_k[d] = kv * h_r[d]
                    xv_r[d] = b_r * e_g * kv
                    kg_r[d] = e_cg * kv
                if want_factors:
                    e_pos_r, e_neg_r, eg_r, ecg_r = e_pos[p, r], e_neg[p, r], eg[p, r], ecg[p, r]
                    for d in range(K):
                        e_pos_r[d] = f_r[d]
                        e_neg_r[d] = h_r[d]
                        x = c_eg[d] * f_r[d]
                        eg_r[d] = x if x > _FLOOR else _FLOOR
                        x = c_ecg[d] * h_r[d]
                        ecg_r[d] = x if x > _FLOOR else _FLOOR
                for d in range(V):
                    xv_r[K + d] = b_r * v_r[d]
                if r == C - 1:
                    for d in range(K):
                        x = c_eg[d] * f_r[d]
                        decay[p, d] = x if x > _FLOOR else _FLOOR
                if has_q:
                    rows_q, qg_r = blk_rows[p, bd, sub + t], qg[p, r]
                    for d in range(K):
                        qs = scale * q_r[d]
                        x = c_eg[d] * f_r[d]
                        qg_r[d] = qs * (x if x > _FLOOR else _FLOOR)
                        rows_q[d] = qs * f_r[d]
                    for u in range(8):
                        acc8[u] = 0.0
                    for d0 in range(0, K - 7, 8):  # 8 partial sums: no serial chain of fp64 adds
                        for u in range(8):
                            acc8[u] += np.float64(q_r[d0 + u]) * k_r[d0 + u]
                    for d in range(K - K % 8, K):
                        acc8[0] += np.float64(q_r[d]) * k_r[d]
                    qk[p, r] = scale * acc8.sum()
                if i > 0:  # off-diagonal rows: exp(G_r - b_i) = exp(m_i - b_i) exp(G_r - m_i) <= 1, clamped
                    rows_k = blk_rows[p, b0, t]
                    for d in range(K):
                        x = c_off[d] * f_r[d]
                        rows_k[d] = k_r[d] * (x if x > _FLOOR else _FLOOR)
                    if want_factors:
                        o_r = off_rows[p, i - 1, t]
                        for d in range(K):
                            x = c_off[d] * f_r[d]
                            o_r[d] = x if x > _FLOOR else _FLOOR
                    if has_q:
                        rows_q = blk_rows[p, b0, sub + t]
                        for d in range(K):
                            x = c_off[d] * f_r[d]
                            rows_q[d] = scale * q_r[d] * (x if x > _FLOOR else _FLOOR)
                for i2 in range(i + 1, n_sub):  # columns of block (i2, i): exp(b_i2 - G_c) = exp(b_i2 - m_i) h_c
                    c_col = cst[3 * n_sub + i2 * (i2 - 1) // 2 + i]
                    cols_k = blk_cols[p, i2 * (i2 + 1) // 2 + i, t]
                    oc = sub * i2 * (i2 - 1) // 2 + r
                    for d in range(K):
                        x = c_col[d] * h_r[d]
                        cols_k[d] = k_r[d] * (x if x > _FLOOR else _FLOOR)
                    if want_factors:
                        o_c = off_cols[p, oc]
                        for d in range(K):
                            x = c_col[d] * h_r[d]
                            o_c[d] = x if x > _FLOOR else _FLOOR
            for j in range(1, i):  # the same rows for every off-diagonal block of sub-tile i
                blk_rows[p, b0 + j] = blk_rows[p, b0]



@njit(cache=True, nogil=True, fastmath={"contract"})
def assemble_blocks(blk, beta, qk, has_q, want_akk, lb, a_kk, a_qk, solve, xv, wu):  # pragma: no cover (compiled)
    """Scatter block products ``blk [P, nb, R, sub]`` (rows ``[k; q]`` of sub-tile i against columns of sub-tile
    j, block order as in :func:`tile_operands`) into ``[P, C, C]`` matrices, zero elsewhere:

    - ``lb``: ``beta_r A_kk[r, c]`` for c < r (the strictly lower L of the UT transform);
    - ``a_kk`` (only with ``want_akk``): ``A_kk[r, c]`` for c < r;
    - ``a_qk`` (only with ``has_q``): ``A_qk[r, c]`` for c < r, ``qk[p, r]`` (the exact diagonal) for c = r;
    - ``wu [P, C, K + V]`` (only with ``solve``): ``(I + L)^-1 xv`` by forward substitution as each row of L is
      built, ``wu[r] = xv[r] - sum_{c < r} L[r, c] wu[c]`` (rows of K + V: vectorized multiply-adds in the compute
      dtype, as LAPACK's triangular solve; C^2 (K + V) / 2 multiply-adds, half of inverting ``I + L`` and
      multiplying, when the inverse itself is not needed).

    The masked entries of the diagonal blocks (c > r) are never read: they may overflow (a product of two large
    factors). Each row is written as runs of whole blocks (vectorized copies), then its zero tail."""
    P, C = beta.shape
    sub = blk.shape[3]
    acc = np.empty(xv.shape[2] if solve else 0, lb.dtype)  # row r of wu
    for p in range(P):
        for r in range(C):
            i = r // sub
            t = r - i * sub
            b_r = beta[p, r]
            lb_r, akk_r, aqk_r = lb[p, r], a_kk[p, r], a_qk[p, r]
            for j in range(i + 1):  # whole blocks (i, j < i), then the t columns before r of block (i, i)
                src = blk[p, i * (i + 1) // 2 + j, t]
                w = sub if j < i else t
                c0 = j * sub
                for c in range(w):
                    lb_r[c0 + c] = b_r * src[c]
                if want_akk:
                    for c in range(w):
                        akk_r[c0 + c] = src[c]
                if has_q:
                    src = blk[p, i * (i + 1) // 2 + j, sub + t]
                    for c in range(w):
                        aqk_r[c0 + c] = src[c]
            for c in range(r, C):
                lb_r[c] = 0.0
            if want_akk:
                for c in range(r, C):
                    akk_r[c] = 0.0
            if has_q:
                aqk_r[r] = qk[p, r]
                for c in range(r + 1, C):
                    aqk_r[c] = 0.0
            if solve:
                wu_p = wu[p]
                acc[:] = xv[p, r]
                for c in range(r):
                    x = lb_r[c]
                    w_c = wu_p[c]
                    for e in range(acc.size):
                        acc[e] -= x * w_c[e]
                wu_p[r, :] = acc


def load_compiled() -> None:
    """Load both kernels' fp32 and fp64 specializations (C-contiguous arrays, as :mod:`moonrt.ops.kda.terms` passes
    them) from numba's on-disk cache, compiling and caching any that is missing. Runs no kernel and starts no thread.

    A process that will fork workers calls this first (:mod:`moonrt.cluster.rank_preload`), so each worker inherits
    the compiled code instead of loading it again (~0.4 s per process on 2 cores)."""
    for dtype in (np.float32, np.float64):
        a2, a3, a4 = (typeof(np.empty((0,) * ndim, dtype)) for ndim in (2, 3, 4))
        flag = types.boolean
        tile_operands.compile((a3, a3, a3, a3, a2, types.float64, types.int64, flag, flag,
                               a4, a4, a3, a3, a3, a2, a2, a3, a3, a3, a3, a4, a3))
        assemble_blocks.compile((a4, a2, a2, flag, flag, a3, a3, a3, flag, a3, a3))
