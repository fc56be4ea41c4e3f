"""Muon (momentum orthogonalized by Newton-Schulz) with per-block orthogonalization: pure tensor math.

K3 report §2.7 (Per-Head Muon): orthogonalizing a whole Q/K/V projection lets the heads with large
gradients dominate the shared update direction, so K3 cuts those projections by head and
orthogonalizes each head's (tall, thin) matrix separately; experts are orthogonalized per expert.

One Muon step of a parameter ``W`` with gradient ``G`` (the arithmetic of ``torch.optim.Muon``)::

    B  <- lerp(B, G, 1 - mu)                  (momentum buffer, shape of W)
    U  <- lerp(G, B, mu) if nesterov else B
    O_k = NS5(U_k) for every block k of U     (quintic Newton-Schulz, per block)
    W  <- W * (1 - lr * wd)                   (decoupled weight decay)
    W_k <- W_k - adjust(lr, a, b) * O_k       (a x b: the block's shape)

A **blocking** says how a parameter ``[*S, A, B]`` is cut into independent ``[a, b]`` matrices:
``stack_dims`` leading dims are a stack (experts ``[E, out, in]``: one block per expert), and
``head_dim`` (optional) cuts matrix axis ``axis`` (0: rows, 1: columns) into heads of ``head_dim``.
With no blocking a parameter is one 2-D matrix (exactly ``torch.optim.Muon``). The learning-rate
adjustment uses the *block's* shape (``match_rms_adamw``: update RMS 0.2 per block, whatever the cut).

Newton-Schulz runs in ``ns_dtype`` (default fp32; ``torch.optim.Muon`` always uses bf16, which
``ns_dtype="bfloat16"`` reproduces bit for bit). Groups with ``use_muon=False`` are stepped with
torch's own AdamW arithmetic (``torch.optim.adam.adam`` with decoupled weight decay), so one
optimizer object holds Muon matrices and AdamW vectors/embeddings with one lr schedule and one
``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.optim.adam import adam

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Quintic Newton-Schulz coefficients of ``torch.optim.Muon`` (Keller Jordan's)."""
NS_EPS = 1e-7
"""Frobenius-norm floor of the normalisation before Newton-Schulz (``torch.optim.Muon``'s ``eps``)."""
NS_STEPS = 5
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
ADJUST_LR_FNS = ("original", "match_rms_adamw")


class Blocking(Protocol):
    """How a parameter is cut into independent matrices (``moonrt.parallel.blocks.MatrixBlocks`` is one)."""

    stack_dims: int
    head_dim: int | None
    axis: int


def block_grid(shape: torch.Size | tuple[int, ...], spec: Blocking | None) -> tuple[int, int, int, int]:
    """``(stack, heads, a, b)``: a ``shape`` tensor is ``stack * heads`` blocks of ``[a, b]``.

    ValueError when the shape does not fit the blocking (not 2-D after the stack, head_dim not dividing).
    """
    sd = spec.stack_dims if spec is not None else 0
    if len(shape) != sd + 2:
        raise ValueError(f"parameter shape {tuple(shape)}: expected {sd} stacked dims + 2 matrix dims for Muon")
    stack = math.prod(shape[:sd])
    a, b = shape[sd], shape[sd + 1]
    if spec is None or spec.head_dim is None:
        return stack, 1, a, b
    if spec.axis not in (0, 1):
        raise ValueError(f"blocking axis = {spec.axis}: expected 0 (rows) or 1 (columns)")
    dim = (a, b)[spec.axis]
    if spec.head_dim <= 0 or dim % spec.head_dim:
        raise ValueError(f"blocking head_dim = {spec.head_dim}: expected a positive divisor of matrix axis "
                         f"{spec.axis} of size {dim} (shape {tuple(shape)})")
    heads = dim // spec.head_dim
    return (stack, heads, spec.head_dim, b) if spec.axis == 0 else (stack, heads, a, spec.head_dim)


def block_view(t: torch.Tensor, spec: Blocking | None, k: int) -> torch.Tensor:
    """Block ``k`` (stack-major, then head) of ``t`` as an ``[a, b]`` view (writes go to ``t``)."""
    stack, heads, a, b = block_grid(t.shape, spec)
    sd = spec.stack_dims if spec is not None else 0
    m = t.reshape(stack, *t.shape[sd:])
    s, h = divmod(k, heads)
    if heads == 1:
        return m[s]
    return m[s, h * a:(h + 1) * a, :] if spec.axis == 0 else m[s, :, h * b:(h + 1) * b]


def to_blocks(t: torch.Tensor, spec: Blocking | None) -> torch.Tensor:
    """``t [*S, A, B]`` -> ``[N, a, b]`` (N = stack * heads); a view unless columns are split."""
    stack, heads, a, b = block_grid(t.shape, spec)
    if heads == 1 or spec.axis == 0:
        return t.reshape(stack * heads, a, b)
    return t.reshape(stack, a, heads, b).permute(0, 2, 1, 3).reshape(stack * heads, a, b)


