"""fla-compatible keyword options of :func:`moonrt.ops.kda.kda_chunk` and :func:`~moonrt.ops.kda.kda_recurrent`.

A user of fla's ``chunk_kda`` / ``fused_recurrent_kda`` switches by changing the import and passing options by
keyword: each option here is the same computation done on the inputs before the recurrence (or on the state
after it), in the compute dtype (fp32, fp64 for fp64 inputs), differentiable through autograd:

- grouped value heads (GVA): ``q, k [B, T, H, K]`` with ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
  ``beta [B, T, HV]``, states ``[N, HV, K, V]``, ``HV`` a multiple of ``H``; value head ``j`` reads query/key head
  ``j // (HV / H)`` (fla's convention: q and k repeated per head, ``repeat_interleave``);
- ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum x^2 + 1e-6)`` over K for q and k (K3_SYSTEMS §2.1);
- ``use_gate_in_kernel``: g is the raw gate input ``z``; with ``x = z + dt_bias`` (``dt_bias [HV * K]``, optional)
  the log-decay is ``-exp(A_log_h) softplus(x)`` (``A_log [HV]``), or with ``lower_bound`` (a negative float)
  ``lower_bound * sigmoid(exp(A_log_h) x)`` (K3's lower-bounded gate, §2.2; ``A_log`` optional there, 0 if None);
- ``use_beta_sigmoid_in_kernel``: ``beta = sigmoid(beta)``; with ``allow_neg_eigval`` ``2 sigmoid(beta)``
  (eigenvalues of ``I - beta k k^T`` down to -1; requires ``use_beta_sigmoid_in_kernel``, as fla);
- ``state_v_first``: ``initial_state`` and the final state in ``[N, HV, V, K]`` layout;
- ``safe_gate``: accepted for fla's signature; moonrt needs no safe range (any log-decay is exact), so it only
  enforces fla's rule that an in-kernel gate with ``safe_gate`` names its ``lower_bound``.

The output dtype follows q (fla's). A wrong option raises one TypeError / ValueError naming the argument and the
expected value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
"""Epsilon of the in-kernel q/k L2 normalization ``x / sqrt(sum x^2 + eps)``."""


@dataclasses.dataclass(frozen=True, slots=True)
class FlaOptions:
    """fla's keyword options (see the module docstring); all off by default."""

    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None
    safe_gate: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False

    def is_default(self) -> bool:
        """No option set (the plain contract: nothing to apply)."""
        flags = (self.use_qk_l2norm_in_kernel, self.use_gate_in_kernel, self.safe_gate,
                 self.use_beta_sigmoid_in_kernel, self.allow_neg_eigval, self.state_v_first)
        return all(f is False for f in flags) and self.A_log is None and self.dt_bias is None \
            and self.lower_bound is None


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} = {value!r}: expected a bool")


def _check_options(opt: FlaOptions, HV: int, K: int) -> None:
    for f in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "safe_gate", "use_beta_sigmoid_in_kernel",
              "allow_neg_eigval", "state_v_first"):
        _check_bool(f, getattr(opt, f))
    if opt.allow_neg_eigval and not opt.use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval = True: expected use_beta_sigmoid_in_kernel = True with it (it scales "
                         "the in-kernel sigmoid of beta to 2 sigmoid(beta))")
    if not opt.use_gate_in_kernel:
        for name in ("A_log", "dt_bias", "lower_bound"):
            if getattr(opt, name) is not None:
                raise ValueError(f"{name} given with use_gate_in_kernel = False: expected use_gate_in_kernel = True "
                                 f"(g is then the raw gate input) or no {name}")
        return
    lb = opt.lower_bound
    if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or not math.isfinite(lb)
                           or not lb < 0):
        raise ValueError(f"lower_bound = {lb!r}: expected a finite negative number (the log-decay floor of the "
                         "gate lower_bound * sigmoid(...))")
    if opt.safe_gate and lb is None:
        raise ValueError("lower_bound = None with safe_gate = True and use_gate_in_kernel = True: expected a "
                         "negative lower_bound (fla's rule)")
    if opt.A_log is None and lb is None:
        raise ValueError("A_log = None with use_gate_in_kernel = True: expected a tensor [HV] (the gate "
                         "-exp(A_log) softplus(g + dt_bias)), or a lower_bound")
    if opt.A_log is not None and (not isinstance(opt.A_log, torch.Tensor) or opt.A_log.numel() != HV):
        shape = tuple(opt.A_log.shape) if isinstance(opt.A_log, torch.Tensor) else type(opt.A_log).__name__
        raise ValueError(f"A_log.shape = {shape}: expected [HV] = [{HV}] (one per value head)")
    if opt.dt_bias is not None and (not isinstance(opt.dt_bias, torch.Tensor) or opt.dt_bias.numel() != HV * K):
        shape = tuple(opt.dt_bias.shape) if isinstance(opt.dt_bias, torch.Tensor) else type(opt.dt_bias).__name__
        raise ValueError(f"dt_bias.shape = {shape}: expected [HV * K] = [{HV * K}] (one per value head and key "
                         "channel)")


