"""Kimi Delta Attention, the chunkwise-parallel form (K3_SYSTEMS §2.1-2.4), beside the token recurrence
(:mod:`moonrt.ops.kda.naive`, re-exported here).

Both functions share fla's ``chunk_kda`` / ``fused_recurrent_kda`` contract for the five tensors, so
implementations can be swapped when called with keywords:

- ``q, k [B, T, H, K]``, ``v [B, T, H, V]``: used as given (L2 normalization is the layer's job);
- ``g [B, T, H, K]``: per-token, per-channel log-decay (<= 0), ``alpha_t = exp(g_t)``;
- ``beta [B, T, H]``: write strength; ``scale`` defaults to ``K ** -0.5``;
- ``initial_state [B, H, K, V]`` (fp32); returns ``(o [B, T, H, V] in q's dtype (fla's), final_state
  [B, H, K, V] fp32 or None)``;
- fla's keyword options (:mod:`moonrt.ops.kda.fla_options`): grouped value heads (``v, g, beta`` and the states with
  ``HV`` heads, a multiple of q and k's ``H``), ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with
  ``A_log``, ``dt_bias`` and ``lower_bound`` (``safe_gate`` accepted), ``use_beta_sigmoid_in_kernel`` /
  ``allow_neg_eigval``, ``state_v_first`` (states ``[N, HV, V, K]``), so a ``chunk_kda`` / ``fused_recurrent_kda``
  call switches by changing the import; options fla has and moonrt does not (``cp_context``,
  ``return_intermediate_states``, ...) raise Python's TypeError naming them;
- everything after the five tensors is keyword-only: fla's positional order differs (its 9th argument is
  ``use_qk_l2norm_in_kernel``, moonrt's was ``chunk_size``), so a peer-style positional call raises TypeError
  instead of silently running with other options. ``chunk_size`` is checked (:func:`check_chunk_size`).

The recurrence (§2.1) per head, state ``S`` of shape K x V, is "decay, then delta correction, then read"::

    S <- Diag(alpha_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)

The chunk form (§2.3) splits the sequence into chunks of C tokens. Everything that does not depend on the
state entering a chunk is computed for all chunks at once as batched matmuls ``[N, B, H, C, *]`` by
:func:`chunk_terms`; the only sequential part is one K x K by K x V state matmul per chunk
(``S_{n+1} = M_n S_n + S_ext_n``, the affine form of §2.4). :func:`kda_transition` exposes that affine map
for any contiguous segment; KCP (§7) builds on it. The building blocks live in :mod:`moonrt.ops.kda.terms`;
:func:`kda_chunk` runs them as one autograd function with a hand-written chunked backward (reverse state
pass, then batched per-chunk gradients; :mod:`moonrt.ops.kda.autograd`); without a graph the terms' elementwise
work runs in numba (:mod:`moonrt.ops.kda.backends.numba`). :func:`kda_transition` under autograd runs the plain torch
terms (differentiable).

Numerics: all state arithmetic is in fp32 (fp64 if the inputs are fp64). Any log-decay ``g <= 0`` is accepted
(``-inf`` too; NaN raises ValueError naming g): the chunk form first clamps each per-token log-decay at
:func:`log_decay_floor` (fp32: -20, fp64: -40; ``exp`` of the floor is below the dtype's resolution, so the clamp
changes results by less than one rounding, and the clamped entries get a zero gradient whose true value is below
the same bound). In-chunk decays are applied through sub-tiles with a midpoint reference (§2.2) whose length
follows the data (:func:`sub_tile`): 32 tokens for per-token log-decays >= -5 (K3's gate range, the fast path),
fewer for stronger decays (8 at the fp32 floor, 4 at fp64's), so every factor in a matmul operand lies within
``e^80``. Cumulative log-decays are summed in fp64 (and their gradient reverse-summed in fp64) and exponentials of
large exponents are taken in fp64 and rounded once, so results keep fp32 precision (~1e-7 relative against an
fp64 reference) and fp64 runs equal the recurrence to ~1e-13.
"""

from __future__ import annotations

import torch

