"""KDA chunk-form building blocks (K3_SYSTEMS §2.2-2.4): chunk layout, per-chunk terms, state maps, state pass.

Shapes are chunk-major ``[N, B, H, C, *]`` (N chunks of C tokens, see :func:`_to_chunks`). ``chunk_terms`` has two
implementations of the same math: without a graph (the chunked kernel :mod:`moonrt.ops.kda.autograd`, forward and
recomputation in its hand-written backward, which keeps the :class:`TileFactors`) the elementwise work runs in two
numba passes (:mod:`moonrt.ops.kda.backends.numba`) around batched matmuls; when an input requires grad
(:func:`moonrt.ops.kda.kda_transition` under autograd) plain differentiable torch runs instead. A test holds the
two equal (fp64: 1e-12, fp32: 1e-6 relative).

Numerics: all state arithmetic is in fp32 (fp64 if the inputs are fp64). In-chunk decays are applied through
sub-tiles with a midpoint reference (§2.2), so every factor in a matmul operand lies within ``e^80``
(:data:`FACTOR_LOG_RANGE`): 32-token sub-tiles while every per-token log-decay is >= -5 (K3's gate range, the
fast path), shorter ones (:func:`sub_tile`) for stronger decays, which the callers first clamp at
:func:`log_decay_floor` (a change below the compute dtype's resolution). Cumulative log-decays are summed in
fp64 and exponentials of large exponents are taken in fp64 and rounded once, so results keep fp32 precision
(~1e-7 relative against an fp64 reference).
"""
from __future__ import annotations

import dataclasses
import operator

import torch

import moonrt.ops.kda.backends.numba as kda_numba

SUB_TILE = 32
"""Rows per sub-tile for the in-chunk decay factorization (K3_SYSTEMS §2.2). 32 rather than 16: the batched
intra-chunk matmuls then have 64 rows (q and k rows of a sub-tile), which CPU BLAS runs several times faster."""

FACTOR_LOG_RANGE = 80.0
"""Bound on the exponent of every in-chunk decay factor that enters a matmul operand: ``e^80 < 3.4e38`` (fp32
max, ``e^88.7``) and ``e^-80`` above fp32's smallest normal (``e^-87.3``). The sub-tile length is chosen so that
``|G_r - m_i| <= FACTOR_LOG_RANGE`` (:func:`sub_tile`); decaying factors are clamped at ``-FACTOR_LOG_RANGE``
(:data:`LOG_FLOOR`)."""

_LOG_DECAY_FLOOR = {torch.float32: -20.0, torch.float64: -40.0}


def log_decay_floor(dtype: torch.dtype) -> float:
    """Per-token log-decay floor for compute dtype ``dtype``: the chunk form clamps ``g`` here first.

    ``exp(floor)`` is far below the dtype's resolution (fp32: ``e^-20 = 2.1e-9`` vs eps ``1.2e-7``; fp64:
    ``e^-40 = 4.2e-18`` vs eps ``2.2e-16``), so the clamp changes a decay ``alpha_t = exp(g_t) < exp(floor)`` by
    less than ``exp(floor)`` absolute: the state it multiplies is kept to below one rounding of the result, and
    its gradient (``alpha_t`` times O(1) data, zero through the clamp) likewise. With the floor, the sub-tile
    (:func:`sub_tile`) stays >= 8 tokens (fp32) or >= 4 tokens (fp64)."""
    return _LOG_DECAY_FLOOR.get(dtype, _LOG_DECAY_FLOOR[torch.float32])


