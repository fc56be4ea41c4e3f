"""The chunked KDA kernel as one autograd function with a hand-written backward (K3_SYSTEMS §2.3-2.4).

Forward, per cache-sized group of chunks (all chunks of all heads of a group in each batched matmul): the
state-independent terms (:func:`moonrt.ops.kda.terms.chunk_terms`, numba elementwise passes around batched
matmuls), the per-chunk affine maps
``S_{n+1} = M_n S_n + S_ext_n``, the sequential state pass (the only per-chunk loop) and the outputs
``O = Qg S_n + A_qk (U - W S_n)``. Saved for backward: the chunked inputs and the state entering each chunk.

Backward, per group from the last: the terms are recomputed with their tile factors
(:func:`moonrt.ops.kda.terms.chunk_terms_with_factors`), then

1. ``P_n = Qg^T dO - W^T (A_qk^T dO)`` for all chunks at once, and the reverse state pass
   ``dS_n = M_n^T dS_{n+1} + P_n`` (the transposed affine map; ``dS_{n+1}`` is the gradient of the state
   leaving chunk n: the next chunk's, or the final state's for the last chunk of a sequence);
2. batched per-chunk gradients: ``dV~ = A_qk^T dO + Kg dS_{n+1}``, ``dKg = V~ dS_{n+1}^T``,
   ``dW = -dV~ S_n^T``, ``dQg = dO S_n^T``, ``dA_qk = dO V~^T``; through the UT transform
   (``T = (I + L)^-1 Diag(beta)``: ``dL = -T_inv^T dT_inv T_inv^T``) to ``dA_kk`` and ``dbeta``; through the
   factored in-chunk decays (the same sub-tile blocks as the forward) to q, k and the cumulative log-decay G;
   ``dg`` is the reverse cumulative sum of ``dG`` (in fp64, as the forward's cumulative sum).
"""

from __future__ import annotations

from typing import Any

import torch

from moonrt.ops.kda.terms import (
    ChunkTerms,
    TileFactors,
    _scan_states,
    chunk_terms,
    chunk_terms_with_factors,
    chunk_transitions,
    clamp_log_decay,
)
from moonrt.ops.precision import fp32_island

CHUNK_GROUP_ELEMS = 1 << 18
"""Chunks are processed in groups of about this many ``[C, K]`` elements (1 MiB in fp32), so each group's
intermediates stay in cache; the state passes carry the state (forward) or its gradient (backward) across groups."""


