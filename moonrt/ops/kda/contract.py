"""The input contract every KDA implementation shares (K3_SYSTEMS §2.1), checked in one place.

:func:`moonrt.ops.kda.kda_chunk` / ``kda_recurrent`` / ``kda_state_grad`` / ``kda_transition``, their Triton twins in
:mod:`moonrt.ops.kda.backends.triton` and context-parallel KDA (:func:`moonrt.comm.cp.kcp.kcp_kda`) take the same tensors:

- ``q, k [B, T, H, K]`` (q absent for the transition), ``v [B, T, H, V]``, ``g [B, T, H, K]`` per-token,
  per-channel log-decays (any value <= 0, ``-inf`` included; NaN refused), ``beta [B, T, H]``;
- ``initial_state [B, H, K, V]``, or ``[N, H, K, V]`` (one per sequence) with ``cu_seqlens``, fla's ``[N + 1]``
  non-decreasing integer offsets from 0 to T of N sequences packed along T (batch size 1);
- ``scale`` defaults to ``K ** -0.5``; the state arithmetic runs in :func:`compute_dtype` (fp32, fp64 for fp64
  inputs) and the output comes back in q's dtype (fla's);
- fla's keyword options (:mod:`moonrt.ops.kda.fla_options`) are applied to the inputs first (:func:`prepare_call`), so the
  checks see the plain contract (grouped value heads expanded).

A violation raises one ValueError naming the argument, its shape (or value) and the expected one. The ``*_error``
forms return that message instead (None when fine), for callers that must raise it on every rank (KCP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moonrt.ops.kda.fla_options import FlaOptions, apply_options

MIN_LOG_DECAY = float("-inf")
"""Smallest per-token log-decay the chunk form accepts: any (``-inf`` included, a full reset); only NaN is refused.
Kept as a name for callers that validate a gate bound against it (the model layer, KCP)."""

StateMap = Callable[[torch.Tensor | None], torch.Tensor | None]
"""Maps a final state from the kernels' layout back to the caller's (fla's ``state_v_first``)."""


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The state arithmetic's dtype: fp32, promoted by the inputs (fp64 for fp64 inputs)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def shape_error(name: str, t: torch.Tensor, expected: tuple[int, ...], dims: str, why: str = "") -> str | None:
    """``"{name}.shape = (...): expected [dims] = [...]{why}"`` when ``t``'s shape is not ``expected``, else None."""
    if t.shape == expected:
        return None
    return f"{name}.shape = {tuple(t.shape)}: expected [{dims}] = [{', '.join(map(str, expected))}]{why}"


def inputs_error(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None) -> str | None:
    """The first shape violation of the contract as a message naming the argument (None when fine)."""
    if k.dim() != 4:
        return f"k.shape = {tuple(k.shape)}: expected [B, T, H, K] (4 dims)"
    B, T, H, K = k.shape
    if q is not None and q.shape != k.shape:
        return f"q.shape = {tuple(q.shape)}: expected k's shape {tuple(k.shape)} [B, T, H, K]"
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        return f"v.shape = {tuple(v.shape)}: expected [B, T, H, V] = [{B}, {T}, {H}, V]"
    if g.shape != k.shape:
        return f"g.shape = {tuple(g.shape)}: expected k's shape {tuple(k.shape)} [B, T, H, K]"
    if beta.shape != (B, T, H):
        return f"beta.shape = {tuple(beta.shape)}: expected [B, T, H] = [{B}, {T}, {H}]"
    if initial_state is not None:
        return shape_error("initial_state", initial_state, (B, H, K, v.shape[-1]), "B, H, K, V")
    return None


def check_inputs(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Check the shapes (:func:`inputs_error`: ValueError naming the argument); return ``(B, T, H, K, V)``."""
    error = inputs_error(q, k, v, g, beta, initial_state)
    if error is not None:
        raise ValueError(error)
    B, T, H, K = k.shape
    return B, T, H, K, v.shape[-1]


def decay_error(g: torch.Tensor) -> str | None:
    """Any log-decay is accepted (``-inf`` too); NaN is refused, naming g (one host sync)."""
    if g.numel():
        lo = float(g.detach().min())
        if not lo >= MIN_LOG_DECAY:  # NaN
            return f"g.min() = {lo}: expected per-token log-decays <= 0, not NaN"
    return None


def check_decay(g: torch.Tensor) -> None:
    """:func:`decay_error` raised as ValueError."""
    error = decay_error(g)
    if error is not None:
        raise ValueError(error)


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
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


def check_sequence_states(initial_state: torch.Tensor | None, n_seq: int, H: int, K: int, V: int) -> None:
    """With ``cu_seqlens``: ``initial_state`` is None or ``[N, H, K, V]``, one state per sequence."""
    error = None if initial_state is None else shape_error(
        "initial_state", initial_state, (n_seq, H, K, V), "N, H, K, V", " (one state per sequence of cu_seqlens)")
    if error is not None:
        raise ValueError(error)


def check_state_grad_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            d_o: torch.Tensor, d_final: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """``kda_state_grad``'s arguments: the inputs (:func:`check_inputs`), ``d_o`` of v's shape and ``d_final`` None or
    ``[B, H, K, V]``; returns ``(B, T, H, K, V)``."""
    B, T, H, K, V = check_inputs(q, k, v, g, beta, None)
    if d_o.shape != v.shape:
        raise ValueError(f"d_o.shape = {tuple(d_o.shape)}: expected v's shape {tuple(v.shape)} [B, T, H, V]")
    error = None if d_final is None else shape_error("d_final", d_final, (B, H, K, V), "B, H, K, V")
    if error is not None:
        raise ValueError(error)
    return B, T, H, K, V


def _identity(S: torch.Tensor | None) -> torch.Tensor | None:
    return S


def apply_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None, opt: FlaOptions,
              ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, StateMap]:
    """fla's options applied to the inputs (:func:`moonrt.ops.kda.fla_options.apply_options`); the plain call (no option,
    as many value heads as query heads) passes through untouched."""
    plain = opt.is_default() and not (v.dim() == 4 and k.dim() == 4 and v.shape[2] != k.shape[2])
    if plain:
        return (q, k, v, g, beta), initial_state, _identity
    return apply_options(q, k, v, g, beta, initial_state, opt, compute_dtype(q, k, v, g, beta))


@dataclasses.dataclass(frozen=True, slots=True)
class KdaCall:
    """One ``kda_chunk`` / ``kda_recurrent`` call after fla's options and the shape checks (:func:`prepare_call`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    final: StateMap
    """The final state back in the caller's layout."""
    dims: tuple[int, int, int, int, int]
    """``(B, T, H, K, V)``, V and the heads after fla's options."""
    scale: float
    dtype: torch.dtype
    """The compute dtype (:func:`compute_dtype` of the five tensors)."""
    out_dtype: torch.dtype
    """The output's dtype: the caller's q's (fla's)."""

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta


def prepare_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 opt: FlaOptions, *, scale: float | None, initial_state: torch.Tensor | None,
                 per_sequence_state: bool = False) -> KdaCall:
    """fla's options applied (:func:`apply_fla`), the shapes checked (:func:`check_inputs`; the initial state too
    unless it is ``per_sequence_state``, one per sequence of ``cu_seqlens``, checked once the offsets are known), the
    default scale and the compute dtype resolved."""
    out_dtype = q.dtype
    (q, k, v, g, beta), initial_state, final = apply_fla(q, k, v, g, beta, initial_state, opt)
    dims = check_inputs(q, k, v, g, beta, None if per_sequence_state else initial_state)
    scale = dims[3] ** -0.5 if scale is None else scale
    return KdaCall(q, k, v, g, beta, initial_state, final, dims, scale, compute_dtype(q, k, v, g, beta), out_dtype)


__all__ = ["MIN_LOG_DECAY", "KdaCall", "StateMap", "apply_fla", "check_cu_seqlens", "check_decay", "check_inputs",
           "check_sequence_states", "check_state_grad_inputs", "compute_dtype", "decay_error", "inputs_error",
           "prepare_call", "shape_error"]
