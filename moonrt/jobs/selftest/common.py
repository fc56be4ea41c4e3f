"""What every ``moonrt selftest`` suite shares: the per-rank result record, argument parsers, numerics.

A suite is a function ``run_suite(args, rank, world) -> SuiteResult`` called on every rank of the
job at once (it may use collectives on the default group). Its checks are this rank's verdicts,
named ``<suite>/<case>/<check>``; its rows are measurements, identical on every rank (each timed
value is the maximum over ranks); ``table`` is what rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

EPS32 = float(torch.finfo(torch.float32).eps)
"""fp32 unit roundoff scale (1.19e-7): tolerances below are ``c * EPS32`` with ``c`` from the computation."""


@dataclasses.dataclass(slots=True)
class SuiteResult:
    """One suite's outcome on one rank.

    ``checks``: check name -> ``{"ok": bool, ...details}`` (errors, tolerances, what differed).
    ``rows``: measurements (dicts of plain numbers/strings; identical on every rank).
    ``table``: the human-readable table (printed by rank 0). ``extra``: suite-specific report fields.
    """

    checks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    table: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        """Record check ``name`` (``ok`` and any details); returns ``ok``."""
        self.checks[name] = {"ok": bool(ok), **detail}
        return bool(ok)


def normwise_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` in float64 (``inf`` on a shape mismatch; 0/0 -> 0)."""
    if got.shape != ref.shape:
        return float("inf")
    if not got.numel():
        return 0.0
    diff = float((got.detach().double().cpu() - ref.detach().double().cpu()).abs().max())
    scale = float(ref.detach().double().abs().max())
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def close(result: SuiteResult, name: str, got: torch.Tensor | None, ref: torch.Tensor | None, tol: float) -> bool:
    """Record check ``name``: ``normwise_err(got, ref) <= tol`` (a missing tensor fails)."""
    if got is None or ref is None:
        return result.check(name, False, error="missing tensor", got=got is not None, ref=ref is not None)
    err = normwise_err(got, ref)
    return result.check(name, err <= tol, error=err, tol=tol)


def max_over_ranks(value: float) -> float:
    """``value`` maximised over the ranks of the default group (float64 all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(step: Callable[[], Any], iters: int) -> float:
    """Mean seconds of ``step()`` over ``iters`` calls after one warm-up, every rank starting together
    (barrier) and the slowest rank's time returned (max over ranks)."""
    import torch.distributed as dist

    dev = device()
    step()
    sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync(dev)
    return max_over_ranks((time.perf_counter() - t0) / iters)


def device() -> torch.device:
    """CUDA (the current device) under nccl, else CPU: where the suites put their tensors."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------------------------------------
# Argument parsers (argparse ``type=`` functions: a bad value is a one-line usage error, exit 2)


def byte_sizes(text: str) -> tuple[int, ...]:
    """``"4K,64K,1M"`` -> byte counts (K = 1024, M = 1024**2), each >= 4."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1:], 1)
        digits = part[:-1] if mult > 1 else part
        if not digits.isdigit() or int(digits) * mult < 4:
            raise argparse.ArgumentTypeError(f"size {part!r}: expected bytes >= 4, e.g. 65536 or 64K")
        out.append(int(digits) * mult)
    return tuple(out)


def positive_ints(text: str) -> tuple[int, ...]:
    """``"256,1024"`` -> positive integers."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 1, e.g. 256,1024")
    return tuple(int(p) for p in parts)


def nonneg_floats(text: str) -> tuple[float, ...]:
    """``"0,1,4,16"`` -> non-negative floats."""
    out = []
    for p in text.split(","):
        try:
            v = float(p)
        except ValueError:
            v = -1.0
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"{p.strip()!r} in {text!r}: expected numbers >= 0, e.g. 0,1,4,16")
        out.append(v)
    return tuple(out)