def _groups(N: int, per_chunk: int) -> list[slice]:
    group = max(1, CHUNK_GROUP_ELEMS // per_chunk)
    return [slice(n0, min(n0 + group, N)) for n0 in range(0, N, group)]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over flattened leading dims (3-d bmm, no broadcasting bookkeeping)."""
    return torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])).view(*a.shape[:-1], b.shape[-1])


def _bmm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T @ b`` over the last two dims."""
    return _bmm(a.transpose(-1, -2), b)


def _bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` over the last two dims."""
    return _bmm(a, b.transpose(-1, -2))


class ChunkKDA(torch.autograd.Function):
    """Chunked KDA on chunk-major inputs with a hand-written backward.

    ``forward(q, k, v, g, beta, S0, starts, scale)``: ``q, k, g [N, B, H, C, K]``, ``v [N, B, H, C, V]``,
    ``beta [N, B, H, C]`` (chunked, compute dtype; padding tokens have g = k = beta = 0), ``S0 [n, B, H, K, V]``
    the entering state of each of n sequences, ``starts`` (tuple of n ints, ``starts[0] = 0``) the first chunk of
    each sequence. Returns ``O [N, B, H, C, V]`` and the state after each sequence ``[n, B, H, K, V]``.
    Callers pass ``starts`` and ``scale`` by keyword (``apply`` cannot declare them keyword-only: torch binds
    only positional parameters of ``forward``).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S0: torch.Tensor, starts: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        g, clamped = clamp_log_decay(g)  # below the floor: a decay under the dtype's resolution (no gradient)
        resets = {f: S0[j] for j, f in enumerate(starts)}
        lasts = _lasts(starts, N)
        O = v.new_empty(N, B, H, C, V)
        S_in = v.new_empty(N, B, H, K, V)
        finals: list[torch.Tensor | None] = [None] * len(starts)
        S = S0[0]
        for sl in _groups(N, B * H * C * max(K, V)):
            terms = chunk_terms(k[sl], v[sl], g[sl], beta[sl], q=q[sl], scale=scale)
            M, S_ext = chunk_transitions(terms)
            _, S = _scan_states(M, S_ext, S, sl.start, resets, lasts, finals, states=S_in[sl])
            Si = S_in[sl].view(-1, K, V)
            V_tilde = torch.baddbmm(terms.U.view(-1, C, V), terms.W.view(-1, C, K), Si, alpha=-1.0)  # (4)
            torch.baddbmm(torch.bmm(terms.Qg.view(-1, C, K), Si), terms.A_qk.view(-1, C, C), V_tilde,
                          out=O[sl].view(-1, C, V))  # (5)
        ctx.save_for_backward(q, k, v, g, beta, S_in)
        ctx.starts, ctx.scale, ctx.n_seq, ctx.clamped = starts, scale, S0.shape[0], clamped
        return O, torch.stack(finals)  # type: ignore[arg-type]

    @staticmethod
    @torch.autograd.function.once_differentiable
    @fp32_island  # its backward may run inside an autocast region (the pipeline's schedule): kept fp32
    def backward(ctx: Any, dO: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, S_in = ctx.saved_tensors
        starts, scale = ctx.starts, ctx.scale
        N, B, H, C, K = k.shape
        V = v.shape[-1]
        dO = dO.to(v.dtype).contiguous()
        d_final = d_final.to(v.dtype)
        resets = {f: j for j, f in enumerate(starts)}
        lasts = _lasts(starts, N)
        grads = [torch.empty_like(t) for t in (q, k, v, g, beta)]
        dS0 = S_in.new_empty(ctx.n_seq, B, H, K, V)
        carry = d_final[-1].reshape(B * H, K, V)
        for sl in reversed(_groups(N, B * H * C * max(K, V))):
            terms, fac = chunk_terms_with_factors(k[sl], v[sl], g[sl], beta[sl], q=q[sl], scale=scale)
            M, _ = _transition_matrix(terms)
            dOg = dO[sl]
            dOA = _bmm_tn(terms.A_qk, dOg)  # [n, B, H, C, V] A_qk^T dO
            P = _bmm_tn(terms.Qg, dOg).sub_(_bmm_tn(terms.W, dOA))  # [n, B, H, K, V]
            dS_out = P.new_empty(P.shape)  # gradient of the state leaving each chunk
            carry = _reverse_state_pass(P, M, carry, sl.start, lasts, d_final, resets, dS0, dS_out)
            out = _chunk_grads(terms, fac, q[sl], k[sl], v[sl], beta[sl], S_in[sl], dS_out, dOg, dOA, scale)
            for grad, part in zip(grads, out):
                grad[sl] = part
        if ctx.clamped is not None:
            grads[3].masked_fill_(ctx.clamped, 0.0)  # the clamp's gradient
        need = ctx.needs_input_grad
        return (*(gr if need[i] else None for i, gr in enumerate(grads)), dS0 if need[5] else None, None, None)


def _reverse_state_pass(P: torch.Tensor, M: torch.Tensor, carry: torch.Tensor, first: int, lasts: dict[int, int],
                        d_final: torch.Tensor, resets: dict[int, int], dS0: torch.Tensor,
                        dS_out: torch.Tensor | None = None) -> torch.Tensor:
    """The reverse state pass ``dS_n = M_n^T dS_{n+1} + P_n`` over one group of chunks ``first ..``, last first.

    ``P [n, B, H, K, V]``, ``M [n, B, H, K, K]``; ``carry [B * H, K, V]`` the gradient of the state leaving the
    group (replaced by ``d_final[lasts[c]]`` at the last chunk c of a sequence). Writes the gradient entering the
    first chunk of sequence j into ``dS0[j]`` (``resets``: first chunk -> j) and, when given, the gradient of the
    state leaving each chunk into ``dS_out [n, B, H, K, V]``. Returns the gradient entering the group's first chunk.
    """
    n, B, H, K, V = P.shape
    for j in range(n - 1, -1, -1):
        c = first + j
        if c in lasts:
            carry = d_final[lasts[c]].reshape(B * H, K, V)
        if dS_out is not None:
            dS_out[j].view(B * H, K, V).copy_(carry)
        carry = torch.baddbmm(P[j].view(B * H, K, V), M[j].view(B * H, K, K).transpose(-1, -2), carry)
        if c in resets:
            dS0[resets[c]].view(B * H, K, V).copy_(carry)
    return carry


@fp32_island
def chunk_state_grad(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dO: torch.Tensor,
                     d_final: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Gradient of the entering state of one sequence, only (the state path of :class:`ChunkKDA`'s backward).

    ``q, k, g [N, B, H, C, K]``, ``beta [N, B, H, C]``, ``dO [N, B, H, C, V]`` chunked as for :class:`ChunkKDA`
    (compute dtype), ``d_final [B, H, K, V]`` the gradient of the state after the last chunk. Returns
    ``dS_in [B, H, K, V]``. Per group of chunks it recomputes the terms (no values: ``P_n`` and ``M_n`` do not
    depend on them, nor on any state), forms ``P_n = Qg^T dO - W^T (A_qk^T dO)`` and runs the reverse state pass;
    none of the per-input gradients of the full backward.
    """
    N, B, H, C, K = k.shape
    V = dO.shape[-1]
    g, _ = clamp_log_decay(g)
    v0 = k[..., :0]  # the values only enter U = T v, which the state gradient does not read: a zero-width view
    dS0 = dO.new_empty(1, B, H, K, V)
    carry = d_final.to(dO.dtype).reshape(B * H, K, V)
    for sl in reversed(_groups(N, B * H * C * max(K, V))):
        terms = chunk_terms(k[sl], v0[sl], g[sl], beta[sl], q=q[sl], scale=scale)
        M, _ = _transition_matrix(terms)
        dOg = dO[sl]
        P = _bmm_tn(terms.Qg, dOg).sub_(_bmm_tn(terms.W, _bmm_tn(terms.A_qk, dOg)))  # [n, B, H, K, V]
        carry = _reverse_state_pass(P, M, carry, sl.start, {}, d_final, {0: 0}, dS0)
    return dS0[0]


def _lasts(starts: tuple[int, ...], N: int) -> dict[int, int]:
    """Last chunk of each sequence -> its index."""
    ends = [*starts[1:], N]
    return {e - 1: j for j, e in enumerate(ends)}


def _transition_matrix(terms: ChunkTerms) -> tuple[torch.Tensor, None]:
    """``M = Diag(exp(G_C)) - Kg^T W`` (the state map's linear part only)."""
    return torch.diag_embed(terms.decay).sub_(_bmm_tn(terms.Kg, terms.W)), None


def _chunk_grads(terms: ChunkTerms, fac: TileFactors, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 beta: torch.Tensor, S_in: torch.Tensor, dS_out: torch.Tensor, dO: torch.Tensor, dOA: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, ...]:
    """Gradients ``(dq, dk, dv, dg, dbeta)`` of one group of chunks ``[n, B, H, C, *]`` given the output gradient
    ``dO``, ``dOA = A_qk^T dO``, the entering states ``S_in`` and the gradients of the leaving states ``dS_out``."""
    n, B, H, C, K = k.shape
    A_qk, W, U, Kg, Qg = terms.A_qk, terms.W, terms.U, terms.Kg, terms.Qg
    assert A_qk is not None and Qg is not None
    V_tilde = U - _bmm(W, S_in)  # [n, B, H, C, V]
    dVt = _bmm(Kg, dS_out).add_(dOA)  # A_qk^T dO + Kg dS_{n+1}
    dKg = _bmm_nt(V_tilde, dS_out)  # [C, K]
    dW = _bmm_nt(dVt, S_in).neg_()
    dQg = _bmm_nt(dO, S_in)
    d_decay = (S_in * dS_out).sum(-1)  # [n, B, H, K]
    dA_qk = _bmm_nt(dO, V_tilde)  # [C, C], only c <= r used
    # W = T X (X = exp(G) k), U = T v, T = T_inv Diag(beta), T_inv = (I + L)^-1, L = Diag(beta) A_kk
    X = fac.eG * k
    dT = _bmm_nt(dW, X).add_(_bmm_nt(dVt, v)).tril_()
    T = terms.T
    dX = _bmm_tn(T, dW)
    dv = _bmm_tn(T, dVt)
    T_inv = fac.T_inv
    d_beta = (dT * T_inv).sum(-2)  # column scale
    dT_inv = dT.mul_(beta[..., None, :])
    dL = _bmm_nt(_bmm_tn(T_inv, dT_inv), T_inv).neg_().tril_(-1)
    d_beta += (dL * fac.A_kk).sum(-1)  # row scale
    dA_kk = dL.mul_(beta[..., None])
    # k.k and q.k in-chunk products through the factored decays: row parts (dk_r, dqs_r) and column part (dk_c);
    # dG gets +x * (row part) on rows and -k * (column part) on columns
    qs = q * scale
    dk_row, dqs_row, dk_col = _factored_grads(dA_kk, dA_qk.tril(-1), fac, k, qs)
    diag = dA_qk.diagonal(dim1=-2, dim2=-1)[..., None]  # [n, B, H, C, 1] the exact q_r . k_r diagonal
    dqs = dqs_row + diag * k + dQg * fac.eG
    dk = dk_row + dk_col + diag * qs + dX * fac.eG + dKg * fac.eCG
    # dG in fp64 (as the forward's fp64 cumulative sum): its terms are large and cancel; each product of two
    # fp32 numbers is exact in fp64 (in-place into fp64 computes in fp64)
    dKgKg = dKg * Kg
    dG = torch.mul(dX, X, out=k.new_empty(k.shape, dtype=torch.float64))
    dG.addcmul_(k, dk_row).addcmul_(k, dk_col, value=-1.0).addcmul_(qs, dqs_row).sub_(dKgKg).addcmul_(dQg, Qg)
    dG[..., -1, :] += dKgKg.sum(-2, dtype=torch.float64) + d_decay.double() * terms.decay
    dg = dG.flip(-2).cumsum(-2).flip(-2).to(k.dtype)
    return dqs * scale, dk, dv, dg, d_beta


def _factored_grads(dA_kk: torch.Tensor, dA_qk: torch.Tensor, fac: TileFactors, k: torch.Tensor,
                    qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``A = [k; qs] (exp(G_r - G_c) k_c)`` (strictly lower ``dA_kk``, ``dA_qk`` [n, B, H, C, C]) through
    the sub-tile factorization of :func:`chunk_terms_with_factors`: returns the gradient parts of k as a row,
    of qs as a row, and of k as a column, each ``[n, B, H, C, K]`` and already multiplied by its factor (so the
    log-decay gradient is ``k * dk_row + qs * dqs_row - k * dk_col``)."""
    n, B, H, C, K = k.shape
    n_sub, sub = fac.e_pos.shape[3:5]
    tiles = (n, B, H, n_sub, sub)
    e_pos, e_neg = fac.e_pos, fac.e_neg
    k_t, qs_t = k.view(*tiles, K), qs.view(*tiles, K)
    # diagonal blocks of all sub-tiles at once: dA [n, B, H, n_sub, 2 sub, sub] for rows [k; qs]
    blocks = (n, B, H, n_sub, sub, n_sub, sub)
    d_diag = torch.cat([dA_kk.view(blocks).diagonal(dim1=3, dim2=5), dA_qk.view(blocks).diagonal(dim1=3, dim2=5)],
                       dim=3).permute(0, 1, 2, 5, 3, 4)
    k_col = e_neg * k_t
    rows = torch.cat([k_t * e_pos, qs_t * e_pos], dim=-2)
    d_rows = _bmm(d_diag, k_col)  # [n, B, H, n_sub, 2 sub, K]
    d_col = _bmm_tn(d_diag, rows)  # [n, B, H, n_sub, sub, K]
    dk_row = (d_rows[..., :sub, :] * e_pos).view(n, B, H, C, K)
    dqs_row = (d_rows[..., sub:, :] * e_pos).view(n, B, H, C, K)
    dk_col = (d_col * e_neg).view(n, B, H, C, K)
    for i in range(1, n_sub):
        row_f, col_f = fac.off_rows[i - 1], fac.off_cols[i - 1]
        r = slice(i * sub, (i + 1) * sub)
        d_off = torch.cat([dA_kk[..., r, : i * sub], dA_qk[..., r, : i * sub]], dim=-2)  # [n, B, H, 2 sub, i sub]
        col = col_f * k[..., : i * sub, :]
        d_rows_i = _bmm(d_off, col)
        d_col_i = _bmm_tn(d_off, torch.cat([k[..., r, :] * row_f, qs[..., r, :] * row_f], dim=-2))
        dk_row[..., r, :] += d_rows_i[..., :sub, :] * row_f
        dqs_row[..., r, :] += d_rows_i[..., sub:, :] * row_f
        dk_col[..., : i * sub, :] += d_col_i * col_f
    return dk_row, dqs_row, dk_col
