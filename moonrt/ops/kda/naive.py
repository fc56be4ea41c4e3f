"""The KDA token recurrence (K3_SYSTEMS §2.1): the reference every KDA backend is tested against.

Per head, state ``S`` of shape K x V, "decay, then delta correction, then read"::

    S <- Diag(alpha_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)

One token at a time in plain torch (differentiable through autograd), with fla's ``fused_recurrent_kda`` contract
(:mod:`moonrt.ops.kda.contract`, :mod:`moonrt.ops.kda.fla_options`).
"""

from __future__ import annotations

import torch

from moonrt.ops.kda.contract import prepare_call
from moonrt.ops.kda.fla_options import FlaOptions
from moonrt.ops.precision import fp32_island


@fp32_island
def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
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
    """Token-by-token KDA (K3_SYSTEMS §2.1), the reference. Differentiable through autograd.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (used as given).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` log-decay, <= 0 (any magnitude).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before token 0 (zeros if None).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first: fla's options (all off by default), applied as
            the same computation on the inputs / states (:mod:`moonrt.ops.kda.fla_options`); with grouped value heads
            (``v, g, beta, initial_state`` with ``HV`` heads, a multiple of q and k's ``H``) o and the states have
            ``HV`` heads.

    Returns:
        ``o [B, T, H, V]`` in q's dtype, and ``S_T [B, H, K, V]`` fp32 (fp64 for fp64 inputs) or None.
    """
    call = prepare_call(q, k, v, g, beta, FlaOptions(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first), scale=scale, initial_state=initial_state)
    B, T, H, K, V = call.dims
    scale, dtype = call.scale, call.dtype
    q, k, v, g, beta = (t.to(dtype) for t in call.tensors)
    S = k.new_zeros(B, H, K, V) if call.initial_state is None else call.initial_state.to(dtype)
    outs = []
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t, :, None]  # [B, H, K], [B, H, 1]
        S = S * g[:, t, :, :, None].exp()  # decay rows
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)  # v - S^T k with the decayed state
        S = S + (b_t * k_t)[..., None] * err[:, :, None, :]  # delta correction
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))  # read
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(call.out_dtype), call.final(S) if output_final_state else None
