"""Kimi Delta Attention ops: the token recurrence and the chunkwise-parallel form (K3_SYSTEMS §2.1-2.4).

Both functions share fla's ``chunk_kda`` / ``fused_recurrent_kda`` contract, so implementations can be
swapped:

- ``q, k [B, T, H, K]``, ``v [B, T, H, V]``: used as given (L2 normalization is the layer's job);
- ``g [B, T, H, K]``: per-token, per-channel log-decay (<= 0), ``alpha_t = exp(g_t)``;
- ``beta [B, T, H]``: write strength; ``scale`` defaults to ``K ** -0.5``;
- ``initial_state [B, H, K, V]`` (fp32); returns ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V]
  fp32 or None)``.

The recurrence (§2.1) per head, state ``S`` of shape K x V, is "decay, then delta correction, then read"::

    S <- Diag(alpha_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)

The chunk form (§2.3) splits the sequence into chunks of C tokens. Everything that does not depend on the
state entering a chunk is computed for all chunks at once as batched matmuls ``[N, B, H, C, *]`` by
:func:`chunk_terms`; the only sequential part is one K x K by K x V state matmul per chunk
(``S_{n+1} = M_n S_n + S_ext_n``, the affine form of §2.4). :func:`kda_transition` exposes that affine map
for any contiguous segment; KCP (§7) builds on it.

Numerics: all state arithmetic is in fp32 (fp64 if the inputs are fp64). In-chunk decays are applied
through 32-token sub-tiles with a midpoint reference (§2.2), so every factor in a matmul operand lies within
``e^(16 * 5) = e^80`` for per-token log-decays >= -5 (K3's gate range). Cumulative log-decays are summed in
fp64 (and their gradient reverse-summed in fp64) and exponentials of large exponents are taken in fp64 and
rounded once, so results keep fp32 precision (~1e-7 relative against an fp64 reference).
"""

from __future__ import annotations

import dataclasses

import torch

SUB_TILE = 32
"""Rows per sub-tile for the in-chunk decay factorization (K3_SYSTEMS §2.2). 32 rather than 16: the batched
intra-chunk matmuls then have 64 rows (q and k rows of a sub-tile), which CPU BLAS runs several times faster."""

MIN_LOG_DECAY = -5.0
"""Smallest per-token log-decay the chunk form accepts (K3's gate bound, §2.2): the factors taken relative to
a sub-tile midpoint then stay within e^(16 * 5) = e^80 < 3.4e38 (fp32 max)."""


LOG_FLOOR = -80.0
"""Exponents of decaying factors (exponent <= 0) are clamped from below at this value before ``exp``: fp32 ``exp``
of arguments below about -87 takes a slow path (subnormal/underflow results, 10-35x slower on x86 CPUs), which
made the kernel's speed depend on the decay values. A clamped factor is off by at most ``e^-80 ~ 1.8e-35``
absolute on a factor <= 1 that multiplies only factors <= 1 and O(1) data, far below fp32 rounding of any
result; its gradient (``e^x`` times O(1) data) is likewise below ``e^-80``."""