def check_options(opt: FlaOptions, HV: int, K: int) -> None:
    """The options' types and combinations (TypeError / ValueError naming the option), for ``HV`` value heads of
    key dimension ``K``: what :func:`apply_options` checks, for a backend that passes the options on (fla's)."""
    _check_options(opt, HV, K)


def check_gva_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> int:
    """Shapes of a GVA call (``v, g, beta`` with HV heads, ``q, k`` with H): returns ``HV // H``; one ValueError
    naming the argument and its expected shape otherwise."""
    if k.dim() != 4:
        raise ValueError(f"k.shape = {tuple(k.shape)}: expected [B, T, H, K] (4 dims)")
    B, T, H, K = k.shape
    if q.shape != k.shape:
        raise ValueError(f"q.shape = {tuple(q.shape)}: expected k's shape {tuple(k.shape)} [B, T, H, K]")
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % max(H, 1) or v.shape[2] < H:
        raise ValueError(f"v.shape = {tuple(v.shape)}: expected [B, T, HV, V] = [{B}, {T}, HV, V] with HV a "
                         f"multiple of H = {H}")
    HV = v.shape[2]
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g.shape = {tuple(g.shape)}: expected [B, T, HV, K] = [{B}, {T}, {HV}, {K}]")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta.shape = {tuple(beta.shape)}: expected [B, T, HV] = [{B}, {T}, {HV}]")
    return HV // H if H else 1


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(z: torch.Tensor, *, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """The in-kernel gate on ``z [B, T, HV, K]`` (module docstring), in z's dtype: ``-exp(A_log) softplus(z + dt_bias)``
    or ``lower_bound * sigmoid(exp(A_log) (z + dt_bias))``."""
    HV, K = z.shape[-2:]
    x = z if dt_bias is None else z + dt_bias.to(z.dtype).view(HV, K)
    a = None if A_log is None else A_log.to(z.dtype).view(HV, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(x if a is None else a * x)
    assert a is not None
    return -a * F.softplus(x)


def apply_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, opt: FlaOptions, dtype: torch.dtype,
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, Callable[[torch.Tensor | None],
                                                                                   torch.Tensor | None]]:
    """Inputs with the options applied (GVA expanded to ``HV`` query/key heads) in compute dtype ``dtype`` where an
    option computes on them, the entering state in ``[N, HV, K, V]`` layout, and the map of the final state back to
    the caller's layout. Shapes checked first (:func:`check_gva_shapes`)."""
    G = check_gva_shapes(q, k, v, g, beta)
    HV, K = g.shape[2], g.shape[3]
    _check_options(opt, HV, K)
    if opt.use_qk_l2norm_in_kernel:
        q, k = _l2norm(q.to(dtype)), _l2norm(k.to(dtype))
    if G > 1:
        q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    if opt.use_gate_in_kernel:
        g = kda_gate(g.to(dtype), A_log=opt.A_log, dt_bias=opt.dt_bias, lower_bound=opt.lower_bound)
    if opt.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(dtype))
        if opt.allow_neg_eigval:
            beta = 2.0 * beta
    if opt.state_v_first and initial_state is not None:
        if initial_state.dim() != 4 or initial_state.shape[1] != HV:
            raise ValueError(f"initial_state.shape = {tuple(initial_state.shape)}: expected [N, HV, V, K] with "
                             f"HV = {HV} (state_v_first = True)")
        initial_state = initial_state.transpose(-1, -2)

    def final(S: torch.Tensor | None) -> torch.Tensor | None:
        return S.transpose(-1, -2).contiguous() if opt.state_v_first and S is not None else S

    return (q, k, v, g, beta), initial_state, final