from moonrt.ops.kda.autograd import ChunkKDA, chunk_state_grad
from moonrt.ops.kda.contract import (
    MIN_LOG_DECAY,
    KdaCall,
    check_cu_seqlens,
    check_decay,
    check_inputs,
    check_sequence_states,
    check_state_grad_inputs,
    compute_dtype,
    prepare_call,
)
from moonrt.ops.kda.fla_options import FlaOptions
from moonrt.ops.kda.naive import kda_recurrent
from moonrt.ops.kda.terms import (
    LOG_FLOOR,
    SUB_TILE,
    ChunkTerms,
    _to_chunks,
    check_chunk_size,
    chunk_terms,
    chunk_transitions,
    clamp_log_decay,
    log_decay_floor,
    sub_tile,
)
from moonrt.ops.precision import fp32_island

# ---- chunk form (building blocks: moonrt.ops.kda.terms; kernel and its backward: moonrt.ops.kda.autograd) ----


@fp32_island
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
    """Chunkwise-parallel KDA (K3_SYSTEMS §2.3): same contract and results as :func:`kda_recurrent`.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (used as given).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log-decay ``<= 0`` per token, any magnitude (``-inf``: a full reset; see the module
            docstring's numerics for the clamp at :func:`log_decay_floor`).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before token 0 (zeros if None); ``[N, H, K, V]`` with
            ``cu_seqlens``, one per sequence.
        output_final_state: also return the state after the last token (``[N, H, K, V]`` per sequence with
            ``cu_seqlens``).
        chunk_size: tokens per chunk C, an int (not a bool) >= 1 that is <= 32 or a multiple of 32
            (:func:`check_chunk_size`: TypeError / ValueError naming it otherwise). T need not be a multiple of C:
            the tail is padded with tokens that neither decay nor write (g = 0, k = 0, beta = 0).
        cu_seqlens: ``[N + 1]`` integer offsets of N sequences packed along T (fla's meaning; requires B = 1):
            sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``, the state starts from its own initial state
            at each boundary and nothing crosses it. Each sequence is padded to whole chunks, so results equal
            separate calls per sequence.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first: fla's options (all off by default), applied as
            the same computation on the inputs / states (:mod:`moonrt.ops.kda.fla_options`); with grouped value heads
            (``v, g, beta, initial_state`` with ``HV`` heads, a multiple of q and k's ``H``) o and the states have
            ``HV`` heads.

    Returns:
        ``o [B, T, H, V]`` in q's dtype (fla's), and ``S_T [B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``)
        fp32 (fp64 for fp64 inputs) or None.
    """
    chunk_size = check_chunk_size(chunk_size)
    call = prepare_call(q, k, v, g, beta, FlaOptions(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first), scale=scale, initial_state=initial_state,
        per_sequence_state=cu_seqlens is not None)
    check_decay(call.g)
    if cu_seqlens is not None:
        o, S_T = _kda_chunk_varlen(call, output_final_state=output_final_state, chunk_size=chunk_size,
                                   cu_seqlens=cu_seqlens)
        return o, call.final(S_T)
    B, T, H, K, V = call.dims
    dtype, final = call.dtype, call.final
    S = call.k.new_zeros(B, H, K, V, dtype=dtype) if call.initial_state is None else call.initial_state.to(dtype)
    if T == 0:
        return call.v.new_zeros(B, 0, H, V, dtype=call.out_dtype), (final(S) if output_final_state else None)
    C = _chunk_len(T, chunk_size)
    chunks = [_to_chunks(t, C, dtype) for t in call.tensors]  # [N, B, H, C, *]
    O, S = ChunkKDA.apply(*chunks, S[None], starts=(0,), scale=call.scale)
    S = S[0]
    N = O.shape[0]
    o = O.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T].to(call.out_dtype)
    return o, (final(S) if output_final_state else None)