def _decay_exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(x)`` for exponents ``x <= 0`` (any dtype, rounded to ``dtype`` first), clamped at :data:`LOG_FLOOR`."""
    return torch.exp(x.to(dtype).clamp(min=LOG_FLOOR))


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_inputs(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None) -> None:
    """Raise ValueError naming the argument, its shape and the expected shape."""
    if k.dim() != 4:
        raise ValueError(f"k.shape = {tuple(k.shape)}: expected [B, T, H, K] (4 dims)")
    B, T, H, K = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q.shape = {tuple(q.shape)}: expected k's shape {tuple(k.shape)} [B, T, H, K]")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v.shape = {tuple(v.shape)}: expected [B, T, H, V] = [{B}, {T}, {H}, V]")
    if g.shape != k.shape:
        raise ValueError(f"g.shape = {tuple(g.shape)}: expected k's shape {tuple(k.shape)} [B, T, H, K]")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta.shape = {tuple(beta.shape)}: expected [B, T, H] = [{B}, {T}, {H}]")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state.shape = {tuple(initial_state.shape)}: expected [B, H, K, V] = "
                         f"[{B}, {H}, {K}, {V}]")


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (K3_SYSTEMS §2.1), the reference. Differentiable through autograd.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (used as given).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log-decay, <= 0 (any magnitude).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before token 0 (zeros if None).
        output_final_state: also return the state after the last token.

    Returns:
        ``o [B, T, H, V]`` in v's dtype, and ``S_T [B, H, K, V]`` fp32 (fp64 for fp64 inputs) or None.
    """
    _check_inputs(q, k, v, g, beta, initial_state)
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    S = k.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t, :, None]  # [B, H, K], [B, H, 1]
        S = S * g[:, t, :, :, None].exp()  # decay rows
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)  # v - S^T k with the decayed state
        S = S + (b_t * k_t)[..., None] * err[:, :, None, :]  # delta correction
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))  # read
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(v.dtype), (S if output_final_state else None)


# ---- chunk form ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkTerms:
    """Per-chunk quantities that do not depend on the entering state (K3_SYSTEMS §2.3 steps 1-3, 5-6).

    Shapes are ``[N, B, H, C, *]`` (N chunks of C tokens), in the compute dtype (fp32 for fp32/bf16 inputs).
    """

    G: torch.Tensor
    """``[N, B, H, C, K]`` in-chunk inclusive cumulative log-decay (fp64: differences stay precise)."""
    T: torch.Tensor
    """``[N, B, H, C, C]`` UT transform ``(I + L)^-1 Diag(beta)`` (lower triangular)."""
    W: torch.Tensor
    """``[N, B, H, C, K]`` ``T (exp(G) * K)``."""
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


def _sub_tile(chunk_size: int) -> int:
    if chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size}: expected an integer >= 1")
    if chunk_size <= SUB_TILE:
        return chunk_size
    if chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size = {chunk_size}: expected <= {SUB_TILE} or a multiple of {SUB_TILE}")
    return SUB_TILE


def _check_decay(g: torch.Tensor) -> None:
    if g.numel():
        lo = float(g.detach().min())
        if not lo >= MIN_LOG_DECAY:  # also catches NaN
            raise ValueError(f"g.min() = {lo}: the chunk form expects per-token log-decays >= {MIN_LOG_DECAY} "
                             "(K3's gate gives > -5); use kda_recurrent for stronger decays")


