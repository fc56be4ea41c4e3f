"""Mixed-precision islands: the code that keeps computing in fp32 (or wider) inside a bf16 autocast region.

A ``--dtype bf16`` job (:class:`moonrt.comm.parallelism.Precision`) runs every forward under
``torch.autocast(device_type, dtype=torch.bfloat16)``, torch's native AMP as torchtitan's FSDP2
``MixedPrecisionPolicy`` uses it without sharding: the parameters stay fp32 (they are the master weights), autocast
runs matmuls, linears and einsums in bf16 on bf16 copies of them and gradients land in fp32 on the fp32 parameters.

Some computations must not be rounded to bf16 (the numerics rule, K3_SYSTEMS §11): the KDA state chain, the
AttnRes softmax, the router's logits and top-k, the loss and the KCP state summaries. Each runs inside
:func:`fp32_island` (a decorator) or :func:`autocast_off` (a context): autocast is off on every device type, so an
op there runs in its inputs' dtype, and :func:`at_least_fp32` lifts the inputs to fp32 without ever narrowing a
wider dtype (an fp64 reference run stays fp64). Outside autocast both are no-ops on fp32 and fp64 tensors.

Backward: autograd runs each backward op in the dtype its forward op used, so an island's backward is fp32 too;
a custom ``autograd.Function`` whose backward may run under an autocast region (the pipeline part runs its
micro-batches' backwards inside it) has its backward decorated with :func:`fp32_island` as well, so the matmuls
there are not rounded either.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

DEVICE_TYPES = ("cpu", "cuda")
"""The device types whose autocast state :func:`autocast_off` turns off."""

F = TypeVar("F", bound=Callable[..., Any])


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``promote_types(x.dtype, float32)`` (bf16/fp16 -> fp32; fp32, fp64 and integer tensors unchanged)."""
    if not x.is_floating_point():
        return x
    return x.to(torch.promote_types(x.dtype, torch.float32))


def autocast_active() -> bool:
    """True inside an enabled autocast region of any of :data:`DEVICE_TYPES`."""
    return any(torch.is_autocast_enabled(d) for d in DEVICE_TYPES if d != "cuda" or torch.cuda.is_available())


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast disabled on every device type where it is enabled (ops run in their inputs' dtypes); restored
    on exit."""
    with contextlib.ExitStack() as stack:
        for d in DEVICE_TYPES:
            if (d != "cuda" or torch.cuda.is_available()) and torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(device_type=d, enabled=False))
        yield


def _lift(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return at_least_fp32(a)
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        return type(a)(_lift(t) for t in a)
    return a


def fp32_island(fn: F) -> F:
    """Decorate ``fn`` so that inside an autocast region it runs with autocast off and every floating tensor
    argument (also inside a list or tuple argument) lifted by :func:`at_least_fp32`; outside autocast it is ``fn``
    unchanged (the dtypes it is given are the dtypes it computes in, as without mixed precision)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not autocast_active():
            return fn(*args, **kwargs)
        with autocast_off():
            return fn(*(_lift(a) for a in args), **{k: _lift(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]


def no_autocast(fn: F) -> F:
    """Decorate ``fn`` to run with autocast off (:func:`autocast_off`), its arguments as given: for code that
    already chooses its dtypes explicitly (a custom autograd function's forward or backward that casts to fp32
    itself), which an enclosing autocast region would otherwise round to bf16 at every matmul."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not autocast_active():
            return fn(*args, **kwargs)
        with autocast_off():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@fp32_island
def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of ``logits [..., V]`` against ``targets [...]`` int64, skipping targets
    equal to -100 (torch's ``ignore_index``): a scalar in ``promote(logits.dtype, float32)``. The loss island: under
    autocast the (bf16) logits are lifted to fp32 first, so the log-softmax and the sum are fp32."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="sum")


__all__ = ["DEVICE_TYPES", "at_least_fp32", "autocast_active", "autocast_off", "fp32_island", "no_autocast",
           "token_loss_sum"]