def _chunk_len(T: int, chunk_size: int) -> int:
    """Chunk length for a sequence of T tokens: a sequence shorter than one chunk (e.g. decoding) uses the
    smallest valid chunk that holds it."""
    return max(1, min(chunk_size, T if T <= SUB_TILE else -(-T // SUB_TILE) * SUB_TILE))


def _kda_chunk_varlen(call: KdaCall, *, output_final_state: bool, chunk_size: int,
                      cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kda_chunk` with ``cu_seqlens``: each sequence padded to whole chunks, all chunks of all sequences
    through the same batched chunk terms, the state pass reset at each sequence's first chunk."""
    q, k, v, g, beta = call.tensors
    B, T, H, K, V = call.dims
    initial_state, dtype, out_dtype = call.initial_state, call.dtype, call.out_dtype
    cu = check_cu_seqlens(cu_seqlens, B, T)
    n_seq = len(cu) - 1
    check_sequence_states(initial_state, n_seq, H, K, V)
    S0 = k.new_zeros(n_seq, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    C = _chunk_len(max(lens), chunk_size)
    n_chunks = [-(-n // C) for n in lens]
    firsts = [sum(n_chunks[:i]) for i in range(n_seq)]
    NC = sum(n_chunks)
    finals_out: list[torch.Tensor | None] = [None if n else S0[i : i + 1] for i, n in enumerate(n_chunks)]
    if NC == 0:
        return v.new_zeros(1, 0, H, V, dtype=out_dtype), (torch.cat(finals_out) if output_final_state else None)  # type: ignore[arg-type]
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

    live = [i for i, n in enumerate(n_chunks) if n]  # sequences with tokens; an empty one ends in its S0
    O, S_live = ChunkKDA.apply(*(chunked(t) for t in (q, k, v, g, beta)), S0[live][:, None],
                               starts=tuple(firsts[i] for i in live), scale=call.scale)
    for j, i in enumerate(live):
        finals_out[i] = S_live[j]
    o = O[:, 0].transpose(1, 2).reshape(NC * C, H, V).index_select(0, pos)[None].to(out_dtype)
    S_T = torch.cat(finals_out) if output_final_state else None  # type: ignore[arg-type]
    return o, S_T


@fp32_island
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
    """Gradient of :func:`kda_chunk`'s ``initial_state`` only, for output gradient ``d_o`` (and final-state gradient
    ``d_final``): the state path of the chunked backward (per-chunk ``P_n`` from ``d_o``, transitions ``M_n``, the
    reverse state pass), without the per-input gradients. KCP's backward step 1 (K3_SYSTEMS §7).

    Args:
        q, k, v, g, beta, scale, chunk_size: as in :func:`kda_chunk` (v only fixes V and the dtype: the gradient of
            the entering state does not depend on the values, nor on the entering state itself, the map being affine).
        d_o: ``[B, T, H, V]`` gradient of the outputs.
        d_final: ``[B, H, K, V]`` gradient of the final state, or None (zero).

    Returns:
        ``dS_in [B, H, K, V]`` fp32 (fp64 for fp64 inputs): equal to the ``initial_state`` gradient of the same
        :func:`kda_chunk` call. No graph.
    """
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, K, V = check_state_grad_inputs(q, k, v, g, beta, d_o, d_final)
    check_decay(g)
    scale = K ** -0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta)
    dS = k.new_zeros(B, H, K, V, dtype=dtype) if d_final is None else d_final.detach().to(dtype)
    if T == 0:
        return dS.clone()
    C = _chunk_len(T, chunk_size)
    with torch.no_grad():
        # each [N, B, H, C, *]
        q_c, k_c, g_c, beta_c, d_o_c = (_to_chunks(t.detach(), C, dtype) for t in (q, k, g, beta, d_o))
        return chunk_state_grad(q_c, k_c, g_c, beta_c, d_o_c, dS, scale=scale)


@fp32_island
def kda_transition(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
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
    chunk_size = check_chunk_size(chunk_size)
    B, T, H, K, V = check_inputs(None, k, v, g, beta, None)
    check_decay(g)
    dtype = compute_dtype(k, v, g, beta)
    if T == 0:
        eye = torch.eye(K, dtype=dtype, device=k.device).expand(B, H, K, K).clone()
        return eye, k.new_zeros(B, H, K, V, dtype=dtype)
    g, _ = clamp_log_decay(g.to(dtype))  # differentiable clamp (a change below the dtype's resolution)
    kc, vc, gc = (_to_chunks(t, chunk_size, dtype) for t in (k, v, g))  # [N, B, H, C, *]
    terms = chunk_terms(kc, vc, gc, _to_chunks(beta, chunk_size, dtype))
    M_c, E_c = chunk_transitions(terms)  # [N, B, H, K, K], [N, B, H, K, V]
    M, S = M_c[0], E_c[0]
    for n in range(1, M_c.shape[0]):
        M = M_c[n] @ M
        S = torch.baddbmm(E_c[n].view(B * H, K, V), M_c[n].view(B * H, K, K), S.reshape(B * H, K, V)).view(B, H, K, V)
    return M, S


__all__ = ["ChunkTerms", "check_chunk_size", "chunk_terms", "chunk_transitions", "kda_chunk", "kda_recurrent",
           "kda_state_grad", "kda_transition", "log_decay_floor", "sub_tile", "LOG_FLOOR", "MIN_LOG_DECAY",
           "SUB_TILE"]
