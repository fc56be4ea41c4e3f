"""fla's ``chunk_kda`` as a KDA backend (``kernels.kda: fla``): the field's Triton kernels behind moonrt's contract.

fla-core (``pip install 'moonrt[fla]'``, or ``pip install fla-core``) is imported on the first call, never when this
module is imported; where it is missing the registry (:mod:`moonrt.ops.kernels`) says so in one line before this
module is loaded, and where its own imports fail (Triton missing) the first call does. Nothing of fla's math is
rewritten here: this module only maps :func:`moonrt.ops.kda.kda_chunk`'s contract (:mod:`moonrt.ops.kda.contract`)
onto ``fla.ops.kda.chunk_kda``'s, so the registry's callers (the attention context, the KDA layer) run it unchanged:

- the same tensors, shapes and fla keyword options, checked by moonrt's checks first (one ValueError naming the
  argument), then passed to fla as fla's own options (its fused gate, L2 norm, beta sigmoid, grouped value heads and
  ``state_v_first`` run inside fla's kernels);
- ``scale`` defaults to ``K ** -0.5`` (both); ``cu_seqlens`` is validated as moonrt does, then given to fla as int64
  on the tensors' device with a host copy (fla's ``cu_seqlens_cpu``, so fla needs no host synchronization of its own);
- the compute dtype is fp32: bf16/fp16 inputs are lifted to fp32 (moonrt's contract: the state arithmetic runs in
  fp32 and the output comes back in q's dtype), the initial state is given to fla in fp32 (fla requires it), the
  final state comes back fp32. fp64 inputs are refused in one line naming ``kernels.kda=torch`` (fla's kernels compute
  in fp32 at most; the contract promises fp64 arithmetic for fp64 inputs);
- per-token log-decays: any value <= 0 as in the contract (NaN refused). Without the in-kernel gate they are clamped
  at :data:`G_FLOOR` first: fla's chunk form turns a ``-inf`` into NaN, and ``exp(G_FLOOR)`` is 0 in fp32, so the clamp
  changes no decay factor (the clamped entries get a zero gradient, as in moonrt's own chunk form). ``safe_gate``
  promises fla that every log-decay lies in ``[lower_bound, 0)`` with ``lower_bound >= -5`` (fla's M=16 tensor-core
  path); a plain ``g`` below -5 with ``safe_gate`` is refused in one line instead of a silent wrong result;
- ``chunk_size`` is 32 or 64 (fla's choices; 64 by default, as moonrt's).

KCP's summaries (``kda_transition``, ``kda_state_grad``) have no fla form (fla's context parallelism is its own
``cp_context``): the registry has no fla backend for them, so ``kernels.kda: fla`` with ``parallel.cp > 1`` is refused
by the job config. fla's Triton kernels need CUDA; CPU tensors run only under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check this adapter without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from moonrt.ops.kda.contract import check_cu_seqlens, check_decay, compute_dtype, shape_error
from moonrt.ops.kda.fla_options import FlaOptions, check_gva_shapes, check_options
from moonrt.ops.kda.terms import check_chunk_size
from moonrt.ops.kernels import FLA_INSTALL, KernelUnavailable
from moonrt.ops.precision import fp32_island

FLA_CHUNKS = (32, 64)
"""Chunk sizes fla's ``chunk_kda`` accepts."""

G_FLOOR = -1000.0
"""Plain log-decays are clamped from below here before fla sees them: ``exp(-1000)`` is 0 in fp32 (a full reset, as
``-inf``), while fla's chunk form would turn ``-inf`` into NaN (``-inf - -inf`` in its in-chunk differences)."""

SAFE_GATE_FLOOR = -5.0
"""fla's safe range: with ``safe_gate`` every per-token log-decay lies in ``[-5, 0)`` (fla checks ``lower_bound`` in
``[-5, 0)`` for its in-kernel gate; for a plain ``g`` the caller promises it)."""