def chunk_terms(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    q: torch.Tensor | None = None,
    scale: float = 1.0,
) -> ChunkTerms:
    """Per-chunk KDA quantities for all chunks at once (K3_SYSTEMS §2.3), as batched matmuls.

    Args:
        k: ``[N, B, H, C, K]`` keys, chunked (see :func:`_to_chunks`), compute dtype.
        v: ``[N, B, H, C, V]`` values.
        g: ``[N, B, H, C, K]`` per-token log-decay (>= :data:`MIN_LOG_DECAY`).
        beta: ``[N, B, H, C]`` write strength.
        q: ``[N, B, H, C, K]`` queries, or None when only the state transition is needed.
        scale: query scale.

    In-chunk decays ``exp(G_r - G_c)`` (c <= r) enter the matmuls factored through sub-tiles of :data:`SUB_TILE`
    tokens (§2.2), with every factor in fp32 range and no exponent below :data:`LOG_FLOOR`:

    - diagonal blocks (r, c in sub-tile i): row r is scaled by ``exp(G_r - m_i)`` and column c by
      ``exp(m_i - G_c)``, m_i the sub-tile's midpoint; both within ``e^(16 * 5) = e^80`` for log-decays >= -5;
    - off-diagonal blocks (r in sub-tile i, c before it): reference ``b_i = G`` at the last token before sub-tile
      i, row factor ``exp(G_r - b_i) <= 1`` and column factor ``exp(b_i - G_c) <= 1``, both decaying and clamped
      at :data:`LOG_FLOOR` (a dropped product is below ``e^-80``).

    Exponents are differences of fp64 cumulative sums, rounded once. The diagonal ``r = c`` of ``A_qk`` is taken
    exactly (``q_r . k_r``), so no gradient passes through ``exp(0)`` written as a product of a large and a small
    factor. The UT transform is one batched triangular solve against ``Diag(beta)``.
    """
    dtype = k.dtype
    N, B, H, C, K = k.shape
    sub = _sub_tile(C)
    n_sub = C // sub
    tiles = (N, B, H, n_sub, sub)
    G = g.to(torch.float64).cumsum(dim=-2)  # [N, B, H, C, K]; (cumsum(dtype=) would run its backward in fp32)
    Gt = G.view(*tiles, K)
    # sub-tile midpoints [N, B, H, n_sub, 1, K], detached: the factored products do not depend on them, and their
    # gradient would be a difference of two large sums (cancellation)
    m = Gt[..., max(sub // 2 - 1, 0) : max(sub // 2, 1), :].detach()
    e_pos = torch.exp(Gt - m).to(dtype)  # [N, B, H, n_sub, sub, K] exp(G_r - m_i), within e^+-80
    k_t = k.view(*tiles, K)
    k_col = torch.exp((m - Gt).to(dtype)) * k_t  # k_c exp(m_i - G_c), c in sub-tile i
    qs = None if q is None else q * scale
    k_rows = k_t * e_pos  # [N, B, H, n_sub, sub, K]
    rows = k_rows if qs is None else torch.cat([k_rows, qs.view(*tiles, K) * e_pos], dim=-2)
    A_diag = rows @ k_col.transpose(-1, -2)  # [N, B, H, n_sub, R, sub], R = sub (k rows) or 2 sub (k and q rows)
    blocks = []  # per sub-tile i: [N, B, H, R, C] = [off-diagonal (c < i sub) | diagonal | zeros (c > i sub)]
    for i in range(n_sub):
        parts = []
        if i:
            ref = G[..., i * sub - 1 : i * sub, :]  # [N, B, H, 1, K] b_i
            row_f = _decay_exp(Gt[..., i, :, :] - ref, dtype)  # [N, B, H, sub, K] exp(G_r - b_i) <= 1
            col = _decay_exp(ref - G[..., : i * sub, :], dtype) * k[..., : i * sub, :]  # exp(b_i - G_c) k_c
            rows_i = k_t[..., i, :, :] * row_f
            if qs is not None:
                rows_i = torch.cat([rows_i, qs.view(*tiles, K)[..., i, :, :] * row_f], dim=-2)
            parts.append(rows_i @ col.transpose(-1, -2))
        parts.append(A_diag[..., i, :, :])
        if i + 1 < n_sub:
            parts.append(A_diag.new_zeros(*A_diag.shape[:3], A_diag.shape[-2], C - (i + 1) * sub))
        blocks.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
    A = torch.stack(blocks, dim=3)  # [N, B, H, n_sub, R, C]
    cols = torch.arange(C, device=k.device)
    strict = (cols[:, None] > cols[None, :]).view(n_sub, sub, C)  # c < r
    # masked entries of the diagonal blocks may overflow (products of two large factors): select before any
    # arithmetic
    L = (torch.where(strict, A[..., :sub, :], 0.0) * beta.view(*tiles, 1)).view(N, B, H, C, C)
    T = torch.linalg.solve_triangular(L, torch.diag_embed(beta), upper=False, unitriangular=True)
    # decaying factors (exponent <= 0) from fp32-rounded exponents: the error |x| eps is scaled by e^-|x| <= 1/e
    eG = _decay_exp(G, dtype)  # [N, B, H, C, K] exp(G)
    W = T @ (eG * k)
    U = T @ v
    G_last = G[..., -1:, :]  # [N, B, H, 1, K]
    Kg = _decay_exp(G_last - G, dtype) * k  # exp(G_C - G) * K
    decay = _decay_exp(G_last[..., 0, :], dtype)
    Qg = A_qk = None
    if qs is not None:
        Qg = qs * eG
        lower = strict | (cols[:, None] == cols[None, :]).view(n_sub, sub, C)
        A_qk = torch.where(lower, A[..., sub:, :], 0.0).view(N, B, H, C, C)
        # the diagonal carries no decay: take it exactly
        A_qk.diagonal(dim1=-2, dim2=-1).copy_((qs * k).sum(-1))
    return ChunkTerms(G=G, T=T, W=W, U=U, Kg=Kg, decay=decay, Qg=Qg, A_qk=A_qk)


def chunk_transitions(terms: ChunkTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk affine state maps ``S_{n+1} = M_n S_n + S_ext_n`` (K3_SYSTEMS §2.4).

    Returns ``M [N, B, H, K, K] = Diag(exp(G_C)) - Kg^T W`` and ``S_ext [N, B, H, K, V] = Kg^T U``.
    """
    KgT = terms.Kg.transpose(-1, -2)
    return torch.diag_embed(terms.decay).sub_(KgT @ terms.W), KgT @ terms.U


def _scan_states(M: torch.Tensor, S_ext: torch.Tensor, S: torch.Tensor, first: int = 0,
                 resets: dict[int, torch.Tensor] | None = None, finals: dict[int, int] | None = None,
                 out: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each chunk ``[N, B, H, K, V]`` and the state after the last one ``[B, H, K, V]``.

    ``M [N, B, H, K, K]``, ``S_ext [N, B, H, K, V]``, ``S [B, H, K, V]`` the entering state. The only sequential
    part of the chunk form: one ``[K, K] @ [K, V]`` matmul per chunk (batched over B, H). For packed sequences
    (``cu_seqlens``): chunk ``first + n`` in ``resets`` starts from ``resets[first + n]`` instead of the carried
    state, and the state after chunk ``first + n`` in ``finals`` is stored at ``out[finals[first + n]]``.
    """
    N, B, H, K, V = S_ext.shape
    states = []
    S = S.reshape(B * H, K, V)
    for n in range(N):
        if resets is not None and first + n in resets:
            S = resets[first + n].reshape(B * H, K, V)
        states.append(S)
        S = torch.baddbmm(S_ext[n].view(B * H, K, V), M[n].view(B * H, K, K), S)
        if finals is not None and out is not None and first + n in finals:
            out[finals[first + n]] = S.view(B, H, K, V)
    return torch.stack(states).view(N, B, H, K, V), S.view(B, H, K, V)


CHUNK_GROUP_ELEMS = 1 << 18
"""Chunks are processed in groups of about this many ``[C, K]`` elements (1 MiB in fp32), so each group's
intermediates stay in cache; the state pass carries the state from group to group."""


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA (K3_SYSTEMS §2.3): same contract and results as :func:`kda_recurrent`.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (used as given).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log-decay in ``[-5, 0]`` per token (K3's gate range; see :data:`MIN_LOG_DECAY`).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before token 0 (zeros if None); ``[N, H, K, V]`` with
            ``cu_seqlens``, one per sequence.
        output_final_state: also return the state after the last token (``[N, H, K, V]`` per sequence with
            ``cu_seqlens``).
        chunk_size: tokens per chunk C (<= 32 or a multiple of 32). T need not be a multiple of C: the
            tail is padded with tokens that neither decay nor write (g = 0, k = 0, beta = 0).
        cu_seqlens: ``[N + 1]`` integer offsets of N sequences packed along T (fla's meaning; requires B = 1):
            sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``, the state starts from its own initial state
            at each boundary and nothing crosses it. Each sequence is padded to whole chunks, so results equal
            separate calls per sequence.

    Returns:
        ``o [B, T, H, V]`` in v's dtype, and ``S_T [B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) fp32
        (fp64 for fp64 inputs) or None.
    """
    _check_inputs(q, k, v, g, beta, initial_state if cu_seqlens is None else None)
    _check_decay(g)
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta)
    _sub_tile(chunk_size)
    if cu_seqlens is not None:
        return _kda_chunk_varlen(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size,
                                 cu_seqlens, dtype)
    S = k.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:
        return v.new_zeros(B, 0, H, V), (S if output_final_state else None)
    C = _chunk_len(T, chunk_size)
    chunks = [_to_chunks(t, C, dtype) for t in (q, k, v, g, beta)]  # [N, B, H, C, *]
    O, S = _chunk_forward(*chunks, S, scale)
    N = O.shape[0]
    o = O.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T].to(v.dtype)
    return o, (S if output_final_state else None)


def _chunk_len(T: int, chunk_size: int) -> int:
    """Chunk length for a sequence of T tokens: a sequence shorter than one chunk (e.g. decoding) uses the
    smallest valid chunk that holds it."""
    return max(1, min(chunk_size, T if T <= SUB_TILE else -(-T // SUB_TILE) * SUB_TILE))


def _chunk_forward(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor,
                   S: torch.Tensor, scale: float, resets: dict[int, torch.Tensor] | None = None,
                   finals: dict[int, int] | None = None,
                   out: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA on chunk-major inputs ``[N, B, H, C, *]`` (see :func:`_to_chunks`) from the entering state
    ``S [B, H, K, V]``: returns ``O [N, B, H, C, V]`` and the state after the last chunk. ``resets``, ``finals``
    and ``out`` as in :func:`_scan_states` (packed sequences)."""
    N, B, H, C, K = kc.shape
    V = vc.shape[-1]
    group = max(1, CHUNK_GROUP_ELEMS // (B * H * C * max(K, V)))
    outs = []
    for n0 in range(0, N, group):
        sl = slice(n0, n0 + group)
        terms = chunk_terms(kc[sl], vc[sl], gc[sl], bc[sl], q=qc[sl], scale=scale)
        M, S_ext = chunk_transitions(terms)
        S_in, S = _scan_states(M, S_ext, S, n0, resets, finals, out)  # [n, B, H, K, V]
        bmm = (-1, C, V)  # as 3-d batches, so the additions fuse into the matmuls
        V_tilde = torch.baddbmm(terms.U.view(bmm), terms.W.view(-1, C, K), S_in.view(-1, K, V), alpha=-1.0)  # (4)
        O = torch.baddbmm(terms.Qg.view(-1, C, K) @ S_in.view(-1, K, V), terms.A_qk.view(-1, C, C), V_tilde)  # (5)
        outs.append(O.view(-1, B, H, C, V))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)), S


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    """Validate fla-style offsets; return them as a list. One-line ValueError naming the problem otherwise."""
    if B != 1:
        raise ValueError(f"q.shape[0] = {B}: cu_seqlens packs sequences along T and expects batch size 1")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
        what = (f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor)
                else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens: {what}: expected a 1-d integer tensor [N + 1] with N >= 1")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens = {cu}: expected non-decreasing offsets from 0 to T = {T}")
    return cu


def _kda_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, initial_state: torch.Tensor | None, output_final_state: bool, chunk_size: int,
                      cu_seqlens: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_chunk` with ``cu_seqlens``: each sequence padded to whole chunks, all chunks of all sequences
    through the same batched chunk terms, the state pass reset at each sequence's first chunk."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    cu = _check_cu_seqlens(cu_seqlens, B, T)
    n_seq = len(cu) - 1
    if initial_state is not None and initial_state.shape != (n_seq, H, K, V):
        raise ValueError(f"initial_state.shape = {tuple(initial_state.shape)}: expected [N, H, K, V] = "
                         f"[{n_seq}, {H}, {K}, {V}] (one state per sequence of cu_seqlens)")
    S0 = k.new_zeros(n_seq, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    C = _chunk_len(max(lens), chunk_size)
    n_chunks = [-(-n // C) for n in lens]
    firsts = [sum(n_chunks[:i]) for i in range(n_seq)]
    NC = sum(n_chunks)
    finals_out: list[torch.Tensor | None] = [None if n else S0[i : i + 1] for i, n in enumerate(n_chunks)]
    if NC == 0:
        return v.new_zeros(1, 0, H, V), (torch.cat(finals_out) if output_final_state else None)  # type: ignore[arg-type]
    dev = k.device
    starts = torch.tensor(cu[:-1], device=dev)
    seq_of = torch.repeat_interleave(torch.arange(n_seq, device=dev), torch.tensor(lens, device=dev))
    pos = torch.arange(T, device=dev) - starts[seq_of] + torch.tensor(firsts, device=dev)[seq_of] * C  # padded pos
    src = torch.full((NC * C,), T, dtype=torch.long, device=dev)  # token at each padded position; T = a zero row
    src[pos] = torch.arange(T, device=dev)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [1, T, H, *] -> [NC, 1, H, C, *], padding zeros
        flat = torch.cat([x[0].to(dtype), x.new_zeros(1, *x.shape[2:], dtype=dtype)])
        y = flat.index_select(0, src).view(NC, C, *x.shape[2:])
        return y.transpose(1, 2).unsqueeze(1).contiguous()

    resets = {f: S0[i : i + 1] for i, (f, n) in enumerate(zip(firsts, n_chunks)) if n}
    finals = {f + n - 1: i for i, (f, n) in enumerate(zip(firsts, n_chunks)) if n}
    O, _ = _chunk_forward(*(chunked(t) for t in (q, k, v, g, beta)), S0[:1], scale, resets, finals, finals_out)
    o = O[:, 0].transpose(1, 2).reshape(NC * C, H, V).index_select(0, pos)[None].to(v.dtype)
    S_T = torch.cat(finals_out) if output_final_state else None  # type: ignore[arg-type]
    return o, S_T


def kda_transition(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine state map of a contiguous segment: ``S_end = M S_start + S_ext`` (K3_SYSTEMS §2.4, used by KCP §7).

    Args:
        k: ``[B, T, H, K]``, v: ``[B, T, H, V]``, g: ``[B, T, H, K]``, beta: ``[B, T, H]`` for the segment.
        chunk_size: as in :func:`kda_chunk`.

    Returns:
        ``M [B, H, K, K]`` (product over the segment of ``(I - beta_t k_t k_t^T) Diag(alpha_t)``, later tokens on
        the left) and ``S_ext [B, H, K, V]`` (the segment's final state from a zero start), both fp32 (fp64 for
        fp64 inputs). Differentiable.
    """
    _check_inputs(None, k, v, g, beta, None)
    _check_decay(g)
    B, T, H, K = k.shape
    V = v.shape[-1]
    dtype = _compute_dtype(k, v, g, beta)
    if T == 0:
        eye = torch.eye(K, dtype=dtype, device=k.device).expand(B, H, K, K).clone()
        return eye, k.new_zeros(B, H, K, V, dtype=dtype)
    kc, vc, gc = (_to_chunks(t, chunk_size, dtype) for t in (k, v, g))  # [N, B, H, C, *]
    terms = chunk_terms(kc, vc, gc, _to_chunks(beta, chunk_size, dtype))
    M_c, E_c = chunk_transitions(terms)  # [N, B, H, K, K], [N, B, H, K, V]
    M, S = M_c[0], E_c[0]
    for n in range(1, M_c.shape[0]):
        M = M_c[n] @ M
        S = torch.baddbmm(E_c[n].view(B * H, K, V), M_c[n].view(B * H, K, K), S.reshape(B * H, K, V)).view(B, H, K, V)
    return M, S


__all__ = ["ChunkTerms", "chunk_terms", "chunk_transitions", "kda_chunk", "kda_recurrent", "kda_transition",
           "LOG_FLOOR", "MIN_LOG_DECAY", "SUB_TILE"]
