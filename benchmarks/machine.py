"""What machine a benchmark ran on: printed next to every figure and stored in its JSON."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def wall_times(fn: Callable[[], object], repeats: int, device: str = "cpu") -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn()`` after one warm-up call; on ``cuda`` each is bracketed by
    ``torch.cuda.synchronize()`` so the kernels it queued are counted. Callers pick the statistic (the fastest run
    is the least disturbed on a shared machine; the median moves with the other jobs' load)."""
    sync = None
    if device == "cuda":
        import torch

        sync = torch.cuda.synchronize
    fn()
    out = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        out.append(time.perf_counter() - t0)
    return out