def _chunk_kda() -> Callable[..., Any]:
    """fla's ``chunk_kda``, imported on first use (KernelUnavailable, one line, when fla or its Triton is missing)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as exc:
        raise KernelUnavailable(f"kernels.kda = 'fla': fla's chunk_kda cannot be imported ({exc}): {FLA_INSTALL} "
                                f"(fla-core with Triton), or set kernels.kda: torch") from None
    return chunk_kda


def _check_device(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels.kda = 'fla': fla's Triton kernels run on CUDA tensors, got cpu tensors (or set "
                             "TRITON_INTERPRET=1 to run Triton's interpreter); expected kernels.kda: torch on CPU")


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
    """:func:`moonrt.ops.kda.kda_chunk`'s contract run by fla's ``chunk_kda`` (module docstring for the mapping).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log-decays (or the raw gate input with
            ``use_gate_in_kernel``); beta: ``[B, T, HV]``; fp32, bf16 or fp16 (computed in fp32; fp64 refused).
        scale, initial_state, output_final_state, cu_seqlens and fla's options: as in
            :func:`moonrt.ops.kda.kda_chunk`.
        chunk_size: 32 or 64 (fla's chunk sizes; ValueError naming it otherwise).

    Returns:
        ``o [B, T, HV, V]`` in q's dtype and the final state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
        ``state_v_first``) fp32, or None. Differentiable in q, k, v, g, beta, initial_state, A_log and dt_bias
        (fla's backward).
    """
    chunk_size = check_chunk_size(chunk_size)
    if chunk_size not in FLA_CHUNKS:
        raise ValueError(f"chunk_size = {chunk_size}: kernels.kda = 'fla' (fla's chunk_kda) expects one of "
                         f"{', '.join(map(str, FLA_CHUNKS))}")
    opt = FlaOptions(use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
                     use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first)
    check_gva_shapes(q, k, v, g, beta)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    check_options(opt, HV, K)
    dtype = compute_dtype(q, k, v, g, beta)
    if dtype != torch.float32:
        raise ValueError(f"q, k, v, g, beta compute in {dtype}: kernels.kda = 'fla' (fla's chunk_kda) computes in "
                         "fp32 at most; expected fp32/bf16/fp16 inputs, or kernels.kda: torch for fp64")
    if cu_seqlens is None:
        n_seq, cu = B, None
    else:
        cu = check_cu_seqlens(cu_seqlens, B, T)
        n_seq = len(cu) - 1
    if initial_state is not None:
        dims = (n_seq, HV, V, K) if state_v_first else (n_seq, HV, K, V)
        why = " (one state per sequence of cu_seqlens)" if cu is not None else ""
        error = shape_error("initial_state", initial_state, dims, "N, HV, V, K" if state_v_first else "N, HV, K, V",
                            why)
        if error is not None:
            raise ValueError(error)
    _check_device(q, k, v, g, beta, initial_state)
    check_decay(g)
    if not use_gate_in_kernel:
        if safe_gate and g.numel() and float(g.detach().min()) < SAFE_GATE_FLOOR:
            raise ValueError(f"g.min() = {float(g.detach().min())} with safe_gate = True: fla's safe gate expects "
                             f"log-decays in [{SAFE_GATE_FLOOR}, 0); expected safe_gate = False (any decay), or "
                             "kernels.kda: torch")
        g = g.clamp(min=G_FLOOR)
    if T == 0:  # nothing for fla's kernels to do: moonrt's empty result
        o = v.new_zeros(B, 0, HV, V, dtype=q.dtype)
        S = None
        if output_final_state:
            S = initial_state.float().clone() if initial_state is not None else v.new_zeros(
                n_seq, HV, *((V, K) if state_v_first else (K, V)), dtype=torch.float32)
        return o, S
    extra: dict[str, Any] = {}
    if cu is not None:
        extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int64, device=q.device),
                 "cu_seqlens_cpu": torch.tensor(cu, dtype=torch.int64)}
    if use_gate_in_kernel:
        extra |= {"A_log": None if A_log is None else A_log.float(), "dt_bias": None if dt_bias is None else
                  dt_bias.float()}
    o, S = _chunk_kda()(
        q=q.float(), k=k.float(), v=v.float(), g=g.float(), beta=beta.float(), scale=K ** -0.5 if scale is None else
        scale, initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first,
        chunk_size=chunk_size, **extra)
    return o.to(q.dtype), (S if output_final_state else None)


__all__ = ["FLA_CHUNKS", "G_FLOOR", "SAFE_GATE_FLOOR", "kda_chunk"]
