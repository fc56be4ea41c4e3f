"""KCP: context parallelism for Kimi Delta Attention, forward and backward (K3_SYSTEMS §2.4, §7).

The delta rule makes a segment's effect depend on the state entering it, but affinely: for a
contiguous segment ``S_end = M S_start + S_ext`` (``M [K, K]``, ``S_ext [K, V]`` per head, fp32).
A CP group of ``c`` ranks, rank ``r`` holding the contiguous slice ``r`` of the sequence
(:func:`moonrt.comm.cp.ops.split_sizes`), runs:

Forward
  1. ``(M_r, S_ext_r)`` of the local slice (one chunked pass, fp32). Rank 0 folds the user's
     initial state ``h0`` in: it publishes ``S_ext_0 + M_0 h0``.
  2. One all-gather of ``[S_ext | M]`` (``B x H x K x (V + K)`` fp32 per rank).
  3. Prefix merge ``S_in_r = M_{r-1} S_in_{r-1} + S_ext_{r-1}`` (``S_in_0 = h0`` or zero).
  4. The ordinary local chunked KDA from ``S_in_r``.

Backward (the transposed chain)
  1. ``a_r``: the gradient of the entering state from this slice's outputs alone (on the last rank
     with the user's final-state gradient): the state path only (``kda_state_grad``: per-chunk
     ``P_n`` and ``M_n`` recomputed, one reverse state pass; no input gradients).
  2. One all-gather of ``[a_r | M_r]``.
  3. Suffix merge: ``dS_out_r = dS_in_{r+1}`` with ``dS_in_j = M_j^T dS_out_j + a_j`` (the chain ends
     at the last rank, whose ``a`` already holds the final-state gradient).
  4. The ordinary local backward with output gradients and ``dS_out_r`` on the leaving state; it
     gives every input gradient, and on rank 0 ``dh0``.

Per KDA layer and rank this moves ``B * H * K * (K + V) * 4`` bytes in each pass, independent of
the sequence length. Both gathers go through a :class:`~moonrt.comm.cp.gather.SummaryGather` (``gather``: the
collectives' all-gather by default, or one-sided writes into a symmetric heap's slots, ``parallel.cp_transport``);
the result is bitwise the same. The local math is :mod:`moonrt.ops.kda` (``kda_chunk``, ``kda_transition``,
``kda_state_grad``): this runtime module reaches it through keyword seams ``chunk_fn`` /
``transition_fn`` / ``state_grad_fn`` whose default is the kernel registry's backend for the tensors' device
(:mod:`moonrt.ops.kernels`, the choice passed as ``kernel``), so a device kernel with the same contract runs
each piece (a ``chunk_fn`` without a ``state_grad_fn``: step 1 asks autograd).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moonrt.comm.cp.gather import CollectiveGather, SummaryGather
from moonrt.comm.cp.ops import (
    CommRecord,
    dtype_code,
    exchange_metadata,
    require_same,
    require_split,
)
from moonrt.ops.kda.contract import decay_error, inputs_error
from moonrt.ops.precision import fp32_island

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
TransitionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
StateGradFn = Callable[..., torch.Tensor]

_META = ("B", "T", "H", "K", "V", "dtype", "init", "final")


def _default_fns(kernel: str, device: torch.device) -> tuple[ChunkFn, TransitionFn, StateGradFn,
                                                             Callable[[object], int]]:
    """The ops layer's chunked KDA, its segment transition and its state-only gradient from the kernel registry
    (:mod:`moonrt.ops.kernels`: the backend ``kernel`` picks for ``device``), and the chunk-size check."""
    from moonrt.ops.kda import check_chunk_size
    from moonrt.ops.kernels import kernel as resolve

    return (resolve("kda_chunk", kernel, device), resolve("kda_transition", kernel, device),
            resolve("kda_state_grad", kernel, device), check_chunk_size)


class _KCP(torch.autograd.Function):
    """Autograd function of :func:`kcp_kda`; ``forward`` keeps the local graph for ``backward``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, h0: torch.Tensor | None, gather: SummaryGather, rank: int, size: int,
                scale: float, final: bool, chunk_size: int, chunk_fn: ChunkFn, transition_fn: TransitionFn,
                state_grad_fn: StateGradFn | None, record: CommRecord | None) -> tuple[torch.Tensor, torch.Tensor]:
        last = rank == size - 1
        with torch.no_grad():
            M, S_ext = transition_fn(k, v, g, beta, chunk_size=chunk_size)  # [B,H,K,K], [B,H,K,V] fp32
            if h0 is not None:
                S_ext = S_ext + M @ h0.to(M.dtype)
            payload = torch.cat([S_ext, M], dim=-1)  # [B, H, K, V + K]
            parts = gather.all_gather(payload)
            V = S_ext.shape[-1]
            if h0 is not None:
                S_in = h0.to(M.dtype)
            else:
                S_in = torch.zeros_like(S_ext)
                for j in range(rank):  # prefix merge (§7 step 3)
                    S_in = parts[j][..., V:] @ S_in + parts[j][..., :V]
        if record is not None:
            record.fwd_sent += payload.numel() * payload.element_size()
            record.fwd_recv += (size - 1) * payload.numel() * payload.element_size()

        needs = ctx.needs_input_grad[:6]
        ctx.meta = (gather, rank, size, record, V)
        ctx.local = (scale, chunk_size, state_grad_fn)
        if not any(needs):
            with torch.no_grad():
                o, S_out = chunk_fn(q, k, v, g, beta, scale=scale, initial_state=S_in,
                                    output_final_state=final and last, chunk_size=chunk_size)
            ctx.graph = None
            return o, (S_out if S_out is not None else o.new_zeros(0))
        # Keep the local graph (built on detached leaves) instead of recomputing it in backward.
        leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v, g, beta), needs[:5])]
        s_leaf = S_in.detach().requires_grad_(True)
        with torch.enable_grad():
            o, S_out = chunk_fn(*leaves, scale=scale, initial_state=s_leaf, output_final_state=True,
                                chunk_size=chunk_size)
        ctx.graph = (leaves, s_leaf, o, S_out)
        ctx.save_for_backward(M)
        ctx.has_h0 = h0 is not None
        return o.detach(), (S_out.detach() if final and last else o.new_zeros(0))

    @staticmethod
    @torch.autograd.function.once_differentiable
    @fp32_island  # its backward may run inside an autocast region (the pipeline's schedule): kept fp32
    def backward(ctx: Any, d_o: torch.Tensor, d_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gather, rank, size, record, V = ctx.meta
        if ctx.graph is None:
            raise RuntimeError("kcp_kda: backward called but no input required grad in forward")
        leaves, s_leaf, o, S_out = ctx.graph
        ctx.graph = None
        (M,) = ctx.saved_tensors
        last = rank == size - 1
        wrt = [t for t in leaves if t.requires_grad] + [s_leaf]
        outs, grads = [o], [d_o]
        if last and d_final.numel():
            outs.append(S_out)
            grads.append(d_final.to(S_out.dtype))
        # Step 1: a_r = dS_in from this slice's outputs (and, on the last rank, the user's final-state
        # gradient), no input gradients yet: the kernel's state-only backward, or (a chunk_fn without one)
        # autograd asked for the entering state only.
        scale, chunk_size, state_grad_fn = ctx.local
        if state_grad_fn is not None:
            with torch.no_grad():
                a = state_grad_fn(*leaves, d_o, d_final=grads[1] if len(grads) > 1 else None, scale=scale,
                                  chunk_size=chunk_size).to(M.dtype)
        else:
            (a,) = torch.autograd.grad(outs, [s_leaf], grads, retain_graph=True)
        # Step 2: one all-gather of [a | M].
        payload = torch.cat([a, M], dim=-1)
        parts = gather.all_gather(payload)
        if record is not None:
            record.bwd_sent += payload.numel() * payload.element_size()
            record.bwd_recv += (size - 1) * payload.numel() * payload.element_size()
        if not last:
            # Step 3: suffix merge for the gradient of the state leaving this slice.
            d_out = parts[size - 1][..., :V]
            for j in range(size - 2, rank, -1):
                d_out = parts[j][..., V:].transpose(-1, -2) @ d_out + parts[j][..., :V]
            outs, grads = [o, S_out], [d_o, d_out.to(S_out.dtype)]
        # Step 4: the ordinary local backward with the correct leaving-state gradient.
        total = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
        it = iter(total)
        result: list[torch.Tensor | None] = [next(it) if t.requires_grad else None for t in leaves]
        d_s = next(it)
        result.append(d_s if ctx.has_h0 and ctx.needs_input_grad[5] else None)
        return (*result, *(None,) * 10)


@fp32_island
def kcp_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    group: ProcessGroup | None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    record: CommRecord | None = None,
    chunk_fn: ChunkFn | None = None,
    transition_fn: TransitionFn | None = None,
    state_grad_fn: StateGradFn | None = None,
    kernel: str = "auto",
    gather: SummaryGather | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Context-parallel KDA over ``group`` (KCP, K3_SYSTEMS §7); the contract of ``kda_chunk`` per slice.

    Each rank of ``group`` passes its contiguous slice of one sequence (rank ``r`` owns tokens
    ``[r*T//c, (r+1)*T//c)``, :func:`moonrt.comm.cp.ops.split_sizes`):

    Args:
        q, k: ``[B, T_r, H, K]`` queries and keys of this slice (used as given).
        v: ``[B, T_r, H, V]`` values.
        g: ``[B, T_r, H, K]`` log-decay (<= 0, any magnitude; NaN refused).
        beta: ``[B, T_r, H]`` write strength.
        group: the CP process group (``None``: the default group).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before the sequence's first token, on CP rank 0
            only (other ranks pass None).
        output_final_state: return the state after the sequence's last token on the last CP rank.
        chunk_size: chunk length C of the local chunked form (checked as by ``moonrt.ops.kda.check_chunk_size``;
            a bad value raises ValueError on every rank).
        record: optional byte counter (:class:`moonrt.comm.cp.ops.CommRecord`).
        chunk_fn, transition_fn: local kernels with the contracts of ``moonrt.ops.kda.kda_chunk``
            and ``kda_transition`` (default: those).
        state_grad_fn: the entering-state gradient of ``chunk_fn`` alone (backward step 1), with the contract
            of ``moonrt.ops.kda.kda_state_grad``; default: that one with the default ``chunk_fn``, and for a
            custom ``chunk_fn`` without one, autograd through ``chunk_fn``'s graph asked for that gradient only.
        kernel: the backend of the default local kernels (``kernels.kda``: auto, torch, numba, triton;
            :mod:`moonrt.ops.kernels`; ``auto`` follows the device of ``k``).
        gather: what all-gathers the per-rank summaries over ``group`` (:mod:`moonrt.comm.cp.gather`; the same
            ranks in the same order); default: ``dist.all_gather`` over ``group``.

    Returns:
        ``o [B, T_r, H, V]`` in v's dtype (this slice's outputs), and ``S_T [B, H, K, V]`` fp32 on the
        last CP rank when ``output_final_state`` (None elsewhere). Differentiable in q, k, v, g, beta
        and ``initial_state``; gradients equal those of single-process ``kda_chunk`` on the whole
        sequence. Collective: every rank of ``group`` must call it; shapes, dtypes and slice lengths
        are checked first by one small metadata all-gather and a mismatch raises ``ValueError`` on
        every rank (no hang).
    """
    what = "kcp_kda"
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    default_chunk, default_transition, default_state_grad, check_chunk = _default_fns(kernel, k.device)
    if state_grad_fn is None and chunk_fn is None:
        state_grad_fn = default_state_grad
    chunk_fn = chunk_fn or default_chunk
    transition_fn = transition_fn or default_transition
    try:
        chunk_size, error = check_chunk(chunk_size), None
    except (TypeError, ValueError) as exc:  # raised on every rank by the metadata exchange (no hang)
        error = str(exc)
    error = error or _local_error(q, k, v, g, beta, initial_state, rank)
    values = None
    if error is None:
        B, T, H, K = k.shape
        values = [B, T, H, K, v.shape[-1], dtype_code(v.dtype), int(initial_state is not None),
                  int(output_final_state)]
    table = exchange_metadata(what, group, _META, values, error, device=v.device)
    for field, label in (("B", "batch size B"), ("H", "head count H"), ("K", "key dim K"), ("V", "value dim V"),
                         ("dtype", "dtype"), ("final", "output_final_state")):
        require_same(what, table, field, label)
    require_split(what, [row["T"] for row in table])
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    gather = gather if gather is not None else CollectiveGather(group)
    if (gather.rank, gather.world_size) != (rank, size):
        raise ValueError(f"gather: rank {gather.rank} of {gather.world_size}; expected rank {rank} of {size} (the "
                         "same ranks as group, in the same order)")
    o, final = _KCP.apply(q, k, v, g, beta, initial_state, gather, rank, size, scale, output_final_state,
                          chunk_size, chunk_fn, transition_fn, state_grad_fn, record)
    return o, (final if output_final_state and rank == size - 1 else None)


def _local_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, rank: int) -> str | None:
    """This rank's input problems as a message (None when fine); raised on every rank by the metadata exchange.
    The shapes and the log-decays are the ops' contract (:mod:`moonrt.ops.kda.contract`), checked here before the
    all-gather so that the other ranks do not wait in it."""
    error = inputs_error(q, k, v, g, beta, None)
    if error is not None:
        return error
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        return f"q, k, v dtypes = {q.dtype}, {k.dtype}, {v.dtype}: expected one dtype"
    bad = [(n, t.dtype) for n, t in zip("q k v g beta".split(), (q, k, v, g, beta)) if dtype_code(t.dtype) < 0]
    if bad:
        return f"{bad[0][0]}.dtype = {bad[0][1]}: expected a floating dtype (float32, bfloat16, float16, float64)"
    error = decay_error(g)
    if error is not None:
        return error
    if initial_state is not None and rank != 0:
        return "initial_state given on a CP rank other than 0: expected it on CP rank 0 only (the sequence start)"
    return inputs_error(None, k, v, g, beta, initial_state)