def clamp_log_decay(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``g`` clamped at :func:`log_decay_floor` of its dtype, and the mask of the clamped entries (None, and ``g``
    itself, when no entry is below the floor; a new tensor otherwise). Differentiable (torch's clamp)."""
    floor = log_decay_floor(g.dtype)
    if not g.numel() or float(g.detach().min()) >= floor:
        return g, None
    return g.clamp(min=floor), g.detach() < floor

LOG_FLOOR = -80.0
"""Exponents of decaying factors (exponent <= 0) are clamped from below at this value before ``exp``: fp32 ``exp``
of arguments below about -87 takes a slow path (subnormal/underflow results, 10-35x slower on x86 CPUs), which
made the kernel's speed depend on the decay values. A clamped factor is off by at most ``e^-80 ~ 1.8e-35``
absolute on a factor <= 1 that multiplies only factors <= 1 and O(1) data, far below fp32 rounding of any
result; its gradient (``e^x`` times O(1) data) is likewise below ``e^-80``."""


def _decay_exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(x)`` for exponents ``x <= 0`` (any dtype, rounded to ``dtype`` first), clamped at :data:`LOG_FLOOR`."""
    return torch.exp(x.to(dtype).clamp_(min=LOG_FLOOR) if x.dtype != dtype else x.clamp(min=LOG_FLOOR))


def _to_chunks(x: torch.Tensor, C: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, H, *]`` -> ``[N, B, H, C, *]`` (zero padded to N * C tokens), in ``dtype``, one copy.

    Chunks lead so that a run of chunks is one contiguous block (processed while it sits in cache).
    """
    B, T, H = x.shape[:3]
    rest = x.shape[3:]
    N, full = -(-T // C), T // C
    out = x.new_empty(N, B, H, C, *rest, dtype=dtype)
    dims = (1, 0, 3, 2, *range(4, 4 + len(rest)))
    view = out.permute(*dims)  # [B, N, C, H, *] view of out
    if full:
        view[:, :full] = x[:, : full * C].reshape(B, full, C, H, *rest)
    if full != N:
        view[:, full, : T - full * C] = x[:, full * C :]
        view[:, full, T - full * C :] = 0
    return out


def check_chunk_size(chunk_size: object) -> int:
    """``chunk_size`` as an int if it is a valid chunk length, else a one-line error naming it.

    TypeError for anything but an integer (a bool too: ``True`` would silently mean 1-token chunks, e.g. a flag
    passed where fla's ``chunk_kda`` takes ``use_qk_l2norm_in_kernel``); ValueError below 1 or, above
    :data:`SUB_TILE`, for a length that is not a whole number of sub-tiles (the in-chunk decay factorization
    splits a chunk into sub-tiles of :data:`SUB_TILE` tokens; a chunk of at most that many is one sub-tile)."""
    if isinstance(chunk_size, bool):
        raise TypeError(f"chunk_size = {chunk_size!r}: expected an integer, not a bool")
    try:
        c = operator.index(chunk_size)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"chunk_size = {chunk_size!r}: expected an integer") from None
    if c < 1:
        raise ValueError(f"chunk_size = {c}: expected an integer >= 1")
    if c > SUB_TILE and c % SUB_TILE:
        raise ValueError(f"chunk_size = {c}: expected <= {SUB_TILE} or a multiple of {SUB_TILE}")
    return c


def _span(sub: int) -> int:
    """Most tokens between a sub-tile's reference row ``max(sub / 2 - 1, 0)`` and any of its rows."""
    mid = max(sub // 2 - 1, 0)
    return max(sub - 1 - mid, mid)


def sub_tile(chunk_size: int, extent: float = 5.0) -> int:
    """Sub-tile length for chunks of ``chunk_size`` tokens (validated by :func:`check_chunk_size`) whose per-token
    log-decays are within ``[-extent, extent]``: the longest divisor ``sub <= SUB_TILE`` of the chunk with
    ``span(sub) * extent <= FACTOR_LOG_RANGE`` (span: the most tokens between a row and the sub-tile's midpoint
    reference, ``sub / 2`` for even ``sub``), so every diagonal-block factor ``exp(+-(G_r - m_i))`` stays within
    ``e^80``. ``extent <= 5`` (K3's gate range): 32 (the fast path); fp32's clamp floor 20: 8; fp64's 40: 4; a
    1-token sub-tile has no in-tile factor at all (any extent)."""
    c = check_chunk_size(chunk_size)
    for sub in range(min(c, SUB_TILE), 1, -1):
        if c % sub == 0 and _span(sub) * extent <= FACTOR_LOG_RANGE:
            return sub
    return 1


def _data_sub_tile(C: int, g: torch.Tensor) -> int:
    """:func:`sub_tile` for the log-decays ``g`` (their largest magnitude)."""
    if not g.numel():
        return sub_tile(C)
    lo, hi = torch.stack(torch.aminmax(g.detach())).tolist()  # one host sync
    return sub_tile(C, max(-lo, hi, 0.0))


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkTerms:
    """Per-chunk quantities that do not depend on the entering state (K3_SYSTEMS §2.3 steps 1-3, 5-6).

    Shapes are ``[N, B, H, C, *]`` (N chunks of C tokens), in the compute dtype (fp32 for fp32/bf16 inputs).
    """

    T: torch.Tensor | None
    """``[N, B, H, C, C]`` UT transform ``(I + L)^-1 Diag(beta)`` (lower triangular); None from the fused path
    without factors (the forward needs only W and U)."""
    W: torch.Tensor
    """``[N, B, H, C, K]`` ``T (exp(G) * K)`` (G the in-chunk inclusive cumulative log-decay)."""
    U: torch.Tensor
    """``[N, B, H, C, V]`` ``T V``."""
    Kg: torch.Tensor
    """``[N, B, H, C, K]`` ``exp(G_C - G) * K``: each key decayed to the chunk end."""
    decay: torch.Tensor
    """``[N, B, H, K]`` ``exp(G_C)``: total decay over the chunk."""
    Qg: torch.Tensor | None
    """``[N, B, H, C, K]`` ``scale * Q * exp(G)`` (None without q)."""
    A_qk: torch.Tensor | None
    """``[N, B, H, C, C]`` ``scale * q_r . (exp(G_r - G_c) * k_c)`` for c <= r, else 0 (None without q)."""
    WU: torch.Tensor | None = None
    """``[N, B, H, C, K + V]``: W and U side by side when computed by one matmul (W, U are views of it), else None."""


@dataclasses.dataclass(frozen=True, slots=True)
class TileFactors:
    """Intermediates of :func:`chunk_terms` that the hand-written backward reuses (sub-tile i of ``sub`` rows)."""

    e_pos: torch.Tensor
    """``[N, B, H, n_sub, sub, K]`` ``exp(G_r - m_i)``, m_i sub-tile i's midpoint (diagonal-block row factor)."""
    e_neg: torch.Tensor
    """``[N, B, H, n_sub, sub, K]`` ``exp(m_i - G_c)`` (diagonal-block column factor)."""
    off_rows: list[torch.Tensor]
    """Per sub-tile i >= 1: ``[N, B, H, sub, K]`` ``exp(G_r - b_i) <= 1``, b_i = G before sub-tile i (clamped)."""
    off_cols: list[torch.Tensor]
    """Per sub-tile i >= 1: ``[N, B, H, i sub, K]`` ``exp(b_i - G_c) <= 1`` for the columns before it (clamped)."""
    A_kk: torch.Tensor
    """``[N, B, H, C, C]`` ``k_r . (exp(G_r - G_c) * k_c)`` for c < r, else 0 (L before the beta row scale)."""
    T_inv: torch.Tensor
    """``[N, B, H, C, C]`` ``(I + L)^-1`` (T = T_inv Diag(beta))."""
    eG: torch.Tensor
    """``[N, B, H, C, K]`` ``exp(G)``."""
    eCG: torch.Tensor
    """``[N, B, H, C, K]`` ``exp(G_C - G)``."""


def _masks(C: int, sub: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``strict [n_sub, sub, C]`` (c < r) and ``lower`` (c <= r) masks of the rows of each sub-tile."""
    cols = torch.arange(C, device=device)
    strict = cols[:, None] > cols[None, :]
    return strict.view(C // sub, sub, C), (strict | torch.eye(C, dtype=torch.bool, device=device)).view(C // sub,
                                                                                                        sub, C)


def _use_fused(*tensors: torch.Tensor | None) -> bool:
    """The numba path runs without a graph on CPU fp32/fp64 tensors; the torch path otherwise (autograd)."""
    ts = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in ts)


def chunk_terms_with_factors(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    q: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[ChunkTerms, TileFactors]:
    """:func:`chunk_terms` and the :class:`TileFactors` it computed on the way (same arguments)."""
    sub = _data_sub_tile(k.shape[-2], g)
    if _use_fused(k, v, g, beta, q):
        terms, fac = _chunk_terms_fused(k, v, g, beta, q, scale, factors=True, sub=sub)
        assert fac is not None
        return terms, fac
    return _chunk_terms_autograd(k, v, g, beta, q, scale, sub)


def _chunk_terms_fused(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, q: torch.Tensor | None,
                       scale: float, factors: bool, sub: int) -> tuple[ChunkTerms, TileFactors | None]:
    """:func:`chunk_terms` without a graph: the elementwise work in two numba passes
    (:func:`moonrt.ops.kda.backends.numba.tile_operands` before the block matmul,
    :func:`~moonrt.ops.kda.backends.numba.assemble_blocks`
    after it), the matmuls batched over all chunks ``p`` of ``[N, B, H]``: all sub-tile blocks in one ``bmm``, the
    UT transform as one triangular solve, ``[W | U] = (I + L)^-1 [Diag(beta) exp(G) K | Diag(beta) V]`` as one
    ``bmm``. With ``factors`` also the backward's :class:`TileFactors` (and ``T``)."""
    N, B, H, C, K = k.shape
    V = v.shape[-1]
    P = N * B * H
    n_sub = C // sub
    nb = kda_numba.n_blocks(n_sub)
    R = sub if q is None else 2 * sub
    dtype = k.dtype
    k, v, g, beta = (t.to(dtype).contiguous() for t in (k, v, g, beta))
    q = None if q is None else q.to(dtype).contiguous()

    def new(*shape: int) -> torch.Tensor:
        return k.new_empty(P, *shape)

    none = k.new_empty(0, 0, 0)  # stands for an output that is not written (numba needs an array)
    blk_rows, blk_cols, xv, kg, decay = new(nb, R, K), new(nb, sub, K), new(C, K + V), new(C, K), new(K)
    qg, qk = (new(C, K), new(C)) if q is not None else (none, k.new_empty(0, 0))
    e_pos, e_neg, eg, ecg = (new(C, K) for _ in range(4)) if factors else (none,) * 4
    off_rows = new(n_sub - 1, sub, K) if factors else k.new_empty(0, 0, 0, 0)
    off_cols = new(sub * n_sub * (n_sub - 1) // 2, K) if factors else none
    a = {n: t.reshape(P, C, -1).numpy() for n, t in dict(k=k, v=v, g=g).items()}
    kda_numba.tile_operands(a["g"], a["k"], a["k"] if q is None else q.reshape(P, C, K).numpy(), a["v"],
                            beta.reshape(P, C).numpy(), float(scale), sub, q is not None, factors,
                            *(t.numpy() for t in (blk_rows, blk_cols, xv, kg, qg, decay, qk, e_pos, e_neg, eg, ecg,
                                                 off_rows, off_cols)))
    blk = torch.bmm(blk_rows.view(P * nb, R, K), blk_cols.view(P * nb, sub, K).transpose(1, 2))
    lb = new(C, C)
    a_kk = new(C, C) if factors else none
    a_qk = new(C, C) if q is not None else none
    # forward only: [W | U] by forward substitution in the same pass; with factors (backward): T_inv as well
    WU = none if factors else new(C, K + V)
    kda_numba.assemble_blocks(blk.view(P, nb, R, sub).numpy(), beta.reshape(P, C).numpy(), qk.numpy(),
                              q is not None, factors, lb.numpy(), a_kk.numpy(), a_qk.numpy(), not factors,
                              xv.numpy(), WU.numpy())
    T = T_inv = None
    if factors:
        eye = torch.eye(C, dtype=dtype, device=k.device)
        # unitriangular: the solve reads only the strictly lower part (L), the unit diagonal is implied
        T_inv = torch.linalg.solve_triangular(lb, eye, upper=False, unitriangular=True)  # [P, C, C]
        WU = torch.bmm(T_inv, xv)
        T_inv = T_inv.view(N, B, H, C, C)
        T = T_inv * beta[..., None, :]
    WU = WU.view(N, B, H, C, K + V)

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.view(N, B, H, *t.shape[1:])

    terms = ChunkTerms(T=T, W=WU[..., :K], U=WU[..., K:], Kg=chunked(kg), decay=chunked(decay),
                       Qg=None if q is None else chunked(qg), A_qk=None if q is None else chunked(a_qk), WU=WU)
    if not factors:
        return terms, None
    tiles = (N, B, H, n_sub, sub, K)
    offs = [sub * i * (i - 1) // 2 for i in range(n_sub)]
    fac = TileFactors(e_pos=e_pos.view(tiles), e_neg=e_neg.view(tiles),
                      off_rows=[chunked(off_rows[:, i - 1]) for i in range(1, n_sub)],
                      off_cols=[chunked(off_cols[:, offs[i] : offs[i] + i * sub]) for i in range(1, n_sub)],
                      A_kk=chunked(a_kk), T_inv=T_inv, eG=chunked(eg), eCG=chunked(ecg))  # type: ignore[arg-type]
    return terms, fac


def _chunk_terms_autograd(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          q: torch.Tensor | None, scale: float, sub: int) -> tuple[ChunkTerms, TileFactors]:
    """:func:`chunk_terms_with_factors` in plain torch, differentiable (the path with a graph)."""
    dtype = k.dtype
    N, B, H, C, K = k.shape
    n_sub = C // sub
    tiles = (N, B, H, n_sub, sub)
    # [N, B, H, C, K] in fp64; cumsum(dtype=) (no separate cast) only without a graph: its backward runs in fp32
    grad = torch.is_grad_enabled() and g.requires_grad
    G = g.to(torch.float64).cumsum(dim=-2) if grad else g.cumsum(dim=-2, dtype=torch.float64)
    Gt = G.view(*tiles, K)
    # sub-tile midpoints [N, B, H, n_sub, 1, K], detached: the factored products do not depend on them, and their
    # gradient would be a difference of two large sums (cancellation)
    m = Gt[..., max(sub // 2 - 1, 0) : max(sub // 2, 1), :].detach()
    e_pos = torch.exp(Gt - m).to(dtype)  # [N, B, H, n_sub, sub, K] exp(G_r - m_i), within e^+-80
    e_neg = torch.reciprocal(e_pos)  # exp(m_i - G_c): within e^+-80 as e_pos, and rounded twice only
    k_t = k.view(*tiles, K)
    k_col = e_neg * k_t  # k_c exp(m_i - G_c), c in sub-tile i
    qs = None if q is None else q * scale
    k_rows = k_t * e_pos  # [N, B, H, n_sub, sub, K]
    rows = k_rows if qs is None else torch.cat([k_rows, qs.view(*tiles, K) * e_pos], dim=-2)
    R = rows.shape[-2]  # sub (k rows) or 2 sub (k and q rows)
    A_diag = rows @ k_col.transpose(-1, -2)  # [N, B, H, n_sub, R, sub]
    # per sub-tile i: [N, B, H, R, C] = [off-diagonal (c < i sub) | diagonal | zeros (c > i sub)]
    A = A_diag.new_zeros(N, B, H, n_sub, R, C)
    A.view(N, B, H, n_sub, R, n_sub, sub).diagonal(dim1=3, dim2=5).copy_(A_diag.permute(0, 1, 2, 4, 5, 3))
    off_rows, off_cols = [], []
    for i in range(1, n_sub):
        ref = G[..., i * sub - 1 : i * sub, :]  # [N, B, H, 1, K] b_i
        row_f = _decay_exp(Gt[..., i, :, :] - ref, dtype)  # [N, B, H, sub, K] exp(G_r - b_i) <= 1
        col_f = _decay_exp(ref - G[..., : i * sub, :], dtype)  # exp(b_i - G_c) <= 1
        rows_i = k_t[..., i, :, :] * row_f
        if qs is not None:
            rows_i = torch.cat([rows_i, qs.view(*tiles, K)[..., i, :, :] * row_f], dim=-2)
        A[..., i, :, : i * sub] = rows_i @ (col_f * k[..., : i * sub, :]).transpose(-1, -2)
        off_rows.append(row_f)
        off_cols.append(col_f)
    strict, lower = _masks(C, sub, k.device)
    # masked entries of the diagonal blocks may overflow (products of two large factors): select before any
    # arithmetic
    A_kk = torch.where(strict, A[..., :sub, :], 0.0).view(N, B, H, C, C)
    eye = torch.eye(C, dtype=dtype, device=k.device)
    # unitriangular: the solve reads only the strictly lower part (L), the unit diagonal is implied
    T_inv = torch.linalg.solve_triangular(A_kk * beta[..., None], eye, upper=False, unitriangular=True)
    T = T_inv * beta[..., None, :]
    # decaying factors (exponent <= 0) from fp32-rounded exponents: the error |x| eps is scaled by e^-|x| <= 1/e
    eG = _decay_exp(G, dtype)  # [N, B, H, C, K] exp(G)
    W = T @ (eG * k)
    U = T @ v
    G_last = G[..., -1:, :]  # [N, B, H, 1, K]
    eCG = _decay_exp(G_last - G, dtype)
    Kg = eCG * k  # exp(G_C - G) * K
    decay = eG[..., -1, :]
    Qg = A_qk = None
    if qs is not None:
        Qg = qs * eG
        A_qk = torch.where(lower, A[..., sub:, :], 0.0).view(N, B, H, C, C)
        # the diagonal carries no decay: take it exactly
        A_qk.diagonal(dim1=-2, dim2=-1).copy_((qs * k).sum(-1))
    terms = ChunkTerms(T=T, W=W, U=U, Kg=Kg, decay=decay, Qg=Qg, A_qk=A_qk)
    return terms, TileFactors(e_pos=e_pos, e_neg=e_neg, off_rows=off_rows, off_cols=off_cols, A_kk=A_kk,
                              T_inv=T_inv, eG=eG, eCG=eCG)


def chunk_terms(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    q: torch.Tensor | None = None,
    scale: float = 1.0,
) -> ChunkTerms:
    """Per-chunk KDA quantities for all chunks at once (K3_SYSTEMS §2.3), as batched matmuls.

    Args:
        k: ``[N, B, H, C, K]`` keys, chunked (see :func:`_to_chunks`), compute dtype.
        v: ``[N, B, H, C, V]`` values.
        g: ``[N, B, H, C, K]`` per-token log-decay, finite (any magnitude: the sub-tile follows it; the ops clamp
            it at :func:`log_decay_floor` first, which keeps sub-tiles long).
        beta: ``[N, B, H, C]`` write strength.
        q: ``[N, B, H, C, K]`` queries, or None when only the state transition is needed (keyword-only, as
            ``scale``).
        scale: query scale.

    In-chunk decays ``exp(G_r - G_c)`` (c <= r) enter the matmuls factored through sub-tiles of ``sub`` tokens
    (§2.2; :func:`sub_tile` of the largest ``|g|`` in this call: :data:`SUB_TILE` for log-decays >= -5, fewer for
    stronger ones), with every factor in fp32 range and no exponent below :data:`LOG_FLOOR`:

    - diagonal blocks (r, c in sub-tile i): row r is scaled by ``exp(G_r - m_i)`` and column c by
      ``exp(m_i - G_c)``, m_i the sub-tile's midpoint; both within ``e^(span(sub) max|g|) <= e^80``
      (``e^(16 * 5)`` for 32-token sub-tiles and log-decays >= -5);
    - off-diagonal blocks (r in sub-tile i, c before it): reference ``b_i = G`` at the last token before sub-tile
      i, row factor ``exp(G_r - b_i) <= 1`` and column factor ``exp(b_i - G_c) <= 1``, both decaying and clamped
      at :data:`LOG_FLOOR` (a dropped product is below ``e^-80``).

    Exponents are differences of fp64 cumulative sums, rounded once. The diagonal ``r = c`` of ``A_qk`` is taken
    exactly (``q_r . k_r``), so no gradient passes through ``exp(0)`` written as a product of a large and a small
    factor. The UT transform is one batched triangular solve against the identity, scaled by ``beta`` per column.

    Without a graph (no input requires grad, CPU fp32/fp64) this runs :func:`_chunk_terms_fused` and returns
    ``T = None`` (the forward reads only W and U, computed as ``[W | U] = (I + L)^-1 Diag(beta) [exp(G) K | V]``).
    """
    sub = _data_sub_tile(k.shape[-2], g)
    if _use_fused(k, v, g, beta, q):
        return _chunk_terms_fused(k, v, g, beta, q, scale, factors=False, sub=sub)[0]
    return _chunk_terms_autograd(k, v, g, beta, q, scale, sub)[0]


def chunk_transitions(terms: ChunkTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk affine state maps ``S_{n+1} = M_n S_n + S_ext_n`` (K3_SYSTEMS §2.4).

    Returns ``M [N, B, H, K, K] = Diag(exp(G_C)) - Kg^T W`` and ``S_ext [N, B, H, K, V] = Kg^T U``.
    """
    KgT = terms.Kg.transpose(-1, -2)
    if terms.WU is not None and not torch.is_grad_enabled():  # one matmul Kg^T [W | U]; M and S_ext are views
        K = KgT.shape[-2]
        N, B, H = KgT.shape[:3]
        MS = torch.bmm(KgT.reshape(-1, K, KgT.shape[-1]), terms.WU.reshape(-1, *terms.WU.shape[-2:]))
        MS = MS.view(N, B, H, K, -1)
        M = MS[..., :K].neg_()
        M.diagonal(dim1=-2, dim2=-1).add_(terms.decay)
        return M, MS[..., K:]
    return torch.diag_embed(terms.decay).sub_(KgT @ terms.W), KgT @ terms.U


def _scan_states(M: torch.Tensor, S_ext: torch.Tensor, S: torch.Tensor, first: int = 0,
                 resets: dict[int, torch.Tensor] | None = None, finals: dict[int, int] | None = None,
                 out: list[torch.Tensor | None] | None = None,
                 states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk ``[N, B, H, K, V]`` and the state after the last one ``[B, H, K, V]``.

    ``M [N, B, H, K, K]``, ``S_ext [N, B, H, K, V]``, ``S [B, H, K, V]`` the entering state. The only sequential
    part of the chunk form: one ``[K, K] @ [K, V]`` matmul per chunk (batched over B, H). For packed sequences
    (``cu_seqlens``): chunk ``first + n`` in ``resets`` starts from ``resets[first + n]`` instead of the carried
    state, and the state after chunk ``first + n`` in ``finals`` is stored at ``out[finals[first + n]]``.
    ``states``: optional preallocated ``[N, B, H, K, V]`` output. No graph: the chunked kernel's backward runs
    the reverse pass itself (:mod:`moonrt.ops.kda.autograd`).
    """
    N, B, H, K, V = S_ext.shape
    if states is None:
        states = S_ext.new_empty(N, B, H, K, V)
    S3 = S.reshape(B * H, K, V)
    for n in range(N):
        if resets is not None and first + n in resets:
            S3 = resets[first + n].reshape(B * H, K, V)
        cur = states[n].view(B * H, K, V)
        if S3.data_ptr() != cur.data_ptr():
            cur.copy_(S3)
        in_place = n + 1 < N and (resets is None or first + n + 1 not in resets)
        S3 = torch.baddbmm(S_ext[n].view(B * H, K, V), M[n].view(B * H, K, K), cur,
                           out=states[n + 1].view(B * H, K, V) if in_place else torch.empty_like(cur))
        if finals is not None and out is not None and first + n in finals:
            out[finals[first + n]] = S3.view(B, H, K, V)
    return states, S3.view(B, H, K, V)