def from_blocks(u: torch.Tensor, spec: Blocking | None, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: ``u [N, a, b]`` -> a tensor of ``shape``."""
    stack, heads, a, b = block_grid(shape, spec)
    if heads == 1 or spec.axis == 0:
        return u.reshape(shape)
    return u.reshape(stack, heads, a, b).permute(0, 2, 1, 3).reshape(shape)


def zeropower_via_newtonschulz(g: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                               steps: int = NS_STEPS, eps: float = NS_EPS,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximate orthogonalization ``U S' V^T`` of ``g [a, b]`` or of every ``g[i]`` of ``g [N, a, b]``.

    ``torch.optim.Muon``'s iteration: cast to ``dtype``, transpose tall matrices to wide, divide by the
    Frobenius norm (floored at ``eps``; per matrix), then ``steps`` times
    ``X <- a X + (b A + c A A) X`` with ``A = X X^T``; transpose back. Returns ``dtype``, ``g``'s shape.
    The 2-D path uses the same ``addmm`` calls as torch (bitwise equal to it in bf16).
    """
    if g.dim() not in (2, 3):
        raise ValueError(f"g shape {tuple(g.shape)}: expected [a, b] or [N, a, b]")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if g.dim() == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, a: int, b: int) -> float:
    """``torch.optim.Muon``'s update scale for an ``[a, b]`` matrix.

    ``original`` (or None): ``lr * sqrt(max(1, a / b))``; ``match_rms_adamw`` (Moonlight): ``0.2 * lr *
    sqrt(max(a, b))``, which gives the update the RMS of a typical AdamW update so AdamW's lr and
    weight decay can be reused.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r}: expected one of {', '.join(ADJUST_LR_FNS)}")


def step_count(value: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An optimizer's per-parameter step count as torch's optimizers keep it without ``capturable``/``fused``: a
    0-dim tensor on the host, whatever device the parameter is on (the update reads it as a number, and
    ``Optimizer.load_state_dict`` leaves ``step`` on the host). ``dtype``: torch's scalar dtype by default (fp32, fp64
    under an fp64 default dtype)."""
    from torch.optim.optimizer import _get_scalar_dtype

    return torch.tensor(float(value), dtype=dtype or _get_scalar_dtype(), device="cpu")


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update ``buf`` in place (``lerp(buf, grad, 1 - momentum)``) and return the direction to orthogonalize."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def ns_flops(a: int, b: int, steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of :func:`zeropower_via_newtonschulz` on one ``[a, b]`` matrix.

    With ``m = min(a, b)``, ``n = max(a, b)`` per step: ``X X^T`` (2 m^2 n), ``A A`` (2 m^3), ``B X`` (2 m^2 n).
    """
    m, n = min(a, b), max(a, b)
    return steps * (4 * m * m * n + 2 * m ** 3)


class Muon(torch.optim.Optimizer):
    """Muon over blocks of each parameter, plus AdamW groups (see the module docstring).

    Args:
        params: parameters or param groups; a group with ``use_muon=False`` is AdamW (``betas``,
            ``adamw_eps``, ``weight_decay``, ``lr``).
        blocks: parameter -> its :class:`Blocking` (absent: one 2-D matrix).
        ns_dtype: ``"float32"`` (default), ``"bfloat16"`` (torch.optim.Muon's choice; GPU) or ``"float64"``.
    Other arguments are ``torch.optim.Muon``'s, with its defaults.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = NS_EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None,
                 ns_dtype: str = "float32", betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 blocks: Mapping[torch.Tensor, Blocking | None] | None = None) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr = {lr}, momentum = {momentum}, weight_decay = {weight_decay}: expected all >= 0")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r}: expected one of {', '.join(ADJUST_LR_FNS)}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype = {ns_dtype!r}: expected one of {', '.join(NS_DTYPES)}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype, "use_muon": True, "betas": tuple(betas),
                    "adamw_eps": adamw_eps}
        super().__init__(params, defaults)
        self.blocks: dict[int, Blocking | None] = {id(p): s for p, s in (blocks or {}).items()}
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    block_grid(p.shape, self.blocks.get(id(p)))  # fails now, not at step 1

    def blocking(self, p: torch.Tensor) -> Blocking | None:
        """The blocking of parameter ``p`` (None: one whole matrix)."""
        return self.blocks.get(id(p))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_param(p, group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_param(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        update = momentum_update(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"])
        spec = self.blocking(p)
        stack, heads, a, b = block_grid(p.shape, spec)
        u = to_blocks(update, spec)
        kw = {"coefficients": group["ns_coefficients"], "steps": group["ns_steps"], "eps": group["eps"],
              "dtype": NS_DTYPES[group["ns_dtype"]]}
        o = zeropower_via_newtonschulz(u[0], **kw).unsqueeze(0) if u.shape[0] == 1 else \
            zeropower_via_newtonschulz(u, **kw)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(from_blocks(o, spec, p.shape), alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], a, b))

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = step_count()
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, group)


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], group: Mapping[str, Any]) -> None:
    """``torch.optim.AdamW``'s update (its functional ``adam`` with decoupled weight decay) of a Muon AdamW group."""
    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, decoupled_weight_decay=True,
         amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
         eps=group["adamw_eps"], maximize=False)
